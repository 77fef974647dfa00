"""Is DP-MacAdam's collapse under correlated noise (digits, 5 epochs, ε = 1) the correlation or the size of σ?

Runs digits, 5 epochs, seed 0, INDEPENDENT noise at the σ that banded:4 and BLT needed for ε = 1
(12.793, 16.893; fixed noise multiplier, so ε is far below 1), DP-MacAdam at its lr grid's middle
values and DP-Adam as a control. Same pipeline as run.py.

    python docs/results/dpmf-grid/diagnose_macadam.py RUNS_DIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from dpopt.data import load_dataset
from dpopt.training import TrainConfig
from dpopt.training.build import build_run
from dpopt.training.loop import run_steps
from dpopt.training.results import run_directory, write_config, write_results

CASES = [("dp-macadam", 0.01), ("dp-macadam", 0.03), ("dp-adam", 0.1)]
SIGMAS = (12.793, 16.893)


def main() -> None:
    torch.set_num_threads(1)
    runs = Path(sys.argv[1])
    data = load_dataset("digits", None)
    for sigma in SIGMAS:
        for method, lr in CASES:
            out = runs / f"diag-digits-ep5-sigma{sigma:g}-{method}-independent-lr{lr:g}-s0"
            if (out / "summary.json").exists():
                s = json.loads((out / "summary.json").read_text())
            else:
                cfg = TrainConfig(
                    dataset="digits",
                    method=method,
                    batch_size=64.0,
                    epochs=5.0,
                    noise_multiplier=sigma,
                    seed=0,
                    out=str(out),
                    overwrite=True,
                    validation_fraction=0.1,
                    lr=lr,
                )
                start = time.perf_counter()
                run = build_run(cfg, data)
                run_dir = run_directory(cfg)
                write_config(run_dir, run)
                s = write_results(run_dir, run, run_steps(run), start)
            keys = ("method", "lr", "noise_multiplier", "epsilon", "val_accuracy", "test_accuracy", "check")
            print(json.dumps({k: s.get(k) for k in keys}), flush=True)


if __name__ == "__main__":
    main()
