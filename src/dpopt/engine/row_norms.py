"""Per-row squared norms in float64 without a float64 copy of the whole input (one concept: the engine's
float64 accumulation of per-example squared norms; used by :mod:`~dpopt.engine.layers` and
:mod:`~dpopt.engine.chol_norm`).

float32 rows on the CPU go through a compiled kernel (C, GIL released: :mod:`dpopt.kernels`;
:func:`row_sq_norms64`): each row is
reduced by one thread in a fixed order, and the rows are split over torch's intra-op thread count
(``torch.get_num_threads()``) with a small pool of Python threads, so a row's bits do not depend on the thread
count. The torch path (float32 column slices cast to float64 in cache-sized blocks of rows) runs on every other
device and dtype, and where autograd records. Why: on the CPU the torch path's blocks sit just above torch's
parallel grain, so each block's cast and reduction was split over the OpenMP threads with a barrier each (16
blocks per CNN5 chunk); with the second core busy those barriers cost ten times the work (docs/performance.md,
"CNN5: dpopt's own work on both cores").
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from ..kernels import native, numpy_readable

__all__ = [
    "ROW_NORM_COLUMNS",
    "RANGE_MIN_ELEMENTS",
    "row_ranges",
    "row_sq_norms64",
    "row_sq_norms64_cpu",
    "rows_sq64",
    "round_up_sq_norms",
    "rounding_gamma",
]

ROW_NORM_COLUMNS = 1 << 15
"""Columns per float64 slice in :func:`row_sq_norms64` (a slice of 8 rows is 2 MiB in float64: it stays in
cache, where a float64 copy of a whole ``[b, q·p]`` chunk went through memory — 1.5× the time, measured in
docs/performance.md, "Transformer steps: profile and floor")."""


RANGE_MIN_ELEMENTS = 1 << 15
"""Fewest elements per range of rows in :func:`row_sq_norms64_cpu`: b·n elements are split into at most
b·n // this ranges (so below 65,536 elements the calling thread does all of it). A hand-off to the pool costs
tens of µs; 32,768 float32 elements take ≈ 15 µs to reduce here, so a many-core machine does not cut a chunk into
ranges that cost more to hand off than to reduce."""


def row_sq_norms64(flat: Tensor, columns: int = ROW_NORM_COLUMNS) -> Tensor:
    """Per-row ‖x_r‖² of ``flat [b, n]``, squares and sums in float64 → ``[b]`` float64.

    float32 on the CPU (a plain ``torch.Tensor``, autograd not recording ``flat``): :func:`row_sq_norms64_cpu` (the compiled kernel,
    rows split over torch's threads; ``columns`` unused). Otherwise the torch path, which gives the same
    values as ``vector_norm(flat, dim=1, dtype=float64).square()`` (each float32 element is exact in
    float64, its square too, the accumulation is float64; only the order of the additions differs), without a
    float64 copy of all of ``flat``: ``columns`` columns at a time, and (float32 input)
    blocks of rows whose float64 slice holds at most ``columns`` elements (:func:`_row_blocks`;
    at least two rows each), so that the copy and its products stay in cache. Each row's
    value does not depend on the blocks (the same column slices, added in the same order, by
    the same per-row reduction): blocking is bit-identical to one call over all rows, and
    3–5× faster on CNN5's ``[33, 18432]`` chunks (docs/performance.md, "CNN5: profile and floor").
    """
    if flat.dtype == torch.float64:
        return torch.linalg.vecdot(flat, flat, dim=1)
    recorded = flat.requires_grad and torch.is_grad_enabled()
    plain = type(flat) is torch.Tensor  # not a subclass (FakeTensor under torch.compile has no numpy data)
    if flat.dtype == torch.float32 and flat.device.type == "cpu" and flat.dim() == 2 and not recorded and plain:
        return row_sq_norms64_cpu(flat)
    return _torch_row_sq_norms64(flat, columns)


def _torch_row_sq_norms64(flat: Tensor, columns: int) -> Tensor:
    """The torch path of :func:`row_sq_norms64` (any device and float dtype), described there."""
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


# --------------------------------------------------------------------------- the compiled CPU kernel
def _rows(x: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """``out[r] = Σ_j float64(x[r, j])²`` for ``lo ≤ r < hi`` (``x`` float32 ``[b, n]`` C-contiguous, ``out``
    float64 ``[b]``) by the C kernel (``row_sq_norms64`` in ``src/dpopt/_native.c``, GIL released).

    Per row: eight float64 accumulators over the columns j ≡ 0 … 7 (mod 8) of the first n − n mod 8 columns,
    added pairwise ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), then the last n mod 8 squares left to
    right. A float32 value's square is exact in float64 (24 + 24 significant bits ≤ 53), so each square is
    exact and only the additions round (as in ``vector_norm(x, dtype=float64)²``, in another order); the
    order is fixed by n alone (no ``-ffast-math``: the compiler may not reassociate the sums).
    """
    native.row_sq_norms64(x, out, x.shape[1], lo, hi)


_POOL: Optional[ThreadPoolExecutor] = None
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """A pool of at least ``workers`` threads for the row ranges beyond the caller's own (made on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < workers:
            old, _POOL = _POOL, ThreadPoolExecutor(workers, thread_name_prefix="dpopt-row-norms")
            if old is not None:
                old.shutdown(wait=False)
        return _POOL


def _pool_gone_in_child() -> None:
    """A forked child has none of the parent's pool threads: it makes its own pool (and lock) on first use."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pool_gone_in_child)


def row_ranges(rows: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[lo, hi)`` ranges covering ``rows`` rows, sizes differing by at most one
    (``min(parts, rows)`` ranges, at least one)."""
    parts = max(1, min(parts, rows))
    q, r = divmod(rows, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + q + (1 if k < r else 0))
    return list(zip(bounds[:-1], bounds[1:]))


def row_sq_norms64_cpu(flat: Tensor, threads: Optional[int] = None) -> Tensor:
    """Per-row float64 ‖x_r‖² of a float32 CPU ``flat [b, n]`` by the compiled kernel → ``[b]`` float64.

    The rows are split into ``threads`` contiguous ranges (default ``torch.get_num_threads()``; fewer where a range
    would hold under :data:`RANGE_MIN_ELEMENTS` elements, or one row): the calling thread reduces the first, the pool the others,
    each row by the same serial code (:func:`_rows`), so every row's value is bit-identical whatever the
    number of threads or ranges. A non-contiguous ``flat`` is copied first; autograd is not followed.

    Raises:
        ValueError: ``flat`` is not a 2-D float32 CPU tensor.
    """
    if flat.dtype != torch.float32 or flat.device.type != "cpu" or flat.dim() != 2:
        raise ValueError(f"row_sq_norms64_cpu takes a 2-D float32 CPU tensor, got {flat.dtype} {tuple(flat.shape)}")
    if type(flat) is not torch.Tensor:  # a subclass (FakeTensor under torch.compile) has no numpy data: torch's path
        return _torch_row_sq_norms64(flat, ROW_NORM_COLUMNS)
    x = flat.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    rows = x.shape[0]
    out = torch.empty(rows, dtype=torch.float64)
    if rows == 0:
        return out
    kern, xa, oa = _rows, x.numpy(), out.numpy()
    n = torch.get_num_threads() if threads is None else threads
    ranges = row_ranges(rows, min(n, x.numel() // RANGE_MIN_ELEMENTS))
    if len(ranges) == 1:
        kern(xa, oa, 0, rows)
        return out
    pool = _pool(len(ranges) - 1)
    futures: list[Any] = [pool.submit(kern, xa, oa, lo, hi) for lo, hi in ranges[1:]]
    kern(xa, oa, *ranges[0])
    for f in futures:
        f.result()
    return out


def rows_sq64(x: Tensor) -> Tensor:
    """Per-row ‖x_r‖² of ``x [b, n]`` → ``[b]`` float64: every square exact in float64 and summed in float64.

    :func:`row_sq_norms64` of ``x`` (half precision widened to float32 first, exactly): on the CPU, for float32
    ``x``, the compiled kernel (:func:`row_sq_norms64_cpu`: each row's squares exact in float64, added in
    float64 by one thread in a fixed order, so the values do not depend on the thread count). Each
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
    return row_sq_norms64(x)


def round_up_sq_norms(x: Tensor, terms: int, dtype: torch.dtype, times: Optional[Tensor] = None) -> Tensor:
    """A float64 squared norm computed with at most ``terms`` float64 roundings per value (relative error
    ≤ γ_terms, :func:`rows_sq64`), returned in ``dtype`` never below the exact value.

    ``x`` (times ``times`` where given: the float64 product ``x·times``, one rounding to nearest, counted in
    ``terms``) is first multiplied by 1 + 2·γ_{terms+1} in float64 (≥ the exact value after that
    multiplication's own rounding), then rounded toward +∞ into ``dtype``
    (:func:`~dpopt.engine.shifted_norm.round_up`). float64 ``dtype``: ``x`` (``x·times``) as computed (a float64
    engine's norms are float64 evaluations, as elsewhere). nan and ±inf stay what they are (the source's
    non-finite check reads them).

    Why it is an upper bound (Higham 2002, *Accuracy and Stability of Numerical Algorithms*, §3.1, Lemma 3.1):
    a value v computed with k ≤ ``terms`` roundings of relative error ≤ u = 2⁻⁵³ each satisfies
    v ≥ exact·(1 − γ_k); then v·(1 + 2γ_{k+1}) with its own rounding is ≥ exact·(1 − γ_k)(1 + 2γ_{k+1})(1 − u)
    ≥ exact (γ_{k+1} ≥ γ_k + u), and rounding toward +∞ only raises it.

    On the CPU, for float32 ``dtype`` and float64 ``x`` (and ``times``), this is one C pass
    (``sq_round_up`` in ``src/dpopt/_native.c``: the same float64 product, the same multiplication by the
    same factor, the same rounding toward +∞, element by element, so the same bits as the torch expression,
    without its eight small ops; issue 34, docs/performance.md "MLP: the norms' small ops in C").

    Args:
        x: float64 values ≥ 0 (or nan/±inf), any shape; times: None or float64 of ``x``'s shape.
        terms: the roundings each value of ``x`` (``x·times``) went through; dtype: the result's dtype.

    Raises:
        ValueError: ``terms`` < 1 or so large that γ has no bound (≥ 2⁵¹).
    """
    from .shifted_norm import round_up

    if dtype == torch.float64:
        return x if times is None else x * times
    if not 1 <= terms < 2**51:
        raise ValueError(f"terms must be in [1, 2**51), got {terms}")
    factor = 1.0 + 2.0 * rounding_gamma(terms + 1)
    if (
        dtype == torch.float32
        and _plain_cpu64(x)
        and (times is None or (_plain_cpu64(times) and times.shape == x.shape))
    ):
        out = torch.empty(x.shape, dtype=torch.float32)
        native.sq_round_up(out.numpy(), x.numpy(), None if times is None else times.numpy(), factor)
        return out
    return round_up((x if times is None else x * times) * factor, dtype)


def _plain_cpu64(x: Tensor) -> bool:
    """``x`` can be read by the C kernels as a float64 numpy array (:func:`dpopt.kernels.numpy_readable`)."""
    return numpy_readable(x, torch.float64)


def rounding_gamma(n: int) -> float:
    """γ_n = n·u/(1 − n·u), u = 2⁻⁵³: the relative error bound of n float64 roundings (Higham 2002, §3.1)."""
    nu = n * 2.0**-53
    return nu / (1.0 - nu)
