"""The Cholesky form of a sequence Linear layer's per-example norm (engine/chol_norm.py, issue 34).

‖E_iᵀA_i‖² = ‖L_iᵀW_i‖² with K_i = N_iN_iᵀ = L_iL_iᵀ (N the narrow side, float64) and the product with
the wide side W in float32. Checked against

* the exact norm of the float32 inputs (float64 einsum: every float32 product is exact in float64), with
  the module's two-sided bound: under by at most γ_T·‖L‖_F‖W‖_F (the direct form's bound), over by at
  most (γ_{T+1} + 2u)·‖L‖_F‖W‖_F + (2δ)^½·‖N‖_F‖W‖_F — on random, ill-conditioned, rank-deficient
  (T > n), zero-padded and duplicated-row inputs, on both sides (p ≤ q and p > q);
* single-example ``torch.func.grad`` of a sequence Linear layer (float64);
* the cancelling case the Gram form cannot do in float32 (``test_gram_form_does_not_cancel_in_float32``);
* the engine's per-layer choice: the form is taken where its cost model says so, and the norms and the
  clipped sums of the whole engine equal the ``torch.func`` reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_norm_numerics import cancelling_pair
from torch import nn
from torch.func import functional_call, grad, vmap

from dpopt.engine.chol_norm import cholesky_sq_norms, jitter_delta
from dpopt.engine.fast import PerSampleEngine
from dpopt.engine.layers import (
    GRAM_WITH_CACHE_BELOW,
    GRAM_WITHOUT_CACHE_BELOW,
    Budget,
    FactoredBlock,
    LinearPart,
    chol_cost,
    form_costs,
)
from dpopt.engine.reference import per_sample_gradients
from dpopt.types import ClipGeometry

U = 2.0**-24


def _gamma(k: int) -> float:
    return k * U / (1 - k * U)


def _inputs(case: str, b: int, t: int, p: int, q: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``a [b, t, p]``, ``e [b, t, q]`` of one case."""
    g = torch.Generator().manual_seed(seed)
    a, e = torch.randn(b, t, p, generator=g), torch.randn(b, t, q, generator=g)
    if case == "ill":  # positions scaled over 12 decades, and a near-copy: K's condition number ~1e24+
        a = a * torch.logspace(-6, 6, t).view(1, t, 1)
        a[:, 1] = a[:, 0] * (1 + 1e-7)
    elif case == "padded":  # the last half of the positions are padding: zero inputs (and gradients)
        a[:, t // 2 :] = 0
        e[:, t // 2 :] = 0
    elif case == "padded-input":  # zero inputs, non-zero output gradients (a bias-only position)
        a[:, t // 2 :] = 0
    elif case == "duplicated":  # repeated tokens: every position has the input of position 0 or 1
        a[:, 2::2] = a[:, :1]
        a[:, 3::2] = a[:, 1:2]
    return a, e


def _check_bound(a: torch.Tensor, e: torch.Tensor, got: torch.Tensor) -> None:
    """The module docstring's two-sided bound, from the exact float64 norms of the float32 inputs."""
    t = a.shape[1]
    n_side, w_side = (a, e) if a.shape[2] <= e.shape[2] else (e, a)
    exact = torch.einsum("btq,btp->bqp", e.double(), a.double()).flatten(1).norm(dim=1)
    nn_ = n_side.double().flatten(1).norm(dim=1)
    wn = w_side.double().flatten(1).norm(dim=1)
    delta = jitter_delta(t, n_side.shape[2])
    ln = nn_ * math.sqrt(1 + 2 * delta) * (1 + 1e-12)  # ‖L‖_F² = tr(K + J) ≤ (1 + 2δ)·‖N‖_F²
    lo = exact - _gamma(t) * ln * wn
    hi = exact + (_gamma(t + 1) + 2 * U) * ln * wn + math.sqrt(2 * delta) * nn_ * wn
    root = got.double().sqrt()
    slack = 1e-12 * nn_ * wn
    assert bool((root >= lo - slack).all()), f"under the bound by {float((lo - root).max()):.3e}"
    assert bool((root <= hi + slack).all()), f"over the bound by {float((root - hi).max()):.3e}"


@pytest.mark.parametrize("case", ["random", "ill", "padded", "padded-input", "duplicated"])
@pytest.mark.parametrize(("t", "p", "q"), [(16, 8, 40), (24, 40, 8), (6, 32, 96)])  # T > n twice; T < n once
def test_float32_norm_within_the_direct_forms_bound(case, t, p, q):
    a, e = _inputs(case, 3, t, p, q)
    narrow, wide = (a, e) if p <= q else (e, a)
    got = cholesky_sq_norms(narrow, wide)
    assert got.dtype == torch.float64 and got.shape == (3,)
    _check_bound(a, e, got)


@pytest.mark.parametrize("case", ["random", "ill", "padded", "duplicated"])
def test_float64_inputs_give_the_exact_norm_plus_at_most_the_jitter(case):
    """In float64 (product in float64 too) only the jitter remains: 0 ≤ got − ‖G‖² ≤ 2δ·‖N‖²‖W‖²."""
    a, e = (x.double() for x in _inputs(case, 3, 20, 8, 30, seed=3))
    got = cholesky_sq_norms(a, e)
    exact = torch.einsum("btq,btp->bqp", e, a).flatten(1).square().sum(1)
    scale = a.flatten(1).square().sum(1) * e.flatten(1).square().sum(1)
    extra = got - exact
    assert bool((extra >= -1e-13 * scale).all()), f"below the exact norm: {extra / scale}"
    assert bool((extra <= 2 * jitter_delta(20, 8) * scale * (1 + 1e-9)).all()), f"above the jitter: {extra / scale}"
    if case == "random":  # K is positive definite here: the norm to float64 precision, relative
        torch.testing.assert_close(got, exact, rtol=1e-9, atol=0)


def test_no_cancellation_where_float32_gram_fails():
    """g = (e₁ + e₂)a₁ᵀ with e₂ = −e₁ + δ: ‖g‖² = 25 under Gram terms of ≈ 1e10 (the case of
    ``test_gram_form_does_not_cancel_in_float32``); here K = [[‖a‖², ‖a‖²], [‖a‖², ‖a‖²]] is singular."""
    a, e = cancelling_pair()
    got = cholesky_sq_norms(a, e)
    want = torch.einsum("btq,btp->bqp", e.double(), a.double()).flatten(1).square().sum(1)
    assert float(want) > 1.0
    _check_bound(a, e, got)
    # the bound here: γ_2·‖a‖‖e‖ ≈ 1.2e-7 · 141 · 1414 ≈ 0.024 on the norm 5, i.e. 1 % of the square
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0)


def test_nonfinite_inputs_give_a_nonfinite_norm():
    a, e = _inputs("random", 4, 12, 6, 20)
    a[1, 3, 2] = float("nan")
    e[2, 5, 0] = float("inf")
    a[3, 0, 0] = float("inf")
    got = cholesky_sq_norms(a, e)
    assert bool(got[0].isfinite()) and not bool(got[1:].isfinite().any())


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="narrow"):
        cholesky_sq_norms(torch.zeros(2, 3, 4), torch.zeros(2, 5, 6))
    assert cholesky_sq_norms(torch.zeros(0, 4, 3), torch.zeros(0, 4, 5)).shape == (0,)


@pytest.mark.parametrize("blocks", [1, 3, 4, 40])
def test_triangle_blocks_give_the_same_norm(blocks):
    a, e = (x.double() for x in _inputs("random", 2, 10, 5, 17, seed=7))
    want = cholesky_sq_norms(a, e, blocks=1)
    torch.testing.assert_close(cholesky_sq_norms(a, e, blocks=blocks), want)


def test_equals_single_example_torch_func_grad():
    """‖∂ℓ_i/∂W‖² of ``y = x Wᵀ`` over T positions (float64, T 12 > p 4), one example at a time by
    ``torch.func.grad``, against the Cholesky form of the recorded inputs and output gradients."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 10, bias=False).double()
    x = torch.randn(5, 12, 4, dtype=torch.float64)
    x[:, 6:] = x[:, :6]  # repeated tokens
    y = torch.randn(5, 12, 10, dtype=torch.float64)

    def loss(w, xi, yi):
        return (functional_call(lin, {"weight": w}, (xi,)) - yi).square().sum()

    ref = vmap(grad(loss), in_dims=(None, 0, 0))(lin.weight.detach(), x, y)  # [5, 10, 4]
    e = 2 * (x @ lin.weight.detach().t() - y)  # ∂ℓ_i/∂out
    got = cholesky_sq_norms(x, e)
    want = ref.flatten(1).square().sum(1)
    torch.testing.assert_close(got, want, rtol=2 * jitter_delta(12, 4) * 12, atol=0)


# --------------------------------------------------------------------------- the engine's choice
def test_chol_cost_and_form_costs():
    # GPT-2 head: n 256, w 8192, T 128: 0.5 + 1.7/64 + 5·128²/(256·8192) = 0.5656
    assert chol_cost(128, 256, 8192) == pytest.approx(0.5 + 1.7 / 64 + 5 * 128**2 / (256 * 8192))
    # fc (256 → 1024): 0.5 + 1.7/8 + 5/16 = 1.025, above the direct form's norms: the direct form
    assert chol_cost(128, 256, 1024) == pytest.approx(1.025)
    assert chol_cost(128, 8192, 256) == chol_cost(128, 256, 8192)  # symmetric in p, q
    gemm = 1 - GRAM_WITH_CACHE_BELOW / GRAM_WITHOUT_CACHE_BELOW  # the clipped sum as one GEMM, ≈ 0.25
    r = 128 * (256 + 8192) / (256 * 8192)
    head = chol_cost(128, 256, 8192)
    # the head: Cholesky 0.566 + 0.25 = 0.82 beats even the cached direct form (measured 0.88 of it)
    assert form_costs(r, True, head) == pytest.approx((head + gemm, head + gemm))
    assert form_costs(r, True, head)[0] == pytest.approx(0.8173, abs=1e-4)
    assert form_costs(r, False, head) == pytest.approx((1.0, 1 + gemm))  # a shifted geometry: no Cholesky
    gram = gemm + r / GRAM_WITHOUT_CACHE_BELOW  # without it: Gram (≈ 0.96, measured 0.95 of the cached form)
    assert form_costs(r, True) == pytest.approx((gram, gram)) and head + gemm < gram < 1.0


def _chol_block(b: int = 3, t: int = 16, p: int = 20, q: int = 1024, cache: int = 0) -> FactoredBlock:
    """T 16, p 20, q 1024: cached direct 1 < Cholesky 0.89 + 0.25 = 1.14 < direct, sum recomputed, 1.25 <
    Gram 0.25 + 0.816/0.735 = 1.36 (:func:`form_costs`)."""
    g = torch.Generator().manual_seed(2)
    part = LinearPart(torch.randn(b, t, p, generator=g), torch.randn(b, t, q, generator=g))
    return FactoredBlock(0, (q, p), [part], Budget(16 << 20, cache), b)


@pytest.mark.parametrize("transpose", [False, True])
def test_block_takes_the_cholesky_form_and_is_exact(transpose):
    blk = _chol_block(p=1024, q=20) if transpose else _chol_block()
    a, e = blk.parts[0].a, blk.parts[0].e
    got = blk.sq_norms([(None, None)])[0]
    assert blk.form == "chol" and got.dtype == torch.float32
    _check_bound(a, e, got)
    g = torch.einsum("btq,btp->bqp", e.double(), a.double())
    torch.testing.assert_close(got.double(), g.flatten(1).square().sum(1), rtol=1e-5, atol=0)
    c = torch.rand(3)
    bad = torch.tensor([False, True, False])
    want = torch.einsum("b,bqp->qp", (c * ~bad).double(), g)
    torch.testing.assert_close(blk.grad_sums([c], bad)[0].double(), want, rtol=1e-5, atol=1e-5)


def test_block_keeps_the_other_forms_where_they_are_cheaper():
    # a shifted geometry: the direct form (no Gram/Cholesky identity for g − m)
    blk = _chol_block()
    blk.sq_norms([(torch.zeros(1024, 20), None)])
    assert blk.form == "direct"
    # the cache fits and the cached direct form (1) beats Cholesky (1.14)
    blk = _chol_block(cache=1 << 30)
    blk.sq_norms([(None, None)])
    assert blk.form == "direct" and blk._cache is not None


def test_engine_norms_and_sums_equal_the_torch_func_reference():
    """A sequence model whose wide layer takes the Cholesky form: the whole source's norms and clipped
    sums equal ``torch.func`` per-example gradients (``reference.per_sample_gradients``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1024))
    x, y = torch.randn(3, 16, 32), torch.randint(0, 1024, (3, 16))

    def loss(out, target):
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    src = PerSampleEngine(model, loss, cache_bytes=0).compute(x, y)
    ref = per_sample_gradients(model, loss, x, y)
    geo, n = ClipGeometry(), src.num_params
    got = src.sq_norms(geo, [0] * n, 1)
    assert src.forms()[2] == "chol"
    torch.testing.assert_close(got, ref.sq_norms(geo, [0] * n, 1), rtol=1e-5, atol=0)
    w = torch.rand(3, 1)
    for s, r in zip(src.weighted_sum(w, geo, [0] * n), ref.weighted_sum(w, geo, [0] * n)):
        torch.testing.assert_close(s, r, rtol=1e-5, atol=1e-6)
