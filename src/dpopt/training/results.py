"""Writing the run directory: config.json, metrics.jsonl, ledger.jsonl/ledger.json, checkpoint.pt, model.pt,
summary.json, check.txt.

Written as the run goes (:class:`RunFiles`): the ledger journal ``ledger.jsonl``
(appended and fsync'd at least every :data:`~dpopt.training.loop.LEDGER_FLUSH_EVERY`
steps and always before a file that depends on a release), ``metrics.jsonl``
(a row per epoch, appended), ``checkpoint.pt`` (:mod:`.checkpoint`). When the
run stops (completed, interrupted or at its ε budget): ``ledger.json``,
``model.pt``, ``check.txt`` and ``summary.json`` (with ``"status"``:
``"completed"``, ``"interrupted"`` or ``"budget_exhausted"``, and ``"planned_steps"``;
summaries written before every run recorded a status have none, which
:func:`finished_summary` reads as completed). JSON files and checkpoints are replaced atomically (write, then
rename). JSON is strict (:mod:`dpopt.jsonio`): a non-finite number is written as
the string ``"inf"``, ``"-inf"`` or ``"nan"`` (e.g. ``"epsilon": "inf"`` at σ = 0).

Everything written is public configuration, released values (the model,
test-set metrics computed from it) and accountant output only; with
``validation_fraction`` > 0 also ``val_accuracy`` / ``val_loss`` on the held-out
validation records, which (like the test set) get no protection. The dataset
size N is treated as public when the sample rate is derived as q = B̄/N (the
run files then reveal N); give ``sample_rate`` to avoid that.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ..accounting.ledger import JOURNAL_NAME, PrivacyLedger
from ..accounting.ledger_check import check_ledger
from ..accounting.run_continuation import continuation
from ..atomic import append_whole, atomic_write, atomic_write_text, check_writable_dir
from ..errors import ConfigError
from ..jsonio import dumps, loads
from ..models import num_parameters
from ..reports.curves import CURVES_NAME, write_curves
from ..reports.tensorboard import TensorBoardLogger
from ..transforms.muon_auto import HISTORY_FILE, write_history
from .build import Run
from .checkpoint import CHECKPOINT_NAME, rng_state, save_checkpoint
from .config import TrainConfig

__all__ = [
    "RUN_FILES",
    "run_directory",
    "write_config",
    "write_results",
    "RunFiles",
    "check_extras",
    "atomic_write_text",
    "finished_summary",
    "new_segment",
]

RUN_FILES = (
    "config.json",
    "metrics.jsonl",
    "ledger.json",
    "model.pt",
    "summary.json",
    "check.txt",
    JOURNAL_NAME,
    CHECKPOINT_NAME,
    HISTORY_FILE,
    CURVES_NAME,
)


def new_segment(from_step: int) -> dict:
    """A training segment of a run: ``{"id": 12 random hex digits (OS entropy), "from_step": step}``.

    A run is one segment, plus one per resume. ``summary.json`` and ``checkpoint.pt`` list them
    (``"segments"``): a copy of a run directory resumed in two places shows two different last
    segments from the same step, which the ledger entries alone cannot show (same schedule, same
    events). Public: random ids and step numbers, nothing about the data.
    """
    return {"id": uuid.uuid4().hex[:12], "from_step": int(from_step)}


def finished_summary(run_dir: Union[str, Path], statuses: tuple = ("completed",)) -> Optional[dict]:
    """``run_dir/summary.json`` if it exists, parses, and its ``status`` is in ``statuses`` (a summary
    without ``status`` is a completed run); else None."""
    try:
        summary = loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if summary.get("status", "completed") in statuses else None


def _default_directory(cfg: TrainConfig) -> Path:
    """``runs/METHOD-DATASET-sSEED-YYYYmmdd-HHMMSS``, with ``-2``, ``-3``, ... when that name is taken (two
    runs started within one second would otherwise meet at one name, and the second be refused)."""
    base = Path("runs") / f"{cfg.method}-{cfg.dataset}-s{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    return path


def run_directory(cfg: TrainConfig) -> Path:
    """The run directory, created; refuses a file, or a directory holding another run.

    With ``overwrite`` the earlier run's files are removed first, except a ledger journal that holds
    charged releases: it is moved to ``ledger-replaced-RUNID.jsonl`` with a warning (those releases still
    count against the data's budget; ``dpopt ledger`` scores the file).

    Raises:
        ConfigError: ``out`` is a file, already holds a run (allow ``overwrite``; a run that stopped before
            its end: the message says how it goes on), or cannot be created.
    """
    path = Path(cfg.out) if cfg.out else _default_directory(cfg)
    check_extras(cfg)  # before anything is written: a missing package never leaves a half-made run directory
    if path.exists() and not path.is_dir():
        raise ConfigError(f"out {path} is a file; give a directory for the run", "out")
    if not cfg.overwrite and any((path / name).exists() for name in RUN_FILES):
        stopped = "" if (path / "summary.json").exists() else _how_on(path)
        raise ConfigError(
            f"out {path} already holds a run{stopped}; choose a new directory or allow overwrite", "out", "overwrite"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the run directory {path}: {exc.strerror or exc}", "out") from None
    if cfg.overwrite:  # clear the earlier run before writing anything: no mixed directory
        _keep_journal_aside(path)
        for name in RUN_FILES:
            for victim in (path / name, path / (name + ".tmp")):
                if victim.is_file():
                    victim.unlink()
    return path


def _how_on(path: Path) -> str:
    """`` (it stopped before its end: HOW IT GOES ON)`` for a run in ``path`` with journaled releases and no
    ``summary.json`` (:func:`~dpopt.accounting.run_continuation.continuation`); '' when its journal holds none."""
    how = continuation(path)
    if how.releases == 0:
        return ""
    advice = how.advice()
    return f" (it stopped before its end: {advice[0].lower() + advice[1:]})"


def _keep_journal_aside(path: Path) -> Optional[Path]:
    """Before ``overwrite`` clears ``path``: move a journal that holds charged releases to
    ``ledger-replaced-RUNID.jsonl`` (warned), so the record of what the data was charged is never deleted.

    Returns the new path, or None when there was no journal or it held no release (it is then removed with
    the other run files). A journal that cannot be read is kept aside too (its releases cannot be counted).
    """
    journal = path / JOURNAL_NAME
    if not journal.is_file():
        return None
    try:
        saved: Optional[PrivacyLedger] = PrivacyLedger.load(journal)
    except (OSError, ValueError):
        saved = None
    if saved is not None and len(saved) == 0:
        return None
    name = (saved.run_id if saved is not None else None) or time.strftime("%Y%m%d-%H%M%S")
    aside, k = path / f"ledger-replaced-{name}.jsonl", 1
    while aside.exists():  # a copy of the same run overwritten twice: never replace a kept journal
        k += 1
        aside = path / f"ledger-replaced-{name}-{k}.jsonl"
    os.replace(journal, aside)
    held = "an unreadable number of" if saved is None else str(len(saved))
    warnings.warn(
        f"overwrite: the earlier run's journal in {path} held {held} charged release(s), which still count "
        f"against the data's privacy budget (a new run's ε adds to them); it is kept as {aside.name} (its other "
        "files are replaced)",
        UserWarning,
        stacklevel=3,
    )
    return aside


def check_extras(cfg: TrainConfig) -> None:
    """Check the optional packages and extra output directories a run needs, before its directory is made.

    ``tensorboard``: the package must import and the log directory must be writable (it is created);
    ``accountant="prv"``: the ``prv-accountant`` package must import. Checked at the start so that a
    missing package or an unwritable directory never leaves a run directory holding only
    ``config.json`` and a header-only ledger (which the next run with the same ``out`` would refuse).

    Raises:
        ConfigError: naming ``tensorboard`` or ``accountant``, with what to install or change.
    """
    if cfg.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise ConfigError(
                "tensorboard needs the tensorboard package: pip install tensorboard (or dpopt[logging]), "
                "or leave tensorboard out",
                "tensorboard",
            ) from None
        try:
            check_writable_dir(cfg.tensorboard)
        except OSError as exc:
            raise ConfigError(
                f"tensorboard: cannot write the log directory {cfg.tensorboard} ({exc.strerror or exc}); "
                "choose a directory this user can write",
                "tensorboard",
            ) from None
    if str(cfg.accountant).lower() == "prv":
        from ..accounting.prv import prv_available

        if not prv_available():
            raise ConfigError(
                "accountant 'prv' needs the prv-accountant package: pip install prv-accountant, or use "
                "accountant 'pld'",
                "accountant",
            )


def write_config(run_dir: Path, run: Run) -> None:
    """``config.json``: the configuration as run (model, resolved hyperparameters, σ used, q, steps)."""
    hp = run.hparams
    config = dict(
        asdict(run.cfg),
        model=run.model_name,
        hparams=dict(hp),
        noise_multiplier=run.noise_multiplier,
        max_grad_norm=hp["max_grad_norm"],
        lr=hp["lr"],
        sample_rate=run.sample_rate,
        steps=run.steps,
        num_parameters=num_parameters(run.model),
        **run.privacy_facts,
    )
    atomic_write_text(run_dir / "config.json", dumps(config, indent=2, default=str))


class RunFiles:
    """The files a run writes as it goes; the ledger is flushed before anything that depends on it.

    Args:
        run_dir: the run directory.
        run: the run.
        resumed: the journal already holds the ledger's entries (a resumed run;
            the journal is rewritten once, dropping a torn last line).
    """

    def __init__(self, run_dir: Path, run: Run, *, resumed: bool = False, segments: Optional[list] = None):
        self.run_dir, self.run = Path(run_dir), run
        self.segments = list(segments or [])  # this run's training segments (:func:`new_segment`), checkpointed
        tb = run.cfg.tensorboard
        self.tensorboard = TensorBoardLogger(tb) if tb else None  # public scalars per metrics row
        run.ledger.open_journal(self.run_dir / JOURNAL_NAME, rewrite=True)

    def flush(self) -> None:
        """Append new ledger entries to the journal (fsync'd)."""
        self.run.ledger.flush()

    def metric(self, row: dict) -> None:
        """Append one metrics row (after flushing the ledger it depends on)."""
        self.flush()
        append_whole(self.run_dir / "metrics.jsonl", (dumps(row) + "\n").encode())  # a whole line, or none
        if self.tensorboard is not None:
            self.tensorboard.log(row, self.run.optimizer)

    def checkpoint(self, state, sampler) -> None:
        """Write ``checkpoint.pt`` (after flushing the ledger)."""
        run = self.run
        self.flush()
        optimizer = run.optimizer.state_dict(include_ledger=False)  # transforms + Privatizer, one mechanism
        privatizer = optimizer.pop("privatizer")  # kept as its own key of the checkpoint
        save_checkpoint(
            self.run_dir / CHECKPOINT_NAME,
            {
                "config": asdict(run.cfg),
                "step": state.step,
                "ledger_length": len(run.ledger),
                "run_id": run.ledger.run_id,
                "segments": self.segments,
                "model": run.model.state_dict(),
                "optimizer": optimizer,
                "privatizer": privatizer,
                "sampler": sampler.state_dict(),
                "rng": rng_state(),
                "loop": state.state_dict(),
                "averager": None if run.averager is None else run.averager.state_dict(),
            },
        )


def write_results(
    run_dir: Path,
    run: Run,
    metrics: list[dict],
    start: float,
    *,
    status: str = "completed",
    stop_signal: Optional[str] = None,
    streamed: bool = False,
    epsilon: Optional[float] = None,
    extra: Optional[dict] = None,
) -> dict:
    """Write metrics, ledger, model, check and summary; return the summary (public values only).

    Args:
        run_dir: the run directory (:func:`run_directory`).
        run: the trained run.
        metrics: the per-epoch rows of :func:`~dpopt.training.loop.run_steps` (the last one
            closes the final step: no second evaluation).
        start: ``time.perf_counter()`` when the run began (for ``wall_seconds``), or minus the
            seconds of earlier segments for a resumed run.
        status: ``"completed"``, ``"interrupted"`` or ``"budget_exhausted"`` (recorded in every summary,
            with ``planned_steps``; ``stop_signal`` names the signal of an interruption).
        streamed: the metrics rows are already in ``metrics.jsonl`` (:class:`RunFiles`).
        epsilon: ε of the whole ledger if already computed (else the last row's).
        extra: more public summary fields.
    """
    cfg, hp, ledger, opt = run.cfg, run.hparams, run.ledger, run.optimizer
    ledger.flush()
    ledger.delta = float(cfg.delta)  # ledger.json states the run's delta (`dpopt ledger` on the file alone)
    if not streamed:
        with open(run_dir / "metrics.jsonl", "w") as fh:
            for row in metrics:
                fh.write(dumps(row) + "\n")
    ledger.save(run_dir / "ledger.json")
    atomic_write(run_dir / "model.pt", lambda fh: torch.save(run.model.state_dict(), fh), binary=True)
    if run.averager is not None:  # the EMA of the released parameters (post-processing), beside the raw model
        ema_state = run.averager.averaged_state_dict(run.model)
        atomic_write(run_dir / "model_ema.pt", lambda fh: torch.save(ema_state, fh), binary=True)
    # dp-muon-auto's per-layer on/off decisions (functions of released momenta only); no-op otherwise
    write_history(run_dir, run.optimizer, [n for n, p in run.model.named_parameters() if p.requires_grad])
    final = metrics[-1]  # the last step always closes a metrics row: no second evaluation
    acc, test_loss, eps = final["test_accuracy"], final["test_loss"], final["epsilon"]
    if epsilon is not None:
        eps = epsilon
    summary: dict[str, Any] = {
        # the ledger header's run_id (random, made once per run; copies of a run share it). Not "run_id":
        # a sweep's results.jsonl record is this summary plus the sweep's own "run_id" (its grid point)
        "ledger_run_id": ledger.run_id,
        "method": cfg.method,
        "dataset": cfg.dataset,
        "model": run.model_name,
        "test_accuracy": acc,
        "test_loss": test_loss,
        "epsilon": eps,
        "delta": cfg.delta,
        "noise_multiplier": run.noise_multiplier,
        "max_grad_norm": hp["max_grad_norm"],
        "clipping": cfg.clipping,
        # cyclic batches (correlated noise, no amplification) sample nothing: B̄/N is no sampling rate
        "sample_rate": None if run.privacy_facts.get("sampling") == "cyclic" else run.sample_rate,
        # the divisor the run used: B̄, or N/b (cyclic batches), q·N/b' (cyclic Poisson)
        "expected_batch_size": run.expected_batch_size
        if run.expected_batch_size is not None
        else float(cfg.batch_size),
        "steps": len(ledger),
        "epochs": cfg.epochs,
        "lr": hp["lr"],
        "accountant": cfg.accountant,
        "seed": cfg.seed,
        "num_parameters": num_parameters(run.model),
        "noise": run.noise.mode,
        "dataset_size": ledger.dataset_size,
        "privatizer_reads": opt.privatizer.reads,
        "privatizer_releases": opt.privatizer.releases,
        "wall_seconds": time.perf_counter() - start,
        "run_dir": str(run_dir),
        **run.privacy_facts,
    }
    summary.update(status=status, planned_steps=run.steps)  # every summary says how the run ended
    if status != "completed":
        if stop_signal:
            summary["stop_signal"] = stop_signal
    if cfg.max_epsilon is not None:
        summary["max_epsilon"] = cfg.max_epsilon
    if cfg.validation_fraction:
        summary["validation_fraction"] = cfg.validation_fraction
    if "val_accuracy" in final:  # held-out training records: never trained on, no protection (like test)
        summary.update(val_accuracy=final["val_accuracy"], val_loss=final["val_loss"])
    if run.averager is not None:  # the EMA model's metrics (model_ema.pt), from the same final row
        summary.update(ema_decay=cfg.ema_decay, **{k: v for k, v in final.items() if k.startswith("ema_")})
    if cfg.augmentation_multiplicity > 1 or cfg.augment not in (None, "none"):
        summary.update(augmentation_multiplicity=cfg.augmentation_multiplicity, augment=cfg.augment or "crop-flip")
    if cfg.lr_schedule != "constant" or cfg.warmup_steps:
        summary.update(lr_schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps)
    summary.update(extra or {})
    if run.calibration is not None:
        summary.update(target_epsilon=cfg.target_epsilon, calibrated_epsilon=run.calibration.epsilon)
    if opt.privatizer.quantile is not None:
        summary["final_max_grad_norm"] = opt.privatizer.max_grad_norm
    check = check_ledger(ledger, summary)
    summary["check"] = "pass" if check.passed else "FAIL: " + ", ".join(check.failures)
    atomic_write_text(run_dir / "check.txt", check.format() + "\n")
    atomic_write_text(run_dir / "summary.json", dumps(summary, indent=2))
    write_curves(run_dir)  # curves.png: test accuracy, test loss and ε against step (needs matplotlib)
    return summary
