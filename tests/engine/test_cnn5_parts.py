"""CNN5's per-example parts after the issue-34 profile (docs/performance.md, "CNN5: profile and floor").

GroupNorm's per-example affine gradients now come from torch's GroupNorm backward kernel with the batch
folded into the channels (``layers._group_norm_grads_fused``), in place of the two-pass formula. Checked
here against that formula written out independently in float64, against torch.func's per-example
gradients through a whole CNN5 (every parameter's norm and the clipped sum), and for the dtypes that
keep the old path.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpopt.engine import fast_per_sample_gradients
from dpopt.engine.layers import _fused_group_norm_ok, group_norm_grads
from dpopt.engine.reference import per_sample_gradients
from dpopt.models import build_model
from dpopt.types import ClipGeometry


def _by_hand(x: torch.Tensor, e: torch.Tensor, groups: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dweight_bc = Σ_pos x̂ e, dbias_bc = Σ_pos e, with x̂ normalised per example and group (float64)."""
    x, e = x.double(), e.double()
    b, c = x.shape[:2]
    xg = x.reshape(b, groups, -1)
    mean = xg.mean(2, keepdim=True)
    var = ((xg - mean) ** 2).mean(2, keepdim=True)
    xhat = ((xg - mean) / torch.sqrt(var + eps)).reshape(b, c, -1)
    ee = e.reshape(b, c, -1)
    return (xhat * ee).sum(2), ee.sum(2)


@pytest.mark.parametrize(
    "shape,groups",
    [((5, 8, 6, 7), 4), ((3, 6, 4, 4), 6), ((4, 6, 9), 3), ((4, 6), 2), ((2, 4, 3, 3), 1)],
)
@pytest.mark.parametrize("with_stats", [True, False])
def test_fused_group_norm_grads_equal_the_formula(shape, groups, with_stats):
    g = torch.Generator().manual_seed(sum(shape) + groups)
    x64 = torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 0.7
    e64 = torch.randn(*shape, generator=g, dtype=torch.float64)
    want_w, want_b = _by_hand(x64, e64, groups, 1e-5)
    for dt, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        x, e = x64.to(dt), e64.to(dt)
        stats = None
        if with_stats:  # what autograd saves for GroupNorm's backward: (mean, rstd) [B, G]
            _, mean, rstd = torch.ops.aten.native_group_norm(
                x, None, None, shape[0], shape[1], x[0, 0].numel() if x.dim() > 2 else 1, groups, 1e-5
            )
            stats = (mean, rstd)
            assert _fused_group_norm_ok(x, e, mean.reshape(shape[0], groups), rstd.reshape(shape[0], groups))
        dw, db = group_norm_grads(x, e, groups, 1e-5, stats)
        assert dw.shape == db.shape == shape[:2] and dw.dtype == dt
        scale_w, scale_b = float(want_w.abs().max()), float(want_b.abs().max())
        torch.testing.assert_close(dw.double(), want_w, rtol=tol, atol=tol * scale_w)
        torch.testing.assert_close(db.double(), want_b, rtol=tol, atol=tol * scale_b)


@pytest.mark.parametrize(
    "layout",
    [
        "x sliced last dim",
        "e sliced last dim",
        "x cropped along H",
        "e broadcast (sum-pool)",
        "channels_last",
        "x transposed",
    ],
)
def test_fused_group_norm_grads_of_strided_operands_equal_the_formula(layout):
    """The native kernel reads its buffers as contiguous memory: strided views of x or e (a slice along the last dim,
    a crop along H, a stride-0 gradient from sum-pooling, channels_last, a transpose) must give the formula's
    per-example values, each row from its own example only (before the fix, slices mixed rows: errors ≈ 9, and a
    broadcast e read past its buffer: NaN)."""
    g = torch.Generator().manual_seed(7)
    B, C, H, W, groups = 3, 6, 4, 5, 3
    x = torch.randn(B, C, H, W, generator=g)
    e = torch.randn(B, C, H, W, generator=g)
    if layout == "x sliced last dim":
        x = torch.randn(B, C, H, 2 * W, generator=g)[..., 3 : 3 + W]
    elif layout == "e sliced last dim":
        e = torch.randn(B, C, H, 2 * W, generator=g)[..., 1 : 1 + W]
    elif layout == "x cropped along H":
        x = torch.randn(B, C, H + 2, W, generator=g)[:, :, 1:-1]
    elif layout == "e broadcast (sum-pool)":
        e = torch.randn(B, C, 1, 1, generator=g).expand(B, C, H, W)
    elif layout == "channels_last":
        x, e = x.to(memory_format=torch.channels_last), e.to(memory_format=torch.channels_last)
    else:
        x = torch.randn(B, C, W, H, generator=g).transpose(2, 3)
    assert not (x.is_contiguous() and e.is_contiguous())
    want_w, want_b = _by_hand(x.double().contiguous(), e.double().contiguous(), groups, 1e-5)
    dw, db = group_norm_grads(x, e, groups, 1e-5)
    torch.testing.assert_close(dw.double(), want_w, rtol=2e-6, atol=2e-6 * float(want_w.abs().max()))
    torch.testing.assert_close(db.double(), want_b, rtol=2e-6, atol=2e-6 * float(want_b.abs().max()))


def test_fused_group_norm_grads_with_views_sum_each_examples_views():
    """K = 2 views per example: the per-example gradient is the sum of its views' (each with its own statistics)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 4, 5, 5, generator=g, dtype=torch.float64)
    e = torch.randn(3, 2, 4, 5, 5, generator=g, dtype=torch.float64)
    dw, db = group_norm_grads(x, e, 2, 1e-5, None, views=2)
    ww, wb = _by_hand(x.flatten(0, 1), e.flatten(0, 1), 2, 1e-5)
    torch.testing.assert_close(dw, ww.reshape(3, 2, 4).sum(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(db, wb.reshape(3, 2, 4).sum(1), rtol=1e-12, atol=1e-12)


def test_other_dtypes_and_empty_batches_keep_the_two_pass_formula():
    x = torch.randn(2, 4, 3, 3)
    s = torch.zeros(2, 2)
    assert _fused_group_norm_ok(x, x, s, s)
    assert not _fused_group_norm_ok(x.bfloat16(), x.bfloat16(), s.bfloat16(), s.bfloat16())
    assert not _fused_group_norm_ok(x, x.double(), s, s)
    assert not _fused_group_norm_ok(x[:0], x[:0], s[:0], s[:0])
    # the bf16 fallback still gives the formula's values (to bf16's rounding)
    xb = (torch.randn(2, 4, 3, 3) * 2).bfloat16()
    eb = torch.randn(2, 4, 3, 3).bfloat16()
    dw, db = group_norm_grads(xb, eb, 2, 1e-5)
    ww, wb = _by_hand(xb, eb, 2, 1e-5)
    torch.testing.assert_close(dw.double(), ww, rtol=0.05, atol=0.05 * float(ww.abs().max()))
    torch.testing.assert_close(db.double(), wb, rtol=0.02, atol=0.02 * float(wb.abs().max()))


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_cnn5_norms_per_parameter_and_clipped_sum_equal_torch_func(dtype, rtol):
    """Every parameter of CNN5 (its convs' direct forms, GroupNorm's fused per-example grads, the closed-form
    Linear layers) as its own clip group, flat geometry: norms and Σ_i w_i g_i against torch.func."""
    torch.manual_seed(0)
    model = build_model("cnn5").to(dtype)
    with torch.no_grad():  # GroupNorm's affine parameters away from (1, 0)
        for m in model.modules():
            if isinstance(m, nn.GroupNorm):
                m.weight.add_(0.3 * torch.randn_like(m.weight))
                m.bias.add_(0.3 * torch.randn_like(m.bias))
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 3, 32, 32, generator=g, dtype=dtype), torch.randint(0, 10, (4,), generator=g)

    def ce(out, target):
        return nn.functional.cross_entropy(out, target)

    fast, ref = fast_per_sample_gradients(model, ce, x, y), per_sample_gradients(model, ce, x, y)
    n = len(list(model.parameters()))
    geo = ClipGeometry(None, None)
    groups = list(range(n))
    a, b = fast.sq_norms(geo, groups, n), ref.sq_norms(geo, groups, n)
    assert a.shape == (4, n) and bool((b > 0).all())
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=0.0)
    w = torch.rand(4, n, generator=g, dtype=dtype)
    for u, v in zip(fast.weighted_sum(w, geo, groups), ref.weighted_sum(w, geo, groups)):
        torch.testing.assert_close(u, v, rtol=rtol, atol=rtol * float(v.abs().max()))
