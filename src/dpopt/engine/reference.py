"""Per-sample gradients: the ``torch.func`` reference path (``engine="reference"``).

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

**The example axis.** ``x``'s examples lie along ``batch_dim`` (default 0, the
documented convention); the targets ``y`` always have the examples along dim 0
and ``x.shape[batch_dim]`` must equal ``y.shape[0]`` (:func:`check_inputs`).
Example i's gradient is the gradient of ``loss_fn(model(x_i), y[i:i+1])``, where
``x_i = x.narrow(batch_dim, i, 1)`` keeps a size-1 example axis at
``batch_dim``: the model sees that example *alone*, so a forward that mixes
the examples of a batch (batch statistics, broadcasts over the batch) still
gets its per-example definition. ``loss_fn`` receives the model's output for
that one example, as the model returns it, and the target ``y[i:i+1]``.

**Two exact evaluations.** ``torch.func`` ``vmap(grad)`` by default; where
vmap cannot batch the model (recurrent layers, data-dependent shapes such as
``EmbeddingBag`` offsets or packing inside ``forward``), an exact loop of
single-example autograd calls, with a one-time warning that it is slower.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from ..models import check_model
from ..types import ClipGeometry, EvaluationPoint
from .check import Unreplayable
from .inputs import BufferWrite, LossFn, LossShapeError, buffers_unchanged, check_inputs, example_loss, guarded_buffers
from .layers import compute_dtype
from .row_norms import round_up_sq_norms

__all__ = [
    "PerSampleGrads",
    "per_sample_gradients",
    "per_sample_gradient_tensors",
    "iter_per_sample_gradients",
    "check_inputs",
    "METHODS",
]

METHODS = ("auto", "vmap", "loop")


class PerSampleGrads:
    """Materialised per-sample gradients (private).

    Args:
        grads: one tensor per parameter, shape ``[B, *param.shape]``; all with
            the same B (B = 0 is allowed: an empty Poisson batch).
        params: the parameters (the ``nn.Parameter`` objects) the gradients
            belong to, in the same order; None for raw tensors.
        points: the :class:`~dpopt.types.EvaluationPoint` objects
            the gradients were evaluated at; None if unknown.

    Attributes:
        batch_size: B (private: never leaves the Privatizer).
        nonfinite: number of examples whose gradient had a non-finite entry
            (private diagnostic; those rows were zeroed).
        params: tuple of the covered parameters in this source's order, or None.
        points: tuple of evaluation points, or None.
    """

    def __init__(
        self,
        grads: Sequence[Tensor],
        *,
        params: Optional[Sequence[Tensor]] = None,
        points: Optional[Sequence[EvaluationPoint]] = None,
    ):
        grads = list(grads)
        if not grads:
            raise ValueError("PerSampleGrads needs at least one parameter gradient")
        b = grads[0].shape[0]
        if any(g.shape[0] != b for g in grads):
            raise ValueError("all per-sample gradients must share the batch dimension")
        if params is not None and len(params) != len(grads):
            raise ValueError(f"{len(grads)} gradients but {len(params)} params")
        bad = torch.zeros(b, dtype=torch.bool, device=grads[0].device)
        for g in grads:
            bad |= ~torch.isfinite(g.reshape(b, math.prod(g.shape[1:]))).all(dim=1)
        self.nonfinite = int(bad.sum())
        if self.nonfinite:
            grads = [torch.where((~bad).view(-1, *([1] * (g.dim() - 1))), g, torch.zeros_like(g)) for g in grads]
        self.grads = grads
        self.batch_size = int(b)
        self.params = None if params is None else tuple(params)
        self.points = None if points is None else tuple(points)

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
        """Squared norms ‖w_i‖² per group: shape ``[B, num_groups]`` (float32/64).

        w_i = (g_i − shift)/scale is formed coordinate-wise (no cancellation
        beyond one rounding per coordinate), the very w_i that :meth:`weighted_sum` sums; the squares
        are accumulated in float64 and returned in :func:`~dpopt.engine.layers.compute_dtype` of the
        gradients' dtype (float32 for bf16) rounded UP (:func:`~dpopt.engine.row_norms.round_up_sq_norms`
        over the group's n coordinates: ≤ 2n + 3 float64 roundings — n squares, n − 1 additions, the
        norm's √ and its square, the group's additions): never below the exact ‖w_i‖² of the group, so
        the Privatizer's clip factor keeps the clipped norm ≤ C. float64 gradients: the float64
        evaluation (as every float64 engine's norms).
        """
        out = self.grads[0].new_zeros(self.batch_size, num_groups, dtype=torch.float64)
        terms = [0] * num_groups
        for i, k in enumerate(groups):
            w = self._w(i, geometry)
            n = math.prod(w.shape[1:])
            terms[k] += 2 * n + 4
            out[:, k] += torch.linalg.vector_norm(w.reshape(self.batch_size, n), dim=1, dtype=torch.float64).square()
        return round_up_sq_norms(out, max([1, *terms]), compute_dtype(self.grads[0].dtype))

    def weighted_sum(self, weights: Tensor, geometry: ClipGeometry, groups: Sequence[int]) -> list[Tensor]:
        """Σ_i weights[i, group(p)] · w_i(p) for every parameter p (param-shaped), in
        :func:`~dpopt.engine.layers.compute_dtype` of w's dtype (bf16 gradients summed in float32)."""
        out = []
        for i, k in enumerate(groups):
            w = self._w(i, geometry)
            w = w.to(compute_dtype(w.dtype))
            c = weights[:, k].to(w.dtype)
            out.append(torch.tensordot(c, w, dims=([0], [0])))
        return out


# Models for which vmap failed or disagreed with the loop: per-example gradients by the loop.
class ExampleFailed(ValueError):
    """The model or loss raised on a single example (the exact loop's ``model(x_i)``)."""


_LOOP_MODELS: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def use_loop(model: nn.Module, reason: str) -> None:
    """From now on compute ``model``'s per-example gradients by the exact loop (warns once)."""
    if model not in _LOOP_MODELS:
        _LOOP_MODELS[model] = reason
        warnings.warn(
            f"per-example gradients of {type(model).__name__} use an exact loop of single-example "
            f"autograd calls (slower than torch.func.vmap): {reason}",
            RuntimeWarning,
            stacklevel=4,
        )


def _one_example(model: nn.Module, loss_fn: LossFn, batch_dim: int):
    """ℓ(params; x_i, y_i) for one example whose example axis vmap removed (re-inserted at batch_dim).

    The model's buffers are passed as guarded aliases
    (:func:`~dpopt.engine.inputs.guarded_buffers`: the same storage, kept in
    ``f.buffers``): a forward that rebinds one (``buf.data = ...``) under vmap
    raises :class:`~dpopt.engine.inputs.BufferWrite` instead of putting a
    batched tensor into the model (a crash), and a rebinding by any other
    means is found after the pass (:func:`_rebound_buffers`).
    """
    buffers = guarded_buffers(model)

    def f(params: dict, x: Tensor, y: Tensor) -> Tensor:
        out = functional_call(model, (params, buffers), (x.unsqueeze(batch_dim),))
        return example_loss(loss_fn(out, y.unsqueeze(0)))

    f.buffers = buffers  # type: ignore[attr-defined]
    return f


def _rebound_buffers(model: nn.Module, aliases: dict) -> list[str]:
    """Names of buffers whose vmap alias (:func:`_one_example`) no longer shares the buffer's storage."""
    real = dict(model.named_buffers())
    out = []
    for k, a in aliases.items():
        try:
            moved = k not in real or a.data_ptr() != real[k].data_ptr() or a.shape != real[k].shape
        except RuntimeError:  # rebound to a batched tensor of the vmap pass (it has no storage of its own)
            moved = True
        if moved:
            out.append(k)
    return sorted(out)


def _shifted(params: dict, offset: Optional[Sequence[Tensor]]) -> dict:
    if offset is None:
        return params
    return {k: v + o for (k, v), o in zip(params.items(), offset)}


def _vmap_grads(model, loss_fn, sel: dict, rest: dict, x: Tensor, y: Tensor, bd: int) -> dict:
    f = _one_example(model, loss_fn, bd)

    def f_sel(s: dict, r: dict, xi: Tensor, yi: Tensor) -> Tensor:
        return f({**r, **s}, xi, yi)

    # randomness="different": each example draws its own dropout masks, as it would alone (the loop)
    out = vmap(grad(f_sel), in_dims=(None, None, bd, 0), randomness="different")(sel, rest, x, y)
    rebound = _rebound_buffers(model, f.buffers)
    if rebound:
        raise BufferWrite(
            f"the model's forward pass rebinds its buffers {rebound} (buf.data = ...) while computing "
            "per-sample gradients of private examples: their new values are un-noised statistics "
            "of the private batch and would be released with the model. Keep buffers constant "
            "during training (an EMA or codebook update belongs outside the private forward, or "
            "in parameters trained privately)"
        )
    return out


def _loop_grads(model, loss_fn, sel: dict, rest: dict, x: Tensor, y: Tensor, bd: int) -> dict:
    """Exact per-example gradients by one autograd call per example (the definition)."""
    buffers = dict(model.named_buffers())
    leaves = {k: v.detach().requires_grad_(True) for k, v in sel.items()}
    rows = []
    for i in range(y.shape[0]):
        try:
            with torch.enable_grad():
                out = functional_call(model, ({**rest, **leaves}, buffers), (x.narrow(bd, i, 1),))
                loss = example_loss(loss_fn(out, y[i : i + 1]))
                gs = (
                    torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
                    if loss.requires_grad
                    else [None] * len(leaves)
                )
        except (LossShapeError, Unreplayable):  # the user's loss / the check's replay: say so directly
            raise
        except Exception as err:  # noqa: BLE001 — the user's model/loss: say what was called
            raise ExampleFailed(
                f"per-example gradients failed: model(x_i) with one example (a size-1 example "
                f"axis at batch_dim={bd}, shape {tuple(x.narrow(bd, i, 1).shape)}) and "
                f"loss_fn(out, y[i:i+1]) raised {type(err).__name__}: {err}"
            ) from err
        rows.append([torch.zeros_like(v) if g is None else g.detach() for g, v in zip(gs, leaves.values())])
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(leaves)}


def _grads(model, loss_fn, sel, rest, x, y, bd, method: str) -> dict:
    if method == "loop" or (method == "auto" and model in _LOOP_MODELS):
        return _loop_grads(model, loss_fn, sel, rest, x, y, bd)
    try:
        return _vmap_grads(model, loss_fn, sel, rest, x, y, bd)
    except (LossShapeError, BufferWrite):
        raise  # the user's loss / a buffer write, not vmap: say so directly
    except Exception as err:  # noqa: BLE001 — vmap cannot batch this model: the exact loop instead
        if method == "vmap":
            raise
        use_loop(model, f"torch.func.vmap cannot batch it ({type(err).__name__}: {str(err).splitlines()[0][:120]})")
        return _loop_grads(model, loss_fn, sel, rest, x, y, bd)


def per_sample_gradient_tensors(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    points: Optional[Sequence[EvaluationPoint]] = None,
    names: Optional[Sequence[str]] = None,
    batch_dim: int = 0,
    method: str = "auto",
) -> list[Tensor]:
    """Raw per-sample gradients (non-finite rows NOT zeroed) of selected trainable parameters.

    Args:
        model, loss_fn, x, y, points, batch_dim: as in :func:`per_sample_gradients`.
        names: parameter names (``named_parameters`` keys) to differentiate;
            the other parameters are held fixed. Default: every trainable one.
            ``points[k].offset`` always lists every trainable parameter.
        method: ``"vmap"``, ``"loop"`` (one autograd call per example) or
            ``"auto"`` (vmap; the loop for models vmap cannot batch).

    Returns:
        one tensor ``[B, *p.shape]`` per selected parameter, in
        ``named_parameters`` order.

    Raises:
        KeyError: a name that is not a trainable parameter.
        ValueError: invalid inputs (:func:`check_inputs`), unknown method,
            the model/loss failed on a single example, or the forward pass
            changed a buffer (:func:`~dpopt.engine.inputs.buffers_unchanged`).

    Source: ``torch.func`` ``vmap(grad(...))`` (per-sample-gradients tutorial).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    bd = check_inputs(x, y, batch_dim)
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    keys = list(params)
    chosen = keys if names is None else [k for k in keys if k in set(names)]
    if names is not None and len(chosen) != len(set(names)):
        raise KeyError(f"not trainable parameters of the model: {sorted(set(names) - set(chosen))}")
    points = list(points) if points else [EvaluationPoint(1.0)]
    if y.shape[0] == 0:
        return [params[k].new_zeros((0, *params[k].shape)) for k in chosen]
    total: Optional[list[Tensor]] = None
    for pt in points:
        shifted = _shifted(params, pt.offset)
        sel = {k: shifted[k] for k in chosen}
        rest = {k: v for k, v in shifted.items() if k not in sel}
        with buffers_unchanged(model):
            g = _grads(model, loss_fn, sel, rest, x, y, bd, method)
        g = [pt.coef * g[k] for k in chosen] if pt.coef != 1.0 else [g[k] for k in chosen]  # type: ignore[assignment]
        total = g if total is None else [a + c for a, c in zip(total, g)]  # type: ignore[assignment]
    return total  # type: ignore[return-value]


def per_sample_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    points: Optional[Sequence[EvaluationPoint]] = None,
    batch_dim: int = 0,
) -> PerSampleGrads:
    """Per-sample gradients of ``loss_fn(model(x_i), y[i:i+1])`` w.r.t. trainable params.

    Args:
        model: the module; its trainable parameters in ``named_parameters`` order.
        loss_fn: ``loss_fn(out_i, target[1, ...]) -> scalar`` where ``out_i``
            is the model's output for one example (module docstring).
        x: inputs with the B examples along ``batch_dim``; y: targets ``[B, ...]``.
            B may be 0.
        points: evaluation points (DiSK); the per-example vector is
            Σ_k coef_k ∇ℓ(θ + offset_k; x_i). Default: one point at θ.
        batch_dim: x's example axis (default 0).

    Returns:
        :class:`PerSampleGrads` with one ``[B, *p.shape]`` tensor per parameter,
        ``params`` the trainable parameters and ``points`` the points given
        (default ``(EvaluationPoint(1.0),)``).

    Raises:
        ValueError: a layer refused by :func:`~dpopt.models.check_model`, or
            invalid inputs (:func:`check_inputs`).

    Source: ``torch.func`` ``vmap(grad(...))`` (per-sample-gradients tutorial).
    """
    check_model(model)
    pts = tuple(points) if points else (EvaluationPoint(1.0),)
    params = tuple(p for p in model.parameters() if p.requires_grad)
    return PerSampleGrads(
        per_sample_gradient_tensors(model, loss_fn, x, y, pts, batch_dim=batch_dim), params=params, points=pts
    )


def iter_per_sample_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    physical_batch_size: Optional[int] = None,
    points: Optional[Sequence[EvaluationPoint]] = None,
    batch_dim: int = 0,
) -> Iterator[PerSampleGrads]:
    """Yield :class:`PerSampleGrads` for chunks of at most ``physical_batch_size`` examples.

    Chunks are cut along ``batch_dim`` of x (dim 0 of y). An empty batch
    yields one empty chunk (so the step is still released).

    Raises:
        ValueError: ``physical_batch_size`` ≤ 0 or invalid inputs (:func:`check_inputs`).
    """
    bd = check_inputs(x, y, batch_dim)
    b = y.shape[0]
    size = physical_batch_size or max(b, 1)
    if size <= 0:
        raise ValueError(f"physical_batch_size must be > 0, got {physical_batch_size}")
    return _iter_chunks(model, loss_fn, x, y, size, points, bd)


def _iter_chunks(model, loss_fn, x, y, size, points, bd) -> Iterator[PerSampleGrads]:
    b = y.shape[0]
    if b == 0:
        yield per_sample_gradients(model, loss_fn, x, y, points, bd)
        return
    for start in range(0, b, size):
        n = min(size, b - start)
        yield per_sample_gradients(model, loss_fn, x.narrow(bd, start, n), y[start : start + n], points, bd)
