"""Per-row squared norms in float64 without a float64 copy of the whole input (one concept: the engine's
float64 accumulation of per-example squared norms; used by :mod:`~dpopt.engine.layers` and
:mod:`~dpopt.engine.chol_norm`)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

__all__ = ["ROW_NORM_COLUMNS", "row_sq_norms64", "rows_sq64", "round_up_sq_norms"]

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


def rows_sq64(x: Tensor) -> Tensor:
    """Per-row ‖x_r‖² of ``x [b, n]`` → ``[b]`` float64: every square exact in float64 and summed in float64.

    On the CPU, for float32 ``x``, ONE compiled pass (numba, ``nogil``; :func:`_rows_kernel`): the row's
    elements widened to float64, squared exactly and added in float64 in an order the compiler picks
    (reassociation allowed, so it vectorises; no fused multiply-add; one row in one thread, so the values do
    not depend on the thread count). Elsewhere (float64, bf16/fp16, other devices):
    :func:`row_sq_norms64` of ``x`` (half precision widened to float32 first, exactly). Either way each
    value is the exact ‖x_r‖² up to float64 rounding: relative error ≤ γ_{n+1} = (n+1)·2⁻⁵³/(1 − (n+1)·2⁻⁵³)
    (Higham 2002, §3.1: n exact squares, n − 1 additions in any order), which
    :func:`round_up_sq_norms` covers. The shared per-example ‖e_i‖² and ‖a_i‖² of a T = 1 linear layer
    (:class:`~dpopt.engine.layers.LinearPart`), computed once for its weight and its bias.

    Raises:
        ValueError: ``x`` is not 2-D or not floating.
    """
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"rows_sq64 needs a 2-D floating tensor, got {tuple(x.shape)} {x.dtype}")
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()  # exact
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.shape[0] == 0 or x.shape[1] == 0:
        return row_sq_norms64(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float64)
    _rows_kernel()(x.detach().numpy(), out.numpy())
    return out


def _rows_kernel() -> Callable[..., None]:
    """The compiled :func:`rows_sq64` pass ``(x float32 [b, n] with unit column stride, out float64 [b])``,
    compiled (or loaded from numba's cache) once by the first caller (:func:`dpopt.ziggurat.compile_once`)."""
    from ..ziggurat import compile_once

    return compile_once(_cached_rows_kernel)


@lru_cache(maxsize=1)
def _cached_rows_kernel() -> Callable[..., None]:
    from ..ziggurat import njit_kernel

    def body(x: Any, out: Any) -> None:
        for i in range(x.shape[0]):
            total = 0.0
            for j in range(x.shape[1]):
                v = np.float64(x[i, j])
                total += v * v  # exact square (a float32's 24 bits squared fit float64's 53); the sum rounds
            out[i] = total

    # reassociation only: the compiler may add the squares in any order (it sums in vector lanes, ≈ 5× the
    # scalar loop here) — the bound γ_{n+1} holds for every order; no contraction (no FMA), no nnan/ninf
    # assumption (nan and inf propagate as in IEEE arithmetic).
    return njit_kernel(body, error_model="numpy", fastmath={"reassoc"})


def round_up_sq_norms(x: Tensor, terms: int, dtype: torch.dtype) -> Tensor:
    """A float64 squared norm computed with at most ``terms`` float64 roundings per value (relative error
    ≤ γ_terms, :func:`rows_sq64`), returned in ``dtype`` never below the exact value.

    ``x`` is first multiplied by 1 + 2·γ_{terms+1} in float64 (≥ the exact value after that multiplication's
    own rounding), then rounded toward +∞ into ``dtype`` (:func:`~dpopt.engine.shifted_norm.round_up`).
    float64 ``dtype``: ``x`` as computed (a float64 engine's norms are float64 evaluations, as elsewhere).
    nan and ±inf stay what they are (the source's non-finite check reads them).

    Raises:
        ValueError: ``terms`` < 1 or so large that γ has no bound (≥ 2⁵¹).
    """
    from .shifted_norm import round_up

    if dtype == torch.float64:
        return x
    if not 1 <= terms < 2**51:
        raise ValueError(f"terms must be in [1, 2**51), got {terms}")
    nu = (terms + 1) * 2.0**-53
    return round_up(x * (1.0 + 2.0 * nu / (1.0 - nu)), dtype)
