"""Per-row losses of a recognised torch loss from one batched call (issue 34: the MLP step's losses).

:class:`~dpopt.engine.fast.PerSampleEngine` differentiates ℓ_r =
``loss_fn(out[r:r+1], y[r:r+1])``, the loss of row r alone, for every row r.
For an arbitrary ``loss_fn`` that is ``torch.func.vmap`` of the single-row
call (or a loop); for cross-entropy on ``[256, 10]`` it costs ≈ 0.28–0.32 ms
of CPU forward and backward against ≈ 0.10 ms for one batched call, because
``nll_loss`` runs through torch's Python decomposition under ``vmap``.

:func:`recognised_row_losses` gives the same ℓ_r from one batched call with
``reduction="none"`` where ``loss_fn`` is exactly one of the losses below, the
inputs have exactly the stated shapes and dtypes, and the single-row value is
known to equal that form (the torch definitions: ``torch.nn.CrossEntropyLoss``,
``torch.nn.MSELoss``):

* ``torch.nn.functional.cross_entropy`` itself, or an ``nn.CrossEntropyLoss``
  instance (its exact type, no hooks, no instance ``forward``) with
  ``weight=None``, ``label_smoothing=0``; ``out`` ``[n, C]`` floating, ``y``
  ``[n]`` int64 class indices. With ``reduction="mean"`` the single-row loss is
  the row's loss divided by its count of non-ignored targets, 1 — or 0 where
  ``y[r] == ignore_index``: 0/0 = NaN there, with a zero output gradient
  (``nll_loss``'s backward gives an ignored target none). ℓ_r is then
  ``none_r`` with NaN filled in where ``y == ignore_index`` (``masked_fill``,
  whose backward gives those rows the same zero).
  With ``"sum"`` / ``"none"``, ℓ_r = ``none_r`` (0 for an ignored target).
* ``torch.nn.functional.mse_loss`` itself, or an ``nn.MSELoss`` instance (same
  conditions); ``out`` and ``y`` of one floating dtype and the same shape
  ``[n, ...]`` (no broadcasting: a ``[n, 1]`` output with ``[n]`` targets would
  broadcast differently batched). ℓ_r = the mean (``"mean"``) or sum
  (``"sum"``) of row r's squared errors; ``"none"`` only where a row has one
  element (``example_loss`` refuses more).

Anything else — a lambda or ``def`` wrapping these, ``functools.partial``, a
subclass, a weight, label smoothing, probability targets, other shapes or
dtypes, a patched ``torch.nn.functional`` function (before or after dpopt's
import), module hooks (the instance's or global ones), an instance
``_call_impl``, a compiled module (``Module.compile()``), attribute values of
other types than the user's own call takes (``ignore_index=True``) — returns
``None`` and the engine keeps ``vmap``.
A batched call that raises (e.g. a class index out of range) also returns
``None``, so the user's own call reports the error. Values equal the
single-row ones to float rounding (cross-entropy: the same operations on the
same row; MSE: the row's reduction may sum in another order); the output
gradients, through autograd of these ops, likewise (tests/engine/test_recognised_losses.py).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import loss as _loss_module
from torch.nn.modules import module as _module

__all__ = ["recognised_row_losses", "recognised_kind"]


def _torch_own(fn: object, module: object, name: str) -> bool:
    """``fn`` is the function ``name`` defined in torch's own source of ``module``.

    A replacement installed before dpopt's import (e.g. a fused kernel library
    assigning ``torch.nn.functional.cross_entropy = its_own``) has other globals
    and is never taken for torch's: its ``"mean"`` and ``"none"`` need not agree.
    """
    code = getattr(fn, "__code__", None)
    return getattr(fn, "__globals__", None) is vars(module) and code is not None and code.co_name == name


def _own(fn: Callable, module: object, name: str) -> Optional[Callable]:
    return fn if _torch_own(fn, module, name) else None


# the functions as torch defines them, taken at import (None if already replaced then: nothing recognised);
# a later patch of torch.nn.functional is not recognised either (compared at each call)
_CROSS_ENTROPY = _own(F.cross_entropy, F, "cross_entropy")
_MSE = _own(F.mse_loss, F, "mse_loss")
_CE_FORWARD = _own(nn.CrossEntropyLoss.forward, _loss_module, "forward")
_MSE_FORWARD = _own(nn.MSELoss.forward, _loss_module, "forward")
_REDUCTIONS = ("mean", "sum", "none")
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _plain(loss_fn: object, cls: type[nn.Module], forward: Optional[Callable]) -> bool:
    """``loss_fn`` is an instance of exactly ``cls`` whose call is torch's own ``forward`` and nothing else.

    Not plain: another type, a replaced class or instance ``forward``, an
    instance ``_call_impl`` (what ``nn.Module.__call__`` runs), a compiled call
    (``Module.compile()`` sets ``_compiled_call_impl``), or any module hook.
    """
    if forward is None or type(loss_fn) is not cls or cls.forward is not forward:
        return False
    own = vars(loss_fn)
    if "forward" in own or "_call_impl" in own or own.get("_compiled_call_impl") is not None:
        return False
    m: nn.Module = loss_fn
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
        return False
    return not any(getattr(_module, name, None) for name in _GLOBAL_HOOKS)


def recognised_kind(loss_fn: object) -> Optional[tuple[str, str, int]]:
    """``(kind, reduction, ignore_index)`` if ``loss_fn`` is a loss :func:`recognised_row_losses` knows, else None.

    ``kind`` is ``"cross_entropy"`` or ``"mse"``; ``ignore_index`` is -100
    (torch's default) for the functional form and unused for MSE. Only the
    loss itself is examined here (not the tensors' shapes).
    """
    if _CROSS_ENTROPY is not None and loss_fn is _CROSS_ENTROPY:
        return ("cross_entropy", "mean", -100) if F.cross_entropy is _CROSS_ENTROPY else None
    if _MSE is not None and loss_fn is _MSE:
        return ("mse", "mean", -100) if F.mse_loss is _MSE else None
    if _plain(loss_fn, nn.CrossEntropyLoss, _CE_FORWARD):
        ce: nn.CrossEntropyLoss = loss_fn  # type: ignore[assignment]
        # the attributes' own types, as torch's call takes them: ignore_index=True or 2.9, or
        # label_smoothing="0", make the user's call raise, so they are not recognised either
        if (
            ce.weight is None
            and type(ce.label_smoothing) in (int, float)
            and ce.label_smoothing == 0
            and type(ce.ignore_index) is int
            and ce.reduction in _REDUCTIONS
            and F.cross_entropy is _CROSS_ENTROPY
        ):
            return "cross_entropy", ce.reduction, ce.ignore_index
        return None
    if _plain(loss_fn, nn.MSELoss, _MSE_FORWARD):
        mse: nn.MSELoss = loss_fn  # type: ignore[assignment]
        if mse.reduction in _REDUCTIONS and F.mse_loss is _MSE:
            return "mse", mse.reduction, -100
    return None


def recognised_row_losses(loss_fn: object, out: object, y: object) -> Optional[Tensor]:
    """ℓ_r = ``loss_fn(out[r:r+1], y[r:r+1])`` for every row r from one batched call, or None (not recognised).

    Args:
        loss_fn: the user's loss (see the module docstring for what is recognised).
        out: the model's output, ``[n, C]`` for cross-entropy, ``[n, ...]`` for MSE.
        y: the targets, ``[n]`` int64 for cross-entropy, ``out``'s shape and dtype for MSE.

    Returns:
        ``[n]`` per-row losses (``out``'s dtype, or as autocast computes the
        loss), differentiable in ``out`` with the single-row calls' gradients;
        None where the loss, shapes or dtypes are not recognised or the
        batched call raised (the caller then runs the single-row calls).

    Source: the definitions of ``torch.nn.CrossEntropyLoss`` / ``torch.nn.MSELoss``
    (the ``"mean"`` over a single row's non-ignored targets / elements).
    """
    if not (isinstance(out, Tensor) and isinstance(y, Tensor)) or out.dim() == 0 or y.dim() == 0:
        return None
    n = out.shape[0]
    if n < 1 or y.shape[0] != n or not out.is_floating_point():
        return None
    kind = recognised_kind(loss_fn)
    if kind is None:
        return None
    name, reduction, ignore = kind
    try:
        if name == "cross_entropy":
            if out.dim() != 2 or y.dim() != 1 or y.dtype != torch.int64:
                return None
            assert _CROSS_ENTROPY is not None  # recognised_kind found torch's own
            none = _CROSS_ENTROPY(out, y, ignore_index=ignore, reduction="none")
            if reduction != "mean":
                return none
            # the mean over row r's non-ignored targets: none_r / 1, or 0/0 = NaN with no gradient where ignored
            return none.masked_fill(y == ignore, float("nan"))
        if y.shape != out.shape or y.dtype != out.dtype:
            return None
        per_row = out[0].numel()
        if per_row == 0 or (reduction == "none" and per_row != 1):
            return None
        assert _MSE is not None  # recognised_kind found torch's own
        sq = _MSE(out, y, reduction="none").reshape(n, per_row)
        return sq.mean(1) if reduction == "mean" else sq.sum(1)
    except (RuntimeError, ValueError, IndexError):  # e.g. a class index out of range: the user's call says so
        return None
