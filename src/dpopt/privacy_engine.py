"""``PrivacyEngine``: dpopt behind Opacus's ``make_private`` — bring your own model, loop and optimizer.

::

    engine = dpopt.PrivacyEngine()                       # accountant="pld" | "rdp" | "prv"
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0)
    for x, y in loader:                                   # Poisson batches (possibly empty)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()                                   # per-sample gradients captured by hooks
        opt.step()                                        # clip · sum · noise → p.grad → AdamW
    engine.get_epsilon(delta=1e-5)

What happens where (DESIGN.md, "the privacy boundary"):

* the data loader is replaced by a :class:`~dpopt.data_loader.DPDataLoader`:
  Poisson sampling at q = 1/len(data_loader) over the loader's dataset,
  len(data_loader) batches per epoch, empty batches yielded (zero-length
  tensors) so that the loop still steps; the expected batch size q·N is the
  public denominator (N is treated as public; the ledger header says so).
  Only a default loader is replaced (a ``BatchSampler`` over a sequential or
  shuffling sampler): a ``WeightedRandomSampler``, a custom ``batch_sampler``
  or sampling with replacement is refused with advice
  (:func:`~dpopt.data_loader.custom_batching`), never silently discarded;
* the model gets hooks (:class:`~dpopt.engine.hooks.HookCapture`) that turn
  the user's forward/backward into per-sample sources, with the engines'
  checks; the model object returned is the one given. The backward computes
  no weight gradient for a layer with a per-sample rule (Linear, Conv,
  LayerNorm, ...) whose input requires a gradient: its parameters leave that
  call's graph, so their ``p.grad`` stays as ``zero_grad()`` left it (None)
  until ``step()`` sets the release — the non-private gradient Opacus's
  backward forms there was dropped unread by ``step()`` (and is not private);
  the clipped sum replaces that product (issue 34). A deep copy of the model
  forms its gradients as a plain model;
* ``optimizer.step()`` hands the source to the ONE Privatizer of a dpopt
  optimizer built by :func:`dpopt.methods.make_optimizer` (it records every
  release in ``engine.ledger``). With a ``torch.optim.Optimizer`` that is
  ``dp-sgd``'s Privatizer with no post-processing of its own: the release
  (already divided by the expected batch size) becomes ``p.grad`` and the
  user's optimizer post-processes it (AdamW, momentum, LR schedulers). With a
  method name (``"dp-macadam"``, ``"dp-muon"``, ...) the method's chain runs,
  its clip geometry feedback included, and ``p.grad`` is set to the release.
  ``step()`` with no backward since ``zero_grad()`` raises (an empty batch's
  forward and backward are a release, as they must be);
* saved state carries the ledger (:mod:`dpopt.checkpoint`):
  ``optimizer.state_dict()`` holds the Privatizer's state and the engine's
  ledger, ``engine.save_checkpoint(path=, module=, optimizer=)`` /
  ``engine.load_checkpoint(...)`` hold it too and keep an append-only journal
  of every later release, so loading an older checkpoint still charges them;
  a state without a ledger is refused.

Data parallel (``distributed=True``; :mod:`dpopt.distributed`): run the same
script on every rank (``torchrun --nproc_per_node W script.py``), after
``torch.distributed.init_process_group`` — gloo on CPU, NCCL on GPUs::

    model, opt, loader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                             noise_multiplier=1.0, max_grad_norm=1.0, distributed=True)
    ...                                                   # the same loop on every rank
    if torch.distributed.get_rank() == 0:
        engine.ledger.save("ledger.json")                 # every rank's ledger is the same

``make_private`` broadcasts rank 0's parameters and buffers; each rank's
loader draws ITS shard of the dataset at q = 1/len(data_loader) (the union
over ranks is a Poisson sample of the whole dataset at q, Opacus's
``DistributedPoissonBatchSampler``); ``opt.step()`` adds the noise once (rank
0) and all-reduces the clipped sums, so every rank applies the same update;
``expected_batch_size`` q·N is the global one and every rank's ledger records
each step once (``get_epsilon`` is that of the one-process run). Pass the bare
module: a ``DistributedDataParallel`` (or Opacus ``DPDDP``) is refused — it
would all-reduce the un-clipped gradients. ``poisson_sampling=False`` is
refused; settings that differ between ranks (or a refusal on one rank) make
every rank raise.

Opacus names kept: ``make_private(module=, optimizer=, data_loader=,
noise_multiplier=, max_grad_norm=, poisson_sampling=, clipping=,
loss_reduction=, noise_generator=)``, ``make_private_with_epsilon(...,
target_epsilon=, target_delta=, epochs=)``, ``get_epsilon(delta)``,
``clipping="flat" | "per_layer" | "adaptive"`` (per_layer: one bound per
parameter, as Opacus; adaptive: quantile clipping with
``target_unclipped_quantile``, ``clipbound_learning_rate`` and
``unclipped_num_std``), ``p.grad_sample`` read where present.
Differences: noise is secret by default and ``secure_mode`` uses the OS
CSPRNG (:mod:`dpopt.noise`); adaptive clipping is charged (the count release
shares the budget: the total σ stays ``noise_multiplier``); methods whose
gradients are evaluated at other points than θ (DiSK) are refused — the
engine never sees the loss, so it cannot evaluate one — use dpopt's own loop
(:func:`dpopt.train`, or ``iter_per_sample_sources`` with
``opt.evaluation_points()``).
"""

from __future__ import annotations

import math
import os
import secrets
import sys
import warnings
import weakref
import zlib
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union, cast

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from . import engine_checkpoint, fsdp
from .accounting.accountant import epsilon
from .accounting.budget import DEFAULT_COUNT_SHARE, split_budget, split_for_count_noise
from .accounting.calibration import (
    AMPLIFICATION_CHECK_DELTA,
    calibrate_amplified_noise_multiplier,
    calibrate_noise_multiplier,
    warn_if_amplification_costs,
)
from .accounting.ledger import PrivacyLedger
from .accounting.opacus_accountant import LedgerAccountant
from .accounting.validation import check_delta
from .augment import ViewCollate, check_multiplicity, resolve_augmentation
from .checkpoint import LedgerKeeper
from .correlated_noise import CorrelatedNoise, Participation, make_mechanism, optimize_strategy, parse_mechanism
from .correlated_noise import calibrate_noise_multiplier as calibrate_mechanism_noise
from .cyclic_batches import CyclicBatchSampler, CyclicLoader, CyclicPoissonLoader, cyclic_poisson_partitions
from .data_loader import DPDataLoader, custom_batching, loader_settings
from .distributed import (
    DistributedContext,
    any_rank,
    attach,
    backend_device,
    broadcast_parameters,
    check_replicas,
    context,
)
from .engine.collate_check import probe_loader
from .engine.compiled import compile_backend
from .engine.hooks import LOSS_REDUCTIONS, HookCapture
from .errors import ConfigError
from .methods import get_method, make_optimizer
from .module_validator import ModuleValidator
from .noise import NoiseSource
from .opacus_compat import LossReductionWatch, TargetWatch, alias_module, check_opacus_arguments, warn_drop_last
from .optim import is_frozen
from .private_optimizer import PrivateOptimizer
from .privatizer import QuantileClipping
from .release_boundary import boundary_of
from .transforms.base import Chain, Partition, Transform
from .users import DEFAULT_MAX_RECORDS_PER_USER, check_privacy_unit

__all__ = ["PrivacyEngine", "PrivateOptimizer", "CLIPPING", "check_sampling"]

CLIPPING = ("flat", "per_layer", "adaptive", "auto")  # auto: AUTO-S (dpopt.auto_clipping)
_LOW_PRECISION = (torch.bfloat16, torch.float16)  # parameter dtypes whose mean-loss backward rounds ∂ℓ_i/B


def _declares_points(t: Transform) -> bool:
    """Does a chain evaluate gradients away from θ (DiSK-type evaluation points)?"""
    if isinstance(t, Chain):
        return any(_declares_points(s) for s in t.transforms)
    if isinstance(t, Partition):
        return any(_declares_points(s) for s in t.transforms.values())
    return type(t).evaluation_points is not Transform.evaluation_points


def _frames_here() -> int:
    """The stacklevel of the first frame outside this module (the user's ``make_private`` or
    ``make_private_with_epsilon`` call), counted from the caller of :func:`warnings.warn`."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


def _warn_low_precision_mean(module: nn.Module, loss_reduction: str) -> None:
    """Warn once when a trainable parameter is bf16/fp16 and ``loss_reduction="mean"``.

    The hook door recovers e_i = B · grad_output_i from the user's backward of (1/B) Σ_i ℓ_i; in a 16-bit
    backward ∂ℓ_i/B is rounded at a scale that depends on the realised B, so removing one example also moves
    the other examples' g_i and the σ = 0 sum moves by up to ≈ 1.002·C (docs/pitfalls.md item 19,
    ``tests/engine/test_bf16_weights.py``). With ``"sum"`` the backward is B-independent (e_i = grad_output_i).
    """
    if loss_reduction != "mean":
        return
    low = sorted({str(p.dtype) for p in module.parameters() if p.requires_grad and p.dtype in _LOW_PRECISION})
    if not low:
        return
    warnings.warn(
        f"make_private: trainable parameters in {', '.join(low)} with loss_reduction='mean': your backward "
        "rounds each example's loss gradient (1/B)·∂ℓ_i at a scale that depends on the batch size B, so the "
        "clip bound C holds only up to that rounding (removing one example moved the sigma=0 sum by up to "
        '1.002·C in bf16). For a bound exact to float32 rounding pass loss_reduction="sum" and backpropagate '
        "the loss summed over the batch (e.g. cross_entropy(..., reduction='sum')), not divided by B: the "
        "release is divided by the expected batch size either way, so the step is the same. "
        "See docs/pitfalls.md, item 19",
        UserWarning,
        stacklevel=_frames_here(),
    )


def _is_ddp(module: nn.Module) -> bool:
    """torch's DistributedDataParallel or Opacus's DPDDP (by name: Opacus need not be installed)."""
    return (
        isinstance(module, nn.parallel.DistributedDataParallel)
        or type(module).__name__ == "DifferentiallyPrivateDistributedDataParallel"
    )


def _loader_with_views(loader: DataLoader, k: int, fn: Callable) -> DataLoader:
    """``loader`` whose batches are the example-major views of its examples (:class:`ViewCollate`).

    dpopt's own Poisson loader (made by ``make_private``) gets the wrapped ``collate_fn`` in place;
    a user's loader (``poisson_sampling=False``) is never modified: a new loader over the same batch
    sampler is returned."""
    collate = ViewCollate(loader.collate_fn, k, fn)
    if isinstance(loader, DPDataLoader):
        loader.collate_fn = collate
        return loader
    return DataLoader(
        loader.dataset,
        batch_sampler=loader.batch_sampler,
        collate_fn=collate,
        **loader_settings(loader, generator=True),
    )


def _check_unit_arguments(
    unit: Any,
    user_ids: Any,
    sample_rate: Optional[float],
    distributed: Any,
    poisson_sampling: bool,
    mech_kind: str = "independent",
) -> str:
    """``privacy_unit`` and the arguments that go with it (:mod:`dpopt.users`), checked together.

    Raises:
        ValueError: an unknown unit; ``user_ids`` missing with "user" or given without it;
            ``sample_rate`` without "user" or ``sampling="cyclic-poisson"`` (with a correlated ``mech_kind``
            the message suggests ``sampling="cyclic-poisson"``); "user" with ``distributed="fsdp"`` or
            ``poisson_sampling=False``.
    """
    unit = check_privacy_unit(unit)
    if unit != "user":
        if user_ids is not None:
            raise ValueError("user_ids are read only with privacy_unit='user' (user-level DP); pass both or neither")
        if sample_rate is not None:
            hint = (
                "; for amplified accounting of this noise_mechanism pass sampling='cyclic-poisson' with it"
                if mech_kind != "independent"
                else ""
            )
            raise ValueError(
                "sample_rate is read only with privacy_unit='user' or sampling='cyclic-poisson' "
                f"(q = 1/len(data_loader) otherwise){hint}"
            )
        return unit
    if user_ids is None:
        raise ValueError("privacy_unit='user' needs user_ids=: one user id per record of the loader's dataset")
    if not poisson_sampling:
        raise ValueError("privacy_unit='user' samples users by Poisson sampling; poisson_sampling=False is refused")
    return unit


def _distributed_context(
    module: nn.Module, distributed: Union[bool, str], process_group: Any, poisson_sampling: bool
) -> DistributedContext:
    """The data-parallel context ``make_private`` asked for (one process unless ``distributed``), or a refusal."""
    if _is_ddp(module):
        raise ValueError(
            f"make_private got a {type(module).__name__}: pass the bare module (`ddp.module`) with "
            "distributed=True instead. DDP would all-reduce the raw, un-clipped gradients in "
            "backward; dpopt all-reduces the clipped per-sample sums itself, with the noise drawn once"
        )
    if not distributed and process_group is None:
        return DistributedContext()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "distributed=True needs an initialised process group: call "
            "torch.distributed.init_process_group on every rank first (torchrun sets the environment)"
        )
    ctx = context(process_group)
    if ctx.enabled and not poisson_sampling:
        raise ValueError(
            "poisson_sampling=False is not supported with distributed=True: the loader's own batches "
            "on each rank are not known to be disjoint (a DistributedSampler pads with repeated "
            "examples), so one example could be in several ranks' sums (sensitivity > C)"
        )
    return ctx


def _join_ranks(ctx: DistributedContext, error: Optional[Exception], public: Callable[[], list]) -> None:
    """Every rank raises if ``make_private`` failed on some rank or the ranks' public settings differ.

    Two small collectives: a failure flag, then a fingerprint of ``public()``
    (q, N, steps, σ, C, parameter sizes, method, clipping, loss reduction,
    noise mode) compared with rank 0's.
    """
    if any_rank(error is not None, ctx):
        if error is not None:
            raise error
        raise RuntimeError("make_private was refused on another rank (its error is reported there)")
    fingerprint = torch.tensor(
        [float(zlib.crc32(repr(public()).encode()))], dtype=torch.float64, device=backend_device(ctx)
    )
    if not check_replicas([fingerprint], ctx):
        raise ValueError(
            "make_private was called with different settings on different ranks: every rank needs "
            "the same len(data_loader) and len(dataset), noise_multiplier, max_grad_norm, model "
            "parameters, optimizer (method), clipping, loss_reduction and noise (noise_generator on "
            "every rank or on none)"
        )


def _distributed_sampler(data_loader: DataLoader) -> bool:
    """A torch ``DistributedSampler`` under a plain ``BatchSampler`` (data parallel: replaced by the sharded
    Poisson sampler at q = 1/len(loader), as Opacus's ``DPDataLoader`` does)."""
    from torch.utils.data import BatchSampler
    from torch.utils.data.distributed import DistributedSampler

    bs = data_loader.batch_sampler
    return type(bs) is BatchSampler and type(bs.sampler) is DistributedSampler


def _refuse_custom_batching(data_loader: DataLoader, ctx: DistributedContext, sampling: str) -> None:
    """Refuse a loader whose batching the correlated-noise sampler would silently replace (as Poisson sampling
    refuses it): a ``SubsetRandomSampler`` (the cyclic batches would cover the WHOLE dataset, held-out examples
    included), a ``WeightedRandomSampler``, a custom ``batch_sampler`` (:func:`~dpopt.data_loader.custom_batching`;
    a torch ``DistributedSampler`` under data parallel is allowed: every rank takes its slice of each batch).

    Raises:
        ValueError: such a loader; the message names what it does and what to pass instead.
    """
    custom = custom_batching(data_loader)
    if custom is not None and not (ctx.enabled and _distributed_sampler(data_loader)):
        raise ValueError(
            f"make_private: the data loader forms its batches with {custom}, which the {sampling} of a "
            "correlated noise_mechanism would silently replace (over the WHOLE dataset: a subset sampler's "
            "excluded examples would be trained on). Give a plain DataLoader(dataset, batch_size=B) over exactly "
            "the examples to train on (e.g. torch.utils.data.Subset(dataset, indices))"
        )


def _cyclic_loader(data_loader: DataLoader, ctx: DistributedContext) -> tuple[int, int, DataLoader]:
    """(N, b, a :class:`~dpopt.cyclic_batches.CyclicLoader` of b cyclic batches over the loader's dataset; its
    collate and worker settings kept). Balls-in-bins batches (each example in one of b batches, i.i.d.
    uniform): sizes are random and private, an empty batch still releases (noise only).

    Data parallel (``ctx``): every rank draws rank 0's assignment (its secret seed is broadcast, never saved)
    and yields its own slice of each batch, so the ranks' slices of step t are disjoint and make up batch t."""
    dataset = data_loader.dataset
    if not hasattr(dataset, "__len__"):
        raise ValueError("make_private needs a map-style dataset with __len__ (N is the public dataset size)")
    n, b = len(dataset), len(data_loader)
    keep = loader_settings(data_loader)
    sampler = CyclicBatchSampler(n, b, seed=_partition_seed(ctx), rank=ctx.rank, world_size=ctx.world_size)
    collate = data_loader.collate_fn
    if collate is default_collate or getattr(collate, "__name__", "") == "default_collate":
        collate = None  # type: ignore[assignment]
    return n, b, CyclicLoader(dataset, sampler, collate_fn=collate, **keep)


def _partition_seed(ctx: DistributedContext) -> int:
    """A fresh secret seed of the cyclic (or cyclic Poisson) balls-in-bins assignment (:mod:`secrets`; held in
    memory only, never saved or logged), rank 0's on every rank so that all ranks draw the same assignment.
    A collective under ``ctx``."""
    device = backend_device(ctx) if ctx.enabled else "cpu"
    seed = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=device)
    broadcast_parameters([seed], ctx)
    return int(seed.item())


def _release_clock(optimizer: Any) -> Callable[[], Optional[int]]:
    """The clock of a cyclic sampler (:func:`dpopt.cyclic_batches._seek`): forgets a batch handed out and never
    stepped (the new pass hands it out again, :meth:`~dpopt.release_boundary.ReleaseBoundary.settle`), then
    returns the releases ``optimizer`` has made, the step of the next one (None once the optimizer is gone).
    Holds the optimizer weakly."""
    ref = weakref.ref(optimizer)

    def clock() -> Optional[int]:
        opt = ref()
        if opt is None:
            return None
        boundary_of(opt).settle()
        return int(opt.privatizer.steps)

    return clock


def horizon_steps(epochs: float, batches: int) -> int:
    """The horizon T of correlated noise (and the steps ``make_private_with_epsilon`` calibrates for):
    T = ⌈``epochs`` · ``batches``⌉, at least 1 — a fractional epoch is planned in full, never truncated
    (1.5 epochs of 4 batches: 6 steps; 0.99 epochs: 4 steps). The one rule of ``make_private`` and
    ``make_private_with_epsilon``; the 1e-9 absorbs float error (3 × 0.1 epochs of 10 batches: 3 steps).

    Args:
        epochs: the number of passes over the loader (a finite number > 0, fractions allowed).
        batches: the loader's batches per epoch, ``len(data_loader)`` (>= 1).
    """
    return max(1, math.ceil(float(epochs) * batches - 1e-9))


def _mechanism(
    spec: str,
    noise_multiplier: float,
    batches: int,
    epochs: Optional[float],
    total_steps: Optional[int],
    partitions: int = 0,
    sample_rate: Optional[float] = None,
    delta: float = AMPLIFICATION_CHECK_DELTA,
) -> CorrelatedNoise:
    """The correlated-noise mechanism for cyclic batches: T = epochs·b (or total_steps), k = ⌈T/b⌉
    participations b steps apart; cyclic Poisson (``partitions`` b' > 0, ``sample_rate`` q): at most
    ⌈T/b'⌉ participations b' steps apart, amplified events — warned when they score a larger ε at ``delta``
    than the unamplified ones (:func:`~dpopt.accounting.calibration.warn_if_amplification_costs`)."""
    steps = int(total_steps) if total_steps is not None else horizon_steps(cast(float, epochs), batches)
    if steps < 1:
        raise ConfigError(f"the horizon must be >= 1 step, got epochs={epochs}, total_steps={total_steps}", "epochs")
    sep = partitions or batches
    participation = Participation(steps, -(-steps // sep), sep)
    try:
        mech = make_mechanism(spec, noise_multiplier, participation, sample_rate)
    except ValueError as exc:
        raise ConfigError(str(exc), "noise_mechanism", "sampling") from None
    assert mech is not None  # not "independent": checked by _check_mechanism_options
    if mech.sample_rate is not None:
        warn_if_amplification_costs(mech.strategy, steps, batches, sep, mech.sample_rate, noise_multiplier, delta)
    return mech


def check_sampling(sampling: Optional[str], kind: str, spec: str, sample_rate: Optional[float], batches: int) -> int:
    """The number of partitions b' of cyclic Poisson sampling (0 for cyclic batches / independent noise).

    The one rule of ``make_private``, ``make_private_with_epsilon`` and ``DPTrainer`` (Choquette-Choo et al.
    2023, arXiv 2306.08153, Sec. 4): b' = round(q · ``batches``) parts.

    Args:
        sampling: None, ``"cyclic"`` or ``"cyclic-poisson"``.
        kind, spec: the noise mechanism's kind (``"banded"``, ``"blt"``, ``"independent"``) and its spec string.
        sample_rate: q, the rate within a part (required for ``"cyclic-poisson"``).
        batches: L, the steps of one epoch (the loader's length).

    Raises:
        ConfigError: an unknown sampling, or one without a valid accountant
            (:func:`~dpopt.correlated_noise.check_amplified`).
    """
    if sampling is None:
        return 0
    if sampling not in ("cyclic", "cyclic-poisson"):
        raise ConfigError(f"sampling must be 'cyclic' or 'cyclic-poisson', got {sampling!r}", "sampling")
    if kind == "independent":
        raise ConfigError(
            "sampling= chooses the sampling of correlated noise; independent noise is Poisson-sampled "
            "(poisson_sampling=True): drop sampling= or set noise_mechanism",
            "sampling",
        )
    if sampling == "cyclic":
        return 0
    if sample_rate is None or not 0.0 < float(sample_rate) <= 1.0:
        raise ConfigError(
            f"sampling='cyclic-poisson' needs sample_rate=q in (0, 1] (the rate within a part), got {sample_rate!r}",
            "sample_rate",
        )
    parts = cyclic_poisson_partitions(sample_rate, batches)
    if parts < 1:
        raise ConfigError(
            f"sampling='cyclic-poisson': b' = round(sample_rate × len(data_loader)) = round({sample_rate} × "
            f"{batches}) is 0 partitions; raise sample_rate to at least {0.5 / batches:.3g}",
            "sample_rate",
        )
    return parts


def _trained_parameters(
    optimizer: Any, module: nn.Module, capture: HookCapture, hparams: dict
) -> tuple[list, str, dict]:
    """(parameters, method name, method hyperparameters) of ``make_private``'s ``optimizer`` argument.

    Raises:
        TypeError: neither a torch optimizer nor a method name.
        ConfigError: an unknown method name.
        ValueError: the optimizer does not train exactly the model's trainable parameters.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        params = [p for g in optimizer.param_groups for p in g["params"] if not is_frozen(p)]
        method, overrides = "dp-sgd", {}
    elif isinstance(optimizer, str):
        params = [p for p in module.parameters() if p.requires_grad]
        method, overrides = optimizer, dict(hparams)
        get_method(method)  # unknown names: ConfigError listing the methods
    else:
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or a dpopt method name, got {type(optimizer).__name__}"
        )
    if {id(p) for p in params} != {id(p) for p in capture.params}:
        raise ValueError(
            "the optimizer must train exactly the model's trainable parameters (freeze the others "
            "with requires_grad_(False)); per-sample gradients are clipped over all of them"
        )
    return params, method, overrides


class _WatchRefs(list):
    """Weak references to an engine's :class:`~dpopt.opacus_compat.LossReductionWatch` objects (each owned by
    its optimizer). A copy or pickle of the engine starts with none: the watches, and their hooks, belong to
    the original's optimizers (whose copies carry no watch either)."""

    def __deepcopy__(self, memo: dict) -> "_WatchRefs":
        return _WatchRefs()

    def __reduce__(self) -> tuple:
        return (_WatchRefs, ())


class PrivacyEngine:
    """Opacus-compatible entry point: make a model, optimizer and data loader private.

    Args:
        accountant: ``"pld"`` (default), ``"rdp"`` or ``"prv"``: the accountant
            of :meth:`get_epsilon` and of ε calibration.
        secure_mode: draw the noise and the Poisson masks from the OS CSPRNG
            (:mod:`dpopt.noise`); by default they come from a secret
            generator seeded from OS entropy and never written.

    Attributes:
        ledger: the :class:`~dpopt.accounting.ledger.PrivacyLedger` of every
            release of every optimizer this engine made private
            (``engine.ledger.save(path)``; ``dpopt ledger check`` reads it).
        accountant: Opacus's accountant interface over :attr:`ledger`
            (:class:`~dpopt.accounting.opacus_accountant.LedgerAccountant`:
            ``get_epsilon(delta)``, ``history``, ``len``, ``mechanism()``,
            ``state_dict()``); ``str(accountant)`` is its name.

    Raises:
        ValueError: unknown accountant; Opacus's ``"gdp"`` (an approximation, not a bound).
    """

    def __init__(self, accountant: str = "pld", secure_mode: bool = False):
        self.secure_mode = bool(secure_mode)
        self.ledger = PrivacyLedger(dataset_size="public")
        # Opacus's accountant interface, reading self.ledger (whichever ledger the engine holds now)
        self.accountant = LedgerAccountant(self, accountant)
        self.noise = NoiseSource("secure" if self.secure_mode else "secret")
        self._captures: list[HookCapture] = []
        self._loss_watches = _WatchRefs()  # the first-batch loss checks still hooked (detach removes them)
        self._keeper = LedgerKeeper(self.ledger)  # saved ledgers come in here; the journal

    # -- the Opacus API -------------------------------------------------------------
    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: Union[torch.optim.Optimizer, str],
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: Union[float, Sequence[float]],
        poisson_sampling: bool = True,
        clipping: str = "flat",
        loss_reduction: str = "mean",
        noise_generator: Optional[torch.Generator] = None,
        target_unclipped_quantile: float = 0.5,
        clipbound_learning_rate: float = 0.2,
        unclipped_num_std: Optional[float] = None,
        count_share: Optional[float] = None,
        distributed: Union[bool, str] = False,
        process_group: Optional[Any] = None,
        criterion: Optional[Callable] = None,
        batch_first: bool = True,
        grad_sample_mode: str = "hooks",
        max_clipbound: float = math.inf,
        min_clipbound: float = 0.0,
        secure_mode: Optional[bool] = None,
        augmentation_multiplicity: int = 1,
        augmentation: Optional[Union[str, Callable]] = None,
        clipping_gamma: float = 0.01,
        privacy_unit: str = "record",
        user_ids: Optional[Sequence[Any]] = None,
        max_records_per_user: int = DEFAULT_MAX_RECORDS_PER_USER,
        sample_rate: Optional[float] = None,
        noise_mechanism: str = "independent",
        epochs: Optional[float] = None,
        total_steps: Optional[int] = None,
        sampling: Optional[str] = None,
        delta: Optional[float] = None,
        compile: Union[bool, str] = False,
        cache_bytes: Optional[int] = None,
        norm_form: Optional[str] = None,
        **hparams: Any,
    ) -> tuple:
        """Return ``(module, optimizer, data_loader)`` whose ordinary training loop is DP.

        Args:
            module: the model (hooks are attached to it; it is returned as is).
                Refused: BatchNorm, InstanceNorm with running statistics,
                ``max_norm``/sparse embeddings (see :func:`dpopt.validate` and
                :func:`dpopt.fix`).
            optimizer: a ``torch.optim.Optimizer`` over the model's trainable
                parameters (any: AdamW, SGD with momentum, ...), or a dpopt
                method name (``"dp-adam"``, ``"dp-macadam"``, ...; not DiSK),
                built over the model's trainable parameters with ``**hparams``
                (``lr``, ``betas``, ``weight_decay``, ...).
            data_loader: a ``DataLoader`` over a map-style dataset; q =
                1/len(data_loader), N = len(dataset), expected batch size q·N.
            noise_multiplier: σ (for ``clipping="adaptive"``: the total σ,
                split between the gradient and the count releases).
            max_grad_norm: C; for ``"per_layer"`` one bound per trainable
                parameter (Opacus) or a total C split as C/√P each; for
                ``"adaptive"`` the initial bound.
            poisson_sampling: False keeps the loader's own batches: the
                accountant's ε then does not apply (warned; recorded in the ledger).
            clipping: ``"flat"``, ``"per_layer"``, ``"adaptive"`` or ``"auto"`` (AUTO-S, Bu et al.
                2023: each example's gradient becomes C·g/(‖g‖ + γ), γ = ``clipping_gamma``;
                sensitivity C = ``max_grad_norm``; :mod:`dpopt.auto_clipping`).
            clipping_gamma: γ of ``clipping="auto"`` (0.01, the paper's).
            loss_reduction: ``"mean"`` (the loss averages the per-example losses
                of the batch) or ``"sum"``. It must describe the loss: a torch
                loss module with ``reduction="sum"``/``"none"`` on the model's
                output is checked on the first batch (a mismatch raises at
                ``step()``: :class:`~dpopt.opacus_compat.LossReductionWatch`);
                a functional or hand-written loss cannot be checked. With bf16/fp16
                trainable parameters ``"mean"`` warns (UserWarning): the clip bound then holds
                only up to the 16-bit rounding of ∂ℓ_i/B in your backward; ``"sum"`` is exact
                (docs/pitfalls.md item 19).
            noise_generator: a seeded generator: REPRODUCIBLE noise and masks
                (research reruns only; recorded in the ledger, failed by ``dpopt check``).
            target_unclipped_quantile, clipbound_learning_rate: adaptive
                clipping's γ and η_C (Andrew et al. 2021).
            unclipped_num_std: adaptive clipping's count noise std σ_b (the
                gradient σ is raised so the step still costs ``noise_multiplier``;
                refused where impossible), else ``count_share`` r of the budget
                (default 0.05).
            distributed: data parallel over an initialised ``torch.distributed``
                process group (module docstring): call ``make_private`` on every
                rank with the same arguments and the bare module (not
                ``DistributedDataParallel``); the loader draws this rank's shard
                at q, ``optimizer.step()`` all-reduces the clipped sums with the
                noise drawn once (rank 0), rank 0's parameters and buffers are
                broadcast now. Save the ledger on rank 0 only. ``"fsdp"``: a
                model sharded with FSDP2's ``fully_shard`` and a torch optimizer
                over its sharded parameters (:mod:`dpopt.fsdp`: norms per
                example over every layer, one reduce-scatter of the clipped
                sums, noise once per coordinate by its owner; its refusals
                are listed there).
            process_group: the group to train over (default: the default
                group); implies ``distributed``.
            criterion, batch_first, grad_sample_mode, max_clipbound,
                min_clipbound, secure_mode: Opacus's arguments, mapped onto
                dpopt's one engine or refused with advice
                (:mod:`dpopt.opacus_compat`); ``grad_sample_mode="ghost"``
                returns ``(module, optimizer, criterion, data_loader)``.
            augmentation_multiplicity: K ≥ 1 views per example (De et al. 2022;
                docs/recipe.md). The loop forwards, in ONE forward pass per
                step, B·K example-major rows — rows i·K … i·K + K − 1 the K
                views of example i, e.g. ``dpopt.augment.repeat_views(x, K, fn)``
                with labels ``y.repeat_interleave(K)``; example i's gradient is
                the mean over its views, clipped once (sensitivity C, the same
                ε as K = 1), and ``loss_reduction="mean"`` is the mean over the
                B·K rows (= over the B examples of their view means; ``"sum"``:
                the sum over the examples of their view means, i.e. the sum over
                the rows divided by K). The layout is the user's contract and
                is NOT checked beyond the row count: batch-major rows
                (``x.repeat(K, 1, 1, 1)``, ``y.repeat(K)``) have the same count
                but put K different examples in each clipped group, so one
                example reaches K groups and the sensitivity is K·C, not C.
                The data
                loader yields examples (q, N and the expected batch size count
                examples); BatchMemoryManager chunks are of examples, each with
                all its views. A step whose rows / K differ from the examples
                of the Poisson loader's last batch (views not repeated) is
                refused with a ValueError before anything is released. Not
                with ``distributed="fsdp"``. Give ``augmentation`` to have the
                returned loader build the rows itself (recommended: the layout
                is then right by construction).
            augmentation: ``None`` (the loop builds the views), a name
                (``"crop-flip"``, ``"flip"``; :data:`dpopt.augment.AUGMENTATIONS`)
                or ``fn(rows [B·K, ...], generator) -> rows`` (called with
                ``generator=None``: torch's default generator; augmentation
                draws protect nothing). The returned data loader then yields
                each batch of B examples as B·K example-major rows: the first
                element of the batch through ``fn`` after
                ``repeat_interleave(K)``, every other element (labels, ...)
                repeated the same way (:class:`dpopt.augment.ViewCollate`, a
                wrapper of the loader's ``collate_fn``; batches must be a tensor
                or a tuple/list of tensors). Its sampler still draws examples,
                and BatchMemoryManager still splits examples, so every chunk
                has whole examples with all their views. With K = 1: one
                augmented view per example.
            privacy_unit: what one protected unit is (docs/privacy-unit.md): ``"record"`` (default: one
                example of the dataset), ``"user"`` (user-level DP, :mod:`dpopt.users`: users are
                Poisson-sampled at q_user, each sampled user contributes at most
                ``max_records_per_user`` of its records chosen at random, and the MEAN of those records'
                gradients is clipped to ``max_grad_norm`` as one unit; ε is per user, at q_user; the
                expected batch size is q_user · N_users users; with ``distributed`` each rank samples its
                contiguous shard of the users: the union is one user-level Poisson sample) or ``"block"``
                (each example is a packed block of text: recorded in the ledger header, warned: it protects a
                block, not a record).
            user_ids: with ``privacy_unit="user"``: one user id per record of ``data_loader.dataset``
                (ints or strs; a list, tensor or array). N_users, the number of distinct ids, is treated
                as public (the ledger header records it), like N for record-level DP.
            max_records_per_user: k ≥ 1 (default :data:`DEFAULT_MAX_RECORDS_PER_USER`): the records
                a sampled user contributes at most (chosen uniformly at random from the secret stream,
                never by content). Public; it bounds compute, not privacy (the user's mean is clipped).
            sample_rate: with ``privacy_unit="user"``: q_user (default 1/len(data_loader), Opacus's
                rule applied to users: len(data_loader) steps per epoch); then round(1/q_user) steps per epoch.
            noise_mechanism: ``"independent"`` (default: fresh Gaussian noise every step), or correlated
                noise across steps (DP matrix factorization, :mod:`dpopt.correlated_noise`,
                docs/correlated-noise.md): ``"banded:B"`` (B bands) or ``"blt"`` / ``"blt:N"`` (N buffers).
                The returned loader then yields CYCLIC batches (:class:`~dpopt.cyclic_batches.
                CyclicBatchSampler`: one fixed balls-in-bins assignment of each example to one of len(data_loader)
                batches (sizes Binomial(N, 1/b), possibly empty; arXiv 2410.06266), in a fixed order,
                so an example takes part every len(data_loader) steps), the strategy is optimised for the
                horizon, and ε is that of one Gaussian at the strategy's sensitivity (no amplification;
                see ``sampling`` for the amplified form). ``distributed=True``: each rank its slice of every
                cyclic batch, the stream added once (rank 0); ``distributed="fsdp"``: each rank its slice
                of every cyclic batch, and the stream of the coordinates it owns (its shard's state only,
                :class:`dpopt.fsdp.ShardedRelease`). Needs ``epochs`` or ``total_steps``; refused
                with ``poisson_sampling=False``, adaptive clipping or a noise_multiplier of 0; a release past the horizon raises; resuming from a checkpoint is
                refused.
            epochs, total_steps: the horizon T of correlated noise (T = ⌈epochs × len(data_loader)⌉,
                :func:`horizon_steps`, as ``make_private_with_epsilon``; or total_steps); refused with
                independent noise (they change nothing there).
            sampling: correlated noise only: ``"cyclic"`` (default, unamplified) or ``"cyclic-poisson"``
                (amplified MF): with ``sample_rate=q`` the data are split once into b' = round(q·len(data_loader))
                parts and step t Poisson-samples part t mod b' at rate q (:class:`~dpopt.cyclic_batches.
                CyclicPoissonLoader`; expected batch q·N/b' ≈ the loader's batch size); ε is k = ⌈T/b'⌉
                rounds of the Poisson-sampled Gaussian at σ/s: s = ‖c‖ for banded:B with B ≤ b'
                (Choquette-Choo et al. arXiv 2306.08153, Thm 4), s = √λ_max(UᵀU) for BLT or B > b' (the
                spectral bound, :mod:`dpopt.accounting.sampled_matrix_mechanism`; T ≤ 2048).
                ``distributed=True`` / ``"fsdp"``: every rank cuts rank 0's partition and Poisson-samples its
                own slice of part t mod b' at q (each example lives on one rank), so the union over ranks is
                one cyclic Poisson sample; the noise as above.
            delta: the δ at which this run's ε will be read, if known (0 < δ < 1): recorded in the ledger
                header (``dpopt ledger FILE`` scores at it) and the δ at which cyclic-Poisson amplification is
                compared with cyclic batches (:func:`~dpopt.accounting.calibration.warn_if_amplification_costs`).
                None: the δ a door already gave the engine (``make_private_with_epsilon``'s ``target_delta``,
                ``DPTrainer``'s ``delta``), else that comparison runs at
                :data:`~dpopt.accounting.calibration.AMPLIFICATION_CHECK_DELTA` = 1e-5 (it only decides whether
                to warn; no ε is computed for the run or recorded at it).
            compile: ``True`` (backend ``"inductor"``), a backend name in
                :data:`~dpopt.engine.compiled.COMPILE_BACKENDS` (``"aot_eager"``: fast to compile), or False:
                your ``model(x)`` (one positional tensor, ≥ 2 rows, gradients on) runs the model's forward
                as ONE ``torch.compile`` graph with taps on the recorded layers, and your
                ``loss.backward()`` runs its compiled backward to the layer outputs
                (:class:`~dpopt.engine.compiled.CompiledForward`); the norms, clipped sums and noise stay
                eager. The first-batch check runs on that compiled path against single-example eager
                autograd, and again on the first pass after any new graph compiles (a new input shape,
                dtype, mode); a disagreement refuses. The parameters enter the graph detached: ``p.grad``
                is not formed by your backward (the optimizer's step uses the clipped sum). Other calls
                (one row, keywords, ``no_grad``) run eagerly with the ordinary hooks. Refused: models the
                compiled capture cannot take (data-dependent control flow, MultiheadAttention / LSTM,
                layers without a per-sample rule, ``transformers`` models, dropout in train mode),
                ``distributed="fsdp"`` and ``augmentation_multiplicity`` > 1. A first-step check that refuses
                the compiled path ("with compile=...") restores the model's forward and hooks; every later
                ``step()`` raises it again: make it private again without ``compile=``. On this project's 2-core CPU it is not faster than
                eager (docs/performance.md, "torch.compile").
            cache_bytes: bytes of per-example weight gradients the capture may keep between the norms
                and the clipped sum (per step, all layers together): None (default) derives them from
                the model and batch (≈ 10 % of what the non-private step holds,
                :func:`dpopt.engine.layers.derived_cache_bytes`); 0 never caches (least memory); more
                trades memory for speed.
            norm_form: None (default): the capture's cost model chooses each layer's per-example norm
                form; ``"gram"``, ``"chol"`` or ``"direct"`` forces that form wherever it applies
                (:attr:`dpopt.engine.layers.Budget.norm_form`; for tests and measurements: the forms
                agree up to rounding).
            **hparams: hyperparameters of a dpopt method name.

        Raises:
            TypeError: ``module`` not an ``nn.Module``, ``data_loader`` not a ``DataLoader``, an
                ``optimizer`` that is neither a torch optimizer nor a method name.
            ValueError: unknown clipping / loss_reduction, a refused layer, an
                iterable dataset, a DiSK-type method, hyperparameters given
                with a torch optimizer, an optimizer over other parameters
                than the model's trainable ones; a ``DistributedDataParallel``
                module; ``distributed`` without an initialised process group,
                with ``poisson_sampling=False``, or with settings that differ
                between ranks (every rank raises).
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be the torch.nn.Module to train, got {type(module).__name__}")
        compile_backend(compile)  # an unknown backend name: ValueError before anything is attached
        if not isinstance(data_loader, DataLoader):
            raise TypeError(
                f"data_loader must be a torch.utils.data.DataLoader over the private dataset (make_private "
                f"returns its Poisson-sampled replacement), got {type(data_loader).__name__}"
            )
        if clipping not in CLIPPING:
            raise ValueError(f"clipping must be one of {CLIPPING}, got {clipping!r}")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        _warn_low_precision_mean(module, loss_reduction)
        if isinstance(optimizer, torch.optim.Optimizer) and hparams:
            raise TypeError(
                f"make_private() got unexpected arguments {sorted(hparams)} with a torch optimizer: "
                "extra keywords are hyperparameters of a dpopt method name (optimizer='dp-adam', ...); "
                "the Opacus arguments dpopt takes are listed in docs/migrating-from-opacus.md"
            )
        compat = check_opacus_arguments(
            self,
            grad_sample_mode=grad_sample_mode,
            batch_first=batch_first,
            criterion=criterion,
            loss_reduction=loss_reduction,
            clipping=clipping,
            min_clipbound=min_clipbound,
            max_clipbound=max_clipbound,
            max_grad_norm=max_grad_norm,
            secure_mode=secure_mode,
            noise_generator=noise_generator,
        )
        run_delta = check_delta(delta) if delta is not None else self.ledger.delta
        mech_kind = self._check_mechanism_options(
            noise_mechanism, epochs, total_steps, poisson_sampling, clipping, noise_multiplier
        )
        partitions = check_sampling(sampling, mech_kind, noise_mechanism, sample_rate, len(data_loader))
        unit = _check_unit_arguments(
            privacy_unit, user_ids, None if partitions else sample_rate, distributed, poisson_sampling, mech_kind
        )
        if unit == "user" and mech_kind != "independent":
            raise ValueError(
                "privacy_unit='user' with a correlated noise_mechanism is not supported: its sensitivity "
                "analysis is per record over cyclic batches; use noise_mechanism='independent'"
            )
        warn_drop_last(data_loader, poisson_sampling)
        noise = NoiseSource("secure") if compat.secure else self.noise
        if noise_generator is not None:
            warnings.warn(
                "noise_generator: the Gaussian noise and Poisson masks are reproducible from this "
                "generator's seed (research reruns only; `dpopt check` fails this ledger)",
                UserWarning,
                stacklevel=2,
            )
            noise = NoiseSource("reproducible", generator=noise_generator)
        ctx = _distributed_context(module, distributed, process_group, poisson_sampling)
        views = check_multiplicity(augmentation_multiplicity)
        view_fn = None if augmentation is None else resolve_augmentation(augmentation, views)
        if views > 1 and unit == "user":
            raise ValueError(
                "augmentation_multiplicity > 1 with privacy_unit='user' is not supported: average the views "
                "inside each record's loss, or train at privacy_unit='record'"
            )
        if views > 1 and distributed == "fsdp":
            raise ValueError(
                "augmentation_multiplicity > 1 is not supported with distributed='fsdp'; use "
                "distributed=True (replicas) or one process"
            )
        if compile and (distributed == "fsdp" or views > 1):
            raise ValueError(
                "make_private(compile=True) with "
                + ("distributed='fsdp'" if distributed == "fsdp" else "augmentation_multiplicity > 1")
                + " is not supported: the compiled capture is built and checked for one process holding the "
                "whole model and one row per example; drop compile"
            )
        capture = fsdp.capture_for(
            module,
            distributed,
            optimizer,
            ctx,
            loss_reduction=loss_reduction,
            **({"compile": compile} if compile else {}),
            **({"rows_per_example": views} if views > 1 else {}),
            **({"cache_bytes": cache_bytes} if cache_bytes is not None else {}),
            **({"norm_form": norm_form} if norm_form is not None else {}),
        )
        try:  # the hooks record private tensors: never leave them attached after a refusal
            error: Optional[Exception] = None
            try:
                if ctx.enabled and not ctx.is_main and self._keeper.journal is not None:
                    raise RuntimeError(
                        f"this engine keeps a ledger journal ({self._keeper.journal}) on rank {ctx.rank} of "
                        f"{ctx.world_size}: in a data-parallel run only rank 0 writes it (every rank's ledger "
                        "holds the same releases). Call engine.open_journal() on rank 0 only; a load_checkpoint() "
                        "before make_private() opens the checkpoint's journal too, so on ranks > 0 call "
                        "load_checkpoint() after make_private() (it then reads the journal without opening it)"
                    )
                if unit == "user":
                    n, sample_rate, loader = self._user_loader(
                        data_loader, user_ids, max_records_per_user, sample_rate, noise, ctx
                    )
                    steps_per_epoch = len(loader)
                elif mech_kind == "independent":
                    n, steps_per_epoch, loader = self._private_loader(data_loader, poisson_sampling, noise, ctx)
                    sample_rate = 1.0 / steps_per_epoch
                elif partitions:  # cyclic Poisson: part t mod b' sampled at q (amplified banded MF)
                    _refuse_custom_batching(data_loader, ctx, "cyclic Poisson sampling")
                    n, steps_per_epoch = len(data_loader.dataset), len(data_loader)  # type: ignore[arg-type]
                    sample_rate = float(cast(float, sample_rate))
                    loader = CyclicPoissonLoader(
                        data_loader.dataset,
                        partitions,
                        sample_rate,
                        collate_fn=data_loader.collate_fn,
                        noise=noise,
                        # one iteration of the loader is one epoch of the horizon (T = epochs × len(data_loader)),
                        # not one pass over the b' parts: a loop of `epochs` passes makes the T planned releases
                        steps=steps_per_epoch,
                        # data parallel: rank 0's (secret) assignment, this rank's slice of every part
                        seed=_partition_seed(ctx),
                        rank=ctx.rank,
                        world_size=ctx.world_size,
                        **loader_settings(data_loader),
                    )
                else:
                    _refuse_custom_batching(data_loader, ctx, "cyclic batches")
                    n, steps_per_epoch, loader = _cyclic_loader(data_loader, ctx)
                    sample_rate = 1.0 / steps_per_epoch
                if view_fn is not None:
                    loader = _loader_with_views(loader, views, view_fn)
                expected_batch_size = sample_rate * n  # the GLOBAL expected batch size (all ranks together)
                params, method, overrides = _trained_parameters(optimizer, module, capture, hparams)
                privacy = self._clipping_options(
                    clipping,
                    params,
                    capture,
                    noise_multiplier,
                    max_grad_norm,
                    expected_batch_size,
                    target_unclipped_quantile,
                    clipbound_learning_rate,
                    unclipped_num_std,
                    count_share,
                )
                if mech_kind != "independent":
                    privacy["mechanism"] = _mechanism(
                        noise_mechanism,
                        noise_multiplier,
                        steps_per_epoch,
                        epochs,
                        total_steps,
                        partitions,
                        sample_rate if partitions else None,
                        run_delta if run_delta is not None else AMPLIFICATION_CHECK_DELTA,
                    )
                    # cyclic batches: N/b examples per step; cyclic Poisson: q·N/b'
                    expected_batch_size = n / steps_per_epoch if not partitions else sample_rate * n / partitions
                if clipping == "auto":  # AUTO-S: the flat options plus the normalisation's γ
                    from .auto_clipping import AutoClipping

                    if distributed == "fsdp":  # the sharded release computes its own clip factors
                        raise ValueError("clipping='auto' is not supported with distributed='fsdp'")
                    privacy["auto_clip"] = AutoClipping(clipping_gamma)
                flat_c = max_grad_norm if isinstance(max_grad_norm, (int, float)) else 1.0
                dp = make_optimizer(
                    method,
                    params,
                    expected_batch_size=expected_batch_size,
                    sample_rate=sample_rate,
                    ledger=self.ledger,
                    noise=noise,
                    max_grad_norm=float(flat_c),
                    model=module,
                    **privacy,
                    **overrides,
                )
                if _declares_points(dp.transform):
                    raise ValueError(
                        f"{method} evaluates gradients at points other than the current parameters "
                        "(DiSK), which needs the loss: PrivacyEngine never sees it. Train it with "
                        "dpopt's own loop (dpopt.train, or iter_per_sample_sources(..., "
                        "points=opt.evaluation_points()))"
                    )
            except Exception as exc:
                if not ctx.enabled:
                    raise
                error = exc  # raised below, after every rank knows (no rank waits in a collective forever)
            if ctx.enabled:
                _join_ranks(
                    ctx,
                    error,
                    lambda: [
                        sample_rate,
                        n,
                        steps_per_epoch,
                        noise_multiplier,
                        max_grad_norm,
                        [p.numel() for p in params],
                        method,
                        clipping,
                        loss_reduction,
                        noise.mode,
                    ],
                )
            self._keeper.rank, self._keeper.world_size = ctx.rank, ctx.world_size  # only rank 0 writes the journal
            if isinstance(capture, fsdp.ShardedCapture):  # FSDP2 (dpopt.fsdp): owner-only noise, reduce-scatter
                fsdp.attach(dp.privatizer, params, module, ctx)
            elif ctx.enabled:
                # every replica starts from rank 0's model; the Privatizer releases the noisy sum over ranks
                broadcast_parameters(list(module.parameters()) + list(module.buffers()), ctx)
                attach(dp.privatizer, ctx)
            original = optimizer if isinstance(optimizer, torch.optim.Optimizer) else dp
            self._captures.append(capture)
            self._claims = {
                "noise_multiplier": float(noise_multiplier),
                "sample_rate": sample_rate,
                "privatizers": getattr(self, "_claims", {}).get("privatizers", []) + [dp.privatizer],
            }
            if len(self.ledger):  # a later make_private: its sigma holds from the next release on
                self._claims["noise_multiplier_schedule"] = [[len(self.ledger), float(noise_multiplier)]]
            if clipping == "adaptive":
                self._claims["noise_multiplier_total"] = float(noise_multiplier)
            private = PrivateOptimizer(original, dp, capture, params, engine=self)
            private._loader = loader if isinstance(loader, DPDataLoader) else None
            private._user_level = unit == "user"
            if unit == "user":
                self._claims.update(privacy_unit="user", max_records_per_user=int(max_records_per_user), num_users=n)
            elif unit == "block":
                self._declare_blocks()
            probe_loader(loader, capture, views, view_fn)  # the check collates examples alone (padding)
            if private._loader is not None:  # its batches are tagged for the optimizer (release_boundary)
                loader.boundary = boundary_of(private)
                sampler: Any = getattr(loader, "poisson", None)
                if hasattr(sampler, "clock"):  # cyclic batches: every pass starts at the next release's step
                    sampler.clock = _release_clock(private)
                # a step on data the loader did not hand out, or as another release than its batch's, refused
                boundary_of(private).expect_tags(sampler)
            private.clip_range = compat.clip_range
            # a torch loss module with reduction 'sum'/'none' on the model's output, checked on the first batch
            private._loss_watch = LossReductionWatch(module, loss_reduction)
            self._loss_watches.append(weakref.ref(private._loss_watch))
            alias_module(module)  # Opacus's model._module
            self.ledger.delta = run_delta  # the run's δ (ledger header), once nothing was refused
            if compat.ghost:  # Opacus's ghost-clipping shape; the criterion is an ordinary loss here
                return module, private, compat.criterion, loader
            return module, private, loader
        except BaseException:
            capture.detach()
            raise

    @staticmethod
    def _check_mechanism_options(
        noise_mechanism: str,
        epochs: Optional[float],
        total_steps: Optional[int],
        poisson_sampling: bool,
        clipping: str,
        noise_multiplier: float,
    ) -> str:
        """The mechanism kind of ``noise_mechanism``, or a ConfigError for a combination with no valid
        accountant (module :mod:`dpopt.correlated_noise`)."""
        kind, _ = parse_mechanism(noise_mechanism)
        if kind == "independent":
            if epochs is not None or total_steps is not None:
                raise ConfigError(
                    "epochs / total_steps set the horizon of correlated noise; with noise_mechanism="
                    "'independent' they change nothing: drop them (or use make_private_with_epsilon)",
                    "epochs",
                    "total_steps",
                )
            return kind
        problems = []
        if (epochs is None) == (total_steps is None):
            problems.append("needs exactly one of epochs= or total_steps= (the horizon the strategy is built for)")
        if not poisson_sampling:
            problems.append("cannot be used with poisson_sampling=False (it brings its own cyclic batches)")
        if clipping == "adaptive":
            problems.append(
                "cannot be used with clipping='adaptive' (the noise scale would change with a released bound)"
            )
        if not float(noise_multiplier) > 0:
            problems.append("needs noise_multiplier > 0")
        if problems:
            raise ConfigError(
                f"noise_mechanism={noise_mechanism!r}: " + "; ".join(problems),
                "noise_mechanism",
            )
        return kind

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: Union[torch.optim.Optimizer, str],
        data_loader: DataLoader,
        target_epsilon: float,
        target_delta: float,
        epochs: float,
        max_grad_norm: Union[float, Sequence[float]],
        **kwargs: Any,
    ) -> tuple[nn.Module, PrivateOptimizer, DataLoader]:
        """:meth:`make_private` with σ calibrated so that ``epochs`` epochs cost at most ``target_epsilon``.

        Steps = ⌈``epochs`` · len(data_loader)⌉ Poisson steps at q = 1/len(data_loader)
        (with ``privacy_unit="user"`` and ``sample_rate=q_user``: ⌈``epochs`` · round(1/q_user)⌉ steps at q_user)
        (``epochs`` may be fractional: 2.5 epochs are calibrated as such, never truncated);
        σ is the smallest (within 1 %) with ε(σ) ≤ target under the engine's
        accountant (:func:`~dpopt.accounting.calibration.calibrate_noise_multiplier`;
        for adaptive clipping this is the total σ). The σ chosen is
        ``optimizer.noise_multiplier`` (the gradient part for adaptive clipping).

        Nothing stops the loop after ``epochs`` epochs (as in Opacus): the first
        release that takes ε (this engine's accountant, ``target_delta``) past
        ``target_epsilon`` warns once (:class:`~dpopt.opacus_compat.TargetWatch`).

        Raises:
            ValueError: ``epochs`` not a finite number > 0; and :meth:`make_private`'s errors.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not math.isfinite(epochs) or epochs <= 0:
            raise ValueError(f"epochs must be a number > 0 (fractions allowed), got {epochs!r}")
        if "delta" in kwargs:
            raise ConfigError("make_private_with_epsilon takes the run's delta as target_delta; drop delta=", "delta")
        given = kwargs.get("sample_rate")  # privacy_unit="user" may give q_user; else q = 1/len(data_loader)
        q = 1.0 / len(data_loader) if given is None else float(given)
        per_epoch = len(data_loader) if given is None else max(1, int(round(1.0 / q)))  # the loader's batches
        steps = horizon_steps(epochs, per_epoch)  # 2.5 epochs: σ for all of them, never fewer
        kind, size = parse_mechanism(kwargs.get("noise_mechanism", "independent"))
        if kind != "independent":  # correlated noise: one Gaussian at the strategy's sensitivity (cyclic batches)
            if "epochs" in kwargs or "total_steps" in kwargs:
                raise ConfigError(
                    "make_private_with_epsilon sets the horizon from epochs=; do not give total_steps", "total_steps"
                )
            amplified = kwargs.get("sampling") == "cyclic-poisson"
            if given is not None and not amplified:
                raise ConfigError(
                    "sample_rate is not used with a correlated noise_mechanism (cyclic batches)", "sample_rate"
                )
            steps = horizon_steps(epochs, len(data_loader))  # T counts the loader's batches
            if amplified:  # k rounds of the Poisson-sampled Gaussian at σ/‖c‖: DP-SGD's calibration × ‖c‖
                parts = check_sampling("cyclic-poisson", kind, str(kwargs["noise_mechanism"]), given, len(data_loader))
                sigma = calibrate_amplified_noise_multiplier(
                    target_epsilon,
                    target_delta,
                    optimize_strategy(kind, steps, size),
                    steps,
                    parts,
                    float(cast(float, given)),
                    str(self.accountant),
                )
            else:
                b = len(data_loader)
                participation = Participation(steps, -(-steps // b), b)
                strategy = optimize_strategy(kind, steps, size, participation=participation)  # make_private's
                sigma = calibrate_mechanism_noise(
                    target_epsilon, target_delta, strategy, participation, str(self.accountant)
                )
            kwargs["total_steps"] = steps
        else:
            sigma = calibrate_noise_multiplier(
                target_epsilon, target_delta, q, steps, str(self.accountant)
            ).noise_multiplier
        out = self.make_private(
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            noise_multiplier=sigma,
            max_grad_norm=max_grad_norm,
            delta=target_delta,  # the ledger header's δ and the amplification check's
            **kwargs,
        )
        # training past the planned steps raises epsilon past the target: warned once (opacus_compat.TargetWatch)
        # (correlated noise: a release past the planned steps is refused by the mechanism itself)
        self._target_watch = (
            TargetWatch(self, target_epsilon, target_delta, str(self.accountant), steps)
            if kind == "independent"
            else None
        )
        return out

    def get_epsilon(self, delta: Optional[float] = None) -> float:
        """ε(δ) of every release recorded so far in :attr:`ledger`, under the engine's accountant.

        Args:
            delta: the δ to read ε at; None: the run's δ recorded by ``make_private(delta=...)``
                (or ``make_private_with_epsilon``'s ``target_delta``, ``DPTrainer``'s ``delta``).

        Raises:
            ValueError: ``delta`` is None and no δ was recorded (give ``get_epsilon(delta=...)``).
        """
        if delta is None:
            if self.ledger.delta is None:
                raise ValueError(
                    "get_epsilon needs delta: no delta was given to make_private; call get_epsilon(delta=...)"
                )
            delta = self.ledger.delta
        return epsilon(self.ledger, delta, str(self.accountant))

    # -- Opacus's module checks (dpopt.module_validator) -----------------------------------
    @classmethod
    def get_compatible_module(cls, module: nn.Module) -> nn.Module:
        """``module`` with every refused layer replaced (BatchNorm → GroupNorm, ...), then validated (Opacus).

        Raises:
            UnsupportedModuleError: a problem remains after the fixes.
        """
        return ModuleValidator.fix_and_validate(module)

    def is_compatible(self, *, module: nn.Module, optimizer: Any = None, data_loader: Any = None) -> bool:  # noqa: ARG002
        """True when ``module`` has no layer dpopt refuses (Opacus's signature; optimizer and loader unused)."""
        return ModuleValidator.is_valid(module)

    def validate(self, *, module: nn.Module, optimizer: Any = None, data_loader: Any = None) -> None:  # noqa: ARG002
        """:meth:`is_compatible`, raising :class:`~dpopt.module_validator.UnsupportedModuleError` with each problem."""
        ModuleValidator.validate(module, strict=True)

    def summary(self, delta: float) -> dict:
        """The public claims of this engine's run, in the form ``dpopt check`` reads (``summary.json``).

        ``check_ledger(engine.ledger, engine.summary(delta))``
        (:func:`dpopt.accounting.ledger_check.check_ledger`) re-scores the ledger
        and checks every release; save both with ``engine.ledger.save(path)`` and
        ``json.dump``.
        """
        claims = dict(getattr(self, "_claims", {"noise_multiplier": 0.0, "privatizers": []}))
        privs = claims.pop("privatizers")
        keeper = self._keeper  # releases made before a load are counted by the run that made them
        claims.update(
            epsilon=self.get_epsilon(delta),
            delta=float(delta),
            accountant=str(self.accountant),
            steps=len(self.ledger),
            privatizer_reads=sum(p.reads for p in privs) + keeper.carried_reads,
            privatizer_releases=sum(p.releases for p in privs) + keeper.carried_releases,
            noise=self.ledger.noise,
        )
        return claims

    # -- saved state that carries the ledger (dpopt.checkpoint) -------------------------
    @property
    def journal(self) -> Optional[Path]:
        """The append-only ledger journal every release is flushed to (None until a checkpoint or open_journal)."""
        return self._keeper.journal

    def open_journal(self, path: Union[str, os.PathLike]) -> Path:
        """Flush every release (the ledger so far first) to the JSON-lines journal at ``path`` from now on.

        Optimizer states (``optimizer.state_dict()``) record it, so loading an
        older one still charges the releases made after it;
        :meth:`save_checkpoint` opens one by itself. In a data-parallel run
        (``make_private(..., distributed=...)``) only rank 0 writes the
        journal: call it on rank 0 only (every rank's ledger is the same).

        Raises:
            RuntimeError: called on a rank other than 0 of the engine's
                data-parallel group (:meth:`~dpopt.checkpoint.LedgerKeeper.check_main`).
            ValueError: another journal is already open, or ``path`` holds
                another run's journal (:meth:`~dpopt.checkpoint.LedgerKeeper.open_journal`).
        """
        self._keeper.check_main("open_journal")
        return self._keeper.open_journal(path)

    def _privatizers(self) -> list:
        return list(getattr(self, "_claims", {}).get("privatizers", []))

    def _own(self, optimizer: Any) -> None:
        if optimizer is None:
            return
        if not isinstance(optimizer, PrivateOptimizer):
            raise TypeError(
                f"optimizer must be the optimizer this engine's make_private returned, got {type(optimizer).__name__}"
            )
        if optimizer.privatizer.ledger is not self.ledger:
            raise ValueError(
                "this optimizer was made private by another PrivacyEngine (its releases are in "
                "that engine's ledger): save and load it with that engine"
            )

    def save_checkpoint(
        self,
        *,
        path: Union[str, os.PathLike, Any],
        module: nn.Module,
        optimizer: Optional[PrivateOptimizer] = None,
        noise_scheduler: Optional[Any] = None,
        grad_clip_scheduler: Optional[Any] = None,
        checkpoint_dict: Optional[dict] = None,
        module_state_dict_kwargs: Optional[dict] = None,
        torch_save_kwargs: Optional[dict] = None,
        journal: Optional[Union[str, os.PathLike]] = None,
    ) -> None:
        """Save the model, optimizer, schedulers and this engine's ledger with ``torch.save`` (Opacus's shape).

        Layout in :mod:`dpopt.checkpoint`. The ledger is written ONCE, in its
        run-length form (O(groups): a run at fixed σ, q, C is one group
        whatever its length): the optimizer state's and the accountant state's
        ``"ledger"`` are the same object as ``privacy_ledger``, which pickle
        stores once. A path is written atomically (a temporary file beside it,
        ``fsync``, ``os.replace``: :func:`~dpopt.checkpoint.atomic_torch_save`).
        From the first call on, every
        release is appended to the run's ledger journal (``journal``, default
        ``ledger-<run_id>.jsonl`` beside ``path``), flushed before the file is
        written: :meth:`load_checkpoint` of this file, even after more
        training, charges every release the journal holds.

        Args:
            path: file (or binary file object: then give ``journal=``, or no
                journal is kept — warned).
            module: the model made private (its ``state_dict``).
            optimizer: the optimizer :meth:`make_private` returned (its
                ``state_dict`` carries the Privatizer and the ledger).
            noise_scheduler, grad_clip_scheduler: saved with ``state_dict()``.
            checkpoint_dict: more entries to save (copied, then filled in).
            module_state_dict_kwargs, torch_save_kwargs: passed on.
            journal: the journal file (once one is open it cannot move).

        Raises:
            TypeError / ValueError: an optimizer this engine did not make
                private; a journal path that cannot be used (:meth:`open_journal`).
            RuntimeError: a path (or ``journal=``) on a rank other than 0 of
                the engine's data-parallel group: only rank 0 writes the
                journal, so save on rank 0 only (:meth:`open_journal`).
        """
        engine_checkpoint.save_checkpoint(
            self,
            path=path,
            module=module,
            optimizer=optimizer,
            noise_scheduler=noise_scheduler,
            grad_clip_scheduler=grad_clip_scheduler,
            checkpoint_dict=checkpoint_dict,
            module_state_dict_kwargs=module_state_dict_kwargs,
            torch_save_kwargs=torch_save_kwargs,
            journal=journal,
        )

    def load_checkpoint(
        self,
        *,
        path: Union[str, os.PathLike, Any],
        module: nn.Module,
        optimizer: Optional[PrivateOptimizer] = None,
        noise_scheduler: Optional[Any] = None,
        grad_clip_scheduler: Optional[Any] = None,
        module_load_dict_kwargs: Optional[dict] = None,
        torch_load_kwargs: Optional[dict] = None,
    ) -> dict:
        """Load a :meth:`save_checkpoint` file; this engine's ledger takes the run's whole record in.

        The ledger becomes the longest record of the run among the checkpoint's
        ledger, its journal (every release made after the checkpoint too:
        warned with their number) and this engine's own
        (:class:`~dpopt.checkpoint.LedgerKeeper`); releases go on into that
        journal (on rank 0 of a data-parallel run; the other ranks read it and
        write none). Then the module, the optimizer and the schedulers are
        restored. ``torch.load`` reads with ``weights_only=True`` (whatever
        the torch version's default) unless ``torch_load_kwargs`` says otherwise.

        Returns:
            The checkpoint dict (Opacus returns it too).

        Raises:
            ValueError: a checkpoint without a ledger (e.g. saved by Opacus:
                ε would restart from zero), a ledger of another run or branch,
                other run settings; an optimizer of another engine.
        """
        return engine_checkpoint.load_checkpoint(
            self,
            path=path,
            module=module,
            optimizer=optimizer,
            noise_scheduler=noise_scheduler,
            grad_clip_scheduler=grad_clip_scheduler,
            module_load_dict_kwargs=module_load_dict_kwargs,
            torch_load_kwargs=torch_load_kwargs,
        )

    # -- helpers -------------------------------------------------------------------
    def _private_loader(
        self, data_loader: DataLoader, poisson_sampling: bool, noise: NoiseSource, ctx: DistributedContext
    ) -> tuple[int, int, DataLoader]:
        """(N, batches per epoch, the loader to train with): Poisson batches of the loader's dataset at
        q = 1/len(loader) (this rank's shard with ``ctx``), or, refused by the accountants' assumption but
        allowed with a warning recorded in the ledger, the loader's own batches."""
        dataset = data_loader.dataset
        if not hasattr(dataset, "__len__"):
            raise ValueError("make_private needs a map-style dataset with __len__ (N is the public dataset size)")
        if poisson_sampling:
            custom = custom_batching(data_loader)
            if custom is not None and not (ctx.enabled and _distributed_sampler(data_loader)):
                raise ValueError(
                    f"make_private: the data loader forms its batches with {custom}, which Poisson "
                    f"sampling at q = 1/len(data_loader) would silently replace (e.g. a weighted "
                    "sampler's weights, or a custom batch sampler's batch sizes, would be ignored). "
                    "Either pass poisson_sampling=False to keep your batches (then the accountant's "
                    "epsilon does not hold: warned and recorded in the ledger), or give a plain "
                    "DataLoader(dataset, batch_size=B, shuffle=True): Poisson batches at q = 1/len "
                    "(expected size about B)"
                )
            return len(dataset), len(data_loader), DPDataLoader.from_data_loader(data_loader, noise=noise, ctx=ctx)
        warnings.warn(
            "poisson_sampling=False: the batches are the loader's own (shuffled, fixed size), not Poisson "
            "samples; the accountants' ε assumes Poisson sampling and does not hold for this run "
            "(recorded in the ledger)",
            UserWarning,
            stacklevel=3,
        )
        self.ledger.sampling = "shuffled (not poisson)"
        return len(dataset), len(data_loader), data_loader

    def _user_loader(
        self,
        data_loader: DataLoader,
        user_ids: Any,
        k: int,
        sample_rate: Optional[float],
        noise: NoiseSource,
        ctx: DistributedContext,
    ) -> tuple[int, float, DataLoader]:
        """(N_users, q_user, the user-level Poisson loader) for ``privacy_unit="user"`` (:mod:`dpopt.users`);
        with ``ctx`` of several ranks the loader draws this rank's shard of the users.

        Records the unit, k and N_users in the ledger header (N_users public, like N).
        """
        from .users import UserDPDataLoader, check_max_records, group_users, user_unit_text

        custom = custom_batching(data_loader)
        if custom is not None:
            raise ValueError(
                f"make_private: the data loader forms its batches with {custom}, which user-level Poisson "
                "sampling would silently replace; pass DataLoader(dataset, batch_size=B, shuffle=True)"
            )
        k = check_max_records(k)
        keys, users = group_users(user_ids, len(data_loader.dataset))  # type: ignore[arg-type]
        q = 1.0 / len(data_loader) if sample_rate is None else float(sample_rate)
        steps = len(data_loader) if sample_rate is None else None
        collate = data_loader.collate_fn
        if collate is default_collate or getattr(collate, "__name__", "") == "default_collate":
            collate = None  # type: ignore[assignment]
        loader = UserDPDataLoader(
            data_loader.dataset,
            users,
            q,
            k,
            keys=keys,
            steps=steps,
            collate_fn=collate,
            noise=noise,
            ctx=ctx,
            **loader_settings(data_loader),
        )
        self.ledger.privacy_unit = user_unit_text(k)
        self.ledger.num_users = len(users)
        return len(users), loader.sample_rate, loader

    def _declare_blocks(self) -> None:
        """``privacy_unit="block"``: each example is a packed block; recorded and warned."""
        self.ledger.privacy_unit = "block"
        warnings.warn(
            "privacy_unit='block': each example is a packed block of text, and epsilon protects ONE BLOCK, "
            "not a record or a person: a record spread over k blocks is protected at about k times epsilon "
            "(group privacy; docs/privacy-unit.md). Recorded in the ledger header",
            UserWarning,
            stacklevel=3,
        )

    @staticmethod
    def _clipping_options(
        clipping: str,
        params: Any,
        capture: Any,
        sigma: float,
        max_grad_norm: Any,
        bbar: float,
        quantile: Any,
        quantile_lr: Any,
        unclipped_num_std: Any,
        count_share: Any,
    ) -> dict:
        if clipping in ("flat", "auto"):
            if not isinstance(max_grad_norm, (int, float)):
                raise ValueError("flat clipping takes one max_grad_norm (a number)")
            return {"noise_multiplier": sigma}
        if clipping == "per_layer":
            if isinstance(max_grad_norm, (int, float)):
                bounds = [float(max_grad_norm) / math.sqrt(len(params))] * len(params)
            else:
                bounds = [float(c) for c in max_grad_norm]
                if len(bounds) != len(params):
                    raise ValueError(
                        f"per_layer clipping takes one max_grad_norm per trainable parameter "
                        f"({len(params)}), got {len(bounds)}"
                    )
            return {"noise_multiplier": sigma, "groups": list(range(len(params))), "group_bounds": bounds}
        if not isinstance(max_grad_norm, (int, float)):
            raise ValueError("adaptive clipping takes one initial max_grad_norm (a number)")
        if unclipped_num_std is not None:
            split = split_for_count_noise(sigma, count_noise_std=unclipped_num_std, expected_batch_size=bbar)
        else:
            split = split_budget(sigma, DEFAULT_COUNT_SHARE if count_share is None else count_share)
        q = QuantileClipping(split.count_noise_multiplier, quantile, quantile_lr, initial_clip=float(max_grad_norm))
        return {"noise_multiplier": split.grad_noise_multiplier, "quantile": q}

    def detach(self) -> None:
        """Remove the hooks this engine attached to models: the captures' and those of the first-batch loss
        check, which stay until a step on a batch of >= 2 examples (an engine detached after an empty or
        one-example first batch left a forward hook on the model and a process-wide module forward hook)."""
        for c in self._captures:
            c.detach()
        self._captures = []
        for ref in self._loss_watches:
            watch = ref()
            if watch is not None:
                watch.close()
        self._loss_watches = _WatchRefs()
