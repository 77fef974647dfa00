"""Parameter counts of every model, their dataset registration, and the fast engine on the GroupNorm ResNets.

Expected counts (trainable parameters):

* mlp-small 64·64+64 + 64·10+10 = 4,810; mlp 784·1000+1000 + 1000·10+10 = 795,010;
* cnn5 582,346 (docs/algorithms.md);
* wrn16-4: stem 3·16·9 = 432; group 1 (16→64): block 1 = 2·16 (GN) + 16·64·9 + 2·64 + 64·64·9 + 16·64 (1×1)
  = 47,264, block 2 = 4·64 + 2·64·64·9 = 73,984; group 2 (64→128) = 2·64 + 64·128·9 + 2·128 + 128·128·9
  + 64·128 + 4·128 + 2·128·128·9 = 526,976; group 3 (128→256) = 2,102,528; final GN 512 + fc 2,570
  → 2,748,890, the published WRN-16-4 count (GroupNorm has BatchNorm's 2·C affine parameters);
* resnet18: the standard CIFAR ResNet-18 count with BatchNorm, 11,173,962.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpopt.engine import fast_per_sample_gradients, per_sample_gradients
from dpopt.errors import ConfigError
from dpopt.models import MODELS, build_model, check_model, num_parameters
from dpopt.types import ClipGeometry

COUNTS = {
    "mlp-small": 4_810,
    "mlp": 795_010,
    "cnn5": 582_346,
    "wrn16-4": 2_748_890,
    "resnet18": 11_173_962,
    "cnn5-ws": 582_346,
    "wrn16-4-ws": 2_748_890,
}  # WSConv2d: the same parameters (issue 24)


def test_every_model_has_a_tested_count():
    assert set(COUNTS) == set(MODELS)


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_parameter_count(name):
    model = build_model(name)
    assert num_parameters(model) == COUNTS[name]
    check_model(model)  # no BatchNorm: valid under DP


@pytest.mark.parametrize("name", ["wrn16-4", "resnet18"])
def test_cifar10_models_registered(name):
    model = build_model(name, "cifar10")
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert any(isinstance(m, nn.GroupNorm) for m in model.modules())
    with pytest.raises(ConfigError):
        build_model(name, "mnist")
    with torch.no_grad():
        assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def _sum_groups(n):
    return [0] * n, 1


@pytest.mark.parametrize("name", ["wrn16-4", pytest.param("resnet18", marks=pytest.mark.slow)])
def test_fast_engine_matches_reference(name):
    """Per-example squared norms and the clipped sum from the fast engine equal the torch.func reference.

    8×8 inputs (the models pool globally, so every layer is exercised) keep the float64 reference path fast.
    """
    torch.manual_seed(0)
    model = build_model(name, "cifar10").double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    y = torch.tensor([3, 7])
    loss = lambda out, t: nn.functional.cross_entropy(out, t)  # noqa: E731
    fast = fast_per_sample_gradients(model, loss, x, y)
    ref = per_sample_gradients(model, loss, x, y)
    groups, g = _sum_groups(ref.num_params)
    geo = ClipGeometry()
    sq_f, sq_r = fast.sq_norms(geo, groups, g), ref.sq_norms(geo, groups, g)
    torch.testing.assert_close(sq_f, sq_r, rtol=1e-9, atol=0.0)
    w = torch.tensor([[0.5], [0.25]], dtype=torch.float64)
    for a, b in zip(fast.weighted_sum(w, geo, groups), ref.weighted_sum(w, geo, groups)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)
    # every layer kept its fast rule (none demoted to the reference path)
    assert all(type(blk).__name__ != "ReferenceBlock" for blk in fast.blocks)
