"""Parameter averaging of RELEASED parameters: EMA (with De et al.'s warm-up) and Polyak averaging.

Post-processing only. After each DP step the model's parameters are a
function of the noisy releases so far (and of public values: the
initialisation, the hyperparameters); an average of those parameter vectors
is therefore post-processing of the releases and costs no privacy (Dwork &
Roth 2014, Prop. 2.1). :class:`ParameterAverager` reads the parameters only
through :meth:`ParameterAverager.update`, called *after* ``optimizer.step()``
— never the gradients, per-example quantities or batches — and holds its
own tensors (no copy of the module, so no copy of the hooks dpopt's
``PrivacyEngine`` attached to it).

Rules (θ_t: the parameters after the t-th update, t = 1, 2, ...; the average
starts from θ_0, the parameters when the averager is made):

* EMA, decay D, with warm-up (``warmup=True``)::

      d_t = min(D, (1 + t) / (10 + t)),   θ̄_t = d_t θ̄_{t−1} + (1 − d_t) θ_t

  the warm-up of TensorFlow's ``ExponentialMovingAverage(num_updates=t)``,
  which the jax_privacy EMA used in De et al. 2022 (arXiv:2204.13650, §3.3:
  "parameter averaging", EMA decay 0.999 for their CIFAR-10 WRN runs) also
  applies, so that a short run is not dominated by the random θ_0
  (with D = 0.999 and no warm-up, θ_0 keeps weight 0.999^t: 74 % after 300 steps).
  ``warmup=False``: d_t = D.
* Polyak (uniform) averaging from step s (``mode="polyak"``,
  ``start_step=s``): θ̄_t = θ_t for t ≤ s, then θ̄_t = θ̄_{t−1} + (θ_t − θ̄_{t−1}) / (t − s + 1)
  — the mean of θ_s, ..., θ_t (Polyak & Juditsky 1992).

:func:`unhooked_copy` makes a copy of a module without the hooks and tapped
forwards dpopt (or anyone) attached to it: ``torch.optim.swa_utils.AveragedModel(model)``
deep-copies ``model`` with its hooks — for a model returned by
``PrivacyEngine.make_private`` that is a second, stray capture object recording
the private layer inputs of every forward of the copy with gradients on;
use ``AveragedModel(unhooked_copy(model))`` or, simpler, this averager.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Iterator, Optional, Union

import torch
from torch import Tensor, nn

__all__ = ["ParameterAverager", "ema_decay_at", "unhooked_copy", "MODES"]

MODES = ("ema", "polyak")


def ema_decay_at(t: int, decay: float, warmup: bool = True) -> float:
    """The EMA decay used at update t (1-based): ``min(decay, (1 + t)/(10 + t))``, or ``decay`` without warm-up."""
    return min(decay, (1.0 + t) / (10.0 + t)) if warmup else decay


class ParameterAverager:
    """An EMA or Polyak average of a model's trainable parameters, updated from released values only.

    Args:
        params: an ``nn.Module`` (its trainable parameters, ``named_parameters`` order)
            or an iterable of parameters.
        decay: EMA decay D in [0, 1) (``mode="ema"``; required there).
        mode: ``"ema"`` or ``"polyak"``.
        warmup: EMA warm-up ``min(D, (1 + t)/(10 + t))`` (module docstring).
        start_step: Polyak: average the parameters from this update on (0: from θ_0).

    Attributes:
        averaged: the averaged tensors (detached, float32 or the parameters'
            dtype; same shapes and devices as the parameters).
        step: number of :meth:`update` calls so far.

    Raises:
        ValueError: unknown mode, a decay outside [0, 1) (or missing for EMA),
            a negative start_step, no trainable parameter.

    Example::

        ema = ParameterAverager(model, decay=0.999)
        for batch in loader:
            ...; optimizer.step(); ema.update()
        with ema.swapped(model):
            evaluate(model)            # the averaged parameters, then the raw ones back
    """

    def __init__(
        self,
        params: Union[nn.Module, "Iterator[Tensor]"],
        decay: Optional[float] = None,
        *,
        mode: str = "ema",
        warmup: bool = True,
        start_step: int = 0,
    ):
        if mode not in MODES:
            raise ValueError(f"averaging mode must be one of {MODES}, got {mode!r}")
        if mode == "ema":
            if decay is None or not (isinstance(decay, (int, float)) and math.isfinite(decay) and 0 <= decay < 1):
                raise ValueError(f"EMA decay must be a number in [0, 1) (e.g. 0.999), got {decay!r}")
        elif decay is not None:
            raise ValueError("decay applies to mode 'ema' only (Polyak averaging is uniform)")
        if int(start_step) < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        if isinstance(params, nn.Module):
            params = [p for p in params.parameters() if p.requires_grad]  # type: ignore[assignment]
        self.params = list(params)  # type: ignore[arg-type]
        if not self.params:
            raise ValueError("ParameterAverager needs at least one trainable parameter")
        self.mode, self.decay, self.warmup, self.start_step = mode, decay, bool(warmup), int(start_step)
        self.step = 0
        self.averaged = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """Fold in the current parameters (call once after each ``optimizer.step()``)."""
        self.step += 1
        t = self.step
        if self.mode == "ema":
            d = ema_decay_at(t, self.decay, self.warmup)  # type: ignore[arg-type]
            for a, p in zip(self.averaged, self.params):
                a.mul_(d).add_(p.detach(), alpha=1.0 - d)
            return
        if t <= self.start_step:
            for a, p in zip(self.averaged, self.params):
                a.copy_(p.detach())
            return
        n = t - self.start_step + 1  # θ_s, ..., θ_t
        for a, p in zip(self.averaged, self.params):
            a.add_(p.detach() - a, alpha=1.0 / n)

    @contextlib.contextmanager
    def swapped(self, module: Optional[nn.Module] = None):
        """Within the block the parameters hold the averaged values; the raw ones are put back after.

        ``module`` is only used to check that it owns the averaged parameters. Runs
        under ``torch.no_grad`` for the copies (the values, not the Parameter
        objects, change: optimizer and hooks keep working).
        """
        if module is not None:
            owned = {id(p) for p in module.parameters()}
            if any(id(p) not in owned for p in self.params):
                raise ValueError("this averager's parameters are not the module's")
        raw = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, a in zip(self.params, self.averaged):
                p.copy_(a)
        try:
            yield module
        finally:
            with torch.no_grad():
                for p, r in zip(self.params, raw):
                    p.copy_(r)

    def averaged_state_dict(self, module: nn.Module) -> dict:
        """``module.state_dict()`` with the averaged parameter values (what ``model_ema.pt`` holds)."""
        with self.swapped(module):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def state_dict(self) -> dict:
        """Public state (a function of released parameters): mode, decay, warm-up, step and the averages."""
        return {
            "mode": self.mode,
            "decay": self.decay,
            "warmup": self.warmup,
            "start_step": self.start_step,
            "step": self.step,
            "averaged": [a.clone() for a in self.averaged],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (a checkpoint).

        Raises:
            ValueError: another mode/decay/warm-up, or tensors of other shapes.
        """
        mine = (self.mode, self.decay, self.warmup, self.start_step)
        theirs = (state["mode"], state["decay"], state["warmup"], state["start_step"])
        if mine != theirs:
            raise ValueError(f"averager state for {theirs} loaded into an averager for {mine}")
        if [tuple(a.shape) for a in state["averaged"]] != [tuple(a.shape) for a in self.averaged]:
            raise ValueError("averager state does not fit these parameters (other shapes)")
        self.step = int(state["step"])
        with torch.no_grad():
            for a, s in zip(self.averaged, state["averaged"]):
                a.copy_(s)


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def unhooked_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` without its module hooks and instance ``forward`` overrides.

    The original keeps all of them (they are set aside during the copy and
    put back). Tensor hooks on parameters are not copied by ``deepcopy``
    either. Use it where a library deep-copies a model (``AveragedModel``):
    a copy of a model returned by ``PrivacyEngine.make_private`` would
    otherwise carry a second capture object of the private layer inputs.
    """
    saved = []
    for m in module.modules():
        hooks = {name: getattr(m, name) for name in _HOOK_DICTS if hasattr(m, name)}
        fwd = m.__dict__.get("forward")
        saved.append((m, hooks, fwd))
        for name, d in hooks.items():
            setattr(m, name, type(d)())
        if fwd is not None:
            del m.__dict__["forward"]
    try:
        return copy.deepcopy(module)
    finally:
        for m, hooks, fwd in saved:
            for name, d in hooks.items():
                setattr(m, name, d)
            if fwd is not None:
                m.__dict__["forward"] = fwd
