"""dp-muon-auto vs dp-muon vs dp-sgd at two batch sizes, ≥ 2 seeds (issue 12). Resumable.

Runs the same pipeline as ``dpopt train`` (build_run → run_steps → write_results) and additionally
writes the dp-muon-auto per-layer decision history (``history.json``) with
``dpopt.transforms.muon_auto.write_history``. A run whose ``summary.json`` exists is skipped.

    python docs/results/muon-auto-mnist/run_compare.py RUNS_DIR [--dataset mnist] [--epochs 1] \
        [--batch-sizes 256,1024] [--seeds 0,1] [--methods dp-sgd,dp-muon,dp-muon-auto]
then ``summarize.py RUNS_DIR`` writes results.md here.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dpopt.data import load_dataset
from dpopt.training import TrainConfig
from dpopt.training.build import build_run
from dpopt.training.loop import run_steps
from dpopt.training.results import run_directory, write_config, write_results
from dpopt.transforms.muon_auto import write_history


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs")
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--data-dir", required=True, help="directory with mnist.npz")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--target-epsilon", type=float, default=4.0)
    ap.add_argument("--batch-sizes", default="256,1024")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--methods", default="dp-sgd,dp-muon,dp-muon-auto")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    data = load_dataset(a.dataset, a.data_dir)
    for seed in map(int, a.seeds.split(",")):
        for b in map(float, a.batch_sizes.split(",")):
            for method in a.methods.split(","):
                out = Path(a.runs) / f"{a.dataset}-{method}-b{int(b)}-s{seed}"
                if (out / "summary.json").exists():
                    continue
                cfg = TrainConfig(dataset=a.dataset, data_dir=a.data_dir, method=method, batch_size=b,
                                  epochs=a.epochs, target_epsilon=a.target_epsilon, seed=seed, out=str(out),
                                  overwrite=True)
                start = time.perf_counter()
                run = build_run(cfg, data)
                run_dir = run_directory(cfg)
                write_config(run_dir, run)
                metrics = run_steps(run)
                summary = write_results(run_dir, run, metrics, start)
                write_history(run_dir, run.optimizer,
                              [n for n, p in run.model.named_parameters() if p.requires_grad])
                print(json.dumps({k: summary.get(k) for k in ("method", "expected_batch_size", "test_accuracy",
                                                              "epsilon", "steps", "wall_seconds")}), flush=True)


if __name__ == "__main__":
    main()
