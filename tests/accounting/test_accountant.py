"""Accountants: pld (connect-the-dots), rdp, prv read the same ledger.

Reference numbers (q = 0.01, T = 1000, δ = 1e-5, σ = 1.0): RDP ε ≈ 2.10,
PLD ε ≈ 1.83 (issue 4). A quantile-clipping ledger whose steps release the
gradient at σ_grad = σ/√(1−r) and the count at 2σ_b = σ/√r must report the
same ε as plain DP-SGD at σ; one that records only the gradient release
reports less (≈ 1.98 RDP, ≈ 1.73 PLD at r = 0.05).
"""

import functools
import inspect
import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st

from dpopt.accounting.accountant import (
    ACCOUNTANTS,
    RDP_ORDERS,
    dpsgd_epsilon,
    dpsgd_event,
    epsilon,
    flatten_gaussian_terms,
    pld_epsilon,
)
from dpopt.accounting.budget import split_budget
from dpopt.accounting.events import poisson_composed_step, poisson_gaussian_step
from dpopt.accounting.ledger import PrivacyLedger

Q, T, DELTA, SIGMA = 0.01, 1000, 1e-5, 1.0


@functools.lru_cache(maxsize=None)
def _plain(accountant, sigma=SIGMA, steps=T):
    """ε of plain DP-SGD at the reference setting (cached: PLD at 1e-4 takes ~1 s)."""
    return dpsgd_epsilon(sigma, Q, steps, DELTA, accountant)


def _quantile_ledger(sigma_grad, count_multiplier=None, steps=T, q=Q):
    """A ledger as the Privatizer records it: one (composed) event per step."""
    ledger = PrivacyLedger()
    sigmas = [sigma_grad] if count_multiplier is None else [sigma_grad, count_multiplier]
    for step in range(steps):
        ledger.record(step, poisson_composed_step(sigmas, q))
    return ledger


# --- PLD is connect-the-dots and equals dp_accounting --------------------------------
def test_dp_accounting_default_is_connect_the_dots():
    """dp_accounting 0.6: PLDAccountant → from_gaussian_mechanism, whose default is connect-the-dots."""
    params = inspect.signature(pld_lib.from_gaussian_mechanism).parameters
    assert params["use_connect_dots"].default is True
    assert params["pessimistic_estimate"].default is True


def test_pld_equals_dp_accounting_pld_accountant():
    event = dpsgd_event(SIGMA, Q, T)
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(event)
    assert _plain("pld") == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)


def test_pld_uses_connect_the_dots_not_privacy_buckets():
    # A coarser grid (1e-3) keeps this fast; the construction is the same at 1e-4.
    ours = pld_epsilon(dpsgd_event(SIGMA, Q, 100), DELTA, value_discretization_interval=1e-3)

    def build(connect):
        pld = pld_lib.from_gaussian_mechanism(
            SIGMA, sampling_prob=Q, value_discretization_interval=1e-3, use_connect_dots=connect
        )
        return pld.self_compose(100).get_epsilon_for_delta(DELTA)

    assert ours == pytest.approx(build(True), rel=1e-12)
    buckets = build(False)
    assert buckets > ours * (1 + 1e-4)  # privacy buckets is looser: the two are distinguishable


def test_rdp_equals_dp_accounting_rdp_accountant():
    event = dpsgd_event(SIGMA, Q, T)
    acc = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS))
    acc.compose(event)
    assert epsilon(event, DELTA, "rdp") == pytest.approx(acc.get_epsilon(DELTA), rel=1e-12)


def test_reference_values_plain_dpsgd():
    assert _plain("rdp") == pytest.approx(2.10, abs=0.01)
    assert _plain("pld") == pytest.approx(1.83, abs=0.01)


def test_prv_close_to_pld_and_an_upper_bound():
    from dpopt.accounting.prv import prv_epsilon

    event = dpsgd_event(SIGMA, Q, T)
    upper = epsilon(event, DELTA, "prv")
    estimate = prv_epsilon(event, DELTA, estimate=True)
    assert estimate < upper <= estimate + 0.011
    assert upper == pytest.approx(_plain("pld"), abs=0.03)


def test_three_accountants_read_the_same_ledger(tmp_path):
    ledger = _quantile_ledger(*split_budget(SIGMA, 0.05)[:2], steps=20)
    ledger.save(tmp_path / "ledger.json")
    back = PrivacyLedger.load(tmp_path)
    for name in ACCOUNTANTS:
        plain = dpsgd_epsilon(SIGMA, Q, 20, DELTA, name)
        assert epsilon(back, DELTA, name) == pytest.approx(plain, rel=1e-6), name


# --- quantile clipping: composed events cost exactly σ --------------------------------
@pytest.mark.parametrize(
    "share,accountant,expected",
    [
        (0.01, "rdp", 2.10),
        (0.05, "rdp", 2.10),
        (0.3, "rdp", 2.10),
        (0.9, "rdp", 2.10),
        (0.05, "pld", 1.83),
        (0.5, "pld", 1.83),
    ],
)
def test_quantile_ledger_equals_plain_dpsgd(share, accountant, expected):
    grad, count, _ = split_budget(SIGMA, share)
    eps = epsilon(_quantile_ledger(grad, count), DELTA, accountant)
    assert eps == pytest.approx(_plain(accountant), rel=1e-6)
    assert eps == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize("accountant,honest,leaky", [("rdp", 2.10, 1.98), ("pld", 1.83, 1.73)])
def test_gradient_only_ledger_under_reports(accountant, honest, leaky):
    """Counter-example: recording only the gradient release at σ_grad hides the count's cost."""
    grad, count, _ = split_budget(SIGMA, 0.05)
    assert grad == pytest.approx(1.026, abs=1e-3)
    eps_leaky = epsilon(_quantile_ledger(grad), DELTA, accountant)
    eps_honest = _plain(accountant)  # = the composed ledger's ε (test above)
    assert eps_leaky == pytest.approx(leaky, abs=0.01)
    assert eps_honest == pytest.approx(honest, abs=0.01)
    assert eps_leaky < eps_honest - 0.05


def test_flatten_groups_identical_steps_and_collapses_composed():
    grad, count, _ = split_budget(2.0, 0.2)
    ledger = _quantile_ledger(grad, count, steps=7)
    ledger.record(7, poisson_gaussian_step(3.0, 0.02))
    terms = flatten_gaussian_terms(ledger.composed_event())
    assert list(terms.values()) == [7, 1]
    (q1, s1), (q2, s2) = terms
    assert (q1, q2) == (Q, 0.02) and s1 == pytest.approx(2.0, rel=1e-12) and s2 == 3.0


def test_non_consecutive_identical_events_compose_like_consecutive():
    a, b = poisson_gaussian_step(1.0, 0.01), poisson_gaussian_step(2.0, 0.05)
    interleaved, grouped = PrivacyLedger(), PrivacyLedger()
    for i, ev in enumerate([a, b, a, b, a]):
        interleaved.record(i, ev)
    for i, ev in enumerate([a, a, a, b, b]):
        grouped.record(i, ev)
    assert flatten_gaussian_terms(interleaved.composed_event()) == flatten_gaussian_terms(grouped.composed_event())
    # PLD and PRV compose each distinct (q, σ) term once, whatever the ledger's order.
    assert epsilon(interleaved, DELTA, "rdp") == pytest.approx(epsilon(grouped, DELTA, "rdp"), rel=1e-12)


# --- regression: int / np.float32 multipliers ----------------------------------------
@pytest.mark.parametrize("first,second", [(1, 2), (np.float32(1.0), np.float32(2.0)), (np.int64(1), 2.0)])
def test_int_or_float32_multipliers_give_float_epsilon(first, second):
    ref = epsilon(poisson_composed_step([1.0, 2.0], 0.01), DELTA, "rdp")
    assert epsilon(poisson_composed_step([first, second], np.float32(0.01)), DELTA, "rdp") == pytest.approx(
        ref, rel=1e-6
    )
    # Without events.py's coercion dp_accounting drops the second Gaussian (σ_eff would be 1, not 0.894):
    raw = dp_event.PoissonSampledDpEvent(
        0.01, dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(1), dp_event.GaussianDpEvent(2.0)])
    )
    acc = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS))
    acc.compose(raw)
    assert acc.get_epsilon(DELTA) < ref * 0.9


# --- edge cases and properties ---------------------------------------------------------
@pytest.mark.parametrize("delta", [0.0, 1.0, 1.5, -1e-5, float("nan")])
def test_bad_delta_is_a_clear_error(delta):
    with pytest.raises(ValueError, match="delta must be in"):
        dpsgd_epsilon(SIGMA, Q, 10, delta)


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
def test_zero_noise_is_infinite(accountant):
    assert dpsgd_epsilon(0.0, Q, 10, DELTA, accountant) == math.inf


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown accountant"):
        dpsgd_epsilon(SIGMA, Q, 10, DELTA, "moments")
    with pytest.raises(ValueError, match="sample_rate"):
        dpsgd_epsilon(SIGMA, 0.0, 10, DELTA)
    with pytest.raises(ValueError, match="steps"):
        dpsgd_epsilon(SIGMA, Q, 0, DELTA)
    with pytest.raises(ValueError, match="noise_multiplier"):
        dpsgd_epsilon(-1.0, Q, 10, DELTA)
    assert epsilon(PrivacyLedger(), DELTA, "prv") == 0.0


@settings(max_examples=6, deadline=None)
@given(sigma=st.floats(0.5, 5.0), q=st.floats(1e-3, 0.2), steps=st.integers(1, 2000), delta=st.floats(1e-9, 1e-2))
def test_rdp_monotone_and_nonnegative(sigma, q, steps, delta):
    e = dpsgd_epsilon(sigma, q, steps, delta, "rdp")
    assert e >= 0.0
    assert dpsgd_epsilon(sigma, q, steps + 1 + steps // 2, delta, "rdp") >= e
    assert dpsgd_epsilon(sigma, min(1.0, q * 1.5), steps, delta, "rdp") >= e


@pytest.mark.parametrize("sigma,q,steps", [(2.0, 0.05, 5)])
def test_pld_monotone_and_nonnegative(sigma, q, steps):
    e = dpsgd_epsilon(sigma, q, steps, DELTA, "pld")
    assert e >= 0.0
    assert dpsgd_epsilon(sigma, q, 2 * steps, DELTA, "pld") >= e
    assert dpsgd_epsilon(sigma, min(1.0, 2 * q), steps, DELTA, "pld") >= e


def test_replace_one_ledgers():
    """Only PLD handles Poisson sampling under replace-one; RDP and PRV refuse rather than guess."""
    add_remove, replace = PrivacyLedger(), PrivacyLedger("replace_one")
    for step in range(10):
        add_remove.record(step, poisson_gaussian_step(SIGMA, Q))
        replace.record(step, poisson_gaussian_step(SIGMA, Q))
    assert epsilon(replace, DELTA, "pld") > epsilon(add_remove, DELTA, "pld") > 0
    for name in ("rdp", "prv"):
        with pytest.raises(ValueError, match="replace_one|add_or_remove_one"):
            epsilon(replace, DELTA, name)
