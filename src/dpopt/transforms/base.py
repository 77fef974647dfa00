"""Post-processing transforms: the part of an optimizer that only sees releases.

A :class:`Transform` maps a list of param-shaped update tensors (starting with
the released, privatized gradient) to a new list, keeping named per-parameter
state. Transforms compose with :func:`chain` and route subsets of parameters
with :class:`Partition`. Nothing here ever receives a tensor with a batch axis:
the inputs are :class:`~dpopt.privatizer.Release` contents and public
hyperparameters, so by the post-processing property of DP every transform is
free (Dwork & Roth 2014, Prop. 2.1).

State layout (torch-style): ``optimizer.state[p]`` is the dict returned by the
root transform's :meth:`Transform.init`; a chain stores each member's state
under the member's ``name`` (``"0.scale_by_adam"`` …), and each member keeps
torch's key names (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ``step``).

Feedback: a transform may override :meth:`Transform.geometry` to give the
Privatizer the clip geometry for the NEXT step (AdaClip, DP-MacAdam), or
:meth:`Transform.evaluation_points` to say where the next per-sample gradients
are evaluated (DiSK). Both read released state only; they are the only two
ways state flows back towards private data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from ..types import ClipGeometry, EvaluationPoint  # re-exported: defined in the core-types leaf module

__all__ = [
    "StepContext",
    "Transform",
    "Chain",
    "chain",
    "Partition",
    "ClipGeometry",
    "EvaluationPoint",
]


@dataclass
class StepContext:
    """Public per-step information handed to every transform.

    Attributes:
        step: 1-based index t of the update being computed.
        noise_std: per-parameter noise std of the release, in released
            (gradient) coordinates: 0-d tensor or param-shaped tensor.
        lrs: per-parameter learning rate (from the optimizer's param groups,
            so LR schedulers work).
        groups: per-parameter param-group dict (public hyperparameters).
        noise_multiplier, expected_batch_size: the release's public constants.
    """

    step: int
    noise_std: Sequence[Tensor]
    lrs: Sequence[float]
    groups: Sequence[dict] = field(default_factory=list)
    noise_multiplier: float = 0.0
    expected_batch_size: float = 1.0

    def subset(self, index: Sequence[int]) -> "StepContext":
        """The context restricted to the parameters at ``index`` (for Partition)."""
        pick = lambda xs: [xs[i] for i in index] if xs else xs  # noqa: E731
        return StepContext(
            self.step,
            pick(self.noise_std),
            pick(self.lrs),
            pick(self.groups),
            self.noise_multiplier,
            self.expected_batch_size,
        )


class Transform:
    """Base class of post-processing transforms.

    Subclasses override :meth:`init_param` (per-parameter state) and
    :meth:`update`. ``update`` may mutate its own ``states`` entries in place
    but must never modify ``updates`` in place (released tensors are shared).
    """

    name: str = "transform"

    def init(self, param: Tensor) -> dict:
        """State for one parameter (shape ``param.shape``)."""
        return {}

    def update(self, updates: list[Tensor], states: list[dict], params: list[Tensor], ctx: StepContext) -> list[Tensor]:
        raise NotImplementedError

    def apply(self, updates: list[Tensor], states: list[dict], params: list[Tensor], ctx: StepContext) -> None:
        """``p += update(updates)`` for every parameter, in place (the optimizer's last act of a step).

        Default: :meth:`update`, then one ``_foreach_add_``. A transform whose
        output is a per-parameter scaling of its input overrides this to add
        ``updates`` scaled into the parameters directly, so that no second
        full-size tensor beside the release exists (issue 43: bytes per
        parameter). ``updates`` is never modified.
        """
        if params:
            torch._foreach_add_(params, list(self.update(updates, states, params, ctx)))

    def geometry(self, states: list[dict], params: list[Tensor]) -> Optional[ClipGeometry]:
        """Clip geometry for the next step, or ``None`` (this transform has no say)."""
        return None

    def evaluation_points(self, states: list[dict], params: list[Tensor]) -> Optional[list[EvaluationPoint]]:
        """Where the next per-sample gradients are evaluated, or ``None`` (at θ)."""
        return None

    def __repr__(self) -> str:
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


class Chain(Transform):
    """Apply transforms in order; member i keeps its state under ``f"{i}.{name}"``."""

    name = "chain"

    def __init__(self, *transforms: Transform):
        if not transforms:
            raise ValueError("chain() needs at least one transform")
        self.transforms = tuple(transforms)
        self.keys = tuple(f"{i}.{t.name}" for i, t in enumerate(self.transforms))

    def init(self, param: Tensor) -> dict:
        return {k: t.init(param) for k, t in zip(self.keys, self.transforms)}

    def update(self, updates, states, params, ctx):
        for key, t in zip(self.keys, self.transforms):
            updates = t.update(updates, [s[key] for s in states], params, ctx)
        return updates

    def apply(self, updates, states, params, ctx) -> None:
        """Every member's :meth:`~Transform.update` but the last, then the last one's :meth:`~Transform.apply`."""
        for key, t in zip(self.keys[:-1], self.transforms[:-1]):
            updates = t.update(updates, [s[key] for s in states], params, ctx)
        self.transforms[-1].apply(updates, [s[self.keys[-1]] for s in states], params, ctx)

    def geometry(self, states, params):
        for key, t in zip(self.keys, self.transforms):
            geo = t.geometry([s[key] for s in states], params)
            if geo is not None:
                return geo
        return None

    def evaluation_points(self, states, params):
        for key, t in zip(self.keys, self.transforms):
            pts = t.evaluation_points([s[key] for s in states], params)
            if pts is not None:
                return pts
        return None

    def __repr__(self) -> str:
        return "chain(" + ", ".join(map(repr, self.transforms)) + ")"


def chain(*transforms: Transform) -> Transform:
    """Compose transforms left to right (optax-style). A single one is returned as is."""
    return transforms[0] if len(transforms) == 1 else Chain(*transforms)


class Partition(Transform):
    """Route parameters to different transforms by a label.

    Args:
        transforms: mapping label → transform.
        label_fn: ``label_fn(param) -> label``, evaluated once per parameter at
            :meth:`init` time and stored in the state (key ``"label"``), so a
            user can override routing by passing their own function.

    Raises:
        KeyError: at init, if ``label_fn`` returns a label with no transform.
    """

    name = "partition"

    def __init__(self, transforms: dict[str, Transform], label_fn: Callable[[Tensor], str]):
        self.transforms = dict(transforms)
        self.label_fn = label_fn

    def init(self, param: Tensor) -> dict:
        label = self.label_fn(param)
        if label not in self.transforms:
            raise KeyError(f"partition label {label!r} has no transform; known: {sorted(self.transforms)}")
        return {"label": label, "inner": self.transforms[label].init(param)}

    def _groups(self, states) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, s in enumerate(states):
            groups.setdefault(s["label"], []).append(i)
        return groups

    def update(self, updates, states, params, ctx):
        out: list[Optional[Tensor]] = [None] * len(updates)
        for label, idx in self._groups(states).items():
            res = self.transforms[label].update(
                [updates[i] for i in idx], [states[i]["inner"] for i in idx], [params[i] for i in idx], ctx.subset(idx)
            )
            for i, r in zip(idx, res):
                out[i] = r
        return out

    def geometry(self, states, params):
        parts = {
            label: (idx, self.transforms[label].geometry([states[i]["inner"] for i in idx], [params[i] for i in idx]))
            for label, idx in self._groups(states).items()
        }
        if all(g is None for _, g in parts.values()):
            return None
        shift: list[Tensor] = [torch.zeros_like(p) for p in params]
        scale: list[Tensor] = [torch.ones_like(p) for p in params]
        for idx, geo in parts.values():
            if geo is None:
                continue
            for j, i in enumerate(idx):
                if geo.shift is not None:
                    shift[i] = geo.shift[j]
                if geo.scale is not None:
                    scale[i] = geo.scale[j]
        return ClipGeometry(tuple(shift), tuple(scale))

    def evaluation_points(self, states, params):
        for label, idx in self._groups(states).items():
            pts = self.transforms[label].evaluation_points([states[i]["inner"] for i in idx], [params[i] for i in idx])
            if pts is not None:
                raise NotImplementedError(
                    "evaluation points inside a Partition are not supported; put the filter before the partition"
                )
        return None
