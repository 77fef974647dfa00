"""experiments/finetune-vit/report.py (issue 38): a method re-run after a library fix (the Muon routing fix, commit
d97a7eb) supersedes its earlier rows in the lr choice and in the generated test config; other methods keep theirs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from dpopt.experiments.sweep import load_sweep

_SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "finetune-vit" / "report.py"


def _report_module():
    spec = importlib.util.spec_from_file_location("finetune_vit_report", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(method, lr, val, eps=8.0):
    return {
        "method": method,
        "lr": lr,
        "val_accuracy": val,
        "noise_multiplier": 0.5,
        "epsilon": eps,
        "point": {"target_epsilon": eps},
    }


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_rerun_rows_supersede_the_method_and_only_it(tmp_path):
    mod = _report_module()
    old = _write(
        tmp_path / "old.jsonl",
        [
            _row("dp-adam", 1e-3, 0.47),
            _row("dp-adam", 1e-2, 0.40),
            _row("dp-muon", 0.03, 0.46),
            _row("dp-muon", 0.1, 0.3),
        ],
    )
    # the re-run's best dp-muon lr differs from the old one; an old dp-muon row would win if it were not dropped
    new = _write(tmp_path / "new.jsonl", [_row("dp-muon", 0.01, 0.45), _row("dp-muon", 0.003, 0.2)])
    rows = mod._load([old], [new])
    assert sorted((r["method"], r["lr"]) for r in rows) == [
        ("dp-adam", 1e-3),
        ("dp-adam", 1e-2),
        ("dp-muon", 0.003),
        ("dp-muon", 0.01),
    ]
    config = tmp_path / "finetune-vit-muon-rerun-test.toml"
    best = mod.select(old, str(config), None, [new], [1, 2, 3])
    assert best[("dp-muon", 8.0)]["lr"] == 0.01 and best[("dp-adam", 8.0)]["lr"] == 1e-3
    # the generated config holds only the re-run method: 3 fine-tune seeds + 1 from-scratch run, all at the new lr
    points = load_sweep(config).points
    got = [(p.options["method"], p.options["lr"], p.options["seed"], p.options.get("init_from")) for p in points]
    public = "runs/finetune-vit/public/model.pt"
    assert got == [("dp-muon", 0.01, 1, public), ("dp-muon", 0.01, 2, public), ("dp-muon", 0.01, 3, public)] + [
        ("dp-muon", 0.01, 0, None)
    ]


def test_without_rerun_every_row_counts(tmp_path):
    mod = _report_module()
    old = _write(tmp_path / "old.jsonl", [_row("dp-muon", 0.03, 0.46), _row("dp-muon", 0.1, 0.5)])
    assert mod._load([old], []) == [json.loads(x) for x in Path(old).read_text().splitlines()]
    assert mod.select(old, None, None)[("dp-muon", 8.0)]["lr"] == 0.1
