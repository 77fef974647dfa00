"""Balls-in-bins cyclic batches (dpopt.cyclic_batches; Choquette-Choo et al. 2024, arXiv 2410.06266): the law of
the assignment, its data-parallel split, empty batches, and the sensitivity of the released clipped sum through
make_private and dpopt's own loop (`dpopt train`) with banded:4.

Correlated noise refuses σ = 0, so the "σ = 0" sensitivity checks run with the same seeded (reproducible) noise on
both neighbours: the noise cancels in the difference, which is then the difference of the clipped sums."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from scipy.stats import chi2
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt.privacy_engine as privacy_engine_module
import dpopt.training.build as build_module
from dpopt import PrivacyEngine
from dpopt.cyclic_batches import CyclicBatchSampler, CyclicPoissonBatchSampler, balls_in_bins
from dpopt.data import Dataset
from dpopt.noise import NoiseSource
from dpopt.training import TrainConfig, build_run
from dpopt.training.loop import run_steps

ALPHA = 1e-4  # the error rate of each chi-square test below (a correct sampler fails it with probability 1e-4)


def _part_of(sampler: CyclicBatchSampler, i: int) -> int:
    return next(j for j, b in enumerate(sampler.batches) if i in b)


def test_part_sizes_follow_the_multinomial_law():
    """N = 20,000 examples into b = 8 parts, 5 seeds: the part counts against N/8 each (chi-square, 7 dof, each
    at error rate 1e-4). A balanced cut would pass too; its defect is caught by the two tests below."""
    n, b = 20_000, 8
    limit = chi2.ppf(1 - ALPHA, b - 1)  # ≈ 29.9
    for seed in range(5):
        sampler = CyclicBatchSampler(n, b, seed=seed)
        counts = np.array([len(p) for p in sampler.batches])
        assert counts.sum() == n and sorted(i for p in sampler.batches for i in p) == list(range(n))
        stat = float(((counts - n / b) ** 2 / (n / b)).sum())
        assert stat < limit, stat


def test_two_examples_parts_are_independent_and_uniform():
    """N = 3 examples, b = 3 parts, 3,600 seeds: the pair (part of example 0, part of example 1) against the
    uniform law on the 9 cells (independent, each uniform; chi-square, 8 dof, error rate 1e-4). The balanced cut
    (one example per part) never puts them together: its diagonal is empty, a statistic of ≈ 1,800."""
    n, b, seeds = 3, 3, 3600
    table = np.zeros((b, b))
    for s in range(seeds):
        sampler = CyclicBatchSampler(n, b, seed=s)
        table[_part_of(sampler, 0), _part_of(sampler, 1)] += 1
    expected = seeds / b**2
    stat = float(((table - expected) ** 2 / expected).sum())
    assert stat < chi2.ppf(1 - ALPHA, b * b - 1), stat  # ≈ 31.8
    assert table.trace() > 0  # together in a batch: impossible for a balanced cut of 3 into 3


def test_the_others_keep_their_parts_when_an_example_is_added():
    """With one seed the assignment of examples 0 … N−1 is the same with or without example N (i.i.d. draws, in
    index order): the coupling behind the add/remove analysis (the law of the others does not depend on x)."""
    for seed in range(20):
        with_x = CyclicBatchSampler(16, 4, seed=seed).batches
        without = CyclicBatchSampler(15, 4, seed=seed).batches
        assert without == [[i for i in b if i != 15] for b in with_x]


def test_data_parallel_slices_make_up_the_one_process_batch():
    """W = 3 ranks, rank 0's seed: per batch the ranks' slices are disjoint and their union is the one-process
    batch (an empty batch: every slice empty); cyclic Poisson: each rank's parts are slices of the same parts."""
    n, b, w = 50, 7, 3
    whole = CyclicBatchSampler(n, b, seed=99).batches
    ranks = [CyclicBatchSampler(n, b, seed=99, rank=r, world_size=w).batches for r in range(w)]
    for j in range(b):
        parts = [set(rk[j]) for rk in ranks]
        assert sum(len(p) for p in parts) == len(whole[j]) and set().union(*parts) == set(whole[j])
    poisson = CyclicPoissonBatchSampler(n, b, 1.0, seed=99, rank=1, world_size=w)
    assert poisson.partitions == whole
    assert [poisson.sample().tolist() for _ in range(b)] == ranks[1]  # q = 1: the whole slice


def test_balls_in_bins_refuses_nothing_it_should_not():
    parts = balls_in_bins(0, 3, seed=1)
    assert len(parts) == 3 and all(p.numel() == 0 for p in parts)
    with pytest.raises(ValueError, match="batches must lie in"):
        CyclicBatchSampler(3, 4)


def _data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(16, 5, generator=g)[:n], torch.randint(0, 2, (16,), generator=g)[:n])


def _make_private_sums(n: int, c: float, seed: int, epochs: int, releases: list, monkeypatch) -> torch.Tensor:
    """The released clipped sums (release × the public divisor N/b) of make_private over the first n examples."""
    monkeypatch.setattr(privacy_engine_module, "_partition_seed", lambda ctx: seed)
    releases.clear()
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    engine = PrivacyEngine()
    engine.noise = NoiseSource("reproducible", seed=11)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(_data(n), batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=c,
        noise_mechanism="banded:4",
        epochs=epochs,
        loss_reduction="sum",
    )
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
            opt.step()
    assert len(releases) == 4 * epochs == len(engine.ledger)  # every step released, empty batches included
    bbar = opt.expected_batch_size
    assert bbar == n / 4  # the public divisor N/b, never the realised size
    return torch.stack([torch.cat([g.double().flatten() for g in r.grads]) for r in releases]) * bbar


def test_make_private_removing_one_example_moves_the_clipped_sum_by_at_most_c(releases, monkeypatch):
    """D (16 examples) and D − {example 15}, b = 4 batches, T = 8, banded:4, the same assignment seed and noise:
    the released clipped sum moves by exactly C (the example's gradient, norm ≫ C, clipped) at the two steps of
    its batch j (j, j + 4) and not at all at the others. Tolerance 1e-4 C (float32 roundings of releases ≈ σC)."""
    c, seed = 1e-3, 1234
    j = _part_of(CyclicBatchSampler(16, 4, seed=seed), 15)
    moved = (
        _make_private_sums(16, c, seed, 2, releases, monkeypatch)
        - _make_private_sums(15, c, seed, 2, releases, monkeypatch)
    ).norm(dim=1)
    for t in range(8):
        assert float(moved[t]) == pytest.approx(c if t % 4 == j else 0.0, abs=1e-4 * c), (t, j)


def test_make_private_empty_batch_still_releases(releases, monkeypatch):
    """A seed whose assignment leaves a batch empty: the loader yields it (0 rows), the step releases noise only,
    and the ledger has one entry per step."""
    seed = next(s for s in range(1000) if any(len(p) == 0 for p in CyclicBatchSampler(6, 3, seed=s).batches))
    monkeypatch.setattr(privacy_engine_module, "_partition_seed", lambda ctx: seed)
    model = nn.Linear(5, 2)
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(6), batch_size=2),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        noise_mechanism="banded:2",
        epochs=1,
        loss_reduction="sum",
    )
    rows = []
    for x, y in loader:
        rows.append(len(y))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step()
    assert 0 in rows and sum(rows) == 6 and len(rows) == 3
    assert len(releases) == 3 == len(engine.ledger)
    empty = rows.index(0)
    assert all(bool(torch.isfinite(g).all()) and float(g.norm()) > 0 for g in releases[empty].grads)  # noise


def _train_sums(n: int, c: float, seed: int, releases: list, monkeypatch) -> torch.Tensor:
    """The released clipped sums (release × N/b) of dpopt's own loop (`dpopt train`) over n digits-like records."""
    monkeypatch.setattr(build_module, "_partition_seed", lambda dist: seed)
    releases.clear()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    data = Dataset("digits", x[:n], y[:n], x[:4].clone(), y[:4].clone())
    cfg = TrainConfig(
        dataset="digits",
        method="dp-sgd",
        noise_multiplier=1.0,
        noise_mechanism="banded:4",
        max_grad_norm=c,
        lr=1e-12,  # > 0 (required); the parameters, and so the gradients, stay put to float precision
        batch_size=4.0,
        epochs=2.0,
        physical_batch_size=3,
        reproducible_noise=True,
    )
    with pytest.warns(UserWarning):
        run = build_run(dataclasses.replace(cfg), data)
    assert run.steps == 8 and run.optimizer.privatizer.mechanism.participation.min_separation == 4
    run_steps(run)
    assert len(releases) == 8 == len(run.ledger)
    bbar = run.optimizer.privatizer.expected_batch_size
    assert bbar == n / 4  # the public divisor N/b
    return torch.stack([torch.cat([g.double().flatten() for g in r.grads]) for r in releases]) * bbar


def test_dpopt_train_removing_one_example_moves_the_clipped_sum_by_at_most_c(releases, monkeypatch):
    """As the make_private test, through dpopt's own loop: 16 vs 15 records, b = round(N/4) = 4, T = 8."""
    c, seed = 1e-3, 4321
    j = _part_of(CyclicBatchSampler(16, 4, seed=seed), 15)
    moved = (_train_sums(16, c, seed, releases, monkeypatch) - _train_sums(15, c, seed, releases, monkeypatch)).norm(
        dim=1
    )
    for t in range(8):
        assert float(moved[t]) == pytest.approx(c if t % 4 == j else 0.0, abs=1e-4 * c), (t, j)
