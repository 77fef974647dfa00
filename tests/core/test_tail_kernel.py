"""The compiled exact tail law (``fill_tails`` and the tails ``ziggurat_fill_chunks`` fills, ``_native.c``) held
to its numpy statement (tests/core/tail_oracle.py, dpopt's own implementation until 2026-12-07).

Both take the same words of the same SFC64 stream in the same order and evaluate the same float64 expressions;
only ``log`` differs (numpy's vectorised one against the C library's, one ulp apart for ≈ 0.35 % of arguments
on this CPU), so each value is compared within one ulp, and the stream's end state exactly (the same number of
words taken). Cases: 10^6 values from 28,000 streams; streams whose first candidate's word is below 2^11 (the
uniform's exponent reads on through further words: probability 2^-53 in a random stream, made here by choosing
the state); streams whose first round accepts none of its candidates (a second round: found by a search over
seeded states, checked below through the oracle); an early draw's chunks. The law's own white-box and
statistical tests run on the oracle (test_noise_ziggurat.py).
"""

import math
import os

import numpy as np
import pytest
import tail_oracle as oracle
from scipy import stats
from tail_oracle import within_one_ulp

from dpopt import kernels
from dpopt.noise import NORMAL_CHUNK, NoiseSource, ziggurat_normals
from dpopt.ziggurat import ZIGGURAT_R, sfc64_seed_state, ziggurat_body, ziggurat_tables

native = kernels.native


def _kernel(state: np.ndarray, m: int, signs: np.ndarray = None):
    """fill_tails on m ±inf markers (alternating signs unless given): (values, end state)."""
    out = np.where(np.arange(m) % 2 == 0, -np.inf, np.inf) if signs is None else signs * np.inf
    end = state.copy()
    native.fill_tails(out, end, np.arange(m, dtype=np.int64), ZIGGURAT_R)
    return out, end


def _oracle(state: np.ndarray, m: int):
    """The oracle's m tail draws from ``state`` and the stream's state after them."""
    gen = oracle.sfc64(state)
    z = oracle.tail_draws(gen, m)
    return z, np.array(gen.bit_generator.state["state"]["state"], dtype=np.uint64)


def _agrees(state: np.ndarray, m: int) -> None:
    got, end = _kernel(state, m)
    want, want_end = _oracle(state, m)
    assert within_one_ulp(np.abs(got), want)
    assert np.array_equal(np.signbit(got), np.arange(m) % 2 == 0)  # each marker's sign kept
    assert np.array_equal(end, want_end)  # the same words taken: the same stream position after


def test_a_million_tail_values_agree_with_the_oracle():
    rng = np.random.default_rng(34)
    k = 28_000
    states = np.ones((k, 4), dtype=np.uint64)
    states[:, :3] = rng.integers(0, 2**64, size=(k, 3), dtype=np.uint64)
    counts = rng.integers(1, 72, size=k)
    assert counts.sum() >= 10**6
    exact = total = 0
    for state, m in zip(states, counts.tolist()):
        got, end = _kernel(state, m)
        want, want_end = _oracle(state, m)
        assert within_one_ulp(np.abs(got), want) and np.array_equal(end, want_end)
        exact += int(np.sum(np.abs(got) == want))
        total += m
    assert exact / total > 0.99  # libm's log and numpy's differ in the last bit only now and then


@pytest.mark.parametrize("first", [0, 1, 5, 0x7FF])
def test_a_first_word_below_2_11_reads_the_exponent_on_through_further_words(first):
    """SFC64's first output is a + b + counter: the state is chosen so that it is ``first`` (< 2^11; 0: the
    leading zeros run on into the next word). The uniform's exponent then counts across the stream's further
    words, taken before u₂ — the oracle's rare-row path."""
    b, c, counter = 0x0123456789ABCDEF, 0x0FEDCBA987654321, 1
    a = (first - b - counter) % 2**64
    state = np.array([a, b, c, counter], dtype=np.uint64)
    assert int(oracle.sfc64(state).bit_generator.random_raw()) == first
    for m in (1, 7, 40):
        _agrees(state, m)


# States (a, b, c, counter) whose first round for one draw (5 candidates) accepts none, found by a seeded search
# (numpy default_rng(2026), 2026-12-07): probability ≈ 0.08^5 per stream.
SECOND_ROUND = [
    (0xF0143638A8381DA8, 0x94DA46FA87286BF9, 0x804BC6EA2C734EB5, 1),
    (0x02418798C0A9F752, 0x153BFD875BA768FC, 0xDB932B475A63EE5E, 1),
]


@pytest.mark.parametrize("words", SECOND_ROUND)
def test_a_round_that_accepts_too_few_candidates_is_followed_by_another(words, monkeypatch):
    state = np.array(words, dtype=np.uint64)
    rounds = []
    real = oracle.tries_for
    monkeypatch.setattr(oracle, "tries_for", lambda want: rounds.append(want) or real(want))
    oracle.tail_draws(oracle.sfc64(state), 1)
    assert len(rounds) >= 2  # the oracle needs a second round on this stream
    monkeypatch.undo()
    _agrees(state, 1)


def test_the_chunked_kernel_fills_each_chunks_tails_as_fill_tails_does():
    """With r > 0, ziggurat_fill_chunks leaves no marker in a chunk with at most cap tail positions: its values are
    ziggurat_body's with fill_tails on the state where the body stopped — bit for bit — and its state row still
    ends where the body ended; a chunk with more than cap keeps its markers (the caller redraws it)."""
    k, w, f, _ = ziggurat_tables()
    n, chunk, cap = 9 * 4096 + 77, 4096, 1
    m = -(-n // chunk)
    raw = np.random.default_rng(11).bytes(24 * m)
    states = np.stack([sfc64_seed_state(raw[24 * i : 24 * (i + 1)]) for i in range(m)])
    out, tail_idx, count = np.empty(n), np.full((m, cap), -1, np.int64), np.zeros(m, np.int64)
    native.ziggurat_fill_chunks(out, states, np.zeros(2, np.int64), chunk, 7, k, w, f, tail_idx, cap, count, ZIGGURAT_R)
    over = 0
    for i in range(m):
        lo, hi = i * chunk, min(n, (i + 1) * chunk)
        ref, words = np.empty(hi - lo), sfc64_seed_state(raw[24 * i : 24 * (i + 1)])
        idx = ziggurat_body(ref, words, discard=7)
        assert np.array_equal(states[i], words) and count[i] == idx.size
        if idx.size > cap:
            over += 1
            assert np.array_equal(out[lo:hi], ref)  # markers kept
            continue
        native.fill_tails(ref, words.copy(), idx, ZIGGURAT_R)
        assert np.array_equal(out[lo:hi].view(np.uint64), ref.view(np.uint64)) and np.isfinite(out[lo:hi]).all()
    assert 0 < over < m  # both kinds of chunk (≈ 1.1 tail positions per 4096 values)


def test_an_early_draw_is_ziggurat_normals_chunk_by_chunk():
    """The Privatizer's early draw (its tails filled in the workers' compiled pass) against the streamed draw (each
    chunk by ziggurat_normals): the same bits, every value finite, the tail's share and reach as the law says."""
    n = 3 * NORMAL_CHUNK + 1234
    early = NoiseSource("reproducible", seed=5).start_normal(n).values().numpy()
    streamed = NoiseSource("reproducible", seed=5).start_normal(n, stream=True).values().numpy()
    assert np.array_equal(early.view(np.uint64), streamed.view(np.uint64)) and np.isfinite(early).all()
    tail = int((np.abs(early) >= ZIGGURAT_R).sum())
    p = 2 * 0.00012906  # P(|Z| >= 3.654)
    assert abs(tail - n * p) < 6 * math.sqrt(n * p)  # 6σ binomial band: false alarm 2e-9


def test_ziggurat_normals_fills_every_tail_position():
    state = bytes(range(24))
    out = ziggurat_normals(state, np.empty(1 << 16))
    assert np.isfinite(out).all() and (np.abs(out) >= ZIGGURAT_R).any()


def test_fill_tails_refuses_positions_outside_out_and_bad_arguments():
    out, state = np.full(4, np.inf), sfc64_seed_state(bytes(24))
    with pytest.raises(ValueError, match="outside out"):
        native.fill_tails(out, state, np.array([0, 4], dtype=np.int64), ZIGGURAT_R)
    with pytest.raises(ValueError, match="outside out"):
        native.fill_tails(out, state, np.array([-1], dtype=np.int64), ZIGGURAT_R)
    with pytest.raises(ValueError, match="state uint64"):
        native.fill_tails(out, state[:3].copy(), np.array([0], dtype=np.int64), ZIGGURAT_R)
    with pytest.raises(ValueError, match="idx int64"):
        native.fill_tails(out, state, np.array([0], dtype=np.int32), ZIGGURAT_R)
    assert np.isinf(out).all() and state[3] == 1  # a refused call writes nothing and takes no word


@pytest.mark.parametrize("r", [0.0, 0.5, -1.0, 1000.5, 1e200, math.inf, math.nan])
def test_a_tail_start_outside_1_to_1000_is_refused_not_looped_on(r):
    """Below 1 a candidate is accepted with probability ≈ r, and r·r overflows for a huge r: either would loop with
    the GIL released for ever. Both kernels refuse such an r (ziggurat_fill_chunks' r = 0 means: no tails)."""
    out, state = np.full(4, np.inf), sfc64_seed_state(bytes(24))
    with pytest.raises(ValueError, match=r"r finite in \[1, 1000\]"):
        native.fill_tails(out, state, np.array([0], dtype=np.int64), r)
    k, w, f, _ = ziggurat_tables()
    args = (np.empty(10), np.ones((1, 4), np.uint64), np.zeros(2, np.int64), 10, 0, k, w, f)
    if r != 0.0:
        with pytest.raises(ValueError, match=r"r = 0 or finite in \[1, 1000\]"):
            native.ziggurat_fill_chunks(*args, np.zeros((1, 4), np.int64), 4, np.zeros(1, np.int64), r)
    for edge in (1.0, 1000.0):  # the range's ends are taken
        native.fill_tails(np.full(3, np.inf), sfc64_seed_state(bytes(24)), np.arange(3, dtype=np.int64), edge)


def test_buffers_sharing_memory_are_refused():
    """A position read from memory the kernel writes could point anywhere: out, idx and state must be apart (and
    each position is checked again where it is used)."""
    buf = np.zeros(8, dtype=np.int64)
    out = buf.view(np.float64)
    out[:] = np.inf
    with pytest.raises(ValueError, match="must not share memory"):
        native.fill_tails(out, sfc64_seed_state(bytes(24)), buf[:2], ZIGGURAT_R)
    words = np.ones(8, dtype=np.uint64)
    with pytest.raises(ValueError, match="must not share memory"):
        native.fill_tails(words.view(np.float64), words[:4], np.array([5], dtype=np.int64), ZIGGURAT_R)
    k, w, f, _ = ziggurat_tables()
    block = np.zeros(64, dtype=np.int64)
    with pytest.raises(ValueError, match="must not share memory"):  # tail_idx inside out
        native.ziggurat_fill_chunks(
            block.view(np.float64),
            np.ones((1, 4), np.uint64),
            np.zeros(2, np.int64),
            64,
            0,
            k,
            w,
            f,
            block[:8].reshape(1, 8),
            8,
            np.zeros(1, np.int64),
            ZIGGURAT_R,
        )


def test_no_positions_take_no_words():
    state = sfc64_seed_state(bytes(range(24)))
    before = state.copy()
    native.fill_tails(np.empty(0), state, np.empty(0, dtype=np.int64), ZIGGURAT_R)
    assert np.array_equal(state, before)


_M64 = (1 << 64) - 1
_INV9 = pow(9, -1, 1 << 64)


def _back(s: tuple) -> tuple:
    """SFC64 one step back (it is a bijection): the state whose step gives ``s``."""
    a1, b1, c1, n1 = s
    c = (b1 * _INV9) & _M64  # b1 = c + (c << 3) = 9c
    b = a1
    for _ in range(6):  # a1 = b ^ (b >> 11): fixed-point iteration recovers b (64 / 11 < 6 rounds)
        b = a1 ^ (b >> 11)
    n = (n1 - 1) & _M64
    t = (c1 - (((c << 24) | (c >> 40)) & _M64)) & _M64
    return ((t - b - n) & _M64, b, c, n)


def _planted(offset: int, word: int, seed: int) -> np.ndarray:
    """A state whose output number ``offset`` (from 0) is ``word``: choose the state at that output so that
    a + b + counter = word, then step back ``offset`` times."""
    rng = np.random.default_rng(seed)
    b, c, n = (int(v) for v in rng.integers(0, 2**63, size=3, dtype=np.uint64))
    s = ((word - b - n) & _M64, b, c, n)
    for _ in range(offset):
        s = _back(s)
    state = np.array(s, dtype=np.uint64)
    assert int(oracle.sfc64(state.copy()).bit_generator.random_raw(offset + 1)[-1]) == word
    return state


@pytest.mark.parametrize("offset", [0, 2, 9, 14, 15, 24, 40])
@pytest.mark.parametrize("word", [0, 3, 0x7FF])
def test_rare_words_anywhere_in_the_stream_agree_with_the_oracle(offset, word):
    """A word below 2^11 planted at a stream offset (for m = 5: the candidates' first words at even offsets < 18
    are rare ones; odd offsets are mantissa words, 18–26 or later the extra words or u₂): the kernel and the oracle
    take the same further words and give the same values."""
    _agrees(_planted(offset, word, seed=offset * 7 + word), 5)


def test_the_kernels_tail_draws_follow_the_conditional_normal_law():
    """The compiled draws themselves (not only the oracle, test_noise_ziggurat.py): Z | Z ≥ r by KS against
    1 − Q(z)/Q(r) at α = 1e-7 on 200,000 draws from a fresh os.urandom state (an honest sampler fails with
    probability 1e-7 per run; the KS critical distance is 0.0065, a tail 10 % off in scale is ≥ 0.008 away), and
    the share beyond r + 1 by a binomial count (6σ, false alarm 2e-9)."""
    m = 200_000
    out = np.where(np.arange(m) % 2 == 0, -np.inf, np.inf)
    native.fill_tails(out, sfc64_seed_state(os.urandom(24)), np.arange(m, dtype=np.int64), ZIGGURAT_R)
    t = np.abs(out)
    assert np.isfinite(t).all() and t.min() >= ZIGGURAT_R
    qr = stats.norm.sf(ZIGGURAT_R)
    assert stats.kstest(t, lambda z: 1 - stats.norm.sf(z) / qr).pvalue > 1e-7
    p = stats.norm.sf(ZIGGURAT_R + 1) / qr
    count = int((t > ZIGGURAT_R + 1).sum())
    assert abs(count - m * p) < 6 * math.sqrt(m * p * (1 - p))
