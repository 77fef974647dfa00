"""``PrivateOptimizer``: the optimizer :meth:`PrivacyEngine.make_private <dpopt.privacy_engine.PrivacyEngine.make_private>` returns.

``zero_grad`` / ``step`` of an ordinary loop, made DP: ``step()`` hands the
per-sample source captured by the model's hooks to the ONE Privatizer of the
dpopt optimizer it wraps (one release, one ledger entry), writes the release
into ``p.grad`` and steps the user's optimizer or the method's chain. Opacus's
micro-batch protocol (``signal_skip_step``, :mod:`dpopt.release_boundary`),
settable σ/C for the next release, and ``state_dict`` with the ledger
(:mod:`dpopt.checkpoint`) live here. The front door that builds it is
:mod:`dpopt.privacy_engine` (module docstring: what happens where).
"""

from __future__ import annotations

import math
import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from .accounting.validation import check_noise_multiplier
from .augment import ViewCollate
from .checkpoint import CHECKPOINT_VERSION, recorded_journal
from .data_loader import DPDataLoader
from .engine.hooks import HookCapture, grad_sample_source
from .errors import LedgerWriteError
from .opacus_compat import LossReductionWatch
from .optim import DPOptimizer
from .privatizer import Privatizer
from .release_boundary import ReleaseBoundary, boundary_of
from .types import ClipGeometry

if TYPE_CHECKING:
    from .privacy_engine import PrivacyEngine

__all__ = ["PrivateOptimizer"]


class PrivateOptimizer(torch.optim.Optimizer):
    """The optimizer ``make_private`` returns: ``zero_grad`` / ``step`` of an ordinary loop, made DP.

    Shares ``param_groups``, ``state`` and ``defaults`` with the wrapped
    optimizer (LR schedulers built on either work). ``step()`` reads the
    per-sample gradients of the last forward/backward (or ``p.grad_sample``
    where every trainable parameter has one), privatizes them once (one ledger
    entry), writes the release into ``p.grad`` and steps the wrapped optimizer
    (a ``torch.optim.Optimizer``) or the dpopt method's chain.

    Attributes:
        original_optimizer: the wrapped optimizer (the user's, or the dpopt
            :class:`~dpopt.optim.DPOptimizer` of a method name).
        privatizer: the Privatizer (public config: ``noise_multiplier``,
            ``max_grad_norm``, ``expected_batch_size``, ``sample_rate``).
        expected_batch_size, noise_multiplier, max_grad_norm: as in Opacus (public).
    """

    def __init__(
        self,
        original: torch.optim.Optimizer,
        dp: DPOptimizer,
        capture: HookCapture,
        params: Sequence[torch.Tensor],
        engine: Optional["PrivacyEngine"] = None,
    ):
        super().__init__(list(params), {})
        self._engine = engine  # the PrivacyEngine whose ledger the Privatizer records in (state travels there)
        self.original_optimizer = original
        self.param_groups = original.param_groups
        self.state = original.state
        self.defaults = original.defaults
        self._dp = dp
        self._capture = capture
        # the model's hooks hold the capture's recorder, not this optimizer: when the optimizer goes (deleted,
        # never detached: a sweep, a notebook), its hooks leave the model instead of recording every later forward
        weakref.finalize(self, capture.detach)
        self._params = list(params)
        self._torch = original is not dp
        self._step_skip_queue: list[bool] = []  # Opacus's BatchMemoryManager protocol (signal_skip_step)
        self._is_last_step_skipped = False
        self._open = False  # a logical step is open in the Privatizer (chunks accumulated, not yet released)
        self.clip_range: tuple[float, float] = (0.0, math.inf)  # adaptive clipping's [min, max]_clipbound
        self._loss_watch: Optional[LossReductionWatch] = None  # until the first batch of >= 2 examples
        self._orphan = False  # a copy.deepcopy made without the model (its step() explains)
        self._loader: Optional[DPDataLoader] = None  # make_private's Poisson loader (K views: rows checked)
        self._examples: Optional[int] = 0  # examples accumulated in the open logical step (None: unknown)
        self._user_level = False  # privacy_unit="user": each chunk's rows are grouped per user before clipping
        # the last refused step's error (class, text), until a new backward or zero_grad (_refused_again)
        self._refusal: Optional[tuple[type, str]] = None

    def __getstate__(self) -> dict:  # torch keeps only defaults/state/param_groups: a copy could not step
        """Copies and pickles keep the whole optimizer; its secret noise re-seeds in the copy (dpopt.noise)."""
        state = dict(self.__dict__)
        state["_loss_watch"] = None  # hook handles of the first-batch check: not part of the optimizer's state
        state["_loader"] = None  # the loader holds the private dataset: never in a copy or a pickle
        state["_boundary"] = ReleaseBoundary()  # no open step, no private count in a copy
        state["_refusal"] = None  # the original's refused step is not the copy's
        return state

    def __deepcopy__(self, memo: dict) -> "PrivateOptimizer":
        """A copy; made WITH its model (``copy.deepcopy((model, optimizer))``) it trains the copied model.

        The optimizer's parameters and hooks belong to its model: copied
        alone, the copy holds a private copy of the model that no code can
        reach, so its ``step()`` raises saying so (rather than "no backward").
        A copy is a branch of the run: its engine's ledger holds the releases
        before the copy, and those the copy makes after it.
        """
        import copy

        model = getattr(self._capture, "model", None)
        orphan = model is not None and id(model) not in memo
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        new._orphan = orphan or self._orphan
        return new

    @property
    def privatizer(self) -> Privatizer:
        return self._dp.privatizer

    @property
    def expected_batch_size(self) -> float:
        return self._dp.privatizer.expected_batch_size

    @property
    def noise_multiplier(self) -> float:
        """σ of the next release (settable: Opacus's noise schedulers, :mod:`dpopt.schedulers`)."""
        return self._dp.privatizer.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        """Set σ for the NEXT release; the ledger records each release's σ, so ε stays exact.

        Raises:
            RuntimeError: between the chunks of one logical batch (BatchMemoryManager).
            ValueError: σ < 0 or not a number; 0 < σ < 0.0383 (the sampler's tail,
                :func:`dpopt.noise.check_tail_reach`); σ > 0 with an infinite bound; adaptive
                clipping (its σ is split between the gradient and the count releases).
        """
        priv = self._between_steps("noise_multiplier")
        if priv.quantile is not None:
            raise ValueError(
                "noise_multiplier cannot be changed with clipping='adaptive': the total sigma is split "
                "between the gradient and the clipped-count releases at make_private; make the engine "
                "again (or schedule max_grad_norm instead)"
            )
        sigma = check_noise_multiplier(value)
        priv.check_reach(sigma)
        if sigma > 0 and not math.isfinite(priv.sensitivity):
            raise ValueError("noise_multiplier > 0 needs a finite max_grad_norm (the noise std is sigma x C)")
        priv.noise_multiplier = sigma
        if self._engine is not None:  # the claim dpopt check compares each release with
            self._engine._claims.setdefault("noise_multiplier_schedule", []).append([len(priv.ledger), sigma])

    @property
    def max_grad_norm(self) -> float:
        """C of the next release (settable: Opacus's clip schedulers; per-layer: the total bound)."""
        return self._dp.privatizer.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        """Set C for the NEXT release: its clipping and its noise std σ·C (recorded in its ledger entry).

        Flat and adaptive clipping: the bound (adaptive clipping then adapts
        from it). Per-layer clipping: every per-layer bound is scaled so that
        the total √(Σ C_k²) is ``value``.

        Raises:
            RuntimeError: between the chunks of one logical batch (BatchMemoryManager).
            ValueError: C ≤ 0, NaN, or infinite while σ > 0.
        """
        priv = self._between_steps("max_grad_norm")
        c = float(value)
        if not c > 0 or math.isnan(c) or (priv.noise_multiplier > 0 and not math.isfinite(c)):
            raise ValueError(f"max_grad_norm must be > 0 (and finite when noise_multiplier > 0), got {value!r}")
        total = priv.sensitivity
        priv.bounds = [c] if len(priv.bounds) == 1 else [b * c / total for b in priv.bounds]

    def _between_steps(self, name: str) -> Privatizer:
        if self._open:
            raise RuntimeError(
                f"{name} changed between the physical chunks of one logical batch: the chunks "
                "already clipped used the old value. Change it after the logical step "
                "(scheduler.step() after the last chunk's optimizer.step())"
            )
        return self._dp.privatizer

    # -- Opacus's micro-batch protocol (BatchMemoryManager) ----------------------------
    @property
    def last_step_released(self) -> bool:
        """Whether the last ``step()`` released (ended a logical batch) rather than only adding a
        BatchMemoryManager chunk (Opacus: ``not optimizer._is_last_step_skipped``). Step a learning-rate
        scheduler and a parameter averager only when it is True: they count updates, not chunks."""
        return not self._is_last_step_skipped

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Queue whether the next ``step()`` only clips and adds its chunk (``True``) or ends the logical batch.

        Called by :class:`~dpopt.utils.batch_memory_manager.BatchMemoryManager`
        (and Opacus's) before each physical chunk. A skipped step adds the
        chunk's clipped per-sample gradients into the Privatizer's open step
        (no noise, no ledger entry, no parameter change); the next non-skipped
        step adds its own chunk and releases once.
        """
        self._step_skip_queue.append(bool(do_skip))

    def _check_skip_next_step(self, pop_next: bool = True) -> bool:
        """Whether the next ``step()`` is skipped (Opacus's name); pops the queue with ``pop_next``."""
        if not self._step_skip_queue:
            return False
        return self._step_skip_queue.pop(0) if pop_next else self._step_skip_queue[0]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero ``p.grad`` and ``p.grad_sample``; forget per-sample data of completed backward passes."""
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        for p in self._params:
            if getattr(p, "grad_sample", None) is not None:
                p.grad_sample = None  # type: ignore[attr-defined]
        self._capture.discard_completed()
        self._refusal = None

    def _refuse_if_detached(self) -> None:
        """Refuse a ``step()`` after ``engine.detach()`` (asked in :meth:`step` before the release boundary could
        give another reason, after a noted refusal's repeat: a refusal that detached the model itself, the
        compiled door's first-step check, is said again as it was): the per-sample hooks are gone.

        Raises:
            RuntimeError: the engine was detached and no ``p.grad_sample`` was set by the user (nothing released).
        """
        if getattr(self._capture, "detached", False) and grad_sample_source(self._params) is None:
            self._capture.reset()
            raise RuntimeError(
                "optimizer.step() after the PrivacyEngine was detached: engine.detach() removed the "
                "per-sample hooks from the model, so this optimizer captures no per-sample gradient and "
                "cannot release anything (nothing was released or charged). To train privately again, call "
                "engine.make_private(...) again and step the optimizer it returns; to train without privacy, "
                "step your original torch optimizer"
            )

    def _source(self) -> Any:
        src = grad_sample_source(self._params)
        if src is None:  # (a detached engine was refused in step(), before the boundary)
            if not self._capture.has_gradients():  # the loop's doing: an empty Poisson batch's backward counts
                raise RuntimeError(
                    "optimizer.step() without a backward pass since optimizer.zero_grad(): no "
                    "per-sample gradient was captured, so this step would release pure noise and "
                    "be charged for nothing. Call loss.backward() before optimizer.step() (an "
                    "empty batch's forward and backward are fine: they release noise, as they "
                    "must), and zero_grad() before the forward, not between backward and step"
                )
            self._refusal = None  # a new backward: judged afresh
            if getattr(self._capture, "defers_check", False):  # its largest check pass: after the sums (step)
                return self._capture.collect(defer_check=True)
            return self._capture.collect()
        self._refusal = None
        self._capture.reset()
        for p in self._params:
            p.grad_sample = None  # type: ignore[attr-defined]
        return src

    def _has_records(self) -> bool:
        """Whether a backward pass left per-sample records for a step: ``p.grad_sample`` on a trainable
        parameter, or gradients the model's hooks captured since the last step (:meth:`_source` reads them).

        Raises:
            ValueError: the compiled door was refused by a first-batch check (``HookCapture.has_gradients``).
        """
        return any(getattr(p, "grad_sample", None) is not None for p in self._params) or bool(
            self._capture.has_gradients()
        )

    def _note_refusal(self, err: Exception) -> None:
        """Remember a refused step's error as its class and text (public: what the user was shown; never the
        exception object, whose traceback holds the step's private records).

        Called once per refused step, by :meth:`step` (the one place that notes), for a step that had records:
        a refusal drops the step's records with it (nothing of a step outlives it, and nothing was released),
        so a ``step()`` repeated without a new backward finds none; it then raises this refusal again
        (:meth:`_refused_again`, never noted itself: its suffix is said once), the real reason, not "without a
        backward pass". A step refused without records is not noted: repeated, it is judged afresh on the same
        state. A new backward (judged afresh) or ``zero_grad()`` forgets it.
        """
        kept = (ValueError, RuntimeError, TypeError, LedgerWriteError)  # classes a user's except clause may name
        self._refusal = (type(err) if type(err) in kept else RuntimeError, str(err))

    def _refused_again(self) -> None:
        """Raise the last refused step's error again (:meth:`_note_refusal`), if no backward or zero_grad came since.

        Raises:
            ValueError, RuntimeError, TypeError, LedgerWriteError: the refusal's class (a failed ledger write
                stays a :class:`~dpopt.errors.LedgerWriteError`, an ``OSError``), its text and what to do.
        """
        if self._refusal is None:
            return
        cls, text = self._refusal
        raise cls(
            f"{text} [this step repeats a refused step without a new backward pass: the refusal above still "
            "holds, and the refused step's records were dropped with it (nothing was released); fix the cause, "
            "then zero_grad(), forward, backward and step()]"
        )

    def _check_views_match_the_batch(self, final: bool = True) -> None:
        """The open step's examples (rows / K) against the examples of the tagged chunks it stepped on.

        Both counts come from :func:`dpopt.release_boundary.boundary_of` (the
        chunk tags of the plain Poisson loader and of BatchMemoryManager alike).
        K = 1: more rows than examples (an example forwarded twice) is refused
        at every ``step()``; K > 1: rows / K must equal the examples at the end
        of the logical step (and never exceed them before).

        A loop that forwards the loader's B examples without repeating them
        K times would have K different examples averaged and clipped as one
        (and removing one example would regroup all the later ones): the
        sensitivity C, and so ε, would not hold.

        Raises:
            ValueError: rows / K ≠ the batch's examples (nothing is released).
        """
        views = getattr(self._capture, "views", 1)
        rows, n = boundary_of(self).counts()  # the same place on every path (release_boundary)
        if n is None or rows is None or rows == n:
            return
        if not final and views > 1 and rows < n:  # a chunk of a logical batch: K > 1 compared exactly at its end
            return
        if n == 0:  # an empty batch: nothing of it to repeat (the HF Trainers forward one public stand-in unit,
            return  # its loss × 0: K rows for DPDPOTrainer's pair)
        # the counts (realised batch sizes) are private: the messages name the mismatch, never the numbers
        if views == 1:
            if rows < n:  # fewer rows (a loop that drops some): each still clipped alone
                return
            raise ValueError(
                "this step's forward passes carried more rows than the data loader's last batch had examples: "
                "every row is clipped as its own example, so rows repeated from one example (augmented views) "
                "would move the release by more than max_grad_norm and the reported epsilon would not hold. For K "
                "views per example pass make_private(..., augmentation_multiplicity=K, augmentation='crop-flip' or "
                "your fn) and forward the loader's rows as they are. Other causes: rows of another loader (forward "
                "the batch the loader make_private returned hands you), or a chunk stepped twice; nothing was "
                "released"
            )
        if self._loader is not None and isinstance(self._loader.collate_fn, ViewCollate):  # the loader makes the views
            raise ValueError(
                f"augmentation_multiplicity={views}: this step's forward passes did not carry the data loader's "
                f"last batch as it was yielded: that loader already yields each example's {views} views "
                "(make_private's augmentation=); forward its rows as they are, without repeat_views; nothing was "
                "released"
            )
        raise ValueError(
            f"augmentation_multiplicity={views}: this step's forward passes did not carry {views} rows per example "
            "of the data loader's last batch. "
            f"Forward each example's {views} views as consecutive rows, e.g. "
            f"x = dpopt.augment.repeat_views(x, {views}, augment) and y = y.repeat_interleave({views}), for every "
            "batch the private data loader yields (and step once per batch, or use BatchMemoryManager); nothing "
            "was released"
        )

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One DP step from the last forward/backward (an empty batch: pure noise, charged).

        Args:
            closure: optional; called once (with gradients enabled) for its loss,
                which is returned. Its backward pass is the one privatized.

        A refused step (an exception: the first-batch check, a layout test, the
        loss-reduction watch, ...) releases nothing and drops its records; a
        ``step()`` repeated without a new backward raises that refusal again
        (:meth:`_note_refusal`), and a new forward and backward is judged afresh.

        Raises:
            LedgerWriteError: the release's ledger entry could not be written to the journal
                (:class:`dpopt.errors.LedgerWriteError`): nothing released, the parameters and the ledger
                as before the step; the batch is not spent (a Poisson batch may be stepped again, a cyclic
                one is released as pure noise when the loop moves on: docs/correlated-noise.md).
            RuntimeError: after ``engine.detach()`` (no per-sample hook left), and the refusals above.
        """
        if self._orphan:
            raise RuntimeError(
                "this optimizer is a copy.deepcopy(optimizer) made without its model: the copy's "
                "parameters and per-sample hooks belong to a private copy of the model that nothing "
                "trains, so it can never see a backward pass of yours. Copy the model and the "
                "optimizer together, copy.deepcopy((model, optimizer)) (a branch of the run, with "
                "its own ledger from then on), or snapshot optimizer.state_dict() and "
                "load_state_dict() it into the optimizer make_private returned"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        records = self._has_records()
        if not records:
            self._refused_again()  # a repeat of a refused step: its refusal, not "without a backward pass"
        self._refuse_if_detached()  # (a refusal that detached the model itself, the compiled door's: said again above)
        try:
            self._step()
        except Exception as err:  # the one place a refusal is noted (a repeat without a new backward says it again)
            if records:
                self._note_refusal(err)
            raise
        return loss

    def _step(self) -> None:
        """The body of :meth:`step` after the closure: admit, read the source, accumulate, release or add a chunk.

        Every refusal below releases nothing and leaves the open step (if any) as it was or discarded
        (:meth:`step` notes it)."""
        if self._loss_watch is not None:
            try:
                done = self._loss_watch.at_step()  # raises on a loss_reduction mismatch
            except ValueError:  # that pass's records go with the refusal; the watch judges the next pass
                self._capture.reset()
                raise
            if done:
                self._loss_watch = None
        boundary = boundary_of(self)  # release_boundary: which release this step may make (one check)
        dp = self._dp
        priv, params = dp.privatizer, dp._params()
        self._admit(boundary, priv.steps)
        releases = boundary.tagged_release()  # the chunk's tag (step_chunk below returns the same), or None
        skip = (not releases) if releases is not None else self._check_skip_next_step(pop_next=False)
        if not skip:  # released into p.grad below: the backward's non-private gradient is never read;
            for p in params:  # dropped first, neither the first-batch check nor the clipped sums sit beside it
                p.grad = None
        source = raw = self._source()
        if not self._open:  # a new logical step: the method's geometry (identity for a torch optimizer)
            priv.begin(ClipGeometry() if self._torch else dp.geometry())
            self._open = True
            boundary.begin()
        tagged = None
        try:
            b = getattr(source, "batch_size", None)
            self._examples = None if b is None or self._examples is None else self._examples + int(b)
            tagged = boundary.step_chunk(b)
            if self._user_level:
                source = self._by_user(source, boundary.chunk_public)
            for src in dp._sources(source, params):
                priv.accumulate(src)
            src = None  # the matched source's blocks go with the step's records (_finish_check)
            self._finish_check(raw)
            self._check_views_match_the_batch(final=not skip)
        except BaseException:
            priv._reset()  # nothing released or recorded: the logical step did not happen
            cancel = getattr(self._capture, "cancel_check", None)
            if cancel is not None:  # a deferred first-batch check's rows of this batch: not kept past the step
                cancel()
            self._open, self._examples = False, 0
            boundary.end(released=False)
            if tagged is None:
                self._check_skip_next_step()  # this chunk's signal is spent with it
            raise
        if skip if tagged is not None else self._check_skip_next_step():  # a chunk: added, not released
            self._is_last_step_skipped = True
            return
        self._is_last_step_skipped = False
        self._open, self._examples = False, 0
        try:
            self._release_open(priv, dp, params)  # a refusal here (the correlated-noise horizon) releases nothing
        except BaseException as err:
            # a failed ledger write released nothing: the batch is not spent (a cyclic one stays owed, released
            # as pure noise when the loop moves on; a Poisson one may be stepped again)
            boundary.end(released=not isinstance(err, LedgerWriteError))
            raise
        boundary.end()

    def _admit(self, boundary: ReleaseBoundary, release: int) -> None:
        """Refuse a step that may not add its data to release ``release`` (0-based: the releases made so far;
        :meth:`~dpopt.release_boundary.ReleaseBoundary.admit`, the one check of Poisson tags and cyclic
        positions): before anything of the step is read, so that nothing is released or charged and the open
        step (if any) is as before. The step's per-sample records go with the refusal (they belong to the
        refused data: a later ``step()`` without a new backward must not release them as another batch's), and
        a repeated ``step()`` raises the refusal again.

        Raises:
            ValueError, RuntimeError: as :meth:`~dpopt.release_boundary.ReleaseBoundary.admit`.
        """
        try:
            boundary.admit(release)
        except (ValueError, RuntimeError):
            self._capture.reset()
            for p in self._params:
                p.grad_sample = None  # type: ignore[attr-defined]
            raise

    def _finish_check(self, source: Any) -> None:
        """The first-batch check's pass the capture deferred (``HookCapture.finish_check``), the step's source freed.

        Its batched pass is as large as the step's; run beside the step's
        recorded activations it doubled the first step's peak memory (issue
        34). The clipped sums are accumulated, nothing is released yet: a
        refusal raised here resets the step (:meth:`step`).
        """
        finish = getattr(self._capture, "finish_check", None)
        if finish is None or not getattr(self._capture, "_deferred", None):
            return
        free = getattr(source, "free", None)
        if free is not None:
            free()
        finish()

    def _by_user(self, source: Any, public: int = 0) -> Any:
        """privacy_unit="user": this chunk's per-example gradients as per-USER mean gradients (:mod:`dpopt.users`).

        The rows' owners come from the user-level loader's last batch (private, in memory); the
        chunk must end between two users (:meth:`dpopt.users.UserRows.take`). A chunk of ``public`` rows only
        (DPTrainer's zero-weight stand-ins, :meth:`~dpopt.release_boundary.ReleaseBoundary.public_rows`) holds
        no user: zero per-user rows.

        Raises:
            ValueError: no user-level batch to read the owners from (a copy of the optimizer, or a
                step on data the loader did not yield), rows beyond the batch, or a chunk that splits a user.
        """
        from .users import group_by_user

        rows = getattr(self._loader, "last_batch_rows", None)
        if rows is None:
            raise ValueError(
                "privacy_unit='user': this optimizer groups each step's rows by user from the batch its "
                "user-level data loader yielded last, and there is none (step on the batches of the loader "
                "make_private returned, in order; a copy of the optimizer has no loader); nothing was released"
            )
        b = getattr(source, "batch_size", None)
        if b is None:
            raise ValueError("privacy_unit='user' needs a per-sample source that states its batch_size")
        if public and public == int(b):  # stand-in rows only: no record, no user
            slots = rows.slots[:0]
        else:
            slots = rows.take(int(b)) if rows.slots.numel() else rows.slots
        return group_by_user(source, slots)

    def _close_open_step(self) -> None:
        """Release the open logical step now, as its own charged release (:mod:`dpopt.release_boundary`).

        Called when a chunk of another logical batch is handed to the loop, or
        the loop leaves the ``BatchMemoryManager`` context or its chunk iterator,
        while chunks of a batch are added but not released: what was added is a
        subset of one Poisson batch (sensitivity C), released with its noise,
        recorded in the ledger and applied (``p.grad`` and the optimizer step).
        """
        if not self._open:
            return
        self._open, self._examples = False, 0
        self._is_last_step_skipped = False
        dp = self._dp
        self._release_open(dp.privatizer, dp, dp._params())

    def _release_skipped_batch(self) -> None:
        """Release a batch the loop skipped entirely (a BatchMemoryManager batch, a cyclic batch): pure noise,
        charged, applied (as the empty batch it looks like from outside; :mod:`dpopt.release_boundary`, whose
        position rule it passed)."""
        if self._open:
            return
        dp = self._dp
        priv = dp.privatizer
        priv.begin(ClipGeometry() if self._torch else dp.geometry())
        self._is_last_step_skipped = False
        self._release_open(priv, dp, dp._params())

    def _release_open(self, priv: Any, dp: Any, params: Any) -> None:
        """Release the Privatizer's open step and apply it (the end of a logical step).

        Which release it is was decided before the step's data was read
        (:meth:`~dpopt.release_boundary.ReleaseBoundary.admit`: a Poisson batch once, a cyclic batch at its own
        position); this only releases.

        Raises:
            RuntimeError: the Privatizer's (a correlated-noise release past the horizon; nothing released).
        """
        try:
            release = priv.release(params_like=params)
        except BaseException:  # nothing released (a failed ledger write, ...): the open step is discarded
            priv._reset()
            raise
        if priv.quantile is not None:  # Opacus's min/max_clipbound: post-processing of the released bound
            lo, hi = self.clip_range
            priv.bounds = [min(max(priv.bounds[0], lo), hi)]
        if self._torch:
            for p, g in zip(params, release.grads):
                p.grad = g
            self.original_optimizer.step()
        else:
            dp.apply_release(release)
            for p, g in zip(params, release.grads):
                p.grad = g.clone()  # the public release; the method's state keeps its own copy
        watch = getattr(self._engine, "_target_watch", None)
        if watch is not None:  # make_private_with_epsilon's target: warned once when epsilon passes it
            watch.after_release()

    def state_dict(self) -> dict:
        """The wrapped optimizer's state, the Privatizer's state WITH the ledger, and where the journal is.

        Keys: the wrapped optimizer's (``"state"``, ``"param_groups"``; a dpopt
        method's transform state), ``"privatizer"``
        (:meth:`~dpopt.privatizer.Privatizer.state_dict`: step and clip state
        and the engine's whole ledger; never the secret noise generator's
        state) and ``"dpopt"`` (``{"version", "run_id", "journal"}``). The
        engine's journal, if any, is flushed first. All of it is public.
        """
        if self._engine is not None:
            self._engine._keeper.flush()
        state = self.original_optimizer.state_dict()
        if self._torch:
            state["privatizer"] = self.privatizer.state_dict(include_ledger=True)
        journal = self._engine._keeper.journal if self._engine is not None else None
        state["dpopt"] = {
            "version": CHECKPOINT_VERSION,
            "run_id": self.privatizer.ledger.run_id,
            "journal": None if journal is None else os.path.abspath(journal),
            "noise_multiplier": self.noise_multiplier,
        }  # of the next release (a scheduler's)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`; the engine's ledger takes the saved one in without losing a release.

        The engine's ledger becomes the longest record of the run among the
        saved ledger, the journal the state records and the engine's own
        ledger (:class:`~dpopt.checkpoint.LedgerKeeper`: a state older than the
        journal keeps the releases after it, warned); then the Privatizer and
        the wrapped optimizer are restored.

        Raises:
            ValueError: a state without the Privatizer's ledger (a plain torch
                optimizer ``state_dict``: refused into a run with releases and
                into a fresh one, where ε would restart from zero — load such a
                state into the torch optimizer before ``make_private`` if it
                did not come from private training); a ledger of another run
                or branch; another clipping configuration.
            RuntimeError: in the middle of a logical batch.
        """
        if getattr(self, "_open", False):
            raise RuntimeError("load_state_dict() between the physical chunks of one logical batch")
        state = dict(state_dict)
        meta = state.pop("dpopt", None) or {}
        priv = state.pop("privatizer", None)
        saved = priv.get("ledger") if isinstance(priv, dict) else None
        engine = self._engine
        if engine is not None:
            engine._keeper.adopt(
                saved, journal=recorded_journal(meta.get("journal"), None), where="optimizer state", header_fixed=True
            )
            self._load_rest(state, priv)
            self._restore_sigma(meta)
            engine._keeper.settle(engine._privatizers())
            return
        if priv is None:
            raise ValueError(
                "this optimizer state carries no Privatizer state and ledger (a plain torch "
                "state_dict): loading it would restart epsilon from zero. Load a state saved by "
                "this optimizer's state_dict()"
            )
        self._load_rest(state, priv)
        self._restore_sigma(meta)

    def _restore_sigma(self, meta: dict) -> None:
        """σ of the next release as saved (a noise scheduler's value; the Privatizer state keeps only C)."""
        sigma = (meta or {}).get("noise_multiplier")
        if sigma is None or float(sigma) == self.noise_multiplier or self.privatizer.quantile is not None:
            return  # adaptive clipping: sigma is fixed by make_private (split with the count release)
        self.noise_multiplier = float(sigma)

    def _load_rest(self, state: dict, priv: dict) -> None:
        """The Privatizer (without its ledger when an engine adopted it) and the wrapped optimizer's state."""
        if self._engine is not None:
            priv = {k: v for k, v in priv.items() if k != "ledger"}
        if self._torch:
            self.privatizer.load_state_dict(priv)  # first: a refusal leaves the optimizer as it was
            self.original_optimizer.load_state_dict(state)
        else:
            self._dp.load_state_dict(dict(state, privatizer=priv))

    def __repr__(self) -> str:
        return f"PrivateOptimizer({self.original_optimizer!r})"
