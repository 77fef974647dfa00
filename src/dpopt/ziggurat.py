"""The body of the CPU Gaussian sampler: a compiled float64 ziggurat on an SFC64 stream.

Marsaglia & Tsang (2000), "The Ziggurat Method for Generating Random Variables", J. Stat. Softw.
5(8), with 256 strips of equal area v under f(x) = exp(−x²/2) on x ≥ 0: strip 0 is the base
(the rectangle [0, r] × [0, f(r)] plus the tail x > r), strip i ≥ 1 lies between the heights f(x_i)
and f(x_{i−1}) with x_i the strip's right edge (x_1 = r > x_2 > … > x_255, x_0 := v/f(r) the base
strip's width as a rectangle of area v, and the "edge" above the top strip is 0). With the
paper's indexing (strip 1 at the top, strip 255 just above the base) the tables are

    w[i] = x_i / 2^52,  k[i] = ⌊2^52 · x_{i+1}/x_i⌋ (k[1] = 0),  f[i] = f(x_i) (f[0] = 1),

each strip's x-edge taken from the recursion x_{i−1} = f⁻¹(v/x_i + f(x_i)) of the paper's §2. One
64-bit word per candidate: 8 bits pick the strip i, 1 bit the sign, 52 bits an integer j < 2^52;
x = j·w[i]. If j < k[i], x lies inside the strip's inner rectangle: accepted (≈ 98.8 %). Else, for
i ≥ 1, x is in the strip's wedge: accepted iff f[i] + u·(f[i−1] − f[i]) < f(x) with a fresh 53-bit
uniform u (otherwise a new candidate); for i = 0 the candidate is the base strip's TAIL branch
(x ≥ r, probability P(|Z| ≥ r) = 2.6e-4 of the values). The tail is not sampled here: its index
is recorded and the caller fills it from the exact tail law (:func:`dpopt.noise.ziggurat_normals`),
so the position holds ±inf (its sign) until then.

The edges are computed once in 50-digit arithmetic (``mpmath``, a dependency of torch's sympy)
with r the root of the closure condition (the top strip's area x_255·(1 − f(x_255)) equals v,
v = r·f(r) + ∫_r^∞ f), so the 256 strips tile the area under f exactly, then rounded once to
float64 (w, f) or truncated (k). A truncated k[i] only sends a candidate within one 2^-52 grid
step below x_{i+1} to the wedge test, which accepts it (f(x) > f[i−1] there): no bias. The same
holds for the base strip, except that its one grid step below r is sent to the tail (probability
≤ 2^-60 per value: far below every δ).

SFC64 (Doty-Humphrey's Small Fast Chaotic PRNG, the algorithm of numpy's ``np.random.SFC64``):
state (a, b, c, counter); each step returns a + b + counter and is the reference code's
``tmp = a + b + w++; a = b ^ (b >> 11); b = c + (c << 3); c = rotl(c, 24) + tmp``. A stream is
seeded by (a, b, c) = the 24 given bytes (little-endian), counter = 1, and 12 outputs dropped
(numpy's own seeding does the same after its SeedSequence), so a numpy ``SFC64`` set to the
returned state continues the SAME stream (the tail draws use it). numpy's own ``standard_normal``
is the same method with tables computed differently in their last bits: its values and these differ
by a few ulps, which is why :func:`dpopt.noise.ziggurat_normals` uses this kernel (one set of tables,
values independent of the numpy version) rather than numpy's.

The kernel is C, compiled with the package (:mod:`dpopt.kernels`; the GIL is released, so chunks run in
parallel in the noise source's threads); on this 2-vCPU Xeon it costs ≈ 1.8 ns of CPU per normal against
numpy's ≈ 8 ns (``benchmarks/noise_cost.py``; ≈ 1.4–1.5 ns since 2026-12-07 evening). The sign costs no
branch on a random bit: the strip's factor w is looked up by the word's 9 low bits (strip and sign bit) in a
table whose entries carry the sign, so ``x = j · (±w)`` — bit for bit the product ``j · w`` with bit 8 ORed into
its sign bit, as before (``tests/core/test_ziggurat_fast_path.py``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from .kernels import native

__all__ = [
    "STRIPS",
    "ZIGGURAT_R",
    "SFC_DISCARD",
    "SFC_STATE_BYTES",
    "ziggurat_tables",
    "ziggurat_body",
    "sfc64_seed_state",
]

STRIPS = 256
ZIGGURAT_R = 3.6541528853610088  # r rounded to float64 (the 50-digit root: ziggurat_tables); |x| ≥ r ⇔ tail
SFC_DISCARD = 12  # outputs dropped after setting an SFC64 state, as numpy's seeding does
SFC_STATE_BYTES = 24  # the seed of a stream: SFC64's a, b, c (its counter starts at 1: period ≥ 2^64)


def ziggurat_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(k uint64 [256], w float64 [256], f float64 [256], r) of the module docstring (read-only arrays).

    r is solved to 50 digits from the closure condition (Marsaglia & Tsang 2000, §2: the top
    strip's area equals v); the tables are built from it in 50-digit arithmetic.

    Raises:
        RuntimeError: the recursion does not close to 1e-40 (a broken mpmath).
    """
    return _cached_tables()


def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    import mpmath

    ctx = mpmath.mp.clone()
    ctx.dps = 50
    half = ctx.mpf(1) / 2

    def f(x: Any) -> Any:
        return ctx.exp(-half * x * x)

    def area(r: Any) -> Any:
        return r * f(r) + ctx.sqrt(ctx.pi / 2) * ctx.erfc(r / ctx.sqrt(2))

    def edges(r: Any) -> tuple[list[Any], Any]:
        v = area(r)
        x = [v / f(r), r]  # x_0 (the base as a rectangle of area v), x_1 = r
        for _ in range(STRIPS - 2):
            x.append(ctx.sqrt(-2 * ctx.log(v / x[-1] + f(x[-1]))))
        return x, v - x[-1] * (1 - f(x[-1]))

    r = ctx.findroot(lambda r: edges(r)[1], ctx.mpf(ZIGGURAT_R))
    x, residual = edges(r)
    if abs(residual) > ctx.mpf(10) ** -40:
        raise RuntimeError(f"the ziggurat's strips do not close: residual {residual}")
    scale = ctx.mpf(2) ** 52
    k = np.zeros(STRIPS, dtype=np.uint64)
    w = np.zeros(STRIPS, dtype=np.float64)
    fi = np.zeros(STRIPS, dtype=np.float64)
    # Marsaglia & Tsang's indexing: table slot 0 = base strip (edge x_0), slot 1 = top strip (edge
    # x_255), slot j ≥ 1 = the strip whose edge is x_{256−j}; the next-narrower edge of slot j is
    # that of slot j − 1 (0 for slot 1).
    edge = [x[0]] + [x[STRIPS - j] for j in range(1, STRIPS)]
    for j in range(STRIPS):
        narrower = x[1] if j == 0 else (edge[j - 1] if j > 1 else ctx.mpf(0))
        k[j] = np.uint64(int(ctx.floor(narrower / edge[j] * scale)))
        w[j] = float(edge[j] / scale)
        fi[j] = 1.0 if j == 0 else float(f(edge[j]))
    for table in (k, w, fi):
        table.setflags(write=False)  # shared by every caller and thread
    return k, w, fi, float(r)


_cached_tables = lru_cache(maxsize=1)(_tables)  # a pure function: concurrent first callers may both compute it


def sfc64_seed_state(state: bytes) -> np.ndarray:
    """The SFC64 state [a, b, c, counter] (uint64 [4]) for (a, b, c) = ``state`` (24 bytes,
    little-endian) and counter 1, before the :data:`SFC_DISCARD` dropped outputs.

    Raises:
        ValueError: ``state`` is not 24 bytes.
    """
    if len(state) != SFC_STATE_BYTES:
        raise ValueError(f"an SFC64 state is {SFC_STATE_BYTES} bytes, got {len(state)}")
    words = np.frombuffer(state, dtype="<u8").astype(np.uint64)
    return np.array([words[0], words[1], words[2], 1], dtype=np.uint64)


def ziggurat_body(out: np.ndarray, state: np.ndarray, discard: int = SFC_DISCARD) -> np.ndarray:
    """Fill float64 ``out`` (1-D, contiguous) with standard normals from the SFC64 stream ``state``,
    except the tail branch's positions, which get ±inf (the value's sign) and are returned.

    Args:
        out: float64 ``[n]``, overwritten.
        state: uint64 ``[4]`` SFC64 state (:func:`sfc64_seed_state`), advanced IN PLACE to the
            stream's state after this call (a numpy ``SFC64`` set to it continues the stream).
        discard: outputs dropped before the first candidate (≥ 0).

    Returns:
        int64 ``[m]`` the positions of the tail branch (increasing), m ≈ 2.6e-4·n.

    Raises:
        ValueError: ``out`` not 1-D contiguous float64, ``state`` not uint64 [4], discard < 0.
    """
    if out.dtype != np.float64 or out.ndim != 1 or not out.flags.c_contiguous:
        raise ValueError("out must be a 1-D contiguous float64 array")
    if state.dtype != np.uint64 or state.shape != (4,) or not state.flags.writeable:
        raise ValueError("state must be a writable uint64 array of 4 words (a, b, c, counter)")
    if discard < 0:
        raise ValueError(f"discard must be >= 0, got {discard}")
    k, w, fi, _ = ziggurat_tables()
    tail_idx = np.empty(out.shape[0], dtype=np.int64)  # untouched beyond the ~2.6e-4·n written entries
    tails = int(native.ziggurat_fill(out, state, discard, k, w, fi, tail_idx))
    return tail_idx[:tails].copy()
