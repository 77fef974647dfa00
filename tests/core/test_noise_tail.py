"""The Gaussian sampler keeps its tail (issue 19, "Noise with its tail").

White-box tests feed :func:`dpopt.noise.gaussian_from_words` its extreme words and check the
stated radius by hand; statistical tests state their false-alarm rate.
"""

import math

import pytest
import torch
from scipy import stats

import dpopt
from dpopt.engine.reference import PerSampleGrads
from dpopt.noise import _SLOT_WORDS, BLOCK_PAIRS, CUT_RADIUS, NORMAL_CHUNK, NoiseSource, _slots, gaussian_from_words
from dpopt.privatizer import Privatizer

LN2 = math.log(2.0)


def _words(a, b):
    return torch.tensor([a, b], dtype=torch.int64).view(2, -1)


def _slot_rows(rows):
    """``rows`` (lists of words, padded with zero words) as an int64 [M, _SLOT_WORDS] tensor."""
    return torch.tensor([list(r) + [0] * (_SLOT_WORDS - len(r)) for r in rows], dtype=torch.int64)


def test_cut_radius_is_the_smallest_normal_float64_and_beats_the_requirement():
    assert CUT_RADIUS == pytest.approx(math.sqrt(2 * 1022 * LN2), rel=1e-15)
    assert CUT_RADIUS == pytest.approx(37.6403, abs=1e-4)
    # the bound: r_max ≥ 11.5 + 1/σ for every σ ≥ 0.1 the library accepts
    assert CUT_RADIUS >= 11.5 + 1 / 0.1
    # P(Z > r_max − 1/σ) at σ = 0.1 (log of the Gaussian tail, Mills ratio bound)
    x = CUT_RADIUS - 10.0
    assert -x * x / 2 - math.log(x * math.sqrt(2 * math.pi)) < math.log(1e-160)


def test_all_zero_words_give_the_stated_radius():
    """The longest run of zero bits: u = 2^-1022, the angle 0 → z = (r_max, ~0)."""
    z = gaussian_from_words(_words([0], [0]), _slot_rows([[]]))
    assert float(z[0]) == pytest.approx(CUT_RADIUS, rel=1e-15)
    assert abs(float(z[1])) < 1e-12 * CUT_RADIUS


def test_all_one_words_give_the_smallest_radius():
    """u = 1 − 2^-53 (mantissa all ones, no leading zero): R = √(−2 ln(1 − 2^-53)) = 2^-26."""
    z = gaussian_from_words(_words([-1], [-1]), _slot_rows([[]]))
    r = math.hypot(float(z[0]), float(z[1]))
    assert r == pytest.approx(2.0**-26, rel=1e-6)


@pytest.mark.parametrize("zeros", [0, 5, 51])
def test_continued_stream_adds_its_leading_zeros(zeros):
    """Stage bits all zero (k = 12) and mantissa 1.0, so u = 2^-13; a continuation word with
    ``zeros`` leading zeros (of its 52 bits) makes u = 2^-(13+zeros): R² = 2(13 + zeros) ln 2."""
    z = gaussian_from_words(_words([0], [0]), _slot_rows([[1 << (51 - zeros)]]))
    assert float(z[0]) ** 2 == pytest.approx(2 * (13 + zeros) * LN2, rel=1e-13)


def test_stream_crosses_word_boundaries_and_stops_at_the_normal_range():
    z = gaussian_from_words(_words([0, 0], [0, 0]), _slot_rows([[0, 1 << 51], [0, 0, 1 << 48]]))
    assert float(z[0]) ** 2 == pytest.approx(2 * (13 + 52) * LN2, rel=1e-13)
    assert float(z[1]) ** 2 == pytest.approx(2 * (13 + 104 + 3) * LN2, rel=1e-13)
    # 20 zero words (1040 zero bits) stop at u = 2^-1022: the cut radius, never inf or nan
    z = gaussian_from_words(_words([0], [0]), _slot_rows([[0] * _SLOT_WORDS]))
    assert float(z[0]) == pytest.approx(CUT_RADIUS, rel=1e-15)


def test_first_stage_exponent_is_the_count_of_leading_zero_bits():
    """b's top 12 bits hold the first stage; j leading zeros and mantissa 1.0 give u = 2^-(j+1)."""
    for j in (0, 1, 7, 11):
        b = 1 << (63 - j)  # the sign bit counts as the first stage bit
        z = gaussian_from_words(_words([0], [b - (1 << 64) if b >= 1 << 63 else b]), _slot_rows([[]]))
        assert float(z[0]) ** 2 == pytest.approx(2 * (j + 1) * LN2, rel=1e-13), j


def test_more_flagged_pairs_than_slots_stay_at_the_first_stage():
    """The overflow case (probability ≤ 2^-140 per call with _slots rows): later pairs keep k = 12."""
    z = gaussian_from_words(_words([0, 0, 0], [0, 0, 0]), _slot_rows([[1 << 41]]))  # one row: 10 zeros
    r2 = (z[:3] ** 2 + z[3:] ** 2).tolist()
    assert r2[0] == pytest.approx(2 * (13 + 10) * LN2, rel=1e-13)
    assert r2[1] == pytest.approx(2 * 13 * LN2, rel=1e-13) and r2[2] == pytest.approx(2 * 13 * LN2, rel=1e-13)


@pytest.mark.parametrize("pairs", [1, 7, 1000, 500_000, 10**9])
def test_slot_count_bounds_the_overflow_probability(pairs):
    """Cross-check of the Chernoff choice with scipy's exact binomial tail: P(N > M) ≤ 2^-140."""
    m = _slots(pairs)
    if m >= pairs:
        assert m == pairs
        return
    assert stats.binom.logsf(m, pairs, 2.0**-12) <= -140 * LN2
    assert m <= pairs * 2.0**-12 * 1.1 + 400  # and not wastefully many


def test_continued_pairs_have_the_exponential_tail():
    """Every pair flagged (stage bits zero): −ln u − 12 ln 2 must be Exp(1) (memoryless), i.e.
    R²/2 − 12 ln 2 ~ Exp(1). KS test at α = 1e-4 (false alarm 1 in 10,000) on 100,000 pairs."""
    gen = torch.Generator().manual_seed(7)
    n = 100_000
    words = torch.empty(2, n, dtype=torch.int64).random_(-(2**63), None, generator=gen)
    words[1] &= (1 << 52) - 1  # clear the 12 stage bits of b
    slots = torch.empty(n, _SLOT_WORDS, dtype=torch.int64).random_(-(2**63), None, generator=gen)
    z = gaussian_from_words(words, slots)
    e = (z[:n] ** 2 + z[n:] ** 2) / 2 - 12 * LN2
    assert float(e.min()) > 0
    assert stats.kstest(e.numpy(), "expon").pvalue > 1e-4


@pytest.mark.parametrize("mode", ["secret", "secure", "reproducible"])
def test_every_mode_is_standard_normal(mode):
    """KS against N(0, 1) at α = 1e-7 on 400,000 draws (the chunked CPU path for secret and
    reproducible); the squared radius of each Box–Muller pair (cos half, sin half of each block)
    is χ²₂ (KS, α = 1e-7); the cos and sin halves are uncorrelated (|r| < 5.6/√n: false alarm 2.1e-8).
    Secret and secure draws are new every run, so each of those cases fails an honest sampler with
    probability ≈ 2.2e-7 per run. Power: the KS critical distance is ≤ 0.0065 (a std 5 % off is 0.012,
    a wrong radius law far more); a cos/sin pair sharing its angle correlates at 1."""
    src = NoiseSource(mode, seed=3) if mode == "reproducible" else NoiseSource(mode)
    n = 4 * NORMAL_CHUNK if mode != "secure" else 400_000
    z = src.normal((n,), dtype=torch.float64)
    assert z.dtype == torch.float64 and float(z.abs().max()) <= CUT_RADIUS
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-7
    blocks = z[: (n // (2 * BLOCK_PAIRS)) * 2 * BLOCK_PAIRS].view(-1, 2, BLOCK_PAIRS)
    r2 = (blocks**2).sum(dim=1).flatten()
    assert stats.kstest(r2.numpy(), "chi2", args=(2,)).pvalue > 1e-7
    c, s = blocks[:, 0].flatten(), blocks[:, 1].flatten()
    assert abs(float(torch.corrcoef(torch.stack([c, s]))[0, 1])) < 5.6 / math.sqrt(c.numel())


def test_float32_output_is_the_float64_draw_rounded_once():
    a = NoiseSource("reproducible", seed=9).normal((1001,), dtype=torch.float64)
    b = NoiseSource("reproducible", seed=9).normal((1001,), dtype=torch.float32)
    assert torch.equal(a.to(torch.float32), b)
    with pytest.raises(ValueError, match="floating-point dtype"):
        NoiseSource().normal((3,), dtype=torch.int64)


def test_odd_counts_and_empty_shapes():
    src = NoiseSource("reproducible", seed=1)
    assert src.normal((0,)).shape == (0,)
    one = src.normal((), dtype=torch.float64)
    assert one.shape == () and one.untyped_storage().nbytes() == 8  # the unused draw is not kept
    assert src.normal((3, 5)).shape == (3, 5)


def test_reproducible_mode_is_bit_reproducible_across_paths_and_threads():
    old = torch.get_num_threads()
    try:
        draws = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            src = NoiseSource("reproducible", seed=21)
            draws.append([src.normal((17,)), src.normal((3, NORMAL_CHUNK + 1), dtype=torch.float64)])
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(x, y) for x, y in zip(*draws))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_privatizer_adds_the_noise_in_float64_and_rounds_once(dtype):
    """Release = round_dtype(s + σC·z, computed in float64) / B̄ with z the source's float64 draw."""
    sums = torch.tensor([[0.3, -1.7, 2.5, 1e-3]], dtype=dtype)  # one example: its clipped sum is itself
    grads = PerSampleGrads([sums])
    sigma, clip, bbar = 0.7, 10.0, 4.0
    priv = Privatizer(sigma, clip, bbar, 0.1, noise=NoiseSource("reproducible", seed=5))
    rel = priv.privatize(grads).grads[0]
    z = NoiseSource("reproducible", seed=5).normal((4,), dtype=torch.float64)
    want = (sums[0].double() + z * (sigma * clip)).to(dtype).div_(bbar)
    assert rel.dtype == dtype and torch.equal(rel, want)


def _tail_pairs_beyond(src: NoiseSource, pairs: int, r2_min: float, chunk: int = 1 << 24) -> int:
    """Count the Box–Muller pairs (cos half, sin half of each output block) with R² > r2_min."""
    count, done = 0, 0
    while done < pairs:
        n = min(chunk, 2 * (pairs - done))
        n -= n % (2 * BLOCK_PAIRS)
        z = src.normal((n,), dtype=torch.float64).view(-1, 2, BLOCK_PAIRS)
        count += int(((z * z).sum(dim=1) > r2_min).sum())
        done += n // 2
    return count


@pytest.mark.slow
def test_tail_beyond_the_old_cut_at_the_gaussian_rate():
    """Squared radius beyond 33.28 = −2 ln 6e-8 (|z| of torch's float32 sampler never exceeds
    5.768, R² ≤ 33.27): a true Gaussian pair lands there with probability 6e-8. Over 2.6e8 pairs the
    count is Poisson(15.6); two-sided test at α = 1e-6 (false alarm 1 in 10^6). A sampler cut below
    the threshold gives 0, which the test rejects (P(0) = 1.7e-7 < α/2)."""
    pairs = 2 * 2**27 - (2 * 2**27) % BLOCK_PAIRS  # 2.68e8 pairs, whole blocks
    p = math.exp(-33.28 / 2)
    lam = pairs * p
    lo, hi = stats.poisson.ppf(0.5e-6, lam), stats.poisson.isf(0.5e-6, lam)
    assert lo >= 1  # the test has power against a cut sampler
    count = _tail_pairs_beyond(NoiseSource("secret"), pairs, 33.28)
    assert lo <= count <= hi, (count, lam)


# -- the σ the sampler's tail can serve (an output beyond r_max is impossible without the example) ----------


def test_the_smallest_served_sigma_keeps_the_truncation_below_1e_30():
    """At σ = MIN_NOISE_MULTIPLIER the reach is exactly 11.5 std beyond the shift 1/σ: δ per inclusion
    is P(Z > 11.5) = 6.4e-31 (scipy); at σ = 0.01 the shift (100 std) is beyond r_max (37.6), so the
    supports of the two neighbours' outputs are disjoint and δ would be 1."""
    from dpopt.noise import _TAIL_RADIUS, MIN_NOISE_MULTIPLIER

    r_max = min(_TAIL_RADIUS, CUT_RADIUS)
    assert MIN_NOISE_MULTIPLIER == pytest.approx(1 / (r_max - 11.5), rel=1e-15)
    assert MIN_NOISE_MULTIPLIER == pytest.approx(0.03827, abs=1e-5)
    assert stats.norm.sf(r_max - 1 / MIN_NOISE_MULTIPLIER) < 1e-30
    assert r_max - 1 / 0.01 < 0


@pytest.mark.parametrize("sigma", [0.03, 1e-3])
def test_a_sigma_the_tail_cannot_serve_is_refused_not_truncated(sigma):
    """σ below MIN_NOISE_MULTIPLIER (0.0383) used to be accepted and its noise silently truncated at
    37.63: the refusal names noise_multiplier and the bound. σ = 0 (non-private) and σ ≥ the bound pass."""
    from dpopt.errors import ConfigError
    from dpopt.noise import MIN_NOISE_MULTIPLIER

    with pytest.raises(ConfigError, match=r"noise_multiplier .*below 0\.0383") as err:
        Privatizer(sigma, 1.0, 4.0, 0.1)
    assert err.value.arguments == ("noise_multiplier",)
    for ok in (0.0, MIN_NOISE_MULTIPLIER, 0.04):
        rel = Privatizer(ok, 1.0, 4.0, 0.1).privatize(PerSampleGrads([torch.zeros(1, 3)]))
        assert rel.grads[0].shape == (3,)


def test_a_sigma_lowered_after_construction_is_refused_before_any_draw():
    """The settable σ (schedulers, DPTrainer's recalibration): the release refuses before it draws or
    records; the optimizer's setter refuses at once."""
    from dpopt.errors import ConfigError

    priv = Privatizer(1.0, 1.0, 4.0, 0.1)
    priv.noise_multiplier = 0.02
    calls = []
    real = priv.noise.start_normal
    priv.noise.start_normal = lambda *a, **k: calls.append(a) or real(*a, **k)  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match="below 0.0383"):
        priv.privatize(PerSampleGrads([torch.zeros(1, 3)]))
    assert calls == [] and len(priv.ledger) == 0
    model = torch.nn.Linear(3, 2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.zeros(8, dtype=torch.long))
    _, opt, _ = dpopt.PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    with pytest.raises(ConfigError, match="below 0.0383"):
        opt.noise_multiplier = 0.02
    assert opt.noise_multiplier == 1.0
    opt.noise_multiplier = 0.5  # the setter still works
    assert opt.privatizer.noise_multiplier == 0.5


def test_count_noise_and_correlated_noise_are_held_to_the_same_reach():
    """The count's σ_b/0.5 (quantile clipping) and correlated noise's σ/Δ (the Gaussian mechanism on C·x has
    sensitivity Δ·C) are the multipliers the tail serves."""
    from dpopt.correlated_noise import CorrelatedNoise, Participation, optimize_strategy
    from dpopt.errors import ConfigError
    from dpopt.privatizer import QuantileClipping

    with pytest.raises(ConfigError, match="count_noise_multiplier"):
        Privatizer(1.0, 1.0, 4.0, 0.1, quantile=QuantileClipping(0.03))
    mech = CorrelatedNoise(optimize_strategy("banded", 8, 2), Participation(8, 4, 2), 0.06)
    assert mech.sensitivity > 0.06 / 0.0383  # σ/Δ below the bound although σ is above it
    with pytest.raises(ConfigError, match="sensitivity"):
        Privatizer(0.06, 1.0, 4.0, 1.0, mechanism=mech)
