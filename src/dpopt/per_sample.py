"""Per-sample gradients: the ``torch.func`` reference path.

:class:`PerSampleGrads` holds materialised per-sample gradients (one tensor of
shape ``[B, *param.shape]`` per parameter) and answers the two questions the
Privatizer asks of any per-sample source:

* :meth:`PerSampleGrads.sq_norms` — squared norms of w_i = (g_i − shift)/scale,
  per clipping group, shape ``[B, G]``;
* :meth:`PerSampleGrads.weighted_sum` — Σ_i c_{i,k} w_i restricted to group k
  for every parameter, shape like the parameters.

The fast source, :class:`dpopt.engine.FastPerSampleGrads` (ghost norms,
book-keeping), implements the same two methods without materialising
``[B, d]`` tensors and calls :func:`per_sample_gradient_tensors` for the
parameters of layers it has no rule for; :func:`dpopt.engine.iter_per_sample_sources`
picks the engine. Instances are private data: only the
:class:`~dpopt.privatizer.Privatizer` may read them.

Non-finite per-sample gradients (an example whose gradient has any NaN/inf
coordinate) are replaced by zeros on construction, so the clipping bound — and
with it the sensitivity — holds for every example.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from .models import check_model
from .transforms.base import ClipGeometry, EvaluationPoint

__all__ = ["PerSampleGrads", "per_sample_gradients", "per_sample_gradient_tensors", "iter_per_sample_gradients"]

LossFn = Callable[[Tensor, Tensor], Tensor]


class PerSampleGrads:
    """Materialised per-sample gradients (private).

    Args:
        grads: one tensor per parameter, shape ``[B, *param.shape]``; all with
            the same B (B = 0 is allowed: an empty Poisson batch).

    Attributes:
        batch_size: B (private: never leaves the Privatizer).
        nonfinite: number of examples whose gradient had a non-finite entry
            (private diagnostic; those rows were zeroed).
    """

    def __init__(self, grads: Sequence[Tensor]):
        grads = list(grads)
        if not grads:
            raise ValueError("PerSampleGrads needs at least one parameter gradient")
        b = grads[0].shape[0]
        if any(g.shape[0] != b for g in grads):
            raise ValueError("all per-sample gradients must share the batch dimension")
        bad = torch.zeros(b, dtype=torch.bool, device=grads[0].device)
        for g in grads:
            bad |= ~torch.isfinite(g.reshape(b, math.prod(g.shape[1:]))).all(dim=1)
        self.nonfinite = int(bad.sum())
        if self.nonfinite:
            grads = [torch.where((~bad).view(-1, *([1] * (g.dim() - 1))), g, torch.zeros_like(g))
                     for g in grads]
        self.grads = grads
        self.batch_size = int(b)

    @property
    def num_params(self) -> int:
        return len(self.grads)

    def _w(self, i: int, geometry: ClipGeometry) -> Tensor:
        w = self.grads[i]
        if geometry.shift is not None:
            w = w - geometry.shift[i]
        if geometry.scale is not None:
            w = w / geometry.scale[i]
        return w

    def sq_norms(self, geometry: ClipGeometry, groups: Sequence[int], num_groups: int) -> Tensor:
        """Squared norms ‖w_i‖² per group: shape ``[B, num_groups]`` (float32/64)."""
        out = self.grads[0].new_zeros(self.batch_size, num_groups)
        for i, k in enumerate(groups):
            w = self._w(i, geometry)
            out[:, k] += w.reshape(self.batch_size, math.prod(w.shape[1:])).pow(2).sum(dim=1)
        return out

    def weighted_sum(self, weights: Tensor, geometry: ClipGeometry, groups: Sequence[int]) -> list[Tensor]:
        """Σ_i weights[i, group(p)] · w_i(p) for every parameter p (param-shaped)."""
        out = []
        for i, k in enumerate(groups):
            w = self._w(i, geometry)
            c = weights[:, k].to(w.dtype)
            out.append(torch.tensordot(c, w, dims=([0], [0])))
        return out


def _loss_per_example(model: nn.Module, loss_fn: LossFn):
    buffers = dict(model.named_buffers())

    def f(params: dict, x: Tensor, y: Tensor) -> Tensor:
        out = functional_call(model, (params, buffers), (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    return f


def _shifted(params: dict, offset: Optional[Sequence[Tensor]]) -> dict:
    if offset is None:
        return params
    return {k: v + o for (k, v), o in zip(params.items(), offset)}


def per_sample_gradient_tensors(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    points: Optional[Sequence[EvaluationPoint]] = None,
    names: Optional[Sequence[str]] = None,
) -> list[Tensor]:
    """Raw per-sample gradients (non-finite rows NOT zeroed) of selected trainable parameters.

    Args:
        model, loss_fn, x, y, points: as in :func:`per_sample_gradients`.
        names: parameter names (``named_parameters`` keys) to differentiate;
            the other parameters are held fixed. Default: every trainable one.
            ``points[k].offset`` always lists every trainable parameter.

    Returns:
        one tensor ``[B, *p.shape]`` per selected parameter, in
        ``named_parameters`` order.

    Raises:
        KeyError: a name that is not a trainable parameter.

    Source: ``torch.func`` ``vmap(grad(...))`` (per-sample-gradients tutorial).
    """
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    keys = list(params)
    chosen = keys if names is None else [k for k in keys if k in set(names)]
    if names is not None and len(chosen) != len(set(names)):
        raise KeyError(f"not trainable parameters of the model: {sorted(set(names) - set(chosen))}")
    points = list(points) if points else [EvaluationPoint(1.0)]
    if x.shape[0] == 0:
        return [params[k].new_zeros((0, *params[k].shape)) for k in chosen]
    f = _loss_per_example(model, loss_fn)

    def f_sel(sel: dict, rest: dict, xi: Tensor, yi: Tensor) -> Tensor:
        return f({**rest, **sel}, xi, yi)

    per_ex = vmap(grad(f_sel), in_dims=(None, None, 0, 0))
    total: Optional[list[Tensor]] = None
    for pt in points:
        shifted = _shifted(params, pt.offset)
        sel = {k: shifted[k] for k in chosen}
        rest = {k: v for k, v in shifted.items() if k not in sel}
        g = per_ex(sel, rest, x, y)
        g = [pt.coef * g[k] for k in chosen] if pt.coef != 1.0 else [g[k] for k in chosen]
        total = g if total is None else [a + c for a, c in zip(total, g)]
    return total  # type: ignore[return-value]


def per_sample_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    points: Optional[Sequence[EvaluationPoint]] = None,
) -> PerSampleGrads:
    """Per-sample gradients of ``loss_fn(model(x_i), y_i)`` w.r.t. trainable params.

    Args:
        model: the module; its trainable parameters in ``named_parameters`` order.
        loss_fn: ``loss_fn(logits[1, ...], target[1, ...]) -> scalar``.
        x: inputs ``[B, ...]``; y: targets ``[B, ...]``. B may be 0.
        points: evaluation points (DiSK); the per-example vector is
            Σ_k coef_k ∇ℓ(θ + offset_k; x_i). Default: one point at θ.

    Returns:
        :class:`PerSampleGrads` with one ``[B, *p.shape]`` tensor per parameter.

    Source: ``torch.func`` ``vmap(grad(...))`` (per-sample-gradients tutorial).
    """
    check_model(model)
    return PerSampleGrads(per_sample_gradient_tensors(model, loss_fn, x, y, points))


def iter_per_sample_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    physical_batch_size: Optional[int] = None,
    points: Optional[Sequence[EvaluationPoint]] = None,
) -> Iterator[PerSampleGrads]:
    """Yield :class:`PerSampleGrads` for chunks of at most ``physical_batch_size`` examples.

    An empty batch yields one empty chunk (so the step is still released).
    """
    b = x.shape[0]
    size = physical_batch_size or max(b, 1)
    if size <= 0:
        raise ValueError(f"physical_batch_size must be > 0, got {physical_batch_size}")
    if b == 0:
        yield per_sample_gradients(model, loss_fn, x, y, points)
        return
    for start in range(0, b, size):
        yield per_sample_gradients(model, loss_fn, x[start:start + size], y[start:start + size], points)
