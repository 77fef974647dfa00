"""Recognised losses' per-row values from one batched call (dpopt.engine.row_losses, issue 34).

The engine's per-example losses ℓ_r = loss_fn(out[r:r+1], y[r:r+1]) are
computed by one batched ``reduction="none"`` call for ``cross_entropy`` /
``mse_loss`` as torch defines them, and by ``torch.func.vmap`` of the single-row
call otherwise. Each case here is checked against single-example autograd:
the values, the output gradients for random weights, and the engine's
per-example parameter gradients (``torch.func`` loop reference); a spy on the
two paths asserts which one ran.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpopt.engine.fast as fast_mod
from dpopt.engine import PerSampleEngine
from dpopt.engine.fast import _per_example_losses
from dpopt.engine.reference import per_sample_gradient_tensors
from dpopt.engine.row_losses import recognised_kind, recognised_row_losses
from dpopt.types import ClipGeometry

DT = torch.float64
N, C = 7, 5


class Spy:
    """Counts the batched (recognised) and vmap paths taken by ``fast._per_example_losses``."""

    def __init__(self, monkeypatch):
        self.batched = self.vmapped = 0
        real_rec, real_vmap = fast_mod.recognised_row_losses, fast_mod.vmap

        def rec(loss_fn, out, y):
            r = real_rec(loss_fn, out, y)
            self.batched += r is not None
            return r

        def vm(*a, **k):
            self.vmapped += 1
            return real_vmap(*a, **k)

        monkeypatch.setattr(fast_mod, "recognised_row_losses", rec)
        monkeypatch.setattr(fast_mod, "vmap", vm)


def single_rows(loss_fn, out, y, w):
    """ℓ_r and w_r · ∂ℓ_r/∂out_r by one autograd call per row (the definition)."""
    vals, grads = [], []
    for r in range(out.shape[0]):
        o = out.detach()[r : r + 1].clone().requires_grad_(True)
        loss = loss_fn(o, y[r : r + 1]).reshape(())
        (g,) = torch.autograd.grad(loss, o, w[r].to(loss.dtype))
        vals.append(loss.detach())
        grads.append(g[0])
    return torch.stack(vals), torch.stack(grads)


def batched_rows(loss_fn, out, y, w):
    o = out.detach().clone().requires_grad_(True)
    loss = _per_example_losses(loss_fn, o, y)
    (g,) = torch.autograd.grad(loss, o, w.to(loss.dtype))
    return loss.detach(), g


def ce_data(ignored=(), dtype=DT, ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = 3 * torch.randn(N, C, generator=g, dtype=dtype)
    y = torch.randint(0, C, (N,), generator=g)
    for r in ignored:
        y[r] = ignore_index
    return out, y


CE_CASES = {
    "functional": F.cross_entropy,
    "module-mean": nn.CrossEntropyLoss(),
    "module-sum": nn.CrossEntropyLoss(reduction="sum"),
    "module-none": nn.CrossEntropyLoss(reduction="none"),
}


@pytest.mark.parametrize("name", list(CE_CASES))
@pytest.mark.parametrize("ignored", [(), (1, 4)])
def test_cross_entropy_rows_equal_single_example_autograd(monkeypatch, name, ignored):
    loss_fn = CE_CASES[name]
    out, y = ce_data(ignored)
    w = torch.rand(N, generator=torch.Generator().manual_seed(3), dtype=DT) + 0.5
    spy = Spy(monkeypatch)
    v, g = batched_rows(loss_fn, out, y, w)
    assert (spy.batched, spy.vmapped) == (1, 0)
    v_ref, g_ref = single_rows(loss_fn, out, y, w)
    torch.testing.assert_close(v, v_ref, rtol=1e-13, atol=1e-13, equal_nan=True)
    torch.testing.assert_close(g, g_ref, rtol=1e-13, atol=1e-13)
    # hand-computed: ℓ_r = logsumexp(out_r) − out_r[y_r]; an ignored row is 0/0 = NaN ("mean") or 0, gradient 0
    keep = torch.ones(N, dtype=torch.bool)
    keep[list(ignored)] = False
    hand = torch.logsumexp(out, 1) - out.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(v[keep], hand[keep], rtol=1e-13, atol=1e-13)
    if ignored:
        mean = loss_fn is F.cross_entropy or loss_fn.reduction == "mean"
        assert bool(v[~keep].isnan().all()) if mean else bool((v[~keep] == 0).all())
        assert bool((g[~keep] == 0).all())


def test_cross_entropy_custom_ignore_index_and_float32(monkeypatch):
    loss_fn = nn.CrossEntropyLoss(ignore_index=2)  # a real class index, ignored
    out, y = ce_data(dtype=torch.float32, seed=5)
    y[0], y[3] = 2, 2
    w = torch.rand(N, generator=torch.Generator().manual_seed(3))
    spy = Spy(monkeypatch)
    v, g = batched_rows(loss_fn, out, y, w)
    assert (spy.batched, spy.vmapped) == (1, 0) and v.dtype == torch.float32
    v_ref, g_ref = single_rows(loss_fn, out, y, w)
    torch.testing.assert_close(v, v_ref, equal_nan=True)
    torch.testing.assert_close(g, g_ref)
    assert torch.equal(v.isnan(), y == 2) and bool(v[[0, 3]].isnan().all())  # exactly the ignored rows


MSE_CASES = {
    "functional [n,3]": (F.mse_loss, (N, 3)),
    "module-mean [n,2,3]": (nn.MSELoss(), (N, 2, 3)),
    "module-sum [n,3]": (nn.MSELoss(reduction="sum"), (N, 3)),
    "functional [n]": (F.mse_loss, (N,)),
    "module-none [n,1]": (nn.MSELoss(reduction="none"), (N, 1)),
}


@pytest.mark.parametrize("name", list(MSE_CASES))
def test_mse_rows_equal_single_example_autograd(monkeypatch, name):
    loss_fn, shape = MSE_CASES[name]
    g0 = torch.Generator().manual_seed(1)
    out, y = torch.randn(shape, generator=g0, dtype=DT), torch.randn(shape, generator=g0, dtype=DT)
    w = torch.rand(N, generator=g0, dtype=DT)
    spy = Spy(monkeypatch)
    v, g = batched_rows(loss_fn, out, y, w)
    assert (spy.batched, spy.vmapped) == (1, 0)
    v_ref, g_ref = single_rows(loss_fn, out, y, w)
    torch.testing.assert_close(v, v_ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(g, g_ref, rtol=1e-13, atol=1e-13)
    sq = (out - y).reshape(N, -1) ** 2  # hand-computed: the row's mean or sum of squared errors
    reduction = getattr(loss_fn, "reduction", "mean")
    torch.testing.assert_close(v, sq.mean(1) if reduction == "mean" else sq.sum(1), rtol=1e-13, atol=1e-13)


class SubCE(nn.CrossEntropyLoss):
    pass


FALLBACKS = {
    "weight": (nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, C, dtype=DT)), "ce"),
    "label_smoothing": (nn.CrossEntropyLoss(label_smoothing=0.1), "ce"),
    "subclass": (SubCE(), "ce"),
    "lambda": (lambda o, t: F.cross_entropy(o, t), "ce"),
    "partial": (functools.partial(F.cross_entropy, reduction="sum"), "ce"),
    "probability targets": (F.cross_entropy, "ce-prob"),
    "3-d output": (F.cross_entropy, "ce-3d"),
    "mse broadcast [n,1] vs [n]": (F.mse_loss, "mse-bcast"),
    "mse none [n,3]": (nn.MSELoss(reduction="none"), "mse-wide"),
    "l1": (F.l1_loss, "mse-same"),
}


def fallback_data(kind):
    g = torch.Generator().manual_seed(2)
    if kind == "ce":
        return ce_data()
    if kind == "ce-prob":
        return torch.randn(N, C, generator=g, dtype=DT), torch.softmax(torch.randn(N, C, generator=g, dtype=DT), 1)
    if kind == "ce-3d":
        return torch.randn(N, C, 4, generator=g, dtype=DT), torch.randint(0, C, (N, 4), generator=g)
    if kind == "mse-bcast":
        return torch.randn(N, 1, generator=g, dtype=DT), torch.randn(N, generator=g, dtype=DT)
    if kind == "mse-wide":
        return torch.randn(N, 1, generator=g, dtype=DT), torch.randn(N, 1, generator=g, dtype=DT)
    return torch.randn(N, 3, generator=g, dtype=DT), torch.randn(N, 3, generator=g, dtype=DT)


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_unrecognised_losses_keep_vmap(monkeypatch, name):
    loss_fn, kind = FALLBACKS[name]
    out, y = fallback_data(kind)
    if name == "mse none [n,3]":
        out, y = out.expand(N, 3).contiguous(), y.expand(N, 3).contiguous()
    assert recognised_row_losses(loss_fn, out, y) is None
    spy = Spy(monkeypatch)
    if name == "mse none [n,3]":  # three numbers for one example: the engine's own refusal, as before
        with pytest.raises(ValueError, match="one number per example"):
            batched_rows(loss_fn, out, y, torch.ones(N, dtype=DT))
        return
    if name == "mse broadcast [n,1] vs [n]":
        with pytest.warns(UserWarning):  # torch warns of the broadcast in the single-row call
            v, g = batched_rows(loss_fn, out, y, torch.ones(N, dtype=DT))
    else:
        v, g = batched_rows(loss_fn, out, y, torch.ones(N, dtype=DT))
    assert spy.batched == 0 and spy.vmapped == 1
    if name != "mse broadcast [n,1] vs [n]":
        v_ref, g_ref = single_rows(loss_fn, out, y, torch.ones(N, dtype=DT))
        torch.testing.assert_close(v, v_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)


def test_hooks_instance_forward_and_patched_functional_are_not_recognised(monkeypatch):
    ce = nn.CrossEntropyLoss()
    assert recognised_kind(ce) == ("cross_entropy", "mean", -100)
    handle = ce.register_forward_hook(lambda m, i, o: None)
    assert recognised_kind(ce) is None
    handle.remove()
    assert recognised_kind(ce) is not None
    glob = nn.modules.module.register_module_forward_pre_hook(lambda m, i: None)
    try:
        assert recognised_kind(ce) is None
    finally:
        glob.remove()
    ce.forward = lambda o, t: F.cross_entropy(o, t, reduction="sum")  # type: ignore[method-assign]
    assert recognised_kind(ce) is None
    mse, original = nn.MSELoss(), F.mse_loss
    assert recognised_kind(mse) == ("mse", "mean", -100) and recognised_kind(original) is not None
    monkeypatch.setattr(F, "mse_loss", lambda *a, **k: torch.zeros(()))  # the module's forward calls the patch
    assert recognised_kind(mse) is None and recognised_kind(original) is None


def test_out_of_range_class_raises_the_users_error():
    out, y = ce_data()
    y[2] = C + 3
    assert recognised_row_losses(F.cross_entropy, out, y) is None  # the batched call raised: not recognised
    with pytest.raises((IndexError, RuntimeError)):
        _per_example_losses(F.cross_entropy, out, y)


# ---------------------------------------------------------------------------- the engine
def mlp(out_features: int = C, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, out_features)).to(DT)


def engine_rows(eng: PerSampleEngine, x, y) -> list[torch.Tensor]:
    """The engine's per-example gradients g_i, as weighted sums with one-hot weights (flat geometry)."""
    src = eng.compute(x, y)
    k = len(src.params)
    rows = []
    for i in range(int(y.shape[0])):
        w = torch.zeros(int(y.shape[0]), 1, dtype=DT)
        w[i] = 1.0
        rows.append(src.weighted_sum(w, ClipGeometry(), [0] * k))
    return [torch.stack([r[j] for r in rows]) for j in range(k)]


ENGINE_CASES = {
    "ce functional": (F.cross_entropy, "ce", ()),
    "ce module mean, ignored rows": (nn.CrossEntropyLoss(), "ce", (2, 11)),
    "ce module sum, ignored rows": (nn.CrossEntropyLoss(reduction="sum"), "ce", (2, 11)),
    "mse module mean": (nn.MSELoss(), "mse", ()),
    "mse functional [n,5]": (F.mse_loss, "mse", ()),
    "mse module sum": (nn.MSELoss(reduction="sum"), "mse", ()),
}


@pytest.mark.parametrize("name", list(ENGINE_CASES))
def test_engine_per_example_gradients_equal_single_example_autograd(monkeypatch, name):
    loss_fn, kind, ignored = ENGINE_CASES[name]
    g = torch.Generator().manual_seed(4)
    n = 13
    x = torch.randn(n, 6, generator=g, dtype=DT)
    if kind == "ce":
        y = torch.randint(0, C, (n,), generator=g)
        y[list(ignored)] = -100
    else:
        y = torch.randn(n, C, generator=g, dtype=DT)
    model = mlp()
    spy = Spy(monkeypatch)
    eng = PerSampleEngine(model, loss_fn)
    got = engine_rows(eng, x, y)
    assert spy.batched >= 1 and spy.vmapped == 0  # the batched path, also in the first-batch check
    assert eng.fallback_names == []  # every layer stayed on the fast rules (the check passed)
    ref = per_sample_gradient_tensors(model, loss_fn, x, y, method="loop")
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for r in ignored:  # an ignored target: no gradient at all
        assert all(float(a[r].abs().max()) == 0.0 for a in got)


def test_compiled_capture_uses_the_batched_losses(monkeypatch):
    """The compiled door (compile="aot_eager") differentiates the same batched losses of its compiled output."""
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(13, 6, generator=g, dtype=DT), torch.randint(0, C, (13,), generator=g)
    y[3] = -100
    model = mlp(seed=1)
    spy = Spy(monkeypatch)
    got = engine_rows(PerSampleEngine(model, nn.CrossEntropyLoss(), compile="aot_eager"), x, y)
    assert spy.batched >= 1 and spy.vmapped == 0
    ref = per_sample_gradient_tensors(model, nn.CrossEntropyLoss(), x, y, method="loop")
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- review findings (2026-12-07)
def test_a_replacement_installed_before_dpopts_import_is_never_taken_for_torchs(monkeypatch):
    """A library that assigns its own ``F.cross_entropy`` before dpopt is imported (as fused-kernel libraries do).

    Its ``"mean"`` and ``"none"`` need not agree, so its rows cannot come from a batched call: only the function
    defined in torch's own ``torch.nn.functional`` is recognised (its globals are that module's).
    """
    import importlib

    import dpopt.engine.row_losses as rl

    def smoothed(o, t, reduction="mean", **kw):  # "mean" smooths, "none" does not
        if reduction == "mean":
            return F.cross_entropy(o, t, label_smoothing=0.1)
        return F.cross_entropy(o, t, reduction=reduction, **kw)

    assert rl._torch_own(F.cross_entropy, F, "cross_entropy") and not rl._torch_own(smoothed, F, "cross_entropy")
    real = F.cross_entropy
    try:
        monkeypatch.setattr(F, "cross_entropy", smoothed)
        importlib.reload(rl)  # dpopt's import after the replacement
        assert rl._CROSS_ENTROPY is None
        assert rl.recognised_kind(smoothed) is None and rl.recognised_kind(nn.CrossEntropyLoss()) is None
        out, y = ce_data()
        assert rl.recognised_row_losses(smoothed, out, y) is None
    finally:
        monkeypatch.setattr(F, "cross_entropy", real)
        importlib.reload(rl)
    assert rl._CROSS_ENTROPY is real and rl.recognised_kind(real) == ("cross_entropy", "mean", -100)


@pytest.mark.parametrize(
    "attr, value", [("ignore_index", True), ("ignore_index", 2.9), ("label_smoothing", "0"), ("label_smoothing", False)]
)
def test_attributes_the_users_call_rejects_are_not_recognised(attr, value):
    """``ignore_index=True`` would silently drop class 1 if read with ``int()``; the user's own call raises."""
    ce = nn.CrossEntropyLoss()
    setattr(ce, attr, value)
    assert recognised_kind(ce) is None
    out, y = ce_data()
    assert recognised_row_losses(ce, out, y) is None


def test_an_instance_call_impl_or_a_compiled_call_is_not_recognised():
    """``nn.Module.__call__`` runs ``self._call_impl`` (or ``_compiled_call_impl`` after ``Module.compile()``)."""
    ce = nn.CrossEntropyLoss()
    ce._call_impl = lambda o, t: 1000 * F.cross_entropy(o, t)  # type: ignore[method-assign]
    assert recognised_kind(ce) is None
    ce = nn.CrossEntropyLoss()
    ce._compiled_call_impl = lambda o, t: F.cross_entropy(o, t, label_smoothing=0.5)  # type: ignore[assignment]
    assert recognised_kind(ce) is None
    ce._compiled_call_impl = None  # type: ignore[assignment]
    assert recognised_kind(ce) == ("cross_entropy", "mean", -100)


SENSITIVITY_CASES = {
    "F.cross_entropy": (F.cross_entropy, "ce", 6),
    "CE mean, 3 ignored": (nn.CrossEntropyLoss(), "ce-ignored", 6),
    "CE sum": (nn.CrossEntropyLoss(reduction="sum"), "ce", 6),
    "MSE mean": (F.mse_loss, "mse", 6),
    "MSE sum": (nn.MSELoss(reduction="sum"), "mse", 6),
    "CE one class": (F.cross_entropy, "ce", 1),
}


@pytest.mark.parametrize("name", list(SENSITIVITY_CASES))
@pytest.mark.parametrize("c", [0.05, 1e3])
def test_sigma_zero_sensitivity_through_the_batched_losses_in_float32(monkeypatch, name, c):
    """σ = 0, float32 (the C kernels' norms and clip factors): removing any one example moves the release by ≤ C.

    The release is the clipped sum (``expected_batch_size`` = 1); the slack 1e-6·C is the float32 summation of
    the other rows in another order (each clip factor is rounded down with a margin of 8u, u = 2⁻²⁴). One
    class: every loss is 0 and nothing moves (the exact value).
    """
    from dpopt.engine import iter_per_sample_sources
    from dpopt.methods import make_optimizer

    loss_fn, kind, k = SENSITIVITY_CASES[name]
    n, p = 16, 24
    g = torch.Generator().manual_seed(5)
    x = 5 * torch.randn(n, p, generator=g)
    if kind == "mse":
        y = 3 * torch.randn(n, k, generator=g)
    else:
        y = torch.randint(0, k, (n,), generator=g)
        if kind == "ce-ignored":
            y[[2, 6, 10]] = -100
    spy = Spy(monkeypatch)

    def fresh():
        torch.manual_seed(4)
        return nn.Sequential(nn.Linear(p, 20), nn.ReLU(), nn.Linear(20, k))

    def release(xs, ys):
        model = fresh()
        opt = make_optimizer(
            "dp-sgd", list(model.parameters()), noise_multiplier=0.0, max_grad_norm=c,
            expected_batch_size=1.0, sample_rate=0.01,
        )  # fmt: skip
        rel = opt.step(iter_per_sample_sources(model, loss_fn, xs, ys, points=opt.evaluation_points()))
        return torch.cat([r.flatten().double() for r in rel.grads])

    full = release(x, y)
    moves = []
    for i in range(n):
        keep = torch.arange(n) != i
        moves.append(float((full - release(x[keep], y[keep])).norm()))
    assert spy.batched >= n + 1 and spy.vmapped == 0  # every release took the batched losses
    assert max(moves) <= c * (1 + 1e-6)
    if k == 1:
        assert max(moves) == 0.0  # log-softmax over one class is 0: no gradient
    elif c < 1:
        assert max(moves) >= 0.5 * c  # rows at or near the bound: the test can see a factor that is too large
    else:  # nothing clipped: each move is that example's own gradient norm (single-example autograd)
        model = fresh()
        for i in range(n):
            loss = loss_fn(model(x[i : i + 1]), y[i : i + 1])
            own = torch.autograd.grad(loss, list(model.parameters())) if torch.isfinite(loss) else ()
            norm = float(torch.cat([t.flatten().double() for t in own]).norm()) if own else 0.0
            assert moves[i] == pytest.approx(norm, rel=1e-5, abs=1e-6)
