"""Issue 38: data splits, the tiny ViT, and its NON-private pretraining for docs/results/finetune-vit.

Three steps (repository root, ``cifar10.npz`` in ``--data-dir``):

* ``splits`` — ``OUT/public/cifar10.npz``: CIFAR-10 classes 0–4 (all 25,000 training and 5,000 test records), the
  PUBLIC pretraining data (the stored CIFAR-10 has only 1,000 test images: 485 of them are the public test set);
  ``OUT/private/cifar10.npz``: classes 5–9, a SUBSAMPLE of ``--n-private`` training records (a fixed permutation,
  seed 0; CPU time) and, as its test set, ``--n-test`` OTHER training records of those classes (disjoint; the 515
  official test images of classes 5–9 are too few to see seed spreads of a point). The split is by label, so the
  two training sets are disjoint; labels keep their values (the 10-way head is shared, rows 5–9 are new to it).
* ``init`` — a Hugging Face ``ViTForImageClassification`` from a local ``ViTConfig`` (32×32 inputs, patch 8: 16
  patch tokens + CLS; 4 blocks, width 96, 4 heads, MLP 192, no dropout), randomly initialised with ``--seed`` and
  written with ``save_pretrained`` to ``OUT`` (what ``dpopt train --model hf:OUT`` loads; nothing is downloaded).
* ``pretrain`` — ordinary (non-private) AdamW training of that model on the public split (the same normalisation as
  ``dpopt train``), saved as a state dict with the keys of dpopt's ``HFLogits`` wrapper (``OUT/model.pt``, loaded by
  ``--init-from``) and a record ``OUT/pretrain.json`` (public test accuracy, wall time).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dpopt.data import load_dataset
from dpopt.hf.pretrained import load_hf_model


def splits(data_dir: str, out: str, n_private: int, n_test: int) -> dict:
    """Write OUT/public/cifar10.npz (labels 0–4) and OUT/private/cifar10.npz (labels 5–9: n_private training, n_test
    test records, both drawn from the CIFAR-10 training records of those classes, disjoint)."""
    src = np.load(Path(data_dir) / "cifar10.npz")
    counts = {}
    for name, keep in (("public", lambda y: y <= 4), ("private", lambda y: y >= 5)):
        arrays = {}
        for part in ("train", "test"):
            x, y = src[f"x_{part}"], src[f"y_{part}"].reshape(-1)
            idx = np.flatnonzero(keep(y))
            if name == "private" and part == "train":
                perm = np.random.default_rng(0).permutation(idx)
                idx, held = np.sort(perm[:n_private]), np.sort(perm[n_private : n_private + n_test])
            if name == "private" and part == "test":  # the 500 official test images are too few: held-out records
                x, y, idx = src["x_train"], src["y_train"].reshape(-1), held
            arrays[f"x_{part}"], arrays[f"y_{part}"] = x[idx], y[idx]
            counts[f"{name}_{part}"] = int(idx.size)
        d = Path(out) / name
        d.mkdir(parents=True, exist_ok=True)
        np.savez(d / "cifar10.npz", **arrays)
    return counts


def init(out: str, seed: int, width: int, depth: int) -> int:
    """Save a randomly initialised tiny ViT (save_pretrained) to OUT; return its parameter count."""
    import transformers as T

    torch.manual_seed(seed)
    cfg = T.ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=width,
        num_hidden_layers=depth,
        num_attention_heads=4,
        intermediate_size=2 * width,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = T.ViTForImageClassification(cfg)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def pretrain(data_dir: str, model_dir: str, out: str, epochs: int, seed: int) -> dict:
    """Non-private AdamW (lr 1e-3, wd 0.05, batch 128, cosine) on the public split; save OUT/model.pt."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    data = load_dataset("cifar10", data_dir)
    model = load_hf_model(f"hf:{model_dir}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    n, bs = data.n_train, 128
    total = epochs * (-(-n // bs))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=total, pct_start=0.1)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(n)
        for i in range(0, n, bs):
            idx = perm[i : i + bs]
            x = data.x_train[idx]
            flip = torch.rand(x.shape[0]) < 0.5  # public data: ordinary augmentation is allowed
            x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
            opt.zero_grad()
            loss_fn(model(x), data.y_train[idx]).backward()
            opt.step()
            sched.step()
    model.eval()
    with torch.no_grad():
        acc = (
            sum(
                (model(data.x_test[i : i + 500]).argmax(1) == data.y_test[i : i + 500]).sum().item()
                for i in range(0, data.x_test.shape[0], 500)
            )
            / data.x_test.shape[0]
        )
    Path(out).mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), Path(out) / "model.pt")
    info = {
        "public_test_accuracy": acc,
        "n_public_train": n,
        "epochs": epochs,
        "seed": seed,
        "optimizer": "AdamW lr 1e-3 (one-cycle), wd 0.05, batch 128, random flips (non-private)",
        "parameters": sum(p.numel() for p in model.parameters()),
        "wall_seconds": time.perf_counter() - t0,
    }
    (Path(out) / "pretrain.json").write_text(json.dumps(info, indent=1))
    return info


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("splits", "init", "pretrain"))
    ap.add_argument("--data-dir", default="data")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-dir", default="runs/finetune-vit/vit-init")
    ap.add_argument("--n-private", type=int, default=5000)
    ap.add_argument("--n-test", type=int, default=3000)
    ap.add_argument("--width", type=int, default=96)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.step == "splits":
        print(splits(a.data_dir, a.out, a.n_private, a.n_test))
    elif a.step == "init":
        print(init(a.out, a.seed, a.width, a.depth))
    else:
        print(pretrain(a.data_dir, a.model_dir, a.out, a.epochs, a.seed))
