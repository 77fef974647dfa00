"""bf16 weights (``model.to(torch.bfloat16)``) through both doors: norms, clip factors and clipped sums in float32.

The engine casts the recorded bf16 layer inputs ``a`` and output gradients ``e`` to float32
(:func:`dpopt.engine.layers.compute_dtype`) before any product — a factored layer per chunk of examples, so
no float32 copy of the activations is held — and accumulates norms in float64 and sums in float32, as under
autocast. The Privatizer adds the float64 noise to the float32 sum and rounds the release to bf16 once,
after the noise. Checked here, on a pre-norm transformer block in bf16:

* the norms and sums are float32, and the factored layers keep the recorded bf16 tensors (no float32 copy;
  a step's allocator peak is below the float32 step's, under autocast and with bf16 weights);
* the norms against a float32 ``torch.func`` reference on the SAME bf16 weights (cast exactly to float32):
  only bf16's forward and backward differ (unit roundoff u = 2⁻⁸; a block chains about a dozen roundings,
  but they partly cancel in a norm). Stated tolerance 2u ≈ 0.78 % per norm (measured 0.28 %), and 8u ≈ 3.1 %
  of each example's gradient (measured 1.6 %);
* σ = 0 sensitivity through the ``dpopt train`` door (``iter_per_sample_sources`` → the Privatizer) and the
  ``make_private`` hook door: removing one example (every example clipped) moves the float32 clipped sum
  by C up to float32 rounding (relative 1e-5 asserted; with bf16 norms it moved by up to 1.007·C,
  docs/pitfalls.md item 19), and the bf16 release (× B̄) by at most C plus its final roundings — s + σS·z to
  bf16 once, then ÷ B̄ in bf16 — at most (2u + u²) of the two releases' norms (round to nearest:
  |fl(x) − x| ≤ u·|fl(x)|, Higham 2002, eq. 2.5).
  The hook door with ``loss_reduction="mean"`` is only characterised: the user's bf16 backward rounds the
  output gradients ∂ℓ_i/B, which depend on B, so the OTHER examples' g_i change when one is removed
  (measured up to 1.0018·C; the engine cannot undo a rounding of the model's backward — pitfalls item 19).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_autocast_blocks import Block, ce
from test_step_memory import peak_bytes
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

from dpopt import PrivacyEngine
from dpopt.engine import iter_per_sample_sources
from dpopt.engine.hooks import HookCapture
from dpopt.engine.layers import Budget, ConvPart, FactoredBlock, LinearPart, compute_dtype, unscaled
from dpopt.methods import make_optimizer
from dpopt.privatizer import Privatizer
from dpopt.types import ClipGeometry

B, T, E, C_OUT = 6, 4, 8, 3
U = 2.0**-8  # bf16 unit roundoff
C = 0.05  # below every example's norm here (asserted): each example is clipped
FINAL_ROUNDING = 2 * U + U * U  # the release's rounding to bf16, then ÷ B̄ in bf16 (docstring)


def _model():
    torch.manual_seed(0)
    return Block().train().to(torch.bfloat16)


def _data(n: int = B, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, T, E, generator=gen).to(torch.bfloat16), torch.randint(0, C_OUT, (n,), generator=gen)


def _mean_loss(out, y):
    return F.cross_entropy(out.float(), y)


def _engine_source(model, x, y):
    return next(iter(iter_per_sample_sources(model, ce, x, y)))


def _hook_source(model, x, y):
    cap = HookCapture(model, "mean")
    try:
        for _ in range(2):  # the first collect runs the first-batch check
            model.zero_grad()
            _mean_loss(model(x), y).backward()
            src = cap.collect()
        return src
    finally:
        cap.detach()


DOORS = {"engine": _engine_source, "hooks": _hook_source}


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.flatten() for t in ts])


def _reference(model, x, y):
    """Per-example gradients ``[B, d]`` by float32 ``torch.func`` on the same (bf16) weights cast to float32."""
    ref = copy.deepcopy(model).float()
    params = {k: v.detach() for k, v in ref.named_parameters()}

    def loss(p, xi, yi):
        return ce(functional_call(ref, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # vmap's fallback for the attention kernel (slow, exact)
        g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x.float(), y)
    return torch.cat([g[k].flatten(1) for k, _ in ref.named_parameters()], dim=1).double()


def test_compute_dtype():
    assert compute_dtype(torch.bfloat16) == torch.float32 and compute_dtype(torch.float16) == torch.float32
    assert compute_dtype(torch.float32) == torch.float32 and compute_dtype(torch.float64) == torch.float64
    with pytest.raises(ValueError, match="floating"):
        compute_dtype(torch.int64)


@pytest.mark.parametrize("door", list(DOORS))
def test_bf16_weights_norms_and_sums_in_float32_from_the_recorded_bf16_tensors(door):
    model, (x, y) = _model(), _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no demotion, no loop fallback
        src = DOORS[door](model, x, y)
    geo, n = ClipGeometry(), src.num_params
    assert src.sq_norms(geo, [0] * n, 1).dtype == torch.float32
    assert all(s.dtype == torch.float32 for s in src.weighted_sum(torch.ones(B, 1), geo, [0] * n))
    parts = [pt for blk in map(unscaled, src.blocks) if isinstance(blk, FactoredBlock) for pt in blk.parts]
    linear = [pt for pt in parts if isinstance(pt, LinearPart)]
    assert len(linear) >= 3  # the MLP's two Linear layers and the head (attention's projections too)
    assert all(pt.dtype == torch.float32 for pt in linear)
    # the plain Linear rule keeps what was recorded (bf16): cast per chunk, no float32 copy held
    assert sum(pt.a.dtype == torch.bfloat16 and pt.e.dtype == torch.bfloat16 for pt in linear) >= 3


@pytest.mark.parametrize("door", list(DOORS))
def test_bf16_weights_norms_against_float32_torch_func_on_the_same_weights(door):
    model, (x, y) = _model(), _data()
    want = _reference(model, x, y)  # [B, d] float32 values
    src = DOORS[door](copy.deepcopy(model), x, y)
    geo, n = ClipGeometry(), src.num_params
    norms = src.sq_norms(geo, [0] * n, 1)[:, 0].double().sqrt()
    ref = want.norm(dim=1)
    assert float((norms / ref - 1).abs().max()) <= 2 * U
    rows = []
    for i in range(B):  # each example's gradient (a one-hot weighted sum)
        w = torch.zeros(B, 1)
        w[i] = 1
        rows.append(_flat(src.weighted_sum(w, geo, [0] * n)).double())
    got = torch.stack(rows)
    assert float(((got - want).norm(dim=1) / ref).max()) <= 8 * U


def _privatizer(n_params):
    opt = make_optimizer(
        "dp-sgd", n_params, noise_multiplier=0.0, expected_batch_size=float(B), sample_rate=0.1, lr=0.1, max_grad_norm=C
    )
    return opt.privatizer


def _assert_moves(full: torch.Tensor, less: torch.Tensor) -> None:
    moved = float((full.double() - less.double()).norm())
    assert C * (1 - 1e-4) <= moved <= C * (1 + 1e-5), moved / C


def _assert_rounded_moves(full: torch.Tensor, less: torch.Tensor) -> None:
    """The bf16 releases (× B̄): ‖Δ‖ ≤ C + the final rounding of each."""
    f, g = full.double(), less.double()
    moved = float((f - g).norm())
    assert moved <= C * (1 + 1e-5) + FINAL_ROUNDING * float(f.norm() + g.norm()), moved / C


@pytest.fixture
def unrounded(monkeypatch):
    """The Privatizer's clipped sums s at each release, before s + σS·z is rounded to the parameters' dtype
    (σ = 0 here: they are the noisy sums before the rounding), as flat float64 vectors, in order."""
    out = []
    add_noise = Privatizer._add_noise

    def recorded(self, std, dtypes):
        assert std == 0.0 and all(t.dtype == torch.float32 for t in self._sum)  # float32 sums of bf16 parameters
        out.append(_flat(self._sum).double())
        return add_noise(self, std, dtypes)

    monkeypatch.setattr(Privatizer, "_add_noise", recorded)
    return out


def test_train_door_sigma_zero_sensitivity_with_bf16_weights(unrounded):
    """``dpopt train``'s step: ``iter_per_sample_sources`` → the Privatizer (float32 sums, bf16 release)."""
    model, (x, y) = _model(), _data()
    assert float(_reference(model, x, y).norm(dim=1).min()) > 2 * C  # every example is clipped
    params = [p for p in model.parameters() if p.requires_grad]
    priv = _privatizer(params)

    def sums(xb, yb):
        release = priv.privatize(iter_per_sample_sources(model, ce, xb, yb), params_like=params)
        assert all(g.dtype == torch.bfloat16 for g in release.grads)
        return unrounded[-1], _flat(release.grads) * B

    full, full16 = sums(x, y)
    for j in range(B):
        keep = torch.arange(B) != j
        less, less16 = sums(x[keep], y[keep])
        _assert_moves(full, less)
        _assert_rounded_moves(full16, less16)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_make_private_sigma_zero_sensitivity_with_bf16_weights(unrounded, releases, reduction):
    """``PrivacyEngine.make_private`` (hook door) on the bf16 model: the noisy sum before its rounding to bf16
    (the float32 clipped sum, σ = 0, recorded in the Privatizer) and the bf16 release that becomes ``p.grad``."""
    model, (x, y) = _model(), _data(2 * B, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # σ = 0: the reproducible-noise warning
        model, opt, _ = PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),  # releases, never moves θ
            data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
            noise_multiplier=0.0,
            max_grad_norm=C,
            poisson_sampling=False,
            loss_reduction=reduction,
        )
    params = [p for p in model.parameters() if p.requires_grad]

    def step(xb, yb):
        opt.zero_grad()
        F.cross_entropy(model(xb).float(), yb, reduction=reduction).backward()
        opt.step()
        assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in params)
        return unrounded[-1], _flat(releases[-1].grads) * releases[-1].expected_batch_size

    x, y = x[:B], y[:B]
    full, full16 = step(x, y)
    for j in range(B):
        keep = torch.arange(B) != j
        less, less16 = step(x[keep], y[keep])
        if reduction == "sum":
            _assert_moves(full, less)
            _assert_rounded_moves(full16, less16)
        else:  # the user's bf16 backward rounds ∂ℓ_i/B: g_i of the other examples moves too (docs/pitfalls.md 19)
            moved = float((full.double() - less.double()).norm())
            assert abs(moved / C - 1) <= 8 * U, moved / C  # measured ≤ 1.002: a characterisation, not a bound
    assert len(releases) == B + 1


def _exact_weighted_sum(a: torch.Tensor, e: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Σ_i c_i Σ_t e_it a_itᵀ in float64 from the bf16 values (exact in float64 up to its rounding)."""
    return torch.einsum("i,itq,itp->qp", c.double(), e.double(), a.double())


@pytest.mark.parametrize("chunk_bytes", [1, 16 << 20])
def test_linear_part_sums_bf16_inputs_in_float32_per_chunk(chunk_bytes):
    """The clipped sum of a bf16 layer: float32 products of the cast chunks, summed in float32 — one example
    per chunk (``chunk_bytes=1``) or all at once give the float64 value to float32 rounding (not bf16's)."""
    g = torch.Generator().manual_seed(4)
    a = torch.randn(5, 7, 6, generator=g).to(torch.bfloat16)
    e = torch.randn(5, 7, 4, generator=g).to(torch.bfloat16)
    c = torch.rand(5, generator=g)
    part = LinearPart(a, e, torch.float32)
    got = part.grad_sum(c, None, chunk_bytes)
    assert got.dtype == torch.float32 and part.a.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _exact_weighted_sum(a, e, c), rtol=1e-5, atol=1e-6)
    bad = torch.tensor([False, True, False, False, True])
    kept = ~bad
    torch.testing.assert_close(
        part.grad_sum(c, bad, chunk_bytes).double(),
        _exact_weighted_sum(a[kept], e[kept], c[kept]),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("chunk_bytes", [1, 16 << 20])
def test_conv_part_norms_and_sums_of_bf16_inputs_in_float32(chunk_bytes):
    g = torch.Generator().manual_seed(5)
    conv = torch.nn.Conv2d(2, 3, 3, padding=1).to(torch.bfloat16)
    x = torch.randn(4, 2, 5, 5, generator=g).to(torch.bfloat16)
    e = torch.randn(4, 3, 5, 5, generator=g).to(torch.bfloat16)
    c = torch.rand(4, generator=g)
    part = ConvPart(conv, x, e, 1, torch.float32)
    # the truth: per-example float64 weight gradients of the same bf16 values
    per = torch.stack(
        [
            torch.nn.grad.conv2d_weight(x[i : i + 1].double(), conv.weight.shape, e[i : i + 1].double(), padding=1)
            for i in range(4)
        ]
    ).flatten(1)
    got = part.grad_sum(c, None, chunk_bytes)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double().flatten(), (c.double().unsqueeze(1) * per).sum(0), rtol=1e-5, atol=1e-6)
    blk = FactoredBlock(0, tuple(conv.weight.shape), [part], Budget(max(chunk_bytes, 1)), 4)
    sq = blk.sq_norms([(None, None)])[0]
    assert sq.dtype == torch.float32
    torch.testing.assert_close(sq.double(), per.square().sum(1), rtol=1e-5, atol=0.0)


def _step_peak_bytes(mode: str) -> int:
    """Peak CPU-allocator bytes of one per-sample step (source, norms, clipped sum) of 4 Linear(256) layers on
    ``[8, 64, 256]`` inputs: float32, under bf16 autocast, or with bf16 weights (after the first-batch check)."""
    torch.manual_seed(0)
    width, layers = 256, 4
    model = torch.nn.Sequential(
        *[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())],
        torch.nn.Linear(width, 3),
    )
    x, y = torch.randn(8, 64, width), torch.randint(0, 3, (8,))
    if mode == "weights":
        model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)

    def loss(out, yb):
        return F.cross_entropy(out.float().mean(1), yb)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            src = next(iter(iter_per_sample_sources(model, loss, x, y)))
        n, geo = src.num_params, ClipGeometry()
        w = torch.clamp(src.sq_norms(geo, [0] * n, 1).sqrt().reciprocal(), max=1.0)
        assert all(s.dtype == torch.float32 for s in src.weighted_sum(w, geo, [0] * n))

    step()  # the first-batch check
    return peak_bytes(step)


def test_bf16_activations_are_cast_per_chunk_not_held_in_float32():
    """Deterministic (allocation sizes): with bf16 activations — autocast or bf16 weights — the step holds the
    recorded bf16 a and e and casts chunks, so it peaks below the float32 step (measured 4.78 against 6.79 MiB;
    when autocast's a and e were cast whole to float32 it peaked at 6.80 MiB, as float32 does)."""
    fp32 = _step_peak_bytes("float32")
    assert _step_peak_bytes("autocast") <= 0.8 * fp32
    assert _step_peak_bytes("weights") <= 0.8 * fp32


@pytest.mark.parametrize("shift", [False, True])
def test_bf16_weights_with_a_clip_geometry_in_bf16_float32_or_float64(shift):
    """AdaClip / DP-MacAdam keep their geometry in the parameters' dtype: bf16 for a bf16 model. The closed form of a
    T = 1 layer with a shift used to raise (``bmm`` of float32 rows with a bf16 geometry); now the geometry is met in
    the wider dtype. A bf16 geometry gives exactly the norms of the same values in float32 (the widening is exact);
    a float64 geometry is not rounded, and its norms are the float64 value rounded up into float32. Both are checked
    against ‖(g_i − m)/b‖² from float64 ``torch.func`` per-example gradients on the same weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 5, generator=gen).to(torch.bfloat16), torch.randint(0, 3, (8,), generator=gen)
    ps = list(model.parameters())
    scale = [(0.5 + torch.rand(p.shape, generator=gen, dtype=torch.float64)).to(torch.bfloat16) for p in ps]
    sh = [(0.01 * torch.randn(p.shape, generator=gen, dtype=torch.float64)).to(torch.bfloat16) for p in ps]

    def geometry(dt):
        return ClipGeometry(tuple(s.to(dt) for s in sh) if shift else None, tuple(s.to(dt) for s in scale))

    src = _engine_source(model, x, y)
    groups = list(range(len(ps)))
    norms = {dt: src.sq_norms(geometry(dt), groups, len(ps)) for dt in (torch.bfloat16, torch.float32, torch.float64)}
    assert all(n.dtype == torch.float32 for n in norms.values())
    assert torch.equal(norms[torch.bfloat16], norms[torch.float32])
    ref = copy.deepcopy(model).double()
    params = {k: v.detach() for k, v in ref.named_parameters()}
    g = vmap(grad(lambda p, xi, yi: ce(functional_call(ref, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))), (None, 0, 0))(
        params, x.double(), y
    )
    for k, (name, _) in enumerate(ref.named_parameters()):
        w = (g[name] - (sh[k].double() if shift else 0.0)) / scale[k].double()
        exact = w.flatten(1).square().sum(1)
        # the engine reads the bf16 forward's recorded rows; the reference runs the float64 forward (bf16 inputs
        # and weights): the rows differ by the bf16 forward's rounding, a few u relative
        torch.testing.assert_close(norms[torch.float64][:, k].double(), exact, rtol=8 * U, atol=0.0)
        torch.testing.assert_close(norms[torch.float32][:, k].double(), exact, rtol=8 * U, atol=0.0)


@pytest.mark.parametrize("method", ["adaclip", "dp-macadam"])
def test_bf16_weights_train_with_the_adaptive_geometry_methods(method):
    """Three steps of AdaClip / DP-MacAdam on a bf16 MLP (their shift/scale states are bf16): finite bf16 parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 5, generator=gen).to(torch.bfloat16), torch.randint(0, 3, (8,), generator=gen)
    opt = make_optimizer(
        method, list(model.parameters()), noise_multiplier=1.0, expected_batch_size=8.0, sample_rate=0.1
    )
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        opt.step(iter_per_sample_sources(model, ce, x, y, None, opt.evaluation_points()))
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_hook_door_shift_is_divided_by_the_batch_in_float64_whatever_its_dtype():
    """The hook door's blocks are scaled by B (a mean loss); the shift is divided by B before the inner norm. In the
    shift's own dtype that division rounded it (a bf16 shift: relative 2⁻⁸), and an example near the shift got a
    norm below the exact one (review of 2026-12-07: 0.965 of it). In float64 the same shift values give the same
    norms whether they come as bf16, float32 or float64."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 5, generator=gen) + 0.05 * torch.randn(12, 5, generator=gen)  # similar examples
    y = torch.zeros(12, dtype=torch.long)
    src = _hook_source(model, x, y)
    ref = copy.deepcopy(model).double()
    params = {k: v.detach() for k, v in ref.named_parameters()}
    g = vmap(grad(lambda p, xi, yi: ce(functional_call(ref, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))), (None, 0, 0))(
        params, x.double(), y
    )
    names = [k for k, _ in ref.named_parameters()]
    shift = [g[k].mean(0).to(torch.bfloat16) for k in names]  # near the mean gradient: ‖g_i − m‖ ≪ ‖m‖
    norms = [
        src.sq_norms(ClipGeometry(tuple(s.to(dt) for s in shift), None), list(range(4)), 4)
        for dt in (torch.bfloat16, torch.float32, torch.float64)
    ]
    assert torch.equal(norms[0], norms[1]) and torch.equal(norms[1], norms[2])
    exact = torch.stack([(g[k] - shift[i].double()).flatten(1).square().sum(1) for i, k in enumerate(names)], 1)
    # against a float64 forward: the recorded float32 rows differ by the float32 forward's rounding, amplified by
    # the cancellation ‖g‖/‖g − m‖ (≈ 10³ here); the dtype of the shift no longer adds to it
    torch.testing.assert_close(norms[0].double(), exact, rtol=5e-4, atol=0.0)
