"""SGD pieces: learning-rate scaling and heavy-ball momentum.

Source: Polyak 1964 (heavy ball); torch.optim.SGD's momentum/dampening form.
"""

from __future__ import annotations

import torch

from .base import StepContext, Transform

__all__ = ["ScaleByLearningRate", "Momentum", "scale_by_lr"]


class ScaleByLearningRate(Transform):
    """u ← −lr · u, with lr read from the optimizer's param groups (schedulers work).

    Args:
        multiplier: constant factor on top of the group lr (e.g. for a
            secondary optimizer inside a partition); must be > 0.
    """

    name = "scale_by_lr"

    def __init__(self, multiplier: float = 1.0):
        if not multiplier > 0:
            raise ValueError(f"lr multiplier must be > 0, got {multiplier}")
        self.multiplier = float(multiplier)

    def update(self, updates, states, params, ctx: StepContext):
        return torch._foreach_mul(list(updates), [-(lr * self.multiplier) for lr in ctx.lrs])

    def apply(self, updates, states, params, ctx: StepContext) -> None:
        """``p ← p − lr·u`` in place, one ``_foreach_add_`` per distinct lr: no scaled copy of the updates is made."""
        by_lr: dict[float, list[int]] = {}
        for i, lr in enumerate(ctx.lrs[: len(params)]):
            by_lr.setdefault(lr, []).append(i)
        for lr, idx in by_lr.items():
            torch._foreach_add_([params[i] for i in idx], [updates[i] for i in idx], alpha=-(lr * self.multiplier))


def scale_by_lr(multiplier: float = 1.0) -> ScaleByLearningRate:
    """Factory for :class:`ScaleByLearningRate`."""
    return ScaleByLearningRate(multiplier)


class Momentum(Transform):
    """Heavy-ball momentum: buf ← μ·buf + u (buf_1 = u); output buf (or u + μ·buf if nesterov).

    Args:
        momentum: μ ∈ [0, 1). nesterov: use the Nesterov form.
    State: ``momentum_buffer`` (param-shaped).
    """

    name = "momentum"

    def __init__(self, momentum: float = 0.9, nesterov: bool = False):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum, self.nesterov = float(momentum), bool(nesterov)

    def init(self, param):
        return {"momentum_buffer": None}

    def update(self, updates, states, params, ctx):
        out = []
        for u, st in zip(updates, states):
            buf = st["momentum_buffer"]
            buf = u.clone() if buf is None else self.momentum * buf + u
            st["momentum_buffer"] = buf
            out.append(u + self.momentum * buf if self.nesterov else buf)
        return out
