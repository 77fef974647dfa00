"""DPOptimizer: a ``torch.optim.Optimizer`` = Privatizer + post-processing chain.

``step(per_sample)`` does, for one logical step::

    geometry = transform.geometry(state)          # released state only
    release  = privatizer.privatize(per_sample, geometry)   # the one read of private data
    updates  = transform.update(release.grads, state, ctx)  # post-processing
    p += update                                   # (updates already include −lr)

It calls ``super().__init__`` so LR schedulers, ``state_dict`` and hooks work;
learning rates are read from ``param_groups`` at every step.
"""

from __future__ import annotations


import torch
from torch import Tensor

from .privatizer import Privatizer, Release
from .transforms.base import ClipGeometry, EvaluationPoint, StepContext, Transform

__all__ = ["DPOptimizer"]


class DPOptimizer(torch.optim.Optimizer):
    """Differentially private optimizer facade.

    Args:
        params: iterable of parameters or param-group dicts (each group needs
            ``lr``; extra keys are public hyperparameters visible to transforms).
        privatizer: the :class:`~dpopt.privatizer.Privatizer` (owns the ledger).
        transform: the post-processing chain; its output must already include
            the −lr scaling (e.g. end with ``scale_by_lr()``).
        lr: default learning rate (> 0).

    Raises:
        ValueError: lr ≤ 0.
        TypeError: a closure passed to :meth:`step` (DP steps need per-sample
            gradients, not a loss closure).
    """

    def __init__(self, params, privatizer: Privatizer, transform: Transform, lr: float = 1e-3):
        if not (isinstance(lr, (int, float)) and lr > 0):
            raise ValueError(f"lr must be > 0, got {lr!r}; e.g. --lr 1e-3 for Adam-type methods, 0.1 for SGD")
        super().__init__(params, {"lr": float(lr)})
        for group in self.param_groups:
            if not group["lr"] > 0:
                raise ValueError(f"lr must be > 0 in every param group, got {group['lr']}")
        self.privatizer = privatizer
        self.transform = transform

    # -- helpers over all trainable params, in group order ------------------
    def _params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _states(self) -> list[dict]:
        states = []
        for p in self._params():
            if not self.state[p]:
                self.state[p].update(self.transform.init(p))
            states.append(self.state[p])
        return states

    def geometry(self) -> ClipGeometry:
        """The clip geometry for the next step (identity unless a transform provides one)."""
        with torch.no_grad():
            geo = self.transform.geometry(self._states(), self._params())
        return geo if geo is not None else ClipGeometry()

    def evaluation_points(self) -> list[EvaluationPoint]:
        """Where the next per-sample gradients must be evaluated (default: at θ)."""
        with torch.no_grad():
            pts = self.transform.evaluation_points(self._states(), self._params())
        return pts if pts is not None else [EvaluationPoint(1.0)]

    @torch.no_grad()
    def step(self, per_sample=None, closure=None) -> Release:  # type: ignore[override]
        """One DP step from per-sample gradients of the trainable parameters.

        Args:
            per_sample: a per-sample source (``PerSampleGrads``) or an iterable
                of them (micro-batches of one logical batch), parameters in
                the optimizer's order.

        Returns:
            The step's :class:`~dpopt.privatizer.Release`.
        """
        if closure is not None or callable(per_sample):
            raise TypeError("DPOptimizer.step does not take a closure; pass per-sample gradients")
        if per_sample is None:
            raise TypeError("DPOptimizer.step needs per-sample gradients (see dpopt.per_sample)")
        params = self._params()
        states = self._states()
        release = self.privatizer.privatize(per_sample, self.geometry(), params_like=params)
        lrs = [g["lr"] for g in self.param_groups for _ in g["params"]]
        groups = [g for g in self.param_groups for _ in g["params"]]
        ctx = StepContext(step=release.step + 1, noise_std=release.noise_std, lrs=lrs, groups=groups,
                          noise_multiplier=release.noise_multiplier,
                          expected_batch_size=release.expected_batch_size)
        updates = self.transform.update(list(release.grads), states, params, ctx)
        for p, u in zip(params, updates):
            p.add_(u)
        return release
