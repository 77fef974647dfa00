"""Empirical auditing: the ε lower bounds, the one-step audits of the real privatizers, the CLI.

Error rates: audits use α = 1e-3 unless stated (an honest mechanism shows LEAK
with probability ≤ 1e-3); every test is seeded, so each is deterministic and
the stated rate is the chance that a given seed would have failed.
"""

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

from dpopt import auditing as A
from dpopt.accounting.accountant import epsilon
from dpopt.accounting.events import gaussian_event

DELTA = 1e-5
TRUE_EPS_SIGMA1 = epsilon(gaussian_event(1.0), DELTA)  # PLD: 4.3772 (one Gaussian step, σ = 1, no sampling)


# --------------------------------------------------------------------------- closed forms
def test_gaussian_epsilon_matches_accountant():
    # The analytic μ-GDP conversion and dp_accounting's PLD agree on the plain Gaussian.
    assert TRUE_EPS_SIGMA1 == pytest.approx(4.377, abs=2e-3)
    for sigma in (0.5, 1.0, 2.0, 5.0):
        eps = A.gdp_epsilon(1.0 / sigma, DELTA)
        assert eps == pytest.approx(epsilon(gaussian_event(sigma), DELTA), rel=2e-3, abs=1e-3)
        # and it inverts gdp_delta
        assert A.gdp_delta(1.0 / sigma, eps) == pytest.approx(DELTA, rel=1e-6)


def test_gdp_edge_cases():
    assert A.gdp_epsilon(0.0, DELTA) == 0.0
    assert A.gdp_epsilon(math.inf, DELTA) == math.inf
    # δ(0) = 2Φ(μ/2) − 1 ≤ δ  ⇒  ε = 0
    assert A.gdp_epsilon(1e-6, DELTA) == 0.0
    assert A.gdp_epsilon(30.0, DELTA) > 400  # ≈ μ²/2 + ...; no overflow
    with pytest.raises(ValueError, match="mu must be >= 0"):
        A.gdp_epsilon(-1.0, DELTA)
    with pytest.raises(ValueError, match="delta must be in"):
        A.gdp_epsilon(1.0, 0.0)


def test_clopper_pearson_upper_is_the_exact_binomial_bound():
    for k, n in [(0, 100), (3, 100), (50, 100), (999, 1000)]:
        p = A.clopper_pearson_upper(k, n, 1e-3)
        assert stats.binom.cdf(k, n, p) == pytest.approx(1e-3, rel=1e-6)
    assert A.clopper_pearson_upper(0, 1000, 0.05) == pytest.approx(1 - 0.05 ** (1 / 1000))
    assert A.clopper_pearson_upper(7, 7, 0.05) == 1.0
    arr = A.clopper_pearson_upper(np.array([0, 1, 2]), 10, 0.1)
    assert arr.shape == (3,) and np.all(np.diff(arr) > 0)
    with pytest.raises(ValueError, match="0 <= successes <= trials"):
        A.clopper_pearson_upper(11, 10, 0.1)
    with pytest.raises(ValueError, match="alpha must be in"):
        A.clopper_pearson_upper(1, 10, 1.5)


def test_direct_and_gdp_formulas():
    # ln((1 − δ − FNR)/FPR) and the swapped direction
    assert A.epsilon_from_error_rates(0.01, 0.5, 0.0 + 1e-9) == pytest.approx(math.log(0.5 / 0.01), rel=1e-6)
    assert A.epsilon_from_error_rates(0.5, 0.01, 1e-9) == pytest.approx(math.log(0.5 / 0.01), rel=1e-6)
    assert A.epsilon_from_error_rates(0.6, 0.6, 1e-5) == 0.0  # worse than guessing: no evidence
    # μ = Φ⁻¹(1 − FPR) − Φ⁻¹(FNR): the point (Φ(−μ/2), Φ(−μ/2)) lies on G_μ
    mu = 1.3
    r = stats.norm.cdf(-mu / 2)
    assert A.gdp_mu_from_error_rates(r, r) == pytest.approx(mu)
    assert A.gdp_mu_from_error_rates(0.7, 0.7) == 0.0
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        A.epsilon_from_error_rates(-0.1, 0.5, DELTA)


# --------------------------------------------------------------------------- bounds from scores
def test_input_validation():
    good = np.zeros(100)
    with pytest.raises(ValueError, match="1-D"):
        A.epsilon_lower_bounds(np.zeros((10, 10)), good)
    with pytest.raises(ValueError, match="at least 10"):
        A.epsilon_lower_bounds(np.zeros(5), good)
    with pytest.raises(ValueError, match="NaN or inf"):
        A.epsilon_lower_bounds(np.r_[good[:-1], np.nan], good)
    with pytest.raises(ValueError, match="delta must be in"):
        A.epsilon_lower_bounds(good, good, delta=1.0)
    with pytest.raises(ValueError, match="alpha must be in"):
        A.epsilon_lower_bounds(good, good, alpha=0.0)
    with pytest.raises(ValueError, match="selection_fraction"):
        A.epsilon_lower_bounds(good, good, selection_fraction=1.0)
    with pytest.raises(ValueError, match="thresholds"):
        A.epsilon_lower_bounds(good, good, thresholds=[])


def test_gdp_bound_on_plain_gaussian_within_10_percent():
    """σ = 1, sensitivity 1, no sampling, 10⁵ trials (5·10⁴ per arm): GDP-route lower bound
    in [0.9, 1.0] × 4.377. Upper side: fails with probability ≤ α = 1e-3 (soundness).
    Lower side: over 400 seeds the bound had mean 4.135, sd 0.048, minimum 3.98, so falling
    below 0.9·4.377 = 3.94 is a ≈ 4-sd event."""
    rng = np.random.default_rng(2024)
    n = 50_000
    b = A.epsilon_lower_bounds(rng.normal(1.0, 1.0, n), rng.normal(0.0, 1.0, n), DELTA, 1e-3)
    assert 0.9 * TRUE_EPS_SIGMA1 <= b.gdp <= TRUE_EPS_SIGMA1
    assert b.mu <= 1.0
    # the direct route is sound but loose at δ = 1e-5 (ALGORITHMS.md): well below, well above 0
    assert 1.5 < b.direct < b.gdp
    assert b.selection == "holdout" and b.n_eval_in == 40_000


def test_identical_distributions_give_no_evidence():
    rng = np.random.default_rng(1)
    b = A.epsilon_lower_bounds(rng.normal(size=20_000), rng.normal(size=20_000), DELTA, 1e-3)
    # with no difference, the bounds hold with prob ≥ 1 − α: ε = 0 is the truth
    assert b.direct == 0.0 and b.gdp == 0.0 and b.mu == 0.0


def test_perfect_separation_is_limited_by_the_trial_count():
    n = 10_000
    b = A.epsilon_lower_bounds(np.full(n, 5.0) + np.arange(n) * 1e-9, np.arange(n) * 1e-9, DELTA, 1e-3)
    # zero errors on 8000 evaluation trials per arm: FPR̄ = FNR̄ = 1 − (α/4)^(1/8000)
    p = 1 - (1e-3 / 4) ** (1 / 8000)
    assert b.direct == pytest.approx(math.log((1 - DELTA - p) / p), rel=1e-9)
    assert b.mu == pytest.approx(2 * stats.norm.isf(p), rel=1e-9)


def test_fixed_thresholds_use_bonferroni_over_all_tests():
    rng = np.random.default_rng(3)
    s_in, s_out = rng.normal(1.0, 1.0, 20_000), rng.normal(0.0, 1.0, 20_000)
    b1 = A.epsilon_lower_bounds(s_in, s_out, DELTA, 1e-3, thresholds=[0.5])
    b50 = A.epsilon_lower_bounds(s_in, s_out, DELTA, 1e-3, thresholds=np.linspace(-3, 4, 50))
    assert b1.selection == "bonferroni" and b1.tests == 2 and b50.tests == 100
    assert b1.n_eval_in == 20_000
    # same best test (τ = 0.5 is on the grid-ish), but 50× the correction: smaller μ
    assert b1.gdp_test[0] == "upper" and b1.gdp_test[1] == 0.5
    assert 0.85 < b50.mu < b1.mu <= 1.0


def test_bounds_are_sound_at_the_stated_rate():
    """300 small audits of a Gaussian with μ = 1 at α = 0.1: the number of runs where either bound
    exceeds the truth is ≤ Binomial(300, 0.1)'s 1 − 1e-3 quantile (false alarm of this test 1e-3)."""
    rng = np.random.default_rng(7)
    true_eps, violations = TRUE_EPS_SIGMA1, 0
    for seed in range(300):
        b = A.epsilon_lower_bounds(
            rng.normal(1.0, 1.0, 1500), rng.normal(0.0, 1.0, 1500), DELTA, 0.1, seed=seed, max_thresholds=256
        )
        violations += (b.gdp > true_eps) or (b.direct > true_eps) or (b.mu > 1.0)
    assert violations <= stats.binom.ppf(1 - 1e-3, 300, 0.1)
    # and the bounds are not vacuous: the GDP route sees most of μ at this size
    assert b.mu > 0.5


def test_small_trial_counts_fall_back_to_a_looser_gdp_ranking():
    """Issue 15, item 7a. 1,000 scores per arm from N(1, 1) vs N(0, 1), δ = 1e-5, α = 1e-3: ranked at
    (α/4)² on 200 selection trials per arm, every candidate scored μ = 0 and argmax took the first
    threshold (τ = −2.28): μ = 0 and GDP ε = 0 while the direct bound was 1.009. All-tied candidates
    now fall back to the ranking at α/4: μ = 0.597, GDP ε = 2.43 (truth: μ = 1, ε = 4.377)."""
    rng = np.random.default_rng(0)
    b = A.epsilon_lower_bounds(rng.normal(1.0, 1.0, 1000), rng.normal(0.0, 1.0, 1000), DELTA, 1e-3)
    assert b.gdp_rank_level == pytest.approx(1e-3 / 4) and b.direct_rank_level == pytest.approx(1e-3 / 4)
    assert b.direct == pytest.approx(1.009, abs=1e-3)
    assert b.mu == pytest.approx(0.597, abs=1e-3) and b.gdp == pytest.approx(2.430, abs=1e-3)
    assert b.mu <= 1.0 and b.gdp > b.direct
    # with enough trials the strict ranking is kept (the 10⁵-trial behaviour is unchanged)
    b = A.epsilon_lower_bounds(rng.normal(1.0, 1.0, 20_000), rng.normal(0.0, 1.0, 20_000), DELTA, 1e-3)
    assert b.gdp_rank_level == pytest.approx((1e-3 / 4) ** 2)


def test_fallback_ranking_keeps_the_false_alarm_rate():
    """150 scores per arm at α = 0.1, where the (α/4)² ranking ties at 0 in most runs (254 of 300
    measured), so the fallback chooses the test. 300 runs with μ = 1 (violation: a bound above the
    truth) and 300 with identical arms (violation: any bound > 0): each count ≤ Binomial(300, 0.1)'s
    1 − 1e-3 quantile, 47 (false alarm of this test ≤ 2e-3). Measured: 0 and 0. Power: mean μ 0.465,
    μ = 0 in 11 runs (before the fallback: 0.089, μ = 0 in 226 runs)."""
    rng = np.random.default_rng(11)
    violations = null_violations = fallbacks = 0
    mus = []
    for seed in range(300):
        b = A.epsilon_lower_bounds(rng.normal(1.0, 1.0, 150), rng.normal(0.0, 1.0, 150), DELTA, 0.1, seed=seed)
        violations += (b.gdp > TRUE_EPS_SIGMA1) or (b.direct > TRUE_EPS_SIGMA1) or (b.mu > 1.0)
        fallbacks += b.gdp_rank_level != pytest.approx(0.025**2)
        mus.append(b.mu)
        b0 = A.epsilon_lower_bounds(rng.normal(size=150), rng.normal(size=150), DELTA, 0.1, seed=seed)
        null_violations += (b0.direct > 0) or (b0.mu > 0)
    limit = stats.binom.ppf(1 - 1e-3, 300, 0.1)
    assert violations <= limit and null_violations <= limit
    assert fallbacks > 150
    assert np.mean(mus) > 0.35  # measured 0.465; before: 0.089


def test_max_thresholds_below_128():
    """Issue 15, item 7b. ``max_thresholds=100`` raised numpy's "Number of samples, -28, must be
    non-negative" (64 extreme candidates at each end = 128 > 100). The extreme set is now sized from
    it (min(64, ⌊m/4⌋) per end), and a non-positive or fractional value is a clear ValueError."""
    from dpopt.auditing.stats import _candidate_thresholds

    rng = np.random.default_rng(0)
    s_in, s_out = rng.normal(1.0, 1.0, 1000), rng.normal(0.0, 1.0, 1000)
    b = A.epsilon_lower_bounds(s_in, s_out, DELTA, 1e-3, max_thresholds=100)
    assert b.direct == pytest.approx(0.928, abs=1e-3) and b.mu == pytest.approx(0.618, abs=1e-3)
    pooled = np.sort(np.concatenate([s_in, s_out]))
    mids = 0.5 * (pooled[:-1] + pooled[1:])
    for m in (1, 2, 3, 10, 100, 127, 128, 255, 256, 1000, 100_000):
        taus = _candidate_thresholds(pooled, m)
        assert 1 <= taus.size <= m and np.all(np.isin(taus, mids))
        if m >= 2:  # both extremes are always candidates
            assert taus[0] == mids[0] and taus[-1] == mids[-1]
        if m >= 256:  # as before: the 64 most extreme midpoints at each end
            assert np.all(np.isin(mids[:64], taus)) and np.all(np.isin(mids[-64:], taus))
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match="max_thresholds must be a positive integer"):
            A.epsilon_lower_bounds(s_in, s_out, DELTA, 1e-3, max_thresholds=bad)


# --------------------------------------------------------------------------- package layout
OLD_PUBLIC_API = [
    "clopper_pearson_upper",
    "gdp_delta",
    "gdp_epsilon",
    "epsilon_from_error_rates",
    "gdp_mu_from_error_rates",
    "EpsilonLowerBounds",
    "epsilon_lower_bounds",
    "AuditResult",
    "claimed_one_step",
    "canary_scores",
    "audit_privatizer",
    "BUILTIN_MECHANISMS",
    "audit_mechanism",
    "registered_methods",
    "audit_method",
    "audit_all",
    "mechanism_seed",
]


def test_stats_module_imports_no_torch():
    """The statistics (stats, one_run_stats: the package's eager part) import neither torch nor other dpopt modules."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import dpopt.auditing.stats\n"
        "from dpopt.auditing import epsilon_lower_bounds, gdp_epsilon, EpsilonLowerBounds\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or "
        "(m.startswith('dpopt.') and m not in ('dpopt.auditing', 'dpopt.auditing.stats', 'dpopt.auditing.one_run_stats')))\n"
        "assert not bad, bad\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_public_api_is_reexported_from_the_package():
    from dpopt.auditing import harness, suite
    from dpopt.auditing import stats as st

    assert sorted(set(OLD_PUBLIC_API) - set(A.__all__)) == []
    for name in A.__all__:
        assert getattr(A, name) is not None, name
    assert A.epsilon_lower_bounds is st.epsilon_lower_bounds
    assert A.audit_privatizer is harness.audit_privatizer and A.canary_scores is harness.canary_scores
    assert A.audit_all is suite.audit_all and A.BUILTIN_MECHANISMS == (
        "flat",
        "shift-scale",
        "per-layer",
        "quantile",
        "auto",
    )
    with pytest.raises(AttributeError):
        A.no_such_name  # noqa: B018


# --------------------------------------------------------------------------- the real privatizers
def test_vectorised_trials_equal_one_release_per_trial():
    """σ = 0 makes every release deterministic: the block-embedded releases (many trials in one
    Privatizer call) must give exactly the scores of one Privatizer call per trial, in a shift/scale
    geometry and with per-group bounds (clipping is global per example, per group)."""

    from dpopt.privatizer import Privatizer
    from dpopt.transforms.base import ClipGeometry

    g = torch.Generator().manual_seed(0)
    shapes = [(2, 2), (3,), (2,)]
    geo = ClipGeometry(
        tuple(torch.randn(s, generator=g, dtype=torch.float64) for s in shapes),
        tuple(0.1 + torch.rand(s, generator=g, dtype=torch.float64) for s in shapes),
    )
    make = lambda: Privatizer(0.0, [1.0, 2.0, 0.5], 4.0, 1.0, groups=[0, 1, 2])  # noqa: E731
    vin, vout, vmode = A.canary_scores(make, shapes, 70, 50, geometry=geo, chunk=32)
    lin, lout, lmode = A.canary_scores(make, shapes, 70, 50, geometry=geo, vectorize=False)
    assert (vmode, lmode) == ("vectorised", "loop")
    np.testing.assert_allclose(vin, lin, rtol=0, atol=1e-12)
    np.testing.assert_allclose(vout, lout, rtol=0, atol=1e-12)
    # the canary moves the normalised score by exactly 1 (it is clipped to C_k in every group)
    np.testing.assert_allclose(vin - vout[0], 1.0, atol=1e-12)


def test_canary_score_noise_is_the_configured_sigma():
    """Honest flat privatizer, σ = 1.5: score std = σ in both modes (scores are in units of the
    sensitivity). Chi-square two-sided at 1e-4 per check (4 checks). The noise is seeded (``generator=``):
    with the secret default every run was a new draw and the four checks failed an honest privatizer in
    about 4 runs in 10,000; now the stated rate is the chance that this seed would have failed."""
    from dpopt.privatizer import Privatizer

    gen = torch.Generator().manual_seed(11)
    make = lambda: Privatizer(1.5, 2.0, 8.0, 1.0, generator=gen)  # noqa: E731
    for vec, n in ((True, 20_000), (False, 3_000)):
        s_in, s_out, _ = A.canary_scores(make, [(3,), (2,)], n, n, vectorize=vec, seed=5)
        for s in (s_in, s_out):
            stat = (len(s) - 1) * np.var(s, ddof=1) / 1.5**2
            lo, hi = stats.chi2.ppf([5e-5, 1 - 5e-5], len(s) - 1)
            assert lo < stat < hi
        assert np.mean(s_in) - np.mean(s_out) == pytest.approx(1.0, abs=4.5 * 1.5 * math.sqrt(2 / n))


def test_harness_validation():
    from dpopt.privatizer import Privatizer, QuantileClipping

    with pytest.raises(ValueError, match="sample_rate=1.0"):
        A.audit_privatizer(lambda: Privatizer(1.0, 1.0, 8.0, 0.5), [(2,)], trials=100)
    with pytest.raises(ValueError, match="vectorize=True"):
        A.canary_scores(
            lambda: Privatizer(1.0, 1.0, 8.0, 1.0, quantile=QuantileClipping(2.0)), [(2,)], 5, 5, vectorize=True
        )
    with pytest.raises(ValueError, match="canary_factor"):
        A.canary_scores(lambda: Privatizer(1.0, 1.0, 8.0, 1.0), [(2,)], 5, 5, canary_factor=0.5)
    with pytest.raises(ValueError, match="trials must be >= 40"):
        A.audit_privatizer(lambda: Privatizer(1.0, 1.0, 8.0, 1.0), [(2,)], trials=10)
    with pytest.raises(ValueError, match="unknown built-in mechanism"):
        A.audit_mechanism("nope", trials=100)


def test_harness_config_and_named_results():
    """The harness is configured by one frozen dataclass and returns named tuples (which still unpack)."""
    from dpopt.privatizer import Privatizer

    with pytest.raises(ValueError, match="chunk must be >= 1"):
        A.HarnessConfig(chunk=0)
    with pytest.raises(ValueError, match="canary_factor"):
        A.HarnessConfig(canary_factor=0.5)
    make = lambda: Privatizer(0.0, 1.0, 4.0, 1.0)  # noqa: E731 - σ = 0: deterministic scores
    harness = A.CanaryHarness(make, [(3,), (2,)], A.HarnessConfig(chunk=8, seed=4))
    assert harness.mode == "vectorised" and harness.weights.count == 0.0
    res = harness.scores(10, 12)
    assert isinstance(res, A.CanaryScores) and res.mode == "vectorised"
    assert res.scores_in.shape == (10,) and res.scores_out.shape == (12,)
    np.testing.assert_allclose(res.scores_in - res.scores_out[0], 1.0, atol=1e-12)
    same = A.canary_scores(make, [(3,), (2,)], 10, 12, chunk=8, seed=4)
    np.testing.assert_array_equal(same.scores_in, res.scores_in)
    claim = A.claimed_one_step(Privatizer(1.0, 1.0, 8.0, 1.0), DELTA)
    assert isinstance(claim, A.ClaimedStep) and claim.mu == 1.0 and claim.epsilon == pytest.approx(TRUE_EPS_SIGMA1)
    b = A.epsilon_lower_bounds(np.arange(20.0) + 100, np.arange(20.0), DELTA, 0.1)
    assert isinstance(b.gdp_test, A.ThresholdTest) and b.gdp_test.tail == "upper"
    assert list(b.gdp_test) == [b.gdp_test.tail, b.gdp_test.threshold, b.gdp_test.fpr_ub, b.gdp_test.fnr_ub]


def test_claimed_one_step():
    from dpopt.privatizer import Privatizer, QuantileClipping

    eps, mu = A.claimed_one_step(Privatizer(1.0, 1.0, 8.0, 1.0), DELTA)
    assert eps == pytest.approx(TRUE_EPS_SIGMA1) and mu == 1.0
    # quantile: two Gaussians on the same batch → σ_eff = (1.2⁻² + 2⁻²)^(−1/2)
    eps, mu = A.claimed_one_step(Privatizer(1.2, 1.0, 8.0, 1.0, quantile=QuantileClipping(2.0)), DELTA)
    assert mu == pytest.approx(math.sqrt(1.2**-2 + 2.0**-2))
    assert eps == pytest.approx(A.gdp_epsilon(mu, DELTA), rel=2e-3)
    # sampled: no Gaussian trade-off claim, the GDP route is informational only
    assert A.claimed_one_step(Privatizer(1.0, 1.0, 8.0, 0.1), DELTA)[1] is None


def test_plain_gaussian_privatizer_gdp_bound_within_10_percent():
    """The real Privatizer (flat C = 1, σ = 1, q = 1), 10⁵ trials: PASS (false alarm ≤ 1e-3) and the
    GDP-route bound within 10 % of the true 4.377 (mean ≈ 4.13, sd ≈ 0.05: failing is a ≈ 4-sd event)."""
    r = A.audit_mechanism("flat", trials=100_000, delta=DELTA, alpha=1e-3, seed=A.mechanism_seed(0, "flat"))
    assert r.verdict == "PASS" and r.mode == "vectorised"
    assert r.claimed_epsilon == pytest.approx(TRUE_EPS_SIGMA1)
    assert 0.9 * TRUE_EPS_SIGMA1 <= r.epsilon_gdp <= r.claimed_epsilon


@pytest.mark.parametrize(
    "name,trials", [("shift-scale", 40_000), ("per-layer", 40_000), ("quantile", 10_000), ("auto", 10_000)]
)
def test_every_builtin_mechanism_passes_and_the_audit_has_power(name, trials):
    """Each built-in privatizer passes (false alarm ≤ 1e-3) and the GDP bound reaches ≥ 75 % of the
    claim (so a leak of more than a third of ε would be flagged). With 10⁴ loop-mode trials the
    quantile bound's expected ratio is ≈ 0.85 with sd ≈ 0.03: < 0.75 is a > 3-sd event."""
    r = A.audit_mechanism(name, trials=trials, seed=A.mechanism_seed(0, name))
    assert r.verdict == "PASS", r
    assert r.claimed_mu is not None
    assert 0.75 * r.claimed_epsilon <= r.epsilon_gdp <= r.claimed_epsilon
    assert r.mu_lower <= r.claimed_mu
    # the score's canary shift is the full sensitivity, in every geometry
    shift = r.details["score_mean_in"] - r.details["score_mean_out"]
    assert shift == pytest.approx(1.0, abs=5 * r.details["score_std_out"] * math.sqrt(4 / trials))


def test_every_registered_method_passes():
    """Generic method-level audit: every method in dpopt.methods, 12 000 trials each, α = 1e-3 per
    method. Power: the GDP bound's ratio to the claim measured over 104 audits (8 seeds × 13 methods)
    at this size: mean 0.844, sd 0.035, min 0.766, so < 0.6 is a 7-sd event. (At 6000 trials the
    mean was 0.78 with a heavier lower tail — 2 of 893 audits below 0.65 — and one CI run drew
    0.59.) Each method's noise is seeded (``generator=``, passed on to ``make_optimizer``): with the secret
    default every run was a new draw, so the 13 audits' PASS (α = 1e-3 each, ≤ 1.3 % per run in all) and
    power checks were judged on fresh noise every CI run; now the stated rates are the chance that these
    seeds would have failed, and the test is deterministic."""
    from dpopt import methods  # dpopt's own registry: an import error fails the test (never a skip)

    names = [spec.name for spec in methods.list_methods()]
    assert names, "the registry is empty"
    for name in names:
        seed = A.mechanism_seed(0, name)
        gen = torch.Generator().manual_seed(seed)
        r = A.audit_method(name, trials=12_000, seed=seed, generator=gen)
        assert r.verdict == "PASS", r
        assert 0.6 * r.claimed_epsilon <= r.epsilon_gdp <= r.claimed_epsilon, r


def test_method_audit_uses_the_methods_feedback_geometry():
    """DP-MacAdam clips in its own shift/scale geometry; after the warm-up steps it is not identity,
    and the audit still sees the full sensitivity (score shift 1)."""
    from dpopt import methods  # dpopt's own registry: an import error fails the test (never a skip)

    names = {spec.name: spec for spec in methods.list_methods()}
    assert "dp-macadam" in names  # a built-in method (a skip here would hide its removal)
    from dpopt.auditing.suite import _method_params

    params = _method_params(torch.float64)
    # A seeded noise generator: the warm-up's geometry is then one fixed draw. With the secret noise,
    # about 1.5 % of runs (3 of 200 measured) clamp every coordinate's scale to the floor and the
    # non-identity check below failed at random.
    opt = methods.make_optimizer(
        "dp-macadam",
        params,
        noise_multiplier=1.0,
        expected_batch_size=8.0,
        sample_rate=1.0,
        generator=torch.Generator().manual_seed(3),
    )
    from dpopt.engine.reference import PerSampleGrads

    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        opt.step(PerSampleGrads([0.5 + torch.randn(6, *p.shape, generator=g, dtype=p.dtype) for p in params]))
    geo = opt.geometry()
    assert geo.scale is not None and not all(torch.allclose(s, s.flatten()[0]) for s in geo.scale)
    # the audit's own optimizer seeded too (its PASS, α = 1e-3, was judged on fresh secret noise every run)
    r = A.audit_method("dp-macadam", trials=4_000, seed=1, generator=torch.Generator().manual_seed(4))
    assert r.verdict == "PASS"
    assert r.details["score_mean_in"] - r.details["score_mean_out"] == pytest.approx(1.0, abs=0.15)


# --------------------------------------------------------------------------- CLI
def _cli():
    from typer.testing import CliRunner

    from dpopt.cli import app

    return CliRunner(), app


def test_cli_audit_json_pass():
    runner, app = _cli()
    res = runner.invoke(app, ["audit", "--method", "per-layer", "--trials", "20000", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["false_alarm_rate_per_mechanism"] == 1e-3 and doc["leaks"] == []
    (row,) = doc["results"]
    assert row["name"] == "per-layer" and row["verdict"] == "PASS"
    assert row["epsilon_gdp"] <= row["claimed_epsilon"]


def test_cli_audit_table_and_leak_exit_code(monkeypatch, leaky):
    """A LEAK makes the command exit 1: swap the built-in 'flat' for defect 3 (noise sized to the
    smallest of bounds 1, 2, 2)."""
    from dpopt.auditing import suite

    runner, app = _cli()
    res = runner.invoke(app, ["audit", "--method", "flat", "--trials", "4000"])
    assert res.exit_code == 0, res.output
    assert "α = 0.001 per mechanism" in res.output and "PASS" in res.output

    def leaky_spec(name, seed):
        gen = torch.Generator().manual_seed(seed)  # seeded, as the built-in specs are
        return (
            (
                lambda: leaky.SmallestBoundNoisePrivatizer(
                    1.0, [1.0, 2.0, 2.0], 8.0, 1.0, groups=[0, 1, 2], generator=gen
                )
            ),
            [(2,), (2,), (2,)],
            None,
        )

    monkeypatch.setattr(suite, "_builtin_spec", leaky_spec)
    res = runner.invoke(app, ["audit", "--method", "flat", "--trials", "4000"])
    assert res.exit_code == 1, res.output
    assert "LEAK" in res.output and "1 LEAK" in res.output


def test_cli_audit_rejects_bad_arguments():
    runner, app = _cli()
    res = runner.invoke(app, ["audit", "--method", "flat", "--all"])
    assert res.exit_code == 2 and "not both" in res.output
    res = runner.invoke(app, ["audit", "--method", "no-such-thing", "--trials", "100"])
    assert res.exit_code == 2 and "unknown mechanism" in res.output
    res = runner.invoke(app, ["audit", "--delta", "2", "--trials", "100"])
    assert res.exit_code == 2


def test_cli_audit_table_columns_align_with_long_method_names(monkeypatch):
    """`dpopt audit --all`'s table: every column ends where its header ends, for a short name, the longest
    registered method name (doppler-muon-bc, 15 characters: one past the old fixed width of 14, which shifted its
    row right by one) and a longer one. The audits are stubbed (the table is under test, not the audits)."""
    from types import SimpleNamespace

    from dpopt.cli import audit as audit_cli

    names = ["flat", "doppler-muon-bc", "a-much-longer-method-name"]
    rows = [
        SimpleNamespace(
            name=n,
            claimed_epsilon=4.377,
            epsilon_direct=0.943,
            epsilon_gdp=2.566,
            mu_lower=0.626,
            claimed_mu=1.0,
            mode="vectorised",
            seconds=0.3,
            verdict="PASS",
        )
        for n in names
    ]
    monkeypatch.setattr(audit_cli, "_run_audits", lambda method, all_, **kw: (rows, None))
    runner, app = _cli()
    res = runner.invoke(app, ["audit", "--all"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    header = next(line for line in lines if line.startswith("mechanism"))
    table = [line for line in lines if line.split(" ")[0] in names]
    assert [t.split()[0] for t in table] == names
    for label in ("claimed ε", "direct LB", "GDP LB", "μ LB", "μ claim", "mode", "sec"):
        end = header.index(label) + len(label)
        for row in table:
            assert row[end - 1] != " " and row[end] == " ", (label, row)  # right-aligned under its header
    assert all(row.index("PASS") == header.index("verdict") for row in table)
