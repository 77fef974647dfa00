"""Per-example losses for sequence models: each example's loss depends on that example only.

DP-SGD clips each example's gradient, so the loss must be a sum (or a mean
with a public denominator) of per-example losses ℓ_i that depend on example
i alone. Hugging Face's built-in language-model loss
(``model(input_ids, labels=labels).loss``) is instead the mean over **all
valid tokens of the batch**, (1/N) Σ_i Σ_t ℓ_it with N the batch's token count
(or ``num_items_in_batch``, the count over gradient-accumulation steps): the
weight of example i's tokens depends on the lengths of the other examples,
so that "loss" is not a mean of per-example losses and
:class:`dpopt.PrivacyEngine` refuses it (``labels=`` / ``num_items_in_batch=``
passed to a transformers model). State it per example instead::

    logits = model(input_ids=ids, attention_mask=mask).logits
    loss = dpopt.losses.per_example_lm_loss(logits, ids).mean()   # loss_reduction="mean"
    loss.backward()

and in dpopt's own loop (``dpopt.train`` / ``iter_per_sample_sources``),
``loss_fn=per_example_lm_loss`` directly (one example → a 1-element result).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["per_example_lm_loss", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum")


def per_example_lm_loss(
    logits: Tensor, labels: Tensor, reduction: str = "mean", ignore_index: int = -100, shift: bool = True
) -> Tensor:
    """Token cross-entropy reduced over each example's own valid tokens: ``[B]``.

    Args:
        logits: ``[B, T, V]`` (any float dtype; computed in float32 or wider).
        labels: ``[B, T]`` integer token ids; ``ignore_index`` marks tokens
            without a loss (padding, prompt).
        reduction: ``"mean"`` — ℓ_i = (1/n_i) Σ_t ℓ_it over example i's n_i
            valid tokens (an example with none has ℓ_i = 0); ``"sum"`` —
            ℓ_i = Σ_t ℓ_it.
        ignore_index: the label of ignored tokens (HF's −100).
        shift: True for a causal LM (as HF's ``labels=``): position t's logits
            predict token t + 1 (``logits[:, :-1]`` against ``labels[:, 1:]``);
            False for token-level tasks (masked LM, tagging).

    Returns:
        ``[B]`` per-example losses; ``.mean()`` over the batch is the loss of
        ``PrivacyEngine(loss_reduction="mean")``, ``.sum()`` that of ``"sum"``.

    Raises:
        ValueError: an unknown reduction, or logits/labels shapes that do not
            agree (``[B, T, V]`` and ``[B, T]``).

    Source: the per-example reformulation of the LM objective used for DP
    fine-tuning (Li et al. 2022, arXiv 2110.05679, §3: sentence-level losses).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if logits.dim() != 3 or labels.dim() != 2 or tuple(logits.shape[:2]) != tuple(labels.shape):
        raise ValueError(
            f"per_example_lm_loss needs logits [B, T, V] and labels [B, T]; got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    b, t, v = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    tok = F.cross_entropy(
        logits.reshape(b * t, v).to(dtype), labels.reshape(b * t).long(), ignore_index=ignore_index, reduction="none"
    ).reshape(b, t)
    total = tok.sum(1)
    if reduction == "sum":
        return total
    n = (labels != ignore_index).sum(1).to(total.dtype)
    return total / n.clamp_min(1.0)
