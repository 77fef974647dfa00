"""Tied weights (one parameter, several modules): per-example gradient = the sum over its uses (engine.tied).

The squared norm of a tied embedding / output projection has the cross term
2⟨G_emb,i, G_head,i⟩; the factored form computes it without a V×D head
gradient per example. Ground truth: ``per_sample_gradients`` (torch.func,
the model seeing each example alone), float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpopt.engine import HookCapture, PerSampleEngine, iter_per_sample_sources, per_sample_gradients
from dpopt.engine.tied import TiedBlock
from dpopt.types import ClipGeometry

DT = torch.float64
V, D, B, T = 13, 5, 4, 6


class TiedLM(nn.Module):
    """Token embedding whose weight is also the output projection (GPT-2's wte == lm_head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))  # [B, T, V]


class Opaque(nn.Module):
    """Owns a weight it uses through F.linear: no rule."""

    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, h):
        return F.linear(h, self.w)


class TiedToOpaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.out = Opaque(self.emb.weight)

    def forward(self, x):
        return self.out(torch.tanh(self.emb(x)))


def lm(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    x[0, :3] = 2  # a repeated token: one touched row summed over positions
    return x, torch.randint(0, V, (B, T), generator=g)


def model_of(cls, seed=0):
    torch.manual_seed(seed)
    return cls().to(DT)


def _tied_forms(src):
    return [blk.form for blk in src.blocks if isinstance(blk, TiedBlock)]


def _geometry(params, seed=3):
    g = torch.Generator().manual_seed(seed)
    return ClipGeometry(
        shift=[0.1 * torch.randn(p.shape, generator=g, dtype=DT) for p in params],
        scale=[0.5 + torch.rand(p.shape, generator=g, dtype=DT) for p in params],
    )


def test_tied_embedding_and_head_factored_norms_and_sums_equal_torch_func():
    model = model_of(TiedLM)
    x, y = batch()
    eng = PerSampleEngine(model, lm)
    src = eng.compute(x, y)
    assert eng.fallback_names == []  # the tied weight is on the fast path
    ref = per_sample_gradients(model, lm, x, y)
    params = list(model.parameters())
    n = len(params)
    sq, want = src.sq_norms(ClipGeometry(), list(range(n)), n), ref.sq_norms(ClipGeometry(), list(range(n)), n)
    assert _tied_forms(src) == ["factored"]  # no V x D head gradient per example
    torch.testing.assert_close(sq, want, rtol=1e-10, atol=1e-14)
    emb = [n for n, _ in model.named_parameters()].index("emb.weight")
    w = torch.rand(B, 1, dtype=DT, generator=torch.Generator().manual_seed(1))
    for a, b in zip(src.weighted_sum(w, ClipGeometry(), [0] * n), ref.weighted_sum(w, ClipGeometry(), [0] * n)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    # the cross term matters: |F + S|^2 differs from |F|^2 + |S|^2 by far more than the tolerance here
    parts = per_example_use_norms(model, x, y)
    assert float((parts - want[:, emb]).abs().max()) > 1e-3 * float(want[:, emb].max())


def per_example_use_norms(model, x, y):
    """Σ_u ‖g_i^u‖² of the tied weight: each use's gradient alone (untied copies), without the cross term."""
    untied = model_of(TiedLM)
    untied.load_state_dict(model.state_dict())
    untied.head.weight = nn.Parameter(model.emb.weight.detach().clone())
    ref = per_sample_gradients(untied, lm, x, y)
    names = [n for n, _ in untied.named_parameters()]
    return sum(ref.grads[names.index(k)].flatten(1).square().sum(1) for k in ("emb.weight", "head.weight"))


def test_tied_weight_in_a_shift_scale_geometry_uses_the_materialised_fallback():
    model = model_of(TiedLM)
    x, y = batch(1)
    src = PerSampleEngine(model, lm).compute(x, y)
    ref = per_sample_gradients(model, lm, x, y)
    params = list(model.parameters())
    geo, n = _geometry(params), len(params)
    torch.testing.assert_close(src.sq_norms(geo, [0] * n, 1), ref.sq_norms(geo, [0] * n, 1), rtol=1e-10, atol=1e-14)
    assert _tied_forms(src) == ["dense"]
    w = torch.rand(B, 1, dtype=DT, generator=torch.Generator().manual_seed(2))
    for a, b in zip(src.weighted_sum(w, geo, [0] * n), ref.weighted_sum(w, geo, [0] * n)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


def test_weight_tied_to_a_module_without_a_rule_uses_the_per_example_path():
    model = model_of(TiedToOpaque)
    x, y = batch(2)
    eng = PerSampleEngine(model, lm)
    src = eng.compute(x, y)
    assert eng.fallback_names == ["emb.weight"]
    ref = per_sample_gradients(model, lm, x, y)
    torch.testing.assert_close(src.sq_norms(ClipGeometry(), [0], 1), ref.sq_norms(ClipGeometry(), [0], 1))


@pytest.mark.parametrize("cls", [TiedLM, TiedToOpaque])
def test_hook_capture_of_a_tied_weight_equals_torch_func(cls):
    """Review finding: a tied weight crashed PrivacyEngine's capture ('blocks must cover every trainable
    parameter exactly once', naming no parameter)."""
    model = model_of(cls)
    x, y = batch(3)
    cap = HookCapture(model, "sum")
    try:
        out = model(x)
        sum(lm(out[i : i + 1], y[i : i + 1]) for i in range(B)).backward()
        src = cap.collect()
    finally:
        cap.detach()
    ref = per_sample_gradients(model, lm, x, y)
    n = src.num_params
    torch.testing.assert_close(
        src.sq_norms(ClipGeometry(), list(range(n)), n),
        ref.sq_norms(ClipGeometry(), list(range(n)), n),
        rtol=1e-10,
        atol=1e-14,
    )


def test_sigma_zero_sensitivity_of_the_tied_model_is_at_most_c():
    model = model_of(TiedLM)
    x, y = batch(4)

    def clipped(xs, ys, c):
        src = next(iter(iter_per_sample_sources(model, lm, xs, ys)))
        n = src.num_params
        norms = src.sq_norms(ClipGeometry(), [0] * n, 1)[:, 0].sqrt()
        w = torch.clamp(c / norms, max=1.0).unsqueeze(1)
        return torch.cat([s.flatten() for s in src.weighted_sum(w, ClipGeometry(), [0] * n)]), norms

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _, norms = clipped(x, y, 1.0)
        c = 0.5 * float(norms.median())
        full, _ = clipped(x, y, c)
        for j in range(B):
            keep = torch.tensor([i for i in range(B) if i != j])
            part, _ = clipped(x[keep], y[keep], c)
            assert float((full - part).norm()) <= c * (1 + 1e-9)


class TiedHeadUnused(TiedLM):
    """The tied head is not called (e.g. a model returning hidden states): only the embedding's use counts."""

    def forward(self, x):
        return self.mid(self.emb(x))[:, :, :3].mean(1)


def test_a_tied_use_that_is_never_called_adds_nothing():
    model = model_of(TiedHeadUnused)
    x, y = batch(5)
    y = y[:, 0] % 3
    src = PerSampleEngine(model, F.cross_entropy).compute(x, y)
    assert not any(isinstance(blk, TiedBlock) for blk in src.blocks)  # no zero [B, V, D] block, no dense form
    ref = per_sample_gradients(model, F.cross_entropy, x, y)
    n = src.num_params
    torch.testing.assert_close(
        src.sq_norms(ClipGeometry(), list(range(n)), n),
        ref.sq_norms(ClipGeometry(), list(range(n)), n),
        rtol=1e-10,
        atol=1e-14,
    )
