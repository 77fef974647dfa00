"""``DPSFTTrainer``: TRL's ``SFTTrainer`` trained through :class:`~dpopt.hf.trainer.DPTrainer`'s private step.

::

    from trl import SFTConfig
    from dpopt.hf import DPSFTTrainer
    trainer = DPSFTTrainer(model=model, args=SFTConfig("out", per_device_train_batch_size=8, max_steps=100),
                           train_dataset=texts, processing_class=tokenizer,
                           noise_multiplier=1.0, max_grad_norm=1.0)
    trainer.train()

TRL prepares the dataset (tokenising, completion-only / assistant-only
labels, truncation, packing) and builds its collator; everything private is
DPTrainer's (see :mod:`dpopt.hf.trainer`): Poisson batches, the per-example
loss (each example's token cross-entropy averaged over its own label tokens,
:func:`dpopt.hf.loss.per_example_loss` — TRL's batch-level token mean
``Σ tokens / num_items_in_batch`` is never used), per-unit clipping, one
release per logical batch, ε in the logs, the ledger in every checkpoint.

**The privacy unit.**

* ``packing=False``: one example = one record (``privacy_unit`` as
  DPTrainer's: ``"record"``, ``"user"`` with ``user_column``, ...; ``None``
  is ``"record"`` for a dataset of texts, and detects a pre-packed
  pre-tokenized dataset as DPTrainer does).
* ``packing=True`` with ``packing_strategy="wrapped"``: TRL concatenates the
  texts and cuts them into blocks of ``max_length`` tokens; a block is the
  unit (``privacy_unit="block"`` of ``max_length`` tokens, recorded in the
  ledger header, the logs and the summary, with a warning: a record spread
  over k blocks is protected at about k·ε).
* ``packing=True`` with ``privacy_unit="user"`` is refused: TRL packs the
  whole dataset, so a block mixes users. Pack each user's texts yourself
  (blocks that never cross users, each with its ``user_id``) and pass them
  with ``packing=False, privacy_unit="user"``.

Refused, besides DPTrainer's list: ``padding_free=True`` and
``packing_strategy="bfd"`` / ``"bfd_split"`` (TRL's default when packing:
padding-free), whose collator flattens the whole batch into ONE row — the
examples cannot be told apart on dim 0; ``loss_type="dft"`` (not a
per-example cross-entropy here); ``privacy_unit="record"`` with packing;
``activation_offloading``, ``use_liger_kernel`` (:mod:`dpopt.hf.trl_common`).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Union

from trl import SFTConfig, SFTTrainer

from .guarantee import unit_text
from .trainer import DPTrainer
from .trl_common import TRLPrivate, trl_refusals

__all__ = ["DPSFTTrainer", "sft_refusals", "sft_privacy_unit"]


def sft_refusals(args: Any, privacy_unit: Union[None, str, int]) -> list[str]:
    """Why an ``SFTConfig`` cannot be trained privately (empty when it can); see the module docstring."""
    out = trl_refusals(args)
    packing = bool(getattr(args, "packing", False))
    strategy = getattr(args, "packing_strategy", "bfd")
    if getattr(args, "padding_free", False) or (packing and strategy in ("bfd", "bfd_split")):
        out.append(
            "padding_free (also implied by packing_strategy='bfd' / 'bfd_split', TRL's default when packing): "
            "the collator flattens the whole batch into one row, so examples cannot be clipped one by one; "
            "use packing=False, or packing=True with packing_strategy='wrapped'"
        )
    if getattr(args, "loss_type", "nll") != "nll":
        out.append(
            f"loss_type={args.loss_type!r}: DPSFTTrainer trains each example's token cross-entropy (loss_type='nll'); "
            "pass per_example_loss=fn(outputs, labels) -> [B] for another per-example loss"
        )
    if packing and privacy_unit == "user":
        out.append(
            "packing=True with privacy_unit='user': TRL packs across the whole dataset, so a block mixes "
            "users. Pack each user's texts into blocks of their own (with the user_id column) and pass "
            "them with packing=False, privacy_unit='user'"
        )
    if packing and privacy_unit == "record":
        out.append(
            "packing=True with privacy_unit='record': packed blocks hold pieces of several records, so the "
            "unit is the block; leave privacy_unit unset (or 'block') to record it, or set packing=False"
        )
    return out


def sft_privacy_unit(args: Any, privacy_unit: Union[None, str, int], dataset: Any) -> Union[None, str, int]:
    """The privacy unit DPTrainer is given.

    With packing, the block of ``max_length`` tokens (warned). Without: as
    given; ``None`` is ``"record"`` when TRL tokenizes the texts itself (the
    dataset has no ``input_ids`` column: each text becomes one example), and
    left to DPTrainer's detection of packed blocks for a pre-tokenized dataset.

    Raises:
        ValueError: packing without ``max_length``.
    """
    if not getattr(args, "packing", False):
        names = getattr(dataset, "column_names", None)
        if privacy_unit is None and names is not None and "input_ids" not in names:
            return "record"
        return privacy_unit
    if args.max_length is None:
        raise ValueError("packing=True needs max_length (the block length, which is the privacy unit)")
    block = int(privacy_unit) if isinstance(privacy_unit, int) else int(args.max_length)
    warnings.warn(
        f"DPSFTTrainer: packing=True — the privacy unit is the {unit_text(block)}, not a record: a record "
        "spread over k blocks is protected at about k times epsilon (group privacy). Recorded in the ledger "
        "header, logs and summary. Use packing=False for record-level DP",
        UserWarning,
        stacklevel=3,
    )
    return block


class DPSFTTrainer(TRLPrivate, DPTrainer, SFTTrainer):
    """TRL's ``SFTTrainer`` with DPTrainer's private step (per-example clipping, Gaussian noise, the ledger).

    Args:
        model: a ``transformers`` causal LM (or PEFT model), as for ``SFTTrainer``.
        args: an ``SFTConfig`` (a ``TrainingArguments`` is converted by TRL);
            default ``SFTConfig("dp_sft_output")``. Copied, not changed.
        privacy_unit: as :class:`~dpopt.hf.trainer.DPTrainer`; with packing
            the unit is the block of ``max_length`` tokens (see the module docstring).
        **kwargs: DPTrainer's privacy keywords (``noise_multiplier`` or
            ``target_epsilon``, ``max_grad_norm``, ``delta``, ``method``,
            ``user_column``, ``max_records_per_user``, ...) and
            ``SFTTrainer``'s (``train_dataset``, ``processing_class``,
            ``formatting_func``, ``peft_config``, ...).

    Raises:
        ValueError: a setting that cannot be honoured privately
            (:func:`sft_refusals` and DPTrainer's list, all in one message).

    The math is DP-SGD (Abadi et al. 2016, Alg. 1) over per-example SFT
    losses; see :mod:`dpopt.hf.trainer` for the release and accounting.
    """

    def __init__(
        self,
        model: Any = None,
        args: Optional[Any] = None,
        *,
        privacy_unit: Union[None, str, int] = None,
        **kwargs: Any,
    ):
        args = SFTConfig("dp_sft_output") if args is None else args
        problems = sft_refusals(args, privacy_unit)
        if problems:
            raise ValueError("DPSFTTrainer cannot honour these settings privately:\n- " + "\n- ".join(problems))
        unit = sft_privacy_unit(args, privacy_unit, kwargs.get("train_dataset"))
        super().__init__(model, args, privacy_unit=unit, **kwargs)
