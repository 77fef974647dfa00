"""A T = 1 linear layer's weight and bias norms from one shared float64 ‖e_i‖², rounded up (issue 34).

The fast engine's closed form for a linear weight called once with one position per example is
‖e_i a_iᵀ‖² = ‖e_i‖²‖a_i‖² (Goodfellow 2015); its bias's is ‖e_i‖². Both come from
:meth:`dpopt.engine.layers.LinearPart.sq64` (float64 rows, :func:`dpopt.engine.row_norms.rows_sq64`,
one compiled pass), computed once per layer and rounded UP into the compute dtype
(:func:`dpopt.engine.row_norms.round_up_sq_norms`): a norm that bounds the sensitivity is never below the
exact norm of the recorded rows. Checked here against exact rational arithmetic (``fractions``), against
single-example autograd (``torch.func``) per parameter in train mode (MLPs with and without biases, T = 1
and T = 3, float32 and bf16 weights), through σ = 0 sensitivity (removing one example moves the clipped sum
by ≤ C) and on the source's non-finite check, which now reads the group totals first.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import dpopt.engine.layers as layers
from dpopt.engine import iter_per_sample_sources
from dpopt.engine.layers import DirectBlock, FactoredBlock, LinearPart, unscaled
from dpopt.engine.row_norms import round_up_sq_norms, rows_sq64
from dpopt.methods import make_optimizer
from dpopt.types import ClipGeometry

B, P, H, K = 9, 20, 16, 5


def ce(out, y):
    return F.cross_entropy(out.float(), y)


class MLP(nn.Module):
    """Linear → ReLU → Linear; with T > 1 the positions are averaged before the loss."""

    def __init__(self, bias: bool):
        super().__init__()
        self.l1, self.l2 = nn.Linear(P, H, bias=bias), nn.Linear(H, K, bias=bias)

    def forward(self, x):
        out = self.l2(torch.relu(self.l1(x)))
        return out.mean(1) if out.dim() == 3 else out


def _setup(bias: bool, t: int, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    model = MLP(bias).train().to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (B, P) if t == 1 else (B, t, P)
    x = (3 * torch.randn(*shape, generator=gen)).to(dtype)
    return model, x, torch.randint(0, K, (B,), generator=gen)


def _source(model, x, y):
    return next(iter(iter_per_sample_sources(model, ce, x, y)))


def _torch_func_sq_norms(model, x, y) -> torch.Tensor:
    """Per-example, per-parameter ‖g_i‖² ``[B, n]`` (float64) by single-example autograd."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return ce(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.stack([g[k].double().flatten(1).square().sum(1) for k in params], 1)


def _exact(rows: torch.Tensor) -> list[Fraction]:
    """Exact Σ_j x_rj² of every row, in rationals."""
    return [sum((Fraction(float(v)) ** 2 for v in r.tolist()), Fraction(0)) for r in rows.double()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_per_parameter_norms_equal_torch_func_in_train_mode(bias, t, dtype):
    model, x, y = _setup(bias, t, dtype)
    src = _source(model, x, y)
    n = src.num_params
    got = src.sq_norms(ClipGeometry(), list(range(n)), n).double()  # one group per parameter
    want = _torch_func_sq_norms(model, x, y)
    assert got.shape == want.shape == (B, 4 if bias else 2)
    # float32 products on both sides (bf16: the same bf16 recorded tensors in float32 here, bf16 autograd there)
    rtol = 2e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got, want, rtol=rtol, atol=0), float(((got - want).abs() / want).max())
    closed = [blk for blk in map(unscaled, src.blocks) if isinstance(blk, FactoredBlock)]
    assert [blk.form for blk in closed] == (["closed", "closed"] if t == 1 else [blk.form for blk in closed])
    if t > 1:
        assert "closed" not in [blk.form for blk in closed]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_t1_norms_are_upper_bounds_of_the_exact_norms_of_the_recorded_rows(bias, dtype):
    model, x, y = _setup(bias, 1, dtype)
    src = _source(model, x, y)
    n = src.num_params
    got = src.sq_norms(ClipGeometry(), list(range(n)), n)
    assert got.dtype == torch.float32
    facs = [blk for blk in map(unscaled, src.blocks) if isinstance(blk, FactoredBlock)]
    for blk in facs:
        pt = blk.parts[0]
        e2, a2 = _exact(pt.e[:, 0].float()), _exact(pt.a[:, 0].float())
        w = [Fraction(float(v)) for v in got[:, blk.index[0]]]
        assert all(wi >= ei * ai for wi, ei, ai in zip(w, e2, a2))
        assert all(wi <= ei * ai * (1 + Fraction(1, 2**21)) for wi, ei, ai in zip(w, e2, a2))
        if bias:
            k = blk.index[0] + 1  # the layer's bias follows its weight
            bb = [Fraction(float(v)) for v in got[:, k]]
            assert all(ei <= bi <= ei * (1 + Fraction(1, 2**21)) for bi, ei in zip(bb, e2))


def test_weight_and_bias_share_one_row_pass_per_side(monkeypatch):
    """‖e_i‖² is computed once per layer for its weight and its bias (and ‖a_i‖² once for the weight)."""
    model, x, y = _setup(True, 1, torch.float32)
    src = _source(model, x, y)
    calls = []
    real = layers.rows_sq64
    monkeypatch.setattr(layers, "rows_sq64", lambda v: calls.append(tuple(v.shape)) or real(v))
    src.sq_norms(ClipGeometry(), [0] * src.num_params, 1)
    assert sorted(calls) == sorted([(B, H), (B, P), (B, K), (B, H)])  # e and a of each layer, once each
    biases = [blk for blk in src.blocks if isinstance(blk, DirectBlock)]
    assert len(biases) == 2 and all(blk.flat is not None for blk in biases)


def test_bias_only_layer_and_shifted_geometry_use_their_own_paths():
    """A frozen weight: the bias still gets ‖e_i‖²; a shift: the bias's norms come from its rows."""
    model, x, y = _setup(True, 1, torch.float32)
    model.l1.weight.requires_grad_(False)
    src = _source(model, x, y)
    n = src.num_params
    got = src.sq_norms(ClipGeometry(), list(range(n)), n).double()
    want = _torch_func_sq_norms(model, x, y)[:, 1:]  # torch.func over every parameter: drop l1.weight
    assert torch.allclose(got, want, rtol=2e-5, atol=0)
    params = [p for p in model.parameters() if p.requires_grad]
    shift = [torch.full_like(p, 0.01) for p in params]
    src = _source(model, x, y)
    shifted = src.sq_norms(ClipGeometry(shift=shift), list(range(n)), n).double()
    g = vmap(
        grad(lambda p, xi, yi: ce(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))),
        in_dims=(None, 0, 0),
    )({k: v.detach() for k, v in model.named_parameters() if v.requires_grad}, x, y)
    ref = torch.stack([(v.double() - 0.01).flatten(1).square().sum(1) for v in g.values()], 1)
    assert torch.allclose(shifted, ref, rtol=2e-5, atol=0)


def _rows(values: list[list[float]]) -> torch.Tensor:
    width = max(len(r) for r in values)
    return torch.tensor([r + [0.0] * (width - len(r)) for r in values], dtype=torch.float32)


ADVERSARIAL = [
    [1.0, 2.0**-30],  # exact 1 + 2⁻⁶⁰: float64 and a nearest float32 both read 1, below the exact value
    [1.0] + [2.0**-27] * 4000,  # many squares each under half an ulp of the running sum
    [2.0**-27] * 4000 + [1.0],
    [3.0, 4.0],  # exactly 25: must stay 25 or the next float32 above
    [1.0 + 2.0**-23] * 9,  # squares not representable in float32
    [float.fromhex("0x1.fffffep+60")] * 3 + [1.0],  # large, mixed with small
    [1e-20] * 7,  # tiny: squares far below float32's normal range, fine in float64
    [0.0] * 5,
]


@pytest.mark.parametrize("row", range(len(ADVERSARIAL)))
def test_rows_sq64_rounded_up_never_below_the_exact_value(row):
    x = _rows([ADVERSARIAL[row], [0.5] * 3])
    exact = _exact(x)
    s64 = rows_sq64(x)
    assert s64.dtype == torch.float64
    up = round_up_sq_norms(s64, x.shape[1], torch.float32)
    assert up.dtype == torch.float32
    for u, ex in zip(up.tolist(), exact):
        assert Fraction(u) >= ex  # never below
        assert Fraction(u) <= ex * (1 + Fraction(1, 2**22)) + Fraction(1, 2**149)  # within 2 ulp (1 subnormal ulp)
    # products (the weight's ‖e‖²‖a‖²): still never below
    prod = round_up_sq_norms(s64 * s64, 2 * x.shape[1] + 1, torch.float32)
    for u, ex in zip(prod.tolist(), exact):
        assert u == math.inf or Fraction(u) >= ex * ex  # (case 5's product is past float32's range: +inf)


def test_rows_sq64_random_rows_against_exact_and_other_dtypes():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(33, 1001, generator=gen) * torch.logspace(-8, 8, 33).unsqueeze(1)
    s64 = rows_sq64(x)
    exact = _exact(x)
    assert all(abs(Fraction(v) - ex) <= ex * Fraction(1002, 2**53) for v, ex in zip(s64.tolist(), exact))
    up = round_up_sq_norms(s64, x.shape[1], torch.float32)
    assert all(Fraction(u) >= ex for u, ex in zip(up.tolist(), exact))
    # non-contiguous rows, bf16 and float64 inputs, an empty batch: the same values (up to float64 order)
    assert torch.allclose(rows_sq64(x.t().contiguous().t()), s64, rtol=1e-14, atol=0)
    xb = x.to(torch.bfloat16)
    assert torch.allclose(rows_sq64(xb), rows_sq64(xb.float()), rtol=1e-14, atol=0)
    assert torch.allclose(rows_sq64(x.double()), s64, rtol=1e-14, atol=0)
    assert rows_sq64(x[:0]).shape == (0,)
    assert round_up_sq_norms(s64, 1001, torch.float64) is s64  # float64 engines: as computed
    with pytest.raises(ValueError, match="2-D"):
        rows_sq64(x[0])
    with pytest.raises(ValueError, match="terms"):
        round_up_sq_norms(s64, 0, torch.float32)


def test_special_values_propagate():
    x = _rows([[float("nan"), 1.0], [float("inf"), 1.0], [1e30, 0.0], [2.0, 0.0]])
    up = round_up_sq_norms(rows_sq64(x), 2, torch.float32)
    assert math.isnan(up[0]) and up[1] == math.inf and up[2] == math.inf and up[3] > 4.0 - 1e-6
    assert Fraction(float(up[3])) >= 4


@pytest.mark.parametrize("bad", ["nan", "inf", "overflow"])
def test_nonfinite_examples_counted_and_zeroed_via_the_totals(bad):
    """One poisoned example: counted once, its norm that of a zero gradient (0 here, flat geometry); the rest
    unchanged. "overflow": finite inputs whose ‖a_i‖²·‖e_i‖² exceeds float32's range."""
    model, x, y = _setup(True, 1, torch.float32)
    clean = _source(model, x, y).sq_norms(ClipGeometry(), [0] * 4, 1)
    x[4, 3] = {"nan": float("nan"), "inf": float("inf"), "overflow": 1e25}[bad]
    src = _source(model, x, y)
    got = src.sq_norms(ClipGeometry(), [0, 0, 1, 1], 2)
    assert src.nonfinite == 1
    assert torch.equal(got[4], torch.zeros(2))
    keep = [i for i in range(B) if i != 4]
    assert torch.equal(got[keep].sum(1), got[keep, 0] + got[keep, 1])
    assert torch.allclose(got[keep].sum(1), clean[keep, 0], rtol=1e-6)
    sums = src.weighted_sum(torch.ones(B, 2), ClipGeometry(), [0, 0, 1, 1])
    assert all(bool(torch.isfinite(s).all()) for s in sums)


@pytest.mark.parametrize("bias", [True, False])
def test_sigma_zero_removing_one_example_moves_the_release_by_at_most_c(bias):
    """Through the Privatizer (``dp-sgd``, σ = 0, every example clipped): ‖Σ − Σ₋ⱼ‖ ≤ C for every j."""
    model, x, y = _setup(bias, 1, torch.float32)
    norms = _torch_func_sq_norms(model, x, y).sum(1).sqrt()
    c = 0.5 * float(norms.min())
    params = [p for p in model.parameters() if p.requires_grad]

    def released(xb, yb):
        opt = make_optimizer(
            "dp-sgd", params, noise_multiplier=0.0, expected_batch_size=1.0, sample_rate=0.1, lr=0.1, max_grad_norm=c
        )
        rel = opt.privatizer.privatize(iter_per_sample_sources(model, ce, xb, yb), params_like=params)
        return torch.cat([g.double().flatten() for g in rel.grads])

    full = released(x, y)
    for j in range(B):
        keep = torch.tensor([i for i in range(B) if i != j])
        moved = float((full - released(x[keep], y[keep])).norm())
        assert c * (1 - 1e-4) <= moved <= c * (1 + 1e-6), (j, moved / c)


def test_linear_part_sq64_needs_t1():
    pt = LinearPart(torch.randn(4, 3, 5), torch.randn(4, 3, 2))
    with pytest.raises(ValueError, match="T = 1"):
        pt.sq64("e")
    with pytest.raises(ValueError, match="side"):
        LinearPart(torch.randn(4, 5), torch.randn(4, 2)).sq64("x")
