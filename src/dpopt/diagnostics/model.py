"""Per-layer spectral diagnostics of a model at several batch sizes — NON-PRIVATE research tool.

:func:`diagnose_model` = :func:`~dpopt.diagnostics.gradients.clean_clipped_mean_gradient` on
the examples given (no noise, no ledger) → for each ≥ 2-D parameter (conv kernels as
out × in·kh·kw) and each expected batch size B̄ with its noise multiplier σ(B̄):
:func:`~dpopt.diagnostics.spectral.diagnose_matrix`. Nothing is released or fed back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from .gradients import NON_PRIVATE_NOTICE, clean_clipped_mean_gradient, matrix_parameters
from .spectral import as_matrix, diagnose_matrix, singular_values

__all__ = ["LayerReport", "ModelDiagnostics", "diagnose_model"]


@dataclass
class LayerReport:
    """One layer: its clean gradient's spectrum and its diagnostics per batch size."""

    name: str
    shape: tuple[int, int]
    singular_values: Tensor  # clean, descending (float64)
    rows: dict = field(default_factory=dict)  # batch size -> MatrixDiagnostics
    clean: Optional[Tensor] = None  # the clean gradient matrix (kept for figures)


@dataclass
class ModelDiagnostics:
    """All layers at all batch sizes, plus the public setting they were computed for."""

    layers: list[LayerReport]
    batch_sizes: list[float]
    noise_multipliers: dict  # batch size -> σ
    max_grad_norm: float
    momentum: float
    examples: int
    trials: int
    notice: str = NON_PRIVATE_NOTICE

    def to_dict(self) -> dict:
        return {
            "notice": self.notice,
            "batch_sizes": self.batch_sizes,
            "noise_multipliers": {str(k): v for k, v in self.noise_multipliers.items()},
            "max_grad_norm": self.max_grad_norm,
            "momentum": self.momentum,
            "examples": self.examples,
            "trials": self.trials,
            "layers": [
                {
                    "name": lay.name,
                    "shape": list(lay.shape),
                    "top_singular_values": [float(s) for s in lay.singular_values[:20]],
                    "by_batch_size": {str(b): r.to_dict() for b, r in lay.rows.items()},
                }
                for lay in self.layers
            ],
        }


def diagnose_model(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    *,
    batch_sizes: Sequence[float],
    noise_multipliers: dict,
    max_grad_norm: float,
    momentum: float = 0.0,
    trials: int = 20,
    seed: int = 0,
    physical_batch_size: Optional[int] = 256,
    progress: Optional[Callable[[str], None]] = None,
) -> ModelDiagnostics:
    """Diagnose every matrix parameter of ``model`` for each B̄ in ``batch_sizes``.

    NOT PRIVATE: reads (x, y) without noise and without a ledger (research use only).

    Args:
        model, loss_fn: the model and a per-example loss (as for the per-sample engine).
        x, y: the examples for the clean clipped mean gradient (N = len(y)).
        batch_sizes: expected batch sizes B̄.
        noise_multipliers: ``{B̄: σ}`` for each batch size.
        max_grad_norm: C.
        momentum: β for B* with momentum (0: none).
        trials: Monte Carlo draws per layer and batch size (0: none).
        seed: seed of the simulated noise (research simulation; not DP noise).
        physical_batch_size: chunk size of the per-sample engine.
        progress: called with a short status line per layer.
    """
    grads = clean_clipped_mean_gradient(model, loss_fn, x, y, max_grad_norm, physical_batch_size)
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for index, name, _ in matrix_parameters(model):
        g = as_matrix(grads[index]).detach().double()
        sv = singular_values(g)
        lay = LayerReport(name, (int(g.shape[0]), int(g.shape[1])), sv, clean=g)
        for b in batch_sizes:
            lay.rows[b] = diagnose_matrix(
                g,
                noise_multiplier=noise_multipliers[b],
                max_grad_norm=max_grad_norm,
                batch_size=b,
                momentum=momentum,
                trials=trials,
                generator=gen,
                clean_singular_values=sv,
            )
        layers.append(lay)
        if progress:
            progress(f"{name} {lay.shape}: σ₁ = {float(sv[0]):.3g}")
    return ModelDiagnostics(
        layers,
        [float(b) for b in batch_sizes],
        dict(noise_multipliers),
        float(max_grad_norm),
        float(momentum),
        int(y.shape[0]),
        int(trials),
    )
