"""The small classification problem the method tests share (imported by pytest's rootdir-relative path)."""

import torch
from torch import nn


def small_problem(seed=0, n=12, hidden=True):
    """A 4-6-5-3 tanh MLP (or 4-5-3 with ``hidden=False``) and n random examples; call under float64."""
    torch.manual_seed(seed)
    layers = (
        [nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)]
        if hidden
        else [nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)]
    )
    model = nn.Sequential(*layers)
    x = torch.randn(n, 4)
    y = torch.randint(0, 3, (n,))
    return model, x, y
