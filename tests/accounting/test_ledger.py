"""Ledger: ε equals dp_accounting's for the equivalent event; float coercion; JSON round trip."""

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpopt.accounting.accountant import epsilon
from dpopt.accounting.events import poisson_composed_step, poisson_gaussian_step
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.engine.reference import PerSampleGrads
from dpopt.privatizer import Privatizer


def _run_privatizer(steps, sigma=1.0, q=0.01):
    priv = Privatizer(sigma, 1.0, expected_batch_size=4.0, sample_rate=q, generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        priv.privatize(PerSampleGrads([torch.randn(3, 2)]))
    return priv.ledger


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_ledger_epsilon_equals_dp_accounting(accountant):
    ledger = _run_privatizer(200, sigma=1.1, q=0.02)
    event = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(1.1)), 200)
    if accountant == "pld":
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    else:
        acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(event)
    assert epsilon(ledger, 1e-5, accountant) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)


def test_composed_event_from_int_or_float32_gives_same_epsilon():
    """dp_accounting's RDP drops later Gaussians when the first multiplier is not a float."""
    ref = poisson_composed_step([1.0, 2.0], 0.01)
    for first in (1, np.float32(1.0), np.int64(1)):
        ev = poisson_composed_step([first, np.float32(2.0)], np.float32(0.01))
        assert epsilon(ev, 1e-5, "rdp") == pytest.approx(epsilon(ref, 1e-5, "rdp"), rel=1e-6)
        assert type(ev.event.events[0].noise_multiplier) is float


def test_ledger_json_round_trip(tmp_path):
    ledger = _run_privatizer(5)
    path = ledger.save(tmp_path / "ledger.json")
    back = PrivacyLedger.load(tmp_path)
    assert len(back) == 5 and back.events() == ledger.events()
    assert back.compacted() == [(poisson_gaussian_step(1.0, 0.01), 5)]
    assert epsilon(back, 1e-5) == pytest.approx(epsilon(ledger, 1e-5))
    assert path.read_text().startswith('{"format": "dpopt-ledger"')


def test_empty_ledger_and_monotone_in_steps():
    assert epsilon(PrivacyLedger(), 1e-5) == 0.0
    eps = [epsilon(_run_privatizer(n), 1e-5) for n in (1, 10, 100)]
    assert 0 < eps[0] < eps[1] < eps[2]


def test_zero_noise_is_infinite_epsilon():
    ledger = PrivacyLedger()
    ledger.record(0, poisson_gaussian_step(0.0, 0.1))
    assert epsilon(ledger, 1e-5) == float("inf")
