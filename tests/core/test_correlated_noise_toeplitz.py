"""The exact Toeplitz sensitivity of DP matrix factorization (McKenna 2024, arXiv 2405.13763, Thm 2) and
its versioning in the ledger (issue 36 follow-up to the jax-privacy cross-check).

For a lower-triangular Toeplitz C with nonnegative, nonincreasing coefficients the worst (k, b)-participation
pattern is 0, b, 2b, …, for the whole run and for every prefix of rows. Every value here is compared with an
enumeration of every participation pattern (brute force, float64; equal to 1e-12 relative). Ledgers written
before ``sensitivity_method`` existed (the general bound) must still pass ``dpopt check``.
"""

import functools
import math

import numpy as np
import pytest
import torch
from test_correlated_noise import _best_pattern

import dpopt.accounting.matrix_factorization as mf
from dpopt.accounting.accountant import epsilon
from dpopt.accounting.calibration import calibrate_correlated_noise_multiplier
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.ledger_check import check_ledger
from dpopt.correlated_noise import (
    LEGACY_SENSITIVITY_METHOD,
    SENSITIVITY_METHOD,
    CorrelatedNoise,
    Participation,
    Strategy,
    brute_force_sensitivity,
    check_record,
    monotone_envelope,
    optimize_strategy,
    prefix_sensitivities,
    sensitivity,
    toeplitz_prefix_sensitivities,
)
from dpopt.engine.reference import PerSampleGrads
from dpopt.privatizer import Privatizer

T = 11
MONOTONE = {
    "banded3": Strategy("banded", (1.0, 0.6, 0.3)),
    "banded5": Strategy("banded", (1.0, 0.8, 0.5, 0.5, 0.1)),  # a tie: nonincreasing, not decreasing
    "banded3_opt": optimize_strategy("banded", T, 3),
    "banded6_opt": optimize_strategy("banded", T, 6),
    "blt1": Strategy("blt", omega=(-0.3,), theta=(0.6,)),
    "blt2_opt": optimize_strategy("blt", T, 2),
    "blt3_opt": optimize_strategy("blt", T, 3),
}
PATTERNS = [(2, 1), (3, 2), (2, 3), (4, 2), (3, 3), (2, 5), (6, 2), (11, 1)]


@pytest.mark.parametrize("name", MONOTONE)
@pytest.mark.parametrize("k,sep", PATTERNS)
def test_exact_sensitivity_equals_every_pattern_enumerated_for_the_run_and_every_prefix(name, k, sep):
    s, p = MONOTONE[name], Participation(T, k, sep)
    assert monotone_envelope(s.column(T)) is not None  # the hypotheses hold on these coefficients
    prefix = prefix_sensitivities(s, p)
    C = s.matrix(T)
    for t in range(T):  # the first t+1 rows of C, every pattern in [0, T)
        truth = math.sqrt(_best_pattern(np.abs(C[: t + 1].T @ C[: t + 1]), k, sep))
        assert prefix[t] == pytest.approx(truth, rel=1e-12), t
    assert sensitivity(s, p) == pytest.approx(brute_force_sensitivity(s, p), rel=1e-12)
    assert sensitivity(s, p) <= sensitivity(s, p, LEGACY_SENSITIVITY_METHOD) * (1 + 1e-12)  # never looser


def test_the_formula_is_c_times_the_earliest_pattern():
    """An independent O(T·k) form: Δ_t² = Σ_{s≤t} (C u)_s², u = e_0 + e_b + … (k' = min(k, ⌈T/b⌉) terms)."""
    rng = np.random.default_rng(0)
    for n, k, sep in [(1, 1, 1), (7, 3, 2), (50, 4, 7), (50, 60, 1), (33, 2, 32), (64, 8, 8)]:
        c = np.sort(rng.random(n))[::-1]
        u = np.zeros(n)
        u[[m * sep for m in range(k) if m * sep < n]] = 1.0
        v = np.tril(c[np.subtract.outer(np.arange(n), np.arange(n)).clip(0)]) @ u
        want = np.sqrt(np.cumsum(v * v))
        got = toeplitz_prefix_sensitivities(c, Participation(n, min(k, -(-n // sep)), sep))
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)


def test_blt_with_the_large_gap_of_the_general_bound():
    """BLT over 3 epochs of 4 batches: the general bound (Alg. 4) is above the truth, the exact form is not."""
    s, p = MONOTONE["blt1"], Participation(16, 3, 4)
    truth = brute_force_sensitivity(s, p)
    assert sensitivity(s, p, LEGACY_SENSITIVITY_METHOD) > truth * 1.004
    assert sensitivity(s, p) == pytest.approx(truth, rel=1e-12)
    assert sensitivity(s, p) == pytest.approx(2.6003823917512996, rel=1e-10)  # jax-privacy 2.0.0, Thm 2


@pytest.mark.parametrize("k,sep", [(3, 2), (2, 1), (4, 2)])
def test_non_monotone_coefficients_fall_back_to_the_general_bound(k, sep):
    s, p = Strategy("banded", (1.0, -0.4, 0.25, 0.1)), Participation(12, k, sep)
    assert monotone_envelope(s.column(12)) is None
    got = sensitivity(s, p)
    assert got == sensitivity(s, p, LEGACY_SENSITIVITY_METHOD)
    assert got >= brute_force_sensitivity(s, p) * (1 - 1e-12)  # valid, here above the truth
    increasing = Strategy("banded", (1.0, 0.5, 0.6))  # positive but not monotone
    assert monotone_envelope(increasing.column(12)) is None
    assert sensitivity(increasing, p) >= brute_force_sensitivity(increasing, p) * (1 - 1e-12)


@pytest.mark.parametrize(
    "c, steps, k, sep",
    [((1.0, 0.2, 0.9), 6, 2, 1), ((1.0, 0.1, 0.1, 0.9), 5, 2, 2), ((1.0, 0.0, 1.0), 6, 2, 1)],
)
def test_the_hypothesis_is_needed_the_earliest_pattern_undercounts_without_it(c, steps, k, sep):
    """Nonnegative but increasing coefficients (Thm 2's hypothesis fails): ‖C·(e_0 + e_b + …)‖ is BELOW the
    enumerated truth (measured 2.112 vs 2.345, 1.797 vs 2.154, 2.0 vs 2.449), so the formula must not be used
    there; dpopt's value (the general bound) is not below the truth."""
    s, p = Strategy("banded", c), Participation(steps, k, sep)
    C = s.matrix(steps)
    u = np.zeros(steps)
    u[[m * sep for m in range(k) if m * sep < steps]] = 1.0
    truth = math.sqrt(_best_pattern(np.abs(C.T @ C), k, sep))
    assert float(np.linalg.norm(C @ u)) < 0.95 * truth
    assert monotone_envelope(s.column(steps)) is None
    prefix = prefix_sensitivities(s, p)
    for t in range(steps):
        assert prefix[t] >= math.sqrt(_best_pattern(np.abs(C[: t + 1].T @ C[: t + 1]), k, sep)) * (1 - 1e-12), t


def test_random_strategies_against_every_pattern_for_every_prefix():
    """60 seeded random banded strategies, T ≤ 10, every (k, b) that fits: monotone coefficients give the
    enumerated truth for every prefix (1e-12), coefficients of any sign and order a value never below it."""
    rng = np.random.default_rng(20261206)
    for trial in range(60):
        steps = int(rng.integers(2, 11))
        sep = int(rng.integers(1, steps + 1))
        k = int(rng.integers(1, -(-steps // sep) + 1))
        c = rng.random(int(rng.integers(1, steps + 1)))
        monotone = trial % 2 == 0
        if monotone:
            c = np.sort(c)[::-1]
        else:
            c = c * np.where(rng.random(len(c)) < 0.3, -1.0, 1.0)
            c[0] = abs(c[0]) + 0.05
        s, p = Strategy("banded", tuple(float(x) for x in c)), Participation(steps, k, sep)
        C, prefix = s.matrix(steps), prefix_sensitivities(s, p)
        for t in range(steps):
            truth = math.sqrt(_best_pattern(np.abs(C[: t + 1].T @ C[: t + 1]), k, sep))
            if monotone:
                assert prefix[t] == pytest.approx(truth, rel=1e-12), (c, steps, k, sep, t)
            else:
                assert prefix[t] >= truth * (1 - 1e-12), (c, steps, k, sep, t)


def test_rounding_off_monotone_stays_an_upper_bound():
    """Coefficients a hair off monotone (within the tolerance) use the envelope max_{r≥s}|c_r| ≥ |c_s|: the
    value is still ≥ every pattern's, and equal to it up to the perturbation."""
    c = (1.0, 0.7, 0.7 + 5e-10, 0.2, -1e-10)
    s = Strategy("banded", c)
    assert monotone_envelope(s.column(T)) is not None
    for k, sep in [(3, 2), (4, 1), (2, 4)]:
        p = Participation(T, k, sep)
        prefix = prefix_sensitivities(s, p)
        C = s.matrix(T)
        for t in range(T):
            truth = math.sqrt(_best_pattern(np.abs(C[: t + 1].T @ C[: t + 1]), k, sep))
            assert truth * (1 - 1e-12) <= prefix[t] <= truth * (1 + 1e-8)
    assert monotone_envelope(np.array([1.0, 0.7, 0.7 + 1e-6])) is None  # beyond the tolerance: not used


def test_long_blt_runs_no_longer_need_the_dense_bound():
    """Multi-epoch BLT beyond the general bound's horizon (T > 2048): the O(T) exact form applies."""
    s = Strategy("blt", omega=(-0.0491, -0.452), theta=(0.8309, 0.2142))  # the fixture's blt2
    p = Participation(4096, 4, 1024)
    assert monotone_envelope(s.column(4096)) is not None
    prefix = prefix_sensitivities(s, p)
    assert np.all(np.diff(prefix) >= 0) and prefix[-1] > prefix[1023]
    with pytest.raises(ValueError, match="up to T = 2048"):
        sensitivity(s, p, LEGACY_SENSITIVITY_METHOD)


def test_the_formula_refuses_coefficients_outside_its_hypotheses():
    with pytest.raises(ValueError, match="nonincreasing"):
        toeplitz_prefix_sensitivities(np.array([1.0, 0.5, 0.6]), Participation(3, 2, 1))
    with pytest.raises(ValueError, match="nonincreasing"):
        toeplitz_prefix_sensitivities(np.array([1.0, -0.1, 0.0]), Participation(3, 2, 1))
    with pytest.raises(ValueError, match="steps"):
        toeplitz_prefix_sensitivities(np.array([1.0, 0.5]), Participation(3, 2, 1))


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="unknown sensitivity_method"):
        sensitivity(MONOTONE["blt1"], Participation(16, 2, 4), "toeplitz-v9")


# -- ledgers: the method is recorded, re-derived, and old ledgers still check -----------------------------


def _ledger(method: str, steps: int = 12):
    s, p = Strategy("banded", (1.0, 0.6, 0.3)), Participation(12, 3, 2)
    mech = CorrelatedNoise(s, p, 1.5, sensitivity_method=method)
    priv = Privatizer(1.5, 1.0, 1.0, 1.0, mechanism=mech)
    for _ in range(steps):
        priv.privatize(PerSampleGrads([torch.zeros(1, 3)]))
    return priv.ledger


def _claims(ledger, steps=12):
    eps = epsilon(ledger, 1e-5, "rdp")
    return {"epsilon": eps, "delta": 1e-5, "accountant": "rdp", "noise_multiplier": 1.5, "steps": steps}


def test_new_ledgers_record_the_exact_method_and_check(tmp_path):
    ledger = PrivacyLedger.load(_ledger(SENSITIVITY_METHOD).save(tmp_path / "new.json"))
    rec = ledger.mechanism
    assert rec["sensitivity_method"] == "toeplitz-monotone"
    assert rec["sensitivity"] == pytest.approx(2.355843797877949, rel=1e-12)  # jax-privacy 2.0.0, Thm 2
    result = check_ledger(ledger, _claims(ledger))
    assert result.passed, result.failures
    # dropping the field makes check re-derive with the old, larger bound: the entries no longer match
    stripped = {k: v for k, v in rec.items() if k != "sensitivity_method"}
    assert any("sensitivity" in msg for msg in check_record(stripped, ledger.entries))
    ledger.mechanism = stripped
    assert not check_ledger(ledger, _claims(ledger)).passed
    ledger.mechanism = {**rec, "sensitivity_method": "toeplitz-v9"}
    assert any("unknown sensitivity_method" in msg for msg in check_record(ledger.mechanism, ledger.entries))
    assert not check_ledger(ledger, _claims(ledger)).passed


def test_old_format_ledgers_still_check_and_tampering_is_caught(tmp_path):
    """A ledger as dpopt wrote it before the field: general-bound values, no ``sensitivity_method``."""
    path = _ledger(LEGACY_SENSITIVITY_METHOD).save(tmp_path / "old.json")
    ledger = PrivacyLedger.load(path)
    ledger.mechanism = {k: v for k, v in ledger.mechanism.items() if k != "sensitivity_method"}
    assert ledger.mechanism["sensitivity"] == pytest.approx(2.479919353527449, rel=1e-12)  # Alg. 4 (jax-privacy)
    assert check_record(ledger.mechanism, ledger.entries) == []
    claims = _claims(ledger)
    result = check_ledger(ledger, claims)
    assert result.passed, result.failures
    # an old ledger relabelled as exact (its sensitivity no longer matches the re-derivation) fails
    relabelled = {**ledger.mechanism, "sensitivity_method": SENSITIVITY_METHOD}
    assert check_record(relabelled, ledger.entries)
    for key, value in (("sensitivity", 2.3558), ("min_separation", 3), ("noise_multiplier", 1.4)):
        bad = PrivacyLedger.load(path)
        bad.mechanism = {k: v for k, v in {**bad.mechanism, key: value}.items() if k != "sensitivity_method"}
        assert not check_ledger(bad, claims).passed, key


def test_the_calibrated_noise_multiplier_drops_by_the_sensitivity_margin(monkeypatch):
    """banded:3 over 3 epochs of 2 batches: the exact Δ is 5.0 % below the general bound, and so is σ at ε = 2."""
    s, p = Strategy("banded", (1.0, 0.6, 0.3)), Participation(12, 3, 2)
    exact, general = sensitivity(s, p), sensitivity(s, p, LEGACY_SENSITIVITY_METHOD)
    assert 1 - exact / general == pytest.approx(1 - 2.355843797877949 / 2.479919353527449, rel=1e-9)
    assert 0.049 < 1 - exact / general < 0.051
    sigma_new = calibrate_correlated_noise_multiplier(2.0, 1e-5, s, p, accountant="rdp")
    monkeypatch.setattr(mf, "prefix_sensitivities", functools.partial(mf.prefix_sensitivities, method="general-bound"))
    sigma_old = calibrate_correlated_noise_multiplier(2.0, 1e-5, s, p, accountant="rdp")
    assert sigma_new / sigma_old == pytest.approx(exact / general, rel=2.5e-3)  # σ is raised in 0.1 % steps
