"""Adam's moment estimates and update direction, with optional DP bias correction.

Adam (Kingma & Ba 2015, Algorithm 1)::

    m_t = β1 m_{t−1} + (1−β1) g̃_t ;   v_t = β2 v_{t−1} + (1−β2) g̃_t²
    m̂_t = m_t/(1−β1^t) ;  v̂_t = v_t/(1−β2^t) ;  u_t = m̂_t / (√v̂_t + ε)

DP-AdamBC (Tang, Shpilevskiy, Lécuyer, AAAI 2024, eq. (8) of
DP-MacAdam (arXiv:2606.05435)): u_t = m̂_t / √max(v̂_t − Φ, γ′) with Φ the
per-coordinate variance of the DP noise in g̃ (Φ = (σC/B̄)² for flat clipping;
read from the Release as ``noise_std²`` so it is right for every geometry).
"""

from __future__ import annotations

import torch

from .base import StepContext, Transform

__all__ = ["ScaleByAdam"]


class ScaleByAdam(Transform):
    """Adam direction m̂/(√v̂ + ε), or with ``noise_correction`` the AdamBC direction.

    Args:
        betas: (β1, β2) in [0, 1). eps: ε > 0 (Adam only; 1e-8).
        noise_correction: if True, use m̂/√max(v̂ − Φ, γ′) (DP-AdamBC).
        gamma_prime: γ′ > 0, floor of the corrected second moment (1e-8).
    State: ``exp_avg`` m, ``exp_avg_sq`` v, ``step`` t (all param-shaped / int).

    Raises:
        ValueError: for betas outside [0, 1) or non-positive eps / gamma_prime.
    """

    name = "scale_by_adam"

    def __init__(
        self, betas=(0.9, 0.999), eps: float = 1e-8, noise_correction: bool = False, gamma_prime: float = 1e-8
    ):
        b1, b2 = (float(b) for b in betas)
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not eps > 0 or not gamma_prime > 0:
            raise ValueError("eps and gamma_prime must be > 0")
        self.betas, self.eps = (b1, b2), float(eps)
        self.noise_correction, self.gamma_prime = bool(noise_correction), float(gamma_prime)

    def init(self, param):
        return {"step": 0, "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}

    def update(self, updates, states, params, ctx: StepContext):
        b1, b2 = self.betas
        out = []
        for g, st, std in zip(updates, states, ctx.noise_std):
            st["step"] += 1
            t = st["step"]
            st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            m_hat = st["exp_avg"] / (1 - b1**t)
            v_hat = st["exp_avg_sq"] / (1 - b2**t)
            if self.noise_correction:
                out.append(m_hat / torch.clamp(v_hat - std**2, min=self.gamma_prime).sqrt())
            else:
                out.append(m_hat / (v_hat.sqrt() + self.eps))
        return out
