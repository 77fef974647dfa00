"""What Hugging Face models do behind the user's back that breaks per-example clipping: refused, with the fix.

* ``model(..., labels=...).loss`` is the mean over every valid token of the
  batch (and ``num_items_in_batch`` divides by the token count of a whole
  accumulated batch): example i's loss weight depends on the other examples'
  lengths, so it is not a mean of per-example losses. A transformers model
  called with ``labels=`` or ``num_items_in_batch=`` while per-sample
  gradients are captured is refused (:func:`refuse_batch_loss`), the message
  showing the per-example form (:func:`dpopt.losses.per_example_lm_loss`).

Gradient checkpointing is supported (each layer call recorded once:
:mod:`dpopt.engine.recompute`).
"""

from __future__ import annotations

from torch import nn

__all__ = [
    "is_hf",
    "refuse_batch_loss",
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
