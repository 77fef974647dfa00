"""One-run estimators (dpopt.auditing.one_run_stats): cross-checked against jax-privacy, sound at their level.

Reference numbers: produced by jax-privacy 2.0.0 (jax 0.10.2, CPU) with::

    PYTHONPATH=src /tmp/jaxvenv/bin/python tests/auditing/one_run_reference.py

(`tests/auditing/one_run_reference.py` holds the cases and the seeded score
sets). ``test_live_cross_check_with_jax_privacy`` reruns the comparison when
jax_privacy is importable and skips otherwise.
"""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from dpopt.auditing import one_run_stats as O
from dpopt.auditing.stats import gdp_epsilon

DELTA = 1e-5


def _reference_module():
    spec = importlib.util.spec_from_file_location("one_run_reference", Path(__file__).with_name("one_run_reference.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


REF = _reference_module()

#: (m, k, c, significance, delta) -> (jax _epsilon_one_run, jax _epsilon_one_run_fdp) from the command above
JAX_COUNTS = {
    (1000, 100, 90, 0.05, 1e-05): (1.6261436787042223, 2.4564050672094146),
    (1000, 100, 100, 0.05, 1e-05): (3.465376229385333, 5.5490279999429415),
    (1000, 500, 400, 0.05, 0.0): (1.1986453137137123, None),
    (10000, 1000, 950, 0.05, 1e-05): (2.6909964769336003, 3.8024442260085842),
    (10000, 256, 256, 0.002, 1e-05): (0.7296737513866687, 4.4417189839052815),
    (10000, 2000, 1500, 0.01, 1e-06): (0.9776673537116931, 1.3936244416011654),
    (100, 20, 19, 0.1, 1e-05): (1.508396553001336, 2.746438158659729),
}
#: score set -> (k of the explicit threshold, jax Explicit steinke, jax Explicit fdp,
#:               jax Bonferroni steinke, jax Bonferroni fdp, jax's Bonferroni tries)
JAX_SCORES = {
    "m1000_mu2": (150, 3.418300099188041, 5.641585555359547, 2.712194220246506, 3.9771089601676763, 25),
    "m2000_mu1.67": (300, 2.492590051793425, 3.865547282132811, 2.144778194041662, 2.934094821814168, 30),
    "m500_mu4": (75, 3.1863426055918636, 5.39453927185044, 3.6011964418400706, 5.932491777960107, 11),
}


@pytest.mark.parametrize("case", sorted(JAX_COUNTS))
def test_count_level_estimators_match_jax_privacy(case):
    m, k, c, sig, delta = case
    jax_steinke, jax_fdp = JAX_COUNTS[case]
    assert O.steinke_epsilon(m, k, c, delta, sig) == pytest.approx(jax_steinke, abs=2e-6)
    if jax_fdp is not None:
        assert O.fdp_epsilon(m, k, c, delta, sig) == pytest.approx(jax_fdp, abs=2e-6)


def test_score_level_bounds_match_jax_privacy_explicit_threshold_and_are_corrected():
    sets = REF.score_sets()
    for name, (k, ex_s, ex_f, bonf_s, bonf_f, jax_tries) in JAX_SCORES.items():
        sin, sout = sets[name]
        one = O.one_run_bounds(sin, sout, DELTA, 0.05, guess_counts=[k], sides="upper")
        assert one.tries == 1
        assert one.steinke == pytest.approx(ex_s, abs=2e-6) and one.fdp == pytest.approx(ex_f, abs=2e-6)
        # jax's default corrects over the thresholds on its ROC hull (found from these scores: jax_tries);
        # ours over every distinct score ("all": m tries) is never looser, and a try at jax's count reproduces it
        al = O.one_run_bounds(sin, sout, DELTA, 0.05, guess_counts="all")
        assert al.tries == sin.size + sout.size
        assert al.steinke <= bonf_s + 1e-6 and al.fdp <= bonf_f + 1e-6
        ks, cs = O._guess_table(sin, sout, "all", "upper")
        best_f = 0.0
        for kk, cc in zip(ks, cs):
            if cc > 0 and O.fdp_slack(best_f, sin.size + sout.size, int(kk), int(cc), 0.05 / jax_tries) > 0:
                best_f = O.fdp_mu(sin.size + sout.size, int(kk), int(cc), 0.05 / jax_tries, lower=best_f)
        assert gdp_epsilon(best_f, DELTA) == pytest.approx(bonf_f, abs=2e-6)


def test_live_cross_check_with_jax_privacy():
    jp = pytest.importorskip("jax_privacy.auditing")
    for (m, k, c, sig, delta), _ in JAX_COUNTS.items():
        assert O.steinke_epsilon(m, k, c, delta, sig) == pytest.approx(
            float(jp._epsilon_one_run(0.0, m, k, c, sig, delta)), abs=2e-6
        )


def test_steinke_p_value_by_hand():
    # delta = 0: P[Bin(k, e^eps/(1+e^eps)) >= c]
    q = math.exp(1.0) / (1 + math.exp(1.0))
    assert O.steinke_p_value(50, 10, 9, 1.0, 0.0) == pytest.approx(stats.binom.sf(8, 10, q), rel=1e-12)
    # the delta term: 2 m delta max_i P[c-i <= W < c] / i
    window = max((stats.binom.cdf(8, 10, q) - stats.binom.cdf(8 - i, 10, q)) / i for i in range(1, 10))
    assert O.steinke_p_value(50, 10, 9, 1.0, 1e-3) == pytest.approx(stats.binom.sf(8, 10, q) + 0.1 * window)
    with pytest.raises(ValueError, match="correct <= guesses <= m"):
        O.steinke_p_value(10, 5, 6, 1.0, 0.0)


def test_no_evidence_gives_zero_and_perfect_guesses_are_limited_by_m():
    assert O.steinke_epsilon(1000, 100, 50, DELTA, 0.05) == 0.0
    assert O.fdp_mu(1000, 100, 50, 0.05) == 0.0
    # all m guesses right: the bound grows with m, stays finite
    e = [O.steinke_epsilon(m, m, m, 0.0, 0.05) for m in (10, 100, 1000)]
    assert e[0] < e[1] < e[2] < math.inf
    # P[Bin(m, q) = m] = q^m = 0.05 exactly at the bound
    assert special_q(e[1]) ** 100 == pytest.approx(0.05, rel=1e-6)


def special_q(eps):
    return math.exp(eps) / (1 + math.exp(eps))


def test_fdp_is_tighter_than_steinke_on_a_gaussian_and_both_below_the_truth():
    mu = 1.666  # eps(1e-5) = 8.0
    rng = np.random.default_rng(3)
    inc = rng.random(10_000) < 0.5
    s = rng.normal(0, 1, inc.size) + mu * inc
    b = O.one_run_bounds(s[inc], s[~inc], DELTA, 0.05)
    assert 0 < b.steinke < b.fdp < gdp_epsilon(mu, DELTA)
    assert b.mu < mu and b.tries == O.default_guess_counts(10_000).size
    assert b.fdp >= 4.0  # the target, idealised: >= 0.5 eps at m = 1e4


def test_repeated_small_audits_exceed_the_truth_within_beta():
    # R audits of an exact mu-GDP score set at confidence 1 - beta: exceedances ~ Bin(R, <= beta).
    # False alarm of this test: P[Bin(60, 0.1) >= observed] < 1e-3 is asserted against.
    R, beta, mu = 60, 0.1, 2.0
    truth = gdp_epsilon(mu, DELTA)
    rng = np.random.default_rng(7)
    over = 0
    for _ in range(R):
        inc = rng.random(300) < 0.5
        s = rng.normal(0, 1, inc.size) + mu * inc
        b = O.one_run_bounds(s[inc], s[~inc], DELTA, beta)
        over += int(b.fdp > truth or b.steinke > truth)
    assert stats.binom.sf(over - 1, R, beta) > 1e-3, over


def test_validation():
    with pytest.raises(ValueError, match="finite"):
        O.one_run_bounds([np.nan], [0.0])
    with pytest.raises(ValueError, match="beta must be in"):
        O.one_run_bounds([1.0], [0.0], beta=1.0)
    with pytest.raises(ValueError, match="guess_counts must lie"):
        O.one_run_bounds([1.0], [0.0], guess_counts=[5])
    with pytest.raises(ValueError, match="sides"):
        O.one_run_bounds([1.0], [0.0], sides="lower")
    with pytest.raises(ValueError, match="unknown estimator"):
        O.one_run_bounds([1.0], [0.0], estimators=["gdp"])
    assert list(O.default_guess_counts(5)) == [2]  # m < 20: only half of them (round(2.5))
    assert list(O.default_guess_counts(1000))[:3] == [10, 12, 14] and O.default_guess_counts(1000)[-1] == 500
