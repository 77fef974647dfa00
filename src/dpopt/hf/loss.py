"""The per-example loss of a Hugging Face model's batch: ``[B]``, each entry depending on its example only.

A transformers model given ``labels=`` returns the mean over every valid
token of the batch (divided by ``num_items_in_batch`` under gradient
accumulation): example i's weight depends on the other examples' lengths, so
it is not a sum of per-example losses and DP clipping would not bound one
example's influence. :func:`per_example_loss` never passes ``labels`` (nor
``num_items_in_batch``) to the model; it computes the loss of each example
from the logits:

* ``labels [B]`` with ``logits [B, C]``: cross-entropy (``C == 1`` with float
  labels: squared error, HF's regression);
* ``labels [B, T]`` with ``logits [B, T, V]``: the token cross-entropy
  averaged over each example's own valid tokens
  (:func:`dpopt.losses.per_example_lm_loss`), shifted by one position for a
  causal LM (HF's ``labels=`` convention) and unshifted otherwise.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..losses import per_example_lm_loss

__all__ = ["per_example_loss", "is_causal_lm", "LABEL_KEYS"]

LABEL_KEYS = ("labels", "label")


def _base(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_base_model", None)  # PEFT
    return get() if callable(get) else model


def is_causal_lm(model: nn.Module) -> bool:
    """True for a decoder-only LM head (``*ForCausalLM``, ``*LMHeadModel``; PEFT unwrapped): labels are shifted."""
    base = _base(model)
    if getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        return False
    name = type(base).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def per_example_loss(
    model: nn.Module,
    inputs: Mapping[str, Any],
    causal: Optional[bool] = None,
    loss_fn: Optional[Callable[[Any, Tensor], Tensor]] = None,
    return_outputs: bool = False,
):
    """Run ``model`` on ``inputs`` without its labels and return the per-example losses ``[B]`` (float32 or wider).

    Args:
        model: a transformers model (or PEFT model) whose output has ``.logits``.
        inputs: the collated batch (``input_ids``, ``attention_mask``, ...,
            and ``labels`` or ``label``); not modified.
        causal: shift LM labels by one (default: :func:`is_causal_lm`).
        loss_fn: ``loss_fn(outputs, labels) -> [B]`` instead of the built-in rules.
        return_outputs: return ``(losses, outputs)``.

    Raises:
        ValueError: no labels; an encoder-decoder model without ``loss_fn``
            (its decoder inputs are built from the labels); label and logit
            shapes no built-in rule covers (pass ``loss_fn``); a ``loss_fn``
            that does not return ``[B]``.
    """
    key = next((k for k in LABEL_KEYS if k in inputs), None)
    if key is None:
        raise ValueError(
            "the training batch has no 'labels': DPTrainer computes each example's loss itself "
            "(collate labels, e.g. DataCollatorForLanguageModeling(mlm=False) for a causal LM)"
        )
    labels = inputs[key]
    kwargs = {k: v for k, v in inputs.items() if k not in LABEL_KEYS}
    base = _base(model)
    if loss_fn is None and getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        raise ValueError(
            f"{type(base).__name__} is an encoder-decoder model: its decoder inputs come from the "
            "labels, so DPTrainer cannot run it without them. Pass per_example_loss=fn(outputs, labels) "
            "-> [B] and put decoder_input_ids in the batch"
        )
    outputs = model(**kwargs)
    b = int(labels.shape[0])
    if loss_fn is not None:
        loss = loss_fn(outputs, labels)
        if not isinstance(loss, Tensor) or tuple(loss.shape) != (b,):
            raise ValueError(
                f"per_example_loss must return a tensor [B] = [{b}] (one loss per example), got "
                f"{getattr(loss, 'shape', type(loss).__name__)}"
            )
        return (loss, outputs) if return_outputs else loss
    logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
    loss = _rule(model, logits, labels, causal)
    return (loss, outputs) if return_outputs else loss


def _rule(model: nn.Module, logits: Tensor, labels: Tensor, causal: Optional[bool]) -> Tensor:
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float32 or wider: a float64 model keeps float64
    if labels.dim() == 1 and logits.dim() == 2:
        if logits.shape[-1] == 1 and labels.is_floating_point():
            return (logits.squeeze(-1).to(dtype) - labels.to(dtype)).square()
        return F.cross_entropy(logits.to(dtype), labels.long(), reduction="none")
    if labels.dim() == 2 and logits.dim() == 3 and tuple(labels.shape) == tuple(logits.shape[:2]):
        return per_example_lm_loss(logits, labels, shift=is_causal_lm(model) if causal is None else causal)
    raise ValueError(
        f"no per-example loss rule for labels {tuple(labels.shape)} and logits {tuple(logits.shape)}: "
        "pass DPTrainer(per_example_loss=fn(outputs, labels) -> [B])"
    )
