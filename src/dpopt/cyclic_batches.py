"""Cyclic batches: the sampler whose participation pattern correlated-noise accounting assumes.

The dataset's indices are split ONCE into ``batches`` disjoint batches (a uniformly random balanced
partition from a fresh seed that is never saved; the matrix-factorization analysis holds for one example
added to a fixed partition of the others — zero-out neighbours; for add/remove the balanced cut re-slices
the others, an open issue: docs/correlated-noise.md, "Open issue"), and step t uses batch t mod b, for every epoch and across iterations of the loader
(a loop that stops an epoch early continues with the next batch, never restarts the cycle). So an
example takes part in at most ⌈T/b⌉ of T steps, any two of them exactly b steps apart: the
:class:`~dpopt.correlated_noise.Participation` (k = ⌈T/b⌉, min_separation = b) of
Choquette-Choo et al. (arXiv 2211.06530, "b-min-sep participation"). Reshuffling every epoch would
break it (an example could be last in one epoch and first in the next).
"""

from __future__ import annotations

import secrets
from collections import deque
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from .data_loader import DPDataLoader, EmptyBatchCollate
from .noise import NoiseSource, make_noise_source

__all__ = ["CyclicBatchSampler", "CyclicPoissonBatchSampler", "CyclicPoissonLoader", "cyclic_poisson_partitions"]


class CyclicBatchSampler(Sampler):
    """A ``batch_sampler`` yielding ``batches`` fixed batches in a fixed cyclic order (module docstring).

    Args:
        dataset_size: N ≥ 1 (public).
        batches: b, with 1 ≤ b ≤ N; batch sizes are ⌊N/b⌋ or ⌈N/b⌉ (expected size N/b).
        steps: for :meth:`sample` (dpopt's own loop): the batches to draw in all (None: unlimited).
        seed: the partition's seed (tests; never saved); None: a fresh random one (what the doors use).
            Data parallel: every rank passes rank 0's seed, so that all ranks cut the same partition.
        rank, world_size: data parallel: this rank yields its part ``tensor_split(batch, world_size)[rank]``
            of every batch (disjoint across ranks; their union is the batch).

    Raises:
        ValueError: b < 1 or b > N; rank ∉ [0, world_size).
    """

    def __init__(
        self,
        dataset_size: int,
        batches: int,
        steps: Optional[int] = None,
        seed: Optional[int] = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        n, b = int(dataset_size), int(batches)
        if not 1 <= b <= n:
            raise ValueError(f"batches must lie in [1, dataset size {n}], got {batches}")
        if not 0 <= int(rank) < int(world_size):
            raise ValueError(f"rank must lie in [0, world_size {world_size}), got {rank}")
        gen = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else int(seed))
        perm = torch.randperm(n, generator=gen)
        self._parts = [part.tensor_split(int(world_size))[int(rank)] for part in torch.tensor_split(perm, b)]
        self.batches = [chunk.tolist() for chunk in self._parts]
        self.steps = steps
        self.position = 0  # steps handed out so far (public)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(len(self.batches)):
            batch = self.batches[self.position % len(self.batches)]
            self.position += 1
            yield batch

    def sample(self) -> torch.Tensor:
        """The next batch's indices (int64 ``[~N/b]``); advances ``position``.

        Raises:
            StopIteration: ``steps`` batches were drawn.
        """
        if self.steps is not None and self.position >= self.steps:
            raise StopIteration
        idx = self._parts[self.position % len(self._parts)]
        self.position += 1
        return idx.clone()

    def state_dict(self) -> dict:
        """Public: the position and the number of batches (the partition is not saved: a correlated-noise
        run is never resumed, docs/correlated-noise.md)."""
        return {"version": 1, "position": self.position, "batches": len(self.batches), "cyclic": True}

    def load_state_dict(self, state: dict) -> None:
        """Only a state at position 0 loads.

        Raises:
            ValueError: a later position (resuming a correlated-noise run is refused).
        """
        if int(state.get("position", 0)) != 0:
            raise ValueError("cyclic batches of a correlated-noise run are never resumed (docs/correlated-noise.md)")


def cyclic_poisson_partitions(sample_rate: float, steps_per_epoch: int) -> int:
    """b' = round(q · L), the number of parts of cyclic Poisson sampling at rate q within a part, L the steps of
    one epoch: the expected batch q·N/b' is then about N/L, the batch of ordinary training (0 when q·L < 1/2;
    callers refuse that naming their own options)."""
    return int(round(float(sample_rate) * int(steps_per_epoch)))


class CyclicPoissonBatchSampler(Sampler):
    """Cyclic Poisson sampling (Choquette-Choo et al., arXiv 2306.08153, Sec. 4, "amplified banded MF"): the
    dataset is split ONCE into ``partitions`` = b' disjoint parts (a uniformly random balanced partition, as
    :class:`CyclicBatchSampler`'s, with its open add/remove issue), and step t includes each example of part t mod b'
    independently with probability q (:func:`~dpopt.sampling.poisson_indices`, the secret uniforms of
    ``noise``). An example takes part only at steps ≡ j (mod b'), each with probability q, independently:
    the participation the amplified accountant (:func:`~dpopt.correlated_noise.amplified_step_events`) assumes.

    Data parallel (``world_size`` W > 1): every rank cuts the same partition (rank 0's public ``seed``) and
    owns the slice ``tensor_split(part, W)[rank]`` of every part, so each example lives on exactly one rank.
    With a secret or secure ``noise`` a rank draws the uniforms of its own slice only, from its own source;
    with a reproducible one (the seed shared by every rank) it draws the uniforms of the whole part, as one
    process does, and keeps those of its slice (as :class:`~dpopt.distributed.ShardedPoissonSampler` does
    for Poisson batches). Either way each example of part t mod b' joins exactly one rank's batch with
    probability q, independently, so the union over ranks is one cyclic Poisson sample of the dataset — the
    one-process sampling (for a reproducible stream, the one-process batch itself).

    Args:
        dataset_size: N ≥ 1 (public).
        partitions: b', 1 ≤ b' ≤ N; part sizes ⌊N/b'⌋ or ⌈N/b'⌉ (expected batch q·N/b', all ranks together).
        sample_rate: q ∈ (0, 1].
        steps: batches per iteration of the loader (default b': one pass over the parts).
        noise: the :class:`~dpopt.noise.NoiseSource` of the inclusion uniforms (default: secret); THIS rank's.
        seed: the partition's seed (public); None: a fresh random one. Data parallel: rank 0's, on every rank.
        rank, world_size: data parallel: this rank's slice of every part (default: one process, the whole part).

    Attributes:
        position: steps handed out so far (public; continues across iterations, never restarts the cycle).
        sizes: the sizes of batches drawn and not yet handed out (private, in memory only: never pickled).

    Raises:
        ValueError: b' ∉ [1, N], q ∉ (0, 1], rank ∉ [0, world_size).
    """

    def __init__(
        self,
        dataset_size: int,
        partitions: int,
        sample_rate: float,
        steps: Optional[int] = None,
        noise: Optional[NoiseSource] = None,
        seed: Optional[int] = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not 0.0 < float(sample_rate) <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        if not 0 <= int(rank) < int(world_size):
            raise ValueError(f"rank must lie in [0, world_size {world_size}), got {rank}")
        self._cyclic = CyclicBatchSampler(dataset_size, partitions, seed=seed)  # the whole parts, on every rank
        # [lo, hi): this rank's slice of each part (tensor_split's: the first len % W slices one longer)
        self._slices = [
            (int(r[0]), int(r[-1]) + 1) if len(r) else (0, 0)
            for r in (torch.arange(len(p)).tensor_split(int(world_size))[int(rank)] for p in self._cyclic.batches)
        ]
        self.sample_rate = float(sample_rate)
        self.steps = len(self._cyclic) if steps is None else int(steps)
        self.noise = make_noise_source(noise)
        self.sizes: "deque[int]" = deque(maxlen=1024)

    @property
    def partitions(self) -> list[list[int]]:
        """The b' fixed parts (public), as lists of dataset indices."""
        return self._cyclic.batches

    @property
    def position(self) -> int:
        return self._cyclic.position

    def __len__(self) -> int:
        return self.steps

    def sample(self) -> torch.Tensor:
        """The next step's indices: this rank's slice of part ``position mod b'`` Poisson-sampled at q (int64
        ``[K]``, K ~ Binomial; one process: the whole part)."""
        from .sampling import poisson_indices

        lo, hi = self._slices[self.position % len(self._slices)]
        part = self._cyclic.sample()
        if self.noise.mode == "reproducible":  # the shared stream's sample of the whole part, this slice's share
            keep = poisson_indices(self.noise, len(part), self.sample_rate)
            return part[keep[(keep >= lo) & (keep < hi)]]
        return part[lo:hi][poisson_indices(self.noise, hi - lo, self.sample_rate)]

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            idx = self.sample()
            self.sizes.append(int(idx.numel()))
            yield idx.tolist()

    def __getstate__(self) -> dict:
        """Copies and pickles never carry the drawn batches' sizes (a count of private examples)."""
        state = dict(self.__dict__)
        state["sizes"] = type(self.sizes)(maxlen=1024)
        return state

    def state_dict(self) -> dict:
        """Public: the position (a correlated-noise run is never resumed, docs/correlated-noise.md)."""
        return {"version": 1, "position": self.position, "partitions": len(self._cyclic), "cyclic_poisson": True}

    def load_state_dict(self, state: dict) -> None:
        """Refuse to resume (as :meth:`CyclicBatchSampler.load_state_dict`: a correlated-noise stream is never saved).

        Raises:
            ValueError: a state past position 0.
        """
        self._cyclic.load_state_dict(state)


class CyclicPoissonLoader(DPDataLoader):
    """A :class:`~dpopt.data_loader.DPDataLoader` whose batches come from a :class:`CyclicPoissonBatchSampler`
    (empty batches collated as for Poisson batches; each batch tagged for the optimizer's release boundary).

    Args:
        dataset: a non-empty map-style dataset.
        partitions, sample_rate, noise, seed, rank, world_size: as :class:`CyclicPoissonBatchSampler`.
        steps: batches per iteration of the loader (default b': one pass over the parts; ``make_private``
            gives the horizon's epoch, ``len(data_loader)``).
        collate_fn: the item collate function (default ``default_collate``).
        **kwargs: other ``DataLoader`` options (``num_workers``, ``pin_memory``, ...).

    Raises:
        ValueError: as :class:`CyclicPoissonBatchSampler`; an empty or iterable dataset.
    """

    def __init__(
        self,
        dataset: Any,
        partitions: int,
        sample_rate: float,
        collate_fn: Optional[Callable] = None,
        noise: Optional[NoiseSource] = None,
        steps: Optional[int] = None,
        seed: Optional[int] = None,
        rank: int = 0,
        world_size: int = 1,
        **kwargs: Any,
    ):
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") or len(dataset) == 0:
            raise ValueError("cyclic Poisson sampling needs a non-empty map-style dataset (with __len__)")
        self.sample_rate = float(sample_rate)
        self.poisson = CyclicPoissonBatchSampler(  # type: ignore[assignment]
            len(dataset), partitions, sample_rate, noise=noise, steps=steps, seed=seed, rank=rank, world_size=world_size
        )
        DataLoader.__init__(
            self, dataset, batch_sampler=self.poisson, collate_fn=EmptyBatchCollate(dataset, collate_fn), **kwargs
        )
        self.last_batch_examples = None
        self.boundary = None
