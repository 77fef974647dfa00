"""DP-MuonBC: DP-Muon with the leading heat-smoothing bias of the orthogonalization removed.

**Provenance — read this first.** Kim & Fan, "DP-Muon: Differentially Private Optimization via
Matrix-Orthogonalized Momentum" (arXiv:2605.12994, May 2026) show that the DP-induced bias of
DP-Muon sits after the nonlinear Newton–Schulz map — Gaussian noise acts on it as a matrix-valued
heat smoothing — and propose DP-MuonBC, which removes the leading output-level bias term. dpopt
could read only the paper's abstract (the stored copies available offline end there); its exact
correction and equation numbers could NOT be consulted. What follows is therefore **dpopt's own
derivation** of the leading-order correction that the abstract describes; it is labelled as such
everywhere (docstrings, ``dpopt methods``, docs/methods.md) and is checked numerically by Monte
Carlo in tests/transforms/test_muon_bc.py, not by comparison with the paper.

Derivation (dpopt). Let the Muon input be U = Ū + N with N i.i.d. N(0, s²) entries (s² the
public noise variance of U, below) and f the polar factor, f(X) = P Qᵀ for X = P Σ Qᵀ (Newton–
Schulz's fixed point). Heat smoothing: E f(Ū + N) = exp((s²/2) Δ) f(Ū) = f(Ū) + (s²/2) Δf(Ū) +
O(s⁴), Δ the Laplacian over the m·n entries. Orthogonal invariance of N reduces Δf(Ū) to Ū's
singular values; the second derivatives of f along single-entry perturbations of diag(σ) are
(2×2 and 1×2 blocks, exact)::

    (D1)  ∂²f_ii/∂E_ij² = ∂²f_ii/∂E_ji² = −1/(σ_i + σ_j)²     (j ≠ i, j ≤ m)
    (D2)  ∂²f_ii/∂E_ik² = −1/σ_i²                           (k > m: the n − m extra columns)
    (D3)  all other second derivatives of f_ii vanish; off-diagonal entries have Δf_ij = 0 (sign symmetry)

so, for Ū = P diag(σ) Qᵀ of shape m × n (m ≤ n after an optional transpose)::

    (D4)  E f(Ū + N) = P diag(1 − s² κ_i) Qᵀ + O(s⁴),
          κ_i = Σ_{j≠i} 1/(σ_i + σ_j)²  +  (n − m) / (2 σ_i²)

— the noise SHRINKS every singular direction of the update, the weak ones most. (For a vector,
m = 1: E[x/‖x‖] ≈ (1 − (n−1)s²/(2‖x̄‖²)) x̄/‖x̄‖, the classical result.) The bias-corrected map
subtracts the leading term, f_BC = f − (s²/2) Δf, evaluated at the released U (the plug-in error
is O(s⁴))::

    (D5)  O_BC = O + scale · P diag(c_i) Qᵀ,     c_i = min(s² κ_i(σ(U)), max_correction)

with O the DP-Muon output (Newton–Schulz or exact polar, times Muon's shape scale) and P, σ, Q
the SVD of U. The cap ``max_correction`` (dpopt's, default 0.5) keeps the expansion where it is
meaningful: near the noise floor s²κ_i is not small and (D4) no longer holds. With Newton–Schulz
the correction is that of its fixed point (the exact polar factor), added to NS's output.

The noise variance s² of U (post-processing of public constants only). The release carries the
per-coordinate noise std σC/B̄ of g̃ (``ctx.noise_std``; its mean square over the matrix is used
when it varies per coordinate). The noise of U is a linear, time-varying filter of the releases'
independent noises: with the noise parts x_t = (m_t, M_t) of an optional first-order input filter
(DiSK: m_t = (1−κ) m_{t−1} + κ ε_t, m_1 = ε_1; DOPPLER EMA: m_t = −a_1 m_{t−1} + b_0 ε_t, read out
as m_t/u_t) and of the EMA momentum M_t = β M_{t−1} + (1−β) f_t, the 2 × 2 covariance P_t is
propagated exactly::

    (D6)  P_t = A_t P_{t−1} A_tᵀ + B_t B_tᵀ v_t,   s_t² = c_tᵀ P_t c_t
          A_t = [[α_t, 0], [(1−β) α_t/u_t, β]],  B_t = [k_t, (1−β) k_t/u_t]ᵀ,
          c_t = [(1−β)/u_t, β]ᵀ (Nesterov: U = (1−β) f_t + β M_t)  or  [0, 1]ᵀ (U = M_t)

(no filter: α = 0, k = 1, u = 1). O(1) state and cost per step and parameter.

Reductions (tests): ``correction=False`` is DP-Muon exactly; at σ = 0 (s² = 0) it is Muon exactly.
"""

from __future__ import annotations

import math
from typing import Optional, cast

import torch
from torch import Tensor

from .base import StepContext
from .muon import ScaleByMuon
from .newton_schulz import NS_COEFFICIENTS, NS_EPS, as_matrix

__all__ = ["ScaleByMuonBC", "heat_bias_factors", "heat_bias_correction", "INPUT_FILTERS"]

INPUT_FILTERS = ("none", "disk", "iir1")


def heat_bias_factors(singular_values: Tensor, rows: int, cols: int) -> Tensor:
    """κ_i of (D4) (dpopt's derivation; module docstring): the leading shrinkage per unit noise variance.

    Args:
        singular_values: ``[k]`` singular values σ_i ≥ 0 of an ``rows × cols`` matrix, k = min(rows, cols).
        rows, cols: the matrix shape (the count n − m of extra dimensions is |rows − cols|).

    Returns:
        ``[k]`` tensor κ_i = Σ_{j≠i} (σ_i+σ_j)^−2 + |rows−cols| / (2σ_i²), in 1/(gradient units)²;
        +inf where σ_i = 0.

    Raises:
        ValueError: ``singular_values`` not 1-D or of length ≠ min(rows, cols).
    """
    s = singular_values
    if s.dim() != 1 or s.numel() != min(rows, cols):
        raise ValueError(f"need the min(rows, cols) = {min(rows, cols)} singular values, got shape {tuple(s.shape)}")
    pair = (s[:, None] + s[None, :]).square()
    off = ~torch.eye(s.numel(), dtype=torch.bool, device=s.device)
    inv = torch.where(off, 1.0 / pair, torch.zeros_like(pair))
    return inv.sum(dim=1) + abs(rows - cols) / (2.0 * s.square())


def heat_bias_correction(u: Tensor, noise_var: float, max_correction: float = 0.5) -> Tensor:
    """The correction term P diag(c_i) Qᵀ of (D5) for one weight-shaped tensor (before Muon's scale).

    Args:
        u: the Muon input U (≥ 2-D; flattened by :func:`~dpopt.transforms.newton_schulz.as_matrix`).
        noise_var: s², the variance of each entry's noise in U (units of U squared); ≥ 0.
        max_correction: cap on c_i = s²κ_i (≥ 0).

    Returns:
        tensor of ``u``'s shape and dtype; zeros when ``noise_var`` = 0.

    Raises:
        ValueError: negative ``noise_var`` or ``max_correction``.
    """
    if not noise_var >= 0 or not max_correction >= 0:
        raise ValueError(f"noise_var and max_correction must be >= 0, got {noise_var}, {max_correction}")
    if noise_var == 0 or max_correction == 0:
        return torch.zeros_like(u)
    m = as_matrix(u)
    if m.dtype not in (torch.float32, torch.float64):  # half precisions: the SVD in float32
        m = m.float()
    p, s, qh = torch.linalg.svd(m, full_matrices=False)
    kappa = heat_bias_factors(s, m.shape[0], m.shape[1])
    c = torch.clamp(noise_var * kappa, max=float(max_correction))
    c = torch.where(s > 0, c, torch.zeros_like(c))  # a zero direction has no polar factor to correct
    return ((p * c) @ qh).to(u.dtype).reshape(u.shape)


class ScaleByMuonBC(ScaleByMuon):
    """DP-Muon's direction with the leading heat-smoothing bias removed (DP-MuonBC; dpopt's derivation).

    Algorithm per hidden matrix (module docstring for the equations)::

        M ← β M + (1−β) g̃ ;  U ← (1−β) g̃ + β M (Nesterov) or M
        O ← NS5(U) · √max(1, rows/cols)                                   (DP-Muon)
        s² ← c_tᵀ P_t c_t                                                  (D6), from ctx.noise_std
        O ← O + √max(1, rows/cols) · P diag(min(s² κ_i, max_correction)) Qᵀ   (D4)–(D5), U = P Σ Qᵀ

    Args:
        momentum, nesterov, ns_steps, orthogonalizer, ns_coefficients, eps: as
            :class:`~dpopt.transforms.muon.ScaleByMuon` (scaling is ``"shape"``).
        correction: apply (D5) (False: exactly DP-Muon).
        max_correction: cap on each c_i (dpopt's; ≥ 0; 0.5).
        input_filter: the linear filter between the release and this transform, for (D6):
            ``"none"``; ``"disk"`` (needs ``filter_kappa``: DiSK's κ); ``"iir1"`` (a first-order
            DOPPLER filter: needs ``filter_a1``, ``filter_b0``; bias-corrected read-out m_t/u_t).
        filter_kappa, filter_a1, filter_b0: the filter's coefficients (see ``input_filter``).

    State per parameter: ``momentum_buffer``; ``noise_cov`` (2 × 2 float64, P_t of (D6));
    ``unit`` (u_t of the DOPPLER read-out, float).

    Raises:
        ValueError: invalid hyperparameters (those of ScaleByMuon; a negative ``max_correction``;
            an unknown ``input_filter`` or missing/invalid coefficients).

    Source: Kim & Fan, arXiv:2605.12994 (2026) — the idea (output-level heat-smoothing bias after
    Newton–Schulz, removed at no privacy cost); the correction formulas (D1)–(D6) are dpopt's own
    derivation (the paper's equations could not be consulted).
    """

    name = "scale_by_muon_bc"

    def __init__(
        self,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        orthogonalizer: str = "newton-schulz",
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        correction: bool = True,
        max_correction: float = 0.5,
        input_filter: str = "none",
        filter_kappa: Optional[float] = None,
        filter_a1: Optional[float] = None,
        filter_b0: Optional[float] = None,
    ):
        super().__init__(momentum, nesterov, ns_steps, "shape", orthogonalizer, ns_coefficients, eps)
        if not (float(max_correction) >= 0 and math.isfinite(float(max_correction))):
            raise ValueError(f"max_correction must be a finite number >= 0, got {max_correction}")
        if input_filter not in INPUT_FILTERS:
            raise ValueError(f"input_filter must be one of {INPUT_FILTERS}, got {input_filter!r}")
        if input_filter == "disk" and not (filter_kappa is not None and 0 < float(filter_kappa) <= 1):
            raise ValueError(f"input_filter='disk' needs filter_kappa in (0, 1], got {filter_kappa!r}")
        if input_filter == "iir1" and not (
            filter_a1 is not None and filter_b0 is not None and abs(float(filter_a1)) < 1 and float(filter_b0) != 0
        ):
            raise ValueError(
                f"input_filter='iir1' needs |filter_a1| < 1 and filter_b0 != 0, got {filter_a1!r}, {filter_b0!r}"
            )
        self.correction, self.max_correction = bool(correction), float(max_correction)
        self.input_filter = input_filter
        self.filter_kappa = None if filter_kappa is None else float(filter_kappa)
        self.filter_a1 = None if filter_a1 is None else float(filter_a1)
        self.filter_b0 = None if filter_b0 is None else float(filter_b0)

    def init(self, param: Tensor) -> dict:
        state = super().init(param)
        state["noise_cov"] = torch.zeros(2, 2, dtype=torch.float64)
        state["unit"] = 0.0
        return state

    def _filter_step(self, st: dict) -> tuple[float, float, float]:
        """(α_t, k_t, u_t) of the input filter's noise recursion at this step (D6)."""
        if self.input_filter == "disk":
            first = st["unit"] == 0.0
            st["unit"] = 1.0
            kappa = float(cast(float, self.filter_kappa))  # checked in __init__
            return (0.0, 1.0, 1.0) if first else (1.0 - kappa, kappa, 1.0)
        if self.input_filter == "iir1":
            a1, b0 = float(cast(float, self.filter_a1)), float(cast(float, self.filter_b0))  # checked in __init__
            u = b0 - a1 * st["unit"]
            st["unit"] = u
            return -a1, b0, u
        return 0.0, 1.0, 1.0

    def noise_variance(self, st: dict, v: float) -> float:
        """Advance (D6) by one release of per-entry noise variance ``v``; return s_t² of U."""
        alpha, k, u = self._filter_step(st)
        beta = self.momentum
        a = torch.tensor([[alpha, 0.0], [(1 - beta) * alpha / u, beta]], dtype=torch.float64)
        b = torch.tensor([k, (1 - beta) * k / u], dtype=torch.float64)
        cov = a @ st["noise_cov"] @ a.T + torch.outer(b, b) * v
        st["noise_cov"] = cov
        c = torch.tensor([(1 - beta) / u, beta] if self.nesterov else [0.0, 1.0], dtype=torch.float64)
        return float(c @ cov @ c)

    def update(self, updates, states, params, ctx: StepContext):
        out = super().update(updates, states, params, ctx)
        beta = self.momentum
        stds = list(ctx.noise_std) if ctx.noise_std else [None] * len(updates)
        res = []
        for g, st, o, std in zip(updates, states, out, stds):
            v = 0.0 if std is None else float(torch.as_tensor(std, dtype=torch.float64).square().mean())
            s2 = self.noise_variance(st, v)
            if self.correction and s2 > 0:
                buf = st["momentum_buffer"]
                u = (1.0 - beta) * g + beta * buf if self.nesterov else buf
                rows, cols = as_matrix(u).shape
                o = o + math.sqrt(max(1.0, rows / cols)) * heat_bias_correction(u, s2, self.max_correction)
            res.append(o)
        return res
