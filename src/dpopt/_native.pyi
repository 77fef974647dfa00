"""Type stubs of dpopt's C extension (src/dpopt/_native.c); documented in :mod:`dpopt.kernels`."""

from typing import Any

def ziggurat_fill(out: Any, state: Any, discard: int, k: Any, w: Any, f: Any, tail_idx: Any) -> int: ...
def ziggurat_fill_chunks(
    out: Any,
    states: Any,
    next: Any,
    chunk: int,
    discard: int,
    k: Any,
    w: Any,
    f: Any,
    tail_idx: Any,
    cap: int,
    tail_count: Any,
) -> int: ...
def release(out: Any, s: Any, z: Any, scale: float, divisor: float, divide: bool) -> None: ...
def row_sq_norms64(x: Any, out: Any, columns: int, lo: int, hi: int) -> None: ...
