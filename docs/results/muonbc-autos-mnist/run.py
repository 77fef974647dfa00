"""DP-MuonBC and automatic clipping (AUTO-S) on MNIST (issue 40): tune on validation, then 2 seeds.

Stage 1 (tuning): every configuration of GRID at seed 0, 10 % of the training records held out
(validation_fraction 0.1), for each target ε. Stage 2: per (entry, ε) the configuration with the
best validation accuracy is rerun at seed 1. The table (summarize.py) reports the test accuracy of
the chosen configuration, mean over seeds {0, 1}. Same pipeline as ``dpopt train`` (build_run →
run_steps → write_results), one thread. Resumable: a run with a ``summary.json`` is skipped.

    python docs/results/muonbc-autos-mnist/run.py RUNS_DIR --data-dir DIR   # DIR holds mnist.npz
    python docs/results/muonbc-autos-mnist/summarize.py RUNS_DIR docs/results/muonbc-autos-mnist/results.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from dpopt.data import load_dataset
from dpopt.training import TrainConfig
from dpopt.training.build import build_run
from dpopt.training.loop import run_steps
from dpopt.training.results import run_directory, write_config, write_results

#: entry → (method, clipping, {hyperparameter: values}); lr and max_grad_norm are TrainConfig fields.
GRID = {
    "dp-sgd": ("dp-sgd", "flat", {"lr": [0.5, 1.0, 2.0], "max_grad_norm": [0.1, 1.0]}),
    "dp-sgd-auto": ("dp-sgd", "auto", {"lr": [0.5, 1.0, 2.0]}),  # C = 1, γ = 0.01 (no C to tune)
    "dp-adam": ("dp-adam", "flat", {"lr": [1e-3, 3e-3]}),
    "dp-muon": ("dp-muon", "flat", {"lr": [0.01, 0.02]}),
    "dp-muon-bc": ("dp-muon-bc", "flat", {"lr": [0.01, 0.02]}),
}
EPSILONS = (1.0, 8.0)
#: ε = 8: a smaller grid (CPU time; see README): the Muon methods at DP-Muon's ε = 1 choice only.
GRID_EPS8 = {
    "dp-sgd": {"lr": [1.0, 2.0], "max_grad_norm": [0.1, 1.0]},
    "dp-sgd-auto": {"lr": [1.0, 2.0]},
    "dp-adam": {"lr": [1e-3, 3e-3]},
    "dp-muon": {"lr": [0.02]},
    "dp-muon-bc": {"lr": [0.02]},
}
BATCH = 256.0
EPOCHS = 1.0


def configs(entry, eps):
    method, clipping, grid = GRID[entry]
    grid = GRID_EPS8[entry] if eps == 8.0 else grid
    keys = sorted(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        yield method, clipping, dict(zip(keys, values))


def name(entry, eps, hp, seed):
    tag = "-".join(f"{k}{v:g}" for k, v in sorted(hp.items()))
    return f"{entry}-eps{eps:g}-{tag}-s{seed}"


def run_one(runs: Path, data, data_dir, entry, method, clipping, hp, eps, seed):
    out = runs / name(entry, eps, hp, seed)
    if (out / "summary.json").exists():
        return json.loads((out / "summary.json").read_text())
    claim = runs / "claims" / out.name  # two processes may share RUNS_DIR: each run is claimed once
    claim.parent.mkdir(parents=True, exist_ok=True)
    try:
        claim.touch(exist_ok=False)
    except FileExistsError:
        return None
    cfg = TrainConfig(dataset="mnist", data_dir=data_dir, method=method, batch_size=BATCH, epochs=EPOCHS,
                      target_epsilon=eps, seed=seed, out=str(out), overwrite=True, validation_fraction=0.1,
                      clipping=clipping, lr=hp["lr"], max_grad_norm=hp.get("max_grad_norm"))
    start = time.perf_counter()
    run = build_run(cfg, data)
    run_dir = run_directory(cfg)
    write_config(run_dir, run)
    summary = write_results(run_dir, run, run_steps(run), start)
    print(json.dumps({"run": out.name, **{k: summary.get(k) for k in ("val_accuracy", "test_accuracy", "epsilon",
                                                                       "steps", "wall_seconds")}}), flush=True)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs")
    ap.add_argument("--data-dir", required=True, help="directory with mnist.npz")
    ap.add_argument("--entries", default=",".join(GRID))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--epsilons", default=",".join(f"{e:g}" for e in EPSILONS))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    runs = Path(a.runs)
    data = load_dataset("mnist", a.data_dir)
    entries = a.entries.split(",")
    best = {}
    for eps in map(float, a.epsilons.split(",")):  # stage 1: tune at seed 0
        for entry in entries:
            scored = []
            for method, clipping, hp in configs(entry, eps):
                s = run_one(runs, data, a.data_dir, entry, method, clipping, hp, eps, 0)
                if s is not None:  # None: claimed by another process (rerun this script to finish it)
                    scored.append((s["val_accuracy"], hp, method, clipping))
            if scored:
                best[(entry, eps)] = max(scored, key=lambda t: t[0])
    for (entry, eps), (_, hp, method, clipping) in best.items():  # stage 2: the chosen config at seed 1
        run_one(runs, data, a.data_dir, entry, method, clipping, hp, eps, 1)


if __name__ == "__main__":
    main()
