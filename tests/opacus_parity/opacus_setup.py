"""Shared set-up of the Opacus-parity tests: a small model, a TensorDataset and a make_private call.

``private(...)`` mirrors the set-up of Opacus's ``privacy_engine_test.py``
(a model, an SGD optimizer, a DataLoader of fixed batch size, then
``PrivacyEngine().make_private``), with dpopt's engine.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt

N, D, K = 64, 5, 3


def data(n: int = N, seed: int = 0) -> TensorDataset:
    """n examples of D features, K classes (fixed by ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, D, generator=g), torch.randint(0, K, (n,), generator=g))


def model(seed: int = 0) -> nn.Module:
    """Linear → tanh → Linear, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 4), nn.Tanh(), nn.Linear(4, K))


def private(
    *,
    accountant: str = "pld",
    batch_size: int = 16,
    seed: int = 0,
    noise_seed: int = 1,
    lr: float = 0.1,
    dataset=None,
    **kwargs,
):
    """(engine, model, optimizer, loader) from ``make_private`` with REPRODUCIBLE noise (``noise_seed``)."""
    engine = dpopt.PrivacyEngine(accountant=accountant)
    m = model(seed)
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    loader = DataLoader(dataset if dataset is not None else data(), batch_size=batch_size)
    kwargs.setdefault("noise_multiplier", 1.0)
    kwargs.setdefault("max_grad_norm", 1.0)
    gen = None if noise_seed is None else torch.Generator().manual_seed(noise_seed)
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="noise_generator")
        out = engine.make_private(module=m, optimizer=opt, data_loader=loader, noise_generator=gen, **kwargs)
    return (engine, *out)


def run_epoch(model, optimizer, loader, steps=None, loss_fn=None) -> int:
    """One epoch (or ``steps`` steps) of the ordinary Opacus loop; returns the number of steps run.

    ``loss_fn(out, y)``: the loss (default ``nn.CrossEntropyLoss()``).
    """
    crit = nn.CrossEntropyLoss() if loss_fn is None else loss_fn
    n = 0
    for x, y in loader:
        optimizer.zero_grad()
        crit(model(x), y).backward()
        optimizer.step()
        n += 1
        if steps is not None and n >= steps:
            break
    return n
