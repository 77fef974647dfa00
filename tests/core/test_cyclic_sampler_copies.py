"""The cyclic samplers' secret assignment of examples to batches never leaves the process in a copy.

An adversary who reads a pickle (or a ``deepcopy``, ``torch.save``) of a :class:`CyclicBatchSampler` /
:class:`CyclicPoissonBatchSampler` must not learn which batch (part) each example is in: the pickled bytes
are checked to be the same for two samplers with different assignments (so they carry nothing of it). A
copy draws a fresh secret assignment on first use at position 0 in one process, and refuses past position
0 (a new assignment would break the b-min-sep participation) or under data parallel (the ranks would no
longer share one assignment). DataLoader workers (``num_workers`` > 0) do not need the assignment: the
batch sampler runs in the main process, and the loaders still yield the assignment's batches.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch.utils.data import TensorDataset

from dpopt.cyclic_batches import CyclicBatchSampler, CyclicLoader, CyclicPoissonBatchSampler, CyclicPoissonLoader
from dpopt.noise import NoiseSource

N, B = 40, 4


def is_partition(parts, n: int = N) -> bool:
    flat = sorted(i for p in parts for i in p)
    return flat == list(range(n))


def test_pickles_of_two_assignments_are_the_same_bytes():
    """Same public fields (N, b, position), different secret assignments: identical pickles."""
    one, two = CyclicBatchSampler(N, B, seed=1), CyclicBatchSampler(N, B, seed=2)
    assert one.batches != two.batches
    assert pickle.dumps(one) == pickle.dumps(two)
    next(iter(one)), next(iter(two))  # one step each: the handed-out sizes differ (private) too
    assert pickle.dumps(one) == pickle.dumps(two)
    copied = pickle.loads(pickle.dumps(one))
    assert copied._parts is None and copied._batches is None and len(copied.sizes) == 0
    assert len(copied) == B and copied.position == 1 and copied.state_dict() == one.state_dict()


def test_poisson_sampler_pickles_carry_no_parts_nor_their_sizes():
    def make(seed):
        return CyclicPoissonBatchSampler(N, B, 0.5, noise=NoiseSource("reproducible", seed=7), seed=seed)

    one, two = make(1), make(2)
    assert one.partitions != two.partitions
    assert pickle.dumps(one) == pickle.dumps(two)
    copied = pickle.loads(pickle.dumps(one))
    assert copied._slices is None and copied._cyclic._parts is None


@pytest.mark.parametrize("copier", [copy.deepcopy, copy.copy, lambda s: pickle.loads(pickle.dumps(s))])
def test_a_copy_at_position_zero_draws_a_fresh_assignment(copier):
    s = CyclicBatchSampler(N, B, seed=1)
    c = copier(s)
    assert is_partition(c.batches) and c.batches != s.batches  # fresh (equal with probability 4^-40)
    assert list(c) == c.batches and c.position == B  # an epoch in the copy's own cyclic order
    assert s.position == 0 and is_partition(s.batches)  # the original is untouched
    p = CyclicPoissonBatchSampler(N, B, 1.0)  # q = 1: each step yields its whole part
    cp = copier(p)
    got = [cp.sample().tolist() for _ in range(B)]
    assert is_partition(got) and got == cp.partitions and got != p.partitions


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))])
@pytest.mark.parametrize("steps", [1, B])  # mid-epoch, and at the epoch boundary (min-separation would break)
def test_a_copy_past_position_zero_refuses(copier, steps):
    s = CyclicBatchSampler(N, B, seed=1)
    it = iter(s)
    for _ in range(steps):
        next(it, None)
    c = copier(s)
    for use in (lambda: list(c), c.sample, lambda: c.batches):
        with pytest.raises(RuntimeError, match=f"at step {steps}.*never copied"):
            use()
    p = CyclicPoissonBatchSampler(N, B, 0.5)
    for _ in range(steps):
        p.sample()
    cp = copier(p)
    for use in (lambda: list(cp), cp.sample, lambda: cp.partitions):
        with pytest.raises(RuntimeError, match="never copied"):
            use()
    assert len(s.batches) == B and len(p.sample()) >= 0  # the originals go on


def test_a_data_parallel_copy_refuses_even_at_position_zero():
    c = copy.deepcopy(CyclicBatchSampler(N, B, seed=1, rank=1, world_size=2))
    with pytest.raises(RuntimeError, match="data-parallel"):
        c.sample()
    cp = copy.deepcopy(CyclicPoissonBatchSampler(N, B, 0.5, seed=1, rank=1, world_size=2))
    with pytest.raises(RuntimeError, match="data-parallel"):
        cp.sample()


def test_a_pickled_loader_carries_no_assignment():
    data = TensorDataset(torch.arange(N))
    one = CyclicLoader(data, CyclicBatchSampler(N, B, seed=1))
    two = CyclicLoader(data, CyclicBatchSampler(N, B, seed=2))
    assert pickle.dumps(one.batch_sampler) == pickle.dumps(two.batch_sampler)
    copied = pickle.loads(pickle.dumps(one))
    assert copied.batch_sampler._parts is None


def test_loaders_with_workers_yield_the_assignment():
    """num_workers = 2: the batch sampler stays in the main process; workers only load and collate."""
    data = TensorDataset(torch.arange(N))
    sampler = CyclicBatchSampler(N, B, seed=3)
    loader = CyclicLoader(data, sampler, num_workers=2)
    for _ in range(2):  # two epochs: the same batches in the same cyclic order
        got = [sorted(x.tolist()) for (x,) in loader]
        assert got == [sorted(b) for b in sampler.batches]
    assert sampler.position == 2 * B
    poisson = CyclicPoissonLoader(data, B, 1.0, seed=3, num_workers=2)  # q = 1: the whole parts
    got = [sorted(x.tolist()) for (x,) in poisson]
    assert got == [sorted(p) for p in poisson.poisson.partitions] and is_partition(got)
