"""A Poisson-sampling ``DataLoader`` over any map-style ``Dataset`` (Opacus's ``DPDataLoader`` in dpopt).

Each of the ``steps`` batches of an epoch contains every example independently
with probability q (the sampling the accountants assume; the masks come from a
:class:`~dpopt.noise.NoiseSource`, secret by default). Batches therefore vary
in size and may be EMPTY: an empty batch is yielded, not skipped, with the
structure of a normal one (zero-length tensors: e.g. ``x [0, 1, 8, 8]``,
``y [0]``, or a dict of them), so that the training loop still calls
``optimizer.step()`` — the Privatizer then releases pure noise and the step
is charged like any other (skipping it would reveal that the batch was empty).

The empty structure is built once, on the first empty batch, by collating one
item (``dataset[0]``) and cutting every tensor (or list) leaf to length 0: the
shapes and dtypes of an item are treated as public (all items share them); no
value of that item is used.

Items may have any structure the ``collate_fn`` understands (tuples, dicts,
nested); the user's ``collate_fn`` is used, else torch's ``default_collate``.

Data parallel (``ctx``, a :class:`~dpopt.distributed.DistributedContext` of
several ranks): each rank's loader yields the Poisson samples of ITS shard of
the dataset at the same q (:class:`~dpopt.distributed.ShardedPoissonSampler`),
``steps`` batches per epoch on every rank; the union over ranks is a Poisson
sample of the whole dataset at q (Opacus's ``DistributedPoissonBatchSampler``).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)
from torch.utils.data._utils.collate import default_collate

from .distributed import DistributedContext, poisson_sampler
from .noise import NoiseSource, make_noise_source
from .sampling import PoissonSampler

__all__ = ["PoissonBatchSampler", "DPDataLoader", "EmptyBatchCollate", "custom_batching", "loader_settings"]


def custom_batching(data_loader: DataLoader) -> Optional[str]:
    """What is not default about how ``data_loader`` forms its batches, or None for torch's default.

    The default — what Poisson sampling at q = 1/len(loader) may replace without
    changing what the user asked for beyond the sampling scheme — is a
    ``BatchSampler`` (exactly that class) over a ``SequentialSampler``
    (``shuffle=False``) or a ``RandomSampler`` without replacement over the
    whole dataset (``shuffle=True``). Anything else encodes a choice of the
    user's (``WeightedRandomSampler``, a custom ``batch_sampler``, a subset or
    resampling sampler, ``batch_size=None``) that Poisson sampling would
    silently discard; the returned text names it, e.g.
    ``"sampler=WeightedRandomSampler"``. Only the classes and settings are
    read, never an index or an example.
    """
    batch_sampler = data_loader.batch_sampler
    if batch_sampler is None:
        return "batch_size=None (no batching: every item is its own batch)"
    if type(batch_sampler) is not BatchSampler:
        return f"batch_sampler={type(batch_sampler).__name__}"
    sampler = batch_sampler.sampler
    if type(sampler) is SequentialSampler:
        return None
    if type(sampler) is RandomSampler:
        if sampler.replacement:
            return "sampler=RandomSampler(replacement=True)"
        if sampler.num_samples != len(sampler.data_source):
            return f"sampler=RandomSampler(num_samples={sampler.num_samples}, not the dataset size)"
        return None
    return f"sampler={type(sampler).__name__}"


class PoissonBatchSampler(Sampler):
    """A ``batch_sampler``: ``steps`` Poisson batches (lists of indices, possibly empty) per epoch.

    Args:
        dataset_size: N (treated as public by the engine that builds it).
        sample_rate: q ∈ (0, 1].
        steps: batches per epoch (≥ 1).
        noise: where the masks come from (default: a secret :class:`~dpopt.noise.NoiseSource`).
        ctx: data parallel: sample this rank's shard only (indices stay global;
            :class:`~dpopt.distributed.ShardedPoissonSampler`). None or one process: the whole dataset.
    """

    def __init__(
        self,
        dataset_size: int,
        sample_rate: float,
        steps: int,
        noise: Optional[NoiseSource] = None,
        ctx: Optional[DistributedContext] = None,
    ):
        if int(steps) < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.dataset_size, self.steps = int(dataset_size), int(steps)
        self.noise = make_noise_source(noise)
        self.sample_rate = PoissonSampler(self.dataset_size, sample_rate, 0, noise=self.noise).sample_rate
        self.ctx = ctx if ctx is not None else DistributedContext()
        self.drawn = 0  # batches handed out (public: a count of steps, not of examples)
        # sizes of the batches drawn and not yet handed to the caller by DPDataLoader (private, in memory only)
        self.sizes: deque = deque(maxlen=1024)

    def __getstate__(self) -> dict:
        """Copies and pickles never carry the drawn batches' sizes (a count of private examples)."""
        state = dict(self.__dict__)
        state["sizes"] = deque(maxlen=1024)
        return state

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for idx in poisson_sampler(self.dataset_size, self.sample_rate, self.steps, self.ctx, noise=self.noise):
            self.drawn += 1
            self.sizes.append(int(idx.numel()))
            yield idx.tolist()


def _empty_like(obj: Any) -> Any:
    leaves, spec = tree_flatten(obj)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf[:0] if leaf.dim() > 0 else leaf.new_zeros((0,)))
        elif isinstance(leaf, (list, tuple, str)):
            out.append(leaf[:0])  # type: ignore[arg-type]
        else:
            out.append(leaf)
    return tree_unflatten(out, spec)


class EmptyBatchCollate:
    """``collate_fn`` wrapper: an empty batch gets the structure of a batch of one, cut to length 0.

    Args:
        dataset: the dataset (``dataset[0]`` is read for its structure only).
        collate_fn: the collate function (default: ``default_collate``).
    """

    def __init__(self, dataset: Dataset, collate_fn: Optional[Callable] = None):
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate
        self._empty = None

    def __call__(self, batch: list) -> Any:
        if len(batch) > 0:
            return self.collate_fn(batch)
        if self._empty is None:
            self._empty = _empty_like(self.collate_fn([self.dataset[0]]))
        return self._empty


def loader_settings(data_loader: DataLoader, generator: bool = False) -> dict:
    """The ``DataLoader`` keywords a rebuilt loader keeps: ``num_workers``, ``pin_memory``, ``timeout``,
    ``worker_init_fn``, ``multiprocessing_context``, ``persistent_workers``, ``prefetch_factor`` (with
    workers) and, with ``generator=True``, ``generator`` (dataset and batching are the caller's)."""
    keep = {
        "num_workers": data_loader.num_workers,
        "pin_memory": data_loader.pin_memory,
        "timeout": data_loader.timeout,
        "worker_init_fn": data_loader.worker_init_fn,
        "multiprocessing_context": data_loader.multiprocessing_context,
        "persistent_workers": data_loader.persistent_workers,
    }
    if data_loader.num_workers > 0:
        keep["prefetch_factor"] = data_loader.prefetch_factor
    if generator:
        keep["generator"] = data_loader.generator
    return keep


class DPDataLoader(DataLoader):
    """A ``DataLoader`` that draws Poisson batches: ``steps`` per epoch at rate ``sample_rate``.

    Args:
        dataset: a map-style dataset (``len`` and ``__getitem__``).
        sample_rate: q ∈ (0, 1]; the expected batch size is q·N.
        steps: batches per epoch (default ``round(1/q)``: one pass in expectation).
        collate_fn: the item collate function (default ``default_collate``);
            empty batches are handled by :class:`EmptyBatchCollate`.
        noise: the :class:`~dpopt.noise.NoiseSource` of the masks (default: secret).
        ctx: data parallel: this rank's shard only (:class:`PoissonBatchSampler`).
        **kwargs: other ``DataLoader`` options (``num_workers``, ``pin_memory``,
            ...); ``batch_size``, ``shuffle``, ``sampler``, ``batch_sampler`` and
            ``drop_last`` are refused (the Poisson sampler decides the batches).

    Raises:
        ValueError: an ``IterableDataset`` or an empty dataset, q outside (0, 1],
            or a batching option.
    """

    def __init__(
        self,
        dataset: Dataset,
        sample_rate: float,
        steps: Optional[int] = None,
        collate_fn: Optional[Callable] = None,
        noise: Optional[NoiseSource] = None,
        ctx: Optional[DistributedContext] = None,
        **kwargs: Any,
    ):
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError(
                "Poisson sampling needs a map-style dataset (with __len__ and __getitem__); "
                f"got {type(dataset).__name__}"
            )
        if len(dataset) == 0:
            raise ValueError("the dataset is empty")
        refused = sorted(set(kwargs) & {"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"})
        if refused:
            raise ValueError(f"DPDataLoader draws its own Poisson batches; do not pass {refused}")
        q = float(sample_rate)
        steps = int(round(1.0 / q)) if steps is None else int(steps)
        self.sample_rate = q
        self.poisson = PoissonBatchSampler(len(dataset), q, max(1, steps), noise=noise, ctx=ctx)
        super().__init__(
            dataset, batch_sampler=self.poisson, collate_fn=EmptyBatchCollate(dataset, collate_fn), **kwargs
        )
        self.last_batch_examples: Optional[int] = None  # examples in the batch last yielded (private, memory only)
        self.boundary = None  # the optimizer's ReleaseBoundary (set by make_private): every batch is tagged

    def __iter__(self):
        """The batches, in order; :attr:`last_batch_examples` is the number of examples of the last one yielded.

        With :attr:`boundary` (make_private's loader) each batch is handed to the
        optimizer's :class:`~dpopt.release_boundary.ReleaseBoundary` as one
        tagged chunk before it is yielded (a step still open for an earlier batch
        is closed as its own release).
        """
        from .release_boundary import ChunkTag

        self.poisson.sizes.clear()
        positions = getattr(self.poisson, "positions", None)  # cyclic batches: the step each batch is for
        if positions is not None:
            positions.clear()
        self.last_batch_examples = None
        in_order = getattr(self, "in_order", True)  # batches out of order: their sizes cannot be matched
        if positions is not None and not in_order:
            raise ValueError(
                "cyclic batches (correlated noise) must reach the loop in their order (in_order=True): release t "
                "must hold the batch of step t"
            )
        for batch in super().__iter__():
            self.last_batch_examples = self.poisson.sizes.popleft() if in_order and self.poisson.sizes else None
            position = positions.popleft() if positions else None
            bd = getattr(self, "boundary", None)
            if bd is not None:
                # out of order (in_order=False, Poisson only): tagged without its size (the rows check skips it)
                tag = ChunkTag(bd.new_batch(), 0, 1, self.last_batch_examples if in_order else None, position)
                # cyclic batches: a batch the loop skips is still released (pure noise) when the loop moves on,
                # so that release t holds the batch of step t (docs/correlated-noise.md)
                bd.hand(tag, owed=positions is not None)
            yield batch
        bd = getattr(self, "boundary", None)
        if bd is not None and positions is not None:  # the pass ran to its end (not left by break)
            bd.pass_ended()  # its last batch, skipped or failed, is released as pure noise now

    def __getstate__(self) -> dict:
        """Copies and pickles never carry the last batch's size (a count of private examples)."""
        state = dict(self.__dict__)
        state["last_batch_examples"] = None
        state["boundary"] = None  # the optimizer's, not the copy's
        return state

    @classmethod
    def from_data_loader(
        cls, data_loader: DataLoader, noise: Optional[NoiseSource] = None, ctx: Optional[DistributedContext] = None
    ) -> "DPDataLoader":
        """The Poisson counterpart of a loader: q = 1/len(loader), len(loader) batches per epoch (Opacus).

        With ``ctx`` (data parallel) each rank draws its shard of the loader's
        dataset at that q; give every rank a loader of the same length.

        Keeps the loader's dataset, ``collate_fn``, ``num_workers``, ``pin_memory``,
        ``timeout``, ``worker_init_fn``, ``multiprocessing_context``,
        ``generator`` (worker seeding only, not the masks), ``prefetch_factor``
        and ``persistent_workers``.
        """
        steps = len(data_loader)
        if steps < 1:
            raise ValueError("the data loader yields no batch")
        keep = loader_settings(data_loader)
        collate = data_loader.collate_fn
        if collate is default_collate or getattr(collate, "__name__", "") == "default_collate":
            collate = None  # type: ignore[assignment]
        return cls(data_loader.dataset, 1.0 / steps, steps, collate_fn=collate, noise=noise, ctx=ctx, **keep)
