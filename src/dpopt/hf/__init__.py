"""Hugging Face integration (extra ``dpopt[hf]``): :class:`DPTrainer`, a private ``transformers.Trainer``.

``from dpopt.hf import DPTrainer`` imports transformers; ``import dpopt`` alone never does.
See :mod:`dpopt.hf.trainer` and docs/finetuning.md.
"""

from __future__ import annotations

__all__ = ["DPTrainer", "per_example_loss"]


def __getattr__(name: str):
    if name == "DPTrainer":
        from .trainer import DPTrainer

        return DPTrainer
    if name == "per_example_loss":
        from .loss import per_example_loss

        return per_example_loss
    raise AttributeError(f"module 'dpopt.hf' has no attribute {name!r}")
