"""Per-sample gradient engines behind the Privatizer.

Two paths produce the per-sample *sources* the
:class:`~dpopt.privatizer.Privatizer` reads (``num_params``, ``batch_size``,
``sq_norms``, ``weighted_sum``, ``nonfinite``):

* ``"reference"`` — :mod:`dpopt.engine.reference`: ``torch.func`` ``vmap(grad)``,
  any layer, materialises ``[B, *p.shape]`` per parameter;
* ``"fast"`` (default) — :mod:`dpopt.engine.fast`: ghost-norm / book-keeping
  rules for Linear, Conv2d, Embedding, LayerNorm and GroupNorm that never
  materialise per-sample gradients of a whole batch, including the AdaClip /
  DP-MacAdam shift/scale geometry; other parameters fall back to the
  reference path individually. "Dim 0 is the example" is verified, not
  assumed: per layer call on every batch, and against the reference path's
  per-example norms on the first batch (see :class:`PerSampleEngine`).

Modules: :mod:`~dpopt.engine.inputs` (the example-axis check both paths
use), :mod:`~dpopt.engine.check` (the first-batch check both capture paths
run, in the mode that trains, dropout masks replayed per example),
:mod:`~dpopt.engine.reference` (the ``torch.func`` path),
:mod:`~dpopt.engine.layers` (per-layer norm/sum math: blocks),
:mod:`~dpopt.engine.rules` (which layer types have a fast rule, registered
per type) and :mod:`~dpopt.engine.fast` (the engine that captures layer
calls and builds the fast source), :mod:`~dpopt.engine.lift` (the hook
door's layers whose rows are not examples, through an enclosing call).
Sources satisfy
:class:`dpopt.types.PerSampleSource`.

Both paths define example i's gradient as that of ``loss_fn(model(x_i),
y[i:i+1])`` with the model seeing example i alone; ``batch_dim`` says where
the examples are in x (dim 0 by default).

:class:`~dpopt.engine.hooks.HookCapture` is a third way in, for loops dpopt does not
own (:class:`dpopt.PrivacyEngine`): per-sample sources built from the user's own
forward and backward pass (forward hooks record layer inputs, tensor hooks the
output gradients), with the same rules and the same checks.

:func:`iter_per_sample_sources` is what :mod:`dpopt.training` calls: it splits a
logical batch into physical chunks lazily, so memory is bounded by the
physical batch size, and the Privatizer accumulates them into one release.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

from torch import Tensor, nn

from ..models import check_model
from ..types import EvaluationPoint
from . import attention, recurrent, ws  # noqa: F401,E402 — register the MultiheadAttention, LSTM/GRU/RNN, WSConv2d rules
from .capture import check_views
from .check import free_sizes
from .fast import FastPerSampleGrads, PerSampleEngine, fast_per_sample_gradients, get_engine
from .hooks import HookCapture, grad_sample_source
from .inputs import check_inputs
from .reference import PerSampleGrads, iter_per_sample_gradients, per_sample_gradients

__all__ = [
    "ENGINES",
    "iter_per_sample_sources",
    "FastPerSampleGrads",
    "PerSampleEngine",
    "fast_per_sample_gradients",
    "get_engine",
    "free_sizes",
    "PerSampleGrads",
    "per_sample_gradients",
    "iter_per_sample_gradients",
    "check_inputs",
    "HookCapture",
    "grad_sample_source",
]

ENGINES = ("fast", "reference")


def iter_per_sample_sources(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    physical_batch_size: Optional[int] = None,
    points: Optional[Sequence[EvaluationPoint]] = None,
    engine: str = "fast",
    batch_dim: int = 0,
    rows_per_example: int = 1,
    compile: object = False,
    cache_bytes: Optional[int] = None,
    norm_form: Optional[str] = None,
) -> Iterator:
    """Lazily yield per-sample sources for chunks of ≤ ``physical_batch_size`` examples.

    Args:
        model, loss_fn: as in :func:`dpopt.engine.reference.per_sample_gradients`
            (``loss_fn(logits[1, ...], target[1, ...]) -> scalar``).
        x: inputs with the B examples along ``batch_dim``; y: targets ``[B, ...]``
            (B may be 0: one empty source). ``loss_fn`` receives the model's
            output for one example (x with a size-1 example axis at
            ``batch_dim``) and ``y[i:i+1]``.
        physical_batch_size: chunk size P (None: the whole batch at once).
        points: DiSK evaluation points (default: θ with coefficient 1).
        engine: ``"fast"`` or ``"reference"``.
        batch_dim: x's example axis (default 0, the documented convention;
            e.g. 1 for sequence-first ``[T, B, ...]`` inputs). The fast
            engine computes every parameter by the per-example path when it
            is not 0.
        rows_per_example: K ≥ 1 (augmentation multiplicity): rows
            ``i·K … i·K + K − 1`` of x (along ``batch_dim``) and y are K views
            of example i, whose gradient is the mean over its views; sources
            have B = rows / K examples and ``physical_batch_size`` counts
            examples (a chunk never splits an example's views). See
            :class:`~dpopt.engine.fast.PerSampleEngine`.
        compile: ``engine="fast"`` only: True (``"inductor"``) or a backend
            name: the capture's forward and backward run as one
            ``torch.compile`` graph, checked against eager single-example
            autograd on the first batch (:mod:`dpopt.engine.compiled`).
        cache_bytes: bytes of per-example weight gradients the fast engine may
            keep between the norms and the clipped sum (all layers together,
            per source): None (default) derives it from the model and batch
            (≈ 10 % of what the non-private step holds:
            :func:`~dpopt.engine.layers.derived_cache_bytes`); 0 never caches
            (least memory); more trades memory for speed
            (docs/performance.md, "Memory budget of the per-layer choice").
        norm_form: ``engine="fast"`` only: None (default) lets the cost model choose each factored
            layer's norm form; ``"gram"``, ``"chol"`` or ``"direct"`` forces that form wherever it
            applies (:attr:`~dpopt.engine.layers.Budget.norm_form`; tests and measurements).

    Yields:
        per-sample sources; with ``engine="fast"`` each is freed when the
        next is requested (consume them one at a time, as the Privatizer does).

    Raises:
        ValueError: unknown engine, ``physical_batch_size`` ≤ 0, or invalid
            inputs (:func:`dpopt.engine.inputs.check_inputs`: a PackedSequence,
            or x's example axis and y's dim 0 of different lengths), a row
            count that is not a multiple of ``rows_per_example``, or a
            layer refused by :func:`dpopt.models.check_model`; ``cache_bytes``
            neither None nor an integer ≥ 0; ``norm_form`` not None or one of
            :data:`~dpopt.engine.layers.NORM_FORMS`, or given with ``engine="reference"``.
    """
    if physical_batch_size is not None and physical_batch_size <= 0:
        raise ValueError(f"physical_batch_size must be > 0, got {physical_batch_size}")
    if engine == "fast":
        eng = get_engine(model, loss_fn, rows_per_example, compile)
        eng.cache_bytes = cache_bytes  # this call's budget and norm form (the engine is cached per model)
        eng.norm_form = norm_form
        return eng.iterate(x, y, physical_batch_size, points, batch_dim)
    if compile:
        raise ValueError("compile= is an option of engine='fast' (the reference engine runs eagerly)")
    if norm_form is not None:
        raise ValueError("norm_form= is an option of engine='fast' (the reference engine has no norm forms)")
    if engine == "reference":
        check_model(model)
        k = int(rows_per_example)
        if k == 1:
            return iter_per_sample_gradients(model, loss_fn, x, y, physical_batch_size, points, batch_dim)
        if k != rows_per_example or k < 1:
            raise ValueError(f"rows_per_example must be an integer >= 1, got {rows_per_example!r}")
        check_views(int(y.shape[0]), k)
        return _mean_views(
            iter_per_sample_gradients(
                model, loss_fn, x, y, physical_batch_size and physical_batch_size * k, points, batch_dim
            ),
            k,
        )
    raise ValueError(f"unknown per-sample engine {engine!r}; choose one of {ENGINES}")


def _mean_views(chunks: Iterator[PerSampleGrads], k: int) -> Iterator[PerSampleGrads]:
    """The reference path's per-row sources as per-example ones: each example's K rows averaged."""
    for src in chunks:
        yield PerSampleGrads(
            [g.reshape(g.shape[0] // k, k, *g.shape[1:]).mean(1) for g in src.grads],
            params=src.params,
            points=src.points,
        )
