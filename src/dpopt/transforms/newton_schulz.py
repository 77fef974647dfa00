"""Orthogonalizing gradient matrices: Newton–Schulz (Muon) and the exact polar factor.

For a matrix G = U S Vᵀ (thin SVD, rank r), the polar factor is UVᵀ: the same
singular vectors with every singular value set to 1. Muon (Keller Jordan 2024;
the spectral paper (Shanmugam, Barnes, Taylor 2026; docs/algorithms.md) §method, Table 15 "NS = 5")
approximates it with a quintic Newton–Schulz iteration::

    X_0 = G / (‖G‖_F + ε)                 (transpose first if rows > cols)
    for k = 1..K:   A = X Xᵀ ;  X ← a X + (b A + c A²) X
    (a, b, c) = (3.4445, −4.7750, 2.0315), K = 5, ε = 1e-7

Each step maps every singular value s ∈ (0, 1] through p(s) = a s + b s³ + c s⁵
and leaves the singular vectors unchanged, so X_K = U p^K(S) Vᵀ. The
coefficients trade exactness for speed: p^5 lands in roughly [0.7, 1.2]
(docs/algorithms.md) rather than at 1, which is why :func:`polar_exact` (SVD) exists
for tests and diagnostics.

Conv kernels ``[out, in, kh, kw]`` are treated as ``out × (in·kh·kw)`` matrices
(:func:`as_matrix`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "NS_COEFFICIENTS",
    "NS_EPS",
    "ORTHOGONALIZERS",
    "as_matrix",
    "newton_schulz",
    "polar_exact",
    "orthogonalize",
    "top_singular_value",
]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
ORTHOGONALIZERS = ("newton-schulz", "svd")


def as_matrix(t: Tensor) -> Tensor:
    """View a weight-shaped tensor as a matrix ``[shape[0], prod(shape[1:])]``.

    Linear weights ``[out, in]`` are unchanged; conv kernels ``[out, in, kh, kw]``
    become ``[out, in·kh·kw]``.

    Raises:
        ValueError: for tensors with fewer than 2 dimensions.
    """
    if t.dim() < 2:
        raise ValueError(f"orthogonalization needs a matrix (>= 2-D tensor), got shape {tuple(t.shape)}")
    return t.reshape(t.shape[0], -1)


def newton_schulz(
    g: Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = NS_EPS
) -> Tensor:
    """Approximate polar factor of a matrix by K quintic Newton–Schulz steps.

    Args:
        g: ``[m, n]`` matrix (any float dtype; computed in that dtype).
        steps: K ≥ 0 iterations (K = 0 returns the Frobenius-normalised input).
        coefficients: (a, b, c) of p(s) = a s + b s³ + c s⁵.
        eps: ε > 0 added to ‖G‖_F before dividing (a zero matrix maps to zero).

    Returns:
        ``[m, n]`` tensor ≈ U S′ Vᵀ with S′ ≈ 1 (roughly [0.7, 1.2] for the
        default coefficients and K = 5), same singular vectors as ``g``.

    Raises:
        ValueError: non-2-D input, negative ``steps`` or non-positive ``eps``.

    Source: Keller Jordan, "Muon: An optimizer for hidden layers in neural
    networks" (2024), ``zeropower_via_newtonschulz5``; docs/algorithms.md "Muon".
    """
    if g.dim() != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(g.shape)}; see as_matrix()")
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    a, b, c = (float(x) for x in coefficients)
    transpose = g.shape[0] > g.shape[1]
    x = g.T if transpose else g
    x = x / (torch.linalg.matrix_norm(x) + eps)  # spectral norm ≤ Frobenius norm ≤ 1
    for _ in range(int(steps)):
        gram = x @ x.T  # [m, m] with m = min(rows, cols)
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if transpose else x


def polar_exact(g: Tensor, rtol: Optional[float] = None) -> Tensor:
    """Exact polar factor U Vᵀ of ``g`` by SVD (for tests and diagnostics).

    Singular values below ``rtol · s_max`` are treated as zero (their
    directions are dropped), so a rank-deficient or zero matrix maps like it
    does under Newton–Schulz (0 ↦ 0) instead of to arbitrary directions.

    Args:
        g: ``[m, n]`` matrix.
        rtol: relative threshold; default ``max(m, n) · machine-eps(dtype)``.

    Returns:
        ``[m, n]`` tensor with all non-zero singular values equal to 1.

    Raises:
        ValueError: non-2-D input.
    """
    if g.dim() != 2:
        raise ValueError(f"polar_exact needs a 2-D matrix, got shape {tuple(g.shape)}; see as_matrix()")
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    if rtol is None:
        rtol = max(g.shape) * torch.finfo(g.dtype).eps
    keep = (s > rtol * s.max()).to(g.dtype) if s.numel() and s.max() > 0 else torch.zeros_like(s)
    return (u * keep) @ vh


def orthogonalize(
    g: Tensor,
    method: str = "newton-schulz",
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
) -> Tensor:
    """Orthogonalize a weight-shaped tensor (flattened by :func:`as_matrix`), same shape back.

    Args:
        g: tensor with ≥ 2 dims.
        method: ``"newton-schulz"`` (Muon's NS5) or ``"svd"`` (exact UVᵀ).
        steps, coefficients, eps: Newton–Schulz settings (ignored by ``"svd"``).

    Raises:
        ValueError: unknown method or a tensor with < 2 dims.
    """
    if method not in ORTHOGONALIZERS:
        raise ValueError(f"orthogonalizer must be one of {ORTHOGONALIZERS}, got {method!r}")
    m = as_matrix(g)
    out = newton_schulz(m, steps, coefficients, eps) if method == "newton-schulz" else polar_exact(m)
    return out.reshape(g.shape)


def top_singular_value(g: Tensor, v: Tensor, iters: int = 2) -> tuple[Tensor, Tensor]:
    """Warm-started power iteration for σ₁(G).

    v ← GᵀG v / ‖GᵀG v‖ (``iters`` times), then σ̂₁ = ‖G v‖ ≤ σ₁ (a lower
    bound that converges geometrically at rate (σ₂/σ₁)² per iteration).

    Args:
        g: ``[m, n]`` matrix.
        v: ``[n]`` start vector (e.g. last step's; need not be normalised).
        iters: number of iterations, ≥ 1.

    Returns:
        ``(sigma, v)``: 0-d tensor σ̂₁ and the new unit ``[n]`` vector (the old
        one, normalised, if G v = 0 so that the warm start survives a zero step).

    Raises:
        ValueError: shapes that do not match or ``iters < 1``.
    """
    if g.dim() != 2 or v.shape != (g.shape[1],):
        raise ValueError(f"need g [m, n] and v [n]; got {tuple(g.shape)} and {tuple(v.shape)}")
    if int(iters) < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    tiny = torch.finfo(g.dtype).tiny
    v = v / v.norm().clamp_min(tiny)
    for _ in range(int(iters)):
        w = g.T @ (g @ v)
        n = w.norm()
        if not n > math.sqrt(tiny):
            return (g @ v).norm(), v
        v = w / n
    return (g @ v).norm(), v
