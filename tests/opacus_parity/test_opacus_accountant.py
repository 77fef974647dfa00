"""``privacy_engine.accountant``: Opacus's accountant interface read from the engine's ledger.

Ports Opacus's accountant cases (privacy_engine_test: ``get_epsilon`` after
training; accountants_test: ``history``, ``state_dict``, mechanism mismatch)
with the import switched; ε is cross-checked against dp_accounting directly.
"""

from __future__ import annotations

import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant
from opacus_setup import private, run_epoch

import dpopt
from dpopt.accounting.accountant import dpsgd_epsilon, epsilon
from dpopt.accounting.opacus_accountant import LedgerAccountant

DELTA = 1e-5


def test_get_epsilon_after_training_equals_the_dpsgd_epsilon_of_the_steps_run():
    engine, model, opt, loader = private(accountant="rdp")
    steps = run_epoch(model, opt, loader)
    assert steps == len(loader) == 4
    eps = engine.accountant.get_epsilon(delta=DELTA)
    assert eps == pytest.approx(dpsgd_epsilon(1.0, 0.25, 4, DELTA, "rdp"), rel=1e-9)
    assert eps == engine.get_epsilon(DELTA)
    assert engine.accountant.history == [(1.0, 0.25, 4)]
    assert len(engine.accountant) == 1 and engine.accountant.steps == 4
    assert engine.accountant.mechanism() == "rdp"


def test_nothing_spent_before_the_first_step():
    engine = dpopt.PrivacyEngine()
    assert engine.accountant.get_epsilon(DELTA) == 0.0
    assert engine.accountant.history == [] and len(engine.accountant) == 0


def test_get_privacy_spent_matches_dp_accounting_rdp_with_its_best_order():
    engine, model, opt, loader = private(accountant="rdp")
    run_epoch(model, opt, loader)
    orders = [1.5, 2.0, 4.0, 8.0, 16.0, 32.0]
    eps, alpha = engine.accountant.get_privacy_spent(delta=DELTA, alphas=orders)
    acc = rdp_privacy_accountant.RdpAccountant(orders)
    acc.compose(dp_event.PoissonSampledDpEvent(0.25, dp_event.GaussianDpEvent(1.0)), 4)
    want_eps, want_order = acc.get_epsilon_and_optimal_order(DELTA)
    assert eps == pytest.approx(want_eps, rel=1e-12) and alpha == want_order
    with pytest.raises(AttributeError, match="get_epsilon"):
        dpopt.PrivacyEngine(accountant="pld").accountant.get_privacy_spent(delta=DELTA)


def test_accountant_is_its_name_for_code_that_read_a_string():
    acc = dpopt.PrivacyEngine(accountant="RDP").accountant
    assert acc == "rdp" and str(acc) == "rdp" and acc != "pld"
    assert dpopt.PrivacyEngine().accountant.mechanism() == "pld"  # dpopt's default


def test_gdp_is_refused_with_the_names_to_use():
    with pytest.raises(ValueError, match="approximat.*pld"):
        dpopt.PrivacyEngine(accountant="gdp")
    with pytest.raises(ValueError, match="unknown accountant"):
        dpopt.PrivacyEngine(accountant="moments")


def test_step_is_refused_and_the_ledger_is_the_only_record():
    engine, model, opt, loader = private()
    run_epoch(model, opt, loader, steps=2)
    with pytest.raises(RuntimeError, match="only the Privatizer"):
        engine.accountant.step(noise_multiplier=0.0, sample_rate=1.0)
    hist = engine.accountant.history
    hist.append((0.0, 1.0, 100))  # a copy: mutating it changes nothing
    assert engine.accountant.history == [(1.0, 0.25, 2)] and len(engine.ledger) == 2


def test_state_dict_round_trip_restores_the_ledger_and_epsilon():
    engine, model, opt, loader = private(accountant="rdp")
    run_epoch(model, opt, loader, steps=3)
    state = engine.accountant.state_dict()
    assert state["history"] == [(1.0, 0.25, 3)] and state["mechanism"] == "rdp"
    fresh = dpopt.PrivacyEngine(accountant="rdp")
    fresh.accountant.load_state_dict(state)
    assert len(fresh.ledger) == 3
    assert fresh.accountant.get_epsilon(DELTA) == pytest.approx(engine.accountant.get_epsilon(DELTA), rel=1e-12)


def test_loading_an_older_accountant_state_never_forgets_later_releases():
    engine, model, opt, loader = private(accountant="rdp")
    run_epoch(model, opt, loader, steps=2)
    older = engine.accountant.state_dict()
    run_epoch(model, opt, loader, steps=3)
    eps5 = engine.accountant.get_epsilon(DELTA)
    with pytest.warns(UserWarning):
        engine.accountant.load_state_dict(older)  # an older state of this run: the 3 later releases stay charged
    assert len(engine.ledger) == 5
    assert engine.accountant.get_epsilon(DELTA) == pytest.approx(eps5, rel=1e-12)
    other, model2, opt2, loader2 = private(accountant="rdp")
    run_epoch(model2, opt2, loader2, steps=1)
    with pytest.raises(ValueError):  # another run's ledger
        engine.accountant.load_state_dict(other.accountant.state_dict())
    assert len(engine.ledger) == 5


def test_load_state_dict_refusals_as_opacus_and_a_bare_history():
    acc = dpopt.PrivacyEngine(accountant="rdp").accountant
    with pytest.raises(ValueError, match="empty"):
        acc.load_state_dict({})
    with pytest.raises(ValueError, match="'prv'"):
        acc.load_state_dict({"history": [], "mechanism": "prv"})
    with pytest.raises(ValueError, match="no ledger"):  # an Opacus accountant's state alone: not a ledger
        acc.load_state_dict({"history": [(1.0, 0.1, 5)], "mechanism": "rdp"})
    acc.load_state_dict({"history": [], "mechanism": "rdp"})  # equal to this (empty) ledger: accepted


def test_accountant_follows_the_engine_ledger_when_it_is_replaced():
    engine, model, opt, loader = private()
    run_epoch(model, opt, loader, steps=2)
    other = dpopt.PrivacyEngine()
    other.ledger = engine.ledger  # e.g. a ledger restored from a checkpoint
    assert other.accountant.steps == 2
    assert other.accountant.get_epsilon(DELTA) == pytest.approx(epsilon(engine.ledger, DELTA, "pld"))


def test_adaptive_clipping_history_is_the_joint_sigma():
    engine, model, opt, loader = private(
        accountant="rdp",
        clipping="adaptive",
        target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2,
        count_share=0.25,
    )
    run_epoch(model, opt, loader, steps=2)
    ((sigma, q, steps),) = engine.accountant.history
    assert (q, steps) == (0.25, 2)
    assert sigma == pytest.approx(1.0, rel=1e-9)  # sigma/sqrt(1-r) and sigma/(2 sqrt(r)) compose back to sigma


def test_ledger_accountant_needs_a_ledger():
    with pytest.raises(TypeError, match="PrivacyLedger"):
        LedgerAccountant(object(), "pld")
