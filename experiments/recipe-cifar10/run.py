"""Ablation of the from-scratch recipe on CIFAR-10 (issue 24): WS on/off, K augmented views, EMA on/off.

Every run is ``dpopt.training.train`` (what ``dpopt train`` runs): DP-SGD at ε = 8 (δ = 1e-5, σ
calibrated by PLD for the run's steps and q), C = 1, 600 Poisson steps (1200 for ``LONG``), lr 0.2
with a 20-step linear warm-up and cosine decay (or constant), EMA decay 0.999 with the warm-up
min(D, (1+t)/(10+t)) evaluated from the SAME run as the raw parameters (EMA is post-processing: no
extra run, no extra ε).

Data (fixed and public, the same for every run):

* training: the first ``N_TRAIN`` = 10,000 records of CIFAR-10's training set (q = B̄ / N);
* evaluation: 11,000 images never trained on: training records 40,000–49,999 (held out) and the
  1,000 official test images that ``cifar10.npz`` holds (its test set is partial). The summary's
  ``test_accuracy`` is on these 11,000 images.

Arms (``ARMS``; K views are random crop (padding 4) + horizontal flip, averaged per example before
the clip, through the fast engine's ``rows_per_example`` grouping):

* ``cnn5 K=1``: no WS, no augmentation;
* ``cnn5-ws K=1``: WS, no augmentation;
* ``cnn5-ws K=1 +aug``: WS, one augmented view (augmentation without multiplicity);
* ``cnn5-ws K=4`` and ``cnn5-ws K=8``: WS, K augmented views per example;
* ``cnn5-ws K=1 B=512``: matched compute for K = 4 (4× the examples per step instead of 4 views
  of each; σ recalibrated for q = 512 / N, same steps).

Then ``LONG``: cnn5-ws K = 1 and K = 8 for 1200 steps, cosine or constant lr.

Seeds 0 and 1; all seed-0 runs of a group are queued before its seed-1 runs so that a partial result
has every arm. Resumable: each run has its own directory under ``runs/recipe-cifar10-v2/`` (relative to
the working directory); a finished run (summary.json with status "completed") is skipped, an
interrupted one (checkpoint.pt) is resumed. ``table.py`` makes the table and plot.

Usage (from the repository root)::

    nice -n 19 python experiments/recipe-cifar10/run.py --data-dir DIR [--workers 2] [--group main|long] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RUNS = Path("runs/recipe-cifar10-v2")
N_TRAIN, HELD_OUT_FROM = 10_000, 40_000
STEPS = 600
COMMON = dict(
    dataset="cifar10",
    method="dp-sgd",
    target_epsilon=8.0,
    delta=1e-5,
    lr=0.2,
    max_grad_norm=1.0,
    warmup_steps=20,
    ema_decay=0.999,
    checkpoint_every=50,
)
# (name stem, label, model, K, augment, expected batch size B̄, steps, lr schedule)
ARMS = [
    ("ws-k1", "cnn5-ws K=1", "cnn5-ws", 1, None, 128, STEPS, "cosine"),
    ("ws-k8", "cnn5-ws K=8", "cnn5-ws", 8, "crop-flip", 128, STEPS, "cosine"),
    ("ws-k1-aug", "cnn5-ws K=1 +aug", "cnn5-ws", 1, "crop-flip", 128, STEPS, "cosine"),
    ("ws-k4", "cnn5-ws K=4", "cnn5-ws", 4, "crop-flip", 128, STEPS, "cosine"),
    ("cnn5-k1", "cnn5 K=1", "cnn5", 1, None, 128, STEPS, "cosine"),
    ("ws-k1-b512", "cnn5-ws K=1 B=512", "cnn5-ws", 1, None, 512, STEPS, "cosine"),
]
# the longer horizon (queued after ARMS): 2× the steps, σ recalibrated for ε = 8; K = 8 with the cosine
# schedule and with a constant lr (where the EMA has noise to average)
LONG = [
    ("ws-k1-long", "cnn5-ws K=1, 1200 steps", "cnn5-ws", 1, None, 128, 2 * STEPS, "cosine"),
    ("ws-k8-long", "cnn5-ws K=8, 1200 steps", "cnn5-ws", 8, "crop-flip", 128, 2 * STEPS, "cosine"),
    ("ws-k8-long-const", "cnn5-ws K=8, 1200 steps, constant lr", "cnn5-ws", 8, "crop-flip", 128, 2 * STEPS, "constant"),
    ("ws-k1-long-const", "cnn5-ws K=1, 1200 steps, constant lr", "cnn5-ws", 1, None, 128, 2 * STEPS, "constant"),
]
# glibc: keep freed blocks up to 32 MiB in the heap (no mmap/munmap and page faults per activation tensor):
# the same steps in about half the time on this CPU (docs/performance.md, "Allocator"); results unchanged
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "17179869184", "MALLOC_TOP_PAD_": "536870912"}
ROWS_PER_CHUNK = 256  # physical micro-batch: 256 / K examples with all their K views


GROUPS = {"main": ARMS, "long": LONG}


def queue(groups=("main", "long")) -> list[dict]:
    return [
        {
            "name": f"{stem}-s{seed}",
            "label": label,
            "model": model,
            "k": k,
            "augment": aug,
            "batch": b,
            "steps": steps,
            "schedule": schedule,
            "seed": seed,
        }
        for g in groups
        for seed in (0, 1)
        for stem, label, model, k, aug, b, steps, schedule in GROUPS[g]
    ]


def data(data_dir: str):
    """Training: the first N_TRAIN training records; evaluation: training records HELD_OUT_FROM.. + the test set."""
    import torch

    from dpopt.data import Dataset, load_dataset

    full = load_dataset("cifar10", data_dir)
    x_eval = torch.cat([full.x_train[HELD_OUT_FROM:], full.x_test])
    y_eval = torch.cat([full.y_train[HELD_OUT_FROM:], full.y_test])
    return Dataset("cifar10", full.x_train[:N_TRAIN], full.y_train[:N_TRAIN], x_eval, y_eval)


def one(name: str, data_dir: str) -> None:
    """Train (or resume) run ``name`` in this process and print its summary as JSON."""
    import torch

    from dpopt.training import TrainConfig, resume, train

    torch.set_num_threads(1)
    job = next(j for j in queue() if j["name"] == name)
    run_dir = RUNS / name
    if (run_dir / "checkpoint.pt").exists():
        summary = resume(run_dir, data=data(data_dir))
    else:
        cfg = TrainConfig(
            **COMMON,
            batch_size=float(job["batch"]),
            epochs=job["steps"] * job["batch"] / N_TRAIN,
            lr_schedule=job["schedule"],
            data_dir=data_dir,
            model=job["model"],
            seed=job["seed"],
            augmentation_multiplicity=job["k"],
            augment=job["augment"],
            physical_batch_size=ROWS_PER_CHUNK // job["k"],
            out=str(run_dir),
            overwrite=True,
        )
        summary = train(cfg, data=data(data_dir))
    print(json.dumps(summary))


def run_one(job: dict, data_dir: str) -> None:
    name = job["name"]
    summary = RUNS / name / "summary.json"
    if summary.exists() and json.loads(summary.read_text()).get("status", "completed") == "completed":
        print(f"{name}: done", flush=True)
        return
    lock = RUNS / f"{name}.lock"  # several runners may share the queue: one runs each job
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        print(f"{name}: taken by another runner ({lock}; delete it after a crash)", flush=True)
        return
    try:
        _launch(name, data_dir)
    finally:
        lock.unlink(missing_ok=True)


def _launch(name: str, data_dir: str) -> None:
    cmd = ["nice", "-n", "19", sys.executable, __file__, "--data-dir", data_dir, "--one", name]
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1", **MALLOC)
    with open(RUNS / f"{name}.log", "a") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    print(f"{name}: exit {rc} after {time.time() - t0:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True, help="directory with cifar10.npz")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--only", default=None, help="run only this run name, e.g. ws-k8-s0")
    ap.add_argument("--group", choices=sorted(GROUPS), default=None, help="run only this group (default: all)")
    ap.add_argument("--one", default=None, help="run this one run (by name) in this process")
    args = ap.parse_args()
    if args.one:
        one(args.one, args.data_dir)
        return
    RUNS.mkdir(parents=True, exist_ok=True)
    jobs = [
        j for j in queue((args.group,) if args.group else tuple(GROUPS)) if args.only is None or j["name"] == args.only
    ]
    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(lambda j: run_one(j, args.data_dir), jobs))


if __name__ == "__main__":
    main()
