"""Per-row squared norms in float64 without a float64 copy of the whole input (one concept: the engine's
float64 accumulation of per-example squared norms; used by :mod:`~dpopt.engine.layers` and
:mod:`~dpopt.engine.chol_norm`)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ROW_NORM_COLUMNS", "row_sq_norms64"]

ROW_NORM_COLUMNS = 1 << 15
"""Columns per float64 slice in :func:`row_sq_norms64` (a slice of 8 rows is 2 MiB in float64: it stays in
cache, where a float64 copy of a whole ``[b, q·p]`` chunk went through memory — 1.5× the time, measured in
docs/performance.md, "Transformer steps: profile and floor")."""


def row_sq_norms64(flat: Tensor, columns: int = ROW_NORM_COLUMNS) -> Tensor:
    """Per-row ‖x_r‖² of ``flat [b, n]``, squares and sums in float64 → ``[b]`` float64.

    The same values as ``vector_norm(flat, dim=1, dtype=float64).square()`` (each
    float32 element is exact in float64, its square rounds once in float64, the
    accumulation is float64; only the order of the additions differs), without a
    float64 copy of all of ``flat``: ``columns`` columns at a time.
    """
    if flat.dtype == torch.float64 or flat.shape[1] <= columns:
        return torch.linalg.vecdot(flat, flat, dim=1) if flat.dtype == torch.float64 else _sq64(flat)
    total = _sq64(flat[:, :columns])
    for s in range(columns, flat.shape[1], columns):
        total += _sq64(flat[:, s : s + columns])
    return total


def _sq64(x: Tensor) -> Tensor:
    v = x.double()
    return torch.linalg.vecdot(v, v, dim=1)
