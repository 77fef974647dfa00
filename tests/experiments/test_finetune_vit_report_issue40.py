"""experiments/finetune-vit/report.py (issue 40): AUTO-S runs (dp-sgd with clipping "auto") are their own entry,
``dp-sgd-auto``, in the validation choice, the generated test config (which keeps ``clipping = "auto"`` and, with
``scratch=False``, only full fine-tunes) and the table; a label merging them with flat-clipping DP-SGD would average
two different methods."""

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


def _row(tmp: Path, name: str, clipping: str, lr: float, val: float, test: float, seed: int = 0) -> dict:
    run = tmp / name
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"init_from": "public.pt"}))  # a full fine-tune
    return {
        "method": "dp-sgd",
        "clipping": clipping,
        "lr": lr,
        "val_accuracy": val,
        "test_accuracy": test,
        "epsilon": 7.998,
        "noise_multiplier": 0.518,
        "target_epsilon": 8.0,
        "steps": 36,
        "wall_seconds": 36.0,
        "num_parameters": 10,
        "seed": seed,
        "run_dir": str(run),
        "point": {"lr": lr, "target_epsilon": 8.0},
    }


def test_select_config_and_report_keep_auto_clipping_apart(tmp_path):
    mod = _report_module()
    tune = [
        _row(tmp_path, "a", "flat", 1.0, 0.52, 0.51),
        _row(tmp_path, "b", "flat", 3.0, 0.44, 0.43),
        _row(tmp_path, "c", "auto", 1.0, 0.40, 0.41),
        _row(tmp_path, "d", "auto", 3.0, 0.50, 0.49),
    ]
    (tmp_path / "tune.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tune))
    cfg = tmp_path / "test.toml"
    best = mod.select(str(tmp_path / "tune.jsonl"), str(cfg), None, scratch=False)
    assert {k: r["lr"] for k, r in best.items()} == {("dp-sgd", 8.0): 1.0, ("dp-sgd-auto", 8.0): 3.0}
    sweep = load_sweep(cfg)  # a valid sweep: auto clipping only where it was tuned, seeds 1, 2, no scratch runs
    got = {
        (p.label, p.options.get("clipping", "flat"), p.options["lr"], p.options["seed"], "init_from" in p.options)
        for p in sweep.points
    }
    assert got == {
        ("dp-sgd/full", "flat", 1.0, 1, True),
        ("dp-sgd/full", "flat", 1.0, 2, True),
        ("dp-sgd-auto/full", "auto", 3.0, 1, True),
        ("dp-sgd-auto/full", "auto", 3.0, 2, True),
    }
    test = [_row(tmp_path, "e", "auto", 3.0, 0.0, 0.53, seed=1), _row(tmp_path, "f", "flat", 1.0, 0.0, 0.55, seed=1)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    out = mod.report([str(tmp_path / "test.jsonl")], str(tmp_path / "tune.jsonl"), str(tmp_path), suffix="-x")
    assert out["dp-sgd-auto/full"]["eps8"]["test_accuracy"] == [0.49, 0.53]  # seed-0 tuning run + seed-1 run
    assert out["dp-sgd/full"]["eps8"]["test_accuracy"] == [0.51, 0.55]
    assert (tmp_path / "table-x.md").exists() and (tmp_path / "table-x.json").exists()
