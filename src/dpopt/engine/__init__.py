"""Per-sample gradient engines behind the Privatizer.

Two paths produce the per-sample *sources* the
:class:`~dpopt.privatizer.Privatizer` reads (``num_params``, ``batch_size``,
``sq_norms``, ``weighted_sum``, ``nonfinite``):

* ``"reference"`` — :mod:`dpopt.per_sample`: ``torch.func`` ``vmap(grad)``,
  any layer, materialises ``[B, *p.shape]`` per parameter;
* ``"fast"`` (default) — :mod:`dpopt.engine.fast`: ghost-norm / book-keeping
  rules for Linear, Conv2d, Embedding, LayerNorm and GroupNorm that never
  materialise per-sample gradients of a whole batch, including the AdaClip /
  DP-MacAdam shift/scale geometry; other parameters fall back to the
  reference path individually.

:func:`iter_per_sample_sources` is what :mod:`dpopt.train` calls: it splits a
logical batch into physical chunks lazily, so memory is bounded by the
physical batch size, and the Privatizer accumulates them into one release.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

from torch import Tensor, nn

from ..per_sample import iter_per_sample_gradients
from ..transforms.base import EvaluationPoint
from .fast import FastPerSampleGrads, PerSampleEngine, fast_per_sample_gradients, get_engine

__all__ = ["ENGINES", "iter_per_sample_sources", "FastPerSampleGrads", "PerSampleEngine",
           "fast_per_sample_gradients", "get_engine"]

ENGINES = ("fast", "reference")


def iter_per_sample_sources(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    physical_batch_size: Optional[int] = None,
    points: Optional[Sequence[EvaluationPoint]] = None,
    engine: str = "fast",
) -> Iterator:
    """Lazily yield per-sample sources for chunks of ≤ ``physical_batch_size`` examples.

    Args:
        model, loss_fn: as in :func:`dpopt.per_sample.per_sample_gradients`
            (``loss_fn(logits[1, ...], target[1, ...]) -> scalar``).
        x: inputs ``[B, ...]``; y: targets ``[B, ...]`` (B may be 0: one empty source).
        physical_batch_size: chunk size P (None: the whole batch at once).
        points: DiSK evaluation points (default: θ with coefficient 1).
        engine: ``"fast"`` or ``"reference"``.

    Yields:
        per-sample sources; with ``engine="fast"`` each is freed when the
        next is requested (consume them one at a time, as the Privatizer does).

    Raises:
        ValueError: unknown engine or ``physical_batch_size`` ≤ 0.
    """
    if physical_batch_size is not None and physical_batch_size <= 0:
        raise ValueError(f"physical_batch_size must be > 0, got {physical_batch_size}")
    if engine == "fast":
        return get_engine(model, loss_fn).iterate(x, y, physical_batch_size, points)
    if engine == "reference":
        return iter_per_sample_gradients(model, loss_fn, x, y, physical_batch_size, points)
    raise ValueError(f"unknown per-sample engine {engine!r}; choose one of {ENGINES}")
