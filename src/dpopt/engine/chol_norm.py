"""‖E_iᵀ A_i‖_F² through a Cholesky factor of the narrow side's Gram matrix: float32 speed, no cancellation.

A Linear layer applied over T positions has, per example i, inputs A_i ``[T, p]``, output gradients
E_i ``[T, q]`` and the weight gradient G_i = E_iᵀ A_i ``[q, p]``. With N the narrow side (A_i if p ≤ q,
else E_i; width n) and W the wide one (width w), K_i = N_i N_iᵀ (``[T, T]``) and K_i = L_i L_iᵀ::

    ‖G_i‖_F² = tr(W_iᵀ K_i W_i) = ‖L_iᵀ W_i‖_F²      (both sides: ‖E_iᵀA_i‖ = ‖A_iᵀE_i‖).

Costs per example: K_i in float64 (T²·n multiply-adds), its Cholesky factor (T³/3, float64), the
product L_iᵀ W_i in float32 (T²·w, of which the blocks below the diagonal of L_iᵀ are skipped: about
(1 + 1/k)/2 of it with k diagonal blocks) and the squares of that ``[T, w]`` product in float64 —
against T·p·q float32 for the direct form (materialised G_i) and T²·(p + q) float64 for the Gram form
‖G_i‖² = ⟨A_iA_iᵀ, E_iE_iᵀ⟩ (Li et al. 2022, §4), whose terms cancel and must be summed in float64.

**Why no cancellation.** The float32 part is a matrix product whose result's norm is read, as in the
direct form: its rounding moves the norm by a bound linear in the unit roundoff, never by a quadratic
one (the Gram form in float32 errs by ≈ u·(Σ_t ‖a_t‖‖e_t‖)², docs/performance.md). The float64 part
(K, jitter, Cholesky) sums terms of K's mixed signs, but in float64.

**K may be singular** (T > n, padding rows of zeros, repeated tokens): a diagonal jitter
J = diag(δ·(K_tt + tr K/T)) with δ = 2·T·(T + n + 1)·u₆₄ is added before factoring. Scaled to a unit
diagonal, K + J has smallest eigenvalue ≥ δ/(1 + δ), above the T·γ_{T+1} (Higham 2002, *Accuracy and
Stability of Numerical Algorithms*, Thm 10.7) that float64 Cholesky needs, plus the ≤ T·γ_n (scaled)
rounding of K itself; an example whose factorisation still fails (``cholesky_ex`` info ≠ 0, or
non-finite inputs) is evaluated by the float64 Gram form instead. The jitter only adds
tr(Wᵀ J W) = Σ_t J_tt ‖w_t‖² ≥ 0 to the norm (safe for clipping: a norm read too large clips more),
at most 2δ·‖N‖_F²‖W‖_F², and at least δ·(tr K/T)·‖W‖_F², which exceeds the float64 rounding of K and
of the factorisation (≤ (γ_n + γ_{T+1})·‖N‖_F²‖W‖_F², Higham Thm 10.3), so the float64 part returns
‖M_i‖ ≥ ‖G_i‖ for M_i = L̂_iᵀ W_i (L̂ the computed factor).

**Error bound (Higham 2002, §3.5, eq. 3.13).** The cast of L̂ to float32 (one rounding per entry) and the
float32 product (≤ T terms per entry) give |fl(M) − M| ≤ γ_{T+1}·|L̂|ᵀ|W| entrywise, and
‖|L̂|ᵀ|W|‖_F ≤ ‖L̂‖_F‖W‖_F; the direct form's fl(EᵀA) errs by γ_T·|E|ᵀ|A|, ‖|E|ᵀ|A|‖_F ≤ ‖A‖_F‖E‖_F.
:func:`cholesky_sq_norms` adds 2u₃₂·‖L̂‖_F‖W‖_F to the computed norm (γ_{T+1} − γ_T ≤ 2u₃₂; ‖W‖_F from one
float32 pass, rounded up by its own bound), so with
‖L̂‖_F² = tr(K + J) (1 + O(u₆₄))::

    ‖G_i‖ − γ_T·‖L̂‖_F‖W‖_F ≤ result^½ ≤ ‖G_i‖ + (γ_{T+1} + 2u₃₂)·‖L̂‖_F‖W‖_F + (2δ)^½·‖N‖_F‖W‖_F

up to the float64 rounding of the final squares: the under-estimate is bounded as the direct form's
(γ_T·‖A_i‖_F‖E_i‖_F, the way the engine states it: the clip bound holds to float32 rounding of the
norm), and the over-estimate by the same order (T = 128, n = 256: γ_T ≈ 7.6e-6, (2δ)^½ ≈ 4.7e-6).
With a reduced float32 matmul precision (TF32/bf16 passes) or inputs in another dtype the product
runs in float64.

Source: the identity is the trace form of the ghost norm (Li et al. 2022, "Large language models can be
strong differentially private learners", §4) with the Gram matrix of one side factored; the choice per
layer follows Bu et al. 2023 (arXiv 2210.00038, book-keeping: the cheaper exact form per layer).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .row_norms import row_sq_norms64

__all__ = ["cholesky_sq_norms", "jitter_delta", "TRIANGLE_BLOCKS"]

_U32 = 2.0**-24  # unit roundoff of float32
_U64 = 2.0**-53  # unit roundoff of float64

TRIANGLE_BLOCKS = 4
"""Diagonal blocks of L_iᵀ in the product (the zero blocks below the diagonal are skipped: 10/16 of the
full product's multiply-adds at 4 blocks; measured 10–12 % faster than one full ``bmm`` on the GPT-2
head and fc shapes, docs/performance.md)."""


def jitter_delta(t: int, n: int) -> float:
    """δ = 2·T·(T + n + 1)·u₆₄: the relative diagonal jitter that lets float64 Cholesky factor a PSD K = N Nᵀ.

    Args:
        t: T (K is ``[T, T]``); n: the width of N (terms per entry of K).

    Source: Higham 2002, Thm 10.7 (Cholesky succeeds when the unit-diagonal scaling of the matrix has
    λ_min > T·γ_{T+1}) with the ≤ T·γ_n scaled rounding of K; a factor 2 of margin.
    """
    return 2.0 * t * (t + n + 1) * _U64


def _product_dtype(wide: Tensor) -> torch.dtype:
    """float32 for float32 inputs under IEEE float32 matmuls (the bound above), float64 otherwise."""
    if wide.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return torch.float32
    return torch.float64


def _sq_norm_upper(flat: Tensor) -> Tensor:
    """An upper bound of each row's ‖x‖² (``[b, m]`` float32 → ``[b]`` float64): one float32 pass, divided by
    1 − γ_{m+1} (m non-negative squares summed in any order: relative error ≤ γ_{m+1}, Higham 2002, §3.1);
    the float64 sum where γ_{m+1} ≥ 1/2. Only the bound's correction term uses it."""

    m = flat.shape[1] + 1
    gamma = m * _U32 / (1 - m * _U32) if m * _U32 < 0.5 else 1.0
    if gamma >= 0.5:
        return row_sq_norms64(flat)
    return torch.linalg.vecdot(flat, flat, dim=1).double() / (1 - gamma)


def cholesky_sq_norms(narrow: Tensor, wide: Tensor, blocks: int = TRIANGLE_BLOCKS) -> Tensor:
    """Per-example ‖N_iᵀ W_i‖_F² (= ‖E_iᵀA_i‖_F² with N, W the narrow and wide side), ``[b]`` float64.

    Args:
        narrow: ``[b, T, n]`` (the side whose ``[T, T]`` Gram matrix is factored; pass the narrower one).
        wide: ``[b, T, w]`` (contiguous in its last dimension: the product reads its rows in place).
        blocks: diagonal blocks of Lᵀ in the product (≥ 1).

    Returns:
        ``[b]`` float64, within the bounds of the module docstring (an example with a non-finite input
        returns a non-finite value, as the other forms do).

    Raises:
        ValueError: shapes that do not match.
    """
    if narrow.dim() != 3 or wide.dim() != 3 or narrow.shape[:2] != wide.shape[:2]:
        raise ValueError(
            f"cholesky_sq_norms needs narrow [b, T, n] and wide [b, T, w], got {tuple(narrow.shape)} and "
            f"{tuple(wide.shape)}"
        )

    b, t, n = narrow.shape
    if b == 0 or t == 0:
        return narrow.new_zeros(b, dtype=torch.float64)
    nd = narrow.double()
    k = torch.bmm(nd, nd.transpose(1, 2))  # [b, T, T]
    diag = k.diagonal(dim1=1, dim2=2)
    trace = diag.sum(1, keepdim=True)
    diag.add_(jitter_delta(t, n) * (diag + trace / t))
    low, info = torch.linalg.cholesky_ex(k)
    dtype = _product_dtype(wide)
    lw, ww = low.to(dtype), wide.to(dtype)
    h = -(-t // max(1, min(blocks, t)))  # block size
    total = torch.zeros(b, dtype=torch.float64, device=narrow.device)
    for s in range(0, t, h):  # rows s..s+h−1 of Lᵀ·W: only columns ≥ s of Lᵀ are non-zero there
        m = torch.bmm(lw[:, s:, s : s + h].transpose(1, 2), ww[:, s:])  # [b, h, w]
        total += row_sq_norms64(m.flatten(1))
    if dtype == torch.float32:  # γ_{T+1} − γ_T ≤ 2u: the direct form's under-estimate bound (docstring)
        wn = _sq_norm_upper(ww.reshape(b, -1)).sqrt()
        ln = torch.linalg.vector_norm(low.flatten(1), dim=1)
        total = (total.sqrt() + 2 * _U32 * ln * wn).square()
    failed = info != 0
    if bool(failed.any()):  # the float64 Gram form for those examples (non-finite inputs stay non-finite)
        nf, wf = nd[failed], wide[failed].double()
        gram = (torch.bmm(nf, nf.transpose(1, 2)) * torch.bmm(wf, wf.transpose(1, 2))).sum((1, 2))
        total[failed] = gram.clamp_min(0.0)
    return total
