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
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

__all__ = ["GRAD_SAMPLE_MODES", "OpacusOptions", "check_opacus_arguments"]

#: Opacus's per-sample gradient modes dpopt accepts (one engine serves them all).
GRAD_SAMPLE_MODES = ("hooks", "functorch", "ew", "ghost")


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
        raise ValueError("grad_sample_mode='ghost_fsdp' (FSDP) is not supported: dpopt trains data parallel with "
                         "make_private(..., distributed=True) on the bare module; drop grad_sample_mode")
    if grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise ValueError(f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES} (dpopt has one engine for all of "
                         f"them), got {grad_sample_mode!r}")
    if grad_sample_mode != "hooks" and not getattr(engine, "_mode_noted", False):
        engine._mode_noted = True
        warnings.warn(f"grad_sample_mode={grad_sample_mode!r}: dpopt computes per-sample gradients with one engine "
                      "(hook capture with its per-layer checks) for every mode; the results are the same as "
                      "'hooks' (exact per-sample clipping)", UserWarning, stacklevel=4)


def _check_criterion(criterion: Optional[Callable], loss_reduction: str) -> Optional[Callable]:
    reduction = getattr(criterion, "reduction", None)
    if reduction is not None and reduction != loss_reduction:
        raise ValueError(f"the criterion reduces by {reduction!r} but loss_reduction={loss_reduction!r}: the "
                         "per-sample gradients would be scaled by the batch size (every example clipped by the "
                         "wrong factor). Pass loss_reduction=" f"{reduction!r} or build the criterion with "
                         f"reduction={loss_reduction!r}")
    return criterion


def _check_clip_range(clipping: str, min_clipbound: float, max_clipbound: float,
                      max_grad_norm: Any) -> tuple[float, float]:
    lo, hi = float(min_clipbound), float(max_clipbound)
    if clipping != "adaptive":
        if (lo, hi) != (0.0, math.inf):
            raise ValueError("min_clipbound / max_clipbound are adaptive clipping's: pass clipping='adaptive' "
                             "(or drop them)")
        return lo, hi
    if math.isnan(lo) or math.isnan(hi) or lo < 0 or hi < lo:
        raise ValueError(f"need 0 <= min_clipbound <= max_clipbound, got {lo}, {hi}")
    if hi == 0:
        raise ValueError("max_clipbound must be > 0")
    c = float(max_grad_norm) if isinstance(max_grad_norm, (int, float)) else None
    if c is not None and not lo <= c <= hi:
        raise ValueError(f"the initial max_grad_norm {c} lies outside [min_clipbound, max_clipbound] = [{lo}, {hi}]")
    return lo, hi


def check_opacus_arguments(engine: Any, *, grad_sample_mode: str, batch_first: bool,
                           criterion: Optional[Callable], loss_reduction: str, clipping: str,
                           min_clipbound: float, max_clipbound: float, max_grad_norm: Any,
                           secure_mode: Optional[bool], noise_generator: Any) -> OpacusOptions:
    """Check Opacus's ``make_private`` arguments (module docstring) and return what dpopt does with them.

    Raises:
        ValueError: ``grad_sample_mode`` unknown or ``"ghost_fsdp"``; ``batch_first=False``;
            a criterion whose ``reduction`` differs from ``loss_reduction``;
            clip bounds without adaptive clipping, or out of order;
            ``secure_mode=True`` with ``noise_generator``.
    """
    _check_mode(grad_sample_mode, engine)
    if not batch_first:
        raise ValueError("batch_first=False is not supported: dpopt's engine takes dim 0 of the model's input as "
                         "the example axis (and checks it for every layer call). Give the model batch-first "
                         "inputs, x.transpose(0, 1) of [T, B, ...], with batch_first=True in its RNN/attention "
                         "layers, and drop batch_first=False")
    ghost = grad_sample_mode == "ghost"
    if ghost and criterion is None:
        criterion = nn.CrossEntropyLoss(reduction=loss_reduction)  # Opacus's default criterion
    criterion = _check_criterion(criterion, loss_reduction)
    clip_range = _check_clip_range(clipping, min_clipbound, max_clipbound, max_grad_norm)
    secure = bool(secure_mode) and not getattr(engine, "secure_mode", False)
    if secure_mode and noise_generator is not None:
        raise ValueError("secure_mode=True and noise_generator are exclusive: secure noise comes from the OS "
                         "CSPRNG and cannot be seeded; drop one")
    return OpacusOptions(ghost, criterion, clip_range, secure)


def warn_drop_last(data_loader: Any, poisson_sampling: bool) -> None:
    """Opacus's warning: ``drop_last`` is meaningless under Poisson sampling (batch sizes are random)."""
    if poisson_sampling and getattr(data_loader, "drop_last", False):
        warnings.warn("Ignoring drop_last as it is not compatible with Poisson sampling (DPDataLoader): every "
                      "Poisson batch is used, whatever its size (q = 1/len(data_loader))", UserWarning,
                      stacklevel=4)


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
