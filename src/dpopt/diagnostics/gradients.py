"""The clean clipped mean gradient of a model on data — NON-PRIVATE research tool.

:func:`clean_clipped_mean_gradient` computes Ḡ = (1/N) Σ_i clip_C(∇ℓ(θ; x_i))
with dpopt's per-sample engine (:func:`dpopt.engine.iter_per_sample_sources`)
and the same flat clipping the :class:`~dpopt.privatizer.Privatizer` applies
(w_i = min(1, C/‖g_i‖)), but WITHOUT noise and WITHOUT a ledger: it reads
private data in the clear, is not differentially private, is not charged to
any budget, and must never feed training. It exists to measure what the
spectral diagnostics need (the signal the DP noise competes with) on data the
user is allowed to inspect.

The divisor is the realised number of examples N (this is the clean mean
that a DP-SGD release with expected batch size B̄ estimates unbiasedly).
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor, nn

from ..engine import iter_per_sample_sources
from ..privatizer import clip_factors
from ..types import ClipGeometry

__all__ = ["NON_PRIVATE_NOTICE", "clean_clipped_mean_gradient", "matrix_parameters"]

NON_PRIVATE_NOTICE = (
    "NON-PRIVATE research diagnostics: the clean clipped mean gradient is computed from the "
    "data WITHOUT noise and WITHOUT the privacy ledger; nothing here is differentially "
    "private, charged to a budget, or fed back into training."
)


def clean_clipped_mean_gradient(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    max_grad_norm: float,
    physical_batch_size: Optional[int] = 256,
    engine: str = "fast",
) -> list[Tensor]:
    """(1/N) Σ_i min(1, C/‖g_i‖) g_i over the N examples of (x, y), one tensor per trainable parameter.

    NOT PRIVATE (see module docstring): no noise, no ledger; research use only.

    Args:
        model, loss_fn: as for :func:`dpopt.engine.iter_per_sample_sources`
            (``loss_fn(logits[1, ...], target[1]) -> scalar``).
        x, y: the examples (N ≥ 1).
        max_grad_norm: flat clip bound C (``math.inf``: no clipping).
        physical_batch_size: examples per chunk (memory bound).
        engine: ``"fast"`` or ``"reference"``.

    Returns:
        param-shaped tensors in ``model.parameters()`` order (trainable ones).
    """
    n = int(y.shape[0])
    if n < 1:
        raise ValueError("need at least one example")
    if not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    geometry = ClipGeometry()
    total: Optional[list[Tensor]] = None
    for source in iter_per_sample_sources(model, loss_fn, x, y, physical_batch_size, engine=engine):
        groups = [0] * source.num_params
        sq = source.sq_norms(geometry, groups, 1)
        weights = clip_factors(sq, [float(max_grad_norm)])  # the Privatizer's rule
        part = source.weighted_sum(weights, geometry, groups)
        total = [p.detach().clone() for p in part] if total is None else [a + b.detach() for a, b in zip(total, part)]
    assert total is not None
    return [t / n for t in total]


def matrix_parameters(model: nn.Module) -> list[tuple[int, str, Tensor]]:
    """``(index, name, param)`` of every trainable ≥ 2-D parameter (the layers the diagnostics cover),
    with ``index`` into the trainable-parameter list."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [(i, n, p) for i, (n, p) in enumerate(params) if p.dim() >= 2]
