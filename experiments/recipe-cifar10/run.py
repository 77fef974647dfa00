"""Reduced ablation of the from-scratch recipe on CIFAR-10 (issue 24): WS on/off, K views, EMA on/off.

Every run: DP-SGD (``dpopt.training.train``, what ``dpopt train`` runs) at ε = 8 (δ = 1e-5, σ calibrated
by PLD) on a FIXED PUBLIC SUBSET of CIFAR-10 — the first 10,000 training records (N = 10,000: q = B̄/N)
and the first 5,000 test records — B̄ = 128, two epochs (156 Poisson steps), lr 0.2 with a 10-step
warm-up and cosine decay, C = 1, EMA decay 0.999 (warm-up min(D, (1+t)/(10+t))) evaluated from the
SAME run as the raw model (EMA is post-processing). Arms: cnn5 K = 1, cnn5-ws K = 1, cnn5-ws K = 2
(crop-flip views), seeds 0 and 1; cnn5-ws K = 1 for 4 epochs (312 steps, σ recalibrated for ε = 8: the
compute of K = 2, "matched compute"); then cnn5-ws K = 1 with crop-flip (augmentation without
multiplicity) and cnn5-ws K = 4 if time is left (K = 4 was the first plan: at this machine's load a
K = 4 run took ~85 min, so K = 2 replaced it; see docs/results/recipe-cifar10/README.md).

Resumable: each run has its own directory under ``runs/recipe-cifar10/`` (relative to the working
directory); a finished run (summary.json) is skipped, an interrupted one (checkpoint.pt) is resumed.
Each finished summary is appended to docs/results/recipe-cifar10/results.jsonl (with the arm's label).

Usage (from the repository root)::

    nice -n 19 python experiments/recipe-cifar10/run.py --data-dir DIR [--workers 2] [--only LABEL]
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

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs/results/recipe-cifar10/results.jsonl"
N_TRAIN, N_TEST = 10_000, 5_000
COMMON = dict(dataset="cifar10", method="dp-sgd", target_epsilon=8.0, delta=1e-5, batch_size=128.0, epochs=2.0,
              lr=0.2, max_grad_norm=1.0, lr_schedule="cosine", warmup_steps=10, ema_decay=0.999,
              checkpoint_every=20)
ARMS = [("cnn5", 1, None), ("cnn5-ws", 1, None), ("cnn5-ws", 2, "crop-flip")]
LATE_ARMS = [("cnn5-ws", 1, "crop-flip"), ("cnn5-ws", 4, "crop-flip")]
MATCHED = ("cnn5-ws", 1, None)  # K = 1 with 2× the epochs (312 steps, σ recalibrated): K = 2's compute
# the order the runs were started in (2 workers): seed 0 of the K = 1 arms, both seeds of K = 2 (the long
# runs), then seed 1 of the K = 1 arms; then the late arms if time is left
ORDER = ["cnn5-k1-s0", "cnn5-ws-k1-s0", "cnn5-ws-k2-s0", "cnn5-ws-k2-s1", "cnn5-k1-s1", "cnn5-ws-k1-s1",
         "cnn5-ws-k1-4ep-s0", "cnn5-ws-k1-4ep-s1", "cnn5-ws-k1-aug-s0", "cnn5-ws-k1-aug-s1", "cnn5-ws-k4-s0",
         "cnn5-ws-k4-s1"]


def queue() -> list[dict]:
    out = []
    for arms in (ARMS, LATE_ARMS):
        for seed in (0, 1):
            for model, k, aug in arms:
                label = f"{model} K={k}" + (" +aug" if aug and k == 1 else "")
                name = f"{model}-k{k}{'-aug' if aug and k == 1 else ''}-s{seed}"
                out.append({"model": model, "k": k, "augment": aug, "seed": seed, "label": label, "name": name})
    for seed in (0, 1):  # matched compute: K = 1 for twice the epochs (the rows of K = 2)
        out.append({"model": MATCHED[0], "k": 1, "augment": None, "seed": seed, "epochs": 4.0,
                    "label": "cnn5-ws K=1 4 epochs", "name": f"cnn5-ws-k1-4ep-s{seed}"})
    return sorted(out, key=lambda j: ORDER.index(j["name"]))


def subset(data_dir: str):
    """The fixed public subset: first N_TRAIN training and first N_TEST test records of cifar10.npz."""
    from dpopt.data import Dataset, load_dataset

    full = load_dataset("cifar10", data_dir)
    return Dataset("cifar10", full.x_train[:N_TRAIN], full.y_train[:N_TRAIN], full.x_test[:N_TEST],
                   full.y_test[:N_TEST])


def one(name: str, data_dir: str) -> None:
    """Train (or resume) run ``name`` in this process and print its summary as JSON."""
    import torch

    from dpopt.training import TrainConfig, resume, train

    torch.set_num_threads(1)
    job = next(j for j in queue() if j["name"] == name)
    run_dir = Path("runs/recipe-cifar10") / name
    data = subset(data_dir)
    if (run_dir / "checkpoint.pt").exists():
        summary = resume(run_dir, data=data)
    else:
        common = dict(COMMON, epochs=job.get("epochs", COMMON["epochs"]))
        cfg = TrainConfig(**common, data_dir=data_dir, model=job["model"], seed=job["seed"],
                          augmentation_multiplicity=job["k"], augment=job["augment"],
                          physical_batch_size=64 // job["k"], out=str(run_dir), overwrite=True)
        summary = train(cfg, data=data)
    print(json.dumps(summary))


def run_one(job: dict, data_dir: str) -> None:
    name = job["name"]
    run_dir = Path("runs/recipe-cifar10") / name
    summary = run_dir / "summary.json"
    if summary.exists() and json.loads(summary.read_text()).get("status", "completed") == "completed":
        print(f"{name}: done", flush=True)
        return
    cmd = ["nice", "-n", "19", sys.executable, __file__, "--data-dir", data_dir, "--one", name]
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(f"runs/recipe-cifar10/{name}.log", "a") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    print(f"{name}: exit {rc} after {time.time() - t0:.0f} s", flush=True)
    if rc == 0 and summary.exists():
        rec = json.loads(summary.read_text())
        rec.update(label=job["label"], name=name, n_train=N_TRAIN, n_test=N_TEST,
                   command=f"python experiments/recipe-cifar10/run.py --data-dir DIR --one {name}")
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with open(RESULTS, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True, help="directory with cifar10.npz")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--only", default=None, help="run only this label, e.g. 'cnn5-ws K=4'")
    ap.add_argument("--one", default=None, help="run this one run (by name) in this process")
    args = ap.parse_args()
    if args.one:
        one(args.one, args.data_dir)
        return
    Path("runs/recipe-cifar10").mkdir(parents=True, exist_ok=True)
    jobs = [j for j in queue() if args.only is None or j["label"] == args.only]
    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(lambda j: run_one(j, args.data_dir), jobs))


if __name__ == "__main__":
    main()
