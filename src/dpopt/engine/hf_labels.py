"""Hugging Face's own ``labels=`` loss in the ``PrivacyEngine`` door, made a mean (or sum) of per-example losses.

The plain HF loop ``loss = model(**batch, labels=labels).loss; loss.backward()``
trains exactly when the model's ``.loss`` is ``(1/B) Σ_i ℓ_i`` (loss_reduction
``"mean"``) or ``Σ_i ℓ_i`` (``"sum"``) with ℓ_i depending on example i only
(the hook door then has e_i = B · ∂loss/∂out_i, :mod:`dpopt.engine.hooks`).

* **Token losses** (``*ForCausalLM``, ``*LMHeadModel``, ``*ForMaskedLM``,
  ``*ForTokenClassification``): HF's loss is the mean over every valid token of
  the batch, Σ_{i,t} ℓ_it / Σ_i n_i — example i's weight n_i / Σ_j n_j depends
  on the other examples' lengths (and ``num_items_in_batch`` divides by the
  tokens of a whole accumulated batch), so one example's influence is not
  bounded by clipping its gradient. While the capture is attached, the
  model's ``loss_function`` (transformers routes these losses through it;
  replaceable where transformers gives it a setter: 5.x; not 4.47) is replaced, for that
  forward call only, by the per-example form: ℓ_i = (1/n_i) Σ_t ℓ_it, the mean
  over example i's own valid tokens (:func:`dpopt.losses.per_example_lm_loss`,
  shifted by one position for a causal LM; ``shift_labels`` unshifted), and
  ``.loss`` = mean over the examples (``"mean"``) or their sum (``"sum"``).
  This is the sentence-level objective of DP fine-tuning (Li et al. 2022,
  arXiv 2110.05679, §3); it differs from HF's token mean when lengths differ.
  ``num_items_in_batch`` is refused (its token count couples the examples).
* **Per-example means as they are** (``*ForSequenceClassification``,
  ``*ForImageClassification``, ``*ForAudioClassification``,
  ``*ForMultipleChoice``; labels ``[B]`` or ``[B, L]`` multi-label): HF's loss is
  already ``(1/B) Σ_i ℓ_i`` (cross-entropy, squared error, or the binary
  cross-entropy averaged over each example's L labels); accepted unchanged
  with ``loss_reduction="mean"``. A negative integer label (cross-entropy's
  ignore index: the mean would then be over the other examples only) is refused.
* Anything else given ``labels=`` (encoder–decoders, question answering, a
  model that computes its loss without ``loss_function``, a transformers
  version without the setter) is refused with the per-example form to use.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from ..losses import per_example_lm_loss
from .hf_guards import PER_EXAMPLE_FORM, is_hf

__all__ = ["LabelsLoss", "strip_labels", "TOKEN_HEADS", "EXAMPLE_HEADS", "LABEL_KWARGS"]

#: class-name suffixes whose loss is a token loss (value: shift labels by one position, as HF's causal LMs)
TOKEN_HEADS = {"ForCausalLM": True, "LMHeadModel": True, "ForMaskedLM": False, "ForTokenClassification": False}
#: class-name suffixes whose ``labels=`` loss is already a mean over examples of per-example losses
EXAMPLE_HEADS = ("ForSequenceClassification", "ForImageClassification", "ForAudioClassification", "ForMultipleChoice")
#: keyword inputs that feed only the model's loss (the check's own passes run without them)
LABEL_KWARGS = ("labels", "num_items_in_batch")


def _refusal(module: nn.Module, why: str) -> ValueError:
    return ValueError(
        f"{type(module).__name__} was called with labels=: {why}. Compute the loss per example instead: "
        f"{PER_EXAMPLE_FORM}"
    )


def _token_shift(module: nn.Module) -> Optional[bool]:
    """The shift of a token-loss head (:data:`TOKEN_HEADS`), None for another model (encoder–decoders: None)."""
    if getattr(getattr(module, "config", None), "is_encoder_decoder", False):
        return None
    name = type(module).__name__
    return next((shift for suffix, shift in TOKEN_HEADS.items() if name.endswith(suffix)), None)


def _loss_function_settable(module: nn.Module) -> bool:
    prop = getattr(type(module), "loss_function", None)
    return isinstance(prop, property) and prop.fset is not None


class LabelsLoss:
    """The hook door's policy for a transformers model called with ``labels=`` (module docstring).

    Args:
        reduction: the door's ``loss_reduction`` (``"mean"`` or ``"sum"``): how
            the per-example token losses are combined into ``.loss``.

    :meth:`pre` and :meth:`post` are a transformers model's forward pre-hook and
    (always-called) forward hook while the capture is attached.
    """

    def __init__(self, reduction: str):
        self.reduction = reduction
        self._swapped: dict[int, tuple[bool, object, list]] = {}  # id(module) -> (had one, previous, [used])

    def pre(self, module: nn.Module, kwargs: dict) -> None:
        """Accept, replace (token losses) or refuse the loss of a call with ``labels=``.

        Raises:
            ValueError: ``num_items_in_batch`` given; a model whose loss cannot
                be made per example here; a classification loss with
                ``loss_reduction="sum"`` or a negative integer label.
        """
        if kwargs.get("num_items_in_batch") is not None:
            raise _refusal(module, "num_items_in_batch divides by the token count of the whole accumulated batch")
        labels = kwargs.get("labels")
        if labels is None:
            return
        if type(module).__module__.split(".")[0] == "peft" and not hasattr(type(module), "loss_function"):
            return  # a PEFT wrapper passes labels to its transformers model, whose own hook decides
        name = type(module).__name__
        if name.endswith(EXAMPLE_HEADS):
            self._check_example_loss(module, labels)
            return
        shift = _token_shift(module)
        if shift is None:
            raise _refusal(module, "dpopt knows no per-example form of its loss")
        if not _loss_function_settable(module):
            raise _refusal(
                module, "this transformers version cannot replace its loss_function (no setter; transformers 5 has one)"
            )
        used: list = []
        had = "_loss_function" in module.__dict__
        self._swapped[id(module)] = (had, module.__dict__.get("_loss_function"), used)
        module.__dict__["_loss_function"] = self._token_loss(shift, used)

    def post(self, module: nn.Module) -> None:
        """Restore the model's ``loss_function``; refuse a forward that computed its loss without it.

        Raises:
            ValueError: labels were given and the replaced ``loss_function`` was not called.
        """
        swapped = self._swapped.pop(id(module), None)
        if swapped is None:
            return
        had, previous, used = swapped
        if had:
            module.__dict__["_loss_function"] = previous
        else:
            module.__dict__.pop("_loss_function", None)
        if not used:
            raise _refusal(module, "its .loss was computed without its loss_function (the batch's token mean)")

    def _check_example_loss(self, module: nn.Module, labels) -> None:
        if self.reduction != "mean":
            raise _refusal(module, "its .loss is the MEAN over the batch of per-example losses: loss_reduction='mean'")
        if isinstance(labels, Tensor) and not labels.is_floating_point() and bool((labels < 0).any()):
            raise _refusal(
                module, "a negative label is ignored by its cross-entropy, whose mean is then over the other examples"
            )

    def _token_loss(self, shift: bool, used: list):
        reduction = self.reduction

        def loss_function(logits: Tensor, labels: Optional[Tensor] = None, *args, **kwargs) -> Tensor:
            """Per-example token loss, combined over the examples by the door's reduction."""
            if kwargs.get("num_items_in_batch") is not None:
                raise ValueError("num_items_in_batch couples the examples (refused)")
            shifted = kwargs.get("shift_labels")
            target = labels if shifted is None else shifted
            if target is None:
                raise ValueError("loss_function was called without labels")
            per = per_example_lm_loss(
                logits,
                target,
                ignore_index=int(kwargs.get("ignore_index", -100)),
                shift=shift and shifted is None,
            )
            used.append(True)
            return per.mean() if reduction == "mean" else per.sum()

        return loss_function


def strip_labels(root: nn.Module, kwargs: dict) -> dict:
    """The check's inputs: ``kwargs`` without :data:`LABEL_KWARGS` when ``root`` is a transformers model using them only for its loss.

    (Its passes differentiate a random linear function of the outputs; a
    scalar ``.loss`` is not an output with the examples along dim 0.)
    Encoder–decoders build decoder inputs from the labels: kept.
    """
    if not is_hf(root) or getattr(getattr(root, "config", None), "is_encoder_decoder", False):
        return kwargs
    return {k: v for k, v in kwargs.items() if k not in LABEL_KWARGS}
