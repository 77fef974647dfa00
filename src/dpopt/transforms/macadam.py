"""DP-MacAdam: Adam moments that also drive AdaClip's coordinate-wise clip geometry.

DP-MacAdam (arXiv:2606.05435), Algorithm 1 (lines 8–22), with the decisions of
docs/algorithms.md. Given the release g̃_t (lines 8–13 are the Privatizer's, in the
geometry ``(shift, scale) = (m̂_{t−1}, b_{t−1})`` that this transform feeds back)::

    14  m_t = β1 m_{t−1} + (1−β1) g̃_t
    15  v_t = β2 v_{t−1} + (1−β2) g̃_t²
    16  m̂_t = m_t/(1−β1^t),  v̂_t = v_t/(1−β2^t)
    17  direction = m̂_t/(√v̂_t + γ)          (AdamBC: m̂_t/√max(v̂_t − Φ_t, γ′))
    18  u_t = (g̃_t − m̂_t)²                   ("paper")
        u_t = (g̃_t − m̂_{t−1})⊙(g̃_t − m̂_t)    ("unbiased", West 1979)
    19  s_t = β1 s_{t−1} + (1−β1) u_t
    20  κ_t = 2(β1 − β1^t)/(1+β1)
    21  ŝ_t = clamp(s_t/κ_t − Φ_t, h1, h2),  Φ_t = b_{t−1}²σ²/B̄² (the release's noise_std²)
    22  b_t = ŝ_t^{1/4} · (Σ_j ŝ_{t,j}^{1/2})^{1/2}    (sum over ALL coordinates)

Option ``center_shrinkage`` (dpopt's, not the paper's; docs/results/macadam-high-noise): the clip centre
fed back is λ_t⊙m̂_t instead of m̂_t, with the positive-part James–Stein gain per coordinate

    λ_t = clamp(1 − V_t/m̂_t², 0, 1),   V_t = N_t/(1−β1^t)²,
    N_t = (β1 + (1−β1)·λ_{t−1}/(1−β1^{t−1}))²·N_{t−1} + (1−β1)²·Φ_t,   N_0 = 0,

where N_t is the variance of the DP noise carried by m_t. Since g̃_t = c_{t−1} + b_{t−1}⊙w̃_t re-adds the
centre c_{t−1}, with the paper's c = m̂ the EMA m_t ≈ m_{t−1} + (1−β1)b⊙w̃_t never forgets its noise (N_t
grows ∝ t, a random walk that the Adam step then follows); with the shrunk centre the noise that is not
distinguishable from the signal is not re-added, and m forgets it at rate (1−β1)(1−λ). N_t is computed from
public σ, B̄ and the released scales only (post-processing: no privacy cost); the recursion treats λ as
fixed given the past (approximate, since λ itself depends on earlier noise).

Option ``noise_subtraction`` (dpopt's; docs/results/macadam-high-noise): ``"last"`` (the paper's line 21)
subtracts Φ_t = b_{t−1}²σ²/B̄², the noise variance of the LAST release only, from s_t/κ_t, an EMA over
the releases of about 1/(1−β1) steps made with earlier scales; the paper's derivation assumes b constant.
``"ema"`` subtracts the same EMA of the releases' noise variances, Φ̄_t = q_t/(1−β1^t) with
q_t = β1 q_{t−1} + (1−β1)Φ_t (equal to Φ_t while b is constant), and, for the AdamBC update, the β2 EMA
Φ̄₂_t = q₂_t/(1−β2^t) from v̂_t. With "last" and dσ²/B̄² ≫ 1 (MNIST MLP, B̄ = 256, σ = 2: 48.5) a large
b_{t−1} makes every ŝ_t negative (→ h1, small b_t) and a small one makes them all large (→ h2): b flips
between the two clamps every step; "ema" responds to the last release with weight 1−β1, like s itself.

Initialisation (line 3): m = v = s = 0, m̂_0 = 0, b_0 = (1/d)·1 with d the
number of trainable parameters. At t = 1, κ_1 = 0 and s_1 = 0, so the b update
is skipped (b_1 = b_0); it is also skipped while κ_t ≤ 1e-12 and for the first
``b_warmup_steps`` steps. The learning rate is applied by a following
:class:`~dpopt.transforms.sgd.ScaleByLearningRate`.
"""

from __future__ import annotations

import torch

from .base import StepContext
from .geometry import ShiftScaleFeedback, noise_optimal_scale

__all__ = ["MacAdam", "VARIANCE_UPDATES", "NOISE_SUBTRACTIONS"]

VARIANCE_UPDATES = ("paper", "unbiased")
NOISE_SUBTRACTIONS = ("last", "ema")
KAPPA_FLOOR = 1e-12


class MacAdam(ShiftScaleFeedback):
    """DP-MacAdam's post-processing: Adam direction + clip geometry for the next step.

    Args:
        betas: (β1, β2) in [0, 1); β1 also drives the variance EMA s (line 19).
        gamma: γ > 0, Adam's stability constant (1e-8).
        h1, h2: clamp bounds of ŝ, 0 < h1 ≤ h2 (MNIST: 1e-9, 1e-6; CIFAR-10: 5e-5, 1.0).
        variance_update: ``"paper"`` (line 18 as written, biased low) or
            ``"unbiased"``.
        bias_correction: if True, DP-MacAdamBC's update m̂/√max(v̂ − Φ, γ′).
        gamma_prime: γ′ > 0 for the BC update.
        b_warmup_steps: keep b = b_0 for this many steps (≥ 0).
        center_shrinkage: if True, feed back the noise-aware centre λ⊙m̂ (module docstring) instead
            of m̂ (False: the paper's Algorithm 1).
        noise_subtraction: ``"last"`` (the paper's Φ_t) or ``"ema"`` (the EMA of the releases'
            noise variances; module docstring).

    State per parameter: ``step``, ``exp_avg`` (m), ``exp_avg_sq`` (v),
    ``var_ema`` (s), ``center`` (the clip centre: m̂_{t−1}, or λ⊙m̂_{t−1} with
    ``center_shrinkage``), ``scale`` (b_{t−1}), all param-shaped; with
    ``center_shrinkage`` also ``center_noise_var`` (N_{t−1}) and ``center_gain`` (λ_{t−1}); with
    ``noise_subtraction="ema"`` also ``noise_var_ema`` (q) and ``noise_var_ema_sq`` (q₂).

    Raises:
        ValueError: on invalid hyperparameters.
    """

    name = "macadam"

    def __init__(
        self,
        betas=(0.9, 0.999),
        gamma: float = 1e-8,
        h1: float = 1e-9,
        h2: float = 1e-6,
        variance_update: str = "paper",
        bias_correction: bool = False,
        gamma_prime: float = 1e-8,
        b_warmup_steps: int = 0,
        center_shrinkage: bool = False,
        noise_subtraction: str = "last",
    ):
        b1, b2 = (float(b) for b in betas)
        if not (0.0 < b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must satisfy 0 < β1 < 1, 0 ≤ β2 < 1, got {betas}")
        if not (0 < float(h1) <= float(h2)):
            raise ValueError(f"need 0 < h1 <= h2, got h1={h1}, h2={h2}")
        if variance_update not in VARIANCE_UPDATES:
            raise ValueError(f"variance_update must be one of {VARIANCE_UPDATES}, got {variance_update!r}")
        if not gamma > 0 or not gamma_prime > 0:
            raise ValueError("gamma and gamma_prime must be > 0")
        if noise_subtraction not in NOISE_SUBTRACTIONS:
            raise ValueError(f"noise_subtraction must be one of {NOISE_SUBTRACTIONS}, got {noise_subtraction!r}")
        if int(b_warmup_steps) < 0:
            raise ValueError("b_warmup_steps must be >= 0")
        self.betas, self.gamma = (b1, b2), float(gamma)
        self.h1, self.h2 = float(h1), float(h2)
        self.variance_update = variance_update
        self.bias_correction, self.gamma_prime = bool(bias_correction), float(gamma_prime)
        self.b_warmup_steps = int(b_warmup_steps)
        self.center_shrinkage = bool(center_shrinkage)
        self.noise_subtraction = noise_subtraction

    def init(self, param):
        z = lambda: torch.zeros_like(param)  # noqa: E731
        state = {"step": 0, "exp_avg": z(), "exp_avg_sq": z(), "var_ema": z(), "center": z(), "scale": None}
        if self.center_shrinkage:
            state.update(center_noise_var=z(), center_gain=z())
        if self.noise_subtraction == "ema":
            state.update(noise_var_ema=z(), noise_var_ema_sq=z())
        return state

    def kappa(self, t: int) -> float:
        """κ_t = 2(β1 − β1^t)/(1+β1) (line 20; Appendix A of the paper)."""
        b1 = self.betas[0]
        return 2.0 * (b1 - b1**t) / (1.0 + b1)

    def update(self, updates, states, params, ctx: StepContext):
        """Lines 14–22 for every parameter at once.

        Each line is one ``torch._foreach_*`` call over all parameters (one kernel launch per
        parameter inside torch, no Python loop per parameter), with the same elementwise
        operations in the same order as the per-parameter form — the values are bit-identical to it
        (``tests/transforms/test_macadam_fused.py``).
        """
        self.ensure_scale(states, params)
        b1, b2 = self.betas
        t = states[0]["step"] + 1
        kappa = self.kappa(t)
        update_b = kappa > KAPPA_FLOOR and t > self.b_warmup_steps
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        g = list(updates)
        for st in states:
            st["step"] = t
        stds = list(ctx.noise_std)
        phi = torch._foreach_mul(stds, stds)  # Φ_t = b_{t−1}²σ²/B̄², the release's noise variance
        if self.center_shrinkage:
            m_prev_hat = [
                st["exp_avg"] / (1 - b1 ** (t - 1)) if t > 1 else torch.zeros_like(x) for st, x in zip(states, g)
            ]
            for st, ph in zip(states, phi):
                self._track_center_noise(st, ph, t)
        else:
            m_prev_hat = [st["center"] for st in states]
        phi_v = phi  # the noise variance subtracted from v̂ (AdamBC form)
        if self.noise_subtraction == "ema":  # the noise variances averaged as s and v average the releases
            q, q2 = [st["noise_var_ema"] for st in states], [st["noise_var_ema_sq"] for st in states]
            torch._foreach_mul_(q, b1)
            torch._foreach_add_(q, phi, alpha=1 - b1)
            torch._foreach_mul_(q2, b2)
            torch._foreach_add_(q2, phi, alpha=1 - b2)
            phi, phi_v = torch._foreach_div(q, bc1), torch._foreach_div(q2, bc2)
        m, v, s = ([st[k] for st in states] for k in ("exp_avg", "exp_avg_sq", "var_ema"))
        torch._foreach_mul_(m, b1)  # line 14
        torch._foreach_add_(m, g, alpha=1 - b1)
        torch._foreach_mul_(v, b2)  # line 15
        torch._foreach_addcmul_(v, g, g, value=1 - b2)
        m_hat = torch._foreach_div(m, bc1)  # line 16
        denom = torch._foreach_div(v, bc2)  # line 17
        if self.bias_correction:  # AdamBC form
            torch._foreach_sub_(denom, phi_v)
            torch._foreach_clamp_min_(denom, self.gamma_prime)
            torch._foreach_sqrt_(denom)
        else:
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, self.gamma)
        out = torch._foreach_div(m_hat, denom)
        u = torch._foreach_sub(g, m_hat)  # line 18
        if self.variance_update == "paper":
            torch._foreach_mul_(u, u)
        else:
            torch._foreach_mul_(u, torch._foreach_sub(g, m_prev_hat))
        torch._foreach_mul_(s, b1)  # line 19
        torch._foreach_add_(s, u, alpha=1 - b1)
        for st, mh in zip(states, m_hat):
            st["center"] = self._shrunk_center(st, mh, bc1) if self.center_shrinkage else mh
        if update_b:  # line 21: ŝ = clamp(s/κ − Φ, h1, h2); line 22: b = ŝ^{1/4} (Σ_j ŝ_j^{1/2})^{1/2}
            s_hat = torch._foreach_div(s, kappa)
            torch._foreach_sub_(s_hat, phi)
            torch._foreach_clamp_min_(s_hat, self.h1)
            torch._foreach_clamp_max_(s_hat, self.h2)
            for st, b in zip(states, noise_optimal_scale(s_hat)):
                st["scale"] = b
        return out

    def _track_center_noise(self, st: dict, phi, t: int) -> None:
        """N_t = (β1 + (1−β1)λ_{t−1}/(1−β1^{t−1}))²·N_{t−1} + (1−β1)²Φ_t: the DP-noise variance in m_t.

        g̃_t = c_{t−1} + b_{t−1}⊙w̃_t carries the centre's noise λ_{t−1}·(noise of m_{t−1})/(1−β1^{t−1})
        plus fresh noise of variance Φ_t; m_t = β1 m_{t−1} + (1−β1) g̃_t.
        """
        b1 = self.betas[0]
        n = st["center_noise_var"]
        if t > 1:
            a = st["center_gain"].mul(1 - b1).div_(1 - b1 ** (t - 1)).add_(b1)
            n.mul_(a.square_())
        n.add_(phi * (1 - b1) ** 2)

    def _shrunk_center(self, st: dict, m_hat, bc1: float):
        """λ_t⊙m̂_t with λ_t = clamp(1 − V_t/m̂_t², 0, 1), V_t = N_t/(1−β1^t)² (positive-part James–Stein)."""
        v = st["center_noise_var"] / (bc1 * bc1)
        gain = (1 - v / m_hat.square().clamp_min(1e-300)).clamp_(0.0, 1.0)
        st["center_gain"] = gain
        return gain * m_hat
