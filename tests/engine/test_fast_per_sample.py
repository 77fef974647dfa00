"""The fast per-sample engine (dpopt.engine) equals the torch.func reference path.

Every comparison is against :func:`dpopt.engine.reference.per_sample_gradients`
(materialised vmap(grad)), on models mixing every layer with a fast rule plus
parameters that must fall back, in float64 so that the tolerance (1e-9
relative) would catch any algebra slip.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpopt.engine import PerSampleEngine, fast_per_sample_gradients, iter_per_sample_sources
from dpopt.engine.layers import CONV_METHODS, Budget, ConvPart, im2col
from dpopt.engine.reference import per_sample_gradients
from dpopt.engine.shifted_norm import RECHECK_RTOL
from dpopt.methods import make_optimizer
from dpopt.models import build_model, num_parameters
from dpopt.privatizer import Privatizer, QuantileClipping
from dpopt.types import ClipGeometry, EvaluationPoint

DT = torch.float64


def ce(out, target):
    return nn.functional.cross_entropy(out, target)


class Mixed(nn.Module):
    """Embedding(+padding) → LayerNorm → Linear over a sequence; Conv2d (stride 2) → GroupNorm →
    Conv2d (even kernel, 'same', reflect) ; a module called twice; Linear head (T = 1);
    a bare parameter (no rule → reference path)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.ln = nn.LayerNorm(6)
        self.seq = nn.Linear(6, 5)
        self.conv = nn.Conv2d(2, 4, 3, padding=1, stride=2)
        self.gn = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 3, (2, 3), padding="same", padding_mode="reflect", dilation=(1, 2))
        self.twice = nn.Linear(5, 5)
        self.head = nn.Linear(5 + 3 * 4 * 4, 4)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        tok = x[:, :4].round().clamp(0, 10).long()
        img = x[:, 4:].reshape(-1, 2, 8, 8)
        h = self.seq(self.ln(self.emb(tok))).tanh()  # [B, 4, 5]: a sequence dimension
        h = self.twice(torch.relu(self.twice(h))).mean(1)  # the same module called twice
        c = self.conv2(torch.relu(self.gn(self.conv(img))))
        return self.head(torch.cat([h, c.flatten(1)], 1)) * self.gain


def mixed_batch(b: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, 11, (b, 4), generator=g).to(DT)
    img = torch.randn(b, 128, generator=g, dtype=DT)
    return torch.cat([tok, img], 1), torch.randint(0, 4, (b,), generator=g)


def make_mixed(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Mixed().to(DT)


def geometries(params, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    shift = tuple(0.3 * torch.randn(p.shape, generator=g, dtype=DT) for p in params)
    scale = tuple(0.2 + torch.rand(p.shape, generator=g, dtype=DT) for p in params)
    return {
        "flat": ClipGeometry(),
        "shift-scale": ClipGeometry(shift, scale),
        "shift": ClipGeometry(shift, None),
        "scale": ClipGeometry(None, scale),
    }


def assert_close(a, b, rtol=1e-9):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    assert a.shape == b.shape
    tol = rtol * (1.0 + float(b.abs().max())) if b.numel() else 0.0
    err = float((a - b).abs().max()) if b.numel() else 0.0
    assert err <= tol, f"max abs error {err:.3e} > {tol:.3e}"


def compare(fast, ref, params, groups, num_groups, seed=2):
    """Norms and weighted sums equal for every geometry; returns the fast forms used."""
    g = torch.Generator().manual_seed(seed)
    for _name, geo in geometries(params).items():
        sq_f = fast.sq_norms(geo, groups, num_groups)
        sq_r = ref.sq_norms(geo, groups, num_groups)
        assert_close(sq_f, sq_r)
        w = torch.rand(ref.batch_size, num_groups, generator=g, dtype=DT)
        for a, b in zip(fast.weighted_sum(w, geo, groups), ref.weighted_sum(w, geo, groups)):
            assert_close(a, b)
    assert fast.nonfinite == ref.nonfinite
    return fast.forms()


def test_mixed_model_plan_covers_supported_layers_and_falls_back_for_the_rest():
    model = make_mixed()
    eng = PerSampleEngine(model, ce)
    assert eng.fallback_names == ["gain"]
    assert set(eng.fast_names) == {n for n, _ in model.named_parameters()} - {"gain"}


@pytest.mark.parametrize("budget", ["cached", "uncached", "tiny-chunks"])
def test_fast_equals_reference_all_geometries_flat_and_per_layer(budget):
    model = make_mixed()
    kw = {"cached": {}, "uncached": {"cache_bytes": 0}, "tiny-chunks": {"cache_bytes": 0, "chunk_bytes": 1}}[budget]
    x, y = mixed_batch(9)
    fast = PerSampleEngine(model, ce, **kw).compute(x, y)
    ref = per_sample_gradients(model, ce, x, y)
    params = [p for p in model.parameters()]
    n = len(params)
    forms = compare(fast, ref, params, [0] * n, 1)  # flat
    compare(fast, ref, params, [i % 3 for i in range(n)], 3)  # per-layer groups
    idx = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    assert forms[idx["head.weight"]] == "closed"  # no sequence dimension
    expected = "direct" if budget == "cached" else "direct"  # last geometry is scale-only
    assert forms[idx["seq.weight"]] == expected


def test_gram_form_is_used_and_exact_in_flat_geometry_when_cheaper():
    # Linear over a length-3 sequence with p = q = 16: Gram cost T(p+q) = 96 < pq = 256.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Flatten(), nn.Linear(48, 3)).to(DT)
    x, y = torch.randn(6, 3, 16, dtype=DT), torch.randint(0, 3, (6,))
    fast = PerSampleEngine(model, ce, cache_bytes=0).compute(x, y)
    ref = per_sample_gradients(model, ce, x, y)
    flat = ClipGeometry()
    assert_close(fast.sq_norms(flat, [0] * 4, 1), ref.sq_norms(flat, [0] * 4, 1))
    assert fast.forms()[0] == "gram"
    w = torch.rand(6, 1, dtype=DT)
    for a, b in zip(fast.weighted_sum(w, flat, [0] * 4), ref.weighted_sum(w, flat, [0] * 4)):
        assert_close(a, b)


def test_im2col_matches_unfold():
    x = torch.randn(2, 3, 7, 9, dtype=DT)
    xp = nn.functional.pad(x, (2, 2, 1, 1))
    got = im2col(xp, (3, 2), (2, 1), (1, 2))
    want = nn.functional.unfold(x, (3, 2), dilation=(1, 2), padding=(1, 2), stride=(2, 1))
    assert torch.equal(got, want)


@pytest.mark.parametrize("method", CONV_METHODS)
@pytest.mark.parametrize(
    "conv",
    [
        dict(in_channels=3, out_channels=4, kernel_size=3, stride=2, padding=1),
        dict(
            in_channels=2, out_channels=3, kernel_size=(2, 3), padding="same", padding_mode="reflect", dilation=(1, 2)
        ),
        dict(in_channels=2, out_channels=2, kernel_size=3, padding=0, bias=False),
    ],
)
def test_conv_per_sample_kernels_equal_autograd(method, conv):
    torch.manual_seed(0)
    m = nn.Conv2d(**conv).to(DT)
    x = torch.randn(5, m.in_channels, 9, 8, dtype=DT)
    e = torch.randn_like(m(x))
    want = torch.stack(
        [torch.autograd.grad((m(x[i : i + 1]) * e[i : i + 1]).sum(), m.weight)[0] for i in range(5)]
    ).reshape(5, m.out_channels, -1)
    got = ConvPart(m, x, e).per_sample(1, 4, method)
    assert_close(got, want[1:4])


def test_empty_batch():
    model = make_mixed()
    x, y = mixed_batch(0)
    fast = fast_per_sample_gradients(model, ce, x, y)
    ref = per_sample_gradients(model, ce, x, y)
    params = list(model.parameters())
    geo = geometries(params)["shift-scale"]
    assert fast.sq_norms(geo, [0] * len(params), 1).shape == (0, 1)
    for a, p in zip(fast.weighted_sum(torch.zeros(0, 1, dtype=DT), geo, [0] * len(params)), params):
        assert a.shape == p.shape and float(a.abs().max()) == 0.0
    assert fast.batch_size == ref.batch_size == 0 and fast.nonfinite == 0


def test_nonfinite_examples_are_zeroed_like_the_reference():
    model = make_mixed()
    x, y = mixed_batch(7)
    x[2, 10] = float("nan")  # poisons example 2's conv path
    x[5, 30] = float("inf")
    eng = PerSampleEngine(model, ce)
    fast = eng.compute(x, y)
    assert eng.fallback_names == ["gain"]  # the plan check ignores non-finite examples
    ref = per_sample_gradients(model, ce, x, y)
    assert ref.nonfinite == 2
    params = list(model.parameters())
    compare(fast, ref, params, [0] * len(params), 1)
    assert fast.nonfinite == 2


def test_disk_points_two_evaluations_equal_reference():
    model = make_mixed()
    x, y = mixed_batch(5)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(3)
    offset = tuple(0.05 * torch.randn(p.shape, generator=g, dtype=DT) for p in params)
    points = [EvaluationPoint(2.5, offset), EvaluationPoint(-1.5)]
    fast = fast_per_sample_gradients(model, ce, x, y, points)
    ref = per_sample_gradients(model, ce, x, y, points)
    compare(fast, ref, params, [0] * len(params), 1)
    # the two points concatenate along t: the T = 1 head now needs the general form
    idx = [n for n, _ in model.named_parameters()].index("head.weight")
    assert fast.forms()[idx] != "closed"


def test_inplace_activation_after_linear_and_tied_weights():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight  # shared by two modules: one block, the uses' calls concatenated
            self.act = nn.ReLU(inplace=True)
            self.out = nn.Linear(4, 3)

        def forward(self, x):
            return self.out(self.act(self.b(self.act(self.a(x)))))

    torch.manual_seed(0)
    model = Tied().to(DT)
    eng = PerSampleEngine(model, ce)
    assert eng.fallback_names == []  # tied weights are on the fast path (engine.tied)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    fast, ref = eng.compute(x, y), per_sample_gradients(model, ce, x, y)
    params = list(model.parameters())
    compare(fast, ref, params, [0] * len(params), 1)


def test_parameter_used_outside_its_module_is_detected_and_falls_back():
    class Hidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 5)
            self.out = nn.Linear(5, 3)

        def forward(self, x):  # lin.weight is also used directly: invisible to the hooks
            h = self.lin(x) + nn.functional.linear(x, self.lin.weight)
            return self.out(torch.tanh(h))

    torch.manual_seed(0)
    model = Hidden().to(DT)
    eng = PerSampleEngine(model, ce)
    x, y = torch.randn(6, 5, dtype=DT), torch.randint(0, 3, (6,))
    with pytest.warns(RuntimeWarning, match="lin.weight"):
        fast = eng.compute(x, y)
    assert eng.fallback_names == ["lin.weight"]
    ref = per_sample_gradients(model, ce, x, y)
    params = list(model.parameters())
    compare(fast, ref, params, [0] * len(params), 1)


def test_float32_mlp_equivalence_and_dtype():
    torch.manual_seed(0)
    model = build_model("mlp-small")
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    fast, ref = fast_per_sample_gradients(model, ce, x, y), per_sample_gradients(model, ce, x, y)
    params = list(model.parameters())
    geo = ClipGeometry(
        tuple(0.01 * torch.randn_like(p) for p in params), tuple(0.05 + torch.rand_like(p) for p in params)
    )
    a, b = fast.sq_norms(geo, [0] * 4, 1), ref.sq_norms(geo, [0] * 4, 1)
    assert a.dtype == torch.float32
    assert torch.allclose(a, b, rtol=1e-4)
    w = torch.rand(16, 1)
    for u, v in zip(fast.weighted_sum(w, geo, [0] * 4), ref.weighted_sum(w, geo, [0] * 4)):
        assert torch.allclose(u, v, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- full privatize() outputs
def _privatize(model, src_fn, geometry=None, **kw):
    params = list(model.parameters())
    priv = Privatizer(
        1.3,
        kw.pop("bound", 0.7),
        expected_batch_size=8.0,
        sample_rate=0.1,
        generator=torch.Generator().manual_seed(11),
        **kw,
    )
    rel = priv.privatize(src_fn(), geometry, params_like=params)
    return rel, priv


@pytest.mark.parametrize("mode", ["flat", "per-layer", "quantile", "shift-scale"])
def test_privatize_outputs_identical_with_fixed_seed(mode):
    model = make_mixed()
    x, y = mixed_batch(10, seed=4)
    params = list(model.parameters())
    kw, geo = {}, None
    if mode == "per-layer":
        kw = {"bound": [0.3, 0.5, 0.4], "groups": [i % 3 for i in range(len(params))]}
    elif mode == "quantile":
        kw = {"quantile": QuantileClipping(count_noise_multiplier=2.0)}
    elif mode == "shift-scale":
        geo = geometries(params)["shift-scale"]
    kw2 = {k: (QuantileClipping(count_noise_multiplier=2.0) if k == "quantile" else v) for k, v in kw.items()}
    rf, pf = _privatize(model, lambda: iter_per_sample_sources(model, ce, x, y), geo, **kw)
    rr, pr = _privatize(model, lambda: per_sample_gradients(model, ce, x, y), geo, **kw2)
    for a, b in zip(rf.grads, rr.grads):
        assert_close(a, b, rtol=1e-8)
    assert rf.max_grad_norm == rr.max_grad_norm
    if mode == "quantile":
        assert pf.bounds == pytest.approx(pr.bounds, rel=1e-12)
        assert pf.ledger.entries[-1].meta["released_fraction"] == pytest.approx(
            pr.ledger.entries[-1].meta["released_fraction"], rel=1e-12
        )


def test_dp_macadam_steps_identical_fast_vs_reference():
    """Three DP-MacAdam steps (its own geometry feeds back) give the same parameters on both paths."""
    x, y = mixed_batch(12, seed=5)
    finals = []
    for engine in ("fast", "reference"):
        model = make_mixed()
        opt = make_optimizer(
            "dp-macadam",
            model.parameters(),
            noise_multiplier=0.8,
            expected_batch_size=10.0,
            sample_rate=0.1,
            generator=torch.Generator().manual_seed(0),
            lr=1e-2,
            h1=1e-6,
            h2=1.0,
        )
        for _ in range(3):
            opt.step(iter_per_sample_sources(model, ce, x, y, None, opt.evaluation_points(), engine=engine))
        finals.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*finals):
        assert_close(a, b, rtol=1e-7)


def test_unknown_engine_is_refused():
    model = make_mixed()
    x, y = mixed_batch(2)
    with pytest.raises(ValueError, match="unknown per-sample engine"):
        iter_per_sample_sources(model, ce, x, y, engine="ghost")


def test_model_sizes():
    assert num_parameters(build_model("cnn5")) == 582_346
    assert num_parameters(build_model("mlp")) == 795_010


def test_cnn5_float32_fast_equals_reference_with_macadam_geometry():
    torch.manual_seed(0)
    model = build_model("cnn5")
    x, y = torch.randn(3, 3, 32, 32), torch.randint(0, 10, (3,))
    fast, ref = fast_per_sample_gradients(model, ce, x, y), per_sample_gradients(model, ce, x, y)
    params = list(model.parameters())
    d = num_parameters(model)
    geo = ClipGeometry(
        tuple(1e-3 * torch.randn_like(p) for p in params),
        tuple(torch.full_like(p, 1.0 / d) * (0.5 + torch.rand_like(p)) for p in params),
    )
    a, b = fast.sq_norms(geo, [0] * len(params), 1), ref.sq_norms(geo, [0] * len(params), 1)
    # the shifted closed form of the Linear layers returns a guaranteed upper bound (float32
    # products + their worst-case rounding error, engine/shifted_norm.py), up to 2·RECHECK_RTOL above
    assert torch.allclose(a, b, rtol=2 * RECHECK_RTOL)
    assert (a >= b * (1 - 1e-6)).all()
    w = torch.rand(3, 1)
    for u, v in zip(fast.weighted_sum(w, geo, [0] * len(params)), ref.weighted_sum(w, geo, [0] * len(params))):
        assert torch.allclose(u, v, rtol=1e-4, atol=1e-4 * float(v.abs().max()))


def test_budget_accounting():
    b = Budget(chunk_bytes=10, cache_bytes=100)
    assert b.take(60) and not b.take(50) and b.used == 60
    b.give(60)
    assert b.used == 0 and b.take(100)


def test_shifted_geometry_norm_survives_cancellation_in_float32():
    """A shift close to every per-sample gradient: ‖g/b‖ ~ 1e4 but ‖(g − m)/b‖ ~ 1.

    The expanded closed form quad − 2·lin + const loses every digit in float32 here
    (and an underestimated norm would break the clip bound); the engine evaluates it
    in float64, so it must match the reference (materialised, float64) norms.
    """
    torch.manual_seed(3)
    lin = nn.Linear(50, 40)
    x = torch.randn(1, 50) + 1e-3 * torch.randn(8, 50)  # nearly identical examples
    y = torch.full((8,), 5)
    ref64 = per_sample_gradients(lin.double(), ce, x.double(), y)
    lin = lin.float()
    fast = fast_per_sample_gradients(lin, ce, x, y)
    mean = [g.mean(0) for g in ref64.grads]
    scale = [torch.full_like(m, 1e-4) for m in mean]
    geo64 = ClipGeometry(tuple(mean), tuple(scale))
    geo32 = ClipGeometry(tuple(m.float() for m in mean), tuple(s.float() for s in scale))
    want = ref64.sq_norms(geo64, [0, 0], 1)[:, 0]
    got = fast.sq_norms(geo32, [0, 0], 1)[:, 0].double()
    raw = ref64.sq_norms(ClipGeometry(None, tuple(scale)), [0, 0], 1)[:, 0]
    assert float((raw / want).min()) > 1e5  # the shift removes almost all of the norm: cancellation
    assert torch.allclose(got, want, rtol=1e-4)
