"""Data-parallel DP training over ``torch.distributed`` with ONE noise draw per step.

Launch ``dpopt train`` under ``torchrun`` (gloo on CPU, NCCL on GPUs)::

    torchrun --standalone --nproc_per_node 4 -m dpopt train --dataset mnist --data-dir data/ ...

(``dpopt train --resume RUN_DIR`` under ``torchrun`` continues one, with any
number of processes), or, from Python, after ``torch.distributed.init_process_group``
on every rank:

* your own loop, model and ``torch.optim`` optimizer (Opacus style): the same
  ``PrivacyEngine().make_private(..., distributed=True)`` call on every rank
  (:mod:`dpopt.privacy_engine`; pass the bare module, not
  ``DistributedDataParallel``): it broadcasts rank 0's parameters, the returned
  loader draws this rank's shard (:class:`ShardedPoissonSampler`), the returned
  optimizer releases through :class:`AllReduceRelease`; B̄ = q·N is global and
  ``engine.get_epsilon`` counts each step once, on every rank;
* a :class:`~dpopt.optim.DPOptimizer`: :func:`prepare` (broadcast and
  :func:`attach`) and a :class:`ShardedPoissonSampler`;
* :func:`dpopt.training.train`, which does all of it.

One logical step on W processes (ranks)::

    rank r:  B_r  = Poisson sample of ITS SHARD D_r at the public rate q      (ShardedPoissonSampler)
             s_r  = Σ_{i ∈ B_r} clip(g_i)            (Privatizer.accumulate, as in one process)
    rank 0:  s_0 += σS·z  (+ the count's σ_b·z)      (the step's only noise draw)
    all:     S̃    = all_reduce_sum(s_r)              (ONE collective: gradient sums and clipped count)
             g̃    = S̃ / B̄ → transforms → update      (identical on every rank)

Why this is the single-process mechanism:

* **Sampling.** The shards D_0 … D_{W−1} partition the dataset; each example
  joins its rank's batch independently with probability q, so the union
  ∪_r B_r is exactly a Poisson sample of the whole dataset at rate q — the
  sampling the accountant assumes (one event per step, the same as W = 1).
* **Sensitivity.** Adding/removing one example changes exactly one rank's
  clipped sum by at most C, so the sum over ranks has sensitivity C (√ΣC_k² per
  layer; ½ for the centred count).
* **Noise.** Drawn once per step, by rank 0 (or, in reproducible mode, by
  every rank from the same seeded stream but added by rank 0 only), so the
  total noise std is exactly σ·S — never √W·σ·S. Adding it before the
  all-reduce means the reduced total is never formed without noise; but the
  ranks are ONE trust domain: every rank loads the training data, a ring
  all-reduce passes other ranks' un-noised partial sums through it, and in
  reproducible mode every rank can recompute the noise.
* **Identical updates.** An all-reduce returns the same tensor on every rank,
  the geometry (MacAdam, AdaClip) and every transform are functions of
  released values, and the initial parameters are broadcast from rank 0, so
  every rank applies the same update; :func:`check_replicas` verifies it.

Randomness per mode (DESIGN.md, "Secret randomness"):

* ``secret`` / ``secure``: every rank's :class:`~dpopt.noise.NoiseSource` is
  seeded from ITS OWN OS entropy (never written). Rank r draws the Poisson
  uniforms of its shard only; only rank 0 draws Gaussian noise — the sources
  of other ranks never produce noise.
* ``reproducible`` (research only): every rank seeds the same stream, draws the
  uniforms of the WHOLE dataset and keeps its shard's part (so the union is the
  batch a one-process run draws), and draws the step's noise too (rank r > 0
  discards it) to keep the shared stream aligned. A W-process run then
  matches the one-process run with the same seed to float tolerance (summation
  order differs), which is what ``tests/distributed/test_ddp_equivalence.py``
  checks.

Only rank 0 writes run files and prints; every rank keeps the ledger in memory
(identical on every rank: the same events in the same order), so the saved
ledger records each step exactly once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from .noise import NoiseSource
from .sampling import PoissonSampler, poisson_indices

__all__ = [
    "DistributedContext",
    "setup",
    "leave",
    "context",
    "shard_bounds",
    "ShardedPoissonSampler",
    "poisson_sampler",
    "AllReduceRelease",
    "RankAgreement",
    "attach",
    "prepare",
    "broadcast_parameters",
    "check_replicas",
    "any_rank",
    "backend_device",
]


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands: ``rank`` of ``world_size`` in process ``group`` (None: the default group).

    ``world_size == 1`` (no process group) is the ordinary single-process run.
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None  # a torch.distributed.ProcessGroup, or None: the default group

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that writes files and prints."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """In-place all-reduce (``"sum"`` or ``"max"``) over the group; a no-op for one process."""
        if self.enabled:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return tensor

    def broadcast(self, tensor: Tensor, src: int = 0) -> Tensor:
        """In-place broadcast from ``src`` (a group rank); a no-op for one process."""
        if self.enabled:
            import torch.distributed as dist

            dist.broadcast(
                tensor, src=dist.get_global_rank(self.group, src) if self.group is not None else src, group=self.group
            )
        return tensor


def context(group=None) -> DistributedContext:
    """The :class:`DistributedContext` of an initialised process group (else a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return DistributedContext()
    return DistributedContext(dist.get_rank(group), dist.get_world_size(group), group)


def setup(device: Optional[torch.device] = None) -> DistributedContext:
    """Join the process group ``torchrun`` describes (env ``WORLD_SIZE`` > 1), or use one already initialised.

    Backend: NCCL for a CUDA ``device`` (and ``torch.cuda.set_device(LOCAL_RANK)``,
    so ``"cuda"`` means this rank's GPU), gloo otherwise. Without a process group
    and with ``WORLD_SIZE`` unset or 1: a single process (nothing initialised).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return context()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistributedContext()
    if not dist.is_available():  # pragma: no cover - torch builds without distributed
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    return context()


def leave(timeout_s: float = 60.0) -> bool:
    """Wait for the other ranks (at most ``timeout_s``; gloo's ``monitored_barrier``), then leave the default
    process group (``destroy_process_group``). Returns whether there was a group to leave.

    For the end of any process in a default process group (one that joined with :func:`setup`, as the ``dpopt``
    command under torchrun does, or a DPTrainer / ``PrivacyEngine`` script's own group): a
    rank whose gloo group was still alive when the interpreter shut down aborted now and then
    ("terminate called without an active exception", SIGABRT) after all its work was written, which
    also lost rank 0's buffered stdout. A rank that failed or left already makes the wait end early
    (its error is the one reported); nothing here raises.
    """
    import datetime

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
        else:
            dist.barrier()
    except Exception:  # noqa: BLE001 - a rank that failed or left: nothing to wait for
        pass
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - leaving must not turn a finished run into a failure
        pass
    return True


def shard_bounds(dataset_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[lo, hi)``: rank's contiguous shard of ``range(dataset_size)`` (sizes differ by at most one)."""
    n, w = int(dataset_size), int(world_size)
    return rank * n // w, (rank + 1) * n // w


class ShardedPoissonSampler(PoissonSampler):
    """Poisson sampling of this rank's shard at the public rate q; indices are GLOBAL (into the dataset).

    Args:
        dataset_size, sample_rate, steps, noise: as for :class:`~dpopt.sampling.PoissonSampler`
            (``noise``: THIS rank's source).
        ctx: the :class:`DistributedContext`.

    With secret/secure noise each rank draws the sample of its shard only, from
    its own source (:func:`~dpopt.sampling.poisson_indices`: O(q·|shard|) per step).
    With reproducible noise every rank draws the sample of the whole dataset from
    the shared seeded stream (O(q·N)) and keeps its shard's part, so the union
    over ranks is the one-process batch for the same seed.
    Either way the union over ranks is a Poisson sample of the dataset at q.
    """

    def __init__(
        self,
        dataset_size: int,
        sample_rate: float,
        steps: int,
        ctx: DistributedContext,
        noise: Optional[NoiseSource] = None,
    ):
        super().__init__(dataset_size, sample_rate, steps, noise=noise)
        self.ctx = ctx
        self.lo, self.hi = shard_bounds(self.dataset_size, ctx.rank, ctx.world_size)

    def sample(self) -> Tensor:
        if self.position >= self.steps:
            raise StopIteration
        if self.noise.mode == "reproducible":  # the shared stream's sample of the whole dataset, this shard's part
            idx = poisson_indices(self.noise, self.dataset_size, self.sample_rate)
            idx = idx[(idx >= self.lo) & (idx < self.hi)]
        else:
            idx = poisson_indices(self.noise, self.hi - self.lo, self.sample_rate).add_(self.lo)
        self.position += 1
        return idx


def poisson_sampler(
    dataset_size: int, sample_rate: float, steps: int, ctx: DistributedContext, noise: Optional[NoiseSource] = None
) -> PoissonSampler:
    """This process's sampler: :class:`ShardedPoissonSampler` over several ranks, else a plain
    :class:`~dpopt.sampling.PoissonSampler` of the whole dataset."""
    if ctx.enabled:
        return ShardedPoissonSampler(dataset_size, sample_rate, steps, ctx, noise=noise)
    return PoissonSampler(dataset_size, sample_rate, steps, noise=noise)


class RankAgreement:
    """What the Privatizer asks of a data-parallel ``reduce`` hook (:class:`AllReduceRelease`,
    :class:`dpopt.fsdp.ShardedRelease`) besides the release: agree a flag over the ranks of ``self.ctx``
    (a :class:`DistributedContext`, set by the hook)."""

    ctx: DistributedContext

    #: The Privatizer agrees each release's ledger record over the ranks (:meth:`any_rank`, one all-reduce)
    #: before drawing. ``dpopt train`` sets it False: its journal is written in batches, never at a record,
    #: and its loop agrees rank 0's failed writes itself (``training.loop``), so the agreement could not fire.
    agree_records = True

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is on some rank (the Privatizer: a ledger write that failed on one rank
        stops the release on all, before any noise is drawn, summed or reduced). A collective: every rank calls it."""
        return any_rank(flag, self.ctx)


class AllReduceRelease(RankAgreement):
    """The Privatizer's ``reduce`` hook: noise once on rank 0, then ONE all-reduce of sums (and count).

    Args:
        ctx: the :class:`DistributedContext`.
        replay: draw the noise on every rank and discard it off rank 0 — for a
            reproducible (shared-seed) noise source only, to keep the shared
            stream aligned; never for secret noise (other ranks never draw noise).

    Call: ``(sums, count, draw) -> (noisy_sums, noisy_count)`` as documented at
    :class:`~dpopt.privatizer.Privatizer` (``reduce``). The sums are packed in
    one flat buffer per dtype and device (one collective for the usual
    all-float32 model); the centred count, under quantile clipping, is one more
    small all-reduce in float64.
    """

    def __init__(self, ctx: DistributedContext, *, replay: bool = False):
        self.ctx, self.replay = ctx, bool(replay)
        self.calls = 0  # steps reduced (public)

    def __call__(
        self, sums: Sequence[Tensor], count: Optional[float], draw: Callable[[], tuple[list[Tensor], Optional[float]]]
    ):
        sums = list(sums)
        if self.ctx.is_main or self.replay:
            noise, count_noise = draw()
            if self.ctx.is_main:
                sums = [s + z for s, z in zip(sums, noise)]
                if count is not None:
                    count = count + count_noise  # type: ignore[operator]
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(sums):
            groups.setdefault((s.dtype, s.device), []).append(i)
        out: list[Optional[Tensor]] = [None] * len(sums)
        noisy_count = None
        for idx in groups.values():
            parts = [sums[i].reshape(-1) for i in idx]
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
            self.ctx.all_reduce(flat)
            offset = 0
            for i in idx:
                n = sums[i].numel()
                out[i] = flat[offset : offset + n].view(sums[i].shape)
                offset += n
        if count is not None:  # in float64 whatever the model's dtype (bf16 would round a count of 300 by 1)
            device = sums[0].device if sums else backend_device(self.ctx)
            noisy_count = float(self.ctx.all_reduce(torch.tensor([count], dtype=torch.float64, device=device))[0])
        self.calls += 1
        return out, noisy_count


def attach(privatizer, ctx: DistributedContext) -> Optional[AllReduceRelease]:
    """Make ``privatizer`` release the noisy sum over every rank of ``ctx`` (a no-op for one process).

    Every rank's Privatizer must have the same configuration (σ, bounds, B̄, q,
    clipping); each keeps its own in-memory ledger (identical on every rank).

    Returns:
        The hook set as ``privatizer.reduce`` (None for one process).

    Raises:
        ValueError: a privatizer that already has a ``reduce`` hook.
    """
    if not ctx.enabled:
        return None
    if privatizer.reduce is not None:
        raise ValueError("this Privatizer already has a reduce hook")
    privatizer.reduce = AllReduceRelease(ctx, replay=privatizer.noise.mode == "reproducible")
    return privatizer.reduce


def prepare(optimizer, ctx: Optional[DistributedContext] = None) -> DistributedContext:
    """Data-parallel setup of a :class:`~dpopt.optim.DPOptimizer` built the same way on every rank.

    Broadcasts rank 0's parameters (so every replica starts equal) and
    :func:`attach` es the all-reduce to its Privatizer. Sample each rank's
    batches with :class:`ShardedPoissonSampler`; only rank 0 should write the
    ledger (``optimizer.privatizer.ledger``) to files.

    Example (each rank, after ``torch.distributed.init_process_group``)::

        ctx = dpopt.distributed.prepare(opt)
        sampler = dpopt.distributed.ShardedPoissonSampler(len(x), q, steps, ctx)
        for idx in sampler:
            opt.step(iter_per_sample_sources(model, loss_fn, x[idx], y[idx]))

    Returns:
        the context used (:func:`context` of the default group if None).
    """
    ctx = ctx if ctx is not None else context()
    broadcast_parameters([p for g in optimizer.param_groups for p in g["params"]], ctx)
    attach(optimizer.privatizer, ctx)
    return ctx


@torch.no_grad()
def broadcast_parameters(tensors: Sequence[Tensor], ctx: DistributedContext) -> None:
    """Copy rank 0's values of ``tensors`` (parameters, buffers) to every rank."""
    if not ctx.enabled:
        return
    for t in tensors:
        ctx.broadcast(t.data)


@torch.no_grad()
def check_replicas(tensors: Sequence[Tensor], ctx: DistributedContext) -> bool:
    """True if every rank holds exactly rank 0's values of ``tensors`` (bit for bit).

    One broadcast of the flattened tensors and one all-reduce of the verdict;
    True for a single process.
    """
    if not ctx.enabled:
        return True
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]) if tensors else torch.zeros(0)
    ref = ctx.broadcast(flat.clone())
    differs = torch.tensor([0.0 if torch.equal(ref, flat) else 1.0], dtype=torch.float64, device=flat.device)
    ctx.all_reduce(differs, op="max")
    return bool(differs.item() == 0.0)


def any_rank(flag: bool, ctx: DistributedContext) -> bool:
    """True on every rank if ``flag`` is True on some rank (e.g. a stop signal that reached one rank)."""
    if not ctx.enabled:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=backend_device(ctx))
    return bool(ctx.all_reduce(t, op="max").item() > 0)


def backend_device(ctx: DistributedContext) -> Optional[torch.device]:
    """Where a collective's tensors must live: this rank's GPU for NCCL, None (the CPU) for gloo."""
    import torch.distributed as dist

    if dist.get_backend(ctx.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None
