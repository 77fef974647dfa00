"""Shared pieces of the transforms that feed a coordinate-wise clip geometry back (AdaClip, DP-MacAdam).

Both keep per-parameter ``center`` (the shift m) and ``scale`` (b) in their
state, start from b_0 = (1/d)·1 with d the number of trainable parameters
(docs/algorithms.md), and set b from a variance estimate s by

    b = s^{1/4} · (Σ_j s_j^{1/2})^{1/2}

the minimiser of the total noise Σ_j b_j² subject to Σ_j s_j/b_j² ≤ 1
(Pichapati et al. 2019, AdaClip; line 22 of Algorithm 1 in arXiv:2606.05435).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .base import ClipGeometry, Transform

__all__ = ["ShiftScaleFeedback", "noise_optimal_scale"]


def noise_optimal_scale(variances: Sequence[Tensor]) -> list[Tensor]:
    """b = s^{1/4}·(Σ_j s_j^{1/2})^{1/2} over ALL coordinates of all tensors (inputs unchanged).

    Args:
        variances: per-parameter variance estimates s ≥ 0 (param-shaped).

    Returns:
        One scale tensor per input, same shapes.
    """
    roots = torch._foreach_sqrt(list(variances))
    total = sum(float(r.sum()) for r in roots) ** 0.5
    torch._foreach_sqrt_(roots)
    torch._foreach_mul_(roots, total)
    return roots  # type: ignore[return-value]


class ShiftScaleFeedback(Transform):
    """Base class: state ``center``/``scale`` → ``ClipGeometry(shift=center, scale=scale)``.

    Subclasses set ``state["scale"] = None`` in :meth:`init`; the first call of
    :meth:`geometry` or :meth:`ensure_scale` fills b_0 = 1/d.
    """

    @staticmethod
    def ensure_scale(states: Sequence[dict], params: Sequence[Tensor]) -> None:
        """Initialise b_0 = (1/d)·1 on first use (d = total parameters of this transform)."""
        if states and states[0]["scale"] is None:
            d = sum(p.numel() for p in params)
            for st, p in zip(states, params):
                st["scale"] = torch.full_like(p, 1.0 / d)

    def geometry(self, states, params) -> Optional[ClipGeometry]:
        """(shift, scale) = (m_{t−1}, b_{t−1}) for the next release."""
        self.ensure_scale(states, params)
        return ClipGeometry(tuple(st["center"] for st in states), tuple(st["scale"] for st in states))
