"""The norms' and clip factors' small ops in C: the same bits as the torch expressions they replace (issue 34).

Three kernels of ``src/dpopt/_native.c`` (docs/performance.md, "The norms' small ops in C"):

* ``sq_round_up`` (:func:`dpopt.engine.row_norms.round_up_sq_norms`): float64 x (or x·y) times 1 + 2γ, rounded
  toward +∞ into float32;
* ``sq_group_totals`` (:meth:`dpopt.engine.fast.FastPerSampleGrads._sq_norms`): the per-parameter float32
  norms summed per clip group in float64 from 0 in parameter order, then rounded up likewise, with the
  all-finite check;
* ``clip_factors32`` (:func:`dpopt.privatizer.clip_factors`): min(1, C/√S), the float64 quotient times 1 − 8u,
  subnormals flushed to 0, rounded toward −∞ into float32, exactly 1 where S ≤ C².

Checked here: hand-computed values; raw bits against the torch expressions (the code before, forced by
patching the C paths' predicates) on random values over many decades and on special values, with one and two
torch threads; the results as bounds against exact rational arithmetic (``fractions``): a norm never below the
exact norm of the recorded rows, a factor times the exact norm never above C; a whole dp-sgd run
``torch.equal`` to the torch paths under the same seeded noise; per-parameter norms and clipped per-example
sums against single-example autograd (``torch.func``); σ = 0 sensitivity; the non-finite path; the kernels'
own argument checks; an extension built without them refused at import.
"""

from __future__ import annotations

import importlib
import math
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import dpopt.engine.fast as fast
import dpopt.engine.row_norms as row_norms
import dpopt.privatizer as privatizer
from dpopt.engine import iter_per_sample_sources
from dpopt.engine.row_norms import round_up_sq_norms, rounding_gamma, rows_sq64
from dpopt.engine.shifted_norm import round_up
from dpopt.kernels import native
from dpopt.methods import make_optimizer
from dpopt.privatizer import clip_factors
from dpopt.types import ClipGeometry

U = 2.0**-53
F32_MAX = float(torch.finfo(torch.float32).max)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def torch_round_up(x: torch.Tensor, terms: int, times=None) -> torch.Tensor:
    """``round_up_sq_norms``'s torch expression (the code before the C pass)."""
    v = x if times is None else x * times
    return round_up(v * (1.0 + 2.0 * rounding_gamma(terms + 1)), torch.float32)


def torch_clip_factors(sq: torch.Tensor, values: tuple) -> torch.Tensor:
    """``clip_factors``'s torch expression for ``cap`` and γ = 0 (the code before the C pass)."""
    b64 = privatizer._bounds64(values, sq.device)
    c2 = privatizer._squares_down(values, sq.device)
    sq64 = sq.double()
    f = privatizer._round_down(privatizer._flush_subnormal(b64 / sq64.sqrt() * privatizer._FACTOR_MARGIN), sq.dtype)
    return f.masked_fill_(sq64 <= c2, 1.0)


SPECIAL64 = [
    0.0, 1.0, 1.0 + 2.0**-60, 1.5, 7.0, 2.0**-149, 2.0**-150, 2.0**-126, 5e-324, 1e-310, 1e-45,
    F32_MAX, F32_MAX * (1 + 2.0**-30), 2.0**128, 1e308, math.inf, math.nan,
]  # fmt: skip


def _wide(n: int, seed: int, decades: float = 60.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * decades)


# ------------------------------------------------------------------------------------------- sq_round_up
def test_round_up_hand_values():
    # 1·(1 + 2γ_2) > 1 rounds up to the next float32 above 1; 0 stays 0; a value below float32's smallest
    # subnormal rounds up to it; above float32's largest: +inf; inf and nan stay
    x = torch.tensor([1.0, 0.0, 2.0**-160, F32_MAX * 1.5, math.inf, math.nan, 3.0], dtype=torch.float64)
    out = round_up_sq_norms(x, 1, torch.float32)
    assert out.dtype == torch.float32
    assert out[0].item() == 1.0 + 2.0**-23
    assert out[1].item() == 0.0
    assert out[2].item() == 2.0**-149
    assert out[3].item() == math.inf and out[4].item() == math.inf and math.isnan(out[5].item())
    assert out[6].item() == 3.0 + 2.0**-22  # 3·(1 + 2γ_2) just above 3: the next float32 (ulp of 3 is 2⁻²²)
    # the product form: 3·5 = 15 exactly, then the margin: the next float32 above 15
    xs, ys = torch.tensor([3.0], dtype=torch.float64), torch.tensor([5.0], dtype=torch.float64)
    assert round_up_sq_norms(xs, 4, torch.float32, times=ys).item() == 15.0 + 2.0**-20


@pytest.mark.parametrize("terms", [1, 10, 1785, 2**40])
def test_round_up_bit_identical_to_the_torch_expression(terms):
    x = _wide(50_000, 1)
    y = _wide(50_000, 2, 30.0)
    x[: len(SPECIAL64)] = torch.tensor(SPECIAL64, dtype=torch.float64)
    y[len(SPECIAL64) : 2 * len(SPECIAL64)] = torch.tensor(SPECIAL64, dtype=torch.float64)
    assert torch.equal(bits(round_up_sq_norms(x, terms, torch.float32)), bits(torch_round_up(x, terms)))
    assert torch.equal(bits(round_up_sq_norms(x, terms, torch.float32, times=y)), bits(torch_round_up(x, terms, y)))


def test_round_up_other_dtypes_and_shapes_keep_the_torch_path():
    x = _wide(1000, 3).reshape(10, 100)
    assert torch.equal(round_up_sq_norms(x, 5, torch.float32), torch_round_up(x, 5))  # 2-D through C
    t = x.t()  # not contiguous: torch path, same values
    assert torch.equal(round_up_sq_norms(t, 5, torch.float32), torch_round_up(t, 5))
    assert torch.equal(
        round_up_sq_norms(x, 5, torch.bfloat16), round_up(x * (1 + 2 * rounding_gamma(6)), torch.bfloat16)
    )
    assert round_up_sq_norms(x, 5, torch.float64) is x
    assert torch.equal(round_up_sq_norms(x, 5, torch.float64, times=x), x * x)
    s = torch.tensor(2.0, dtype=torch.float64)  # 0-dim
    assert round_up_sq_norms(s, 1, torch.float32).shape == () and round_up_sq_norms(s, 1, torch.float32).item() > 2.0
    with pytest.raises(ValueError, match="terms"):
        round_up_sq_norms(x, 0, torch.float32)


def test_t1_norms_never_below_the_exact_norm_of_the_recorded_rows():
    """rows_sq64 + the C round-up against exact rationals: ≥ exact, ≤ exact·(1 + 2⁻²¹), product form too."""
    g = torch.Generator().manual_seed(5)
    e = torch.randn(6, 300, generator=g) * torch.logspace(-15, 15, 6).unsqueeze(1).float()
    a = torch.randn(6, 77, generator=g)
    e[0, 0], e[0, 1:] = 1.0, 2.0**-30  # 1 + tiny squares: exact sum just above 1
    se, sa = rows_sq64(e), rows_sq64(a)
    w = round_up_sq_norms(se, 300 + 77 + 1, torch.float32, times=sa)
    bias = round_up_sq_norms(se, 300, torch.float32)
    for i in range(6):
        ee = sum(Fraction(float(v)) ** 2 for v in e[i].double().tolist())
        aa = sum(Fraction(float(v)) ** 2 for v in a[i].double().tolist())
        assert ee <= Fraction(float(bias[i])) <= ee * (1 + Fraction(1, 2**21))
        assert ee * aa <= Fraction(float(w[i])) <= ee * aa * (1 + Fraction(1, 2**21))
    assert float(bias[0]) > 1.0  # the tiny squares were not lost


def test_sq_round_up_checks_its_arguments():
    out = np.empty(3, np.float32)
    with pytest.raises(ValueError, match="sq_round_up"):
        native.sq_round_up(out, np.zeros(4), None, 1.0)  # length
    with pytest.raises(ValueError, match="sq_round_up"):
        native.sq_round_up(out, np.zeros(3, np.float32), None, 1.0)  # dtype
    with pytest.raises(ValueError, match="sq_round_up"):
        native.sq_round_up(out, np.zeros(3), np.zeros(2), 1.0)
    with pytest.raises(ValueError, match="writable"):
        ro = np.empty(3, np.float32)
        ro.flags.writeable = False
        native.sq_round_up(ro, np.zeros(3), None, 1.0)


# --------------------------------------------------------------------------------------- sq_group_totals
def test_group_totals_hand_values():
    out, total = np.empty((2, 2), np.float32), np.empty((2, 2))
    pieces = [np.array([1.0, 2.0], np.float32), np.array([3.0, 0.5], np.float32), np.array([4.0, 8.0], np.float32)]
    assert native.sq_group_totals(out, pieces, [0, 1, 0], 1.0, total) is True
    assert total.tolist() == [[5.0, 3.0], [10.0, 0.5]]
    assert out.tolist() == [[5.0, 3.0], [10.0, 0.5]]  # factor 1: exact totals stay
    native.sq_group_totals(out, pieces, [0, 1, 0], 1.0 + 2.0**-40, total)
    assert out[0, 0] == np.nextafter(np.float32(5.0), np.float32(np.inf))  # just above: rounded up
    # float32 terms widened exactly, added in float64: 1 + 2⁻³⁰ survives (float32 addition would lose it)
    tiny = [np.array([1.0], np.float32), np.array([2.0**-30], np.float32)]
    o1, t1 = np.empty((1, 1), np.float32), np.empty((1, 1))
    native.sq_group_totals(o1, tiny, [0, 0], 1.0, t1)
    assert t1[0, 0] == 1.0 + 2.0**-30 and o1[0, 0] == np.nextafter(np.float32(1), np.float32(2))
    nan = [np.array([1.0, np.inf], np.float32), np.array([np.nan, 1.0], np.float32)]
    assert native.sq_group_totals(out[:, :1].copy(), nan, [0, 0], 1.0, total[:, :1].copy()) is False


def test_group_totals_check_their_arguments():
    out, total = np.empty((2, 2), np.float32), np.empty((2, 2))
    ok = np.ones(2, np.float32)
    with pytest.raises(ValueError, match="outside"):
        native.sq_group_totals(out, [ok], [2], 1.0, total)
    with pytest.raises(ValueError, match="float32 \\[B\\]"):
        native.sq_group_totals(out, [np.ones(3, np.float32)], [0], 1.0, total)
    with pytest.raises(ValueError, match="float32 \\[B\\]"):
        native.sq_group_totals(out, [np.ones(2)], [0], 1.0, total)
    with pytest.raises(ValueError, match="one group per piece"):
        native.sq_group_totals(out, [ok, ok], [0], 1.0, total)
    with pytest.raises(ValueError, match="one group per piece"):
        native.sq_group_totals(np.empty(4, np.float32), [ok], [0], 1.0, np.empty(4))


# ----------------------------------------------------------------------------------------- clip_factors32
def _down(q: float) -> float:
    """float64 ``q`` rounded toward −∞ into float32 (by hand, numpy)."""
    f = np.float32(q)
    return float(np.nextafter(f, np.float32(-np.inf)) if float(f) > q else f)


def test_clip_factors_hand_values():
    sq = torch.tensor([[4.0], [1.0], [0.0], [math.inf], [-2.0], [math.nan], [0.25], [1.0000001]])
    f = clip_factors(sq, (1.0,))
    margin = 1.0 - 8.0 * 2.0**-53
    # 1/√4 = 0.5 exactly, times 1 − 8u just below: rounded down to the float32 below 0.5
    assert f[0].item() == 0.5 - 2.0**-25
    assert f[1].item() == 1.0 and f[2].item() == 1.0 and f[4].item() == 1.0  # S ≤ C² (negative reads as 0)
    assert f[3].item() == 0.0 and math.isnan(f[5].item())
    assert f[6].item() == 1.0
    s7 = float(sq[7])  # the float32 1 + 2⁻²³
    assert s7 == 1.0 + 2.0**-23 and f[7].item() == _down(1.0 / math.sqrt(s7) * margin) < 1.0
    # two groups, the second's bound 3: S = 9 is at the bound (1), S = 36 gives 3/6 = 0.5 → the float32 below
    f2 = clip_factors(torch.tensor([[9.0, 9.0], [1.0, 36.0]]), (1.0, 3.0))
    assert f2[0, 1].item() == 1.0 and f2[1, 1].item() == 0.5 - 2.0**-25
    assert f2[1, 0].item() == 1.0 and f2[0, 0].item() == _down((1.0 / 3.0) * margin) < 1 / 3


@pytest.mark.parametrize("threads", [1, 2])
def test_clip_factors_bit_identical_to_the_torch_expression(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        sq = torch.exp(torch.randn(30_000, 3, generator=g) * 20).float()
        sq.view(-1)[:18] = torch.tensor(
            [
                0.0,
                -0.0,
                -1.0,
                math.inf,
                math.nan,
                1.0,
                0.99999994,
                1.0000001,
                2.0**-149,
                F32_MAX,
                4.0,
                2.25,
                1e-45,
                1e30,
                1e-30,
                9.0,
                0.01,
                0.010000001,
            ]  # fmt: skip
        )
        for values in [(1.0, 2.0, 0.5), (1e-30, 3.0, 1e30), (0.1, 1.5, math.inf), (0.0, 1e-200, 1e200)]:
            got = clip_factors(sq, values)
            assert torch.equal(bits(got), bits(torch_clip_factors(sq, values))), values
    finally:
        torch.set_num_threads(before)


def test_clip_factor_times_the_exact_norm_never_exceeds_c():
    g = torch.Generator().manual_seed(11)
    sq = torch.exp(torch.randn(400, generator=g) * 8).float().unsqueeze(1)
    for c in (1.0, 0.1, 3.7):
        f = clip_factors(sq, (c,))
        for s, fi in zip(sq.flatten().tolist(), f.flatten().tolist()):
            # f·√S ≤ C ⟺ f²·S ≤ C², exactly in rationals
            assert Fraction(fi) ** 2 * Fraction(s) <= Fraction(c) ** 2
            assert fi <= 1.0
            if Fraction(s) > Fraction(c) ** 2:
                assert fi >= (c / math.sqrt(s)) * (1 - 2.0**-22)  # within ≈ one float32 ulp: not needlessly small


def test_clip_factors_other_inputs_keep_the_torch_path():
    sq = torch.tensor([[4.0, 16.0]])
    assert torch.equal(clip_factors(sq.double(), (1.0, 1.0)), torch_clip_factors(sq.double(), (1.0, 1.0)))
    assert torch.equal(clip_factors(sq, torch.tensor([1.0, 1.0])), torch_clip_factors(sq, (1.0, 1.0)))
    assert torch.equal(clip_factors(sq, (2.0,)), torch_clip_factors(sq, (2.0,)))  # one bound broadcast over 2 groups
    t = (torch.arange(12.0).reshape(3, 4) + 1)[:, ::2]  # [3, 2], not contiguous
    assert not t.is_contiguous()
    assert torch.equal(clip_factors(t, (2.0, 3.0)), torch_clip_factors(t, (2.0, 3.0)))


def test_clip_factors32_checks_its_arguments():
    sq, out = np.ones((2, 3), np.float32), np.empty((2, 3), np.float32)
    with pytest.raises(ValueError, match="clip_factors32"):
        native.clip_factors32(out, sq, np.ones(2), np.ones(3), 1.0)
    with pytest.raises(ValueError, match="clip_factors32"):
        native.clip_factors32(np.empty((2, 2), np.float32), sq, np.ones(3), np.ones(3), 1.0)
    with pytest.raises(ValueError, match="clip_factors32"):
        native.clip_factors32(out, sq.astype(np.float64), np.ones(3), np.ones(3), 1.0)


# ----------------------------------------------------------------------------------------- the whole step
B, P, H, K = 16, 24, 20, 6


ce = F.cross_entropy  # itself: the engine's batched per-example losses (dpopt.engine.row_losses), as dpopt train's


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(P, H), nn.Linear(H, K)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def _torch_paths(m: pytest.MonkeyPatch) -> None:
    """Every C path of this change off: the torch expressions of the code before."""
    m.setattr(row_norms, "_plain_cpu64", lambda x: False)
    m.setattr(fast, "_c_totals", lambda *a: False)
    m.setattr(privatizer, "_c_factors", lambda *a: False)


def _run(grouped: bool, steps: int = 3, sigma: float = 1.0, nan_row: bool = False):
    torch.manual_seed(0)
    model = MLP().train()
    params = list(model.parameters())
    kw = {"groups": [i % 2 for i in range(len(params))], "group_bounds": [0.7, 1.3]} if grouped else {}
    opt = make_optimizer(
        "dp-sgd",
        params,
        noise_multiplier=sigma,
        expected_batch_size=float(B),
        sample_rate=0.01,
        generator=torch.Generator().manual_seed(0),
        **kw,
    )
    gen = torch.Generator().manual_seed(3)
    out = []
    for s in range(steps):
        x, y = 3 * torch.randn(B, P, generator=gen), torch.randint(0, K, (B,), generator=gen)
        if nan_row and s == 1:
            x[5] = math.nan
        rel = opt.step(iter_per_sample_sources(model, ce, x, y, points=opt.evaluation_points()))
        out.append([g.clone() for g in rel.grads])
    return out, [p.detach().clone() for p in params]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("grouped", [False, True], ids=["flat", "two-groups"])
def test_releases_bit_identical_to_the_torch_paths(grouped, threads, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    calls = {"totals": 0, "factors": 0, "round": 0}
    for name, key in (("sq_group_totals", "totals"), ("clip_factors32", "factors"), ("sq_round_up", "round")):
        real = getattr(native, name)

        def counted(*a, _real=real, _key=key):
            calls[_key] += 1
            return _real(*a)

        monkeypatch.setattr(native, name, counted)
    try:
        new = _run(grouped, nan_row=True)
        assert min(calls.values()) >= 3  # the C paths ran
        with monkeypatch.context() as m:
            _torch_paths(m)
            n = dict(calls)
            old = _run(grouped, nan_row=True)
            assert calls == n  # and not here
    finally:
        torch.set_num_threads(before)
    for a_step, b_step in zip(new[0], old[0]):
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(a_step, b_step))
        assert all(torch.isfinite(a).all() for a in a_step)
    assert all(torch.equal(a, b) for a, b in zip(new[1], old[1]))


def _autograd_grads(model, x, y):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return ce(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def test_norms_and_clipped_sum_match_single_example_autograd():
    """Per-parameter norms (one group per parameter) ≥ autograd's and within 10⁻⁵; the clipped sum with the
    flat bound equals Σ_i min(1, C/‖g_i‖)·g_i from single-example autograd."""
    torch.manual_seed(1)
    model = MLP().train()
    gen = torch.Generator().manual_seed(2)
    x, y = 3 * torch.randn(B, P, generator=gen), torch.randint(0, K, (B,), generator=gen)
    g = _autograd_grads(model, x, y)
    per = torch.stack([v.double().flatten(1).square().sum(1) for v in g.values()], 1)  # [B, 4]
    src = next(iter(iter_per_sample_sources(model, ce, x, y)))
    sq = src.sq_norms(ClipGeometry(), [0, 1, 2, 3], 4)
    assert sq.dtype == torch.float32
    assert (sq.double() >= per * (1 - 1e-6)).all()
    torch.testing.assert_close(sq.double(), per, rtol=1e-5, atol=0)
    src = next(iter(iter_per_sample_sources(model, ce, x, y)))
    total = src.sq_norms(ClipGeometry(), [0] * 4, 1)
    c = 0.5 * float(per.sum(1).sqrt().median())  # about half the examples clipped
    f = clip_factors(total, (c,))
    assert 0 < int((f < 1).sum()) < B
    sums = src.weighted_sum(f, ClipGeometry(), [0] * 4)
    ref_f = torch.clamp(c / per.sum(1).sqrt(), max=1.0)
    for s, v in zip(sums, g.values()):
        ref = torch.tensordot(ref_f, v.double(), dims=1)
        torch.testing.assert_close(s.double(), ref, rtol=1e-5, atol=1e-7)
    clipped = (f[:, 0].double() ** 2) * per.sum(1)
    assert (clipped <= c * c * (1 + 1e-6)).all()


def test_sigma_zero_removing_one_example_moves_the_release_by_at_most_c():
    torch.manual_seed(4)
    gen = torch.Generator().manual_seed(5)
    x, y = 5 * torch.randn(B, P, generator=gen), torch.randint(0, K, (B,), generator=gen)
    c = 0.05

    def release(xs, ys):
        torch.manual_seed(4)
        model = MLP().train()
        opt = make_optimizer(
            "dp-sgd", list(model.parameters()), noise_multiplier=0.0, max_grad_norm=c, expected_batch_size=1.0,
            sample_rate=0.01,
        )  # fmt: skip
        rel = opt.step(iter_per_sample_sources(model, ce, xs, ys, points=opt.evaluation_points()))
        return torch.cat([r.flatten().double() for r in rel.grads])

    full = release(x, y)
    moves = []
    for i in range(B):
        keep = torch.arange(B) != i
        moves.append(float((full - release(x[keep], y[keep])).norm()))
    assert max(moves) <= c * (1 + 1e-5)
    assert max(moves) >= 0.99 * c  # the examples are clipped: a move at the bound


def test_nonfinite_example_flagged_through_the_c_totals():
    torch.manual_seed(1)
    model = MLP().train()
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(B, P, generator=gen), torch.randint(0, K, (B,), generator=gen)
    x[3] = math.inf
    src = next(iter(iter_per_sample_sources(model, ce, x, y)))
    sq = src.sq_norms(ClipGeometry(), [0] * 4, 1)
    assert src.nonfinite == 1 and bool(src._bad[3]) and int(src._bad.sum()) == 1
    assert torch.isfinite(sq).all() and sq[3].item() == 0.0  # the zero gradient's norm in the flat geometry


def test_an_extension_without_the_norm_kernels_is_refused(monkeypatch):
    from dpopt import _native

    monkeypatch.delattr(_native, "sq_group_totals")
    monkeypatch.delitem(sys.modules, "dpopt.kernels", raising=False)
    with pytest.raises(ImportError, match=r"older src/dpopt/_native\.c: sq_group_totals missing"):
        importlib.import_module("dpopt.kernels")
    monkeypatch.undo()
    importlib.import_module("dpopt.kernels")
