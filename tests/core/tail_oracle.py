"""The numpy statement of the ziggurat's exact tail law: the oracle of the compiled ``fill_tails``.

dpopt fills the ziggurat's tail-branch positions with the C kernel ``fill_tails`` (:mod:`dpopt.kernels`;
``ziggurat_fill_chunks`` does the same for each chunk of an early draw). This module states the same law,
rounds and word order in numpy, independently of that C code (it was dpopt's own implementation until
2026-12-07): Marsaglia (1964), z = √(r² − 2 ln u₁) accepted with probability r/z, u₁ with the full float64
exponent range. numpy's vectorised ``log`` may differ from the C library's in the last bit, so the tests compare
the two within one ulp per value (tests/core/test_tail_kernel.py).
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np

from dpopt.noise import _LN2, _ONE, _TAIL_K_MAX, _TAIL_WORDS
from dpopt.ziggurat import SFC_DISCARD, ZIGGURAT_R, sfc64_seed_state


def sfc64(state: Union[bytes, np.ndarray], bitgen: Optional[np.random.SFC64] = None) -> np.random.Generator:
    """A numpy Generator on SFC64 (Doty-Humphrey's Small Fast Chaotic PRNG) at a stream's state.

    Args:
        state: 24 bytes (a, b, c little-endian; counter 1, the first :data:`~dpopt.ziggurat.SFC_DISCARD`
            outputs dropped: :func:`~dpopt.ziggurat.sfc64_seed_state`), or uint64 ``[4]`` the exact
            state (a, b, c, counter) to continue from, nothing dropped.
        bitgen: an SFC64 object to re-use (its state overwritten); constructing one costs a SeedSequence hash.

    Raises:
        ValueError: ``state`` is not 24 bytes.
    """
    words = sfc64_seed_state(state) if isinstance(state, bytes) else state
    if bitgen is None:
        bitgen = np.random.SFC64(0)  # a fixed seed only to construct it: the state is replaced next
    bitgen.state = {"bit_generator": "SFC64", "state": {"state": words.copy()}, "has_uint32": 0, "uinteger": 0}
    if isinstance(state, bytes):
        bitgen.random_raw(SFC_DISCARD)
    return np.random.Generator(bitgen)


def leading_zeros(stream: np.ndarray) -> np.ndarray:
    """Leading zero bits of each row's stream of 64-bit words (uint64 ``[r, w]``, first word's top
    bit first); ``64·w`` for an all-zero row (int64 ``[r]``)."""
    nonzero = stream != 0
    first = nonzero.argmax(axis=1)
    word = stream[np.arange(stream.shape[0]), first]
    hi, lo = (word >> np.uint64(32)).astype(np.float64), (word & np.uint64(0xFFFFFFFF)).astype(np.float64)
    bits = np.where(hi > 0, 32 + np.frexp(hi)[1], np.frexp(lo)[1])  # bit length (exact: < 2^32 halves)
    return np.where(nonzero.any(axis=1), 64 * first + 64 - bits, 64 * stream.shape[1]).astype(np.int64)


def log_full_uniform(gen: np.random.Generator, m: int) -> np.ndarray:
    """ln u for ``m`` uniforms u on (0, 1) with a 52-bit mantissa at EVERY scale (float64 ``[m]``).

    u = μ·2^-(k+1), μ ∈ [1, 2) on a 2^-52 grid, k = the leading zero bits of a 1024-bit stream
    (Geometric(1/2), capped at _TAIL_K_MAX: probability 2^-1011), so ln u = ln μ − (k+1)·ln 2 is exact
    to rounding without forming a subnormal u; −ln u ≤ 1012·ln 2. Words: one ``[m, 2]`` draw (the
    stream's first word, μ's word); a row whose first word is below 2^11 (probability 2^-53) draws
    the stream's other _TAIL_WORDS − 1 words next, in row order.
    """
    raw = gen.bit_generator.random_raw((m, 2))
    top = raw[:, 0] & np.uint64(~0x7FF & (2**64 - 1))  # ≤ 53 significant bits: exact in float64
    zeros = 64 - np.frexp(top.astype(np.float64))[1].astype(np.int64)  # leading zeros when top > 0
    rare = np.flatnonzero(top == 0)
    if rare.size:
        more = gen.bit_generator.random_raw((rare.size, _TAIL_WORDS - 1))
        zeros[rare] = leading_zeros(np.concatenate([raw[rare, :1], more], axis=1))
    zeros = np.minimum(zeros, _TAIL_K_MAX)
    mantissa = ((raw[:, 1] >> np.uint64(12)) | np.uint64(_ONE)).view(np.float64)
    return np.log(mantissa) - (zeros + 1) * _LN2


def tail_draws(gen: np.random.Generator, m: int) -> np.ndarray:
    """``m`` independent draws of Z | Z ≥ r (r = :data:`ZIGGURAT_R`), float64 ``[m]``.

    Marsaglia (1964): z = √(r² − 2 ln u₁), accepted with probability r/z (u₂·z < r); the accepted z
    has density ∝ e^{−z²/2} on [r, ∞). u₁ has the full exponent range (:func:`log_full_uniform`),
    so every z ≤ _TAIL_RADIUS is possible; u₂ is a 53-bit uniform on [0, 1). Each round proposes
    25 % + 4 more candidates than still needed (acceptance ≈ 0.92: one round, nearly always) and
    keeps the first accepted ones in order.
    """
    out = np.empty(m, dtype=np.float64)
    done = 0
    while done < m:
        want = m - done
        tries = tries_for(want)
        z = np.sqrt(ZIGGURAT_R * ZIGGURAT_R - 2.0 * log_full_uniform(gen, tries))
        u2 = (gen.bit_generator.random_raw(tries) >> np.uint64(11)).astype(np.float64) * 2.0**-53
        keep = z[u2 * z < ZIGGURAT_R][:want]
        out[done : done + keep.size] = keep
        done += keep.size
    return out


def tries_for(want: int) -> int:
    """Candidates one round of :func:`tail_draws` proposes for ``want`` draws (25 % + 4 more)."""
    return want + want // 4 + 4


def within_one_ulp(got: np.ndarray, want: np.ndarray) -> bool:
    """Same shape, and every float64 of ``got`` within one ulp of ``want``'s (both finite and > 0: the tail's
    magnitudes, whose bit patterns are ordered like their values)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape or not (np.all(got > 0) and np.all(want > 0)):
        return False
    return bool(np.all(np.abs(got.view(np.int64) - want.view(np.int64)) <= 1))
