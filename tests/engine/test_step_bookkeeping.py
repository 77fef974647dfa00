"""The steady-state step's bookkeeping cuts of 2026-12-07 release what the code before them released (issue 34).

Cuts (docs/performance.md, "MLP: the step's Python"): a T = 1 linear layer's per-example bias gradients are a
view of the recorded output gradient, not a copy (:func:`dpopt.engine.rules.linear_bias_sums`); the source's
group totals are summed from 0 by in-place float64 adds, not by indexing a ``[B, G]`` buffer
(:meth:`dpopt.engine.fast.FastPerSampleGrads._sq_norms`); the optimizer walks its parameter groups once per
call site. Checked here:

* bit for bit: several ``dp-sgd`` steps under the same seeded (reproducible) noise give ``torch.equal`` releases
  and parameters with the code before the cuts patched back in, on an MLP (T = 1), on a layer shared by two
  calls with T = 1 (the bias's copy path: the second call's rows are added into the first's), and on a shared
  layer with T = 3 positions per example, flat and with two clipping groups;
* against the per-example reference (``engine="reference"``, torch.func) at σ = 0;
* the first-batch check no longer writes into a float64 per-example gradient (``check.sq_dist64`` subtracted
  in place: with the bias a view of ``e``, the check corrupted the weight's ``e`` and demoted the weight);
* a change after the first steps is still caught: a parameter replaced, a parameter frozen, a batch of another
  size class (checked again).
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpopt.engine.rules as rules
from dpopt.engine import iter_per_sample_sources
from dpopt.engine.check import sq_dist64
from dpopt.engine.fast import FastPerSampleGrads, PerSampleEngine, get_engine
from dpopt.engine.layers import DirectBlock, constant_sq_norms
from dpopt.engine.row_norms import round_up_sq_norms
from dpopt.methods import make_optimizer

B, P, H, K, T = 12, 10, 8, 4, 3


def ce(out, y):
    return F.cross_entropy(out, y)


class MLP(nn.Module):
    """Linear → ReLU → Linear on ``[B, P]`` (T = 1: the closed-form norms and the bias view)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(P, H), nn.Linear(H, K)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


class SharedT1(nn.Module):
    """One ``[P, P]`` layer called twice per example, T = 1 each (its bias: two calls, the copy path)."""

    def __init__(self):
        super().__init__()
        self.shared, self.head = nn.Linear(P, P), nn.Linear(P, K)

    def forward(self, x):
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


class SharedSeq(nn.Module):
    """A shared layer called twice on ``[B, T, P]`` (T = 3 positions per example), positions averaged."""

    def __init__(self):
        super().__init__()
        self.shared, self.head = nn.Linear(P, P), nn.Linear(P, K)

    def forward(self, x):
        h = self.shared(torch.tanh(self.shared(x)))
        return self.head(h.mean(1))


MODELS = {"mlp": (MLP, (B, P)), "shared-t1": (SharedT1, (B, P)), "shared-seq": (SharedSeq, (B, T, P))}


def old_linear_bias_sums(layer):
    """``rules.linear_bias_sums`` before the cut: every T = 1 call's rows copied."""
    b = layer.batch_size
    total: Optional[torch.Tensor] = None
    for _, e in layer.calls:
        q = e.shape[-1]
        if e.numel() == b * q:
            part = e.reshape(b, q).to(layer.dtype, copy=True)
        else:
            part = e.reshape(b, -1, q).sum(1, dtype=layer.dtype)
        total = part if total is None else total.add_(part)
    return total


def old_sq_norms(self, geometry, groups, num_groups):
    """``FastPerSampleGrads._sq_norms`` before the cut: the totals added into a ``[B, G]`` buffer by indexing."""
    per_param = self._param_sq_norms(geometry)
    terms = max(1, len(per_param))
    out = torch.zeros(self.batch_size, num_groups, dtype=torch.float64, device=self.device)
    for v, k in zip(per_param, groups):
        out[:, k] += v
    if bool(torch.isfinite(out).all()):
        self._bad, self._nbad = torch.zeros(self.batch_size, dtype=torch.bool, device=self.device), 0
        return round_up_sq_norms(out, terms, self.dtype)
    bad = torch.zeros(self.batch_size, dtype=torch.bool, device=self.device)
    for v in per_param:
        bad |= ~torch.isfinite(v)
    self._bad, self._nbad = bad, int(bad.sum())
    if not bool(bad.any()):
        return round_up_sq_norms(out, terms, self.dtype)
    out.zero_()
    for i, (v, k) in enumerate(zip(per_param, groups)):
        m, b = self._geo(geometry, i)
        zero_sq = constant_sq_norms(m, b, 1, self.dtype).reshape(())
        out[:, k] += torch.where(bad, zero_sq, v)
    return round_up_sq_norms(out, terms, self.dtype)


def _batches(name: str, steps: int, nan_row: bool = False):
    gen = torch.Generator().manual_seed(7)
    shape = MODELS[name][1]
    out = []
    for s in range(steps):
        x = 2 * torch.randn(*shape, generator=gen)
        if nan_row and s == 1:
            x[3] = float("nan")  # a non-finite example: the totals' second path
        out.append((x, torch.randint(0, K, (B,), generator=gen)))
    return out


def _run(name: str, grouped: bool, steps: int = 4, sigma: float = 1.0, engine: str = "fast", nan_row: bool = False):
    """Releases and final parameters of ``steps`` dp-sgd steps (reproducible noise, seed 0)."""
    torch.manual_seed(0)
    model = MODELS[name][0]().train()
    params = list(model.parameters())
    kw = {}
    if grouped:  # two clipping groups: the totals stacked, each its own bound
        kw = {"groups": [i % 2 for i in range(len(params))], "group_bounds": [0.7, 1.3]}
    opt = make_optimizer(
        "dp-sgd",
        params,
        noise_multiplier=sigma,
        expected_batch_size=float(B),
        sample_rate=0.01,
        generator=torch.Generator().manual_seed(0),
        **kw,
    )
    releases = []
    for x, y in _batches(name, steps, nan_row):
        rel = opt.step(iter_per_sample_sources(model, ce, x, y, points=opt.evaluation_points(), engine=engine))
        releases.append([g.clone() for g in rel.grads])
    return releases, [p.detach().clone() for p in params]


@pytest.mark.parametrize("grouped", [False, True], ids=["flat", "two-groups"])
@pytest.mark.parametrize("name", list(MODELS))
def test_releases_and_parameters_equal_those_of_the_code_before(name, grouped, monkeypatch):
    new = _run(name, grouped, nan_row=True)
    with monkeypatch.context() as m:
        m.setattr(rules, "linear_bias_sums", old_linear_bias_sums)
        m.setattr(FastPerSampleGrads, "_sq_norms", old_sq_norms)
        old = _run(name, grouped, nan_row=True)
    for step_new, step_old in zip(new[0], old[0]):
        assert all(torch.equal(a, b) for a, b in zip(step_new, step_old))
        assert all(torch.isfinite(a).all() for a in step_new)
    assert all(torch.equal(a, b) for a, b in zip(new[1], old[1]))
    assert not all(torch.equal(a, b) for a, b in zip(new[0][0], new[0][1]))  # the steps differ (not a constant)


@pytest.mark.parametrize("grouped", [False, True], ids=["flat", "two-groups"])
@pytest.mark.parametrize("name", list(MODELS))
def test_noiseless_releases_match_the_per_example_reference(name, grouped):
    fast, fast_params = _run(name, grouped, steps=3, sigma=0.0)
    ref, ref_params = _run(name, grouped, steps=3, sigma=0.0, engine="reference")
    for step_f, step_r in zip(fast, ref):
        for a, b in zip(step_f, step_r):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(fast_params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(float(g.abs().max()) > 1e-3 for g in fast[0])  # a real gradient was compared


def test_t1_bias_gradients_are_a_view_of_the_recorded_rows_and_stay_unchanged():
    torch.manual_seed(0)
    model = MLP().train()
    x, y = _batches("mlp", 1)[0]
    src = PerSampleEngine(model, ce).compute(x, y)
    names = [n for n, _ in model.named_parameters()]
    bias = {i: blk for blk in src.blocks if isinstance(blk, DirectBlock) for i in blk.index}
    g = bias[names.index("l2.bias")].grads[0]
    # the per-example bias gradient of l2 is dℓ_i/dout_i: softmax − onehot (cross-entropy of one example)
    want = torch.softmax(model(x), 1) - F.one_hot(y, K).float()
    torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7)
    before = g.clone()
    w = torch.rand(B, 1, generator=torch.Generator().manual_seed(3))
    from dpopt.types import ClipGeometry

    src.sq_norms(ClipGeometry(), [0] * 4, 1)
    sums = src.weighted_sum(w, ClipGeometry(), [0] * 4)
    assert torch.equal(g, before)  # neither the norms nor the sums wrote into it
    torch.testing.assert_close(sums[names.index("l2.bias")], (w * want).sum(0), rtol=1e-5, atol=1e-6)
    assert sums[names.index("l2.bias")].data_ptr() != g.data_ptr()  # a fresh sum (the release adds into it)


def test_sq_dist64_leaves_a_float64_operand_unchanged():
    a = torch.tensor([1.0, -2.0, 3.5], dtype=torch.float64)
    b = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float32)
    a0 = a.clone()
    assert sq_dist64(a, b) == 0.25 + 9.0 + 0.25
    assert torch.equal(a, a0)
    assert sq_dist64(a, a) == 0.0 and torch.equal(a, a0)


def test_float64_mlp_keeps_every_parameter_on_the_fast_path():
    """The regression of the bias view: the first-batch check wrote a − b into a float64 bias row, i.e. into the
    weight's recorded e, and the weight then failed its own check (demoted to the per-example path)."""
    torch.manual_seed(0)
    model = MLP().double().train()
    x, y = _batches("mlp", 1)[0]
    eng = PerSampleEngine(model, ce)
    src = eng.compute(x.double(), y)
    assert eng.fallback_names == []
    from dpopt.types import ClipGeometry

    src.sq_norms(ClipGeometry(), [0] * 4, 1)
    assert set(src.forms().values()) == {"closed"}


def _opt(model):
    return make_optimizer(
        "dp-sgd",
        list(model.parameters()),
        noise_multiplier=1.0,
        expected_batch_size=float(B),
        sample_rate=0.01,
        generator=torch.Generator().manual_seed(0),
    )


def test_a_parameter_replaced_after_steps_is_caught():
    torch.manual_seed(0)
    model = MLP().train()
    opt = _opt(model)
    for x, y in _batches("mlp", 3):
        opt.step(iter_per_sample_sources(model, ce, x, y))
    eng = get_engine(model, ce)
    model.l1.weight = nn.Parameter(model.l1.weight.detach().clone())  # not the optimizer's any more
    assert get_engine(model, ce) is not eng  # re-planned for the new parameter
    x, y = _batches("mlp", 1)[0]
    with pytest.raises(ValueError, match="cover different parameters"):
        opt.step(iter_per_sample_sources(model, ce, x, y))


def test_a_parameter_frozen_after_steps_is_skipped_and_never_changed():
    torch.manual_seed(0)
    model = MLP().train()
    opt = _opt(model)
    batches = _batches("mlp", 4)
    for x, y in batches[:2]:
        opt.step(iter_per_sample_sources(model, ce, x, y))
    model.l1.bias.requires_grad_(False)
    frozen = model.l1.bias.detach().clone()
    others = [p.detach().clone() for n, p in model.named_parameters() if n != "l1.bias"]
    for x, y in batches[2:]:
        rel = opt.step(iter_per_sample_sources(model, ce, x, y))
        assert len(rel.grads) == 3  # the frozen bias is neither released nor updated
    assert torch.equal(model.l1.bias, frozen)
    assert all(
        not torch.equal(a, p)
        for a, (n, p) in zip(others, [(n, p) for n, p in model.named_parameters() if n != "l1.bias"])
    )


def test_a_batch_of_another_size_class_is_checked_again(monkeypatch):
    torch.manual_seed(0)
    model = MLP().train()
    opt = _opt(model)
    x, y = _batches("mlp", 1)[0]
    eng = get_engine(model, ce)
    calls: list[int] = []
    real = PerSampleEngine._verify

    def spy(self, xb, yb, key=None):
        calls.append(int(yb.shape[0]))
        return real(self, xb, yb, key)

    monkeypatch.setattr(PerSampleEngine, "_verify", spy)
    for _ in range(3):
        opt.step(iter_per_sample_sources(model, ce, x, y))
    assert calls == [B]  # checked once for this size class, not per step
    big = torch.randn(4 * B, P, generator=torch.Generator().manual_seed(1))
    opt.step(iter_per_sample_sources(model, ce, big, torch.randint(0, K, (4 * B,))))
    assert calls == [B, 4 * B] and get_engine(model, ce) is eng


def test_step_uses_a_subclass_override_of_geometry_and_evaluation_points():
    """``step()`` walks the parameters once and passes them on, but a subclass's public ``geometry()`` /
    ``evaluation_points()`` still decides the step (review of 2026-12-07: the one-walk cut had bypassed them)."""
    from dpopt.types import ClipGeometry

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    opt = make_optimizer(
        "dp-sgd", list(model.parameters()), noise_multiplier=0.0, expected_batch_size=8.0, sample_rate=0.1, lr=0.1
    )
    calls = []

    class Sub(type(opt)):  # type: ignore[misc]
        def geometry(self):
            calls.append("geometry")
            return super().geometry()

        def evaluation_points(self):
            calls.append("evaluation_points")
            return super().evaluation_points()

    opt.__class__ = Sub
    opt.step(iter_per_sample_sources(model, F.cross_entropy, x, y, None, opt.evaluation_points()))
    assert calls.count("geometry") == 1 and calls.count("evaluation_points") >= 2
    assert isinstance(opt.geometry(), ClipGeometry)
