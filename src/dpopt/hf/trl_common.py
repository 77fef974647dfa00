"""What :class:`~dpopt.hf.sft.DPSFTTrainer` and :class:`~dpopt.hf.dpo.DPDPOTrainer` share on top of ``DPTrainer``.

Both are ``class DPxTrainer(TRLPrivate, DPTrainer, trl.XTrainer)``: the MRO
puts :class:`~dpopt.hf.trainer.DPTrainer` (Poisson loader, per-unit
clipping, one release per logical batch, ε in the logs, ledger in
checkpoints) before TRL's trainer, so DPTrainer's ``training_step``,
``compute_loss``, ``get_train_dataloader``, ``create_optimizer``,
``_save_checkpoint`` and ``_load_optimizer_and_scheduler`` are the ones that
run; TRL's ``__init__`` still prepares the dataset (tokenising, packing) and
builds its collator. This module adds only what TRL brings that DPTrainer
does not know of:

* :meth:`TRLPrivate.log` — TRL's trainers add their own ``_metrics``
  (token accuracy, entropy, rewards, token counts of the private batches)
  inside ``log`` *after* DPTrainer has filtered the keys (TRL's ``log`` is
  later in the MRO); they are cleared first, so they never reach a log.
* :func:`trl_refusals` — TRL options that the private step would silently
  skip or that read the private batch as a whole.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["TRLPrivate", "trl_refusals"]


def trl_refusals(args: Any) -> list[str]:
    """Why TRL-specific settings of ``args`` (an ``SFTConfig`` / ``DPOConfig``) cannot be honoured (empty: they can).

    * ``activation_offloading``: TRL wraps its own ``training_step`` in the
      offloading context; the private step (DPTrainer's) is a different one,
      so the option would be silently ignored.
    * ``use_liger_kernel``: Liger's kernels replace layer forwards the
      per-example hooks are verified on.
    """
    out = []
    if getattr(args, "activation_offloading", False):
        out.append(
            "activation_offloading: the private training step does not run TRL's offloading context "
            "(it would be silently ignored); set it False"
        )
    if getattr(args, "use_liger_kernel", False):
        out.append(
            "use_liger_kernel: Liger's fused kernels replace the layer forwards the per-example gradients "
            "are captured from; set it False"
        )
    return out


class TRLPrivate:
    """Mixin placed before ``DPTrainer`` in a TRL trainer's bases: TRL's own metrics never reach a log."""

    _metrics: dict

    def log(self, logs: dict, start_time: Optional[float] = None) -> None:
        """DPTrainer's public-only log, with TRL's accumulated ``_metrics`` dropped first (computed from
        private batches: token accuracy, entropy, rewards, token counts)."""
        for mode in getattr(self, "_metrics", {}).values():
            mode.clear()
        super().log(logs, start_time)  # type: ignore[misc]  # DPTrainer.log (the next class in the MRO)
