"""The compiled ziggurat's fast path with the signed-w table (``zig_tables`` in ``_native.c``, 2026-12-07).

The loop looks up ``k[strip]`` and ``w[strip]`` with the sign bit already set (a 512-entry table indexed
by the word's 9 low bits) instead of ORing the sign into ``x`` afterwards. The change must not move a
single output bit, so these tests check:

1. the identity it rests on, in numpy: ``rabs * (±w) == with_sign(rabs * w, sign)`` bit for bit for
   every strip, both signs, ``rabs`` from 0 to 2^52 − 1; and ``-0.5 * x * x`` equal for ``x`` and ``-x``;
2. digests (sha256 of values, final states, tail positions, tail counts) of ``ziggurat_fill_chunks``
   draws and of ``NoiseSource("reproducible")`` draws, computed with the kernel before the change
   (main at 7cc97ac, the same machine): chunk counts that are and are not multiples of anything, a
   short last chunk, a tail-position cap that overflows (cap 0 and 2), ±inf tail markers in every chunk;
3. ``ziggurat_fill_chunks`` equal to ``ziggurat_body`` chunk by chunk (values, states, tail positions),
   whatever the chunk size.

The loop itself is also checked bit for bit against a plain-Python transcription of the method in
``test_ziggurat_kernel.py``.
"""

import hashlib

import numpy as np
import pytest

from dpopt import kernels
from dpopt.noise import NoiseSource
from dpopt.ziggurat import SFC_DISCARD, sfc64_seed_state, ziggurat_body, ziggurat_tables

SIGN = np.uint64(1 << 63)


def _with_sign(x: np.ndarray, sign: np.ndarray) -> np.ndarray:
    """x (float64) with the sign bit `sign` (uint64: 0 or 2^63) ORed in, as _native.c's with_sign."""
    return (x.view(np.uint64) | sign).view(np.float64)


def test_signed_factor_gives_the_same_bits_as_the_sign_ored_into_the_product():
    _, w, _, _ = ziggurat_tables()
    rng = np.random.default_rng(5)
    rabs = np.concatenate(
        [np.array([0, 1, 2, 3, (1 << 52) - 1], dtype=np.uint64), rng.integers(0, 1 << 52, 2000, dtype=np.uint64)]
    )
    r = rabs.astype(np.int64).astype(np.float64)  # exact: rabs < 2^52
    assert np.array_equal(r.astype(np.uint64), rabs)
    for sign in (np.uint64(0), SIGN):
        ws = _with_sign(w.copy(), np.full(w.shape, sign))  # the table entry w9[sign << 8 | strip]
        new = (r[:, None] * ws[None, :]).view(np.uint64)
        old = _with_sign(r[:, None] * w[None, :], np.full((r.size, w.size), sign)).view(np.uint64)
        assert np.array_equal(new, old)
    # rabs = 0 under the sign bit: -0.0 both ways (not +0.0)
    assert np.signbit(0.0 * -w[1]) and np.signbit(_with_sign(np.array([0.0 * w[1]]), np.array([SIGN]))[0])
    # the wedge test's exp argument does not see the sign: (-0.5 * x) * x is the same double for x and -x
    x = r[:, None] * w[None, 1:]
    assert np.array_equal((-0.5 * x * x).view(np.uint64), (-0.5 * (-x) * (-x)).view(np.uint64))


def _state(seed: int, i: int) -> np.ndarray:
    return sfc64_seed_state(bytes((seed * 131 + 7 * i + 3 * j) % 256 for j in range(24)))


def _chunks(seed: int, n: int, chunk: int, cap: int):
    """ziggurat_fill_chunks on n values in chunks of `chunk` from states _state(seed, i): (values, final
    states, tail_idx, tail_count, chunks filled)."""
    k, w, f, _ = ziggurat_tables()
    m = -(-n // chunk)
    states = np.stack([_state(seed, i) for i in range(m)])
    out = np.empty(n)
    counter = np.zeros(2, np.int64)
    tail_idx = np.full((m, cap), -1, np.int64)
    tail_count = np.zeros(m, np.int64)
    filled = kernels.native.ziggurat_fill_chunks(
        out, states, counter, chunk, SFC_DISCARD, k, w, f, tail_idx, cap, tail_count
    )
    return out, states, tail_idx, tail_count, filled


# (seed, n, chunk, cap) -> (sha256 of values, states, tail_idx, tail_count [first 32 hex digits], tail positions
# in all, negative values): computed with the kernel before the signed-w table (main 7cc97ac), 2026-12-07
BEFORE = {
    (0, 300_001, 65_536, 40): ("68270c0d54e3092c4222890460e07d75", 84, 149_872),
    (1, 131_072 * 3, 131_072, 64): ("04abfd624622b1347f194082cc2ebbd0", 102, 196_766),
    (2, 100_003, 9_999, 2): ("3520d172c9223024860a886489383f17", 17, 50_192),
    (3, 50_000, 7, 0): ("e547b3a81b52ee68e248a9eecb3d3746", 0, 25_694),
    (4, 777_777, 131_072, 64): ("e41d8e9b65ea34f4da2b16405b58a5e5", 214, 388_806),
}


@pytest.mark.parametrize("case", sorted(BEFORE))
def test_chunked_draws_equal_the_kernel_before_the_change_bit_for_bit(case):
    seed, n, chunk, cap = case
    out, states, tail_idx, tail_count, filled = _chunks(seed, n, chunk, cap)
    assert filled == -(-n // chunk)
    h = hashlib.sha256()
    for a in (out, states, tail_idx, tail_count):
        h.update(np.ascontiguousarray(a).tobytes())
    assert (h.hexdigest()[:32], int(tail_count.sum()), int(np.signbit(out).sum())) == BEFORE[case]


@pytest.mark.parametrize(
    ("seed", "n", "digest"),
    [(0, 795_010, "b2ea29e8c50e3ede12d8cf757e7be2e2"), (7, 262_145, "bdd9100e75e5e897dc5e2f00fde0cb87")],
)
def test_reproducible_draws_equal_the_kernel_before_the_change(seed, n, digest):
    # 795,010: the MNIST MLP's parameter count (7 chunks, the last one short); 262,145: one value in a third chunk
    early = NoiseSource("reproducible", seed=seed).start_normal(n).values()
    streamed = NoiseSource("reproducible", seed=seed).start_normal(n, stream=True).values()
    assert hashlib.sha256(early.numpy().tobytes()).hexdigest()[:32] == digest
    assert np.array_equal(early.numpy().view(np.uint64), streamed.numpy().view(np.uint64))
    assert np.isfinite(early.numpy()).all()  # every tail marker filled


@pytest.mark.parametrize(("n", "chunk"), [(10_000, 1_000), (10_001, 1_000), (9_999, 4_096), (5, 1), (3_000, 7_000)])
def test_chunks_equal_the_body_chunk_by_chunk(n, chunk):
    seed = n % 97
    out, states, tail_idx, tail_count, _ = _chunks(seed, n, chunk, cap=chunk)
    for i in range(-(-n // chunk)):
        lo, hi = i * chunk, min(n, (i + 1) * chunk)
        state = _state(seed, i)
        values = np.empty(hi - lo)
        tails = ziggurat_body(values, state)
        assert np.array_equal(out[lo:hi].view(np.uint64), values.view(np.uint64))
        assert np.array_equal(states[i], state)
        assert tail_count[i] == tails.size and np.array_equal(tail_idx[i, : tails.size], tails)
        assert np.isinf(out[lo:hi][tails]).all() and np.isfinite(np.delete(out[lo:hi], tails)).all()
