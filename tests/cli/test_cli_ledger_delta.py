"""``dpopt ledger FILE`` scores at the RUN's δ (issue 33, case 8).

Before (main fb334df): ``dpopt ledger RUN/ledger.json`` looked for ``RUN/ledger.json/summary.json``, found
nothing and scored at δ = 1e-5 (ε 1.85 where the run's δ = 1e-6 gives 2.30; a DPTrainer checkpoint: 6.81
against 8.0). Now δ comes from the summary beside the ledger (``summary.json`` / ``privacy_summary.json``),
else the ledger header's ``delta``, else ``--delta`` is required.
"""

import json

import pytest
from typer.testing import CliRunner

from dpopt.accounting.accountant import epsilon
from dpopt.accounting.events import poisson_gaussian_step
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.cli import app

runner = CliRunner()


def _book(steps=200, sigma=1.0, q=0.02):
    book = PrivacyLedger()
    for step in range(steps):
        book.record(step, poisson_gaussian_step(sigma, q), sensitivity=1.0)
    return book


def _scored(res):
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    return out["delta"], out["epsilon_by_accountant"]["pld"]


@pytest.mark.parametrize(
    "ledger_name, summary_name", [("ledger.json", "summary.json"), ("privacy_ledger.json", "privacy_summary.json")]
)
def test_a_ledger_file_is_scored_at_the_delta_of_the_summary_beside_it(tmp_path, ledger_name, summary_name):
    book = _book()
    book.save(tmp_path / ledger_name)
    (tmp_path / summary_name).write_text(json.dumps({"delta": 1e-6, "accountant": "pld"}))
    want = epsilon(book, 1e-6, "pld")
    assert want > epsilon(book, 1e-5, "pld") * 1.05  # the δ matters
    for target in (tmp_path / ledger_name, tmp_path):  # the file itself, or its directory (a DPTrainer checkpoint)
        delta, eps = _scored(runner.invoke(app, ["ledger", str(target), "--json"]))
        assert delta == 1e-6 and eps == pytest.approx(want, rel=1e-9)


def test_the_ledger_header_delta_is_used_when_no_summary_is_beside(tmp_path):
    book = _book()
    book.delta = 1e-6
    book.save(tmp_path / "alone.json")
    assert json.loads((tmp_path / "alone.json").read_text())["delta"] == 1e-6
    delta, eps = _scored(runner.invoke(app, ["ledger", str(tmp_path / "alone.json"), "--json"]))
    assert delta == 1e-6 and eps == pytest.approx(epsilon(book, 1e-6, "pld"), rel=1e-9)
    delta, _ = _scored(runner.invoke(app, ["ledger", str(tmp_path / "alone.json"), "--delta", "1e-7", "--json"]))
    assert delta == 1e-7  # --delta, when given, wins


def test_no_delta_anywhere_is_an_error_naming_the_flag(tmp_path):
    _book().save(tmp_path / "alone.json")
    res = runner.invoke(app, ["ledger", str(tmp_path / "alone.json")])
    assert res.exit_code == 2 and res.stderr.startswith("error: ") and "--delta" in res.stderr
    assert "records no δ" in res.stderr


def test_a_dptrainer_checkpoint_is_scored_at_the_trainers_delta(tmp_path):
    """DPTrainer writes privacy_ledger.json (header delta) and privacy_summary.json into each checkpoint."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
    from test_trainer import Tokens, gpt2, targs

    from dpopt.hf import DPTrainer

    tr = DPTrainer(
        model=gpt2(),
        args=targs(tmp_path, max_steps=2, save_strategy="steps", save_steps=2),
        train_dataset=Tokens(),
        noise_multiplier=1.0,
        delta=1e-6,
        privacy_unit="record",
    )
    tr.train()
    ckpt = tmp_path / "checkpoint-2"
    assert json.loads((ckpt / "privacy_ledger.json").read_text())["delta"] == 1e-6
    (ckpt / "privacy_summary.json").unlink()  # the header alone is enough
    delta, eps = _scored(runner.invoke(app, ["ledger", str(ckpt / "privacy_ledger.json"), "--json"]))
    assert delta == 1e-6 and eps == pytest.approx(tr.get_epsilon(), rel=1e-9)


def test_a_killed_train_run_is_scored_at_the_delta_of_its_config(tmp_path):
    """A `dpopt train` run killed before its summary: no summary.json, a header without δ; config.json has it."""
    book = _book()
    book.save(tmp_path / "ledger.json")
    (tmp_path / "config.json").write_text(json.dumps({"dataset": "digits", "delta": 1e-6}))
    delta, eps = _scored(runner.invoke(app, ["ledger", str(tmp_path), "--json"]))
    assert delta == 1e-6 and eps == pytest.approx(epsilon(book, 1e-6, "pld"), rel=1e-9)
