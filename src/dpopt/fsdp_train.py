"""``dpopt train --fsdp``: the training loop with the model sharded by FSDP2 (``fully_shard``), under ``torchrun``.

Launch (gloo on CPU, NCCL on GPUs; every rank runs the same command)::

    torchrun --standalone --nproc_per_node 2 -m dpopt train --fsdp --method dp-sgd --dataset digits ...

:func:`train_fsdp` is :func:`dpopt.training.train` for a sharded model. The run is built as usual
(:func:`~dpopt.training.build.build_run`, the same seed on every rank: the same initial parameters),
then every module that owns trainable parameters is ``fully_shard``-ed, then the root; the
:class:`~dpopt.optim.DPOptimizer` is rebuilt over the sharded (``DTensor``) parameters and
releases through :class:`dpopt.fsdp.ShardedRelease` (each rank's clipped sums in full shape,
noise σC added once per coordinate by the coordinate's owner, one reduce-scatter; the design
is :mod:`dpopt.fsdp`'s). Correlated noise (``--noise-mechanism banded:B|blt``, with ``--sampling
cyclic-poisson`` too): the mechanism build_run planned, each coordinate's stream run by its owner
(its shard's state only), over the cyclic (Poisson) batches sliced over the ranks. The loop is :func:`dpopt.training.loop.run_steps`, the one-process loop
(lr schedule, ε budget, metrics rows, ledger flushes, the stop signal), given this module's
per-sample sources and told to evaluate on every rank. Per step, on every rank::

    idx = this rank's Poisson shard (ShardedPoissonSampler: the union is a Poisson sample at q), or with
          --noise-mechanism its slice of the step's cyclic batch (--sampling cyclic-poisson: its slice of
          the step's part, Poisson-sampled at q), rank 0's (secret) balls-in-bins assignment on every rank
    for each of K chunks of ≤ physical_batch_size examples (K = the largest count over ranks:
        every rank runs the same number of forward/backward passes, so FSDP's collectives match;
        a rank with fewer examples runs empty chunks):
        forward + backward of Σ_i ℓ_i  →  ShardedCapture.collect()  (per-example norms, full shape)
    DPOptimizer.step(sources)  →  clipped sums + owner-only noise → reduce-scatter → the update on the shards

With reproducible noise every rank draws the same stream (the masks of the whole dataset, and
the full-shape noise tensor of which it keeps its chunk), so the W-process run is the
one-process ``dpopt train`` run with the same flags, coordinate for coordinate, to float
rounding (``tests/distributed/test_fsdp_train.py``).

Evaluation (test / validation sets) runs on every rank (the forward passes of a sharded model
are collectives); only rank 0 writes files. At the end the full parameters are gathered
(``DTensor.full_tensor``, a collective) and rank 0 writes ``model.pt`` as a plain state dict
(loadable into the unsharded model), the ledger, ``summary.json`` and ``check.txt``, as
:func:`~dpopt.training.train` does.

Supported: methods ``dp-sgd`` and ``dp-adam`` (their transforms are elementwise, so they run on
the local shards; flat clip geometry), flat clipping, ``--physical-batch-size``,
``--target-epsilon``, ``--max-epsilon``, ``--log-every``, learning-rate schedules, ``--freeze``,
``--noise-mechanism`` (and ``--sampling cyclic-poisson``; as ``dpopt train``, never resumed), the
built-in models (``mlp-small``, ``mlp``, ``cnn5``) and any model whose trainable layers have a fast
per-example rule; SIGINT / SIGTERM end the run between releases (``"status": "interrupted"``, every
file but a checkpoint written). Refused with an error that says what to change
(:func:`check_fsdp_config`): other methods (clip geometry or whole-matrix transforms that are not
sharded: MacAdam, AdaClip, Muon, ...), per-layer and quantile clipping, ``--resume`` and
``--checkpoint-every`` (a sharded checkpoint is not written: the run keeps no ``checkpoint.pt``),
LoRA, augmentation views, the EMA, ``--show-train-loss``, ``--user-ids`` (user-level DP's sampler is not
sharded), ``--compile``, one process (launch under ``torchrun`` with W ≥ 2, or drop ``--fsdp``).
:mod:`dpopt.fsdp` refuses tensor parallelism, HSDP, mixed precision and layers without a fast rule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, cast

import torch
from torch import nn

from .errors import ConfigError, RunWriteError
from .training.results import RunFiles

__all__ = ["FSDP_METHODS", "check_fsdp_config", "shard_model", "train_fsdp"]

#: Methods whose transform is elementwise and whose clip geometry is flat: they run on the local shards.
FSDP_METHODS = ("dp-sgd", "dp-adam")


def check_fsdp_config(cfg) -> None:
    """Refuse what ``--fsdp`` does not support (module docstring), naming the option to change.

    Raises:
        ConfigError: naming the ``TrainConfig`` field (the CLI shows it as its flag).
    """
    if cfg.method not in FSDP_METHODS:
        raise ConfigError(
            f"fsdp: method {cfg.method!r} is not supported with a sharded model (its clip geometry "
            f"or transform is not sharded); use one of {', '.join(FSDP_METHODS)}, or drop fsdp "
            "(data parallel: torchrun without --fsdp)",
            "method",
        )
    refused = {
        "clipping": (cfg.clipping != "flat", "flat clipping only"),
        "user_ids": (cfg.user_ids is not None, "user-level DP's sampler is not sharded"),
        "compile": (cfg.compile, "the sharded capture is not compiled (it would run eager)"),
        "norm_form": (cfg.norm_form is not None, "the sharded capture's norm forms are the cost model's"),
        "lora_rank": (cfg.lora_rank is not None, "LoRA under fsdp is untested"),
        "augmentation_multiplicity": (
            cfg.augmentation_multiplicity > 1 or cfg.augment not in (None, "none"),
            "augmentation views are not supported",
        ),
        "ema_decay": (cfg.ema_decay is not None, "the EMA of a sharded model is not supported"),
        "show_train_loss": (cfg.show_train_loss, "the (non-private) train loss display is not supported"),
        "checkpoint_every": (
            bool(cfg.checkpoint_every),
            "no checkpoint of a sharded model is written (a --fsdp run cannot be resumed)",
        ),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ConfigError(f"fsdp: {why}; remove {name}, or drop fsdp", name)


def shard_model(model: nn.Module) -> nn.Module:
    """``fully_shard`` every module that owns trainable parameters (deepest first), then the root; in place.

    A module's own parameters form one FSDP unit (the root unit also holds what no other unit does,
    e.g. parameters tied across modules).
    """
    from torch.distributed.fsdp import fully_shard

    owners = [
        m
        for _, m in model.named_modules()
        if m is not model and any(p.requires_grad for p in m.parameters(recurse=False))
    ]
    for m in reversed(owners):
        fully_shard(m)
    fully_shard(model)
    return model


def _sources(model: nn.Module, capture, x: torch.Tensor, y: torch.Tensor, *, physical: Optional[int], dist) -> Iterator:
    """Per-sample sources of this rank's batch, in K chunks (K agreed over the ranks: same collectives)."""
    n = int(x.shape[0])
    size = physical or max(n, 1)
    k = torch.tensor([max(1, math.ceil(n / size))], dtype=torch.float64)
    k = int(dist.all_reduce(k, "max").item())  # type: ignore[assignment]
    for c in range(k):
        xb, yb = x[c * size : (c + 1) * size], y[c * size : (c + 1) * size]
        with torch.enable_grad():  # consumed inside the optimizer's step (no_grad)
            loss = nn.functional.cross_entropy(model(xb), yb, reduction="sum")  # Σ_i ℓ_i (an empty chunk: 0)
            loss.backward()
        yield capture.collect()


class _ShardedRunFiles(RunFiles):
    """:class:`~dpopt.training.results.RunFiles` of a sharded run: ledger journal and metrics rows, no checkpoint.

    A sharded model's checkpoint is not written (module docstring), so the loop's checkpoints
    (every epoch, and at the end or a stop) only flush the ledger: every release is on disk.
    """

    def checkpoint(self, state, sampler) -> None:
        self.flush()


def _full_state(model: nn.Module) -> dict:
    """The model's state dict with every ``DTensor`` gathered (a collective: call on every rank)."""
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def train_fsdp(cfg, data=None, on_step: Optional[Callable[[dict], None]] = None) -> dict:
    """:func:`dpopt.training.train` with the model sharded by FSDP2 over ``torchrun``'s processes.

    Args:
        cfg: a :class:`~dpopt.training.TrainConfig` (checked by :func:`check_fsdp_config` and the usual
            validation).
        data: the loaded dataset (loaded from cfg if None).
        on_step: as for :func:`~dpopt.training.train` (rank 0 only).

    The steps are :func:`dpopt.training.loop.run_steps`'s (the one-process loop) with this module's
    per-sample sources and evaluation on every rank. SIGINT / SIGTERM (on any rank) ends the run
    between releases as in ``dpopt train``: every rank finishes the current step, the ledger,
    metrics and ``summary.json`` (``"status": "interrupted"``, ``"stop_signal"``) are written; there
    is no checkpoint, so the run cannot be resumed (a new run's ε adds to this one's).

    Returns:
        On rank 0 the run's summary (as :func:`~dpopt.training.train`, plus ``"world_size"`` and
        ``"fsdp": True``); on other ranks ``{"rank", "world_size", "steps", "run_dir": None}``.

    Raises:
        ConfigError: what :func:`check_fsdp_config` refuses; one process (no ``torchrun``).
        ValueError: what :mod:`dpopt.fsdp` refuses (a layer without a fast rule, ...).
        RunWriteError: rank 0 failed to write the run's files (disk full, ...) after releases were charged;
            raised on EVERY rank after the same release (none waits in a collective), its ``run_dir`` the
            run's (:func:`dpopt.accounting.run_continuation.continuation` says how it goes on), as
            :func:`~dpopt.training.train` raises it.
    """
    from . import fsdp
    from .accounting.incremental import EpsilonTracker
    from .accounting.ledger import PrivacyLedger
    from .data import load_dataset
    from .distributed import any_rank, setup
    from .methods import build_optimizer, get_method
    from .models import build_model
    from .training import _on_main, share_path
    from .training.build import build_run, privacy_options, run_sampler
    from .training.config import resolve_device
    from .training.loop import LoopState, run_steps
    from .training.results import new_segment, run_directory, write_config, write_results
    from .training.signals import graceful_stop

    start = time.perf_counter()
    check_fsdp_config(cfg)
    data = data or load_dataset(cfg.dataset, cfg.data_dir)
    dist = setup(resolve_device(cfg.device))
    if not dist.enabled:
        raise ConfigError(
            "fsdp shards the model over several processes: launch under torchrun "
            "(torchrun --standalone --nproc_per_node 2 -m dpopt train --fsdp ...), or drop fsdp",
            "fsdp",
        )
    run = build_run(cfg, data, stacklevel=4)  # one-process build (no DDP broadcast): the same seed on every rank
    run_dir, error = None, None
    if dist.is_main:
        try:
            run_dir = run_directory(cfg)
            write_config(run_dir, run)  # the unsharded model's parameter count
        except Exception as exc:  # raised below, after the other ranks know
            error = exc
    if any_rank(error is not None, dist):
        if error is not None:
            raise error
        raise RuntimeError("rank 0 failed to set up the run (its error is reported there)")
    run_dir = share_path(run_dir, dist)  # every rank: a failed write of rank 0 is a RunWriteError on each

    model = shard_model(run.model)
    fsdp.prepare_model(model, dist)
    capture = fsdp.ShardedCapture(model, dist, loss_reduction="sum")
    params = [p for p in model.parameters() if p.requires_grad]
    if [id(p) for p in params] != [id(p) for p in capture.params]:
        capture.detach()
        raise RuntimeError("internal: the capture's parameters are not the optimizer's")
    privacy, _ = privacy_options(cfg, model, run.noise_multiplier, float(run.hparams["max_grad_norm"]))
    built = run.optimizer.privatizer  # over the unsharded model, never stepped: its mechanism and B̄ carry over
    if built.mechanism is not None:  # correlated noise: the plan build_run made (strategy, participation, σ)
        privacy["mechanism"] = built.mechanism
    opt = build_optimizer(
        get_method(cfg.method),
        params,
        run.hparams,
        expected_batch_size=built.expected_batch_size,  # B̄; N/b for cyclic batches, q·N/b' for cyclic Poisson
        sample_rate=run.sample_rate,
        ledger=PrivacyLedger(dataset_size=run.ledger.dataset_size),  # fresh: a mechanism is ONE per ledger
        noise=run.noise,
        model=model,
        **privacy,
    )
    hook = fsdp.attach(opt.privatizer, params, model, dist)  # a mechanism: each rank streams its shard's noise
    hook.agree_records = False  # records never write here (batched journal): run_steps agrees rank 0's writes
    run = dataclasses.replace(run, model=model, optimizer=opt, dist=dist, ledger=opt.privatizer.ledger)

    files = None
    try:
        files = _on_main(dist, lambda: _ShardedRunFiles(cast(Path, run_dir), run, segments=[new_segment(0)]))
    except BaseException:
        capture.detach()
        raise
    tracker = EpsilonTracker(cfg.delta, cfg.accountant, cfg.max_epsilon)
    sampler = run_sampler(run, dist)  # Poisson shards, or cyclic (Poisson) slices of rank 0's partition
    state = LoopState(segment_start=start)
    try:
        with graceful_stop() as stop:  # a stop signal on any rank ends every rank after the same release
            metrics = run_steps(
                run,
                on_step if dist.is_main else None,
                files=files,
                state=state,
                sampler=sampler,
                stop=stop,
                tracker=tracker,
                batch_sources=functools.partial(_sources, model, capture, physical=cfg.physical_batch_size, dist=dist),
                evaluate_on_every_rank=True,
            )
    except OSError as exc:  # a failed write (rank 0's, agreed by every rank in the loop): how the directory goes on
        if len(run.ledger) == 0:
            raise
        raise RunWriteError(exc, run_dir) from exc
    finally:
        capture.detach()
    full = _full_state(model)  # every rank (collectives)
    if not dist.is_main:
        return {"rank": dist.rank, "world_size": dist.world_size, "steps": len(run.ledger), "run_dir": None}
    plain = build_model(run.model_name, cfg.dataset)
    for name, p in plain.named_parameters():  # as trained (frozen ones stay frozen)
        p.requires_grad_(dict(run.model.named_parameters())[name].requires_grad)
    plain.load_state_dict(full)
    return write_results(
        Path(cast(Path, run_dir)),
        dataclasses.replace(run, model=plain),
        metrics,
        start,
        status=state.status,
        stop_signal=state.stop_signal,
        streamed=True,
        epsilon=tracker.epsilon(run.ledger),
        extra={"world_size": dist.world_size, "fsdp": True, "segments": [new_segment(0)]},
    )
