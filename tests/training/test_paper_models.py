"""The papers' models (dpopt.models): sizes, and layers refused under DP."""

import pytest
import torch
from torch import nn

from dpopt.engine.reference import per_sample_gradients
from dpopt.models import build_model, check_model

LOSS = nn.functional.cross_entropy


def test_batchnorm_is_refused_with_advice():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    with pytest.raises(ValueError, match=r"'1' is BatchNorm2d.*GroupNorm"):
        check_model(model)
    check_model(build_model("cnn5"))  # GroupNorm is fine


def test_paper_model_sizes():
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(build_model("mlp")) == 795_010
    assert count(build_model("cnn5")) == 582_346


def test_batchnorm_is_refused_by_both_per_sample_engines():
    from dpopt.engine import iter_per_sample_sources

    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match="BatchNorm1d.*GroupNorm"):
        per_sample_gradients(model, LOSS, x, y)
    with pytest.raises(ValueError, match="BatchNorm1d.*GroupNorm"):
        list(iter_per_sample_sources(model, LOSS, x, y))
