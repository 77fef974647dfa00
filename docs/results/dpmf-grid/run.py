"""Independent vs banded vs BLT noise for four optimizers (issue 36's experiment, CPU-reduced).

For every cell (dataset, epochs, ε, method, mechanism): each lr of LR_GRID at seed 0 with 10 % of
the training records held out (validation_fraction 0.1), then the lr with the best validation
accuracy at seeds 1 .. S−1 (``--seeds S``, default 2). Same pipeline as ``dpopt train`` (build_run → run_steps → write_results), one
thread, σ calibrated for the target ε (δ = 1e-5). Resumable: a run with a ``summary.json`` is
skipped. After each run ``dpopt.accounting.ledger_check.check_run`` re-scores the run directory
and the process CPU seconds are written to ``driver.json`` beside the summary.

    python docs/results/dpmf-grid/run.py RUNS_DIR --dataset digits --epochs 1,5
    python docs/results/dpmf-grid/run.py RUNS_DIR --dataset mnist --data-dir DATA --epochs 1 \
        --methods dp-sgd,dp-adam
    python docs/results/dpmf-grid/run.py RUNS_DIR --dataset digits --epochs 1,5 --methods dp-sgd,dp-adam \
        --mechanisms banded:4@q0.2 --seeds 5     # amplified banded MF (cyclic Poisson, q = 0.2, b' = 4)
    python docs/results/dpmf-grid/summarize.py RUNS_DIR [RUNS_DIR ...] docs/results/dpmf-grid
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dpopt.accounting.ledger_check import check_run
from dpopt.data import load_dataset
from dpopt.training import TrainConfig
from dpopt.training.build import build_run
from dpopt.training.loop import run_steps
from dpopt.training.results import run_directory, write_config, write_results

MECHANISMS = ("independent", "banded:4", "blt")
#: amplified banded MF: ``banded:B@qR`` = noise_mechanism banded:B, sampling cyclic-poisson, sample_rate R (the rate
#: within each of the b' = round(R · L) parts, L = round(N / B̄) the steps of an epoch; docs/correlated-noise.md)
AMPLIFIED = "@q"
METHODS = ("dp-sgd", "dp-adam", "dp-macadam", "dp-muon")
EPSILONS = (1.0, 8.0)
#: dataset → method → learning rates tried at seed 0 (chosen on the validation split).
LR_GRID = {
    "digits": {
        "dp-sgd": [0.1, 0.3, 1.0, 3.0, 10.0],
        "dp-adam": [1e-3, 3e-3, 1e-2, 3e-2, 1e-1],
        "dp-macadam": [3e-3, 1e-2, 3e-2, 1e-1, 3e-1],
        "dp-muon": [0.03, 0.1, 0.3, 1.0],
        # the temporal filters over correlated noise (filters.py): DP-SGD's grid
        "disk-sgd": [0.1, 0.3, 1.0, 3.0, 10.0],
        "doppler-sgd": [0.1, 0.3, 1.0, 3.0, 10.0],
    },
    "mnist": {
        "dp-sgd": [0.5, 2.0],
        "dp-adam": [1e-3, 3e-3],
        "dp-macadam": [1e-3, 3e-3],
        "dp-muon": [0.01, 0.02],
    },
}
BATCH = {"digits": 64.0, "mnist": 256.0}


def mechanism_options(mech: str) -> dict:
    """TrainConfig fields of a mechanism token: ``independent``, ``banded:B``, ``blt`` or ``banded:B@qR``."""
    if AMPLIFIED in mech:
        spec, rate = mech.split(AMPLIFIED)
        return {"noise_mechanism": spec, "sampling": "cyclic-poisson", "sample_rate": float(rate)}
    return {"noise_mechanism": mech}


def run_name(dataset: str, epochs: float, eps: float, method: str, mech: str, lr: float, seed: int) -> str:
    token = mech.replace(":", "").replace(AMPLIFIED, "-cpq")  # banded:4@q0.2 -> banded4-cpq0.2
    return f"{dataset}-ep{epochs:g}-eps{eps:g}-{method}-{token}-lr{lr:g}-s{seed}"


def run_one(runs: Path, data, data_dir, dataset, epochs, eps, method, mech, lr, seed) -> dict:
    out = runs / run_name(dataset, epochs, eps, method, mech, lr, seed)
    if (out / "summary.json").exists():
        return json.loads((out / "summary.json").read_text())
    cfg = TrainConfig(
        dataset=dataset,
        data_dir=data_dir,
        method=method,
        batch_size=BATCH[dataset],
        epochs=epochs,
        target_epsilon=eps,
        seed=seed,
        out=str(out),
        overwrite=True,
        validation_fraction=0.1,
        lr=lr,
        **mechanism_options(mech),
    )
    start, cpu0 = time.perf_counter(), time.process_time()
    run = build_run(cfg, data)
    run_dir = run_directory(cfg)
    write_config(run_dir, run)
    summary = write_results(run_dir, run, run_steps(run), start)
    check = check_run(run_dir)
    (run_dir / "driver.json").write_text(
        json.dumps({"cpu_seconds": time.process_time() - cpu0, "check_run": "pass" if check.passed else "FAIL"})
    )
    print(
        json.dumps(
            {
                "run": out.name,
                **{
                    k: summary.get(k)
                    for k in (
                        "noise_multiplier",
                        "val_accuracy",
                        "test_accuracy",
                        "epsilon",
                        "steps",
                        "wall_seconds",
                        "check",
                    )
                },
            }
        ),
        flush=True,
    )
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs")
    ap.add_argument("--dataset", default="digits", choices=sorted(LR_GRID))
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--epochs", default="1,5")
    ap.add_argument("--epsilons", default=",".join(f"{e:g}" for e in EPSILONS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--mechanisms", default=",".join(MECHANISMS))
    ap.add_argument("--seeds", type=int, default=2, help="seeds 1..S-1 rerun at the chosen lr (seed 0 tunes)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    runs = Path(a.runs)
    data = load_dataset(a.dataset, a.data_dir)
    for epochs in map(float, a.epochs.split(",")):
        for eps in map(float, a.epsilons.split(",")):
            for method in a.methods.split(","):
                for mech in a.mechanisms.split(","):
                    scored = []
                    for lr in LR_GRID[a.dataset][method]:  # tuning at seed 0
                        s = run_one(runs, data, a.data_dir, a.dataset, epochs, eps, method, mech, lr, 0)
                        scored.append((s["val_accuracy"], lr))
                    best_lr = max(scored)[1]
                    for seed in range(1, a.seeds):
                        run_one(runs, data, a.data_dir, a.dataset, epochs, eps, method, mech, best_lr, seed)


if __name__ == "__main__":
    main()
