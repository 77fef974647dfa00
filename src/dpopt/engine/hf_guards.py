"""What Hugging Face models do behind the user's back that breaks per-example clipping: refused, with the fix.

* ``model(..., labels=...).loss`` is the mean over every valid token of the
  batch (and ``num_items_in_batch`` divides by the token count of a whole
  accumulated batch): example i's loss weight depends on the other examples'
  lengths, so it is not a mean of per-example losses. A transformers model
  called with ``labels=`` or ``num_items_in_batch=`` while per-sample
  gradients are captured is refused (:func:`refuse_batch_loss`), the message
  showing the per-example form (:func:`dpopt.losses.per_example_lm_loss`).
* gradient checkpointing re-runs layer forwards inside the backward pass
  (capture hooks fire twice; a reentrant checkpoint runs the first forward
  without gradients): refused (:func:`refuse_checkpointing`), and a layer
  call recorded while autograd runs a backward pass is refused too
  (:func:`in_backward`).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "is_hf",
    "refuse_batch_loss",
    "refuse_checkpointing",
    "CheckpointGuard",
    "in_backward",
    "recomputed",
    "PER_EXAMPLE_FORM",
]

PER_EXAMPLE_FORM = (
    "logits = model(input_ids=ids, attention_mask=mask).logits; "
    "loss = dpopt.losses.per_example_lm_loss(logits, labels).mean()  (PrivacyEngine, "
    "loss_reduction='mean'; .sum() for 'sum'), or loss_fn=dpopt.losses.per_example_lm_loss in "
    "dpopt's own loop"
)


def is_hf(module: nn.Module) -> bool:
    """True for a module whose class comes from ``transformers`` or ``peft``."""
    return type(module).__module__.split(".")[0] in ("transformers", "peft")


def refuse_batch_loss(module: nn.Module, kwargs: dict) -> None:
    """Raise if a transformers/peft model is asked for its built-in batch-token-mean loss.

    Raises:
        ValueError: ``labels`` or ``num_items_in_batch`` given (not None).
    """
    given = [k for k in ("labels", "num_items_in_batch") if kwargs.get(k) is not None]
    if given and is_hf(module):
        raise ValueError(
            f"{type(module).__name__} was called with {given}: its built-in .loss averages over all "
            "tokens of the batch (num_items_in_batch: of the accumulated batch), so each example's "
            "gradient depends on the other examples' lengths and per-example clipping would not bound "
            f"the sensitivity. Compute the loss per example instead: {PER_EXAMPLE_FORM}"
        )


def _checkpointing_message(name: str, module: nn.Module) -> str:
    return (
        f"gradient checkpointing is enabled on {name or '<root>'!r} ({type(module).__name__}): it re-runs layer "
        "forwards inside the backward pass, which the per-sample capture would record twice (or not at all). "
        "Call model.gradient_checkpointing_disable() (use a smaller physical batch size to save memory instead)"
    )


def _flagged(module: nn.Module) -> bool:
    """The per-layer flag Hugging Face sets (``gradient_checkpointing``); never the deprecated model property."""
    return module.__dict__.get("gradient_checkpointing", getattr(type(module), "gradient_checkpointing", False)) is True


def refuse_checkpointing(model: nn.Module) -> None:
    """Raise if any submodule of ``model`` has Hugging Face gradient checkpointing enabled.

    Reads each module's own ``gradient_checkpointing`` flag, which
    ``gradient_checkpointing_enable()`` sets on every module that has one
    (transformers ``_set_gradient_checkpointing``); the model-level
    ``is_gradient_checkpointing`` property (deprecated in transformers 5,
    a ``FutureWarning`` per read) is not read.

    Raises:
        ValueError: naming the module and the fix.
    """
    for name, m in model.named_modules():
        if _flagged(m):
            raise ValueError(_checkpointing_message(name, m))


class CheckpointGuard:
    """:func:`refuse_checkpointing` for every forward pass, without walking the model each time.

    Args:
        model: the model; the modules that can be switched to gradient
            checkpointing are those with a ``gradient_checkpointing``
            attribute (transformers sets the flag only on modules that already
            have one), found once here.

    :meth:`check` reads those flags only (a few attribute reads per forward):
    enabling checkpointing after the capture was built is refused at the next
    forward pass in train mode with gradients. A checkpointed forward that
    bypasses these flags (``torch.utils.checkpoint`` in user code) is refused
    where its recomputation runs (:func:`in_backward`).
    """

    def __init__(self, model: nn.Module):
        self.watched = [(name, m) for name, m in model.named_modules() if hasattr(m, "gradient_checkpointing")]

    def check(self) -> None:
        """Raise (:func:`refuse_checkpointing`'s message) if a watched module in train mode has checkpointing on.

        (transformers recomputes a layer only when its flag is set and it is
        in train mode: ``self.gradient_checkpointing and self.training``.)
        """
        for name, m in self.watched:
            if m.training and _flagged(m):
                raise ValueError(_checkpointing_message(name, m))


def in_backward() -> bool:
    """True while autograd runs a backward pass (a forward recomputed by activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


def recomputed(name: str, module: nn.Module) -> ValueError:
    """The refusal of a layer (or tapped map) called inside a backward pass (:func:`in_backward`), both doors."""
    return ValueError(
        f"layer {name!r} ({type(module).__name__}) ran inside the backward pass (activation/gradient "
        "checkpointing recomputes forwards there), which the per-sample capture would record twice; "
        "disable checkpointing (model.gradient_checkpointing_disable()) and use a smaller batch to "
        "save memory"
    )
