"""AdaClip (Pichapati et al. 2019): coordinate-wise shift/scale clipping, plain SGD.

docs/algorithms.md "AdaClip"; DP-MacAdam (arXiv:2606.05435) eqs. (6)-(7). The
Privatizer clips and noises in the geometry this transform feeds back
(shift m, scale b)::

    w_i = (g_i − m) / b ,  w̄_i = w_i / max(1, ‖w_i‖ / C)       (C = 1: unit sensitivity)
    w̃   = (Σ_i w̄_i + N(0, σ²C² I)) / B̄ ,   g̃ = b ⊙ w̃ + m      (the Release)

Given g̃_t (released), this transform returns g̃_t unchanged (plain SGD: the
−lr comes from a following ``scale_by_lr``) and updates the running estimates
used for the NEXT step's geometry::

    v_t = clamp((g̃_t − m_{t−1})² − Φ_t, h1, h2)     Φ_t = b_{t−1}² σ² C² / B̄²  (noise_std²)
    m_t = β1 m_{t−1} + (1−β1) g̃_t
    s_t = β2 s_{t−1} + (1−β2) v_t
    b_t = s_t^{1/4} · (Σ_j s_{t,j}^{1/2})^{1/2}        (sum over ALL coordinates of the model)

b_t minimises the total noise Σ_j b_j² subject to Σ_j s_j / b_j² ≤ 1.
Defaults (not in the sources; docs/algorithms.md): β1 = 0.9, β2 = 0.99, h1/h2 as
for DP-MacAdam, m_0 = s_0 = 0, b_0 = (1/d)·1 with d the number of trainable
parameters.
"""

from __future__ import annotations

import torch

from .base import StepContext
from .geometry import ShiftScaleFeedback, noise_optimal_scale

__all__ = ["AdaClip"]


class AdaClip(ShiftScaleFeedback):
    """AdaClip's running mean/variance estimates and clip geometry; identity on the update.

    Args:
        betas: (β1, β2) in [0, 1): EMA rates of the mean m and of the variance s.
        h1, h2: clamp bounds of the instantaneous variance v, 0 < h1 ≤ h2
            (units: squared gradient coordinates).

    State per parameter (all param-shaped): ``step``, ``center`` (m),
    ``var_ema`` (s), ``scale`` (b; set to 1/d on first use).

    Raises:
        ValueError: betas outside [0, 1) or not 0 < h1 ≤ h2.

    Source: Pichapati, Suresh, Yu, Reddi, Kumar, "AdaCliP: Adaptive Clipping
    for Private SGD" (arXiv:1908.07643), Algorithm 1; decisions in docs/algorithms.md.
    """

    name = "adaclip"

    def __init__(self, betas=(0.9, 0.99), h1: float = 1e-9, h2: float = 1e-6):
        b1, b2 = (float(b) for b in betas)
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not (0 < float(h1) <= float(h2)):
            raise ValueError(f"need 0 < h1 <= h2, got h1={h1}, h2={h2}")
        self.betas, self.h1, self.h2 = (b1, b2), float(h1), float(h2)

    def init(self, param):
        return {"step": 0, "center": torch.zeros_like(param), "var_ema": torch.zeros_like(param), "scale": None}

    def update(self, updates, states, params, ctx: StepContext):
        self.ensure_scale(states, params)
        b1, b2 = self.betas
        for g, st, std in zip(updates, states, ctx.noise_std):
            st["step"] += 1
            v = torch.clamp((g - st["center"]) ** 2 - std**2, min=self.h1, max=self.h2)
            st["center"] = b1 * st["center"] + (1 - b1) * g
            st["var_ema"].mul_(b2).add_(v, alpha=1 - b2)
        for st, b in zip(states, noise_optimal_scale([st["var_ema"] for st in states])):
            st["scale"] = b
        return list(updates)
