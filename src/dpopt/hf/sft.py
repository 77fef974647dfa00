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
* ``packing=True`` (``packing_strategy="wrapped"``) with
  ``privacy_unit="user"``: packing within a user. TRL tokenizes (and builds
  the labels) without packing; then each user's examples are packed alone
  (:func:`dpopt.hf.user_packing.pack_by_user`, TRL's own wrapped packing run
  one user at a time), so a block never mixes two users and keeps its user's
  id in ``user_column``. A user's blocks are that user's records: users are
  Poisson-sampled, a sampled user brings at most ``max_records_per_user``
  blocks, and the user's mean block gradient is clipped as one unit. The
  ledger header and summary record ``"user (at most k blocks of N tokens
  each)"``; logs and train metrics carry ``privacy_unit_tokens`` = N.

Refused, besides DPTrainer's list: ``padding_free=True`` and
``packing_strategy="bfd"`` / ``"bfd_split"`` (TRL's default when packing:
padding-free), whose collator flattens the whole batch into ONE row — the
examples cannot be told apart on dim 0; ``loss_type="dft"`` (not a
per-example cross-entropy here); ``privacy_unit="record"`` with packing;
``activation_offloading``, ``use_liger_kernel`` (:mod:`dpopt.hf.trl_common`).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Optional, Union, cast

from trl import SFTConfig, SFTTrainer

from .guarantee import unit_text
from .trainer import DPTrainer
from .trl_common import TRLPrivate, trl_refusals
from .user_packing import pack_by_user

__all__ = ["DPSFTTrainer", "sft_refusals", "sft_privacy_unit", "user_blocks_text"]


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
    skip = bool((getattr(args, "dataset_kwargs", None) or {}).get("skip_prepare_dataset", False))
    if packing and privacy_unit == "user" and skip:
        out.append(
            "packing=True with privacy_unit='user' and skip_prepare_dataset: DPSFTTrainer packs within each "
            "user while preparing the dataset; pack it yourself (dpopt.hf.user_packing.pack_by_user) and pass "
            "packing=False, privacy_unit='user'"
        )
    if packing and privacy_unit == "record":
        out.append(
            "packing=True with privacy_unit='record': packed blocks hold pieces of several records, so the "
            "unit is the block; leave privacy_unit unset (or 'block') to record it, or set packing=False"
        )
    return out


def sft_privacy_unit(args: Any, privacy_unit: Union[None, str, int], dataset: Any) -> Union[None, str, int]:
    """The privacy unit DPTrainer is given.

    With packing, the block of ``max_length`` tokens (warned), or ``"user"``
    with ``privacy_unit="user"`` (blocks packed within each user). Without: as
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
    if privacy_unit == "user":  # packed within each user (DPSFTTrainer._prepare_dataset): the user is the unit
        return "user"
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
            the unit is the block of ``max_length`` tokens, or with ``"user"`` the
            user, whose texts are packed into blocks of their own (see the module docstring).
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
        if self._packs_by_user(args):
            self.block_tokens = int(cast(int, args.max_length))  # a detail of the user unit: logs, metrics, ledger text

    def _packs_by_user(self, args: Any) -> bool:
        """Whether the train set is packed within each user (``packing=True``, ``privacy_unit="user"``)."""
        return bool(getattr(args, "packing", False)) and self.privacy_unit == "user"

    def _prepare_dataset(
        self, dataset: Any, processing_class: Any, args: Any, packing: bool, formatting_func: Any, dataset_name: str
    ) -> Any:
        """TRL's preparation; with packing and ``privacy_unit="user"``, the train set is packed within each user.

        TRL tokenizes and builds the labels unpacked and untruncated (``max_length`` is the block length, not
        a cut), then :func:`~dpopt.hf.user_packing.pack_by_user` cuts each user's token stream into blocks of
        ``max_length`` tokens; other datasets (evaluation) are TRL's as asked.

        Raises:
            ValueError: a train set that is not a ``datasets.Dataset`` or lacks ``user_column``.
        """
        if not (packing and dataset_name == "train" and self._packs_by_user(args)):
            return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        from datasets import Dataset

        names = getattr(dataset, "column_names", None) or []
        if not isinstance(dataset, Dataset) or self.user_column not in names:
            raise ValueError(
                f"packing=True with privacy_unit='user' packs each user's examples: the train dataset must be a "
                f"datasets.Dataset with the user column {self.user_column!r} (pass user_column=)"
            )
        unpacked_args = copy.copy(args)
        unpacked_args.max_length = None  # no truncation: packing cuts the blocks
        tokenized = super()._prepare_dataset(
            dataset, processing_class, unpacked_args, False, formatting_func, dataset_name
        )
        return pack_by_user(tokenized, int(args.max_length), self.user_column, map_kwargs={"desc": "Packing per user"})

    def _ledger_unit(self) -> Optional[str]:
        """With packing within users the ledger header names the user unit and the block; else DPTrainer's."""
        if self._packs_by_user(self.args) and self.block_tokens is not None:
            return user_blocks_text(self.max_records_per_user, self.block_tokens)
        return super()._ledger_unit()


def user_blocks_text(max_records_per_user: int, block: int) -> str:
    """The ledger header's ``privacy_unit`` of user-level DP over per-user packed blocks:
    ``"user (at most k blocks of N tokens each)"``."""
    return f"user (at most {int(max_records_per_user)} blocks of {int(block)} tokens each)"
