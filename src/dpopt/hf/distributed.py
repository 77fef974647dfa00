"""``DPTrainer`` on several processes (``torchrun`` / ``accelerate launch``): data parallel, one release per step.

::

    torchrun --nproc_per_node 2 train.py          # train.py builds DPTrainer(...) and calls train()
    accelerate launch --num_processes 2 train.py  # the same environment variables

What changes from one process (the engine's ``make_private(..., distributed=True)``, :mod:`dpopt.distributed`):

* **Sampling.** B̄ = ``per_device_train_batch_size × gradient_accumulation_steps × world_size``
  and q = 1/ceil(N/B̄) as for one process. Each rank's loader draws its contiguous shard of the
  dataset at q (:class:`~dpopt.distributed.ShardedPoissonSampler`): every record is on exactly one
  rank and joins with probability q, so the union of the ranks' batches is ONE Poisson sample of the
  whole dataset (the accountant's event, once per step).
* **Clipping and reduction.** The model is NOT wrapped in ``DistributedDataParallel`` (which would
  all-reduce un-clipped gradients in every backward): accelerate prepares it for device placement
  and autocast only (:func:`replicas_not_wrapped`). Each rank clips per example and sums its chunks
  locally; at the step's release rank 0 adds the noise N(0, σ²C²) — drawn once, on rank 0 only —
  and ONE all-reduce of the flat clipped sums makes every rank's update the same
  (:class:`~dpopt.distributed.AllReduceRelease`). No collective runs per physical chunk.
* **Files.** Rank 0 alone opens the journal and writes ``privacy_ledger.json`` /
  ``privacy_summary.json`` (the Trainer's ``should_save``). Every rank keeps the same ledger in
  memory (the same events in the same order), so ``get_epsilon()`` on any rank is the ledger's ε.
  On resume every rank loads the checkpoint (a shared file system, as the Trainer needs anyway);
  ranks > 0 never write the journal (the engine's rank-0 rule) nor read it (:func:`journal_not_reopened`)
  and then take rank 0's ledger (:func:`share_ledger`), which holds every release the journal kept.
* **Parameters.** ``make_private`` broadcasts rank 0's parameters and buffers; after that the
  same released gradient reaches every rank, so all replicas stay equal
  (:func:`dpopt.distributed.check_replicas` verifies it).

**FSDP2** (a model the user ``fully_shard``-ed before building ``DPTrainer``, docs/fsdp.md): the
engine's ``make_private(..., distributed="fsdp")`` (:mod:`dpopt.fsdp`) — the same sampling, per-example
norms on the full-shape gradient, each coordinate's noise added once by the rank that owns its
shard, one reduce-scatter per logical batch. Every forward/backward of a sharded model is a
collective (FSDP's all-gathers), so every rank must run the same number of chunks per logical
batch: :func:`agreed_chunks` all-reduces the MAX of the local chunk counts at the start of each
logical batch (a count that stays among the ranks, never logged or released), and a rank with
fewer chunks runs zero-weight stand-in chunks (:func:`padded`) whose per-example gradient — and so
contribution to the clipped sum — is exactly 0.

``TrainingArguments(fsdp=..., fsdp_config={"fsdp_version": 2})`` is the same path: DPTrainer shards the
model itself from those settings (:mod:`dpopt.hf.fsdp_args`); accelerate never prepares an FSDP model.

Not here: DeepSpeed, and a single process driving several GPUs (``nn.DataParallel``, ``n_gpu > 1``).
"""

from __future__ import annotations

import copy
import functools
import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ..distributed import DistributedContext, context

__all__ = [
    "launched_args",
    "data_parallel_context",
    "replicas_not_wrapped",
    "journal_not_reopened",
    "share_ledger",
    "same_on_every_rank",
    "is_sharded",
    "agreed_chunks",
    "padded",
    "full_state_dict",
    "load_full_state_dict",
    "save_optimizer_shards",
    "load_optimizer_shards",
]


def _launched_world() -> int:
    """The number of processes torchrun / accelerate launch started (``WORLD_SIZE``; 1 without a launcher)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _has_accelerator() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return bool(torch.cuda.is_available())


def launched_args(args: Any) -> Any:
    """``args`` (a copy with ``use_cpu=True`` where needed) that make accelerate join torchrun's process group.

    On a machine without a GPU, accelerate joins the gloo group of ``torchrun --nproc_per_node W``
    only with ``use_cpu=True``; without it every process would run alone (world size 1) — W separate
    runs on the whole dataset, each with its own noise and ledger, all writing ``output_dir``. So when
    ``WORLD_SIZE`` > 1 and no accelerator is present, the copy says ``use_cpu=True`` and forgets its
    device setup (``TrainingArguments._setup_devices``, a cached property that resets accelerate's
    state and sets it up again when next read). ``args`` itself is never changed.
    """
    if _launched_world() > 1 and not args.use_cpu and not _has_accelerator():
        args = copy.copy(args)
        args.use_cpu = True
        vars(args).pop("_setup_devices", None)
        _ = args.device  # set up again, on the CPU: accelerate joins the gloo group (its state is reset first)
    return args


def check_launch(world_size: int) -> None:
    """Refuse a run whose Trainer sees another number of processes than the launcher started.

    Raises:
        ValueError: ``WORLD_SIZE`` > 1 (torchrun / accelerate launch) but ``world_size`` differs — each
            process would train alone on the whole dataset (separate runs, separate ledgers).
    """
    launched = _launched_world()
    if launched > 1 and int(world_size) != launched:
        raise ValueError(
            f"the launcher started {launched} processes (WORLD_SIZE={launched}) but TrainingArguments sees "
            f"world size {world_size}: each process would train alone on the whole dataset, with its own "
            "noise and ledger. On a machine without a GPU pass TrainingArguments(..., use_cpu=True) (gloo), "
            "and create the TrainingArguments before anything initialises accelerate's state"
        )


def data_parallel_context(world_size: int) -> DistributedContext:
    """The process group the Trainer runs in: one process for ``world_size`` ≤ 1.

    Args:
        world_size: ``TrainingArguments.world_size`` (accelerate initialises the group from
            torchrun's environment when it is read).

    Raises:
        RuntimeError: ``world_size`` > 1 but no process group of that size is initialised.
    """
    if int(world_size) <= 1:
        return DistributedContext()
    ctx = context()
    if ctx.world_size != int(world_size):
        raise RuntimeError(
            f"TrainingArguments.world_size is {world_size} but the initialised process group has "
            f"{ctx.world_size} process(es): launch with torchrun / accelerate launch"
        )
    return ctx


@contextmanager
def replicas_not_wrapped(accelerator: Any) -> Iterator[None]:
    """For its duration, ``accelerator.prepare`` places and autocasts the model but never wraps it in DDP.

    accelerate's ``prepare_model(..., evaluation_mode=True)`` keeps device placement and the
    mixed-precision forward and skips ``DistributedDataParallel`` (which would all-reduce the raw,
    un-clipped gradients in backward). The instance attribute is removed on exit, so the class's
    method is the accelerator's again.
    """
    accelerator.prepare_model = functools.partial(type(accelerator).prepare_model, accelerator, evaluation_mode=True)
    try:
        yield
    finally:
        del accelerator.prepare_model


@contextmanager
def journal_not_reopened(optimizer: Any, ctx: DistributedContext) -> Iterator[None]:
    """On ranks > 0, loading an optimizer state reads its ledger but not its journal.

    The journal is rank 0's file. The engine itself never lets a rank > 0 WRITE it (a second writer
    would append every release again): ``LedgerKeeper.adopt`` opens a recorded journal on rank 0 only
    and ``LedgerKeeper.check_main`` refuses ``open_journal``/``save_checkpoint`` elsewhere. This also
    keeps a rank > 0 from READING it: the recorded path may be absent, or another file, on another
    node (a false "journal missing" warning, or a refusal of "another run's record"), rank 0 may be
    appending to it in ``open_journal`` at that moment, and the rank takes rank 0's ledger afterwards
    anyway (:func:`share_ledger`). ``optimizer`` is the :class:`~dpopt.private_optimizer.PrivateOptimizer`;
    its state's ``"dpopt"`` entry loses its ``"journal"`` on these ranks for the duration. A no-op on
    rank 0. ``tests/hf/test_journal_not_reopened.py``.
    """
    if ctx.is_main or optimizer is None:
        yield
        return
    load = optimizer.load_state_dict

    def without_journal(state_dict: dict) -> None:
        state = dict(state_dict)
        if isinstance(state.get("dpopt"), dict):
            state["dpopt"] = {k: v for k, v in state["dpopt"].items() if k != "journal"}
        load(state)

    optimizer.load_state_dict = without_journal
    try:
        yield
    finally:
        del optimizer.load_state_dict


def share_ledger(ledger: Any, ctx: DistributedContext) -> None:
    """Every rank's ledger becomes rank 0's (one ``broadcast_object_list``; a no-op for one process).

    After a resume rank 0's ledger is the longest record of the run (the checkpoint's, or its
    journal's when releases were made after the checkpoint); the other ranks take it, so every
    rank's ε is the same. The ledger is public (DESIGN.md: the ledger holds no private value).
    """
    if not ctx.enabled:
        return
    import torch.distributed as dist

    box = [ledger.state_dict() if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0, group=ctx.group)
    if not ctx.is_main:
        ledger.load_state_dict(box[0])


def same_on_every_rank(model: torch.nn.Module, ctx: DistributedContext) -> bool:
    """Whether every rank holds rank 0's parameters bit for bit (True for one process)."""
    from ..distributed import check_replicas

    return check_replicas([p for p in model.parameters()], ctx)


def is_sharded(model: Any) -> bool:
    """Whether ``fully_shard`` (FSDP2) was applied to ``model`` itself (its root is an ``FSDPModule``).

    Raises:
        ValueError: ``fully_shard`` applied to submodules only (the root not sharded): the root's own
            parameters (embeddings, LM head) would stay replicated beside DTensor shards, a mix the
            sharded release (:mod:`dpopt.fsdp`) does not handle and the replicated one cannot broadcast.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    if isinstance(model, FSDPModule):
        return True
    inner = (
        [n for n, m in model.named_modules() if isinstance(m, FSDPModule)] if hasattr(model, "named_modules") else []
    )
    if inner:
        shown = ", ".join(inner[:3]) + (", ..." if len(inner) > 3 else "")
        raise ValueError(
            f"fully_shard was applied to submodules of the model ({shown}) but not to the model itself: call "
            "fully_shard(model) last, after its blocks (docs/fsdp.md), or pass the unsharded model with "
            "TrainingArguments(fsdp='full_shard', fsdp_config={'fsdp_version': 2})"
        )
    return False


def agreed_chunks(count: int, ctx: DistributedContext) -> int:
    """The largest local chunk count over the ranks (``count`` for one process): one MAX all-reduce.

    A sharded model's forward and backward are collectives, so every rank runs this many chunks in
    the logical batch. The count is a function of the ranks' private batch sizes; it stays among the
    ranks (the trusted side of the release, like the clipped sums before noise) and is never
    logged, returned or written.

    Raises:
        ValueError: ``count`` < 1 (a rank always runs at least one chunk, possibly a stand-in).
    """
    if count < 1:
        raise ValueError(f"a logical batch runs at least one chunk, got {count}")
    if not ctx.enabled:
        return int(count)
    from ..distributed import backend_device

    t = torch.tensor([float(count)], dtype=torch.float64, device=backend_device(ctx))
    return int(ctx.all_reduce(t, op="max").item())


def padded(chunks: list, target: int, stand_in: Any) -> list[tuple[Any, bool]]:
    """``(chunk, real)`` pairs: the rank's ``chunks`` (real) then ``target − len(chunks)`` stand-ins (not real).

    A stand-in is one public row (:func:`dpopt.hf.batches.stand_in`) whose loss the caller multiplies
    by 0: its per-example gradient is exactly 0, so it adds exactly 0 to the clipped sum (flat
    clipping: c_i·0 = 0 for any clip factor c_i; tested against the unpadded release).

    Raises:
        ValueError: more chunks than ``target`` (the agreed count is a maximum over the ranks).
    """
    if len(chunks) > target:
        # the counts are realised (private) batch sizes in chunks: the message names the mismatch, not them
        raise ValueError("this rank has more chunks than the ranks agreed on (their maximum): the counts differ")
    return [(c, True) for c in chunks] + [(stand_in, False)] * (target - len(chunks))


def full_state_dict(model: torch.nn.Module, every_rank: bool = False) -> dict:
    """The model's full (unsharded) state dict on global rank 0, on the CPU; ``{}`` on every other rank.

    torch's ``get_model_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))``:
    each ``DTensor`` shard is all-gathered one tensor at a time and kept by rank 0 only, so no rank
    but 0 ever holds more than one full tensor. With ``every_rank`` (``save_on_each_node``: a local
    main process of another node writes its own copy) every rank keeps the whole dict. A collective
    for a sharded model: call it on every rank.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not every_rank:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
        for k, v in model.state_dict().items()
    }


def load_full_state_dict(model: torch.nn.Module, folder: str) -> None:
    """Load a checkpoint's whole model (``*.safetensors`` written by :func:`full_state_dict` + ``save_pretrained``)
    into a sharded model: every rank reads the files and keeps its own shards
    (``set_model_state_dict(..., StateDictOptions(full_state_dict=True))``). A collective.

    Raises:
        ValueError: no ``*.safetensors`` in ``folder``; a parameter or buffer of the model that the files lack
            (tied aliases such as GPT-2's ``lm_head.weight``, which ``save_pretrained`` drops, excepted), or a
            key the model does not have.
    """
    from pathlib import Path

    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors model to resume the sharded model from")
    state: dict = {}
    for f in files:
        state.update(load_file(str(f)))
    kept = set(model.state_dict().keys())
    tied = kept - {n for n, _ in model.named_parameters()} - {n for n, _ in model.named_buffers()}
    missing, unexpected = kept - set(state) - tied, set(state) - kept
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint's model does not match the sharded model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def _shard_file(folder: str, rank: int, world: int) -> str:
    import os

    return os.path.join(folder, f"optimizer-shard-{rank}-of-{world}.pt")


def save_optimizer_shards(optimizer: torch.optim.Optimizer, folder: str, rank: int, world: int) -> None:
    """This rank's part of a sharded model's optimizer state (its DTensor shards as local tensors) in
    ``folder/optimizer-shard-<rank>-of-<world>.pt``; every rank writes its own file. The state is a
    function of the released (noisy) gradients only: public."""
    from torch.distributed.tensor import DTensor

    out: dict = {}
    for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        if p in optimizer.state:
            out[i] = {
                k: ("shard", v.to_local().detach().cpu().clone()) if isinstance(v, DTensor) else ("plain", v)
                for k, v in optimizer.state[p].items()
            }
    os.makedirs(folder, exist_ok=True)  # rank 0 may not have made the checkpoint folder yet
    torch.save(out, _shard_file(folder, rank, world))


def load_optimizer_shards(optimizer: torch.optim.Optimizer, folder: str, rank: int, world: int) -> None:
    """Restore this rank's optimizer state written by :func:`save_optimizer_shards` (same world size).

    Raises:
        ValueError: the file of this rank at this world size is missing (another world size, or a checkpoint
            written before sharded resume existed).
    """
    import os

    from torch.distributed.tensor import DTensor

    path = _shard_file(folder, rank, world)
    if not os.path.isfile(path):
        raise ValueError(
            f"{path} is missing: a sharded run resumes from a checkpoint written by a sharded run on the same "
            f"number of processes ({world})"
        )
    saved = torch.load(path, map_location="cpu", weights_only=True)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, entries in saved.items():
        p = params[int(i)]
        state = {}
        for k, (kind, v) in entries.items():
            if kind == "shard":
                local = v.to(p.to_local().device)
                v = DTensor.from_local(
                    local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            state[k] = v
        optimizer.state[p] = state
