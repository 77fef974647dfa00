"""Cyclic batches: the sampler whose participation pattern correlated-noise accounting assumes.

The dataset's indices are split ONCE into ``batches`` disjoint batches (a uniformly random
partition; it need not be secret: the unamplified matrix-factorization guarantee holds for every
fixed partition), and step t uses batch t mod b, for every epoch and across iterations of the loader
(a loop that stops an epoch early continues with the next batch, never restarts the cycle). So an
example takes part in at most ⌈T/b⌉ of T steps, any two of them exactly b steps apart: the
:class:`~dpopt.correlated_noise.Participation` (k = ⌈T/b⌉, min_separation = b) of
Choquette-Choo et al. (arXiv 2211.06530, "b-min-sep participation"). Reshuffling every epoch would
break it (an example could be last in one epoch and first in the next).
"""

from __future__ import annotations

import secrets
from typing import Iterator, Optional

import torch
from torch.utils.data import Sampler

__all__ = ["CyclicBatchSampler"]


class CyclicBatchSampler(Sampler):
    """A ``batch_sampler`` yielding ``batches`` fixed batches in a fixed cyclic order (module docstring).

    Args:
        dataset_size: N ≥ 1 (public).
        batches: b, with 1 ≤ b ≤ N; batch sizes are ⌊N/b⌋ or ⌈N/b⌉ (expected size N/b).
        steps: for :meth:`sample` (dpopt's own loop): the batches to draw in all (None: unlimited).

    Raises:
        ValueError: b < 1 or b > N.
    """

    def __init__(self, dataset_size: int, batches: int, steps: Optional[int] = None):
        n, b = int(dataset_size), int(batches)
        if not 1 <= b <= n:
            raise ValueError(f"batches must lie in [1, dataset size {n}], got {batches}")
        gen = torch.Generator().manual_seed(secrets.randbits(63))  # the partition protects nothing
        perm = torch.randperm(n, generator=gen)
        self._parts = list(torch.tensor_split(perm, b))
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
