"""Opacus's ``make_private`` arguments that dpopt maps onto its own mechanism, checked in one place.

:meth:`dpopt.PrivacyEngine.make_private` accepts Opacus's arguments; the
ones without a dpopt counterpart of their own are interpreted here:

=======================  ==========================================================================
Opacus argument          dpopt
=======================  ==========================================================================
``grad_sample_mode``     ``"hooks"``, ``"functorch"``, ``"ew"``, ``"ghost"``: ONE engine serves all
                         (hook-captured per-sample gradients with the engine's checks; a note is
                         warned once per engine for modes other than ``"hooks"``). ``"ghost"``
                         returns ``(module, optimizer, criterion, data_loader)`` as Opacus, the
                         criterion being the one given (an ordinary loss: one backward is enough).
                         ``"ghost_fsdp"`` is refused (no FSDP; use ``distributed=True``).
                         ``"no_op"``: the loop writes per-example gradients of ℓ_i into
                         ``p.grad_sample`` (``[B, *p.shape]``) before ``step()``, which reads them
                         (as it does in every mode where all trainable parameters have one).
``batch_first``          ``True``: as always. ``False`` (inputs ``[T, B, ...]``) is refused: the engine
                         takes dim 0 of the model's input as the example axis and checks it per layer.
``criterion``            only used by ``"ghost"`` (returned); its ``reduction`` must match
                         ``loss_reduction`` (a sum-reduced loss under ``"mean"`` would clip every
                         example by the batch size's factor).
``max_clipbound``,       ``clipping="adaptive"`` only: after each release the adapted bound is clamped
``min_clipbound``        to ``[min_clipbound, max_clipbound]`` (post-processing of the released bound).
``secure_mode``          ``True``: this optimizer's noise and masks from the OS CSPRNG (as
                         ``PrivacyEngine(secure_mode=True)``); not with ``noise_generator``.
``drop_last=True``       (on the loader) ignored under Poisson sampling, with Opacus's warning.
``model._module``        the model itself (dpopt returns the user's module, not a wrapper).
=======================  ==========================================================================

Two checks Opacus does not make: :class:`TargetWatch` (``make_private_with_epsilon``'s
target passed: warned once) and :class:`LossReductionWatch` (a torch loss module whose
reduction disagrees with ``loss_reduction``: refused at the first ``step()``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

__all__ = ["GRAD_SAMPLE_MODES", "LossReductionWatch", "OpacusOptions", "TargetWatch", "check_opacus_arguments"]

#: Opacus's per-sample gradient modes dpopt accepts (one engine serves them all).
GRAD_SAMPLE_MODES = ("hooks", "functorch", "ew", "ghost", "no_op")


@dataclass(frozen=True)
class OpacusOptions:
    """The checked Opacus options of one ``make_private`` call.

    Attributes:
        ghost: return Opacus's ghost-clipping shape ``(module, optimizer, criterion, loader)``.
        criterion: the criterion to return with ``ghost``.
        clip_range: ``(min_clipbound, max_clipbound)`` for adaptive clipping.
        secure: draw this optimizer's noise from the OS CSPRNG.
    """

    ghost: bool
    criterion: Optional[Callable]
    clip_range: tuple[float, float]
    secure: bool


def _check_mode(grad_sample_mode: str, engine: Any) -> None:
    if grad_sample_mode == "ghost_fsdp":
        raise ValueError(
            "grad_sample_mode='ghost_fsdp' (FSDP) is not supported: dpopt trains data parallel with "
            "make_private(..., distributed=True) on the bare module; drop grad_sample_mode"
        )
    if grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise ValueError(
            f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES} (dpopt has one engine for all of "
            f"them), got {grad_sample_mode!r}"
        )
    if grad_sample_mode == "no_op" and not getattr(engine, "_no_op_noted", False):
        engine._no_op_noted = True
        warnings.warn(
            "grad_sample_mode='no_op': step() clips the per-example gradients your loop writes into "
            "p.grad_sample ([B, *p.shape], the gradients of each example's own loss); they are trusted "
            "as given (not checked against the model)",
            UserWarning,
            stacklevel=4,
        )
    elif grad_sample_mode != "hooks" and not getattr(engine, "_mode_noted", False):
        engine._mode_noted = True
        warnings.warn(
            f"grad_sample_mode={grad_sample_mode!r}: dpopt computes per-sample gradients with one engine "
            "(hook capture with its per-layer checks) for every mode; the results are the same as "
            "'hooks' (exact per-sample clipping)",
            UserWarning,
            stacklevel=4,
        )


def _check_criterion(criterion: Optional[Callable], loss_reduction: str) -> Optional[Callable]:
    reduction = getattr(criterion, "reduction", None)
    if reduction is not None and reduction != loss_reduction:
        raise ValueError(
            f"the criterion reduces by {reduction!r} but loss_reduction={loss_reduction!r}: the "
            "per-sample gradients would be scaled by the batch size (every example clipped by the "
            "wrong factor). Pass loss_reduction="
            f"{reduction!r} or build the criterion with "
            f"reduction={loss_reduction!r}"
        )
    return criterion


def _check_clip_range(
    clipping: str, min_clipbound: float, max_clipbound: float, max_grad_norm: Any
) -> tuple[float, float]:
    lo, hi = float(min_clipbound), float(max_clipbound)
    if clipping != "adaptive":
        if (lo, hi) != (0.0, math.inf):
            raise ValueError(
                "min_clipbound / max_clipbound are adaptive clipping's: pass clipping='adaptive' (or drop them)"
            )
        return lo, hi
    if math.isnan(lo) or math.isnan(hi) or lo < 0 or hi < lo:
        raise ValueError(f"need 0 <= min_clipbound <= max_clipbound, got {lo}, {hi}")
    if hi == 0:
        raise ValueError("max_clipbound must be > 0")
    c = float(max_grad_norm) if isinstance(max_grad_norm, (int, float)) else None
    if c is not None and not lo <= c <= hi:
        raise ValueError(f"the initial max_grad_norm {c} lies outside [min_clipbound, max_clipbound] = [{lo}, {hi}]")
    return lo, hi


def check_opacus_arguments(
    engine: Any,
    *,
    grad_sample_mode: str,
    batch_first: bool,
    criterion: Optional[Callable],
    loss_reduction: str,
    clipping: str,
    min_clipbound: float,
    max_clipbound: float,
    max_grad_norm: Any,
    secure_mode: Optional[bool],
    noise_generator: Any,
) -> OpacusOptions:
    """Check Opacus's ``make_private`` arguments (module docstring) and return what dpopt does with them.

    Raises:
        ValueError: ``grad_sample_mode`` unknown or ``"ghost_fsdp"``; ``batch_first=False``;
            a criterion whose ``reduction`` differs from ``loss_reduction``;
            clip bounds without adaptive clipping, or out of order;
            ``secure_mode=True`` with ``noise_generator``.
    """
    _check_mode(grad_sample_mode, engine)
    if not batch_first:
        raise ValueError(
            "batch_first=False is not supported: dpopt's engine takes dim 0 of the model's input as "
            "the example axis (and checks it for every layer call). Give the model batch-first "
            "inputs, x.transpose(0, 1) of [T, B, ...], with batch_first=True in its RNN/attention "
            "layers, and drop batch_first=False"
        )
    ghost = grad_sample_mode == "ghost"
    if ghost and criterion is None:
        criterion = nn.CrossEntropyLoss(reduction=loss_reduction)  # Opacus's default criterion
    criterion = _check_criterion(criterion, loss_reduction)
    clip_range = _check_clip_range(clipping, min_clipbound, max_clipbound, max_grad_norm)
    secure = bool(secure_mode) and not getattr(engine, "secure_mode", False)
    if secure_mode and noise_generator is not None:
        raise ValueError(
            "secure_mode=True and noise_generator are exclusive: secure noise comes from the OS "
            "CSPRNG and cannot be seeded; drop one"
        )
    return OpacusOptions(ghost, criterion, clip_range, secure)


def warn_drop_last(data_loader: Any, poisson_sampling: bool) -> None:
    """Opacus's warning: ``drop_last`` is meaningless under Poisson sampling (batch sizes are random)."""
    if poisson_sampling and getattr(data_loader, "drop_last", False):
        warnings.warn(
            "Ignoring drop_last as it is not compatible with Poisson sampling (DPDataLoader): every "
            "Poisson batch is used, whatever its size (q = 1/len(data_loader))",
            UserWarning,
            stacklevel=4,
        )


def alias_module(module: nn.Module) -> None:
    """``module._module`` is ``module`` itself, so Opacus code that unwraps its ``GradSampleModule`` works.

    dpopt returns the user's module (hooks attached), not a wrapper; Opacus
    scripts and tests read ``model._module`` for the wrapped model. The alias is
    a plain instance attribute (not a registered child: ``modules()``,
    ``state_dict()`` and ``parameters()`` are unchanged). A module that already
    has a ``_module`` attribute of its own is left as it is.
    """
    if not hasattr(module, "_module"):
        object.__setattr__(module, "_module", module)


class TargetWatch:
    """Warn once when ε of the engine's ledger passes ``make_private_with_epsilon``'s ``target_epsilon``.

    ``make_private_with_epsilon`` calibrates σ for ``planned`` steps; nothing
    stops the loop there (Opacus does not either), and every further step
    raises ε past the target. After each release :meth:`after_release` decides,
    at the engine's own accountant and δ (so the warning agrees with
    ``accountant.get_epsilon(delta)``), whether ε now exceeds the target:

    * while the ledger holds at most the planned number of releases and every
      one is the calibrated step (the first release's event: same σ, q), ε is
      at most ε(planned steps at the calibrated σ) ≤ target (ε grows with the
      number of steps and falls with σ): nothing is computed;
    * past that, :class:`~dpopt.accounting.incremental.EpsilonTracker` bisects
      once for how many more releases of the step's event keep ε ≤ target,
      then counts down (O(1) per step; recomputed when the event changes, e.g.
      a noise scheduler, or the ledger jumps, e.g. ``load_checkpoint``).

    ε is public (it is computed from the ledger alone).

    Args:
        engine: the object whose ``.ledger`` is read (the PrivacyEngine).
        target_epsilon, target_delta: the calibration target.
        accountant: the engine's accountant name.
        planned: the number of steps σ was calibrated for.
    """

    def __init__(self, engine: Any, target_epsilon: float, target_delta: float, accountant: str, planned: int):
        from .accounting.incremental import EpsilonTracker

        self._tracker_cls = EpsilonTracker
        self.engine, self.epsilon, self.delta = engine, float(target_epsilon), float(target_delta)
        self.accountant, start = str(accountant), len(engine.ledger)
        self.planned = start + int(planned)
        self.cheap = start == 0  # earlier releases (another make_private) are not in the calibration
        self.event = None  # the calibrated step's event (the first release's)
        self.tracker = EpsilonTracker(self.delta, self.accountant, max_epsilon=self.epsilon)
        self.prev: Optional[tuple] = None  # (ledger length, event, releases still allowed, capped)
        self.warned = False

    def after_release(self) -> None:
        """Check the ledger after a release; warn (``UserWarning``) the first time ε exceeds the target."""
        if self.warned:
            return
        ledger = self.engine.ledger
        n = len(ledger)
        if n == 0:
            return
        event = ledger.last_entry.event  # O(1): never a copy of the ledger
        if self.cheap:
            if self.event is None:
                self.event = event
            if n <= self.planned and event == self.event:
                return
            self.cheap = False
        prev = self.prev
        if prev is not None and prev[0] == n - 1 and prev[1] == event and not (prev[3] and prev[2] == 0):
            passed = prev[2] == 0  # the previous check said no further release of this event fits
        else:
            if prev is not None and prev[3]:
                self.tracker = self._tracker_cls(self.delta, self.accountant, max_epsilon=self.epsilon)
            passed = self.tracker.epsilon(ledger) > self.epsilon
        if passed:
            self.warned = True
            eps = self.tracker.epsilon(ledger)
            warnings.warn(
                f"epsilon = {eps:.4g} (delta = {self.delta:g}, {self.accountant}) has passed "
                f"make_private_with_epsilon's target_epsilon = {self.epsilon:g}: sigma was calibrated for "
                f"{self.planned} steps and this is release {n}. Every further step raises epsilon; stop "
                "here, or calibrate for more epochs (said once)",
                UserWarning,
                stacklevel=4,
            )
            return
        limit = max(self.planned, n, 1)
        left = self.tracker.releases_within_budget(ledger, event, limit)
        self.prev = (n, event, left, left >= limit)


def _inert_hook(*args) -> None:  # noqa: ARG001 - what a copied or unpickled _WeakHook becomes
    return None


class _WeakHook:
    """A forward hook calling ``getattr(watch, name)`` while the watch lives (else it removes its handles)."""

    def __init__(self, ref, name: str, handles: list):
        self.ref, self.name, self.handles = ref, name, handles

    def __call__(self, module, args, out):
        watch = self.ref()
        if watch is None:
            for h in self.handles:
                h.remove()
            self.handles.clear()
            return None
        getattr(watch, self.name)(module, args, out)
        return None

    def __deepcopy__(self, memo):
        return _inert_hook

    def __reduce__(self):
        return (_inert_hook_factory, ())


def _inert_hook_factory():
    return _inert_hook


def _remove_handles(handles: list) -> None:
    """Remove every hook handle in ``handles`` (each once) and empty the list."""
    for h in handles:
        h.remove()
    handles.clear()


class LossReductionWatch:
    """First-batch check that a torch loss module's reduction agrees with ``loss_reduction``.

    The hook engine never sees the loss: with ``loss_reduction="mean"`` it
    takes example i's loss gradient as B · ∂L/∂out_i, which is right only if
    L = (1/B) Σ ℓ_i. A sum-reduced loss under ``"mean"`` gives every example B
    times its gradient (each one clipped by that factor) and nothing in the
    gradients themselves tells the two apart. What CAN be seen soundly: a
    torch loss module (``nn.modules.loss._Loss``, e.g. ``nn.CrossEntropyLoss``)
    called on the model's output with ``reduction="sum"`` or ``"none"``. Its
    output's gradient in ``backward`` is the weight w the loss actually gives
    each example's term (``"sum"``: ∂L/∂L_sum, a scalar; ``"none"``: the
    entries of ∂L/∂ℓ, when they are all equal). ``"mean"`` expects w = 1/B,
    ``"sum"`` expects w = 1; w = 1 under ``"mean"`` (or 1/B under ``"sum"``)
    is the mismatch, refused at ``step()`` before anything is released. Any
    other w (a weighted or token-level loss) is not judged. Mean-reduced loss
    modules are not judged either (their divisor is not always B: class
    weights, ``ignore_index``).

    Not seen: functional losses (``F.cross_entropy(out, y, reduction="sum")``)
    and hand-written sums; the migration guide says so.

    The check watches the forward passes up to the first ``step()`` after a
    batch of at least 2 examples, then removes its hooks (a process-wide
    module forward hook while it watches: it only inspects loss modules). B
    (private) is only compared here, inside the process; a refusal goes to
    the data holder, nothing is released.

    Args:
        module: the model (its forward's output tensors are the ones watched).
        loss_reduction: ``"mean"`` or ``"sum"``.
    """

    def __init__(self, module: nn.Module, loss_reduction: str):
        import weakref

        import torch

        self.expected = loss_reduction
        self.outs: list = []
        self.verdict: Optional[str] = None  # an error message, once a mismatch was seen
        self.batch = 0
        # the hooks hold the watch weakly: dropped with its optimizer, they remove themselves; copies and pickles
        # of a hooked model get inert hooks (_WeakHook), so no hook handle is ever copied or pickled
        handles: list = []
        handles += [
            module.register_forward_hook(_WeakHook(weakref.ref(self), "_root", handles)),
            torch.nn.modules.module.register_module_forward_hook(_WeakHook(weakref.ref(self), "_any", handles)),
        ]
        self._handles = handles
        # removed as soon as the watch is collected, not at the next forward: a stale process-wide hook would
        # stay in torch's global hook dict, where torch.compile's guards read (and fail on) its dead weakref
        weakref.finalize(self, _remove_handles, handles)

    def __getstate__(self) -> dict:
        """Copies and pickles of a watch are closed (no hooks: they belong to the original)."""
        return {"expected": self.expected, "outs": [], "verdict": self.verdict, "batch": 0, "_handles": []}

    def _root(self, module, args, out) -> None:
        from .engine.capture import leaves

        self.outs = leaves(out)
        self.batch = int(self.outs[0].shape[0]) if self.outs and self.outs[0].dim() else 0

    def _any(self, module, args, out) -> None:
        from functools import partial

        from torch import Tensor

        if not isinstance(module, nn.modules.loss._Loss) or not type(module).__module__.startswith("torch."):
            return
        reduction = getattr(module, "reduction", None)
        if reduction not in ("sum", "none") or not args or not isinstance(args[0], Tensor):
            return
        x = args[0]
        if not any(x is o or x._base is o for o in self.outs):
            return
        b = int(x.shape[0]) if x.dim() else 0
        if b >= 2 and isinstance(out, Tensor) and out.requires_grad:
            out.register_hook(partial(self._grad, type(module).__name__, reduction, b))

    def _grad(self, name: str, reduction: str, b: int, g) -> None:
        if reduction == "none":
            if g.numel() == 0 or not bool((g == g.reshape(-1)[0]).all()):
                return
        w = float(g.reshape(-1)[0])
        expect, wrong = (1.0 / b, 1.0) if self.expected == "mean" else (1.0, 1.0 / b)
        if abs(w - wrong) <= 1e-6 * wrong and abs(w - expect) > 1e-6 * expect:
            actual = "sum" if self.expected == "mean" else "mean"
            self.verdict = (
                f"the loss {name}(reduction={reduction!r}) on the model's output gives each example's "
                f"loss the weight of a {actual}-reduced loss, but make_private(loss_reduction="
                f"{self.expected!r}): every per-example gradient would be "
                f"{'B' if actual == 'sum' else '1/B'}"
                f" times its value (clipped by the wrong factor). Pass loss_reduction={actual!r} to "
                f"make_private, or reduce the loss by {self.expected!r}"
            )

    def at_step(self) -> bool:
        """Raise on a mismatch; True when the watch is done (its hooks removed).

        A refusal keeps watching: the verdict belonged to the pass it judged (whose records the optimizer drops
        with the refusal), so the next pass is judged afresh — accepted once the loss is fixed, refused again
        while it is not.

        Raises:
            ValueError: a loss module's reduction disagrees with ``loss_reduction``.
        """
        if self.verdict is not None:
            verdict, self.verdict, self.batch, self.outs = self.verdict, None, 0, []
            raise ValueError(verdict)
        if self.batch >= 2:
            self.close()
            return True
        self.outs = []  # the step's output: its loss was taken before step() (nothing of a step outlives it)
        return False

    def close(self) -> None:
        """Remove the hooks and drop the watched outputs (the model's activations of a private batch)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.outs = []
