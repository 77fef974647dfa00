"""Spectral diagnostics: when does orthogonalizing the noisy gradient (DP-Muon) help? — NON-PRIVATE.

Research tools, not DP mechanisms: :mod:`~dpopt.diagnostics.gradients` reads
private data WITHOUT noise and WITHOUT the ledger (the clean clipped mean
gradient), and nothing in this package is released, charged, or fed back into
training. Use them on data you are allowed to inspect.

* :mod:`~dpopt.diagnostics.spectral` — the math on given matrices: singular
  spectrum, Roy–Vetterli effective rank, stable rank, spectral SNR, the BBP
  threshold ratio ρ = σ₁/(s(mn)^{1/4}), the recovery batch size B* (with
  momentum), the random-matrix cosine prediction and Monte Carlo cosines.
* :mod:`~dpopt.diagnostics.gradients` — the clean clipped mean gradient with
  dpopt's per-sample engine and the Privatizer's flat clipping.
* :mod:`~dpopt.diagnostics.model` — :func:`diagnose_model`: every matrix
  layer at several batch sizes.
* :mod:`~dpopt.diagnostics.report` — Markdown tables and PNG figures
  (``dpopt diagnose`` writes them).

See ``docs/diagnostics.md``.
"""

from .gradients import NON_PRIVATE_NOTICE, clean_clipped_mean_gradient
from .model import ModelDiagnostics, diagnose_model
from .spectral import (
    CosineEstimate,
    MatrixDiagnostics,
    diagnose_matrix,
    effective_rank,
    monte_carlo_cosines,
    noise_edge,
    noise_std,
    predicted_cosines,
    recovery_batch_size,
    singular_values,
    spectral_snr,
    stable_rank,
    threshold_ratio,
)

__all__ = [
    "NON_PRIVATE_NOTICE",
    "clean_clipped_mean_gradient",
    "ModelDiagnostics",
    "diagnose_model",
    "CosineEstimate",
    "MatrixDiagnostics",
    "diagnose_matrix",
    "effective_rank",
    "monte_carlo_cosines",
    "noise_edge",
    "noise_std",
    "predicted_cosines",
    "recovery_batch_size",
    "singular_values",
    "spectral_snr",
    "stable_rank",
    "threshold_ratio",
]
