"""Newton–Schulz orthogonalization, the exact polar factor and the power iteration."""

import math

import pytest
import torch

from dpopt.transforms.newton_schulz import (
    NS_COEFFICIENTS,
    as_matrix,
    newton_schulz,
    orthogonalize,
    polar_exact,
    top_singular_value,
)

A, B, C = NS_COEFFICIENTS


def _p(s: float, k: int = 5) -> float:
    """The scalar map of k quintic steps, p(s) = a s + b s³ + c s⁵ (by hand)."""
    for _ in range(k):
        s = A * s + B * s**3 + C * s**5
    return s


def _well_conditioned(m, n, seed=0, lo=1.0, hi=2.0):
    """G = U diag(s) Vᵀ with s evenly spread in [lo, hi] (condition number 2)."""
    gen = torch.Generator().manual_seed(seed)
    r = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, r, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, r, generator=gen, dtype=torch.float64))
    s = torch.linspace(hi, lo, r, dtype=torch.float64)
    return (u * s) @ v.T, u, s, v


def test_one_step_on_a_diagonal_matrix_by_hand():
    # G = diag(3, 4): ‖G‖_F = 5, X_0 = diag(0.6, 0.8); one step maps s ↦ a s + b s³ + c s⁵.
    g = torch.diag(torch.tensor([3.0, 4.0], dtype=torch.float64))
    x1 = newton_schulz(g, steps=1, eps=1e-300)
    p06 = 3.4445 * 0.6 - 4.7750 * 0.216 + 2.0315 * 0.07776  # = 2.0667 - 1.0314 + 0.15796944
    p08 = 3.4445 * 0.8 - 4.7750 * 0.512 + 2.0315 * 0.32768  # = 2.7556 - 2.4448 + 0.66568192
    assert x1[0, 0].item() == pytest.approx(p06, rel=1e-12)
    assert x1[1, 1].item() == pytest.approx(p08, rel=1e-12)
    assert p06 == pytest.approx(1.19326944, rel=1e-9)
    assert p08 == pytest.approx(0.97648192, rel=1e-9)
    assert x1[0, 1].item() == 0.0 and x1[1, 0].item() == 0.0
    x5 = newton_schulz(g, steps=5, eps=1e-300)
    assert torch.allclose(torch.diagonal(x5), torch.tensor([_p(0.6), _p(0.8)], dtype=torch.float64), rtol=1e-12)


@pytest.mark.parametrize("shape", [(64, 576), (576, 64)])
def test_singular_values_in_band_on_random_matrices(shape):
    torch.manual_seed(0)
    g = torch.randn(*shape)
    o = newton_schulz(g)
    assert o.shape == g.shape
    s = torch.linalg.svdvals(o)
    assert s.min() >= 0.6 and s.max() <= 1.3, (s.min().item(), s.max().item())
    # and not already the exact polar factor: NS5 is an approximation
    assert (s.max() - s.min()) > 0.05


@pytest.mark.parametrize("shape", [(64, 576), (576, 64)])
def test_singular_vectors_match_the_svd(shape):
    g, u, s, v = _well_conditioned(*shape)
    o = newton_schulz(g)
    # In exact arithmetic O v_k = p⁵(s_k/‖G‖_F) u_k: each right singular vector of G is mapped
    # onto the matching left singular vector, scaled by the NS map of its singular value.
    ov = o.T @ u if shape[0] > shape[1] else o @ v  # [*, r] columns O v_k (or Oᵀ u_k)
    ref = v if shape[0] > shape[1] else u
    cos = (ov * ref).sum(0) / ov.norm(dim=0)
    assert cos.min() >= 0.99
    fro = float(g.norm())
    expected = torch.tensor([_p(float(x) / fro) for x in s], dtype=torch.float64)
    assert torch.allclose(ov.norm(dim=0), expected, rtol=1e-6)
    # against the exact polar factor as a whole (the metric of Table 14 of the spectral paper,
    # which reports 0.98 after 4 steps): lower, since S' spreads over [0.68, 1.2]
    polar = u @ v.T
    assert float((o * polar).sum() / (o.norm() * polar.norm())) >= 0.98


def test_exact_mode_equals_uv_from_svd():
    torch.manual_seed(1)
    for shape in [(7, 5), (5, 7), (6, 6)]:
        g = torch.randn(*shape, dtype=torch.float64)
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        assert torch.allclose(polar_exact(g), u @ vh, atol=1e-12)
        o = orthogonalize(g, "svd")
        assert torch.allclose(
            o.T @ o if shape[0] >= shape[1] else o @ o.T, torch.eye(min(shape), dtype=torch.float64), atol=1e-12
        )


def test_exact_mode_drops_null_directions_like_newton_schulz():
    # rank 1: polar factor is u vᵀ (not an arbitrary completion); zero maps to zero.
    u = torch.tensor([3.0, 4.0], dtype=torch.float64) / 5
    v = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    g = 7.0 * torch.outer(u, v)
    assert torch.allclose(polar_exact(g), torch.outer(u, v), atol=1e-12)
    z = torch.zeros(3, 4)
    assert torch.equal(polar_exact(z), z) and torch.equal(newton_schulz(z), z)


def test_conv_kernels_are_flattened():
    torch.manual_seed(2)
    k = torch.randn(8, 3, 3, 3, dtype=torch.float64)
    assert as_matrix(k).shape == (8, 27)
    o = orthogonalize(k, "svd")
    assert o.shape == k.shape
    assert torch.allclose(o.reshape(8, 27), polar_exact(k.reshape(8, 27)))
    assert torch.allclose(orthogonalize(k), newton_schulz(k.reshape(8, 27)).reshape(k.shape))


def test_power_iteration():
    g, u, s, v = _well_conditioned(20, 30, seed=3, lo=0.1, hi=1.0)
    g = g.clone()
    g[:] = (u * torch.cat([torch.tensor([5.0], dtype=torch.float64), s[1:]])) @ v.T  # σ₁ = 5, σ₂ ≤ 1
    start = torch.ones(30, dtype=torch.float64)
    sigma, vec = top_singular_value(g, start, iters=20)
    assert sigma.item() == pytest.approx(5.0, rel=1e-10)
    assert abs(float(vec @ v[:, 0])) == pytest.approx(1.0, abs=1e-10)
    # a lower bound at every iteration count; warm start from the answer is exact immediately
    sigma1, _ = top_singular_value(g, start, iters=1)
    assert sigma1.item() <= 5.0 + 1e-12
    sigma_w, _ = top_singular_value(g, v[:, 0].clone(), iters=1)
    assert sigma_w.item() == pytest.approx(5.0, rel=1e-12)
    # a zero matrix keeps the warm-start vector
    s0, v0 = top_singular_value(torch.zeros(20, 30, dtype=torch.float64), start, iters=2)
    assert s0.item() == 0.0 and torch.allclose(v0, start / math.sqrt(30))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: newton_schulz(torch.ones(3)), "2-D"),
        (lambda: newton_schulz(torch.ones(2, 2), steps=-1), "non-negative"),
        (lambda: newton_schulz(torch.ones(2, 2), eps=0.0), "eps"),
        (lambda: orthogonalize(torch.ones(2, 2), "qr"), "orthogonalizer"),
        (lambda: as_matrix(torch.ones(4)), ">= 2-D"),
        (lambda: top_singular_value(torch.ones(2, 3), torch.ones(2)), "need g"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
