"""The step loop: Poisson-sample → per-sample sources → ``DPOptimizer.step`` → evaluation, ε, run files.

One logical step (DESIGN.md): Poisson-sample a batch (public q) → evaluate
per-sample gradients where the optimizer asks (``evaluation_points``) in
micro-batches of at most ``physical_batch_size`` → ``DPOptimizer.step`` (the
Privatizer releases once and records the step in the ledger) → post-processing.
ε is always computed by one accountant over the whole ledger
(:class:`~dpopt.accounting.incremental.EpsilonTracker` caches it).

Between steps the loop (:func:`run_steps`) may stop early: a stop signal
(:mod:`.signals`, ``status = "interrupted"``) or the ε budget
(``cfg.max_epsilon``: the next release would take the run's ε past it, decided
with the run's own accountant; ``status = "budget_exhausted"``). It writes as
it goes through a ``files`` object (:class:`~dpopt.training.results.RunFiles`):
ledger journal flushes every :data:`LEDGER_FLUSH_EVERY` steps, a metrics row
per epoch (and per ``cfg.log_every`` steps), checkpoints — always flushing the
ledger before anything that depends on a release.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..accounting.incremental import EpsilonTracker
from ..augment import ViewBatches
from ..distributed import DistributedContext, backend_device
from ..engine import iter_per_sample_sources
from ..lr_schedules import apply_lr
from ..sampling import PoissonSampler
from ..users import user_sources
from .build import Run, run_sampler
from .config import epoch_end_step
from .signals import StopRequest

__all__ = ["evaluate", "run_steps", "LOSS_EVERY", "LEDGER_FLUSH_EVERY", "LoopState"]

LOSS_EVERY = 10  # show_train_loss: the (NON-PRIVATE) batch loss is refreshed every 10 steps
LEDGER_FLUSH_EVERY = 50  # the ledger journal is flushed at least this often (and before any dependent file)


def _agree(requested: bool, error: Optional[OSError], dist: DistributedContext) -> bool:
    """Whether some rank has a stop request (one all-reduce of two numbers, every rank). Rank 0's failed
    write (``error``) stops every rank here, after the same release: rank 0 raises it, the others an
    ``OSError`` with its ``errno`` (their front ends wrap it as a :class:`~dpopt.errors.RunWriteError`, so
    every rank reports the run directory and how it goes on; none is left waiting in a collective).

    Raises:
        OSError: some rank's write failed (on that rank: its own error).
    """
    code = 0.0 if error is None else float((error.errno or 0) + 1)  # errno + 1: an OSError without errno counts
    flags = dist.all_reduce(
        torch.tensor([float(requested), code], dtype=torch.float64, device=backend_device(dist)), op="max"
    )
    if flags[1] > 0:
        if error is not None:
            raise error
        number = int(flags[1]) - 1 or None
        reason = os.strerror(number) if number else "a failed write"
        raise OSError(
            number, f"rank 0 could not write the run's files ({reason}): every rank stopped after the same release"
        )
    return bool(flags[0] > 0)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 2000) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on (x, y).

    Non-private: test data, or validation records held out of training (which
    get no protection either). Never the training records.
    """
    model.eval()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    correct, loss = 0, 0.0
    for i in range(0, len(x), batch):
        xb, yb = x[i : i + batch].to(device), y[i : i + batch].to(device)
        out = model(xb)
        loss += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    model.train()
    return correct / max(len(x), 1), loss / max(len(x), 1)


# the function itself, not a wrapper: the engine recognises it and computes the per-example losses in one
# batched call (dpopt.engine.row_losses) instead of torch.func.vmap of the single-example call
_loss = nn.functional.cross_entropy


@dataclass
class LoopState:
    """The loop's public counters (saved in checkpoints)."""

    step: int = 0  # logical steps completed
    next_epoch: int = 1
    metrics: list = field(default_factory=list)  # metrics rows written so far
    status: str = "running"  # running | completed | interrupted | budget_exhausted
    stop_signal: Optional[str] = None
    wall_seconds: float = 0.0  # of earlier segments (resumed runs)
    segment_start: Optional[float] = None  # time.perf_counter() when this segment began (not saved)

    def total_wall_seconds(self) -> float:
        """Seconds of every segment so far: the earlier ones plus this one up to now (if it has begun)."""
        now = 0.0 if self.segment_start is None else time.perf_counter() - self.segment_start
        return self.wall_seconds + now

    def state_dict(self) -> dict:
        """The counters for a checkpoint; ``wall_seconds`` is the total over all segments up to now."""
        return {
            "step": self.step,
            "next_epoch": self.next_epoch,
            "metrics": list(self.metrics),
            "wall_seconds": self.total_wall_seconds(),
        }

    @classmethod
    def from_state(cls, state: dict) -> "LoopState":
        return cls(
            step=int(state["step"]),
            next_epoch=int(state["next_epoch"]),
            metrics=list(state["metrics"]),
            wall_seconds=float(state.get("wall_seconds", 0.0)),
        )


def run_steps(
    run: Run,
    on_step: Optional[Callable[[dict], None]] = None,
    *,
    files=None,
    state: Optional[LoopState] = None,
    sampler: Optional[PoissonSampler] = None,
    stop: Optional[StopRequest] = None,
    tracker: Optional[EpsilonTracker] = None,
    batch_sources: Optional[Callable[[torch.Tensor, torch.Tensor], Iterable]] = None,
    evaluate_on_every_rank: bool = False,
) -> list[dict]:
    """Train ``run`` up to ``run.steps`` logical steps; return the metrics rows.

    After each epoch (and always after the last step, or at an early stop) ε
    of the whole ledger and the test-set accuracy and loss are computed. Epoch
    k ends after step ``round(k / q)`` (:func:`~dpopt.training.config.epoch_end_step`,
    the rounding of the planned steps ``round(epochs / q)``: a 1-epoch run and the
    first epoch of a 3-epoch run have the same steps); a last epoch cut short by
    the planned steps (fractional ``epochs``) is labelled ``epochs``. The
    rows are ``{"epoch", "step", "test_accuracy", "test_loss", "epsilon"}``, plus
    ``"val_accuracy"``, ``"val_loss"`` when ``run.data`` has a validation split
    (``cfg.validation_fraction``; those records get no protection) —
    public values only (an early stop's row has the fractional epoch and
    ``"status"``; ``cfg.log_every`` rows have ``"log": true``). ``on_step``
    is called after every step as documented in :func:`~dpopt.training.train`.

    Args:
        files: where to write as the run goes (:class:`~dpopt.training.results.RunFiles`; None: nothing).
        state: the loop counters to continue from (a resumed run), else a new run.
        sampler: the Poisson sampler (restored position for a resumed run).
        stop: a :class:`~dpopt.training.signals.StopRequest` checked between steps.
        tracker: the ε cache (one is made from the config if None).
        batch_sources: ``(x, y) → per-sample sources`` of a sampled batch, consumed by
            ``DPOptimizer.step`` (default: :func:`~dpopt.engine.iter_per_sample_sources` in
            micro-batches of ``cfg.physical_batch_size`` at the optimizer's evaluation points, or
            per user with ``cfg.user_ids``); a sharded model (:mod:`dpopt.fsdp_train`) gives its own.
            They are evaluated at the current parameters: only for methods whose
            ``evaluation_points`` is θ alone (the FSDP door refuses the others).
        evaluate_on_every_rank: every rank runs the evaluation forwards (a sharded model's forward
            passes are collectives); rank 0 alone still records rows, ε and ``on_step``.

    ``state.status`` says how the loop ended: ``"completed"``, ``"interrupted"``
    or ``"budget_exhausted"``.

    Data parallel (``run.dist`` with several ranks, :mod:`dpopt.distributed`):
    ``sampler`` draws this rank's shard; a stop signal on any rank stops every
    rank after the same step; only rank 0 evaluates, records metrics rows and
    calls ``on_step`` (give ``files`` on rank 0 only). A write of rank 0 that
    fails (disk full) is held to the next step's agreement (or the one after
    the last writes), where every rank raises after the same release: rank 0
    its ``OSError``, the others an ``OSError`` with its ``errno``.
    """
    cfg, data, model, opt, ledger = run.cfg, run.data, run.model, run.optimizer, run.ledger
    dist = run.dist
    if not dist.is_main:
        on_step = None
    steps, sample_rate = run.steps, run.epoch_rate  # epochs per step (cyclic Poisson: not q)
    state = state or LoopState()
    tracker = tracker or EpsilonTracker(cfg.delta, cfg.accountant, cfg.max_epsilon)
    sampler = sampler or run_sampler(run, DistributedContext())
    every = cfg.checkpoint_every
    loss = float("nan")
    last = state.metrics[-1] if state.metrics else {}
    eps_now = last.get("epsilon")  # None until the first metrics row (on_step says so; it showed 0.000)

    def row(extra: dict) -> dict:
        nonlocal eps_now, last
        if not dist.is_main and not evaluate_on_every_rank:  # evaluation, metrics and ε display on rank 0 only
            return {}
        acc, test_loss = evaluate(model, data.x_test, data.y_test)
        r = {**extra, "step": state.step, "test_accuracy": acc, "test_loss": test_loss}
        if data.x_val is not None:  # held-out training records (validation_fraction): no protection, like test
            r["val_accuracy"], r["val_loss"] = evaluate(model, data.x_val, data.y_val)  # type: ignore[arg-type]
        if not dist.is_main:  # a sharded model: this rank's forwards were needed, its rows are not
            return {}
        eps_now = tracker.epsilon(ledger)
        if run.averager is not None:  # the EMA of the released parameters (post-processing), same test set
            with run.averager.swapped(model):
                r["ema_test_accuracy"], r["ema_test_loss"] = evaluate(model, data.x_test, data.y_test)
                if data.x_val is not None:
                    r["ema_val_accuracy"], r["ema_val_loss"] = evaluate(model, data.x_val, data.y_val)  # type: ignore[arg-type]
        r["epsilon"] = eps_now
        state.metrics.append(r)
        last = r
        if files is not None:
            write(lambda: files.metric(r))
        return r

    write_error: Optional[OSError] = None  # rank 0's failed write, held until every rank knows (data parallel)

    def write(fn: Callable[[], object]) -> None:
        """Rank 0's file write; data parallel: a failure is held (no more writes) until the next agreement."""
        nonlocal write_error
        if write_error is not None:
            return
        try:
            fn()
        except OSError as exc:
            if not dist.enabled:
                raise
            write_error = exc

    def checkpoint() -> None:
        if files is not None:
            write(lambda: files.checkpoint(state, sampler))

    k, augment = cfg.augmentation_multiplicity, cfg.augment  # views per example and their augmentation
    views = (
        ViewBatches(model, _loss, k, augment or "crop-flip", cfg.seed)
        if k > 1 or augment not in (None, "none")
        else None
    )
    scheduled = cfg.lr_schedule != "constant" or cfg.warmup_steps > 0

    try:
        while state.step < steps:
            requested = stop is not None and stop.requested
            if dist.enabled:  # every rank stops after the same step (one collective of two numbers)
                requested = _agree(requested, write_error, dist)
            if requested:
                state.status = "interrupted"
                state.stop_signal = (stop.name if stop is not None else None) or "SIGTERM"
                break
            if (
                cfg.max_epsilon is not None
                and tracker.releases_within_budget(ledger, opt.privatizer.step_event(), steps - state.step) < 1
            ):
                state.status = "budget_exhausted"
                break
            if scheduled:  # lr of this update from its (public) index: post-processing
                apply_lr(opt, state.step, steps, cfg.lr_schedule, cfg.warmup_steps)
            drawn = sampler.sample()
            idx, owners = drawn if isinstance(drawn, tuple) else (drawn, None)  # owners: user-level DP only
            x, y = data.x_train[idx].to(run.device), data.y_train[idx].to(run.device)
            step_model, step_loss, views_kw = model, _loss, {}
            if views is not None:  # K views per example (their mean gradient is clipped), docs/recipe.md
                step_model, step_loss, x, y, views_kw = views.batch(x, y, state.step)
            points = opt.evaluation_points()
            if batch_sources is not None:
                sources = batch_sources(x, y)
            elif owners is not None:  # each user's records averaged, then clipped as one unit (dpopt.users)
                sources = user_sources(
                    functools.partial(
                        iter_per_sample_sources,
                        model,
                        _loss,
                        points=points,
                        compile=cfg.compile,
                        norm_form=cfg.norm_form,
                    ),
                    x,
                    y,
                    owners,
                    cfg.physical_batch_size,
                )
            else:
                sources = iter_per_sample_sources(
                    step_model,
                    step_loss,
                    x,
                    y,
                    cfg.physical_batch_size,
                    points,
                    compile=cfg.compile,
                    norm_form=cfg.norm_form,
                    **views_kw,
                )
            opt.step(sources)
            if run.averager is not None:
                run.averager.update()  # reads the released parameters only
            state.step += 1
            step = state.step
            # epoch k ends after step round(k / q), the rounding of the planned steps (config.epoch_end_step)
            epoch_end = step >= epoch_end_step(state.next_epoch, sample_rate, steps)
            if files is not None and (ledger.unflushed >= LEDGER_FLUSH_EVERY or epoch_end):
                write(files.flush)
            if epoch_end:
                # a last epoch cut short by the planned steps (epochs 2.5: epochs 1, 2, then 2.5)
                row({"epoch": min(state.next_epoch, cfg.epochs)})
                state.next_epoch += 1
            elif cfg.log_every and step % cfg.log_every == 0:
                # public values only: the private batch loss (show_train_loss) goes to on_step, never to files
                row({"epoch": round(step * sample_rate, 6), "log": True})
            if (every is None and epoch_end) or (every and step % every == 0):
                checkpoint()
            if on_step is not None:
                info = {
                    "step": step,
                    "steps": steps,
                    "epsilon": eps_now,
                    "test_accuracy": last.get("test_accuracy"),
                    "test_loss": last.get("test_loss"),
                    "metrics_step": last.get("step"),  # the step those metrics are of (a resumed run: an earlier one)
                    "epsilon_bound": tracker.bound(ledger),
                    "accountant": cfg.accountant,
                }
                if cfg.show_train_loss:  # asked for: NOT private (an extra forward pass of the private batch)
                    if (step - 1) % LOSS_EVERY == 0 and len(x):
                        with torch.no_grad():
                            loss = float(_loss(model(x), y))
                    info["loss"] = loss
                on_step(info)
        else:
            state.status = "completed"
        if state.status != "completed" and (not state.metrics or state.metrics[-1]["step"] != state.step):
            row({"epoch": round(state.step * sample_rate, 6), "status": state.status})
        if files is not None:
            write(files.flush)
        checkpoint()
        if dist.enabled:  # the last writes: every rank raises if rank 0's failed (before any later collective)
            _agree(False, write_error, dist)
    except BaseException:
        if files is not None:  # whatever happened: every release made goes on disk (never under-counted)
            try:
                files.flush()
            except OSError:  # the disk that failed the step's write: the first error is the one reported
                pass
        raise
    return state.metrics
