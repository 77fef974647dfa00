"""dpopt.ziggurat: the compiled ziggurat body of the CPU Gaussian sampler (issue 34).

Checked against (1) a plain-Python transcription of Marsaglia & Tsang (2000)'s method on the same
tables and SFC64 stream, bit for bit, tail positions and final state included; (2) numpy's own
ziggurat (tables computed independently, by numpy) on the same stream, up to its first tail branch
(where numpy's tail consumes more words): agreement within 1e-13 relative; (3) the tables' defining
equations (equal strip areas, the closure at the top); (4) the body's law, by a KS test against the
normal truncated to |z| < r.
"""

import math
import os

import numpy as np
import pytest
from scipy import stats

from dpopt.ziggurat import (
    SFC_DISCARD,
    STRIPS,
    ZIGGURAT_R,
    sfc64_seed_state,
    ziggurat_body,
    ziggurat_tables,
)

M64 = (1 << 64) - 1


class _PySFC64:
    """SFC64 in Python integers (Doty-Humphrey's reference step)."""

    def __init__(self, words):
        self.a, self.b, self.c, self.n = (int(w) for w in words)

    def next(self) -> int:
        tmp = (self.a + self.b + self.n) & M64
        self.n = (self.n + 1) & M64
        self.a = self.b ^ (self.b >> 11)
        self.b = (self.c + (self.c << 3)) & M64
        self.c = ((((self.c << 24) | (self.c >> 40)) & M64) + tmp) & M64
        return tmp


def _reference(state: bytes, n: int):
    """Marsaglia & Tsang's loop, transcribed: (values with ±inf at tail positions, tail positions, state)."""
    k, w, f, _ = ziggurat_tables()
    g = _PySFC64(sfc64_seed_state(state))
    for _ in range(SFC_DISCARD):
        g.next()
    out, tails = [], []
    while len(out) < n:
        word = g.next()
        strip, negative, j = word & 0xFF, (word >> 8) & 1, (word >> 9) & ((1 << 52) - 1)
        x = float(j) * float(w[strip])
        if j < int(k[strip]):
            out.append(-x if negative else x)
        elif strip == 0:
            tails.append(len(out))
            out.append(-math.inf if negative else math.inf)
        else:
            u = float(g.next() >> 11) * 2.0**-53
            if float(f[strip]) + u * (float(f[strip - 1]) - float(f[strip])) < math.exp(-0.5 * x * x):
                out.append(-x if negative else x)
    return np.array(out), np.array(tails, dtype=np.int64), [g.a, g.b, g.c, g.n]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compiled_body_equals_the_transcribed_method_bit_for_bit(seed):
    state = bytes((seed * 97 + 13 * i + 5) % 256 for i in range(24))
    n = 40_000  # ≈ 480 wedge tests and ≈ 10 tail branches per state
    want, want_tails, want_state = _reference(state, n)
    words = sfc64_seed_state(state)
    got = np.empty(n)
    tails = ziggurat_body(got, words)
    assert np.array_equal(got, want)  # bit-identical, ±inf at the same positions
    assert np.array_equal(tails, want_tails) and tails.size > 0
    assert [int(v) for v in words] == want_state  # the stream continues where the method left it


def test_body_agrees_with_numpys_independently_computed_ziggurat():
    """numpy's standard_normal is the same method on the same stream (one word per candidate, the same bit
    fields) with tables numpy computed itself: up to numpy's first tail branch the two consume the same
    words, so every value must agree to a few ulps and the first tail must fall at the same position."""
    compared = 0
    for seed in range(40):
        state = bytes((seed * 31 + 7 * i + 3) % 256 for i in range(24))
        words = sfc64_seed_state(state)
        bitgen = np.random.SFC64(0)
        bitgen.state = {"bit_generator": "SFC64", "state": {"state": words.copy()}, "has_uint32": 0, "uinteger": 0}
        bitgen.random_raw(SFC_DISCARD)
        want = np.random.Generator(bitgen).standard_normal(1 << 14)
        got = np.empty(1 << 14)
        tails = ziggurat_body(got, words)
        stop = int(tails[0]) if tails.size else got.size
        np.testing.assert_allclose(got[:stop], want[:stop], rtol=1e-13, atol=0)
        if tails.size:
            assert abs(want[stop]) >= ZIGGURAT_R  # numpy took its tail branch at the same candidate
        compared += stop
    assert compared > 100_000


def test_tables_tile_the_area_under_the_density():
    """Each strip i ≥ 1 has area x_i·(f(x_{i−1}) − f(x_i)) = v (Marsaglia & Tsang's construction) and the
    base's rectangle plus tail is v too; k[i] = ⌊2^52·x_narrower/x_i⌋; f[i] = exp(−x_i²/2)."""
    k, w, f, r = ziggurat_tables()
    x = w * 2.0**52
    v = r * math.exp(-0.5 * r * r) + math.sqrt(math.pi / 2) * math.erfc(r / math.sqrt(2))
    assert x[0] * math.exp(-0.5 * r * r) == pytest.approx(v, rel=1e-14)
    assert x[STRIPS - 1] == pytest.approx(r, rel=1e-15) and r == ZIGGURAT_R
    areas = x[1:] * (f[:-1] - f[1:])  # slot j's strip: width x_j between f(x_j) and the narrower slot's f
    np.testing.assert_allclose(areas, v, rtol=1e-9)  # float64 differences of nearby f values: 1e-9 relative
    np.testing.assert_allclose(f[1:], np.exp(-0.5 * x[1:] ** 2), rtol=1e-14)
    assert f[0] == 1.0 and k[1] == 0 and np.all(np.diff(x[1:]) > 0)
    narrower = np.concatenate([[r, 0.0], x[1:-1]])
    assert np.all(np.abs(k.astype(np.float64) - np.floor(narrower / x * 2.0**52)) <= 1)


def test_body_follows_the_normal_law_truncated_at_r():
    """2^22 values: the body against N(0, 1) restricted to |z| < r (KS, false alarm 1e-7: the state is fresh
    os.urandom every run, so that is the chance per run; at 1e-6 it sat at the limit), the tail branch's share
    against P(|Z| ≥ r) = 2.58e-4 (6 Poisson standard deviations: P(Poisson(1082) beyond) = 3e-9)."""
    out = np.empty(1 << 22)
    tails = ziggurat_body(out, sfc64_seed_state(os.urandom(24)))
    body = np.delete(out, tails)
    assert np.all(np.abs(body) < ZIGGURAT_R) and np.all(np.isinf(out[tails]))
    mass = 1 - 2 * stats.norm.sf(ZIGGURAT_R)
    assert stats.kstest(body, lambda z: (stats.norm.cdf(z) - stats.norm.sf(ZIGGURAT_R)) / mass).pvalue > 1e-7
    lam = out.size * 2 * stats.norm.sf(ZIGGURAT_R)
    assert abs(tails.size - lam) < 6 * math.sqrt(lam)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="24 bytes"):
        sfc64_seed_state(b"short")
    with pytest.raises(ValueError, match="float64"):
        ziggurat_body(np.empty(3, dtype=np.float32), sfc64_seed_state(bytes(24)))
    with pytest.raises(ValueError, match="4 words"):
        ziggurat_body(np.empty(3), np.zeros(3, dtype=np.uint64))
    with pytest.raises(ValueError, match="discard"):
        ziggurat_body(np.empty(3), sfc64_seed_state(bytes(24)), discard=-1)


def test_without_the_extension_the_error_says_how_to_build_it(monkeypatch):
    """A source tree that was never built (no dpopt/_native*.so): the import error names the extension and
    the command that builds it."""
    import importlib
    import sys

    import dpopt

    monkeypatch.setitem(sys.modules, "dpopt._native", None)  # `from . import _native` raises ImportError
    monkeypatch.delattr(dpopt, "_native")  # (else the import finds the package's attribute)
    monkeypatch.delitem(sys.modules, "dpopt.kernels", raising=False)
    with pytest.raises(ImportError, match=r"dpopt\._native.*pip install -e \."):
        importlib.import_module("dpopt.kernels")
    monkeypatch.undo()
    importlib.import_module("dpopt.kernels")


def test_an_extension_built_from_older_source_is_refused_with_the_rebuild_command(monkeypatch):
    """An extension built before a kernel was added (a source tree updated without rebuilding): the import error
    names the missing kernel and the command that rebuilds it, rather than an AttributeError at the first draw."""
    import importlib
    import sys

    from dpopt import _native

    monkeypatch.delattr(_native, "ziggurat_fill_chunks")
    monkeypatch.delitem(sys.modules, "dpopt.kernels", raising=False)
    with pytest.raises(ImportError, match=r"older src/dpopt/_native\.c: ziggurat_fill_chunks missing.*pip install"):
        importlib.import_module("dpopt.kernels")
    monkeypatch.undo()
    importlib.import_module("dpopt.kernels")


def test_the_c_kernel_refuses_buffers_it_cannot_write_safely():
    """The kernel checks its buffers itself (not only the Python wrapper): a tail-index buffer shorter than
    out, a state of the wrong size or tables of the wrong length is a ValueError, not an out-of-bounds write."""
    from dpopt.kernels import native

    k, w, f, _ = ziggurat_tables()
    state = sfc64_seed_state(bytes(24))
    with pytest.raises(ValueError, match="tail_idx int64"):
        native.ziggurat_fill(np.empty(10), state, 0, k, w, f, np.empty(9, dtype=np.int64))
    with pytest.raises(ValueError, match="state uint64"):
        native.ziggurat_fill(np.empty(10), state[:3].copy(), 0, k, w, f, np.empty(10, dtype=np.int64))
    with pytest.raises(ValueError, match="256"):
        native.ziggurat_fill(np.empty(10), state, 0, k[:255], w, f, np.empty(10, dtype=np.int64))
    with pytest.raises(ValueError, match="writable"):
        native.ziggurat_fill(np.empty(10), state, 0, k, w, f, np.empty(10, dtype=np.int64)[::2])


def test_draws_in_several_threads_at_once_agree():
    from concurrent.futures import ThreadPoolExecutor

    state = bytes(range(24))

    def draw(_):
        out = np.empty(3000)
        ziggurat_body(out, sfc64_seed_state(state))
        return out

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(draw, range(4)))
    assert all(np.array_equal(o, outs[0]) for o in outs)
    k, _, _, _ = ziggurat_tables()
    with pytest.raises(ValueError, match="read-only"):
        k[0] = 0


def _chunk_job(n: int, chunk: int, seed: int, cap: int = 64):
    """The arguments of ``ziggurat_fill_chunks`` for ``n`` values in chunks of ``chunk`` (states from ``seed``),
    ``cap`` tail positions recorded per chunk."""
    from dpopt.kernels import native  # noqa: F401 (the extension must be present)

    m = -(-n // chunk)
    raw = np.random.default_rng(seed).bytes(24 * m)
    states = np.stack([sfc64_seed_state(raw[24 * i : 24 * (i + 1)]) for i in range(m)])
    k, w, f, _ = ziggurat_tables()
    out, tail_idx, count = np.empty(n), np.full((m, cap), -1, dtype=np.int64), np.full(m, -1, dtype=np.int64)
    return raw, (out, states, np.zeros(1, dtype=np.int64), chunk, SFC_DISCARD, k, w, f, tail_idx, cap, count)


@pytest.mark.parametrize("callers", [1, 3])
def test_chunked_fill_is_ziggurat_body_per_chunk_whoever_claims_the_chunks(callers):
    """ziggurat_fill_chunks (an early draw's chunks, claimed by the calling threads through one atomic counter)
    gives chunk i exactly what ziggurat_body gives on the i-th state — values, tail positions, end state — each
    chunk filled once in all, however many threads share the job."""
    from concurrent.futures import ThreadPoolExecutor

    from dpopt.kernels import native

    n, chunk = 5 * 4096 + 123, 4096
    raw, job = _chunk_job(n, chunk, seed=callers)
    with ThreadPoolExecutor(callers) as pool:
        done = list(pool.map(lambda _: native.ziggurat_fill_chunks(*job), range(callers)))
    out, states, counter, _, _, _, _, _, tail_idx, _, count = job
    assert sum(done) == 6 and int(counter[0]) >= 6  # every chunk once; each caller's last claim finds none left
    assert native.ziggurat_fill_chunks(*job) == 0  # a finished job fills nothing more
    for i in range(6):
        lo, hi = i * chunk, min(n, (i + 1) * chunk)
        ref, words = np.empty(hi - lo), sfc64_seed_state(raw[24 * i : 24 * (i + 1)])
        idx = ziggurat_body(ref, words)
        assert np.array_equal(out[lo:hi], ref)  # ±inf at the tail positions in both
        assert count[i] == idx.size and np.array_equal(tail_idx[i, : idx.size], idx)
        assert np.array_equal(states[i], words)  # advanced to where the body stopped (the tails continue there)
    assert int(count.sum()) > 0  # some chunk has tail positions (≈ 1 per 3,800 values)


def test_the_chunked_kernel_counts_past_its_cap_without_writing_there():
    """More tail positions than a chunk's row holds: the count is the true one (the caller redraws that chunk)
    and nothing is written beyond the row."""
    from dpopt.kernels import native

    raw, job = _chunk_job(3 * 4096, 4096, seed=5, cap=2)
    guarded = np.full((4, 2), -1, dtype=np.int64)  # the rows, then one guard row right after them in memory
    job = (*job[:8], guarded[:3], *job[9:])
    native.ziggurat_fill_chunks(*job)
    tail_idx, count = job[8], job[10]
    for i in range(3):
        ref = np.empty(4096)
        idx = ziggurat_body(ref, sfc64_seed_state(raw[24 * i : 24 * (i + 1)]))
        assert count[i] == idx.size and np.array_equal(tail_idx[i, : min(2, idx.size)], idx[:2])
        assert (tail_idx[i, min(2, idx.size) :] == -1).all()  # nothing past the chunk's own entries
    assert (guarded[3] == -1).all()  # nothing past the last row
    assert int(count.max()) > 2  # a chunk of 4096 has ≈ 1.1 tail positions on average: seed 5 gives more


def test_the_chunked_kernel_refuses_buffers_it_cannot_write_safely():
    from dpopt.kernels import native

    _, job = _chunk_job(10, 4, seed=0)
    out, states, counter, chunk, disc, k, w, f, tail_idx, cap, count = job
    with pytest.raises(ValueError, match="tail_idx int64"):
        native.ziggurat_fill_chunks(out, states, counter, chunk, disc, k, w, f, tail_idx[:2].copy(), cap, count)
    with pytest.raises(ValueError, match="tail_idx int64"):
        native.ziggurat_fill_chunks(out, states, counter, chunk, disc, k, w, f, tail_idx, cap + 1, count)
    with pytest.raises(ValueError, match="states uint64"):
        native.ziggurat_fill_chunks(out, states[:2].copy(), counter, chunk, disc, k, w, f, tail_idx, cap, count)
    with pytest.raises(ValueError, match="chunk > 0"):
        native.ziggurat_fill_chunks(out, states, counter, 0, disc, k, w, f, tail_idx, cap, count)
    with pytest.raises(ValueError, match="tail_count int64"):
        native.ziggurat_fill_chunks(out, states, counter, chunk, disc, k, w, f, tail_idx, cap, count[:2].copy())
    with pytest.raises(ValueError, match="next int64"):
        native.ziggurat_fill_chunks(out, states, counter.astype(np.uint64), chunk, disc, k, w, f, tail_idx, cap, count)
    assert int(counter[0]) == 0 and (count == -1).all()  # nothing claimed or written by a refused call
