"""``dpopt account``, ``calibrate``, ``ledger`` and ``check``: errors and the ledger table.

More of these commands' tests sit next to the accounting they exercise
(tests of calibration, the ledger check and the accountants' bounds).
"""

import json

from typer.testing import CliRunner

from dpopt.accounting.events import poisson_gaussian_step
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.cli import app

runner = CliRunner()


def test_tiny_noise_multiplier_gets_advice_not_a_traceback():
    res = runner.invoke(
        app, ["account", "--noise-multiplier", "1e-3", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5"]
    )
    assert res.exit_code == 2 and "--accountant rdp" in res.output


def _ledger(path, steps=5, sigma=1.0, q=0.01):
    book = PrivacyLedger()
    for step in range(steps):
        book.record(step, poisson_gaussian_step(sigma, q), sensitivity=1.0 + step / 10)
    book.save(path / "ledger.json")
    return book


def test_ledger_without_summary_requires_delta(tmp_path):
    _ledger(tmp_path)
    res = runner.invoke(app, ["ledger", str(tmp_path)])  # before: scored at 1e-5 silently
    assert res.exit_code == 2 and "records no δ" in res.stderr and "--delta" in res.stderr
    res = runner.invoke(app, ["ledger", str(tmp_path), "--delta", "2"])
    assert res.exit_code == 2 and res.stderr.startswith("error: --delta must be in (0, 1)")
    res = runner.invoke(app, ["ledger", str(tmp_path), "--delta", "1e-5", "--accountant", "nope"])
    assert res.exit_code == 2 and "unknown accountant 'nope'" in res.stderr
    res = runner.invoke(app, ["ledger", str(tmp_path / "missing"), "--delta", "1e-5"])
    assert res.exit_code == 2 and res.stderr.startswith("error: ")


def test_ledger_prints_the_library_report(tmp_path):
    from dpopt.accounting.report import ledger_report

    _ledger(tmp_path)
    res = runner.invoke(app, ["ledger", str(tmp_path), "--delta", "1e-5", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == json.loads(json.dumps(ledger_report(tmp_path, delta=1e-5).to_dict()))
    text = runner.invoke(app, ["ledger", str(tmp_path), "--delta", "1e-5"]).stdout
    assert "steps 0-4 (5x): q = 0.01, Gaussians sigma = 1 -> sigma_eff = 1, sensitivity 1-1.4" in text
    assert "pld: " in text and " *" in text


def test_calibrate_ctrl_c_exits_130(monkeypatch):
    import dpopt.accounting.calibration as cal

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cal, "calibrate_noise_multiplier", interrupted)
    res = runner.invoke(
        app, ["calibrate", "--target-epsilon", "2", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"]
    )
    assert res.exit_code == 130
    assert res.stderr.strip() == "error: calibration interrupted; no noise multiplier was chosen"


def test_check_on_a_saved_ledger_alone_points_to_dpopt_ledger(tmp_path):
    """A directory holding only engine.ledger.save(...)'s ledger.json is not a `dpopt train` run: `dpopt check`
    says what it checks and which command scores the ledger, not "killed ... --resume"; a dpopt train run killed
    before its summary (config.json present) gets advice that fits it: without a checkpoint, no --resume (it would
    fail) but the charged releases and another --out; with one, the resume advice."""
    run = tmp_path / "dl_mf"
    run.mkdir()
    _ledger(run)
    res = runner.invoke(app, ["check", str(run)])
    assert res.exit_code == 2
    line = res.stderr.strip()
    assert "\n" not in line and "--resume" not in line and "killed" not in line
    assert "`dpopt check` checks `dpopt train` run directories" in line
    assert f"`dpopt ledger {run / 'ledger.json'}` scores a saved ledger" in line
    (run / "config.json").write_text("{}")
    res = runner.invoke(app, ["check", str(run)])
    assert res.exit_code == 2 and "--resume" not in res.stderr and "cannot continue" in res.stderr, res.stderr
    assert f"holds {len(PrivacyLedger.load(run))} charged release(s)" in res.stderr and "another --out" in res.stderr
    (run / "checkpoint.pt").write_bytes(b"")
    res = runner.invoke(app, ["check", str(run)])
    assert res.exit_code == 2 and f"dpopt train --resume {run}" in res.stderr
