"""experiments/finetune-mnist/report.py (issues 21, 40): the validation choice per (entry, start, ε), the generated
test config, and the table's rows. AUTO-S runs (dp-sgd with clipping "auto") are their own entry, ``dp-sgd-auto``:
a label that merged them with flat-clipping DP-SGD would average two different methods."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from dpopt.experiments.sweep import load_sweep

_SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "finetune-mnist" / "report.py"


def _report_module():
    spec = importlib.util.spec_from_file_location("finetune_mnist_report", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(label, clipping, lr, val, test, seed=0):
    point = {"label": label, "lr": lr, "init_from": "public.pt"}
    return {
        "label": label,
        "method": "dp-sgd",
        "clipping": clipping,
        "lr": lr,
        "val_accuracy": val,
        "test_accuracy": test,
        "epsilon": 0.9996,
        "noise_multiplier": 0.96,
        "target_epsilon": 1.0,
        "steps": 207,
        "wall_seconds": 20.7,
        "num_parameters": 10,
        "seed": seed,
        "run_dir": "does-not-exist",
        "point": point,
    }


def test_select_and_report_keep_auto_clipping_apart(tmp_path):
    mod = _report_module()
    tune = [
        _row("dp-sgd/full", "flat", 1.0, 0.95, 0.947),
        _row("dp-sgd/full", "flat", 3.0, 0.91, 0.91),
        _row("dp-sgd-auto/full", "auto", 1.0, 0.90, 0.90),
        _row("dp-sgd-auto/full", "auto", 3.0, 0.94, 0.93),
    ]
    (tmp_path / "tune.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tune))
    cfg = tmp_path / "test.toml"
    best = mod.select([str(tmp_path / "tune.jsonl")], str(cfg), None, [1])
    assert {k: r["lr"] for k, r in best.items()} == {("dp-sgd/full", 1.0): 1.0, ("dp-sgd-auto/full", 1.0): 3.0}
    sweep = load_sweep(cfg)  # the generated config is a valid sweep: auto clipping only where it was tuned
    got = {(p.label, p.options.get("clipping", "flat"), p.options["lr"], p.options["seed"]) for p in sweep.points}
    assert got == {("dp-sgd/full", "flat", 1.0, 1), ("dp-sgd-auto/full", "auto", 3.0, 1)}
    test = [_row("x", "auto", 3.0, 0.0, 0.95, seed=1), _row("x", "flat", 1.0, 0.0, 0.949, seed=1)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in test))
    out = mod.report([str(tmp_path / "test.jsonl")], None, None, [str(tmp_path / "tune.jsonl")])
    assert out["dp-sgd-auto/full"]["eps1"]["test_accuracy"] == [0.93, 0.95]  # seed-0 tuning run + seed-1 test run
    assert out["dp-sgd/full"]["eps1"]["test_accuracy"] == [0.947, 0.949]
