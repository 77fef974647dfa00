"""``BatchMemoryManager``: one Poisson logical batch in physical chunks, ONE release per logical batch.

``from dpopt.utils.batch_memory_manager import BatchMemoryManager`` mirrors
``opacus.utils.batch_memory_manager``::

    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=64, optimizer=opt) as chunks:
        for x, y in chunks:                  # at most 64 examples each
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()                       # clips and adds the chunk; releases on the LAST chunk only

How it stays one Poisson step: the wrapped loader's batch sampler draws the
logical batch (Poisson, at q); this sampler splits its index list into
``ceil(|batch| / max_physical_batch_size)`` near-equal chunks (disjoint: every
example of the batch is in exactly one chunk) and tags each chunk
``(batch, chunk, chunks)`` (:mod:`dpopt.release_boundary`); the chunked loader
hands each tag to the optimizer's release boundary as it yields the chunk, so
the tag — not a queue of signals — says which ``step()`` ends the logical
batch, and a step left open (``break``, ``continue`` on the last chunk, an
exception, leaving the ``with`` block) is released on its own before anything
of another batch is added. (An optimizer that is not dpopt's, or Opacus's own
manager, gets Opacus's ``optimizer.signal_skip_step(do_skip=...)`` protocol
instead.) On a skipped step :class:`~dpopt.private_optimizer.PrivateOptimizer` clips the chunk's
per-sample gradients and adds them into its Privatizer's open step
(``Privatizer.accumulate``); on the last chunk it adds that chunk too and
releases once: noise once, one ledger entry at q — the same release as one
backward over the whole logical batch (a test checks equality at σ = 0). An
empty logical batch is one empty chunk (a pure-noise release, charged).

The number of chunks depends on the realised batch size, which is private: it
is only used inside this process to drive the loop (it is not printed, logged
or released). Iterate the loader in the main process order (``num_workers``
> 0 prefetching is fine: the signals are queued in order, as Opacus's).

Opacus's own ``opacus.utils.batch_memory_manager.BatchMemoryManager`` also
works with dpopt's optimizer (it calls the same ``signal_skip_step``).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterator

from torch.utils.data import DataLoader, Sampler

from ..data_loader import loader_settings
from ..release_boundary import ChunkTag, boundary_of

__all__ = ["BatchMemoryManager", "BatchSplittingSampler", "wrap_data_loader"]


def _chunks(indices: list, max_size: int) -> list[list]:
    """``indices`` in ``ceil(n / max_size)`` contiguous chunks whose sizes differ by at most one."""
    n = len(indices)
    k = math.ceil(n / max_size)
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append(list(indices[start : start + size]))
        start += size
    return out


class BatchSplittingSampler(Sampler):
    """A batch sampler: each logical batch of ``sampler`` as physical chunks, signalling the optimizer.

    Args:
        sampler: the logical batch sampler (e.g. the Poisson sampler of a
            :class:`~dpopt.data_loader.DPDataLoader`), yielding lists of indices.
        max_batch_size: the largest physical chunk (≥ 1).
        optimizer: told ``signal_skip_step(do_skip=True)`` before every chunk
            but the last of a logical batch, ``do_skip=False`` before the last.

    ``len()`` is an estimate (Opacus's): batches × ⌈expected size / max⌉, for
    progress bars only; the realised number of chunks depends on the batches.

    Raises:
        ValueError: ``max_batch_size`` < 1, or an optimizer without ``signal_skip_step``.
    """

    def __init__(self, *, sampler, max_batch_size: int, optimizer):
        if int(max_batch_size) < 1:
            raise ValueError(f"max_physical_batch_size must be >= 1, got {max_batch_size}")
        if not hasattr(optimizer, "signal_skip_step"):
            raise ValueError(
                "BatchMemoryManager needs the optimizer that PrivacyEngine.make_private returned "
                "(it accumulates the chunks of one logical batch into one release)"
            )
        self.sampler, self.max_batch_size, self.optimizer = sampler, int(max_batch_size), optimizer
        # dpopt's optimizer: the chunks are tagged (release_boundary) instead of queueing skip signals
        self.boundary = boundary_of(optimizer) if hasattr(optimizer, "_close_open_step") else None
        self.tags: deque = deque()  # tags of the chunks drawn and not yet handed to the loop (private sizes)

    def __getstate__(self) -> dict:
        """Copies and pickles carry no chunk tag (their sizes are private)."""
        state = dict(self.__dict__)
        state["tags"] = deque()
        return state

    def __iter__(self) -> Iterator[list]:
        if self.boundary is not None:
            yield from self._tagged()
            return
        for batch in self.sampler:
            batch = list(batch)
            if not batch:
                self.optimizer.signal_skip_step(do_skip=False)
                yield []
                continue
            parts = _chunks(batch, self.max_batch_size)
            for part in parts[:-1]:
                self.optimizer.signal_skip_step(do_skip=True)
                yield part
            self.optimizer.signal_skip_step(do_skip=False)
            yield parts[-1]

    def _tagged(self) -> Iterator[list]:
        """The chunks, each with its :class:`~dpopt.release_boundary.ChunkTag` queued for the loader."""
        bd = self.boundary
        assert bd is not None, "set by BatchMemoryManager before iteration"
        positions = getattr(self.sampler, "positions", None)  # cyclic batches: the step each batch is for
        for batch in self.sampler:
            batch = list(batch)
            position = positions.popleft() if positions else None
            parts = _chunks(batch, self.max_batch_size) if batch else [[]]
            serial = bd.new_batch()
            for i, part in enumerate(parts):
                self.tags.append(ChunkTag(serial, i, len(parts), len(part), position))
                yield part

    def __len__(self) -> int:
        rate, n = getattr(self.sampler, "sample_rate", None), getattr(self.sampler, "dataset_size", None)
        if rate is None or n is None:
            return len(self.sampler)
        return len(self.sampler) * max(1, math.ceil(rate * n / self.max_batch_size))


def wrap_data_loader(*, data_loader: DataLoader, max_batch_size: int, optimizer) -> DataLoader:
    """A new ``DataLoader`` over the same dataset whose batch sampler is a :class:`BatchSplittingSampler`.

    Keeps ``collate_fn`` (dpopt's handles empty batches), ``num_workers``,
    ``pin_memory``, ``timeout``, ``worker_init_fn``, ``multiprocessing_context``,
    ``generator``, ``prefetch_factor`` and ``persistent_workers``.

    Raises:
        ValueError: an optimizer of ``privacy_unit="user"`` (chunks would split users).
    """
    if getattr(optimizer, "_user_level", False):
        raise ValueError(
            "BatchMemoryManager with privacy_unit='user' is not supported: its chunks would cut users in two "
            "(each user must be clipped as one unit). Step once per batch of the loader make_private returned, "
            "or train with DPTrainer, whose chunks end between users"
        )
    keep = loader_settings(data_loader, generator=True)
    splitter = BatchSplittingSampler(
        sampler=data_loader.batch_sampler, max_batch_size=max_batch_size, optimizer=optimizer
    )
    if splitter.boundary is not None:
        return _ChunkLoader(data_loader.dataset, batch_sampler=splitter, collate_fn=data_loader.collate_fn, **keep)
    return DataLoader(data_loader.dataset, batch_sampler=splitter, collate_fn=data_loader.collate_fn, **keep)


class _ChunkLoader(DataLoader):
    """The chunked loader of dpopt's optimizer: hands each chunk's tag to the release boundary as it yields it.

    Leaving the iteration (exhausted, ``break``, an exception) closes a step
    still open (:meth:`~dpopt.release_boundary.ReleaseBoundary.leave`).
    """

    def __iter__(self):
        splitter = self.batch_sampler
        bd = splitter.boundary
        splitter.tags.clear()
        if getattr(self, "in_order", True) is False:
            raise ValueError(
                "BatchMemoryManager needs the chunks in the order they are drawn (in_order=True): "
                "each chunk is tagged with its logical batch"
            )
        try:
            for chunk in super().__iter__():
                bd.hand(splitter.tags.popleft(), owed=True)
                yield chunk
        finally:
            splitter.tags.clear()
            bd.leave()


class BatchMemoryManager:
    """Context manager returning the chunked loader (module docstring); Opacus's signature.

    Args:
        data_loader: the loader ``make_private`` returned.
        max_physical_batch_size: the largest chunk.
        optimizer: the optimizer ``make_private`` returned.
    """

    def __init__(self, *, data_loader: DataLoader, max_physical_batch_size: int, optimizer):
        self.data_loader, self.max_physical_batch_size, self.optimizer = (
            data_loader,
            int(max_physical_batch_size),
            optimizer,
        )

    def __enter__(self) -> DataLoader:
        return wrap_data_loader(
            data_loader=self.data_loader, max_batch_size=self.max_physical_batch_size, optimizer=self.optimizer
        )

    def __exit__(self, exc_type, exc, tb) -> None:
        """Leaving the context with a logical step open (``break``, an exception) releases what it holds.

        The chunks already added are a subset of one Poisson batch: they are
        released as their own step (noise, ledger entry, update), never merged
        with a later batch (:mod:`dpopt.release_boundary`).
        """
        if hasattr(self.optimizer, "_close_open_step"):
            boundary_of(self.optimizer).leave()
        return None
