"""‖(e aᵀ − m)/b‖² for a batch of rank-one gradients: float32 speed with a guaranteed upper bound.

The fast engine's T = 1 closed form (layers.FactoredBlock) for a Linear weight
with a shift m (and a scale b) expands, per example i with e_i ∈ R^q, a_i ∈ R^p
and g_i = e_i a_iᵀ (AdaClip / DP-MacAdam geometry, issue 5)::

    N_i = ‖(g_i − m)/b‖² = quad_i − 2·lin_i + const,
    quad_i = Σ_jk e_ij² S_jk a_ik²,   lin_i = Σ_jk e_ij M_jk a_ik,   const = Σ_jk m_jk M_jk,
    S = 1/b²,  M = m/b²   (S = 1, M = m without a scale).

quad and lin are two [B, q] × [q, p] matrix products, the whole cost. The
expansion cancels when ‖g_i/b‖ ≫ ‖(g_i − m)/b‖, and a norm read too small
lets a clipped example exceed the clip bound C, so the sum must not simply be
evaluated in float32. Evaluating it all in float64 is exact enough but costs
2.5× the float32 products (the MNIST MLP: 21.6 ms of a 40 ms DP-MacAdam step).

What :func:`shifted_sq_norms` does for float32 inputs instead:

1. quad and lin in float32 (the two products), const in float64;
2. a rigorous bound on the rounding error of that evaluation (standard
   forward error analysis of sums of products, Higham 2002, *Accuracy and
   Stability of Numerical Algorithms*, §3.1, Lemma 3.1 / eq. (3.5)): each term
   of quad and lin passes through at most n = p + q + 8 roundings (the inputs'
   squares and quotients, the inner products over q and over p, in any
   summation order, with or without FMA), so with γ_n = n·u/(1 − n·u),
   u = 2⁻²⁴::

       |fl(quad) − quad| ≤ γ_n·quad,        quad ≤ fl(quad)/(1 − γ_n),
       |fl(lin) − lin|   ≤ γ_n·Σ_jk |e_ij M_jk a_ik| ≤ γ_n·√(quad·const)   (Cauchy–Schwarz),
       err_i := γ_n·(quad_i + 2√(quad_i·const) + const) ≥ |N̂_i − N_i|;

3. every row whose bound is not small next to its value (err_i > τ·N̂_i with
   τ = :data:`RECHECK_RTOL`, or N̂_i ≤ 0: the rows at risk of cancellation) is
   recomputed exactly in float64 from the same float32 inputs;
4. every other row returns N̂_i + err_i, rounded UP to float32: an upper bound
   of the exact N_i of the recorded e, a, m, b, larger by at most a relative
   2τ — so a clip factor computed from it is never too large (the clipped
   example's norm stays ≤ C), and at most ≈ τ smaller than the exact one.

The bound assumes IEEE float32 arithmetic in the products: with a reduced
matmul precision (``torch.set_float32_matmul_precision("high"|"medium")``,
TF32 or bf16 passes) :func:`shifted_sq_norms` uses float64 throughout.
Inputs in other dtypes (float64, bf16, fp16) are evaluated in float64; every
result below float64 is rounded up into its dtype (never to nearest), so the
float64 paths keep the upper bound too.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["RECHECK_RTOL", "shifted_sq_norms", "shift_terms", "rounding_bound", "round_up"]

RECHECK_RTOL = 1e-3
"""τ: rows whose float32 error bound exceeds τ·(their value) are recomputed in float64."""

_U32 = 2.0**-24  # unit roundoff of float32


def shift_terms(e: Tensor, a: Tensor, m: Tensor, b: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(quad [B], lin [B], const []) of the expansion (module docstring), in the inputs' dtype.

    Args:
        e: ``[B, q]`` output gradients; a: ``[B, p]`` layer inputs;
        m: ``[q, p]`` shift; b: ``[q, p]`` scale or None.

    ``const`` is accumulated in float64 whatever the dtype (its terms m·M carry the
    rounding of the dtype: within γ_8 relative, covered by :func:`rounding_bound`).
    """
    if b is None:
        quad = e.square().sum(1) * a.square().sum(1)
        lin = ((e @ m) * a).sum(1)
        const = torch.linalg.vector_norm(m.flatten(), dtype=torch.float64).square()
        return quad, lin, const
    sm = torch.empty((2, *b.shape), dtype=b.dtype, device=b.device)  # S and M in one buffer: one bmm
    torch.mul(b, b, out=sm[0]).reciprocal_()  # S = 1/b² (2 roundings; pow(b, −2) is 3× slower here)
    torch.mul(m, sm[0], out=sm[1])
    const = (m * sm[1]).sum(dtype=torch.float64)  # each term rounded ≤ 6 times; summed in float64
    left = torch.stack([e.square(), e])  # [2, B, q]
    right = torch.stack([a.square(), a])  # [2, B, p]
    quad, lin = (torch.bmm(left, sm) * right).sum(2)
    return quad, lin, const


def rounding_bound(quad: Tensor, const: Tensor, n: int, unit_roundoff: float = _U32) -> Tensor:
    """err_i ≥ |fl(quad − 2 lin + const) − exact| from the float32 quad (module docstring, step 2), float64 [B].

    Args:
        quad: ``[B]`` computed quad (any float dtype); const: computed const (float64 scalar,
            terms within γ_8 ≤ γ_n of exact);
        n: roundings per term (p + q + 8); unit_roundoff: u of the products' dtype.
    """
    nu = n * unit_roundoff
    if nu >= 0.5:
        raise ValueError(f"a {n}-term float32 inner product has no useful error bound")
    gamma = nu / (1.0 - nu)
    q = quad.double().clamp_min(0.0) / (1.0 - gamma)  # ≥ the exact quad
    c = const.double() / (1.0 - gamma) * (1.0 + 1e-12)  # ≥ the exact const (float64 summation: the 1e-12)
    return gamma * (q + 2.0 * torch.sqrt(q * c) + c)


def _exact(e: Tensor, a: Tensor, m: Tensor, b: Optional[Tensor]) -> Tensor:
    quad, lin, const = shift_terms(e.double(), a.double(), m.double(), None if b is None else b.double())
    return (quad - 2.0 * lin + const).clamp_min_(0.0)


def _ieee_float32_products(device: torch.device) -> bool:
    """True only when float32 matrix products on ``device`` are known to be IEEE float32.

    Reads the per-backend setting (``torch.backends.{cuda,mkldnn}.matmul.fp32_precision``:
    "tf32"/"bf16" are reduced) and the legacy global one (``"highest"``); when
    torch cannot say (it raises after a mix of the two APIs) the answer is no.
    """
    # torch.backends.mkldnn.matmul: torch >= 2.9; older torch has only the legacy global setting
    backend = torch.backends.cuda.matmul if device.type == "cuda" else getattr(torch.backends.mkldnn, "matmul", None)
    value = getattr(backend, "fp32_precision", None)
    if value not in (None, "none", "ieee"):
        return False
    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:  # legacy and new precision APIs both used
        return value == "ieee"


def shifted_sq_norms(
    e: Tensor, a: Tensor, m: Tensor, b: Optional[Tensor], rtol: float = RECHECK_RTOL
) -> tuple[Tensor, int]:
    """‖(e_i a_iᵀ − m)/b‖² for every example, never below the exact value (module docstring).

    Args:
        e: ``[B, q]``; a: ``[B, p]``; m: ``[q, p]`` shift; b: ``[q, p]`` scale or None
            (all one dtype and device).
        rtol: τ, the recheck threshold (> 0).

    Returns:
        (``[B]`` squared norms in e's dtype, number of rows recomputed in float64).
        float32: an upper bound, within a relative 2·rtol of the exact value;
        other dtypes: evaluated in float64 (the pre-existing exact path).

    Raises:
        ValueError: rtol ≤ 0.
    """
    if not rtol > 0:
        raise ValueError(f"rtol must be > 0, got {rtol}")
    dtype = e.dtype
    if dtype != torch.float32 or not _ieee_float32_products(e.device) or e.shape[0] == 0:
        return round_up(_exact(e, a, m, b), dtype), int(e.shape[0]) if dtype == torch.float32 else 0
    quad, lin, const = shift_terms(e, a, m, b)
    est = quad.double() - 2.0 * lin.double() + const
    err = rounding_bound(quad, const, n=e.shape[1] + a.shape[1] + 8)
    risky = ~(est > 0) | ~(err <= rtol * est)  # NaN-safe: a non-finite row is rechecked too
    out = est + err
    rows = risky.nonzero().flatten()
    if rows.numel():
        out[rows] = _exact(e[rows], a[rows], m, b)
    return round_up(out, dtype), int(rows.numel())


def round_up(x: Tensor, dtype: torch.dtype) -> Tensor:
    """float64 ``x`` in ``dtype``, rounded toward +∞ (a cast rounds to nearest: up to half an ulp below).

    nan stays nan, ±inf stay ±inf; a finite value above ``dtype``'s largest rounds to +inf."""
    if dtype == torch.float64:
        return x
    up = x.to(dtype)
    return torch.where(up.double() < x, torch.nextafter(up, torch.full_like(up, float("inf"))), up)
