"""Cyclic batches: the sampler whose participation pattern correlated-noise accounting assumes.

The dataset's indices are split ONCE into ``batches`` = b disjoint batches by "balls-in-bins" (Choquette-Choo
et al. 2024, "Near exact privacy amplification for matrix mechanisms", arXiv 2410.06266, Sec. 3): EACH
example is assigned INDEPENDENTLY and uniformly to one of the b batches, from a fresh secret seed that is
never saved. Step t uses batch t mod b, for every epoch and across iterations of the loader (a loop that
stops an epoch early continues with the next batch, never restarts the cycle). So an example takes part in
at most ⌈T/b⌉ of T steps, any two of them exactly b steps apart: the
:class:`~dpopt.correlated_noise.Participation` (k = ⌈T/b⌉, min_separation = b) of Choquette-Choo et al.
(arXiv 2211.06530, "b-min-sep participation"). Reshuffling every epoch would break it (an example could be
last in one epoch and first in the next).

Why independent assignment (add/remove neighbours): the accounting analyses ONE example added to a fixed
assignment of the others (its worst batch). That is exact only if the assignment of the common examples has
the same law in D and D + x; with i.i.d. assignment it does (x's draw is independent of theirs), whereas a
balanced cut (a permutation sliced into equal batches) re-cuts every batch when x is added. The price:
batch sizes are random, Binomial(N, 1/b), possibly 0. A batch's size is private (never logged, saved or
used as a divisor: the release divides by the public expected batch size N/b), and an empty batch still
makes its step's release (noise only), so the step schedule stays the analysed one.
"""

from __future__ import annotations

import copy
import secrets
from collections import deque
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from .data_loader import DPDataLoader, EmptyBatchCollate
from .noise import NoiseSource, make_noise_source

__all__ = [
    "CyclicBatchSampler",
    "CyclicLoader",
    "CyclicPoissonBatchSampler",
    "CyclicPoissonLoader",
    "balls_in_bins",
    "cyclic_poisson_partitions",
]


def balls_in_bins(dataset_size: int, bins: int, seed: Optional[int] = None) -> list[torch.Tensor]:
    """Each of N examples assigned independently and uniformly to one of ``bins`` parts (balls-in-bins,
    Choquette-Choo et al. 2024, arXiv 2410.06266, Sec. 3): part j holds the indices i with A_i = j,
    A_1 … A_N i.i.d. uniform on {0, …, bins − 1}.

    Args:
        dataset_size: N ≥ 0.
        bins: b ≥ 1.
        seed: the generator's seed (tests); None: a fresh secret one (:mod:`secrets`, never saved).

    Returns:
        b int64 tensors of ascending indices, disjoint, their union ``range(N)``; sizes Binomial(N, 1/b).
    """
    gen = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else int(seed))
    assignment = torch.randint(int(bins), (int(dataset_size),), generator=gen)
    order = torch.argsort(assignment, stable=True)  # indices grouped by part, ascending within each
    counts = torch.bincount(assignment, minlength=int(bins))
    return list(order.split(counts.tolist()))


def _seek(sampler: Any, clock: Optional[Callable[[], Optional[int]]]) -> None:
    """Start a pass at the step of the next release: ``sampler.position = clock()`` (the releases made so far).

    Release t must hold the batch of step t (the participation the sensitivity is computed for). A pass
    started after an interrupted one (``break``) would otherwise continue where the sampler stopped, and
    the ``DataLoader``'s workers draw batches ahead of the loop (``prefetch_factor`` × ``num_workers``):
    batches drawn and never handed to the loop would shift every later release onto another batch, so an
    example could take part more than k times, less than b steps apart. ``clock`` first forgets a batch
    handed out and never stepped (:meth:`~dpopt.release_boundary.ReleaseBoundary.settle`): the new pass hands
    it out again. Without a clock (no optimizer) the pass continues at ``sampler.position``.
    """
    if clock is None:
        return
    steps = clock()
    if steps is not None:
        sampler.position = int(steps)
    sampler.positions.clear()
    sampler.sizes.clear()


class CyclicBatchSampler(Sampler):
    """A ``batch_sampler`` yielding ``batches`` fixed batches in a fixed cyclic order (module docstring).

    Each example is assigned once, independently and uniformly, to one of the b batches (balls-in-bins,
    arXiv 2410.06266); the assignment is kept for every epoch (example i takes part at steps j, j + b,
    j + 2b, ... for its batch j).

    Args:
        dataset_size: N ≥ 1 (public).
        batches: b, with 1 ≤ b ≤ N; batch sizes are Binomial(N, 1/b) (expected N/b, possibly 0; private).
        steps: for :meth:`sample` (dpopt's own loop): the batches to draw in all (None: unlimited).
        seed: the assignment's seed (tests; never saved); None: a fresh secret one (:mod:`secrets`).
            Data parallel: every rank passes rank 0's seed, so that all ranks draw the same assignment.
        rank, world_size: data parallel: this rank yields its part ``tensor_split(batch, world_size)[rank]``
            of every batch (disjoint across ranks, possibly empty; their union is the batch).

    Attributes:
        batches: the b batches of THIS rank (lists of dataset indices; private, in memory only: never in
            :meth:`state_dict`, a pickle or a copy).
        position: steps handed out so far (public).
        sizes: the sizes of batches handed out by ``__iter__`` and not yet read by the loader (private,
            in memory only: never pickled).

    Copies (pickle, ``copy.copy``/``deepcopy``, ``torch.save``) carry the public fields only (N, b, rank,
    world size, steps, position), never the assignment: an adversary who reads a pickle must not learn
    which batch each example is in. What a copy does on first use (:meth:`_assigned`): at position 0 in
    one process it draws a fresh secret assignment (a new sampler, as valid as the original's); past
    position 0 it refuses (a fresh assignment would break the run's b-min-sep participation — an example
    could take part in two steps less than b apart — and the old one is gone), and under data parallel it
    refuses at every position (the ranks would no longer share one assignment).

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
        self.dataset_size, self.num_batches = n, b  # public
        self.rank, self.world_size = int(rank), int(world_size)
        self._parts: Optional[list[torch.Tensor]] = self._draw(seed)  # the secret assignment (this rank's)
        self._batches: Optional[list[list[int]]] = None  # the same as lists, made on first use
        self.steps = steps
        self.position = 0  # steps handed out so far (public)
        self.sizes: "deque[int]" = deque(maxlen=1024)
        self.positions: "deque[int]" = deque(maxlen=1024)  # the steps of the batches in ``sizes`` (public)
        self.clock: Optional[Callable[[], Optional[int]]] = None  # make_private's: the releases made so far

    def _draw(self, seed: Optional[int]) -> list[torch.Tensor]:
        parts = balls_in_bins(self.dataset_size, self.num_batches, seed)
        return [part.tensor_split(self.world_size)[self.rank] for part in parts]

    def _assigned(self) -> list[torch.Tensor]:
        """The assignment (this rank's parts); in a copy without one, a fresh secret draw at position 0 (one process).

        Raises:
            RuntimeError: a copy (pickle, ``copy``/``deepcopy``) past position 0 or under data parallel.
        """
        if self._parts is None:
            if self.position != 0 or self.world_size != 1:
                raise RuntimeError(
                    "this cyclic batch sampler is a copy (pickle, copy.copy/deepcopy or torch.save) of one "
                    + (f"at step {self.position}" if self.position else "of a data-parallel run")
                    + ": its secret assignment of examples to batches is never copied, and a new one would "
                    "break the run's participation pattern (or the ranks' shared assignment); iterate the "
                    "original sampler, or build a new loader (make_private again) for a new run"
                )
            self._parts = self._draw(None)  # a fresh secret assignment: a new sampler's, never the original's
        return self._parts

    @property
    def batches(self) -> list[list[int]]:
        """The b batches of this rank as lists of dataset indices (private, in memory only)."""
        if self._batches is None:
            self._batches = [chunk.tolist() for chunk in self._assigned()]
        return self._batches

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        _seek(self, self.clock)
        batches = self.batches
        for _ in range(len(batches)):
            batch = batches[self.position % len(batches)]
            self.positions.append(self.position)
            self.position += 1
            self.sizes.append(len(batch))
            yield batch

    def __getstate__(self) -> dict:
        """Copies and pickles carry the public fields only: never the assignment (``_parts``, ``_batches``), the
        handed-out batches' sizes (a count of private examples) nor the clock (the optimizer's). See the class
        docstring for what the copy does on first use."""
        state = dict(self.__dict__)
        state["_parts"], state["_batches"] = None, None
        state["sizes"] = type(self.sizes)(maxlen=1024)
        state["positions"] = type(self.positions)(maxlen=1024)
        state["clock"] = None
        return state

    def sample(self) -> torch.Tensor:
        """The next batch's indices (int64 ``[K]``, K ~ Binomial(N, 1/b) over the assignment, possibly 0);
        advances ``position``.

        Raises:
            StopIteration: ``steps`` batches were drawn.
            RuntimeError: a copy that cannot draw (:meth:`_assigned`).
        """
        if self.steps is not None and self.position >= self.steps:
            raise StopIteration
        parts = self._assigned()
        idx = parts[self.position % len(parts)]
        self.position += 1
        return idx.clone()

    def state_dict(self) -> dict:
        """Public: the position and the number of batches (the assignment is not saved: a correlated-noise
        run is never resumed, docs/correlated-noise.md)."""
        return {"version": 1, "position": self.position, "batches": self.num_batches, "cyclic": True}

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
    dataset is split ONCE into ``partitions`` = b' disjoint parts (each example assigned independently and
    uniformly to a part, balls-in-bins, arXiv 2410.06266, as :class:`CyclicBatchSampler`'s; so adding an
    example leaves the law of the others' parts unchanged), and step t includes each example of part t mod b'
    independently with probability q (:func:`~dpopt.sampling.poisson_indices`, the secret uniforms of
    ``noise``). An example takes part only at steps ≡ j (mod b'), each with probability q, independently:
    the participation the amplified accountant (:func:`~dpopt.correlated_noise.amplified_step_events`) assumes.

    Data parallel (``world_size`` W > 1): every rank draws the same assignment (rank 0's ``seed``) and
    owns the slice ``tensor_split(part, W)[rank]`` of every part, so each example lives on exactly one rank.
    With a secret or secure ``noise`` a rank draws the uniforms of its own slice only, from its own source;
    with a reproducible one (the seed shared by every rank) it draws the uniforms of the whole part, as one
    process does, and keeps those of its slice (as :class:`~dpopt.distributed.ShardedPoissonSampler` does
    for Poisson batches). Either way each example of part t mod b' joins exactly one rank's batch with
    probability q, independently, so the union over ranks is one cyclic Poisson sample of the dataset — the
    one-process sampling (for a reproducible stream, the one-process batch itself).

    Args:
        dataset_size: N ≥ 1 (public).
        partitions: b', 1 ≤ b' ≤ N; part sizes Binomial(N, 1/b') (expected batch q·N/b', all ranks together).
        sample_rate: q ∈ (0, 1].
        steps: batches per iteration of the loader (default b': one pass over the parts).
        noise: the :class:`~dpopt.noise.NoiseSource` of the inclusion uniforms (default: secret); THIS rank's.
        seed: the assignment's seed (tests; never saved); None: a fresh secret one. Data parallel: rank 0's,
            on every rank.
        rank, world_size: data parallel: this rank's slice of every part (default: one process, the whole part).

    Attributes:
        position: steps handed out so far (public; continues across iterations, never restarts the cycle).
        sizes: the sizes of batches drawn and not yet handed out (private, in memory only: never pickled).

    Copies (pickle, ``copy``/``deepcopy``) carry no assignment, no part sizes and no drawn sizes; on first use
    a copy at position 0 in one process draws a fresh secret assignment, any other copy refuses
    (:class:`CyclicBatchSampler`). The inclusion uniforms' source re-seeds in a copy (:mod:`dpopt.noise`).

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
        self.rank, self.world_size = int(rank), int(world_size)
        self._slices: Optional[list[tuple[int, int]]] = None  # this rank's slice of each part (private: sizes)
        self._slice_table()
        self.sample_rate = float(sample_rate)
        self.steps = len(self._cyclic) if steps is None else int(steps)
        self.noise = make_noise_source(noise)
        self.sizes: "deque[int]" = deque(maxlen=1024)
        self.positions: "deque[int]" = deque(maxlen=1024)  # the steps of the batches in ``sizes`` (public)
        self.clock: Optional[Callable[[], Optional[int]]] = None  # make_private's: the releases made so far

    def _slice_table(self) -> list[tuple[int, int]]:
        """``[lo, hi)``: this rank's slice of each part (tensor_split's: the first len % W slices one longer).

        Raises:
            RuntimeError: a copy under data parallel (a fresh assignment would not be the other ranks').
        """
        if self._slices is None:
            if self.world_size != 1 and self._cyclic._parts is None:
                raise RuntimeError(
                    "this cyclic Poisson sampler is a copy (pickle, copy.copy/deepcopy or torch.save) of one of a "
                    "data-parallel run: its secret assignment of examples to parts is never copied, and a new one "
                    "would not be the other ranks'; iterate the original, or build a new loader for a new run"
                )
            self._slices = [
                (int(r[0]), int(r[-1]) + 1) if len(r) else (0, 0)
                for r in (torch.arange(len(p)).tensor_split(self.world_size)[self.rank] for p in self._cyclic.batches)
            ]
        return self._slices

    @property
    def partitions(self) -> list[list[int]]:
        """The b' fixed parts, as lists of dataset indices (private: in memory only, never in :meth:`state_dict`)."""
        self._slice_table()
        return self._cyclic.batches

    @property
    def position(self) -> int:
        return self._cyclic.position

    @position.setter
    def position(self, value: int) -> None:
        self._cyclic.position = int(value)

    def __len__(self) -> int:
        return self.steps

    def sample(self) -> torch.Tensor:
        """The next step's indices: this rank's slice of part ``position mod b'`` Poisson-sampled at q (int64
        ``[K]``, K ~ Binomial; one process: the whole part)."""
        from .sampling import poisson_indices

        slices = self._slice_table()
        lo, hi = slices[self.position % len(slices)]
        part = self._cyclic.sample()
        if self.noise.mode == "reproducible":  # the shared stream's sample of the whole part, this slice's share
            keep = poisson_indices(self.noise, len(part), self.sample_rate)
            return part[keep[(keep >= lo) & (keep < hi)]]
        return part[lo:hi][poisson_indices(self.noise, hi - lo, self.sample_rate)]

    def __iter__(self) -> Iterator[list[int]]:
        _seek(self, self.clock)
        for _ in range(self.steps):
            self.positions.append(self.position)
            idx = self.sample()
            self.sizes.append(int(idx.numel()))
            yield idx.tolist()

    def __getstate__(self) -> dict:
        """Copies and pickles never carry the assignment (the inner :class:`CyclicBatchSampler` drops it; the
        slices, which are its part sizes, are dropped here), the drawn batches' sizes (a count of private
        examples) nor the clock (the optimizer's). A copy draws a fresh secret assignment at position 0 in one
        process and refuses otherwise (:meth:`CyclicBatchSampler._assigned`)."""
        state = dict(self.__dict__)
        state["_cyclic"] = copy.copy(self._cyclic)  # without its assignment, also in a shallow copy
        state["_slices"] = None
        state["sizes"] = type(self.sizes)(maxlen=1024)
        state["positions"] = type(self.positions)(maxlen=1024)
        state["clock"] = None
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


class CyclicLoader(DPDataLoader):
    """A :class:`~dpopt.data_loader.DPDataLoader` over a :class:`CyclicBatchSampler`'s batches (``make_private``'s
    unamplified correlated-noise loader): empty batches (balls-in-bins sizes are Binomial(N, 1/b)) are
    collated as empty Poisson batches are, so their step still releases (noise only), and each batch is
    tagged for the optimizer's release boundary with its (private, in-memory) size.

    Args:
        dataset: a non-empty map-style dataset of N examples.
        sampler: the :class:`CyclicBatchSampler` over ``range(N)`` (this rank's slices under data parallel).
        collate_fn: the item collate function (default ``default_collate``).
        **kwargs: other ``DataLoader`` options (``num_workers``, ``pin_memory``, ...).

    Raises:
        ValueError: an empty or iterable dataset.
    """

    def __init__(self, dataset: Any, sampler: CyclicBatchSampler, collate_fn: Optional[Callable] = None, **kwargs: Any):
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") or len(dataset) == 0:
            raise ValueError("cyclic batches need a non-empty map-style dataset (with __len__)")
        self.sample_rate = 1.0 / len(sampler)  # epochs per step (public)
        self.poisson = sampler  # type: ignore[assignment]  # DPDataLoader reads its sizes
        DataLoader.__init__(
            self, dataset, batch_sampler=sampler, collate_fn=EmptyBatchCollate(dataset, collate_fn), **kwargs
        )
        self.last_batch_examples = None
        self.boundary = None
