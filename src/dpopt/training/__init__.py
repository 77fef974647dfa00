"""The DP training loop used by ``dpopt train`` and by users.

:func:`train` is three steps, one module each:

* :mod:`.build` — building a run (:func:`~.build.build_run` → :class:`~.build.Run`):
  data, model, σ or its calibration, privacy options, the method's
  hyperparameters (resolved once, in the registry) and optimizer, the noise source;
* :mod:`.loop` — the step loop (:func:`~.loop.run_steps`): Poisson-sample a
  batch (public q) → per-sample sources at the optimizer's evaluation points,
  in micro-batches of at most ``physical_batch_size`` → ``DPOptimizer.step``
  (the Privatizer releases once and records the step in the ledger) →
  per-epoch test metrics and ε (one accountant over the whole ledger);
* :mod:`.results` — writing the run directory (:data:`RUN_FILES`) as the run goes;
* :mod:`.checkpoint` and :mod:`.signals` — checkpoints, :func:`resume`, and
  SIGINT/SIGTERM as a clean stop (``summary.json`` ``"status": "interrupted"``).

Long runs: the ledger journal (``ledger.jsonl``) is appended as releases
happen, metrics rows per epoch, a checkpoint every epoch (``checkpoint_every``
steps); SIGINT/SIGTERM finish the current step and stop with everything
written; :func:`resume` continues a run directory to its planned steps;
``max_epsilon`` stops before the release that would take ε past the budget.

:mod:`.config` holds :class:`TrainConfig` and :func:`validate_config`; its
errors (:class:`~dpopt.errors.ConfigError`) name the config fields, which the
CLI shows as flags.

What the run writes and prints (run files, ``--json`` line, progress) is public
configuration, released values (the model, test-set metrics computed from it)
and accountant output only — and, with ``validation_fraction`` > 0, metrics on
the held-out validation records (``val_accuracy``, ``val_loss``), which like
test records are never trained on and get no protection. The noise and Poisson masks come from a secret
:class:`~dpopt.noise.NoiseSource` unless ``reproducible_noise`` is set; the
seed fixes model initialisation (and other non-private randomness) only.
The dataset size N is treated as public when the sample rate is derived as
q = B̄/N (the run files then reveal N); give ``sample_rate`` to avoid that.

Data parallel (:mod:`dpopt.distributed`): launched under ``torchrun`` (env
``WORLD_SIZE`` > 1) or with a process group already initialised, :func:`train`
runs on every rank: each rank Poisson-samples its shard of the training set at
q, the clipped sums are all-reduced with the noise drawn once (rank 0), and
every rank applies the same update. Only rank 0 creates the run directory,
writes files, evaluates and calls ``on_step``; other ranks return
``{"rank", "world_size", "steps", "run_dir": None}``.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Union, cast

from ..accounting.incremental import EpsilonTracker
from ..accounting.journal_repair import repair_journal as repair_journal_file
from ..accounting.ledger import JOURNAL_NAME, PrivacyLedger
from ..atomic import remove_stale
from ..data import Dataset, load_dataset
from ..distributed import DistributedContext, any_rank, check_replicas, setup
from ..errors import RunWriteError
from ..sampling import PoissonSampler
from .build import REPRODUCIBLE_NOISE_WARNING, Run, build_run, layer_groups, noise_source, run_sampler
from .checkpoint import CHECKPOINT_NAME, load_checkpoint, load_rng_state
from .config import CLIPPINGS, DEVICES, TrainConfig, resolve_device, validate_config
from .loop import LEDGER_FLUSH_EVERY, LOSS_EVERY, LoopState, evaluate, run_steps
from .results import (
    RUN_FILES,
    RunFiles,
    check_extras,
    finished_summary,
    new_segment,
    run_directory,
    write_config,
    write_results,
)
from .signals import graceful_stop

__all__ = [
    "TrainConfig",
    "train",
    "resume",
    "evaluate",
    "validate_config",
    "layer_groups",
    "CLIPPINGS",
    "DEVICES",
    "noise_source",
    "REPRODUCIBLE_NOISE_WARNING",
    "RUN_FILES",
    "LOSS_EVERY",
    "LEDGER_FLUSH_EVERY",
    "Run",
    "build_run",
    "run_steps",
    "resolve_device",
    "CHECKPOINT_NAME",
]


def train(cfg: TrainConfig, data: Optional[Dataset] = None, on_step: Optional[Callable[[dict], None]] = None) -> dict:
    """Train a model with DP; write the run directory; return the summary dict.

    Args:
        cfg: the run's configuration.
        data: a loaded :class:`~dpopt.data.Dataset` (loaded from cfg if None).
        on_step: called after every step with ``{"step", "steps", "epsilon",
            "test_accuracy", "test_loss", "epsilon_bound", "accountant"}`` (ε
            spent by the run's accountant and test-set metrics at the last
            metrics row; None before the first; ``epsilon_bound`` an upper
            bound on the ε spent so far, refreshed every step — Rényi DP summed
            incrementally, the exact value for ``accountant="rdp"``; None
            where RDP has no analysis). Only with
            ``cfg.show_train_loss`` is ``"loss"`` added: the NON-PRIVATE loss
            of the private batch (an extra forward pass every 10 steps), for a
            display the user has asked for.

    Returns:
        dict with method, dataset, model, test_accuracy, epsilon, delta,
        noise_multiplier, sample_rate, expected_batch_size, steps, accountant,
        noise (the noise mode), wall_seconds, run_dir and more — public values only
        (with ``cfg.validation_fraction`` > 0 also validation_fraction, val_accuracy
        and val_loss: metrics of the final model on the held-out records, which get
        no protection; see :class:`TrainConfig`).
        ``"status"`` says how the run ended: ``"completed"`` (all planned steps), or for a
        run that stopped early ``"interrupted"`` (SIGINT or
        SIGTERM: the current step is finished, everything written; see
        :func:`resume`) or ``"budget_exhausted"`` (``cfg.max_epsilon``), and
        ``"planned_steps"`` (``round(epochs / q)``) beside it; ``steps`` is the steps run
        (= ledger entries). Epoch k ends after step ``round(k / q)`` (see :func:`run_steps`).

    Raises:
        ValueError / DataError: invalid configuration or data
            (:class:`~dpopt.errors.ConfigError` names the fields to change).
        RunWriteError: a write failed (disk full, ...) after releases were charged; its ``run_dir`` holds
            their journal (:func:`dpopt.accounting.run_continuation.continuation` says how it goes on). A
            failure before the first release leaves no run files and raises the write's own ``OSError``.
            Data parallel: rank 0 writes; its failed write is raised on EVERY rank after the same release
            (the others' cause an ``OSError`` with its ``errno``), none left waiting in a collective.
    """
    start = time.perf_counter()
    data = data or load_dataset(cfg.dataset, cfg.data_dir)
    dist = setup(resolve_device(cfg.device))  # torchrun / an initialised process group, else one process
    # the reproducible-noise warning points at train's caller
    run = build_run(cfg, data, stacklevel=4, dist=dist)
    run_dir = share_path(_on_main(dist, lambda: _new_run_directory(cfg, run)), dist)  # every rank: for RunWriteError
    # run.data: without the validation records (cfg.validation_fraction)
    sampler = run_sampler(run, dist)
    try:
        return _run(run, run_dir, sampler, LoopState(segment_start=start), start, on_step, segments=[new_segment(0)])
    except BaseException as exc:
        if run_dir is not None and len(run.ledger) == 0:  # nothing released: no half-made run directory is left
            if dist.is_main:
                _discard_unstarted(run_dir)
        elif run_dir is not None and isinstance(exc, OSError):  # releases charged: say which directory holds them
            raise RunWriteError(exc, run_dir) from exc
        raise


def _discard_unstarted(run_dir: Path) -> None:
    """Remove what a run that failed before its first release wrote (config.json, a header-only journal).

    Without it the same ``out`` was refused ("already holds a run") although no step was trained.
    """
    for name in ("config.json", JOURNAL_NAME, JOURNAL_NAME + ".tmp", "metrics.jsonl"):
        try:
            (run_dir / name).unlink(missing_ok=True)
        except OSError:
            pass


def _new_run_directory(cfg: TrainConfig, run: Run) -> Path:
    run_dir = run_directory(cfg)
    write_config(run_dir, run)
    return run_dir


def share_path(path: Optional[Path], dist: DistributedContext) -> Optional[Path]:
    """Rank 0's ``path`` on every rank (one broadcast; ``path`` itself for one process).

    The other ranks need the run directory to report a failed write of rank 0 as a
    :class:`~dpopt.errors.RunWriteError` (a default directory is named after rank 0's clock).
    A collective: every rank of ``dist`` must call it, in the same order relative to
    the run's other collectives.

    Args:
        path: rank 0's run directory (what the other ranks pass is ignored), or None.
        dist: the run's :class:`~dpopt.distributed.DistributedContext`.

    Returns:
        Rank 0's ``path`` (None where rank 0 has none).

    Raises:
        RuntimeError: from ``torch.distributed`` if a rank does not take part.
    """
    if not dist.enabled:
        return path
    import torch.distributed as tdist

    box = [str(path) if dist.is_main and path is not None else None]
    src = tdist.get_global_rank(dist.group, 0) if dist.group is not None else 0
    tdist.broadcast_object_list(box, src=src, group=dist.group)
    return None if box[0] is None else Path(box[0])


def _on_main(dist: DistributedContext, fn: Callable):
    """``fn()`` on rank 0 only (None elsewhere); if it raises, every rank raises (no rank waits forever)."""
    if not dist.enabled:
        return fn()
    result, error = None, None
    if dist.is_main:
        try:
            result = fn()
        except Exception as exc:  # re-raised below, after the other ranks know
            error = exc
    if any_rank(error is not None, dist):
        if error is not None:
            raise error
        raise RuntimeError("rank 0 failed to set up the run (its error is reported there)")
    return result


def _run(
    run: Run,
    run_dir: Optional[Path],
    sampler: PoissonSampler,
    state: LoopState,
    start: float,
    on_step,
    extra: Optional[dict] = None,
    segments: Optional[list] = None,
) -> dict:
    dist = run.dist
    # only rank 0 writes; a journal it cannot open stops every rank (none waits in the loop's collectives)
    files = _on_main(dist, lambda: RunFiles(cast(Path, run_dir), run, segments=segments))
    extra = dict(extra or {}, segments=list(segments or []))
    tracker = EpsilonTracker(run.cfg.delta, run.cfg.accountant, run.cfg.max_epsilon)
    with graceful_stop() as stop:
        metrics = run_steps(
            run,
            on_step if dist.is_main else None,
            files=files,
            state=state,
            sampler=sampler,
            stop=stop,
            tracker=tracker,
        )
    if dist.enabled:
        if not check_replicas([p for p in run.model.parameters()] + list(run.model.buffers()), dist):
            raise RuntimeError(
                "data-parallel replicas diverged: the ranks hold different parameters after "
                "the run (the all-reduce should make every update identical)"
            )
        extra = dict(extra or {}, world_size=dist.world_size)
        if not dist.is_main:
            return {"rank": dist.rank, "world_size": dist.world_size, "steps": len(run.ledger), "run_dir": None}
    return write_results(
        cast(Path, run_dir),
        run,
        metrics,
        start - state.wall_seconds,
        status=state.status,
        stop_signal=state.stop_signal,
        streamed=True,
        epsilon=tracker.epsilon(run.ledger),
        extra=extra,
    )


def resume(
    run_dir: Union[str, Path],
    data: Optional[Dataset] = None,
    on_step: Optional[Callable[[dict], None]] = None,
    *,
    device: Optional[str] = None,
    repair_journal: bool = False,
) -> dict:
    """Continue an interrupted (or budget-stopped) run from its checkpoint to its planned steps.

    The configuration is the run's own (saved in ``checkpoint.pt``; only the
    ``device`` may change). Model, optimizer and every transform's state, the
    Privatizer (step counter, clip bound(s), clip history), the sampler's
    position and the non-secret RNGs are restored; the ledger is read from the
    journal and appended to. The secret noise generator is NOT restored: a new
    one is seeded from OS entropy. With ``reproducible_noise`` its saved state
    is restored, so the resumed run ends with the parameters an uninterrupted
    run would have.

    Data parallel (under ``torchrun``, or with a process group initialised):
    every rank reads the checkpoint and the journal (on several nodes the run
    directory must be on storage they share) and restores the same state; rank
    0's secret generator is re-seeded from OS entropy like every other rank's,
    and only rank 0 writes. The number of processes may differ from the
    interrupted run's (each rank samples its shard at q: the union is Poisson
    sampling at q whatever the number of shards).

    If the journal holds releases made after the checkpoint (a run killed
    without a clean stop, an older checkpoint put back, a branch trained from
    it), they stay in the ledger — they were released and may have reached a
    file — with a warning, and are reported as ``lost_steps``: the steps after
    the checkpoint are trained again and charged again. A checkpoint whose
    run id (``checkpoint.pt`` ``run_id``) is not the journal's is refused.

    The run id (the ledger header's, ``ledger_run_id`` in ``summary.json``) is made once per
    run: a copied run directory keeps it, and each copy resumed continues its
    own ledger — ``dpopt check COPY_A COPY_B`` reports the shared id and, when
    both were trained further, fails them with the ε of both branches together.

    Args:
        run_dir: the run directory (with ``checkpoint.pt`` and ``ledger.jsonl``).
        data: the loaded dataset (loaded from the saved config if None).
        on_step: as for :func:`train`.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` to override the saved device.
        repair_journal: if the journal has damaged lines, rewrite it first from its readable lines,
            charging every release a damaged line may have held
            (:func:`~dpopt.accounting.journal_repair.repair_journal`; the original is kept as
            ``ledger.jsonl.damaged``; warned, and recorded as ``journal_repair`` in the summary).
            Without it a damaged journal is refused (:class:`~dpopt.accounting.ledger.JournalDamaged`).

    Returns:
        The summary, as :func:`train` returns it (``wall_seconds`` over all segments).

    Raises:
        FileNotFoundError: no checkpoint or ledger journal in ``run_dir``.
        ValueError: a checkpoint that does not fit the run it describes.
        RunWriteError: a write failed while training (disk full, ...); ``run_dir`` is the run's.
    """
    start = time.perf_counter()
    run_dir = Path(run_dir)
    ckpt = load_checkpoint(run_dir)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in ckpt["config"].items() if k in fields})
    cfg.out, cfg.overwrite = str(run_dir), False
    if device is not None:
        cfg.device = device
    check_extras(cfg)  # tensorboard / prv-accountant: refused before anything is rewritten
    dist = setup(resolve_device(cfg.device))  # torchrun / an initialised process group, else one process
    data = data or load_dataset(cfg.dataset, cfg.data_dir)
    with warnings.catch_warnings():
        if cfg.reproducible_noise:  # warned when the run was started; the ledger records it
            warnings.filterwarnings("ignore", message="reproducible_noise", category=UserWarning)
        run = build_run(cfg, data, dist=dist)
    journal = run_dir / JOURNAL_NAME
    if not journal.exists():
        raise FileNotFoundError(
            f"no ledger journal at {journal}: cannot resume without the record of the releases already made"
        )
    repaired = None
    if repair_journal:
        repaired = repair_journal_file(journal)
        if repaired.damaged_lines:
            warnings.warn(repaired.message(), UserWarning, stacklevel=2)
    saved = PrivacyLedger.load(journal)
    if (saved.neighbouring, saved.sampling, saved.dataset_size) != (
        run.ledger.neighbouring,
        run.ledger.sampling,
        run.ledger.dataset_size,
    ):
        raise ValueError(f"the ledger journal in {run_dir} does not fit the saved configuration")
    run.ledger.load_state_dict(saved.state_dict())  # the journal's run id too
    run.ledger.mark_noise(run.noise.mode)
    saved_id = ckpt.get("run_id")  # None: a checkpoint written before run ids
    if saved_id is not None and run.ledger.run_id is not None and saved_id != run.ledger.run_id:
        raise ValueError(
            f"the checkpoint in {run_dir} belongs to run {saved_id} but the ledger journal there to "
            f"run {run.ledger.run_id}: its model was trained with releases this journal does not hold "
            "(put back the run's own checkpoint.pt, or start a new run)"
        )
    position = int(ckpt["ledger_length"])
    if len(run.ledger) < position:
        raise ValueError(
            f"the ledger journal in {run_dir} has {len(run.ledger)} releases but the checkpoint "
            f"was written after {position}: the journal is damaged (refusing to under-count)"
        )
    run.model.load_state_dict(ckpt["model"])
    if run.averager is not None:  # the EMA continues (a checkpoint without one: refused, not restarted silently)
        if ckpt.get("averager") is None:
            raise ValueError(f"the checkpoint in {run_dir} has no EMA state for ema_decay {cfg.ema_decay}")
        run.averager.load_state_dict(ckpt["averager"])
    opt = run.optimizer
    opt.load_state_dict(dict(ckpt["optimizer"], privatizer=ckpt["privatizer"]))  # DPOptimizer.load_state_dict
    lost = run.ledger.entries_since(position)
    for entry in lost:  # released after the checkpoint by a run that was killed: still charged
        opt.privatizer.reads += int(entry.meta.get("reads", 0))
        opt.privatizer.releases += int(entry.meta.get("releases", 0))
    sampler = run_sampler(run, dist)
    sampler.load_state_dict(ckpt["sampler"])  # the position; the shared stream's state if reproducible
    load_rng_state(ckpt["rng"])
    state = LoopState.from_state(ckpt["loop"])
    state.segment_start = start  # checkpoints of this segment store the total over all segments
    done = finished_summary(run_dir) if state.step >= run.steps else None
    if done is not None:  # nothing left to train: leave every file as it is
        warnings.warn(
            f"{run_dir} is already complete ({state.step} of {run.steps} steps); nothing to resume",
            UserWarning,
            stacklevel=2,
        )
        return done
    remove_stale(run_dir, RUN_FILES + ("model_ema.pt",))  # NAME.tmp of a write cut short by a kill
    extra: dict = {"resumed_from_step": state.step}
    if repaired is not None and repaired.damaged_lines:
        extra["journal_repair"] = {"damaged_lines": list(repaired.damaged_lines), "charged": repaired.charged}
    if lost:
        warnings.warn(
            f"the ledger journal holds {len(lost)} releases after this checkpoint (step {state.step}): "
            "a run killed after it, an older checkpoint put back, or another branch of this run "
            "directory. They stay charged (the ledger never loses an entry) and those steps are "
            "trained again",
            UserWarning,
            stacklevel=2,
        )
        extra["lost_steps"] = len(lost)
    if dist.enabled:  # every rank has read the checkpoint and journal before rank 0 rewrites them
        any_rank(False, dist)
    segments = list(ckpt.get("segments") or []) + [new_segment(state.step)]
    try:
        return _run(run, run_dir, sampler, state, start, on_step, extra=extra, segments=segments)
    except OSError as exc:  # a failed write (disk full): the directory, to say how it goes on
        raise RunWriteError(exc, run_dir) from exc
