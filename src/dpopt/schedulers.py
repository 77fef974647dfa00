"""Noise and clip-bound schedulers in Opacus's shape (``opacus.schedulers``) for dpopt's optimizer.

Each scheduler sets ``optimizer.noise_multiplier`` (σ) or
``optimizer.max_grad_norm`` (C) of :class:`~dpopt.private_optimizer.PrivateOptimizer`
when its ``step()`` is called, as a torch LR scheduler sets ``lr``. The change
takes effect at the NEXT release: the Privatizer reads σ and C when it clips
and noises, and the ledger entry of each release records the σ (and C, and
the noise std σ·C) that release actually applied — so ε stays exact under any
schedule (it is the composition of the steps as they were run).

Construction calls ``step()`` once (``last_epoch`` becomes 0) and, as Opacus,
leaves the value as it is at epoch 0. Call ``scheduler.step()`` once per epoch
(or per step, as you define the schedule), after ``optimizer.step()``.

==========================  ============================================  ===============
scheduler                   value at epoch t (t ≥ 1)                      Opacus
==========================  ============================================  ===============
``ExponentialNoise``        σ_t = γ σ_{t−1}                               same name
``StepNoise``               σ_t = γ σ_{t−1} if t % step_size == 0         same name
``LambdaNoise``             σ_t = σ_0 · λ(t)                              same name
``ExponentialGradClip``     C_t = γ C_{t−1}                               same name
``StepGradClip``            C_t = γ C_{t−1} if t % step_size == 0         same name
``LambdaGradClip``          C_t = C_0 · λ(t)                              same name
==========================  ============================================  ===============

``state_dict()`` holds every attribute but the optimizer (as Opacus); a
``LambdaNoise``/``LambdaGradClip`` state holds its function (as Opacus's).
"""

from __future__ import annotations

from typing import Callable

__all__ = ["ExponentialNoise", "StepNoise", "LambdaNoise", "ExponentialGradClip", "StepGradClip", "LambdaGradClip"]


class _Scheduler:
    """A schedule of one optimizer attribute (``noise_multiplier`` or ``max_grad_norm``), Opacus's API.

    Raises:
        ValueError: the optimizer has no such attribute (not a DP optimizer).
    """

    attribute = ""

    def __init__(self, optimizer, *, last_epoch: int = -1):
        if not hasattr(optimizer, self.attribute):
            raise ValueError(
                f"{type(self).__name__} needs an optimizer with a .{self.attribute} attribute: the "
                "optimizer that PrivacyEngine.make_private returns"
            )
        self.optimizer = optimizer
        self.last_epoch = int(last_epoch)
        self.step()

    def _current(self) -> float:
        return float(getattr(self.optimizer, self.attribute))

    def _value(self) -> float:
        raise NotImplementedError

    def step(self) -> None:
        """Advance one epoch and set the optimizer's value for its next release."""
        self.last_epoch += 1
        setattr(self.optimizer, self.attribute, self._value())

    def state_dict(self) -> dict:
        """Every attribute but the optimizer."""
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict` (does not change the optimizer's value until the next ``step()``)."""
        self.__dict__.update(state_dict)


class _Exponential(_Scheduler):
    def __init__(self, optimizer, *, gamma: float, last_epoch: int = -1):
        self.gamma = float(gamma)
        super().__init__(optimizer, last_epoch=last_epoch)

    def _value(self) -> float:
        return self._current() if self.last_epoch == 0 else self._current() * self.gamma


class _Step(_Scheduler):
    def __init__(self, optimizer, *, step_size: int, gamma: float, last_epoch: int = -1):
        if int(step_size) < 1:
            raise ValueError(f"step_size must be >= 1, got {step_size}")
        self.step_size, self.gamma = int(step_size), float(gamma)
        super().__init__(optimizer, last_epoch=last_epoch)

    def _value(self) -> float:
        if self.last_epoch == 0 or self.last_epoch % self.step_size:
            return self._current()
        return self._current() * self.gamma


class _Lambda(_Scheduler):
    def __init__(self, optimizer, *, function: Callable[[int], float], last_epoch: int = -1):
        self.function = function
        self.base = float(getattr(optimizer, self.attribute)) if hasattr(optimizer, self.attribute) else 0.0
        super().__init__(optimizer, last_epoch=last_epoch)

    def _value(self) -> float:
        return self.base * float(self.function(self.last_epoch))


class ExponentialNoise(_Exponential):
    """σ ← γ σ at every ``step()`` after the first (Opacus ``ExponentialNoise(optimizer, gamma=)``)."""

    attribute = "noise_multiplier"


class StepNoise(_Step):
    """σ ← γ σ every ``step_size`` epochs (Opacus ``StepNoise(optimizer, step_size=, gamma=)``)."""

    attribute = "noise_multiplier"


class LambdaNoise(_Lambda):
    """σ_t = σ_0 · noise_lambda(t), σ_0 the value at construction (Opacus ``LambdaNoise(optimizer, noise_lambda=)``)."""

    attribute = "noise_multiplier"

    def __init__(self, optimizer, *, noise_lambda: Callable[[int], float], last_epoch: int = -1):
        self.noise_lambda = noise_lambda
        super().__init__(optimizer, function=noise_lambda, last_epoch=last_epoch)

    @property
    def base_noise_multiplier(self) -> float:
        """σ_0 (Opacus's attribute name)."""
        return self.base


class ExponentialGradClip(_Exponential):
    """C ← γ C at every ``step()`` after the first (Opacus ``ExponentialGradClip(optimizer, gamma=)``)."""

    attribute = "max_grad_norm"


class StepGradClip(_Step):
    """C ← γ C every ``step_size`` epochs (Opacus ``StepGradClip(optimizer, step_size=, gamma=)``)."""

    attribute = "max_grad_norm"


class LambdaGradClip(_Lambda):
    """C_t = C_0 · scheduler_function(t) (Opacus ``LambdaGradClip(optimizer, scheduler_function=)``)."""

    attribute = "max_grad_norm"

    def __init__(self, optimizer, *, scheduler_function: Callable[[int], float], last_epoch: int = -1):
        self.scheduler_function = scheduler_function
        super().__init__(optimizer, function=scheduler_function, last_epoch=last_epoch)

    @property
    def base_max_grad_norm(self) -> float:
        """C_0 (Opacus's attribute name)."""
        return self.base
