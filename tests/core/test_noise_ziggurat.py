"""The CPU sampler of secret and reproducible noise (issue 34): a compiled float64 ziggurat
(dpopt.ziggurat; its own tests in test_ziggurat_kernel.py) on per-chunk SFC64 streams, every tail
value (|z| ≥ r = 3.654) drawn from the exact tail law (the compiled ``fill_tails``; the white-box and
statistical tests of the law below run on its numpy statement, tests/core/tail_oracle.py, which
test_tail_kernel.py holds the kernel to).

White-box tests feed the tail's uniforms their extreme words (the largest |z| it can give, the
exponent's count of leading zero bits across words); statistical tests give their false-alarm rate.
The guarantee needs every |z| up to 11.5 + 1/σ to be possible: numpy's ziggurat's own tail stops at
13.71, the tail drawn here at 37.63 (σ ≥ 0.04).
"""

import math
import os

import numpy as np
import pytest
import torch
from scipy import stats
from tail_oracle import log_full_uniform as _log_full_uniform
from tail_oracle import sfc64 as _sfc64
from tail_oracle import tail_draws as _tail_draws
from tail_oracle import within_one_ulp

import dpopt.noise as noise_mod
from dpopt.noise import (
    _TAIL_K_MAX,
    _TAIL_RADIUS,
    _TAIL_WORDS,
    CUT_RADIUS,
    NORMAL_CHUNK,
    ZIGGURAT_R,
    NoiseSource,
    _secure_words,
    ziggurat_normals,
)
from dpopt.ziggurat import sfc64_seed_state, ziggurat_body

LN2 = math.log(2.0)


class _Scripted:
    """A stand-in for a numpy Generator whose ``bit_generator.random_raw(size)`` returns given words:
    each call takes the next entry, an array of that size or a scalar to fill it with."""

    def __init__(self, *draws):
        self._draws = list(draws)
        self.bit_generator = self

    def random_raw(self, size):
        words = self._draws.pop(0)
        if np.ndim(words) == 0:
            return np.full(size, words, dtype=np.uint64)
        return np.asarray(words, dtype=np.uint64).reshape(size)


def test_tail_radius_beats_the_requirement_and_stays_under_the_cut():
    assert _TAIL_RADIUS == pytest.approx(math.sqrt(ZIGGURAT_R**2 + 2 * (_TAIL_K_MAX + 1) * LN2), rel=1e-15)
    assert 11.5 + 1 / 0.04 < _TAIL_RADIUS <= CUT_RADIUS  # every σ ≥ 0.04; the documented bound holds
    assert _TAIL_WORDS * 64 >= _TAIL_K_MAX  # the stream is long enough for the cap


def test_all_zero_words_give_the_largest_tail_value():
    """u₁ = 2^-(K_MAX+1) (all 1024 stream bits and the mantissa zero), u₂ = 0: z = the tail radius."""
    gen = _Scripted(0, 0, 0)  # [first word, μ's word] per try; the stream's other words; u₂
    z = _tail_draws(gen, 1)
    assert z[0] == pytest.approx(_TAIL_RADIUS, rel=1e-14) and z[0] > 11.5 + 1 / 0.1


@pytest.mark.parametrize("zeros", [0, 1, 31, 32, 33, 52, 53, 63, 64, 100, 640, 1000])
def test_exponent_is_the_count_of_leading_zero_bits_across_words(zeros):
    stream = np.zeros(_TAIL_WORDS, dtype=np.uint64)
    word, bit = divmod(zeros, 64)
    stream[word] = np.uint64(1) << np.uint64(63 - bit)
    first = [[stream[0], np.uint64(0x8000000000000000)]]  # μ = 1.5 (the top mantissa bit after the shift)
    draws = (first,) if zeros < 53 else (first, [stream[1:]])  # a first word below 2^11 reads on
    ln_u = _log_full_uniform(_Scripted(*draws), 1)
    assert ln_u[0] == pytest.approx(math.log(1.5) - (zeros + 1) * LN2, rel=1e-15)


def test_exponent_stops_at_its_cap():
    ln_u = _log_full_uniform(_Scripted(0, 0), 2)
    assert np.all(ln_u == -(_TAIL_K_MAX + 1) * LN2)


def test_rare_rows_read_on_in_row_order():
    """Two of three rows have a first word below 2^11: they read the next words, the earlier row first."""
    first = [[0, 0], [1 << 63, 0], [5, 0]]  # zeros: 1024 (all), 0, 61
    more = np.zeros((2, _TAIL_WORDS - 1), dtype=np.uint64)
    more[0, 0] = 1 << 62  # row 0: 64 + 1 zeros
    ln_u = _log_full_uniform(_Scripted(first, more), 3)
    assert np.allclose(ln_u, [-(66) * LN2, -LN2, -(62) * LN2], rtol=1e-15)


def test_full_uniforms_are_uniform():
    """−ln u ~ Exp(1): KS at α = 1e-4 on 200,000 draws."""
    e = -_log_full_uniform(_sfc64(bytes(range(24))), 200_000)
    assert stats.kstest(e, "expon").pvalue > 1e-4


def test_tail_draws_follow_the_conditional_normal_law():
    """Z | Z ≥ r: KS against 1 − Q(z)/Q(r) at α = 1e-7 on 200,000 draws; Q(r + 1) / Q(r) checked
    by a binomial count (6σ, false alarm 2e-9). The state is fresh (os.urandom) every run, so an honest
    sampler fails with probability ≈ 1e-7 per run (it was 1e-4 + 5.7e-7 at α = 1e-4 and 5σ). Power: the KS
    critical distance is 0.0065; r + Exp(rate 1.1·r) or Exp(rate 0.9·r), a tail 10 % off in scale, is 0.008 or 0.075 away."""
    t = _tail_draws(_sfc64(os.urandom(24)), 200_000)
    assert t.min() >= ZIGGURAT_R
    qr = stats.norm.sf(ZIGGURAT_R)
    assert stats.kstest(t, lambda x: 1 - stats.norm.sf(x) / qr).pvalue > 1e-7
    p = stats.norm.sf(ZIGGURAT_R + 1) / qr
    count = int((t > ZIGGURAT_R + 1).sum())
    assert abs(count - t.size * p) < 6 * math.sqrt(t.size * p * (1 - p))


def _body(state: bytes, n: int):
    """The kernel's body values (tail positions ±inf) and the stream's state after it."""
    words = sfc64_seed_state(state)
    out = np.empty(n)
    idx = ziggurat_body(out, words)
    return out, idx, words


def test_tail_positions_are_drawn_from_the_continued_stream_and_the_rest_kept():
    """Against the kernel's body on the same SFC64 state: equal at every body position; each tail
    position (±inf there) holds, with that sign, the tail law's draws from the stream where the body
    stopped (the oracle's _tail_draws on that state, within one ulp: numpy's log against libm's), in order."""
    state = bytes(range(100, 124))
    n = 1 << 18
    body, idx, after = _body(state, n)
    got = ziggurat_normals(state, np.empty(n))
    keep = np.ones(n, dtype=bool)
    keep[idx] = False
    assert np.array_equal(got[keep], body[keep]) and np.all(np.abs(body[keep]) < ZIGGURAT_R)
    assert idx.size > 20  # P(|Z| ≥ r) = 2.6e-4: 68 expected, P(≤ 20) < 1e-10
    assert np.all(np.isinf(body[idx])) and np.all(np.abs(got[idx]) >= ZIGGURAT_R)
    assert np.array_equal(np.signbit(got[idx]), np.signbit(body[idx]))
    assert within_one_ulp(np.abs(got[idx]), _tail_draws(_sfc64(after), idx.size))


def test_ziggurat_normals_is_a_function_of_its_state():
    state = os.urandom(24)
    a, b = ziggurat_normals(state, np.empty(5000)), ziggurat_normals(state, np.empty(5000))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, ziggurat_normals(os.urandom(24), np.empty(5000)))
    with pytest.raises(ValueError, match="24 bytes"):
        ziggurat_normals(b"short", np.empty(3))


@pytest.mark.parametrize("mode", ["secret", "reproducible"])
def test_moments_and_tail_rates_of_the_cpu_sampler(mode):
    """n = 2^22 normals (32 chunks). Mean, variance and excess kurtosis within 6 standard errors
    (1/√n, √(2/n), √(24/n): false alarm < 2e-9 each); the counts beyond r (the redrawn mass,
    P = 2.58e-4) and beyond 4.5 (P = 6.8e-6) within 6 Poisson standard deviations of their mean."""
    src = NoiseSource(mode, seed=17) if mode == "reproducible" else NoiseSource(mode)
    z = src.normal((1 << 22,), dtype=torch.float64).numpy()
    n = z.size
    assert abs(z.mean()) < 6 / math.sqrt(n)
    assert abs(z.var() - 1) < 6 * math.sqrt(2 / n)
    assert abs(stats.kurtosis(z)) < 6 * math.sqrt(24 / n)
    for cut in (ZIGGURAT_R, 4.5):
        lam = n * 2 * stats.norm.sf(cut)
        assert abs(int((np.abs(z) > cut).sum()) - lam) < 6 * math.sqrt(lam), cut
    assert np.abs(z).max() <= _TAIL_RADIUS


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_reproducible_values_do_not_depend_on_threads_or_streaming(threads):
    """Chunk i always gets the i-th SFC64 state: 1, 2 or 3 threads, early or streamed, give the same bits."""
    n = 3 * NORMAL_CHUNK + 11
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = NoiseSource("reproducible", seed=4).normal((n,), dtype=torch.float64)
        torch.set_num_threads(threads)
        got = NoiseSource("reproducible", seed=4).normal((n,), dtype=torch.float64)
        parts = []
        NoiseSource("reproducible", seed=4).start_normal(n, stream=True).consume(
            lambda lo, hi, z: parts.append((lo, z.clone()))
        )
    finally:
        torch.set_num_threads(old)
    assert torch.equal(want, got)
    assert torch.equal(torch.cat([z for _, z in sorted(parts, key=lambda p: p[0])]), want)


def test_secret_chunk_states_come_from_os_entropy_only(monkeypatch):
    """With os.urandom fixed, two secret sources draw the same normals (their chunk states come from
    os.urandom and nothing else); with the real one they differ."""
    n = 2 * NORMAL_CHUNK + 3
    fresh = (
        NoiseSource("secret").normal((n,), dtype=torch.float64),
        NoiseSource("secret").normal((n,), dtype=torch.float64),
    )
    assert not torch.equal(*fresh)
    monkeypatch.setattr(noise_mod.os, "urandom", lambda k: bytes((7 * i + 3) % 256 for i in range(k)))
    a = NoiseSource("secret").normal((n,), dtype=torch.float64)
    b = NoiseSource("secret").normal((n,), dtype=torch.float64)
    assert torch.equal(a, b)


def test_secure_words_without_the_aes_package_read_the_os(monkeypatch):
    """Secure mode's words: AES-256-CTR under a fresh key per call (two calls differ), or os.urandom
    itself when ``cryptography`` is absent; the normals are standard either way (KS, α = 1e-7: secure words
    cannot be seeded, so this is the per-run false-alarm rate; it was 1e-4 at α = 1e-4. Power: the critical
    distance on 100,000 draws is 0.0092; a std 5 % off is 0.012 away)."""
    assert not torch.equal(_secure_words(64), _secure_words(64))
    monkeypatch.setattr(noise_mod, "_aes_ctr", lambda: None)
    monkeypatch.setattr(noise_mod.os, "urandom", lambda k: b"\x5a" * k)
    assert torch.equal(_secure_words(3), torch.frombuffer(bytearray(b"\x5a" * 24), dtype=torch.int64))
    monkeypatch.undo()
    monkeypatch.setattr(noise_mod, "_aes_ctr", lambda: None)
    z = NoiseSource("secure").normal((100_000,), dtype=torch.float64)
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-7


def test_tail_values_are_finite_and_their_signs_are_fair():
    """Over 8 fixed SFC64 states × 2^20 normals (≈ 2,160 tail-branch values): every tail position is
    filled (finite, |z| ≥ r), every body value is the kernel's; the tail values keep the body's sign bit,
    whose count of positives is Binomial(m, 1/2): within 5 standard deviations (false alarm 6e-7; the
    states are fixed, so the outcome is too). A sampler that left a tail position unfilled or forced one
    sign fails at once."""
    m = pos = 0
    for k in range(8):
        state = bytes((37 * k + 11 * i + 1) % 256 for i in range(24))
        body, idx, _ = _body(state, 1 << 20)
        got = ziggurat_normals(state, np.empty(1 << 20))
        tail = np.zeros(got.size, dtype=bool)
        tail[idx] = True
        assert np.array_equal(got[~tail], body[~tail])
        assert np.all(np.isfinite(got)) and np.all(np.abs(got[tail]) >= ZIGGURAT_R)
        assert np.all(np.signbit(got[tail]) == np.signbit(body[tail]))
        m += int(tail.sum())
        pos += int((got[tail] > 0).sum())
    assert m > 1500  # P(|Z| ≥ r) · 2^23 = 2,165
    assert abs(pos - m / 2) < 5 * math.sqrt(m) / 2, (pos, m)
