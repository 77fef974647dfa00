"""Poisson sampler: batch sizes are Binomial(N, q); empty batches occur and are yielded."""

import pytest
import torch

from dpopt.sampling import PoissonSampler


def test_batch_sizes_are_binomial():
    n, q, steps = 1000, 0.05, 2000
    sizes = torch.tensor(
        [len(i) for i in PoissonSampler(n, q, steps, torch.Generator().manual_seed(0))], dtype=torch.float64
    )
    # mean of 2000 Binomial(1000, .05) draws: sd of the mean = sqrt(47.5/2000) ≈ 0.154; ±5 sd window
    # has a false-alarm rate < 1e-6.
    assert abs(float(sizes.mean()) - n * q) < 5 * (n * q * (1 - q) / steps) ** 0.5
    assert float(sizes.var()) == pytest.approx(n * q * (1 - q), rel=0.15)


def test_empty_batches_are_yielded():
    batches = list(PoissonSampler(3, 0.01, 50, torch.Generator().manual_seed(1)))
    assert len(batches) == 50
    assert sum(len(b) == 0 for b in batches) > 40


def test_indices_are_unique_and_in_range():
    for idx in PoissonSampler(100, 0.3, 20, torch.Generator().manual_seed(2)):
        assert len(set(idx.tolist())) == len(idx) and (idx.numel() == 0 or 0 <= int(idx.min()) <= int(idx.max()) < 100)


@pytest.mark.parametrize("args", [(0, 0.1, 1), (10, 0.0, 1), (10, 1.1, 1), (10, 0.1, -1)])
def test_invalid(args):
    with pytest.raises(ValueError):
        PoissonSampler(*args)
