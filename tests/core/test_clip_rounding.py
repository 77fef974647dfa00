"""The clip factor respects C in real arithmetic, whatever the floating-point rounding.

For every example i and group k the Privatizer's weight f must satisfy f·‖w_i,k‖ ≤ C_k for the EXACT
real norm of what the source sums (the sensitivity is computed from C_k). Three roundings could break it
and each test below first shows that the old computation does, on the same inputs:

* the group total of several per-parameter squared norms summed in float32 (rounds to nearest: below
  the exact sum), :class:`~dpopt.engine.fast.FastPerSampleGrads`;
* the hook door's scaling s²·‖g‖² in float32 (:class:`~dpopt.engine.layers.ScaledBlock`);
* √ and C/‖w‖ rounded to nearest (the factor itself, :func:`~dpopt.privatizer.clip_factors`).

Section (d), the review's follow-ups: sources that still rounded to nearest (the scale-only T = 1 closed form,
embeddings, the tied embedding + head), the bounds' device and floats, subnormal float64 factors, and the
quantile count's comparison; each test fails on the code before its fix.

Exact values are Python :class:`fractions.Fraction` (every float is one): f·√S ≤ C ⟺ f²·S ≤ C².
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from dpopt.auto_clipping import AutoClipping, AutoClipPrivatizer
from dpopt.engine import iter_per_sample_sources
from dpopt.engine.fast import FastPerSampleGrads
from dpopt.engine.layers import DirectBlock, FactoredBlock, ScaledBlock, unscaled
from dpopt.engine.shifted_norm import round_up
from dpopt.privatizer import Privatizer, clip_factors
from dpopt.privatizer import _round_down as round_down
from dpopt.types import ClipGeometry


def fr(x) -> Fraction:
    """The exact value of a float (or a 0-d tensor)."""
    return Fraction(float(x))


def within(f, sq_exact: Fraction, c: float) -> bool:
    """f·√sq_exact ≤ c, exactly."""
    return fr(f) ** 2 * sq_exact <= fr(c) ** 2


def old_factor(sq: Tensor, c: float) -> Tensor:
    """The former Privatizer rule, verbatim: min(1, C/‖w‖) in the norms' dtype."""
    norms = sq.clamp_min(0).sqrt()
    bounds = torch.tensor([c], dtype=norms.dtype)
    return torch.clamp(bounds / norms.clamp_min(1e-30), max=1.0)


class Fixed:
    """A block whose per-parameter squared norms are given ``[B]`` tensors (the sums are not used)."""

    def __init__(self, index, values):
        self.index, self.values = tuple(index), list(values)

    def sq_norms(self, geos):
        return [v.clone() for v in self.values]

    def grad_sums(self, coefs, bad):  # pragma: no cover — not called
        raise AssertionError

    def free(self):
        pass


# --------------------------------------------------------------------------- (a) adversarial cases
def test_group_total_rounding_down_in_float32_is_rounded_up_now():
    """1 + 300 terms just below half an ulp of 1: each float32 addition rounds back to 1.0, so the old
    total is 1.0 while the exact sum is 1 + 300·(2⁻²⁴ − 2⁻³⁴) ≈ 1 + 1.8e-5. With C = 1 the old weight was
    1 and the clipped norm exceeded C; the float64 total rounded up gives a weight that keeps it ≤ C."""
    tiny = 2.0**-24 - 2.0**-34
    terms = [torch.tensor([1.0])] + [torch.tensor([tiny]) for _ in range(300)]
    assert all(float(t) == v for t, v in zip(terms, [1.0, tiny]))  # exactly representable
    exact = fr(1.0) + 300 * fr(tiny)
    naive = torch.zeros(1, 1)
    for t in terms:
        naive[:, 0] += t
    assert float(naive) == 1.0 and fr(naive) < exact  # the old float32 total: below the exact sum
    assert not within(old_factor(naive, 1.0)[0, 0], exact, 1.0)  # ... and the old factor broke C
    src = FastPerSampleGrads(
        [Fixed([j], [t]) for j, t in enumerate(terms)],
        [torch.Size([1])] * len(terms),
        1,
        torch.float32,
        torch.device("cpu"),
    )
    sq = src.sq_norms(ClipGeometry(), [0] * len(terms), 1)
    assert sq.dtype == torch.float32 and fr(sq) >= exact
    assert fr(sq) <= exact * (1 + Fraction(2, 2**23))  # one ulp above at most: not pessimistic
    priv = Privatizer(0.0, 1.0, expected_batch_size=1.0, sample_rate=0.1)
    f = priv._clip_weights(sq, torch.tensor([1.0], dtype=torch.float64))
    assert within(f[0, 0], exact, 1.0)
    assert float(f) >= 1 / math.sqrt(float(exact)) * (1 - 4 * 2.0**-24)
    # AUTO-S with a γ below half an ulp of the norm: the old C/(‖w‖ + γ) was 1.0 as well
    auto = AutoClipPrivatizer(0.0, 1.0, expected_batch_size=1.0, sample_rate=0.1, auto=AutoClipping(1e-9))
    assert float(torch.tensor([1.0]) / (naive.sqrt() + 1e-9)) == 1.0
    fa = auto._clip_weights(sq, torch.tensor([1.0], dtype=torch.float64))
    assert fa.dtype == torch.float32 and within(fa[0, 0], exact, 1.0)
    assert float(fa) >= 1 / (math.sqrt(float(exact)) + 1e-9) * (1 - 4 * 2.0**-24)


def _searched(cond, n=20000, seed=0):
    """The first of n random float32 values in [1, 4) (a fixed seed) for which ``cond(value)``."""
    g = torch.Generator().manual_seed(seed)
    xs = 1 + 3 * torch.rand(n, generator=g)
    for x in xs:
        if cond(x):
            return x.reshape(1)
    raise AssertionError("no adversarial case found")  # pragma: no cover


def test_scaled_block_product_rounds_up():
    """s²·v in float32 rounds to nearest (below the exact product for about half the v); the block now
    returns a value never below it, one ulp above at most."""
    s = 3.0
    v = _searched(lambda x: fr(x * 9.0) < 9 * fr(x))  # the float32 product rounds down
    assert fr((v * (s * s))[0]) < 9 * fr(v[0])  # the old ScaledBlock value
    out = ScaledBlock(Fixed([0], [v]), s).sq_norms([(None, None)])[0]
    assert out.dtype == torch.float32 and 9 * fr(v[0]) <= fr(out[0]) <= 9 * fr(v[0]) * (1 + Fraction(1, 2**22))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sqrt_and_division_rounding_no_longer_exceed_c(dtype):
    """A squared norm S given exactly (S ≥ the exact norm², the source's contract) and C for which the old
    float rule min(1, C/√S) exceeds C/√S: found by search; the new factor keeps f·√S ≤ C."""
    g = torch.Generator().manual_seed(1)
    sq = (1 + 3 * torch.rand(20000, generator=g)).to(dtype).reshape(-1, 1)
    cs = (0.5 + 0.4 * torch.rand(20000, generator=g)).to(dtype).double().tolist()  # C < √S: clipped
    hit = None
    for i in range(sq.shape[0]):
        if not within(old_factor(sq[i : i + 1], cs[i])[0, 0], fr(sq[i, 0]), cs[i]):
            hit = i
            break
    assert hit is not None, "the search should find a case the old rule breaks"
    s, c = sq[hit : hit + 1], cs[hit]
    f = clip_factors(s, torch.tensor([c], dtype=torch.float64))
    assert f.dtype == dtype and within(f[0, 0], fr(s[0, 0]), c)
    # every one of the 20000: never above C, never needlessly small
    f_all = clip_factors(sq, torch.tensor(cs, dtype=torch.float64).reshape(-1, 1))
    for i in range(0, sq.shape[0], 97):
        assert within(f_all[i, 0], fr(sq[i, 0]), cs[i])
        eps = torch.finfo(dtype).eps
        assert float(f_all[i, 0]) >= cs[i] / math.sqrt(float(sq[i, 0])) * (1 - eps)


def test_round_down_and_round_up_bracket_the_value():
    x = torch.tensor([1 / 3, 2 / 3, 1e-40, 1e300, -1 / 3, 0.0, float("inf"), float("nan")], dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        lo, hi = round_down(x, dtype).double(), round_up(x, dtype).double()
        fin = torch.isfinite(x)
        assert bool((lo[fin] <= x[fin]).all()) and bool((hi[fin] >= x[fin]).all())
        assert bool(torch.isnan(lo[-1])) and float(lo[-2]) == float("inf")
    assert (
        float(round_down(torch.tensor([1e300], dtype=torch.float64), torch.float32)) == torch.finfo(torch.float32).max
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("c", [1.0, 0.1, 3.0, 1e-3 / 3])
def test_an_example_at_the_bound_keeps_weight_one(dtype, c):
    """S ≤ C² exactly gives weight exactly 1 (not the margin's ulp below); the next S above C² is clipped,
    and its weight still keeps f·√S ≤ C."""
    exact_c2 = fr(c) ** 2
    at = round_down(torch.tensor([[c * c]], dtype=torch.float64), dtype)
    while fr(at[0, 0]) > exact_c2:  # (c·c itself rounded up in float64): the largest S ≤ C² in the dtype
        at = torch.nextafter(at, torch.zeros_like(at))
    assert fr(at[0, 0]) <= exact_c2
    above = torch.nextafter(at, torch.full_like(at, float("inf")))
    if fr(above[0, 0]) <= exact_c2:  # C² itself is a float of the dtype: step over it
        above = torch.nextafter(above, torch.full_like(at, float("inf")))
    assert fr(above[0, 0]) > exact_c2
    b = torch.tensor([c], dtype=torch.float64)
    assert float(clip_factors(at, b)[0, 0]) == 1.0
    assert float(clip_factors(torch.zeros(1, 1, dtype=dtype), b)[0, 0]) == 1.0
    f = clip_factors(above, b)[0, 0]
    assert float(f) < 1.0 and within(f, fr(above[0, 0]), c)


# --------------------------------------------------------------------------- (b) property
_U = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    sq=st.floats(1e-12, 1e12, allow_nan=False, allow_infinity=False),
    c=st.floats(1e-4, 1e4, allow_nan=False, allow_infinity=False),
    gamma=st.sampled_from([0.0, 0.0, 0.01, 1e-7]),
)
def test_factor_never_exceeds_the_real_quotient(dtype, sq, c, gamma):
    """For the exact squared norm S (a float64) delivered rounded UP into the dtype (the sources'
    contract), f·√S ≤ C (and ≤ C·√S/(√S + γ) for AUTO-S), and f is at most a few units of roundoff
    below min(1, C/(√S + γ))."""
    exact = Fraction(sq)
    given_sq = round_up(torch.tensor([[sq]], dtype=torch.float64), dtype)
    assert fr(given_sq[0, 0]) >= exact
    cap = gamma == 0.0
    f = clip_factors(given_sq, torch.tensor([c], dtype=torch.float64), gamma, cap=cap)
    assert f.dtype == dtype
    assert within(f[0, 0], exact, c)
    if gamma:
        # f ≤ C/(√S + γ) ⟺ f·√S ≤ C − f·γ
        assert fr(f[0, 0]) ** 2 * exact <= (fr(c) - fr(f[0, 0]) * fr(gamma)) ** 2
    ideal = c / (math.sqrt(sq) + gamma)
    ideal = min(1.0, ideal) if cap else ideal
    assert float(f[0, 0]) >= ideal * (1 - 4 * _U[dtype] - 12 * 2.0**-53) - 1e-300  # clip_factors' 8u margin


# --------------------------------------------------------------------------- (c) end to end
class Recording(Privatizer):
    """The Privatizer with the weights it used recorded (for the exact check)."""

    def _clip_weights(self, sq, bounds):
        out = super()._clip_weights(sq, bounds)
        self.seen = (sq.clone(), out.clone())
        return out


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _loss(out, y):
    return nn.functional.cross_entropy(out, y, reduction="sum")


GROUPS = [0, 0, 1, 1]  # per layer: weight and bias of each Linear


def _exact_sq_reference(src) -> list[list[Fraction]]:
    """Exact ‖w_i,k‖² of the materialised per-example gradients (what the reference engine sums)."""
    out = [[Fraction(0)] * 2 for _ in range(src.batch_size)]
    for g, k in zip(src.grads, GROUPS):
        for i in range(src.batch_size):
            out[i][k] += sum(Fraction(v) ** 2 for v in g[i].double().flatten().tolist())
    return out


def _exact_sq_fast(src) -> list[list[Fraction]]:
    """Exact ‖w_i,k‖² of what the fast engine sums: e_i a_iᵀ of the recorded rows (T = 1) for a weight,
    the held per-example gradient for a bias."""
    out = [[Fraction(0)] * 2 for _ in range(src.batch_size)]
    for blk in map(unscaled, src.blocks):
        if isinstance(blk, FactoredBlock):
            (pt,) = blk.parts
            k = GROUPS[blk.index[0]]
            for i in range(src.batch_size):
                ea = [sum(Fraction(v) ** 2 for v in t[i].double().flatten().tolist()) for t in (pt.e, pt.a)]
                out[i][k] += ea[0] * ea[1]
        else:
            assert isinstance(blk, DirectBlock)
            for j, g in zip(blk.index, blk.grads):
                for i in range(src.batch_size):
                    out[i][GROUPS[j]] += sum(Fraction(v) ** 2 for v in g[i].double().flatten().tolist())
    return out


@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_clipped_examples_stay_within_c_end_to_end(engine):
    """A small MLP, per-layer groups, σ = 0. The bounds are set AT the float32 norm of one example in each
    group (the old rule gives it weight exactly 1), so every clipped norm sits within an ulp of C_k. For
    every example and group, weight²·(exact squared norm) ≤ C_k² (Fractions); for the reference engine the
    old rule is shown to break this on the same batch. Removing one example moves the released sum by at
    most √(C_0² + C_1²) (the release's sensitivity) up to the float32 rounding of the sums."""
    model = _mlp()
    b = 16
    x, y = torch.randn(b, 6, generator=torch.Generator().manual_seed(2)), torch.arange(b) % 3

    def source(rows):
        return next(iter(iter_per_sample_sources(model, _loss, x[rows], y[rows], engine=engine)))

    src = source(list(range(b)))
    exact = _exact_sq_fast(src) if engine == "fast" else _exact_sq_reference(src)
    sq = src.sq_norms(ClipGeometry(), GROUPS, 2)
    for i in range(b):
        for k in range(2):
            assert fr(sq[i, k]) >= exact[i][k]  # the source's contract, exactly
    # torch.func cross-check of what the fast engine clips (float64 recomputation of the norms)
    ref = (
        source(list(range(b)))
        if engine == "reference"
        else next(iter(iter_per_sample_sources(model, _loss, x, y, engine="reference")))
    )
    r64 = torch.stack(
        [sum(g.double().flatten(1).square().sum(1) for g, kk in zip(ref.grads, GROUPS) if kk == k) for k in (0, 1)], 1
    )
    torch.testing.assert_close(sq.double(), r64, rtol=1e-5, atol=0)
    # bounds at an example's float32 norm: the old rule's weight is exactly 1 there; the reference engine's
    # old total was the float64 sum rounded to nearest (below the exact one for about half the examples)
    if engine == "reference":  # the former PerSampleGrads.sq_norms, verbatim
        old_sq = torch.zeros(b, 2, dtype=torch.float64)
        for g, k in zip(src.grads, GROUPS):
            old_sq[:, k] += torch.linalg.vector_norm(g.reshape(b, -1), dim=1, dtype=torch.float64).square()
        old_sq = old_sq.float()
    else:
        old_sq = sq
    norms32 = old_sq.sqrt()
    pick = []
    for k in range(2):
        below = [i for i in range(b) if fr(norms32[i, k]) ** 2 < exact[i][k]]
        pick.append(below[0] if below else 0)
    bounds = [float(norms32[pick[k], k]) for k in range(2)]
    if engine == "reference":
        assert all(fr(norms32[pick[k], k]) ** 2 < exact[pick[k]][k] for k in range(2))
        old = torch.cat([old_factor(old_sq[:, k : k + 1], bounds[k]) for k in range(2)], 1)
        assert any(not within(old[pick[k], k], exact[pick[k]][k], bounds[k]) for k in range(2))

    def released(rows):
        priv = Recording(0.0, bounds, expected_batch_size=1.0, sample_rate=0.1, groups=GROUPS)
        priv.begin()
        priv.accumulate(source(rows))
        rel = priv.release()
        return priv.seen[1], torch.cat([g.double().flatten() for g in rel.grads])

    weights, full = released(list(range(b)))
    assert weights.dtype == torch.float32
    clipped = 0
    for i in range(b):
        for k in range(2):
            assert within(weights[i, k], exact[i][k], bounds[k]), (i, k)
            clipped += float(weights[i, k]) < 1
    assert clipped >= 4  # the bounds clip some examples
    sens = math.sqrt(bounds[0] ** 2 + bounds[1] ** 2)
    tol = 4 * b * 2.0**-24 * float(sum(w * math.sqrt(float(e)) for w, e in zip(weights.flatten(), sum(exact, []))))
    for j in (0, pick[0], pick[1]):
        _, part = released([i for i in range(b) if i != j])
        assert float((full - part).norm()) <= sens + tol, j


def _fast_source(src):
    """The :class:`FastPerSampleGrads` behind the optimizers' wrappers (a parameter-order view)."""
    while not isinstance(src, FastPerSampleGrads):
        src = src.source
    return src


def test_hook_door_mean_loss_scaled_norms_stay_within_c(monkeypatch):
    """``make_private`` with ``loss_reduction="mean"`` (the hook door's blocks scaled by B: ``ScaledBlock``),
    σ = 0: for every example, weight²·(exact squared norm of what is summed: B²·‖e_i‖²‖a_i‖² per weight,
    the held bias gradients) ≤ C², exactly; and the source's squared norms are never below the exact ones.
    With the code before this change (float32 totals, s²·v to nearest, min(1, C/√S) in float32) this fails
    on this batch (checked by hand: an example's weight above C/‖w‖; with 12 examples, a squared norm below
    the exact one); each defect alone is isolated by the unit tests above."""
    from torch.utils.data import DataLoader, TensorDataset

    from dpopt import PrivacyEngine

    seen = []
    accumulate, clip = Privatizer.accumulate, Privatizer._clip_weights

    def exact_of(src):
        src = _fast_source(src)
        out = [Fraction(0)] * src.batch_size
        for blk in src.blocks:
            s2 = fr(blk.scale) ** 2 if isinstance(blk, ScaledBlock) else Fraction(1)
            inner = unscaled(blk)
            if isinstance(inner, FactoredBlock):
                (pt,) = inner.parts
                for i in range(src.batch_size):
                    ee, aa = (sum(Fraction(v) ** 2 for v in t[i].double().flatten().tolist()) for t in (pt.e, pt.a))
                    out[i] += s2 * ee * aa
            else:
                for g in inner.grads:
                    for i in range(src.batch_size):
                        out[i] += s2 * sum(Fraction(v) ** 2 for v in g[i].double().flatten().tolist())
        return out

    def spy_accumulate(self, source):
        seen.append(
            {"exact": exact_of(source), "scaled": any(isinstance(b, ScaledBlock) for b in _fast_source(source).blocks)}
        )
        return accumulate(self, source)

    def spy_clip(self, sq, bounds):
        out = clip(self, sq, bounds)
        seen[-1].update(sq=sq.clone(), weights=out.clone())
        return out

    monkeypatch.setattr(Privatizer, "accumulate", spy_accumulate)
    monkeypatch.setattr(Privatizer, "_clip_weights", spy_clip)
    model = _mlp()
    b = 64
    x, y = torch.randn(b, 6, generator=torch.Generator().manual_seed(5)), torch.arange(b) % 3
    c = 0.05
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # σ = 0
        model, opt, _ = PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=b),
            noise_multiplier=0.0,
            max_grad_norm=c,
            poisson_sampling=False,
            loss_reduction="mean",
        )
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    (rec,) = seen
    assert rec["scaled"]  # the mean loss's scale B is folded into the blocks
    clipped = 0
    for i in range(b):
        assert fr(rec["sq"][i, 0]) >= rec["exact"][i]
        assert within(rec["weights"][i, 0], rec["exact"][i], c), i
        clipped += float(rec["weights"][i, 0]) < 1
    assert clipped == b  # C below every example's norm: all clipped, each within an ulp of C


# --------------------------------------------------------------------------- (d) review follow-ups
def _nearest32(x: Fraction) -> Fraction:
    """The float32 nearest to an exact value (what a float64 evaluation cast with ``.to`` gives, up to its
    ≈ 1e-16 relative error)."""
    return fr(torch.tensor(float(x), dtype=torch.float64).float())


def test_scale_only_closed_form_is_never_below_the_exact_norm():
    """The T = 1 Linear closed form in a scale-only geometry, Σ_jk e_j² a_k² / b_jk²: formerly evaluated in
    float32 (rounded to nearest at every step), its value fell below the exact squared norm by more than the
    fast source's round-up covers (the example picked: the old value's worst relative deficit). Now
    float64 and rounded up: ≥ the exact value (Fractions) and within a few float32 ulps of it."""
    torch.manual_seed(0)
    q = p = 256
    model = nn.Sequential(nn.Linear(p, q, bias=False))
    b = 16
    x, y = torch.randn(b, p), torch.randn(b, q)
    src = _fast_source(
        next(iter(iter_per_sample_sources(model, lambda o, t: ((o - t) ** 2).sum(), x, y, engine="fast")))
    )
    # powers of two (1/b² exact: the exact check's Fractions stay cheap; the float32 sums still round to nearest)
    scale = 2.0 ** torch.randint(-2, 3, (q, p), generator=torch.Generator().manual_seed(1)).float()
    (pt,) = unscaled(src.blocks[0]).parts
    e, a = pt.e[:, 0], pt.a[:, 0]
    old = ((e.square() @ scale.pow(-2)) * a.square()).sum(1)  # the former float32 evaluation, verbatim
    sq = src.sq_norms(ClipGeometry(scale=(scale,)), [0], 1)[:, 0]  # the fast source's total (one parameter)
    new = src.blocks[0].sq_norms([(None, scale)])[0]  # the block's own value
    assert src.blocks[0].form == "closed"
    e64, a64, s64 = e.double(), a.double(), scale.double()
    approx = ((e64[:, :, None] * a64[:, None, :] / s64) ** 2).sum((1, 2))
    i = int(((old.double() - approx) / approx).argmin())  # the old value's worst example
    inv2 = [[Fraction(1) / Fraction(bjk) ** 2 for bjk in row] for row in s64.tolist()]
    a2 = [Fraction(ak) ** 2 for ak in a64[i].tolist()]
    exact = sum(Fraction(ej) ** 2 * sum(x * y for x, y in zip(a2, row)) for ej, row in zip(e64[i].tolist(), inv2))
    assert fr(old[i]) < exact  # the old closed form: below the exact squared norm
    assert fr(new[i]) >= exact and fr(sq[i]) >= exact
    assert fr(new[i]) <= exact * (1 + Fraction(3, 2**23))  # a float32 ulp or so above: not pessimistic
    torch.testing.assert_close(new.double(), approx, rtol=3e-7, atol=0)


def _sparse(rows_list, v=6):
    """A SparseRowsBlock over V = ``v`` rows: example i looked up token i % v with gradient rows_list[i]."""
    from dpopt.engine.layers import SparseRowsBlock

    b = len(rows_list)
    idx = torch.tensor([[i % v] for i in range(b)])
    e = torch.stack(rows_list).reshape(b, 1, -1)
    return SparseRowsBlock(0, v, None, [(idx, e)], b)


def _exact_sparse(blk, m=None, b=None) -> list[Fraction]:
    """Exact Σ_v ‖(g_iv − m_v)/b_v‖² of a SparseRowsBlock (untouched rows: g_iv = 0)."""
    out = []
    for i in range(blk.B):
        total = Fraction(0)
        for v in range(blk.V):
            sel = [k for k in range(blk.rows.shape[0]) if int(blk.row_ex[k]) == i and int(blk.row_tok[k]) == v]
            g = blk.rows[sel[0]].double().tolist() if sel else [0.0] * blk.D
            for d in range(blk.D):
                w = Fraction(g[d]) - (fr(m[v, d]) if m is not None else 0)
                w = w / fr(b[v, d]) if b is not None else w
                total += w * w
        out.append(total)
    return out


def test_embedding_norms_are_rounded_up_not_to_nearest():
    """``SparseRowsBlock.sq_norms`` (embeddings): the float64 value was cast to float32 to nearest (below the
    exact value for about half the examples). Flat and shifted/scaled geometries: never below the exact value
    (Fractions, every vocabulary row), within a few ulps; the shifted form's cancellation (Σ_all − Σ_touched of
    ‖m_v/b_v‖²) is bounded absolutely, so an example near the shift is still ≥ exact."""
    g = torch.Generator().manual_seed(0)
    blk = _sparse([torch.randn(8, generator=g) for _ in range(24)], v=24)
    exact = _exact_sparse(blk)
    assert any(_nearest32(x) < x for x in exact)  # the old cast: below the exact value for some example
    (sq,) = blk.sq_norms([(None, None)])
    assert sq.dtype == torch.float32
    for i, x in enumerate(exact):
        assert x <= fr(sq[i]) <= x * (1 + Fraction(1, 2**22)), i
    # shift and scale: an example whose row equals the shift's (the touched term ≈ 0, the rest cancels)
    v, d = 6, 3
    m = torch.randn(v, d, generator=g)
    scale = 0.5 + torch.rand(v, d, generator=g)
    rows = [m[i % v].clone() + (1e-4 * torch.randn(d, generator=g) if i % 2 else 0) for i in range(12)]
    blk = _sparse(rows, v=v)
    for geo in ((m, scale), (m, None), (None, scale)):
        exact = _exact_sparse(blk, *geo)
        (sq,) = blk.sq_norms([geo])
        old = []  # the former evaluation: the same float64 value cast to nearest
        for i, x in enumerate(exact):
            assert fr(sq[i]) >= x, (geo[0] is None, geo[1] is None, i)
            assert fr(sq[i]) <= x * (1 + Fraction(1, 2**21)), i
            old.append(_nearest32(x) < x)
        assert any(old)


def test_tied_factored_norms_are_rounded_up():
    """The tied embedding + output projection's factored norm (``TiedBlock``, float64 with the cross term):
    cast to float32 to nearest before, now rounded up: ≥ the exact ‖Σ_t e_it a_itᵀ + S_i‖² (Fractions of the
    recorded rows), within a few ulps."""
    from dpopt.engine.layers import FactoredBlock, SparseRowsBlock
    from dpopt.engine.tied import TiedBlock

    v, d, b, t = 7, 3, 6, 3

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(v, d)
            self.head = nn.Linear(d, v, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(torch.tanh(self.emb(x)))

    torch.manual_seed(0)
    model = Tied()
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randint(0, v, (b, t), generator=gen), torch.randint(0, v, (b, t), generator=gen)

    def lm(out, yy):
        return nn.functional.cross_entropy(out.reshape(-1, v), yy.reshape(-1), reduction="sum")

    src = _fast_source(next(iter(iter_per_sample_sources(model, lm, x, y, engine="fast"))))
    (tb,) = [blk for blk in src.blocks if isinstance(blk, TiedBlock)]
    fac = next(u for u in tb.uses if isinstance(u, FactoredBlock))
    sp = next(u for u in tb.uses if isinstance(u, SparseRowsBlock))
    exact = []
    for i in range(b):
        gr = [[Fraction(0)] * d for _ in range(v)]
        for pt in fac.parts:
            e, a = pt.e[i].double().tolist(), pt.a[i].double().tolist()  # [T, V], [T, D]
            for tt in range(len(e)):
                for r in range(v):
                    for c in range(d):
                        gr[r][c] += Fraction(e[tt][r]) * Fraction(a[tt][c])
        for k in range(sp.rows.shape[0]):
            if int(sp.row_ex[k]) == i:
                for c, val in enumerate(sp.rows[k].double().tolist()):
                    gr[int(sp.row_tok[k])][c] += Fraction(val)
        exact.append(sum(z * z for row in gr for z in row))
    assert any(_nearest32(z) < z for z in exact)  # the old cast: below the exact value for some example
    (sq,) = tb.sq_norms([(None, None)])
    assert tb.form == "factored" and sq.dtype == torch.float32
    for i, z in enumerate(exact):
        assert z <= fr(sq[i]) <= z * (1 + Fraction(1, 2**22)), i


def test_clip_factors_bounds_on_sq_device_and_as_floats():
    """Bounds as a CPU tensor of shape [1] with ``sq`` on another device (meta stands in for CUDA: torch mixes a
    CPU tensor with a device one only when it is 0-dim; this failed before), as floats, as one float; the values
    equal the tensor path's."""
    sq = torch.ones(4, 1, device="meta")
    assert clip_factors(sq, torch.tensor([1.0], dtype=torch.float64)).device.type == "meta"
    assert clip_factors(sq, [1.0]).shape == (4, 1)
    s = torch.tensor([[0.25], [4.0], [9.0], [1e-300]], dtype=torch.float32)
    want = clip_factors(s, torch.tensor([1.0], dtype=torch.float64))
    for b in ([1.0], (1.0,), 1.0, torch.tensor([1.0])):
        assert torch.equal(clip_factors(s, b), want)
    assert float(want[1, 0]) <= 0.5 and float(want[0, 0]) == 1.0
    two = torch.tensor([[4.0, 4.0]], dtype=torch.float64)
    assert torch.equal(clip_factors(two, [1.0, 3.0]), clip_factors(two, torch.tensor([1.0, 3.0], dtype=torch.float64)))
    assert torch.equal(
        clip_factors(two, [1.0, 3.0], 0.01, cap=False),
        clip_factors(two, torch.tensor([1.0, 3.0], dtype=torch.float64), 0.01, cap=False),
    )


@pytest.mark.parametrize("cls", ["plain", "auto"])
def test_privatizer_passes_its_bounds_as_floats(monkeypatch, cls):
    """``accumulate`` hands ``clip_factors`` the Python floats it has (no device→host read of a bounds tensor per
    step); a direct ``_clip_weights`` call with another tensor still uses that tensor's values."""
    import dpopt.auto_clipping as ac
    import dpopt.privatizer as pv
    from dpopt.engine.reference import PerSampleGrads

    seen = []
    mod = ac if cls == "auto" else pv
    real = mod.clip_factors

    def spy(sq, bounds, *args, **kw):
        seen.append(bounds)
        return real(sq, bounds, *args, **kw)

    monkeypatch.setattr(mod, "clip_factors", spy)
    kw = dict(expected_batch_size=1.0, sample_rate=0.1)
    priv = AutoClipPrivatizer(0.0, 2.0, auto=AutoClipping(0.01), **kw) if cls == "auto" else Privatizer(0.0, 2.0, **kw)
    priv.begin()
    priv.accumulate(PerSampleGrads([torch.tensor([[3.0, 4.0]])]))
    assert seen and all(isinstance(x, tuple) and x == (2.0,) for x in seen)
    other = torch.tensor([1.0], dtype=torch.float64)
    f = priv._clip_weights(torch.tensor([[25.0]]), other)
    assert seen[-1] is other and float(f[0, 0]) <= 0.2


def test_subnormal_float64_factors_never_exceed_c():
    """float64 norms with C/√S subnormal: the 1 − 8u margin does not cover the division's absolute rounding
    there (about half of these cases had f·√S > C); such factors are now 0. Normal ones are unchanged."""
    import random

    rng = random.Random(1)
    cs = [rng.uniform(1e-170, 2e-170) for _ in range(300)]
    ss = [rng.uniform(1e290, 4e290) for _ in range(300)]
    sq = torch.tensor(ss, dtype=torch.float64).reshape(-1, 1)
    f = clip_factors(sq, torch.tensor(cs, dtype=torch.float64).reshape(-1, 1))
    raw = torch.tensor(cs, dtype=torch.float64).reshape(-1, 1) / sq.sqrt() * (1 - 8 * 2.0**-53)  # the old value
    assert sum(not within(raw[i, 0], fr(ss[i]), cs[i]) for i in range(300)) > 50  # old: above C/√S often
    for i in range(300):
        assert within(f[i, 0], fr(ss[i]), cs[i])
    assert float(f.max()) == 0.0
    # a normal quotient is untouched (not flushed): C/√S ≈ 1e-300
    g = clip_factors(torch.tensor([[1e200]], dtype=torch.float64), [1e-200], 0.01, cap=False)
    assert 0 < float(g) <= 1e-300 and within(g[0, 0], fr(1e200), 1e-200)


def test_quantile_count_uses_the_clip_decision():
    """The quantile count compares S ≤ C² exactly, as the clip factor does: S = 1 + 2⁻⁵² (float64, exact) with
    C = 1 is clipped (weight < 1) and counted as clipped; √S rounded to nearest is 1.0, which the former count
    (√S ≤ C) read as unclipped. S = 1 exactly: weight 1, counted as unclipped."""
    from dpopt.privatizer import QuantileClipping

    class Given:
        """A float64 source with the given squared norm (exact: 1 + 2⁻⁵² is a float64) and a one-element sum."""

        num_params, params = 1, None

        def __init__(self, s):
            self.s = s

        def sq_norms(self, geometry, groups, num_groups):
            return torch.tensor([[self.s]], dtype=torch.float64)

        def weighted_sum(self, weights, geometry, groups):
            return [weights[:, 0].sum().reshape(1).clone()]

    for s, clipped in ((1.0 + 2.0**-52, True), (1.0, False)):
        priv = Recording(1.0, 1.0, expected_batch_size=1.0, sample_rate=0.1, quantile=QuantileClipping(2.0))
        priv.begin()
        priv.accumulate(Given(s))
        sq, w = priv.seen
        assert math.sqrt(float(sq[0, 0])) == 1.0  # √S rounds to C
        assert (float(w[0, 0]) < 1.0) == clipped
        assert priv._count == (-0.5 if clipped else 0.5)
