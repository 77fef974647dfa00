"""Hugging Face integration (extra ``dpopt[hf]``): :class:`DPTrainer`, a private ``transformers.Trainer``;
with the extra ``dpopt[trl]``, :class:`DPSFTTrainer` and :class:`DPDPOTrainer` (TRL's SFT and DPO trainers).

``from dpopt.hf import DPTrainer`` imports transformers; ``import dpopt`` alone never does (nor does
``dpopt.hf`` import trl before ``DPSFTTrainer`` / ``DPDPOTrainer`` is asked for).
See :mod:`dpopt.hf.trainer`, :mod:`dpopt.hf.sft`, :mod:`dpopt.hf.dpo` and docs/finetuning.md.
"""

from __future__ import annotations

__all__ = ["DPTrainer", "DPSFTTrainer", "DPDPOTrainer", "per_example_loss"]


def __getattr__(name: str):
    if name == "DPTrainer":
        from .trainer import DPTrainer

        return DPTrainer
    if name == "DPSFTTrainer":
        from .sft import DPSFTTrainer

        return DPSFTTrainer
    if name == "DPDPOTrainer":
        from .dpo import DPDPOTrainer

        return DPDPOTrainer
    if name == "per_example_loss":
        from .loss import per_example_loss

        return per_example_loss
    raise AttributeError(f"module 'dpopt.hf' has no attribute {name!r}")
