"""Independent vs banded vs BLT noise on CIFAR-10 CNN5 (issue 36's experiment, CPU-reduced).

The CIFAR-10 half of issue 36's grid, cut to what one CPU-hour allows (README.md says what and why):

* data (fixed and public, the same for every run, as ``recipe-cifar10/``): training = the first
  ``N_TRAIN`` = 10,000 records of CIFAR-10's training set, of which 10 % (1,000, a fixed public
  permutation: ``validation_fraction`` 0.1) are held out for validation → 9,000 trained on;
  evaluation = 11,000 images never trained on (training records 40,000–49,999 plus the 1,000
  official test images that ``cifar10.npz`` holds); the summary's ``test_accuracy`` is on them;
* ``cnn5`` (GroupNorm, 0.58 M parameters), B̄ = 256, C = 1, δ = 1e-5, σ calibrated for the target
  ε by the PLD accountant, secret noise (the seed fixes the initialisation only);
* per cell (epochs, ε, method, mechanism): every lr of ``LR_GRID[method]`` at seed 0, then the lr with
  the best validation accuracy (ties: the larger) at seeds 1 .. S−1. The selection is not charged to ε.

Same pipeline as ``dpopt train`` (build_run → run_steps → write_results), one thread. Resumable: a run
whose directory holds ``summary.json`` is skipped; every finished run appends one JSON line to
``RUNS/results.jsonl`` (its public summary, the driver's CPU seconds and ``check_run``'s verdict, which
re-scores the run directory from its files as ``dpopt check`` does).

    python docs/results/dpmf-cifar10/run.py RUNS --data-dir DIR --epochs 1 --methods dp-sgd,dp-adam
    python docs/results/dpmf-cifar10/run.py RUNS --data-dir DIR --one dp-sgd,independent,8,1,0.5,0  # time one run
    python docs/results/dpmf-cifar10/summarize.py RUNS docs/results/dpmf-cifar10
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dpopt.accounting.ledger_check import check_run
from dpopt.allocator import tune_cpu_allocator
from dpopt.data import Dataset, load_dataset
from dpopt.training import TrainConfig
from dpopt.training.build import build_run
from dpopt.training.loop import run_steps
from dpopt.training.results import run_directory, write_config, write_results

MECHANISMS = ("independent", "banded:4", "blt")
METHODS = ("dp-sgd", "dp-adam", "dp-macadam", "dp-muon")
EPSILONS = (1.0, 8.0)
#: method → learning rates tried at seed 0 (chosen on the validation split).
LR_GRID = {
    "dp-sgd": [0.5, 2.0],
    "dp-adam": [1e-3, 3e-3],
    "dp-macadam": [1e-3, 3e-3],
    "dp-muon": [0.02, 0.05],
}
N_TRAIN, HELD_OUT_FROM = 10_000, 40_000
BATCH = 256.0
PHYSICAL = 256


def cifar_subset(data_dir: str) -> Dataset:
    """Training: the first N_TRAIN training records; evaluation: training records HELD_OUT_FROM.. + the test set."""
    full = load_dataset("cifar10", data_dir)
    x_eval = torch.cat([full.x_train[HELD_OUT_FROM:], full.x_test])
    y_eval = torch.cat([full.y_train[HELD_OUT_FROM:], full.y_test])
    return Dataset("cifar10", full.x_train[:N_TRAIN], full.y_train[:N_TRAIN], x_eval, y_eval)


def run_name(epochs: float, eps: float, method: str, mech: str, lr: float, seed: int) -> str:
    return f"cifar10-ep{epochs:g}-eps{eps:g}-{method}-{mech.replace(':', '')}-lr{lr:g}-s{seed}"


def run_one(runs: Path, data: Dataset, data_dir: str, epochs, eps, method, mech, lr, seed) -> dict:
    out = runs / run_name(epochs, eps, method, mech, lr, seed)
    if (out / "summary.json").exists():
        return json.loads((out / "summary.json").read_text())
    cfg = TrainConfig(
        dataset="cifar10",
        data_dir=data_dir,
        model="cnn5",
        method=method,
        batch_size=BATCH,
        physical_batch_size=PHYSICAL,
        epochs=epochs,
        target_epsilon=eps,
        seed=seed,
        out=str(out),
        overwrite=True,
        validation_fraction=0.1,
        lr=lr,
        noise_mechanism=mech,
        checkpoint_every=0,
    )
    start, cpu0 = time.perf_counter(), time.process_time()
    run = build_run(cfg, data)
    run_dir = run_directory(cfg)
    write_config(run_dir, run)
    summary = write_results(run_dir, run, run_steps(run), start)
    check = check_run(run_dir)
    driver = {"cpu_seconds": time.process_time() - cpu0, "check_run": "pass" if check.passed else "FAIL"}
    (run_dir / "driver.json").write_text(json.dumps(driver))
    keys = ("noise_multiplier", "val_accuracy", "test_accuracy", "epsilon", "steps", "wall_seconds", "check")
    line = {"run": out.name, "method": method, "mechanism": mech, "epochs": epochs, "target_epsilon": eps}
    line |= {"lr": lr, "seed": seed, **{k: summary.get(k) for k in keys}, **driver}
    with open(runs / "results.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    print(json.dumps(line), flush=True)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs")
    ap.add_argument("--data-dir", required=True, help="directory with cifar10.npz")
    ap.add_argument("--epochs", default="1")
    ap.add_argument("--epsilons", default=",".join(f"{e:g}" for e in EPSILONS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--mechanisms", default=",".join(MECHANISMS))
    ap.add_argument("--seeds", type=int, default=2, help="seeds 1..S-1 rerun at the chosen lr (seed 0 tunes)")
    ap.add_argument("--one", default=None, help="METHOD,MECH,EPS,EPOCHS,LR,SEED: this one run only")
    a = ap.parse_args()
    torch.set_num_threads(1)
    tune_cpu_allocator()  # as `dpopt train` does on start (no value changes)
    runs = Path(a.runs)
    runs.mkdir(parents=True, exist_ok=True)
    data = cifar_subset(a.data_dir)
    if a.one:
        m, mech, eps, ep, lr, seed = a.one.split(",")
        run_one(runs, data, a.data_dir, float(ep), float(eps), m, mech, float(lr), int(seed))
        return
    for epochs in map(float, a.epochs.split(",")):
        for eps in map(float, a.epsilons.split(",")):
            for method in a.methods.split(","):
                for mech in a.mechanisms.split(","):
                    scored = []
                    for lr in LR_GRID[method]:  # tuning at seed 0
                        s = run_one(runs, data, a.data_dir, epochs, eps, method, mech, lr, 0)
                        scored.append((s["val_accuracy"], lr))
                    best_lr = max(scored)[1]
                    for seed in range(1, a.seeds):
                        run_one(runs, data, a.data_dir, epochs, eps, method, mech, best_lr, seed)


if __name__ == "__main__":
    main()
