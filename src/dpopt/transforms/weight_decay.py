"""Decoupled weight decay (AdamW-style), appended to any method's chain.

    u ← u − lr · λ · θ

where u is the chain's update (already −lr-scaled), θ the current parameter and
λ = ``weight_decay``: the parameter shrinks by the factor (1 − lr·λ) each
step, independently of the gradient statistics (Loshchilov & Hutter 2019,
"Decoupled weight decay regularization", Algorithm 2, line 12). lr is the
param-group learning rate (LR schedulers scale the decay too, as in
``torch.optim.AdamW``).

Privacy: θ is public (every parameter is a function of released gradients),
so the decay is post-processing and costs nothing.
"""

from __future__ import annotations

import math

from .base import StepContext, Transform

__all__ = ["DecoupledWeightDecay", "add_decayed_weights"]


class DecoupledWeightDecay(Transform):
    """u ← u − lr·λ·θ (decoupled weight decay; λ ≥ 0, a no-op at 0).

    Args:
        weight_decay: λ ≥ 0 (finite).

    Raises:
        ValueError: λ < 0 or not finite.
    """

    name = "weight_decay"

    def __init__(self, weight_decay: float):
        wd = float(weight_decay)
        if not (wd >= 0 and math.isfinite(wd)):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
        self.weight_decay = wd

    def update(self, updates, states, params, ctx: StepContext):
        if self.weight_decay == 0:
            return list(updates)
        return [u - (lr * self.weight_decay) * p for u, p, lr in zip(updates, params, ctx.lrs)]


def add_decayed_weights(weight_decay: float) -> DecoupledWeightDecay:
    """Factory for :class:`DecoupledWeightDecay` (optax's name)."""
    return DecoupledWeightDecay(weight_decay)
