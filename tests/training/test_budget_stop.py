"""--max-epsilon: the run stops at the last step within budget (issue 10, item 4)."""

import json

import pytest
from typer.testing import CliRunner

from dpopt.accounting.accountant import epsilon
from dpopt.accounting.events import poisson_composed_step
from dpopt.accounting.incremental import EpsilonTracker
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.ledger_check import check_run
from dpopt.cli import app


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_cli_stops_at_the_last_step_within_budget(tmp_path, accountant):
    out = tmp_path / "r"
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--method",
            "dp-sgd",
            "--epochs",
            "3",
            "--max-epsilon",
            "2",
            "--accountant",
            accountant,
            "--out",
            str(out),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout.strip().splitlines()[-1])
    assert s["status"] == "budget_exhausted" and s["steps"] < s["planned_steps"] and s["max_epsilon"] == 2
    assert "stopped at the ε budget" in res.stdout
    ledger = PrivacyLedger.load(out)
    assert len(ledger) == s["steps"]
    assert s["epsilon"] == epsilon(ledger, 1e-5, accountant) <= 2.0
    one_more = PrivacyLedger()
    for _ in range(s["steps"] + 1):
        one_more.record(0, ledger.entries[0].event)
    assert epsilon(one_more, 1e-5, accountant) > 2.0  # the next step would have exceeded the budget
    assert check_run(out).passed


def test_tracker_cache_and_bound():
    ev = poisson_composed_step([1.0], 0.05)
    ledger = PrivacyLedger()
    tracker = EpsilonTracker(1e-5, "pld", max_epsilon=3.0)
    k = tracker.releases_within_budget(ledger, ev, 10_000)
    calls = tracker.calls
    for i in range(5):
        ledger.record(i, ev)
    assert tracker.releases_within_budget(ledger, ev, 10_000) == k - 5 and tracker.calls == calls  # cached
    assert tracker.releases_within_budget(ledger, poisson_composed_step([2.0], 0.05), 10_000) > k  # new event
    assert tracker.bound(ledger) == pytest.approx(epsilon(ledger, 1e-5, "rdp"), rel=1e-9)
    assert tracker.bound(ledger) >= epsilon(ledger, 1e-5, "pld")
    assert EpsilonTracker(1e-5, "pld").releases_within_budget(ledger, ev, 7) == 7  # no budget
