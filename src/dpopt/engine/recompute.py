"""Activation (gradient) checkpointing seen from the per-sample capture: which forward calls to record.

``torch.utils.checkpoint`` (and Hugging Face's ``gradient_checkpointing_enable()``,
which calls it per layer) runs a region's forward twice (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost", arXiv 1604.06174), and the
capture's forward hooks fire both times. Exactly one of the two runs is the
call whose output gradient the backward delivers, so exactly one is recorded:

* ``use_reentrant=False``: the first run builds the graph the backward uses
  (its outputs receive the gradients; only the saved tensors are dropped).
  The recomputation runs inside the backward, under
  ``torch.utils.checkpoint``'s recomputation saved-tensor hooks, only to
  refill those saved tensors; its outputs never receive a gradient.
  Recorded: the first run; the recomputation is skipped (:data:`REPLAY`).
* ``use_reentrant=True``: the first run is under ``torch.no_grad()`` (no
  graph; the capture records nothing without gradients); the recomputation
  runs inside the backward with gradients enabled and a nested backward
  through its fresh graph delivers the output gradients. Recorded: the
  recomputation (:data:`REENTRANT`), as a call of the pass whose backward
  runs. The reentrant form refuses ``torch.autograd.grad``; the capture's own
  passes then differentiate with :func:`param_grads`.

A recomputation that is not recognised as the non-reentrant kind is recorded
like a reentrant one; a call whose outputs then receive no gradient is
ignored by the step (it contributes nothing), so a duplicate can never be
counted twice. The per-example gradient of each example is unchanged:
checkpointing changes what is stored, not what is computed (tests compare
both modes with single-example autograd).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "recomputation",
    "saved_tensors_hooked",
    "param_grads",
    "non_reentrant",
    "reentrant_refused",
    "hf_checkpointing_off",
    "shifted_refused",
    "REPLAY",
    "REENTRANT",
]

#: A non-reentrant checkpoint's recomputation: skip (the first run is recorded).
REPLAY = "replay"
#: A forward run inside a backward pass otherwise (a reentrant checkpoint's recomputation): record it.
REENTRANT = "reentrant"


def _top_hooks():
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


def saved_tensors_hooked() -> bool:
    """True while saved-tensor hooks are active (a checkpointed region): reading ``grad_fn._saved_*`` would unpack.

    (A non-reentrant checkpoint's unpack outside the backward recomputes the region.)
    """
    return _top_hooks() is not None


def recomputation() -> Optional[str]:
    """How the forward now running relates to checkpointing: None (an ordinary forward), :data:`REPLAY`, :data:`REENTRANT`.

    None outside a backward pass (``torch._C._current_graph_task_id() == -1``).
    Inside one: :data:`REPLAY` when the innermost saved-tensor hooks are
    ``torch.utils.checkpoint``'s recomputation hooks (non-reentrant), else
    :data:`REENTRANT`.
    """
    if torch._C._current_graph_task_id() == -1:
        return None
    hooks = _top_hooks()
    pack = hooks[0] if hooks else None
    if pack is not None and "_recomputation_hook" in getattr(pack, "__qualname__", ""):
        return REPLAY
    return REENTRANT


def param_grads(loss: Tensor, params: Sequence[Tensor]) -> list[Optional[Tensor]]:
    """``torch.autograd.grad(loss, params, allow_unused=True)`` through reentrant checkpoints too.

    A reentrant checkpoint refuses ``torch.autograd.grad`` (and
    ``backward(inputs=...)``); this runs ``loss.backward()`` with every
    parameter's ``.grad`` set aside and restored afterwards, so nothing
    accumulates in the model. ``params`` must be leaves (the model's
    parameters); the other leaves requiring a gradient must be none but them.

    Returns:
        one gradient (or None: unused) per parameter, shapes as the parameters.
    """
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        torch.autograd.backward(loss)
        return [p.grad for p in params]
    finally:
        for p, g in zip(params, saved):
            p.grad = g


def _reentrant_partial(fn) -> bool:
    """A ``functools.partial`` of ``torch.utils.checkpoint.checkpoint`` that runs the reentrant form."""
    from torch.utils.checkpoint import checkpoint

    return isinstance(fn, partial) and fn.func is checkpoint and fn.keywords.get("use_reentrant", True) is not False


@contextmanager
def non_reentrant(model: nn.Module) -> Iterator[None]:
    """Context: Hugging Face layers checkpointed in the reentrant form use the non-reentrant one (restored after).

    ``gradient_checkpointing_enable()`` stores ``partial(checkpoint, use_reentrant=...)``
    as each layer's ``_gradient_checkpointing_func`` (transformers ≥ 4.35; the
    reentrant form is transformers 4's default). dpopt's own loop
    differentiates its per-example losses w.r.t. the recorded layer outputs
    (``torch.autograd.grad``), which the reentrant form refuses; the
    non-reentrant form computes the same gradients with the same memory
    saving. Nothing else of the model changes.
    """
    swapped = []
    for m in model.modules():
        fn = m.__dict__.get("_gradient_checkpointing_func")
        if isinstance(fn, partial) and _reentrant_partial(fn):
            m.__dict__["_gradient_checkpointing_func"] = partial(
                fn.func, *fn.args, **{**fn.keywords, "use_reentrant": False}
            )
            swapped.append((m, fn))
    try:
        yield
    finally:
        for m, fn in swapped:
            m.__dict__["_gradient_checkpointing_func"] = fn


def reentrant_refused(err: RuntimeError) -> Optional[ValueError]:
    """dpopt's own loop's refusal of a reentrant checkpoint in the user's forward (None: another error)."""
    if "use_reentrant" not in str(err):
        return None
    return ValueError(
        "the model runs torch.utils.checkpoint(..., use_reentrant=True) in its forward: dpopt's own loop "
        "differentiates the per-example losses w.r.t. the layer outputs (torch.autograd.grad), which the "
        "reentrant form refuses. Pass use_reentrant=False (the same gradients and memory saving), or train "
        "through PrivacyEngine, which supports both forms"
    )


@contextmanager
def hf_checkpointing_off(model: nn.Module) -> Iterator[None]:
    """Context: Hugging Face layers with ``gradient_checkpointing`` on run without it (restored after).

    dpopt's own loop evaluates parameters outside the rules (``torch.func``)
    and DiSK's shifted points through ``functional_call``, which binds the
    given parameters during the forward only: a checkpoint recomputing in the
    backward would read the module's own parameters instead (a shifted
    point's gradient evaluated at θ). Those passes run without
    checkpointing; the values are the same, the memory is not saved.
    """
    flagged = [m for m in model.modules() if m.__dict__.get("gradient_checkpointing") is True]
    for m in flagged:
        m.__dict__["gradient_checkpointing"] = False
    try:
        yield
    finally:
        for m in flagged:
            m.__dict__["gradient_checkpointing"] = True


def shifted_refused() -> ValueError:
    """dpopt's own loop's refusal of a checkpoint in user code at a shifted evaluation point (DiSK)."""
    return ValueError(
        "the model's forward runs torch.utils.checkpoint, and dpopt's own loop evaluates this step at "
        "shifted parameters (evaluation points with an offset) through torch.func.functional_call, whose "
        "parameters a checkpoint's recomputation in the backward pass would not see. Remove the checkpoint "
        "from the forward for this method, or use gradient_checkpointing_enable() on a Hugging Face model "
        "(switched off for those passes)"
    )
