"""Decoupled weight decay for every registered method: declared once, applied after the chain."""

from __future__ import annotations

import pytest
import torch

from dpopt.engine.reference import PerSampleGrads
from dpopt.methods import COMMON_DEFAULTS, get_method, list_methods, make_optimizer
from dpopt.transforms.weight_decay import DecoupledWeightDecay


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(4))]


def _step(name, wd, params):
    opt = make_optimizer(
        name, params, noise_multiplier=0.0, expected_batch_size=2.0, sample_rate=0.5, weight_decay=wd, max_grad_norm=1e6
    )
    grads = [torch.ones(2, *p.shape) * 0.1 for p in params]
    for _ in range(2):
        opt.step(PerSampleGrads(grads, params=tuple(params), points=tuple(opt.evaluation_points())))
    return opt


@pytest.mark.parametrize("spec", list_methods(), ids=lambda s: s.name)
def test_every_method_takes_weight_decay(spec):
    assert spec.defaults["weight_decay"] == COMMON_DEFAULTS["weight_decay"] == 0.0
    plain, decayed = _params(), _params()
    _step(spec.name, 0.0, plain)
    opt = _step(spec.name, 0.1, decayed)
    lr = opt.param_groups[0]["lr"]
    changed = [float((a - b).detach().abs().max()) for a, b in zip(plain, decayed)]
    assert max(changed) > 0, "weight_decay had no effect"
    assert all(torch.isfinite(p).all() for p in decayed)
    assert lr > 0


def test_decay_is_decoupled_and_exact_for_sgd():
    """One dp-sgd step: θ' = θ − lr·g̃ − lr·λ·θ (σ = 0, no clipping)."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = make_optimizer(
        "dp-sgd",
        [p],
        noise_multiplier=0.0,
        expected_batch_size=1.0,
        sample_rate=0.5,
        lr=0.5,
        weight_decay=0.1,
        max_grad_norm=1e6,
    )
    theta = p.detach().clone()
    g = torch.tensor([[0.2, 0.4]])
    opt.step(PerSampleGrads([g], params=(p,)))
    torch.testing.assert_close(p.detach(), theta - 0.5 * g[0] - 0.5 * 0.1 * theta)


def test_weight_decay_validated_and_resolved_once():
    with pytest.raises(ValueError, match="weight_decay"):
        DecoupledWeightDecay(-1.0)
    hp = get_method("dp-adam").hparams(weight_decay=1e-4)
    assert hp["weight_decay"] == 1e-4 and set(hp) == set(get_method("dp-adam").defaults)
