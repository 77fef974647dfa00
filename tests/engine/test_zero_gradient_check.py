"""The first-batch check does not trip on exact zeros (issue 20): tolerance relative to the layer's gradient scale.

``dpopt.fix()`` turns ``BatchNorm2d(16)`` into ``GroupNorm(16, 16)``: with one
channel per group the preceding conv's bias gradient is exactly 0, and both
sides of the check return float noise for it. The check once refused the
model through PrivacyEngine ("per-sample gradients of ['0.bias'] ... do not
match") and moved it to the slow loop in dpopt's own loop ("forward mixes
examples?"). A real disagreement of the same size relative to the layer is
still caught (:func:`dpopt.engine.check.agrees`).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn import functional as F

import dpopt
from dpopt.engine import HookCapture, PerSampleEngine, per_sample_gradients
from dpopt.engine.check import agrees, layer_scales
from dpopt.types import ClipGeometry


def _model():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 4 * 4, 3)
    )
    return dpopt.fix(net)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 3, 4, 4, generator=g), torch.randint(0, 3, (6,), generator=g)


def test_fix_gives_groupnorm_with_one_channel_per_group_and_an_exactly_zero_bias_gradient():
    model = _model()
    assert isinstance(model[1], nn.GroupNorm) and model[1].num_groups == 16
    x, y = _batch()
    ref = per_sample_gradients(model, F.cross_entropy, x, y)
    bias = ref.grads[1]  # 0.bias
    assert float(bias.abs().max()) < 1e-6 * float(ref.grads[0].abs().max())


def test_both_doors_keep_the_conv_bias_on_the_fast_path_without_warning_or_refusal():
    model = _model()
    x, y = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        eng = PerSampleEngine(model, F.cross_entropy)
        src = eng.compute(x, y)
        assert eng.fallback_names == []
        ref = per_sample_gradients(model, F.cross_entropy, x, y)
        torch.testing.assert_close(
            src.sq_norms(ClipGeometry(), [0] * 6, 1), ref.sq_norms(ClipGeometry(), [0] * 6, 1), rtol=1e-4, atol=1e-8
        )
        cap = HookCapture(model, "mean")
        try:
            F.cross_entropy(model(x), y).backward()
            cap.collect()  # the first-batch check: no ValueError
        finally:
            cap.detach()


def test_a_disagreement_relative_to_the_layer_is_still_caught():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 3, 5, generator=g, dtype=torch.float64)  # the layer's weight gradients
    zero = torch.zeros(4, 3, dtype=torch.float64)  # its bias: exactly zero
    scales = layer_scales({0: w, 1: zero}, ["conv.weight", "conv.bias"])
    c = torch.rand(4, generator=g, dtype=torch.float64)
    noise = 1e-9 * torch.randn(4, 3, generator=g, dtype=torch.float64)
    assert agrees(noise.square().sum(1), c @ noise, zero, c, 1e-3, scales[1])  # float noise: agrees
    assert not agrees(noise.square().sum(1), c @ noise, zero, c, 1e-3)  # the old test, relative to zero
    wrong = 0.1 * w.flatten(1).norm(dim=1, keepdim=True) * torch.ones(4, 3, dtype=torch.float64)
    assert not agrees(wrong.square().sum(1), c @ wrong, zero, c, 1e-3, scales[1])  # a real error: refused
