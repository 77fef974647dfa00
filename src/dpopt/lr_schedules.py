"""Learning-rate schedules for large-batch DP training: linear warm-up, then constant or cosine.

De et al. 2022 (arXiv:2204.13650) train with very large batches (B̄ = 4096 on
CIFAR-10) and few updates (875 for WRN-16-4 at ε = 1, constant lr 2.0 in
their configs), with a short linear warm-up and an optional cosine decay.
The schedule is a function of the public step counter only: changing the lr
between releases is post-processing and does not change ε.

For step s = 0, 1, ..., T − 1 (the index of the update about to be made),
warm-up length w ≥ 0::

    m(s) = (s + 1) / w                                    s < w   (warm-up: 1/w, ..., 1)
    m(s) = 1                                              "constant", s ≥ w
    m(s) = ½ (1 + cos(π (s − w) / (T − w)))              "cosine", s ≥ w   (1 → ~0 at the last step)

and the lr used by update s is lr₀ · m(s). :func:`lr_lambda` gives m for
``torch.optim.lr_scheduler.LambdaLR`` (which works with
``PrivacyEngine``'s optimizer and with :class:`~dpopt.optim.DPOptimizer`:
both are torch optimizers); :func:`apply_lr` sets a param group's lr from
``initial_lr`` (the key torch's schedulers use, saved with the optimizer
state, so a resumed run continues the schedule).
"""

from __future__ import annotations

import math
import numbers
from typing import Callable

import torch

__all__ = ["SCHEDULES", "lr_multiplier", "lr_lambda", "make_lr_scheduler", "apply_lr", "check_schedule"]

SCHEDULES = ("constant", "cosine")


def check_schedule(schedule: str, warmup_steps: int, total_steps: int | None = None) -> None:
    """Validate a schedule.

    Raises:
        ValueError: unknown schedule, warmup_steps < 0 or not an integer, or
            (when ``total_steps`` is given) total_steps not an integer, warmup_steps ≥ total_steps for "cosine",
            warmup_steps > total_steps, or total_steps < 1.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    if total_steps is not None:
        if not isinstance(total_steps, numbers.Integral) or isinstance(total_steps, bool):
            raise ValueError(
                f"total_steps must be an integer (the number of optimizer steps), got {total_steps!r}; "
                "for fractional epochs use math.ceil(epochs * len(loader))"
            )
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if schedule == "cosine" and warmup_steps >= total_steps:
            raise ValueError(
                f"warmup_steps {warmup_steps} leaves no step of the cosine decay in {total_steps} "
                "steps; use fewer warm-up steps"
            )
        if warmup_steps > total_steps:
            raise ValueError(
                f"warmup_steps {warmup_steps} is more than the run's {total_steps} steps: the lr would "
                "never reach its set value; use at most as many warm-up steps as steps"
            )


def lr_multiplier(step: int, total_steps: int, schedule: str = "constant", warmup_steps: int = 0) -> float:
    """m(step) of the module docstring (step: 0-based index of the update about to be made)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    frac = min(1.0, (step - warmup_steps) / span)
    return 0.5 * (1.0 + math.cos(math.pi * frac))


def lr_lambda(total_steps: int, schedule: str = "constant", warmup_steps: int = 0) -> Callable[[int], float]:
    """``fn(step) -> m(step)`` for ``torch.optim.lr_scheduler.LambdaLR`` (validated, :func:`check_schedule`)."""
    check_schedule(schedule, warmup_steps, total_steps)
    return lambda step: lr_multiplier(step, total_steps, schedule, warmup_steps)


def make_lr_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, schedule: str = "constant", warmup_steps: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` with :func:`lr_lambda`: call ``scheduler.step()`` after every ``optimizer.step()``.

    Works with the optimizer ``PrivacyEngine.make_private`` returns (a torch
    optimizer whose param groups are the user's). The first update uses m(0).
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total_steps, schedule, warmup_steps))


def apply_lr(
    optimizer: torch.optim.Optimizer, step: int, total_steps: int, schedule: str = "constant", warmup_steps: int = 0
) -> None:
    """Set each param group's ``lr`` to ``initial_lr · m(step)`` before update ``step`` (dpopt train's loop).

    ``initial_lr`` is recorded on first use (torch's key; saved in the optimizer's state_dict).
    """
    m = lr_multiplier(step, total_steps, schedule, warmup_steps)
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
        group["lr"] = group["initial_lr"] * m
