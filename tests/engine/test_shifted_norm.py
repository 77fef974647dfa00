"""engine.shifted_norm: float32 closed form of ‖(e aᵀ − m)/b‖² with a guaranteed upper bound.

Truth: the same float32 inputs evaluated in float64 (products of float32
numbers are exact in float64; the float64 sums add ~1e-16 relative error),
so ``got ≥ truth·(1 − 1e-12)`` is the property "never below the exact norm".
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpopt.engine.shifted_norm import RECHECK_RTOL, rounding_bound, shift_terms, shifted_sq_norms


def _truth(e, a, m, b):
    g = torch.einsum("bq,bp->bqp", e.double(), a.double())
    w = g - m.double()
    if b is not None:
        w = w / b.double()
    return w.square().sum((1, 2))


def _inputs(seed: int, bsz: int, q: int, p: int, near_rows: int, log_scale: float, log_spread: float):
    gen = torch.Generator().manual_seed(seed)
    e = torch.randn(bsz, q, generator=gen) * 10.0**log_scale
    a = torch.randn(bsz, p, generator=gen)
    m = 0.3 * torch.randn(q, p, generator=gen) * 10.0**log_scale
    for i in range(near_rows):  # the shift within 1e-3 of this example's gradient: heavy cancellation
        m = torch.outer(e[i], a[i]) + 1e-3 * 10.0**log_scale * torch.randn(q, p, generator=gen)
    b = torch.exp(log_spread * (2 * torch.rand(q, p, generator=gen) - 1))
    return e, a, m, b


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**20),
    near=st.integers(0, 1),
    log_scale=st.floats(-3, 3),
    log_spread=st.floats(0, 4),
    scaled=st.booleans(),
)
def test_never_below_the_exact_norm_and_within_two_rtol(seed, near, log_scale, log_spread, scaled):
    e, a, m, b = _inputs(seed, 9, 40, 30, near, log_scale, log_spread)
    b = b if scaled else None
    got, rechecked = shifted_sq_norms(e, a, m, b)
    want = _truth(e, a, m, b)
    ratio = got.double() / want
    assert got.dtype == torch.float32
    assert float(ratio.min()) >= 1 - 1e-12
    assert float(ratio.max()) <= 1 + 2 * RECHECK_RTOL
    if near:
        assert rechecked >= 1  # the cancelling row went to float64


def test_bound_covers_the_observed_float32_error():
    """err_i ≥ |fl(quad − 2 lin + const) − exact| on many rows, and is not absurdly loose (< 1e4×)."""
    e, a, m, b = _inputs(7, 256, 300, 200, 0, 0.0, 1.0)
    quad, lin, const = shift_terms(e, a, m, b)
    est = quad.double() - 2 * lin.double() + const
    err = rounding_bound(quad, const, n=300 + 200 + 8)
    observed = (est - _truth(e, a, m, b)).abs()
    assert bool((observed <= err).all())
    assert float((err / observed.clamp_min(1e-300)).median()) < 1e4


def test_cancelling_row_is_recomputed_exactly():
    """A true norm of 5 (squared 25) under ‖g/b‖² ≈ 1e8: float32 alone cannot see it."""
    q, p = 30, 20
    gen = torch.Generator().manual_seed(1)
    e, a = torch.randn(3, q, generator=gen), torch.randn(3, p, generator=gen)
    m = torch.outer(e[0], a[0]) * 1e4 / torch.outer(e[0], a[0]).norm()
    e[0] = e[0] * 1e4 / torch.outer(e[0], a[0]).norm()
    delta = torch.zeros(q, p)
    delta[0, 0] = 5.0
    m = (torch.outer(e[0], a[0]) - delta).float()  # ‖g_0 − m‖ = 5 up to float32 rounding of m
    got, rechecked = shifted_sq_norms(e, a, m, None)
    want = _truth(e, a, m, None)
    assert rechecked >= 1
    assert float(got[0]) >= float(want[0]) * (1 - 1e-12)
    assert abs(float(got[0]) / float(want[0]) - 1) < 1e-6


def test_typical_rows_stay_in_float32():
    """Shift of the size of the mean gradient (DP-MacAdam's regime): no row needs float64."""
    e, a, m, b = _inputs(3, 64, 200, 150, 0, 0.0, 1.0)
    got, rechecked = shifted_sq_norms(e, a, m / 3, b)
    assert rechecked == 0


def test_reduced_matmul_precision_falls_back_to_float64():
    e, a, m, b = _inputs(4, 5, 20, 10, 0, 0.0, 1.0)
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 / bf16 passes: the float32 bound would not hold
        got, rechecked = shifted_sq_norms(e, a, m, b)
    finally:
        torch.set_float32_matmul_precision(old)
    assert rechecked == 5
    ratio = got.double() / _truth(e, a, m, b)
    # the float64 value is rounded UP into float32 (a cast to nearest lands below it on about half the rows)
    assert float(ratio.min()) >= 1 - 1e-12 and float(ratio.max()) <= 1 + 2**-23


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_are_rounded_up_never_to_nearest(dtype):
    e, a, m, b = (t.to(dtype) for t in _inputs(8, 64, 20, 10, 0, 0.0, 0.5))
    got, rechecked = shifted_sq_norms(e, a, m, b)
    ratio = got.double() / _truth(e, a, m, b)
    ulp = torch.finfo(dtype).eps
    assert got.dtype == dtype and rechecked == 0
    assert float(ratio.min()) >= 1 - 1e-12 and float(ratio.max()) <= 1 + 2 * ulp
    assert float(ratio.max()) > 1 + 1e-6  # rounding up is visible at this precision: the check can fail


def test_new_precision_api_does_not_crash_and_cuda_tf32_is_not_trusted():
    """torch.get_float32_matmul_precision() raises once the per-backend API set TF32 (the usual GPU
    way); the norm must not crash, and CUDA products under TF32 must not be trusted as float32."""
    from dpopt.engine.shifted_norm import _ieee_float32_products

    e, a, m, b = _inputs(6, 4, 20, 10, 0, 0.0, 1.0)
    matmul = torch.backends.cuda.matmul
    old = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        got, _ = shifted_sq_norms(e, a, m, b)  # CPU: trusted only if mkldnn says "ieee"
        cuda_trusted = _ieee_float32_products(torch.device("cuda"))  # reads flags only; no GPU needed
        cpu_trusted = _ieee_float32_products(torch.device("cpu"))
    finally:
        matmul.fp32_precision = old
    assert not cuda_trusted
    assert cpu_trusted == (torch.backends.mkldnn.matmul.fp32_precision == "ieee")
    ratio = got.double() / _truth(e, a, m, b)
    assert float(ratio.min()) >= 1 - 1e-12 and float(ratio.max()) <= 1 + 2 * RECHECK_RTOL


def test_float64_inputs_are_exact_and_bad_rtol_raises():
    e, a, m, b = (t.double() for t in _inputs(5, 4, 12, 8, 1, 0.0, 1.0))
    got, rechecked = shifted_sq_norms(e, a, m, b)
    assert got.dtype == torch.float64 and rechecked == 0
    assert torch.allclose(got, _truth(e, a, m, b), rtol=1e-12)
    with pytest.raises(ValueError, match="rtol"):
        shifted_sq_norms(e, a, m, b, rtol=0.0)
