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
        "no_op",
    ]
    assert not any(r.no_op for r in runs)


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


def _amplified_ledger(path):
    """A BLT ledger over cyclic Poisson sampling (the spectral bound): T = 6, b' = 2, q = 0.3, σ = 1.5."""
    import torch

    from dpopt.correlated_noise import CorrelatedNoise, Participation, optimize_strategy
    from dpopt.engine.reference import PerSampleGrads
    from dpopt.privatizer import Privatizer

    mech = CorrelatedNoise(optimize_strategy("blt", 6, 2), Participation(6, 3, 2), 1.5, sample_rate=0.3)
    priv = Privatizer(1.5, 1.0, 1.0, 1.0, mechanism=mech)
    for _ in range(6):
        priv.privatize(PerSampleGrads([torch.zeros(1, 3)]))
    return priv.ledger.save(path)


def test_entries_that_contradict_the_mechanism_record_are_named(tmp_path):
    """A correlated-noise ledger whose releases were edited (σ of every round tripled, so ε drops) is still
    scored as written, but the report names the contradiction with its own mechanism record (what
    ``dpopt check`` fails) instead of printing the smaller ε silently; an untouched ledger has none."""
    path = _amplified_ledger(tmp_path / "ledger.json")
    clean = ledger_report(path, delta=DELTA)
    assert clean.mechanism_problem is None and clean.to_dict()["mechanism_problem"] is None
    raw = json.loads(path.read_text())
    rounds = [e for e in raw["entries"] if e["event"]["type"] == "PoissonSampledDpEvent"]
    assert len(rounds) == 3
    for e in rounds:
        e["event"]["event"]["noise_multiplier"] *= 3.0
    path.write_text(json.dumps(raw))
    edited = ledger_report(path, delta=DELTA)
    assert edited.epsilon < 0.5 * clean.epsilon  # the edited entries are what is scored
    assert "3 entries disagree with the mechanism record" in edited.mechanism_problem
    assert edited.to_dict()["mechanism_problem"] == edited.mechanism_problem
    from typer.testing import CliRunner

    from dpopt.cli import app

    out = CliRunner().invoke(app, ["ledger", str(path), "--delta", str(DELTA)])
    assert (
        out.exit_code == 0 and "warning: the releases contradict the ledger's correlated-noise mechanism" in out.output
    )


def test_one_participation_is_singular_and_old_ledgers_still_match():
    """k = 1 reads "1 participation"; a ledger written with the old "k=1 participations" still matches its
    record (the accountants and `dpopt check` compare the statements); a different k does not."""
    from dpopt.accounting.matrix_factorization import Participation, same_sampling

    one = Participation(5, 1, 5).sampling
    assert one == "cyclic (k=1 participation, min separation 5)"
    assert Participation(10, 2, 5).sampling == "cyclic (k=2 participations, min separation 5)"
    assert same_sampling("cyclic (k=1 participations, min separation 5)", one)
    assert same_sampling(one, one)
    assert not same_sampling("cyclic (k=2 participations, min separation 5)", one)
    assert not same_sampling("poisson", None)


def test_mechanism_brief_names_kind_size_sigma_and_sensitivity():
    from dpopt.accounting.report import mechanism_brief

    banded = {"kind": "banded", "strategy": {"kind": "banded", "coefficients": [1.0, 0.5, 0.25, 0.1]}}
    banded.update(noise_multiplier=2.0, sensitivity=1.5)
    assert mechanism_brief(banded) == {
        "kind": "banded",
        "bands": 4,
        "noise_multiplier": 2.0,
        "sensitivity": 1.5,
        "sample_rate": None,
    }
    blt = {"kind": "blt", "strategy": {"kind": "blt", "omega": [0.3, 0.2], "theta": [0.9, 0.5]}, "sample_rate": 0.1}
    assert mechanism_brief(blt)["buffers"] == 2 and mechanism_brief(blt)["sample_rate"] == 0.1
    assert mechanism_brief(None) is None
