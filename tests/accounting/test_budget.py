"""Budget-share split for quantile clipping: σ_grad = σ/√(1−r), 2σ_b = σ/√r recompose to σ."""

import math

import pytest
from dp_accounting import dp_event
from hypothesis import given, settings
from hypothesis import strategies as st

from dpopt.accounting.accountant import dpsgd_epsilon, epsilon
from dpopt.accounting.budget import (
    DEFAULT_COUNT_SHARE,
    BudgetSplit,
    count_share_of,
    default_count_noise_std,
    recompose,
    split_budget,
    split_for_count_noise,
)
from dpopt.accounting.calibration import calibrate_noise_multiplier
from dpopt.accounting.events import poisson_composed_step
from dpopt.accounting.ledger import PrivacyLedger

DELTA = 1e-5


@settings(max_examples=50, deadline=None)
@given(sigma=st.floats(0.05, 50.0), share=st.floats(1e-4, 1 - 1e-4))
def test_split_recomposes_exactly(sigma, share):
    grad, count, r = split_budget(sigma, share)
    assert r == share
    assert grad > sigma and count > sigma
    assert recompose(grad, count) == pytest.approx(sigma, rel=1e-12)
    assert count_share_of(grad, count) == pytest.approx(share, rel=1e-9)


def test_default_share_values():
    split = split_budget(1.0)
    assert isinstance(split, BudgetSplit) and split.count_share == DEFAULT_COUNT_SHARE == 0.05
    assert split.grad_noise_multiplier == pytest.approx(1.0260, abs=1e-4)  # +2.6% gradient noise
    assert split.count_noise_multiplier == pytest.approx(math.sqrt(20), rel=1e-12)
    assert split.count_noise_std == pytest.approx(math.sqrt(20) / 2, rel=1e-12)
    assert split.noise_multiplier == pytest.approx(1.0, rel=1e-12)
    grad, count, share = split  # unpacks as (σ_grad, 2σ_b, r)
    assert (grad, count, share) == tuple(split)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_bad_share_refused(bad):
    with pytest.raises(ValueError, match="count_share must be in"):
        split_budget(1.0, bad)


def test_zero_sigma_refused():
    with pytest.raises(ValueError, match="noise_multiplier > 0"):
        split_budget(0.0)


def test_explicit_count_noise_with_solution():
    split = split_for_count_noise(1.0, count_noise_std=1.0)  # 2σ_b = 2 > σ = 1
    assert split.count_share == pytest.approx(0.25)
    assert split.grad_noise_multiplier == pytest.approx(1 / math.sqrt(0.75))
    assert split.noise_multiplier == pytest.approx(1.0, rel=1e-12)
    same = split_for_count_noise(1.0, count_noise_multiplier=2.0)
    assert same == split


@pytest.mark.parametrize(
    "kwargs", [{"count_noise_std": 0.5}, {"count_noise_multiplier": 0.7}, {"count_noise_std": 0.4}]
)
def test_explicit_count_noise_without_solution_is_refused_with_advice(kwargs):
    with pytest.raises(ValueError) as err:
        split_for_count_noise(1.0, **kwargs)
    msg = str(err.value)
    assert "no budget split exists" in msg and "count_share=0.05" in msg
    assert "B̄ ≥ 11" in msg  # smallest batch size with B̄ > 10σ


def test_bad_arguments():
    with pytest.raises(ValueError, match="not both"):
        split_for_count_noise(1.0, count_noise_std=1.0, count_noise_multiplier=2.0)
    with pytest.raises(ValueError, match="expected_batch_size"):
        split_for_count_noise(1.0)
    with pytest.raises(ValueError, match="expected_batch_size must be > 0"):
        default_count_noise_std(0)


# --- the σ_b = B̄/20 default (Andrew et al. 2021) -----------------------------------------
def _quantile_ledger(split: BudgetSplit, q: float, steps: int) -> PrivacyLedger:
    ledger = PrivacyLedger()
    for step in range(steps):
        ledger.record(step, poisson_composed_step([split.grad_noise_multiplier, split.count_noise_multiplier], q))
    return ledger


def test_b20_default_has_a_split_at_batch_32():
    """B̄ = 32, N = 60,000, 10 epochs, ε = 1, δ = 1e-5: σ ≈ 0.67 < 2σ_b = 3.2, r = (σ/3.2)² ≈ 0.044."""
    batch, n, epochs = 32, 60_000, 10
    q, steps = batch / n, epochs * n // batch
    res = calibrate_noise_multiplier(1.0, DELTA, q, steps, "pld")
    sigma = res.noise_multiplier
    assert sigma == pytest.approx(0.67, abs=0.01) and res.epsilon <= 1.0
    assert default_count_noise_std(batch) == 1.6
    split = split_for_count_noise(sigma, expected_batch_size=batch)
    assert split.count_noise_multiplier == pytest.approx(3.2)
    assert split.count_share == pytest.approx((sigma / 3.2) ** 2, rel=1e-12)
    assert split.count_share == pytest.approx(0.044, abs=0.001)
    # The reported ε of the run with the split equals plain DP-SGD's ε at σ (same accountant).
    ledger = _quantile_ledger(split, q, steps)
    assert epsilon(ledger, DELTA, "pld") == pytest.approx(res.epsilon, rel=1e-6)
    assert epsilon(ledger, DELTA, "rdp") == pytest.approx(dpsgd_epsilon(sigma, q, steps, DELTA, "rdp"), rel=1e-6)


def test_b20_default_refused_at_batch_8():
    """B̄ = 8, σ = 1.0: 2σ_b = 0.8 < σ — no split; the message says what would work."""
    with pytest.raises(ValueError) as err:
        split_for_count_noise(1.0, expected_batch_size=8)
    msg = str(err.value)
    assert "2σ_b = 0.8" in msg and "σ_b = B̄/20 with B̄ = 8" in msg
    assert "count_share=0.05" in msg and "σ_grad = 1.026" in msg
    assert "B̄ ≥ 11" in msg


@pytest.mark.parametrize("share", [0.05, 0.5])
def test_split_ledger_epsilon_equals_plain_rdp(share):
    q, steps, sigma = 0.02, 500, 1.3
    ledger = _quantile_ledger(split_budget(sigma, share), q, steps)
    assert epsilon(ledger, DELTA, "rdp") == pytest.approx(dpsgd_epsilon(sigma, q, steps, DELTA, "rdp"), rel=1e-9)
    # the count really is inside the event: without it ε is smaller
    grad_only = dp_event.SelfComposedDpEvent(
        poisson_composed_step([split_budget(sigma, share).grad_noise_multiplier], q), steps
    )
    assert epsilon(grad_only, DELTA, "rdp") < epsilon(ledger, DELTA, "rdp")
