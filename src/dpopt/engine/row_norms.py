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
    float64 copy of all of ``flat``: ``columns`` columns at a time, and (float32 input)
    blocks of rows whose float64 slice holds at most ``columns`` elements (:func:`_row_blocks`;
    at least two rows each), so that the copy and its products stay in cache. Each row's
    value does not depend on the blocks (the same column slices, added in the same order, by
    the same per-row reduction): blocking is bit-identical to one call over all rows, and
    3–5× faster on CNN5's ``[33, 18432]`` chunks (docs/performance.md, "CNN5: profile and floor").
    """
    if flat.dtype == torch.float64:
        return torch.linalg.vecdot(flat, flat, dim=1)
    blocks = _row_blocks(flat.shape[0], min(flat.shape[1], columns), columns)
    if len(blocks) == 1:
        return _sliced(flat, columns)
    out = torch.empty(flat.shape[0], dtype=torch.float64, device=flat.device)
    for s, t in blocks:
        out[s:t] = _sliced(flat[s:t], columns)
    return out


def _row_blocks(rows: int, width: int, columns: int) -> list[tuple[int, int]]:
    """``[s, t)`` blocks of ``rows`` rows with ``(t − s)·width ≤ columns`` where possible, each of at least two
    rows (a one-row reduction of ≥ 32,768 elements is split across threads by torch, which would make its bits
    depend on the thread count); one block when ``rows`` ≤ 3 or the rows are too wide to block."""
    step = max(2, columns // max(1, width))
    if rows <= max(3, step):
        return [(0, rows)]
    starts = list(range(0, rows, step))
    if rows - starts[-1] < 2:  # a last block of one row joins the one before it
        starts.pop()
    return [(s, starts[k + 1] if k + 1 < len(starts) else rows) for k, s in enumerate(starts)]


def _sliced(flat: Tensor, columns: int) -> Tensor:
    """Per-row float64 ‖x_r‖² of float32 ``flat [b, n]``: ``columns`` columns at a time, added left to right."""
    if flat.shape[1] <= columns:
        return _sq64(flat)
    total = _sq64(flat[:, :columns])
    for s in range(columns, flat.shape[1], columns):
        total += _sq64(flat[:, s : s + columns])
    return total


def _sq64(x: Tensor) -> Tensor:
    v = x.double()
    return torch.linalg.vecdot(v, v, dim=1)
