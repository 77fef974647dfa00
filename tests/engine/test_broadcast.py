"""Parameters broadcast over the batch: [1, T] position ids and bare parameters (engine.fast.expand_broadcast, engine.bare).

Both doors, float64, against single-example autograd (torch.func). A
recognised pattern is exact on the fast path (no warning, no fallback); any
other use of a bare parameter is named in a warning and computed by the
per-example path (dpopt's loop) or the vjp of its owner (PrivacyEngine's hooks).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dpopt.engine import HookCapture, PerSampleEngine, per_sample_gradients
from dpopt.types import ClipGeometry

DT = torch.float64
V, D, B, T, C = 11, 5, 4, 6, 3


def ce(out, y):
    return F.cross_entropy(out, y)


class PosIds(nn.Module):
    """HF GPT-2/BERT style: position ids [1, T] looked up once and broadcast over the batch."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(V, D), nn.Embedding(T, D), nn.Linear(D, C)

    def forward(self, x):
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        return self.head(torch.tanh(self.tok(x) + self.pos(pos)).mean(1))


class Tokens(nn.Module):
    """ViT style: class token expanded and concatenated, position embeddings added (bare parameters)."""

    def __init__(self):
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        self.position_embeddings = nn.Parameter(torch.randn(1, T + 1, D))
        self.drop = nn.Dropout(0.0)

    def forward(self, h):
        h = torch.cat((self.cls_token.expand(h.shape[0], -1, -1), h), dim=1)
        return self.drop(h + self.position_embeddings)


class Scaled(nn.Module):
    """A bare [1, 1, D] parameter used by a multiplication: not a recognised broadcast."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(1.0 + torch.rand(1, 1, D))

    def forward(self, h):
        return h * self.gain


class ViTish(nn.Module):
    def __init__(self, inner=Tokens):
        super().__init__()
        self.tok, self.emb, self.head = nn.Embedding(V, D), inner(), nn.Linear(D, C)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(self.tok(x)))[:, 0])


def model_of(cls):
    torch.manual_seed(0)
    return cls().to(DT)


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, C, (B,), generator=g)


def norms_equal(src, model, x, y):
    ref = per_sample_gradients(model, ce, x, y)
    n = src.num_params
    torch.testing.assert_close(
        src.sq_norms(ClipGeometry(), list(range(n)), n),
        ref.sq_norms(ClipGeometry(), list(range(n)), n),
        rtol=1e-10,
        atol=1e-14,
    )
    w = torch.rand(B, 1, dtype=DT, generator=torch.Generator().manual_seed(2))
    for a, b in zip(src.weighted_sum(w, ClipGeometry(), [0] * n), ref.weighted_sum(w, ClipGeometry(), [0] * n)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


def hook_source(model, x, y):
    cap = HookCapture(model, "mean")
    try:
        ce(model(x), y).backward()
        return cap.collect()
    finally:
        cap.detach()


@pytest.mark.parametrize("cls", [PosIds, ViTish])
def test_broadcast_patterns_are_exact_on_the_fast_path(cls):
    model = model_of(cls)
    x, y = batch()
    eng = PerSampleEngine(model, ce)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # not demoted
        src = eng.compute(x, y)
    assert eng.fallback_names == []
    norms_equal(src, model, x, y)


@pytest.mark.parametrize("cls", [PosIds, ViTish])
def test_broadcast_patterns_through_the_hooks_equal_single_example_autograd(cls):
    model = model_of(cls)
    x, y = batch()
    norms_equal(hook_source(model, x, y), model, x, y)


def test_an_unrecognised_use_of_a_bare_parameter_is_named_and_exact():
    model = model_of(lambda: ViTish(Scaled))
    x, y = batch()
    eng = PerSampleEngine(model, ce)
    with pytest.warns(RuntimeWarning, match=r"parameter 'emb.gain' is used by mul .*expand\(B, ...\) or X \+ P"):
        src = eng.compute(x, y)
    assert eng.fallback_names == ["emb.gain"]
    norms_equal(src, model, x, y)
    norms_equal(hook_source(model, x, y), model, x, y)  # hooks: the vjp of the owner's call


def test_position_ids_of_one_example_are_not_expanded():
    """B = 1: the [1, T] call already has the batch size along dim 0."""
    model = model_of(PosIds)
    x, y = batch()
    src = PerSampleEngine(model, ce).compute(x[:1], y[:1])
    norms_equal_one = per_sample_gradients(model, ce, x[:1], y[:1])
    n = src.num_params
    torch.testing.assert_close(
        src.sq_norms(ClipGeometry(), [0] * n, 1),
        norms_equal_one.sq_norms(ClipGeometry(), [0] * n, 1),
        rtol=1e-10,
        atol=1e-14,
    )


@pytest.mark.parametrize("cls", [PosIds, ViTish])
def test_broadcast_patterns_at_several_evaluation_points(cls):
    """DiSK points: under functional_call the taps watch the substituted parameters θ + offset."""
    from dpopt.types import EvaluationPoint

    model = model_of(cls)
    x, y = batch()
    params = list(model.parameters())
    g = torch.Generator().manual_seed(5)
    pts = [
        EvaluationPoint(0.7),
        EvaluationPoint(-0.3, tuple(0.1 * torch.randn(p.shape, generator=g, dtype=DT) for p in params)),
    ]
    eng = PerSampleEngine(model, ce)
    src, ref = eng.compute(x, y, pts), per_sample_gradients(model, ce, x, y, pts)
    assert eng.fallback_names == []
    n = len(params)
    torch.testing.assert_close(
        src.sq_norms(ClipGeometry(), list(range(n)), n),
        ref.sq_norms(ClipGeometry(), list(range(n)), n),
        rtol=1e-10,
        atol=1e-14,
    )
