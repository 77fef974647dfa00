"""DP matrix factorization cross-checked against an independent implementation: jax-privacy 2.0.0
(issue 36, "ε equals an independent computation ... cross-check with jax-privacy's matrix-factorization
module").

jax is not a dpopt dependency, so the jax-privacy side is a committed fixture,
``tests/core/data/jax_privacy_mf.json``, produced in a separate venv by
``benchmarks/jax_privacy_mf_fixture.py`` (the fixture names the versions). Every test runs against that
fixture (always, also in CI); where ``jax_privacy`` is importable the same tests run a second time on
numbers recomputed live by the script (``pytest.importorskip``; ~2 min of jax compilation, so marked
slow; the strategy optimisation is fixture-only).

Tolerances (all float64): coefficients of C, C⁻¹ and the streamed noise 1e-12 absolute; exact
sensitivities and losses 1e-10 relative; ε from the same dp_accounting PLD construction 1e-6
relative (RDP 1e-3: different grids of orders); dpopt's optimised strategies may not lose more than 1e-6 relative to jax-privacy's optimum.
"""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from dp_accounting import dp_event

from dpopt.accounting.accountant import epsilon
from dpopt.accounting.matrix_factorization import _error
from dpopt.correlated_noise import (
    LEGACY_SENSITIVITY_METHOD,
    CorrelatedNoise,
    Participation,
    Strategy,
    amplified_banded_event,
    brute_force_sensitivity,
    gaussian_epsilon,
    mechanism_event,
    optimize_strategy,
    prefix_sensitivities,
    sensitivity,
    step_events,
)

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "data" / "jax_privacy_mf.json"
SCRIPT = ROOT / "benchmarks" / "jax_privacy_mf_fixture.py"
RDP_RTOL = 1e-3  # the two libraries convert RDP to ε over different grids of orders (same dp_accounting)


def _live() -> dict:
    pytest.importorskip("jax_privacy")
    spec = importlib.util.spec_from_file_location("jax_privacy_mf_fixture", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute(optimise=False)


@pytest.fixture(scope="module", params=["committed", pytest.param("live", marks=pytest.mark.slow)])
def jp(request):
    if request.param == "committed":
        return json.loads(FIXTURE.read_text())
    return _live()


def _strategy(entry: dict) -> Strategy:
    if "coefficients" in entry:
        return Strategy("banded", tuple(float(c) for c in entry["coefficients"]))
    return Strategy("blt", omega=tuple(entry["omega"]), theta=tuple(entry["theta"]))


def test_fixture_names_its_source():
    data = json.loads(FIXTURE.read_text())
    assert data["jax_privacy_version"] == "2.0.0"
    assert (ROOT / data["script"]).is_file()
    assert set(data["strategies"]) == {"banded3", "banded4_signed", "blt1", "blt2"}


def test_strategy_and_inverse_coefficients_agree(jp):
    for name, e in jp["strategies"].items():
        s, T = _strategy(e), e["steps"]
        np.testing.assert_allclose(s.column(T), e["C_column"], rtol=0, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(s.inverse_coefficients(T), e["C_inverse_column"], rtol=0, atol=1e-12, err_msg=name)


def test_streamed_noise_equals_jax_privacy_stream_and_dense_inverse(jp):
    for name, e in jp["strategies"].items():
        s, T = _strategy(e), e["steps"]
        z = np.asarray(e["z"])
        mech = CorrelatedNoise(s, Participation(T), 1.0)
        ours = np.stack([mech.correlate(torch.tensor(z[t]), t).numpy() for t in range(T)])
        np.testing.assert_allclose(ours, e["streamed_noise"], rtol=0, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(ours, np.linalg.solve(s.matrix(T), z), rtol=0, atol=1e-12, err_msg=name)


def test_sensitivity_agrees_and_lies_between_truth_and_the_published_bound(jp):
    """``exact`` (single participation; banded with b ≤ min_separation, jax-privacy's
    get_sensitivity_banded) and ``toeplitz_thm2`` (McKenna 2024 Thm 2, exact for nonnegative nonincreasing
    Toeplitz C: every BLT here and banded3) must equal dpopt's sensitivity and our brute force; where neither
    applies (signed banded with b > min_separation) dpopt's general bound must lie between the truth and
    jax-privacy's Algorithm-4 upper bound (arXiv 2306.08153). Every value is above the (k, b)-fixed-epoch one.
    The legacy method (ledgers without ``sensitivity_method``) still lies between the truth and Algorithm 4."""
    checked = thm2 = 0
    for name, e in jp["strategies"].items():
        s, T = _strategy(e), e["steps"]
        for row in e["sensitivity"]:
            p = Participation(T, row["k"], row["min_separation"])
            ours, truth = sensitivity(s, p), brute_force_sensitivity(s, p)
            legacy = sensitivity(s, p, LEGACY_SENSITIVITY_METHOD)
            assert prefix_sensitivities(s, p)[-1] == pytest.approx(ours, rel=1e-12)
            assert truth * (1 - 1e-12) <= ours <= row["upper_bound_alg4"] * (1 + 1e-10), (name, row)
            assert truth * (1 - 1e-12) <= legacy <= row["upper_bound_alg4"] * (1 + 1e-10), (name, row)
            if "exact" in row:
                assert ours == pytest.approx(row["exact"], rel=1e-10), (name, row)
                checked += 1
            if "toeplitz_thm2" in row:
                assert truth == pytest.approx(row["toeplitz_thm2"], rel=1e-10), (name, row)
                assert ours == pytest.approx(row["toeplitz_thm2"], rel=1e-10), (name, row)
                thm2 += 1
            if "fixed_epoch" in row:
                assert row["fixed_epoch"] <= ours * (1 + 1e-10), (name, row)
        if "blt_sensitivity_closed_form" in e:  # Dvijotham et al. 2024, Lemma 5.3
            assert sensitivity(s, Participation(T)) == pytest.approx(e["blt_sensitivity_closed_form"], rel=1e-10)
    assert checked >= 10 and thm2 >= 18


def test_prefix_sum_losses_agree(jp):
    for name, e in jp["strategies"].items():
        s, T = _strategy(e), e["steps"]
        d, c = s.inverse_coefficients(T), s.column(T)
        assert _error(d, c, "mean") == pytest.approx(e["loss_mean"], rel=1e-10), name
        assert _error(d, c, "max") == pytest.approx(e["loss_max"], rel=1e-10), name


def _optimised_cases(slow: bool) -> list:
    rows = json.loads(FIXTURE.read_text())["optimised"]
    return [r for r in rows if (r["kind"] == "blt" and r["size"] > 2) == slow]


def _check_optimised(row: dict) -> None:
    T = row["steps"]
    theirs = _strategy(row) if row["kind"] == "blt" else Strategy("banded", tuple(row["coefficients"]))
    # the two libraries' loss functions agree on jax-privacy's own optimum ...
    assert _error(theirs.inverse_coefficients(T), theirs.column(T), row["objective"]) == pytest.approx(
        row["loss"], rel=1e-8
    )
    # ... and dpopt's optimiser is no worse than jax-privacy's (same T, bands / buffers, objective)
    ours = optimize_strategy(row["kind"], T, row["size"], row["objective"])
    assert _error(ours.inverse_coefficients(T), ours.column(T), row["objective"]) <= row["loss"] * (1 + 1e-6)


@pytest.mark.parametrize(
    "row", _optimised_cases(False), ids=lambda r: f"{r['kind']}{r['size']}-T{r['steps']}-{r['objective']}"
)
def test_optimised_strategies_are_no_worse_than_jax_privacys(row):
    _check_optimised(row)


@pytest.mark.slow
@pytest.mark.parametrize(
    "row", _optimised_cases(True), ids=lambda r: f"{r['kind']}{r['size']}-T{r['steps']}-{r['objective']}"
)
def test_optimised_blt_with_more_buffers_is_no_worse_than_jax_privacys(row):
    _check_optimised(row)


def test_unamplified_epsilon_equals_jax_privacys_single_release_accountant(jp):
    """jax-privacy's SingleReleaseTrainingAccountant: ONE Gaussian(σ/Δ). dpopt's whole-run event and its
    per-release ledger events (composed) must give the same ε at σ = noise_multiplier·Δ."""
    e = jp["strategies"]["banded3"]
    s, T = _strategy(e), e["steps"]
    p = Participation(T, 3, 4)
    delta_ = jp["epsilon"]["delta"]
    sens = sensitivity(s, p)
    for row in jp["epsilon"]["single_release"]:
        sigma = row["noise_multiplier"] * sens
        whole = mechanism_event(sigma, s, p)
        ledger = dp_event.ComposedDpEvent(step_events(sigma, prefix_sensitivities(s, p)))
        assert epsilon(whole, delta_, "pld") == pytest.approx(row["pld"], rel=1e-6), row
        assert epsilon(whole, delta_, "rdp") == pytest.approx(row["rdp"], rel=RDP_RTOL), row
        assert epsilon(ledger, delta_, "pld") == pytest.approx(row["pld"], rel=2e-3)
        exact = gaussian_epsilon(1.0 / row["noise_multiplier"], delta_)  # Balle & Wang 2018
        assert exact <= row["pld"] <= exact * (1 + 2e-3)


def test_amplified_epsilon_equals_jax_privacys_cyclic_poisson_bandmf_accountant(jp):
    """jax-privacy's DpsgdTrainingAccountant with cycle_length b' (BandMF, bands ≤ b'): ⌈T/b'⌉ compositions
    of the Poisson-sampled Gaussian at q = batch / ⌊N/b'⌋ and the column-normalised multiplier."""
    e = jp["strategies"]["banded3"]
    s = _strategy(e)
    col = float(np.linalg.norm(s.coefficients))
    for row in jp["epsilon"]["amplified_bandmf"]:
        T, sep = row["steps"], row["cycle_length"]
        p = Participation(T, math.ceil(T / sep), sep)
        ev = amplified_banded_event(row["noise_multiplier"] * col, s, p, row["sample_rate"])
        assert epsilon(ev, jp["epsilon"]["delta"], "pld") == pytest.approx(row["pld"], rel=1e-6), row
        assert epsilon(ev, jp["epsilon"]["delta"], "rdp") == pytest.approx(row["rdp"], rel=RDP_RTOL), row
