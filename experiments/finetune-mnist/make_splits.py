"""Issue 21: the public / private splits of MNIST for the fine-tuning experiment (docs/results/finetune-mnist).

Reads ``mnist.npz`` (keys ``x_train, y_train, x_test, y_test``, uint8) from ``--data-dir`` and writes two
directories that ``dpopt train --data-dir`` reads as MNIST:

* ``OUT/public/mnist.npz`` — digits 0–4 (training and test records of those classes): the PUBLIC pretraining data;
* ``OUT/private/mnist.npz`` — digits 5–9: the PRIVATE fine-tuning data (and its test set).

The split is by label only (no randomness); labels keep their values (the 10-way head of ``mlp`` is shared, its
rows 5–9 are what the private fine-tune has to learn). The two training sets are disjoint, so no private record is
in the pretraining data (the "public data must really be public" pitfall of docs/finetuning.md holds by
construction; the two halves of MNIST come from the same writers, which is what makes them related tasks).

Usage (repository root): ``python experiments/finetune-mnist/make_splits.py --data-dir data --out runs/finetune-data``
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def make_splits(data_dir: str, out: str) -> dict:
    """Write OUT/public/mnist.npz (labels 0–4) and OUT/private/mnist.npz (labels 5–9); return the record counts."""
    src = np.load(Path(data_dir) / "mnist.npz")
    counts = {}
    for name, keep in (("public", lambda y: y <= 4), ("private", lambda y: y >= 5)):
        arrays = {}
        for part in ("train", "test"):
            x, y = src[f"x_{part}"], src[f"y_{part}"]
            m = keep(y)
            arrays[f"x_{part}"], arrays[f"y_{part}"] = x[m], y[m]
            counts[f"{name}_{part}"] = int(m.sum())
        d = Path(out) / name
        d.mkdir(parents=True, exist_ok=True)
        np.savez(d / "mnist.npz", **arrays)
    return counts


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="data")
    ap.add_argument("--out", default="runs/finetune-data")
    a = ap.parse_args()
    print(make_splits(a.data_dir, a.out))
