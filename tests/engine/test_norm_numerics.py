"""Every block type's fast norm equals a directly computed float64 norm of (g − shift)/scale.

Property test (hypothesis) over random shift/scale geometries with large
shifts, |shift| up to 1e4 × |g| (issue 9 item 4: SparseRowsBlock once
subtracted in float32 and returned 0 for a norm of 5·C), and a "near" regime
in which the shift is within 1e-3 of a per-sample gradient, where
‖g − shift‖ ≪ ‖shift‖ and any expanded form cancels.

The truth materialises each block's per-sample gradient g_i exactly in float64
from the block's own stored inputs (float32 products are exact in float64),
so the test measures the norm computation alone. The direct and Gram forms
form g_i by a float32 matrix product, whose rounding relative to ‖g_i‖ is not
a property of the norm: their near regime is tested in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpopt.engine.layers import Budget, DirectBlock, FactoredBlock, LinearPart, SparseRowsBlock
from dpopt.engine.shifted_norm import RECHECK_RTOL

B, P, Q, T, VOCAB = 5, 16, 16, 5, 12  # T 5: r = T(P+Q)/(PQ) = 0.625, between the Gram thresholds 0.55 and 0.735
KINDS = ("closed", "gram", "direct", "sparse", "dense")


def _truth(g: torch.Tensor, m, b) -> torch.Tensor:
    w = g.double()
    if m is not None:
        w = w - m.double()
    if b is not None:
        w = w / b.double()
    return w.reshape(w.shape[0], -1).square().sum(1)


def _block(kind: str, dtype: torch.dtype, gen: torch.Generator):
    """(block, exact per-sample gradients [B, *shape] in float64)."""
    if kind in ("closed", "gram", "direct"):
        # direct: the cache fits and r = T(p+q)/(pq) >= GRAM_WITH_CACHE_BELOW (below that, flat geometry
        # takes Gram even with a cache); gram: r < GRAM_WITHOUT_CACHE_BELOW and no cache
        t = {"closed": 1, "gram": T, "direct": T}[kind]
        a = torch.randn(B, t, P, generator=gen).to(dtype)
        e = torch.randn(B, t, Q, generator=gen).to(dtype)
        cache = 1 << 30 if kind == "direct" else 0
        blk = FactoredBlock(0, (Q, P), [LinearPart(a, e)], Budget(1 << 20, cache), B)
        return blk, torch.einsum("btq,btp->bqp", e.double(), a.double())
    if kind == "sparse":
        idx = torch.randint(0, VOCAB, (B, T), generator=gen)
        e = torch.randn(B, T, P, generator=gen).to(dtype)
        blk = SparseRowsBlock(0, VOCAB, None, [(idx, e)], B)
        g = torch.zeros(B, VOCAB, P, dtype=torch.float64)
        g[blk.row_ex, blk.row_tok] = blk.rows.double()  # the block's own (exactly summed) rows
        return blk, g
    g = torch.randn(B, Q, P, generator=gen).to(dtype)
    return DirectBlock([0], [g]), g.double()


def _geometry(g: torch.Tensor, regime: str, log_shift: float, log_spread: float, dtype, gen):
    """(shift, scale) as the engine receives them (param dtype).

    ``large``: |shift| = 10^log_shift × rms(g); ``near``: shift within
    10^−log_shift × rms(g) of example 0's gradient. Scales spread over
    10^±log_spread.
    """
    shape = g.shape[1:]
    rms = float(g.square().mean().sqrt())
    scale = torch.exp(math.log(10.0) * log_spread * (2 * torch.rand(shape, generator=gen, dtype=torch.float64) - 1))
    noise = torch.randn(shape, generator=gen, dtype=torch.float64)
    if regime == "large":
        shift = (10.0**log_shift) * rms * noise
    else:
        shift = g[0] + (10.0**-log_shift) * rms * noise
    return shift.to(dtype), scale.to(dtype)


@pytest.mark.parametrize("geo", ["shift", "shift-scale", "scale", "flat"])
@pytest.mark.parametrize("regime", ["large", "near"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=8, deadline=None, derandomize=True)
@given(log_shift=st.floats(0.0, 4.0), log_spread=st.floats(0.0, 3.0), seed=st.integers(0, 2**20))
def test_fast_block_norm_equals_float64_materialised_norm(kind, dtype, regime, geo, log_shift, log_spread, seed):
    if kind == "gram" and geo != "flat":
        pytest.skip("the Gram form is used in flat geometry only")
    if regime == "near" and dtype == torch.float32 and kind in ("gram", "direct"):
        pytest.skip("g_i itself is a float32 product there (module docstring); tested in float64")
    gen = torch.Generator().manual_seed(seed)
    blk, g = _block(kind, dtype, gen)
    shift, scale = _geometry(g, regime, log_shift, log_spread, dtype, gen)
    m = shift if geo in ("shift", "shift-scale") else None
    b = scale if geo in ("scale", "shift-scale") else None
    got = blk.sq_norms([(m, b)])[0]
    if kind in ("closed", "gram", "direct"):
        assert blk.form == kind
    want = _truth(g, m, b)
    if kind == "closed" and dtype == torch.float32 and m is not None:
        # float32 products + their worst-case rounding error: an upper bound (never below the exact
        # norm, so the clip bound holds), at most 2·RECHECK_RTOL above it (engine/shifted_norm.py)
        ratio = got.double() / want
        assert float(ratio.min()) >= 1 - 1e-12, f"{regime} {geo}: below the exact norm ({float(ratio.min())!r})"
        assert float(ratio.max()) <= 1 + 2 * RECHECK_RTOL, f"{regime} {geo}: {float(ratio.max()) - 1:.2e} above"
        return
    rel = float(((got.double() - want).abs() / want).max())
    assert rel <= 1e-6, f"{kind} {dtype} {regime} {geo}: relative error {rel:.2e}"


def test_sparse_rows_norm_of_five_c_under_a_huge_shift_is_not_zero():
    """The issue's case: a true norm of 5·C under a shift of 1e4 (float32); it once came out 0.000."""
    idx = torch.tensor([[3, 3, 7]])
    e = torch.zeros(1, 3, 4)
    e[0, 0, 0] = 1e4 + 5.0  # row 3 gets 1e4 + 5 in coordinate 0
    blk = SparseRowsBlock(0, 10, None, [(idx, e)], 1)
    shift = torch.zeros(10, 4)
    shift[3, 0] = 1e4
    got = float(blk.sq_norms([(shift, None)])[0][0])
    assert math.isclose(got, 25.0, rel_tol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_block_result_keeps_dtype(dtype):
    g = torch.randn(3, 4, dtype=dtype)
    out = DirectBlock([0], [g]).sq_norms([(torch.ones(4, dtype=dtype), None)])[0]
    assert out.dtype == dtype and torch.allclose(out.double(), _truth(g, torch.ones(4), None), rtol=1e-6)


def cancelling_pair(p: int = 64, q: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One example, two positions whose gradients nearly cancel: activations a = [a₁, a₁] (‖a₁‖ = 100) and
    output gradients e = [e₁, −e₁ + δ] (‖e₁‖ = 1e3, ‖δ‖ = 0.05), drawn in float64 from seed 0 and cast to float32.
    g = Σ_t e_t a_tᵀ = δa₁ᵀ, so ‖g‖² = ‖δ‖²‖a₁‖² = 25 while the Gram terms are ≈ 1e10.
    Returns ``(a, e)``: [B=1, T=2, p] and [1, 2, q], float32."""
    gen = torch.Generator().manual_seed(0)
    a1 = torch.randn(p, generator=gen, dtype=torch.float64)
    a1 = a1 / a1.norm() * 100.0
    e1 = torch.randn(q, generator=gen, dtype=torch.float64)
    e1 = e1 / e1.norm() * 1e3
    delta = torch.randn(q, generator=gen, dtype=torch.float64)
    delta = delta / delta.norm() * 0.05
    a = torch.stack([a1, a1]).unsqueeze(0).float()  # [B=1, T=2, p]
    e = torch.stack([e1, -e1 + delta]).unsqueeze(0).float()
    return a, e


def test_gram_form_does_not_cancel_in_float32():
    """Two positions whose gradients nearly cancel: g = (e₁ + e₂)a₁ᵀ with e₂ = −e₁ + δ.

    ‖g‖² = ‖δ‖²‖a‖² = 25 here, while the Gram terms are ≈ 1e10: a float32 sum of them
    (relative error ~6e-8 of 4e10 ≈ 2.4e3) cannot resolve 25; the float64 evaluation can.
    """
    from dpopt.engine.layers import Budget, FactoredBlock, LinearPart

    p = q = 64
    a, e = cancelling_pair(p, q)
    blk = FactoredBlock(0, (q, p), [LinearPart(a, e)], Budget(16 << 20, 0), 1)
    got = blk.sq_norms([(None, None)])[0]
    assert blk.form == "gram"
    g = torch.einsum("btq,btp->bqp", e.double(), a.double())  # the float32 inputs, exactly
    want = g.reshape(1, -1).square().sum(1)
    assert float(want) > 1.0  # a norm that clipping must see
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize(
    "t, p, q, cache, form",
    [
        (2, 64, 64, 1 << 30, "gram"),  # r = T(p+q)/pq = 0.06 < 0.55: Gram even though the cache fits
        (5, 16, 16, 1 << 30, "direct"),  # r = 0.625 > 0.55: the cached direct form
        (3, 16, 16, 1 << 30, "gram"),  # r = 0.375 < 0.55: Gram even though the cache fits
        (5, 16, 16, 0, "gram"),  # r = 0.625 < 0.735 and no cache: Gram
        (8, 16, 16, 0, "direct"),  # r = 1 > 0.735: direct (recomputed clipped sum)
    ],
)
def test_form_choice_by_work_ratio_and_cache(t, p, q, cache, form):
    """FactoredBlock's form in flat geometry (GRAM_WITH_CACHE_BELOW); each form's norm and sum are exact."""
    from dpopt.engine.layers import Budget, FactoredBlock, LinearPart

    gen = torch.Generator().manual_seed(1)
    a = torch.randn(B, t, p, generator=gen, dtype=torch.float64)
    e = torch.randn(B, t, q, generator=gen, dtype=torch.float64)
    blk = FactoredBlock(0, (q, p), [LinearPart(a, e)], Budget(1 << 20, cache), B)
    g = torch.einsum("btq,btp->bqp", e, a)
    torch.testing.assert_close(blk.sq_norms([(None, None)])[0], g.reshape(B, -1).square().sum(1), rtol=1e-12, atol=0)
    assert blk.form == form
    c = torch.rand(B, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(blk.grad_sums([c], None)[0], torch.einsum("b,bqp->qp", c, g), rtol=1e-12, atol=1e-12)
