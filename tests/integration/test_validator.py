"""dpopt.validate / dpopt.fix (ModuleValidator-style), and the Poisson DataLoader's empty batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.data_loader import DPDataLoader
from dpopt.models import check_model
from dpopt.noise import NoiseSource


def _bad_model():
    return nn.Sequential(
        nn.Conv2d(1, 48, 3),
        nn.BatchNorm2d(48),
        nn.InstanceNorm2d(48, track_running_stats=True),
        nn.Flatten(),
        nn.Linear(48 * 36, 10),
        nn.BatchNorm1d(10),
    )


def test_validate_lists_every_problem_and_check_model_still_raises():
    model = _bad_model()
    problems = dpopt.validate(model)
    assert len(problems) == 3 and "GroupNorm(16, 48)" in problems[0] and "track_running_stats" in problems[1]
    with pytest.raises(ValueError):
        check_model(model)
    emb = nn.Embedding(10, 4, max_norm=1.0, sparse=True)
    assert len(dpopt.validate(emb)) == 2
    assert dpopt.validate(dpopt.fix(emb)) == []


def test_fix_replaces_batchnorm_with_groupnorm_and_the_model_trains():
    model = dpopt.fix(_bad_model())
    assert dpopt.validate(model) == [] and check_model(model) is None
    assert isinstance(model[1], nn.GroupNorm) and model[1].num_groups == 16  # gcd(32, 48)
    assert isinstance(model[5], nn.GroupNorm) and model[5].num_groups == 1  # BatchNorm1d: one group
    assert not model[2].track_running_stats and model[2].running_mean is None
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    assert isinstance(dpopt.fix(nn.BatchNorm1d(8)), nn.GroupNorm)  # the root itself


def test_poisson_loader_yields_empty_batches_with_the_item_structure():
    data = TensorDataset(torch.randn(30, 1, 8, 8), torch.arange(30))
    loader = DPDataLoader.from_data_loader(DataLoader(data, batch_size=3), noise=NoiseSource("secret"))
    assert len(loader) == 10 and loader.sample_rate == pytest.approx(0.1)
    sizes = []
    # 600 secret batches of Binomial(30, 0.1): none empty has probability (1 - 0.9^30)^600 = 6e-12 (at 200 it was
    # 1.8e-4 per run); the mean size is within 0.6 of 3 with sd 0.067 (9 sd)
    for _ in range(60):
        for x, y in loader:
            assert x.shape[1:] == (1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
            assert len(x) == len(y)
            sizes.append(len(y))
    assert 0 in sizes and abs(sum(sizes) / len(sizes) - 3) < 0.6  # E[B] = q·N = 3
    with pytest.raises(ValueError, match="Poisson"):
        DPDataLoader(data, 0.1, batch_size=4)


def test_fixed_batchnorm1d_on_plain_features_still_depends_on_the_input():
    """Fresh-user finding: GroupNorm(32, 32) on [B, 32] features normalises each single feature to 0,
    so the fixed MLP ignored its input (output spread 8e-6). One group keeps the features' spread."""
    torch.manual_seed(0)
    model = dpopt.fix(nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10)))
    out = model(torch.randn(8, 64))
    assert float(out.std(0).mean()) > 0.05
