"""Issue 21: NON-private pretraining of dpopt's ``mlp`` (784-1000-10) on the PUBLIC split (MNIST digits 0–4).

The public data need no protection, so this is ordinary training: Adam (lr 1e-3), batch 128, ``--epochs`` epochs,
seed ``--seed``, the same normalisation as ``dpopt train`` (``dpopt.data.load_dataset``). The state dict is saved as
``OUT/model.pt`` with the keys of ``dpopt.models.build_model("mlp")``, so ``dpopt train --init-from OUT/model.pt``
loads it; ``OUT/pretrain.json`` records the public test accuracy (digits 0–4) and the wall time.

Usage (repository root, after make_splits.py)::

    OMP_NUM_THREADS=1 nice -n 19 python experiments/finetune-mnist/pretrain.py \
        --data-dir runs/finetune-data/public --out runs/finetune-mnist/public
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from dpopt.data import load_dataset
from dpopt.models import build_model


def pretrain(data_dir: str, out: str, epochs: int = 3, seed: int = 0) -> dict:
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    data = load_dataset("mnist", data_dir)
    model = build_model("mlp", "mnist")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    n = data.n_train
    for _ in range(epochs):
        perm = torch.randperm(n)
        for i in range(0, n, 128):
            idx = perm[i : i + 128]
            opt.zero_grad()
            loss_fn(model(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
    with torch.no_grad():
        acc = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
    Path(out).mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), Path(out) / "model.pt")
    info = {
        "public_test_accuracy": acc,
        "n_public_train": n,
        "epochs": epochs,
        "seed": seed,
        "optimizer": "Adam lr 1e-3, batch 128 (non-private)",
        "wall_seconds": time.perf_counter() - t0,
    }
    (Path(out) / "pretrain.json").write_text(json.dumps(info, indent=1))
    return info


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="runs/finetune-data/public")
    ap.add_argument("--out", default="runs/finetune-mnist/public")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(pretrain(a.data_dir, a.out, a.epochs, a.seed))
