"""Core types shared by both sides of the privacy boundary.

This module is a leaf (it imports only ``torch`` and the standard library), so
that the :class:`~dpopt.privatizer.Privatizer`, the per-sample engines
(:mod:`dpopt.engine`) and the auditor can use these types without loading any
post-processing code (:mod:`dpopt.transforms` re-exports them for its users).

* :class:`ClipGeometry` — the coordinate-wise ``(shift, scale)`` in which
  per-sample gradients are clipped (identity for flat clipping);
* :class:`EvaluationPoint` — where per-sample gradients are evaluated, and
  with which weight (DiSK);
* :class:`PerSampleSource` — the interface the Privatizer and the
  :class:`~dpopt.optim.DPOptimizer` use from any per-sample source
  (:class:`~dpopt.engine.reference.PerSampleGrads`,
  :class:`~dpopt.engine.fast.FastPerSampleGrads`, a hand-made one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, runtime_checkable

from torch import Tensor

__all__ = ["ClipGeometry", "EvaluationPoint", "PerSampleSource"]


@dataclass(frozen=True)
class ClipGeometry:
    """Coordinate-wise ``(shift, scale)`` for clipping: w = (g − shift) / scale.

    ``None`` for either means identity (0 shift, unit scale); ``ClipGeometry()``
    is flat L2 clipping. Each list holds one tensor per parameter, shaped like
    the parameter. Source: Pichapati et al. 2019 (AdaClip), eq. (6) of
    DP-MacAdam (arXiv:2606.05435).
    """

    shift: Optional[tuple[Tensor, ...]] = None
    scale: Optional[tuple[Tensor, ...]] = None

    @property
    def is_identity(self) -> bool:
        return self.shift is None and self.scale is None


@dataclass(frozen=True)
class EvaluationPoint:
    """Where per-sample gradients are evaluated, and with which weight.

    The per-example vector fed to the Privatizer is Σ_k coef_k ∇ℓ(θ + offset_k; x_i).
    ``offset`` is one tensor per parameter or ``None`` (θ itself).
    """

    coef: float
    offset: Optional[tuple[Tensor, ...]] = None


@runtime_checkable
class PerSampleSource(Protocol):
    """What the Privatizer reads from one micro-batch of per-sample gradients (private data).

    A source stands for B per-example gradient vectors g_1 … g_B over P
    parameters (g_i(p) shaped like parameter p), in whatever form is cheapest
    (materialised, factored, sparse rows). In the clip geometry (shift m,
    scale b, per parameter) the clipped quantity is w_i = (g_i − m) / b, in the
    gradient's units divided by the scale's. Parameters are partitioned into
    G clipping groups by ``groups`` (length P, values in ``range(G)``; all 0
    for flat clipping).

    Attributes:
        num_params: P, the number of parameters covered.
        batch_size: B (private: never leaves the Privatizer). B = 0 is allowed
            (an empty Poisson batch).
        nonfinite: number of examples whose gradient had a non-finite entry
            (private diagnostic); such examples are treated as g_i = 0.
        params: the covered parameters (the ``nn.Parameter`` objects), in this
            source's order, or None (then matched to an optimizer by position).
        points: the :class:`EvaluationPoint` objects the gradients were
            evaluated at, or None (unknown).

    Methods (called by the Privatizer with the same ``geometry`` and
    ``groups``, ``sq_norms`` first):

    * ``sq_norms(geometry, groups, num_groups) -> Tensor [B, G]``: ‖w_i‖²
      restricted to each group's parameters (float, the parameters' dtype or
      float64; units: squared w-units), never below the exact squared norm
      of the w_i that ``weighted_sum`` sums (rounded up, not to nearest: the
      clip factor is rounded down from it, :func:`dpopt.privatizer.clip_factors`,
      so the clipped norm is ≤ C in real arithmetic). The one exception: float64
      norms (a float64 engine's) are the float64 evaluation itself, not rounded up
      (relative error ≤ n·2⁻⁵³ for n terms, ``round_up_sq_norms`` leaves float64 as
      computed; docs/architecture.md, "Clip factors under rounding");
    * ``weighted_sum(weights [B, G], geometry, groups) -> list[Tensor]``:
      Σ_i weights[i, group(p)] · w_i(p) for every parameter p, one
      param-shaped tensor per parameter, in this source's order (w-units).
      The weights come in ``sq_norms``' dtype; a source that casts them to
      a narrower dtype must round down (a cast to nearest may round up).
      Each must be a FRESH tensor that nothing else holds: on the CPU
      (without quantile clipping) the release adds the float64 noise into a
      contiguous float32/float64 sum of the parameter's dtype and rounds the noisy sum back into that sum's own storage
      (:func:`~dpopt.privatizer.add_and_round`; a model over 2²² parameters
      streams its noise into the sums chunk by chunk), divides it by B̄ in
      place, and hands that same tensor out as the released gradient. A
      buffer the source keeps (returned again, or refilled by its next call)
      would be overwritten by the release and would then overwrite the
      release with the next clipped sum, without noise. The Privatizer
      refuses (``ValueError``, before anything of the step is released) sums
      whose memory overlaps another returned sum, a still-live sum of this or
      the previous step (or its ``_base``), or one of ``params`` or its
      ``.grad``: a comparison of byte ranges, exact for contiguous tensors,
      element by element for strided ones. The check runs AFTER
      ``weighted_sum`` returned, so a refilled buffer is caught at the call
      that refilled it, when the previous step's release held in it (its
      :class:`~dpopt.privatizer.Release` grads, and ``p.grad`` where it was
      written there) has ALREADY been overwritten by a clipped sum without
      noise: the refusal stops this step only; discard those gradients (do
      not apply, publish or save them). Return ``t.clone()`` of anything kept.

    Not every source in the wild has ``batch_size``/``params``/``points``: the
    Privatizer needs only ``num_params``, ``sq_norms``, ``weighted_sum`` and
    (optionally) ``nonfinite``; :class:`~dpopt.optim.DPOptimizer` reads
    ``params`` and ``points`` with ``getattr(..., None)``.
    """

    num_params: int
    batch_size: int
    nonfinite: int
    params: Optional[tuple[Tensor, ...]]
    points: Optional[tuple[EvaluationPoint, ...]]

    def sq_norms(self, geometry: ClipGeometry, groups: Sequence[int], num_groups: int) -> Tensor:
        """Per-example, per-group squared norms ‖w_i‖² in ``geometry``: shape ``[B, num_groups]``."""
        ...

    def weighted_sum(self, weights: Tensor, geometry: ClipGeometry, groups: Sequence[int]) -> list[Tensor]:
        """Σ_i weights[i, group(p)] · w_i(p) per parameter (``weights``: ``[B, G]``; param-shaped outputs).

        The outputs are fresh tensors the caller owns: the Privatizer adds the noise to them in place and
        releases them (see the class docstring; sums that share memory with each other, with the source's
        earlier live sums or with its parameters are refused with ``ValueError``).
        """
        ...
