"""``DPTrainer(bf16=True)``: the forward in bf16 autocast, the privacy arithmetic in float32.

What runs in which precision (the parameters stay float32; docs/architecture.md, "Mixed precision"):

* the model's forward and backward run under accelerate's bf16 autocast (its ``prepare_model``
  wraps ``model.forward``; the logits come back in float32), so the per-example gradient g_i is the
  gradient of the bf16 forward;
* the engine computes every per-example norm, clip factor and clipped sum outside autocast in the
  parameters' dtype (float32) from the recorded bf16 activations and output gradients cast to
  float32; the Gaussian noise is drawn in float32 (secret/secure: from float64 words) and added in
  float32. So ‖c_i·g_i‖ ≤ C holds up to float32 rounding of the norm (relative ≈ 1e-7·√(terms)), as
  without autocast, and the noise std is σ·C exactly as in float32: bf16 changes what g_i is, not
  the sensitivity or the noise.
* The engine's first-batch check (per-example gradients against single-example autograd) replays
  the forward, which is autocast too; :class:`AutocastRelease` runs ``optimizer.step()`` (where the
  check and the release happen) under the same autocast, so the check uses bf16's tolerance
  (:data:`dpopt.engine.check.RTOL`: 5e-2 relative) instead of float32's. Elementwise updates
  (SGD, AdamW) are not autocast ops and stay float32; a method's matrix products (e.g. DP-Muon's
  Newton–Schulz iteration) run in bf16 — post-processing of the release, no privacy effect.

Against float32 training the difference of one update is that of the bf16 forward: measured in
``tests/distributed/test_trainer_ddp.py`` (σ = 0) as a relative L2 difference below 5e-2.

fp16 stays refused: its GradScaler skips a step when a gradient overflows, a decision that reads
the private per-example gradients and is not charged.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from typing import Any

from transformers import TrainerCallback

__all__ = ["AutocastRelease", "check_mixed_precision"]


def check_mixed_precision(args: Any, accelerator: Any) -> None:
    """Refuse an accelerator whose mixed precision is not the one ``TrainingArguments`` asks for.

    accelerate reads its precision from ``ACCELERATE_MIXED_PRECISION`` too: ``accelerate launch
    --mixed_precision bf16`` sets it, and transformers < 4.5x's ``TrainingArguments(bf16=True)`` writes
    it into the process environment, where every later ``TrainingArguments`` of the process finds it.
    A DPTrainer built with ``bf16=False`` would then run its forward (and its first-batch check) in
    bf16 autocast without saying so.

    Args:
        args: the Trainer's ``TrainingArguments`` (``bf16``, ``fp16``).
        accelerator: its ``accelerate.Accelerator`` (``mixed_precision``: ``"no"``, ``"bf16"``, ``"fp16"``).

    Raises:
        ValueError: the two disagree, with both values and what to change.
    """
    want = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    got = str(getattr(accelerator, "mixed_precision", "no"))
    if got != want:
        env = os.environ.get("ACCELERATE_MIXED_PRECISION")
        raise ValueError(
            f"accelerate's mixed precision is {got!r} but TrainingArguments asks for {want!r} (bf16={args.bf16}); "
            f"accelerate took it from ACCELERATE_MIXED_PRECISION={env!r} (set by `accelerate launch "
            "--mixed_precision`, or left in this process by an earlier TrainingArguments(bf16=True) under older "
            "transformers): pass bf16=True to train in bf16, or os.environ.pop('ACCELERATE_MIXED_PRECISION') "
            "before building TrainingArguments to train in float32"
        )


class AutocastRelease(TrainerCallback):
    """Enter the accelerator's autocast before the Trainer's ``optimizer.step()`` and leave it after.

    Args:
        accelerator: the Trainer's ``accelerate.Accelerator`` (its ``autocast()`` is a no-op without
            mixed precision).
    """

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator
        self._stack = ExitStack()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._stack.close()  # a step that raised never reached on_optimizer_step: start clean
        self._stack.enter_context(self.accelerator.autocast())
        return control

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._stack.close()
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.close()
        return control

    def close(self) -> None:
        """Leave the autocast if a step left it entered (``train()`` calls it whatever happens)."""
        self._stack.close()
