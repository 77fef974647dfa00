"""Opacus's per-layer grad-sample configurations that crashed the first-batch check (issue 33, case 9).

``InstanceNorm1d/2d/3d`` with one channel and ``Conv1d`` with one output
channel (any padding, ``"same"`` included, any stride): every parameter is
``[1, ...]``, so it starts as a bare-parameter candidate (:mod:`dpopt.engine.bare`)
and leaves the taps during the check's own batched pass (its use is a
conv/instance_norm, not a broadcast). The check then had no parameter left to
compare and called ``torch.autograd.grad`` with no inputs. Each configuration
must now give per-example gradients equal to ``torch.func`` (vmap of grad)
through both doors: ``iter_per_sample_sources`` and ``PrivacyEngine``'s hook
capture (Opacus's L1 loss, ``"mean"`` and ``"sum"``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from per_example_zoo import per_example_from_source, rel_err
from torch import nn
from torch.func import functional_call, grad, vmap

from dpopt.engine import iter_per_sample_sources
from dpopt.engine.hooks import HookCapture

DT = torch.float64


def _l1(reduction):
    return lambda out, target: nn.functional.l1_loss(out, target, reduction=reduction)


LAYERS = {
    "instancenorm1d": (lambda: nn.InstanceNorm1d(1, affine=True), (1, 7)),
    "instancenorm2d": (lambda: nn.InstanceNorm2d(1, affine=True), (1, 5, 6)),
    "instancenorm3d": (lambda: nn.InstanceNorm3d(1, affine=True), (1, 3, 4, 5)),
    "conv1d-same": (lambda: nn.Conv1d(1, 1, 3, padding="same"), (1, 9)),
    "conv1d-same-even": (lambda: nn.Conv1d(1, 1, 2, padding="same"), (1, 9)),
    "conv1d-stride2": (lambda: nn.Conv1d(1, 1, 3, stride=2, padding=2), (1, 9)),
    "conv1d-valid": (lambda: nn.Conv1d(3, 1, 2), (3, 8)),
}


def _case(name, b=4, seed=0):
    build, shape = LAYERS[name]
    torch.manual_seed(seed)
    layer = build().to(DT)
    with torch.no_grad():  # affine parameters away from their (1, 0) initialisation: a real test
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(b, *shape, generator=g, dtype=DT)
    with torch.no_grad():
        y = torch.randn(layer(x).shape, generator=g, dtype=DT)
    return layer, x, y


def _func_truth(layer, x, y, loss):
    """Per-example gradients of loss(layer(x_i), y_i) by torch.func (vmap of grad over single examples)."""
    params = {k: p.detach() for k, p in layer.named_parameters()}

    def one(ps, xi, yi):
        return loss(functional_call(layer, ps, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return [g[k] for k, _ in layer.named_parameters()]


@pytest.mark.parametrize("name", list(LAYERS))
def test_engine_door_equals_torch_func(name):
    layer, x, y = _case(name)
    loss = _l1("sum")
    truth = _func_truth(layer, x, y, loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "uses the exact per-example path": expected here
        src = next(iter(iter_per_sample_sources(layer, loss, x, y)))
    sq, grads = per_example_from_source(src, len(truth))
    assert rel_err(grads, truth) <= 1e-9
    want_sq = torch.stack([t.flatten(1).square().sum(1) for t in truth], 1)
    assert rel_err([sq], [want_sq]) <= 1e-9


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_hook_door_equals_torch_func(name, reduction):
    layer, x, y = _case(name)
    truth = _func_truth(layer, x, y, _l1("sum"))  # the per-example loss l_i (the door undoes the mean)
    cap = HookCapture(layer, loss_reduction=reduction)
    try:
        _l1(reduction)(layer(x), y).backward() if reduction == "sum" else (
            _l1("sum")(layer(x), y) / x.shape[0]
        ).backward()
        src = cap.collect()
    finally:
        cap.detach()
    _, grads = per_example_from_source(src, len(truth))
    assert rel_err(grads, truth) <= 1e-9
