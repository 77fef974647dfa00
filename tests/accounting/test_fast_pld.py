"""The vectorised PLD construction of calibration's cheap levels (``dpopt.accounting.pld.fast_pld_epsilon``), and
that the ε calibration REPORTS never comes from it.

* δ(ε_k) of every grid point, vectorised, against dp_accounting's own per-point
  ``GaussianPrivacyLoss.get_delta_for_epsilon`` for both adjacencies: equal to 1e-15 absolute (the same
  formulas; the points include ε = 0, where dp_accounting takes its ``b == 0`` branch, and the sampled
  limit log(1 − q));
* ε of T composed steps: fast against ``pld_epsilon`` (dp_accounting's construction) to 1e-9 relative;
* a deliberately wrong fast builder (δ × 1.001) can move the search but not the reported ε: the calibration's
  result equals dp_accounting's ε at the returned σ (``PLDAccountant``, no dpopt code) to rounding, and meets
  the target there — the final check is the library's construction.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.pld import privacy_loss_mechanism as plm

from dpopt.accounting import pld
from dpopt.accounting.calibration import calibrate_noise_multiplier
from dpopt.accounting.events import dpsgd_event

CASES = [(0.85, 0.00512, 1e-4), (2.35, 0.08192, 1e-3), (0.5, 0.3, 1e-3), (1.0, 0.999, 1e-3), (0.3, 0.01, 1e-3)]


def _grid(mech, d):
    b = mech.connect_dots_bounds()
    return np.arange(math.floor(b.epsilon_lower / d), math.ceil(b.epsilon_upper / d) + 1) * d


@pytest.mark.parametrize("sigma,q,d", CASES)
def test_vector_deltas_equal_dp_accountings_per_point_loop(sigma, q, d):
    for adjacency in (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD):
        mech = plm.GaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=adjacency)
        eps = _grid(mech, d)
        special = np.array([0.0, math.log1p(-q), -math.log1p(-q), math.log1p(-q) * (1 + 1e-12)])
        eps = np.concatenate([eps, special])
        want = mech.get_delta_for_epsilon(eps)
        got = pld._vector_deltas(mech, eps, q, adjacency == plm.AdjacencyType.REMOVE)
        assert got.shape == want.shape and np.all((got >= 0) & (got <= 1))
        assert np.max(np.abs(got - want)) <= 1e-15, adjacency
        assert want.max() >= 0.9 * q  # the grid reaches the divergence's bulk (δ up to ≈ q), not only its tails


@pytest.mark.parametrize("sigma,q,d", CASES)
def test_fast_epsilon_equals_the_library_construction(sigma, q, d):
    event = dpsgd_event(sigma, q, 200)
    fast, exact = pld.fast_pld_epsilon(event, 1e-5, d), pld.pld_epsilon(event, 1e-5, d)
    assert exact > 0 and fast == pytest.approx(exact, rel=1e-9)


def test_fast_path_keeps_replace_one_on_the_library():
    ledger = dpsgd_event(1.0, 0.01, 10)
    from dp_accounting.privacy_accountant import NeighboringRelation

    a = pld._fast_sampled_gaussian_pld(1.0, 0.01, 1e-3, NeighboringRelation.REPLACE_ONE)
    assert a is pld._sampled_gaussian_pld(1.0, 0.01, 1e-3, NeighboringRelation.REPLACE_ONE)
    assert pld.fast_pld_epsilon(ledger, 1e-5, 1e-3) == pld.pld_epsilon(ledger, 1e-5, 1e-3)


def _dp_accounting(sigma, q, steps, delta=1e-5):
    acc = PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
        )
    )
    return float(acc.get_epsilon(delta))


@pytest.mark.parametrize("perturb", [1.0, 1.001])
def test_reported_epsilon_is_dp_accountings_at_the_returned_sigma(monkeypatch, perturb):
    """With the fast builder honest (1.0) or wrong (δ × 1.001: the cheap levels' ε too large), the reported ε
    is dp_accounting's own at the returned σ (to rounding: never a smaller value from the fast path) and ≤ target."""
    original = pld._vector_deltas
    monkeypatch.setattr(pld, "_vector_deltas", lambda *a: np.clip(original(*a) * perturb, 0, 1))
    pld._fast_sampled_gaussian_pld.cache_clear()
    try:
        q, steps = 0.04096, 1221  # Table 16, B = 2048
        res = calibrate_noise_multiplier(4.0, 1e-5, q, steps)
    finally:
        pld._fast_sampled_gaussian_pld.cache_clear()
    exact = _dp_accounting(res.noise_multiplier, q, steps)
    assert exact <= 4.0
    assert res.epsilon == pytest.approx(exact, rel=1e-9, abs=0)
    assert res.epsilon == pld.pld_epsilon(dpsgd_event(res.noise_multiplier, q, steps), 1e-5)  # the library's
    assert res.noise_multiplier == pytest.approx(1.733, rel=2e-3)  # still the tight σ (within the search's rtol)
