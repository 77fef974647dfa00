"""dpopt.accounting.report: a run's ledger grouped into runs and re-scored (what `dpopt ledger` prints)."""

import json
import math

import pytest
from dp_accounting import dp_event

from dpopt.accounting.accountant import epsilon
from dpopt.accounting.events import gaussian_event, poisson_gaussian_step
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.report import LedgerReport, ReleaseRun, ledger_report, ledger_runs
from dpopt.errors import ConfigError

DELTA = 1e-5


def _book():
    book = PrivacyLedger()
    for step in range(3):
        book.record(step, poisson_gaussian_step(1.0, 0.01), sensitivity=1.0 + step)
    for step in range(3, 5):
        book.record(step, poisson_gaussian_step(2.0, 0.02))
    book.record(5, gaussian_event(4.0))
    return book


def test_runs_group_consecutive_equal_events():
    runs = ledger_runs(_book())
    assert [(r.first_step, r.last_step, r.count) for r in runs] == [(0, 2, 3), (3, 4, 2), (5, 5, 1)]
    assert runs[0] == ReleaseRun(0, 2, 3, [0.01], [1.0], [1.0], [], 1.0, 3.0)
    assert runs[1].sensitivity_min is None and runs[1].sample_rates == [0.02]
    assert runs[2].sample_rates == [] and runs[2].noise_multipliers == [4.0]
    assert list(runs[0].to_dict()) == [
        "first_step",
        "last_step",
        "count",
        "sample_rates",
        "noise_multipliers",
        "sigma_eff",
        "unsupported",
        "sensitivity_min",
        "sensitivity_max",
    ]


def test_report_scores_every_accountant_with_the_run_defaults(tmp_path):
    book = _book()
    book.save(tmp_path / "ledger.json")
    (tmp_path / "summary.json").write_text(json.dumps({"delta": DELTA, "accountant": "rdp", "epsilon": 1.0}))
    report = ledger_report(tmp_path)
    assert isinstance(report, LedgerReport)
    assert report.delta == DELTA and report.accountant == "rdp" and report.releases == 6
    assert report.epsilon == report.epsilon_by_accountant["rdp"]
    assert report.epsilon_by_accountant["pld"] == pytest.approx(epsilon(book, DELTA, "pld"), rel=1e-12)
    assert set(report.epsilon_by_accountant) == {"pld", "rdp", "prv"}
    assert report.summary_epsilon == 1.0 and report.summary_accountant == "rdp"
    doc = report.to_dict()
    assert json.loads(json.dumps(doc)) == doc
    assert doc["epsilon"] == doc["epsilon_by_accountant"]["rdp"] and doc["epsilon_summary"] == 1.0
    assert ledger_report(tmp_path, accountant="PLD", delta=1e-6).accountant == "pld"


def test_report_infinite_epsilon_and_failing_accountants(tmp_path):
    book = PrivacyLedger()
    book.record(0, dp_event.NonPrivateDpEvent())
    book.save(tmp_path / "ledger.json")
    report = ledger_report(tmp_path, delta=DELTA)
    values = report.epsilon_by_accountant.values()
    assert all((isinstance(v, float) and math.isinf(v)) or str(v).startswith("n.a.: ") for v in values)
    assert all(v == "inf" or str(v).startswith("n.a.: ") for v in report.to_dict()["epsilon_by_accountant"].values())


def test_report_errors_name_the_argument(tmp_path):
    _book().save(tmp_path / "ledger.json")
    with pytest.raises(ConfigError) as info:  # no summary.json, no delta in the header: no silent default δ
        ledger_report(tmp_path)
    assert info.value.arguments == ("delta",)
    with pytest.raises(ConfigError) as info:
        ledger_report(tmp_path, delta=1.5)
    assert info.value.arguments == ("delta",)
    with pytest.raises(ValueError, match="unknown accountant"):
        ledger_report(tmp_path, accountant="nope", delta=DELTA)
    with pytest.raises((FileNotFoundError, ValueError)):
        ledger_report(tmp_path / "missing", delta=DELTA)
