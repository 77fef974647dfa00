"""The CLI in the field's language: TF Privacy-style schedules, δ default, --version, help layout, file errors."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dpopt import __version__
from dpopt.cli import app

runner = CliRunner()
TF_ARGS = ["--dataset-size", "60000", "--batch-size", "256", "--epochs", "5"]


def test_account_with_dataset_size_batch_size_epochs_matches_tf_privacy():
    res = runner.invoke(app, ["account", *TF_ARGS, "--noise-multiplier", "1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["epsilon"] == pytest.approx(0.784, abs=5e-4)  # delta defaults to 1e-5, pld
    assert out["delta"] == 1e-5 and out["steps"] == 1172 and out["sample_rate"] == 256 / 60000
    direct = runner.invoke(
        app, ["account", "--noise-multiplier", "1", "--sample-rate", str(256 / 60000), "--steps", "1172", "--json"]
    )
    assert json.loads(direct.stdout)["epsilon"] == out["epsilon"]


def test_calibrate_takes_the_same_schedule():
    res = runner.invoke(app, ["calibrate", "--target-epsilon", "0.784", *TF_ARGS, "--accountant", "rdp", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["steps"] == 1172 and out["delta"] == 1e-5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sample-rate", "0.01", "--epochs", "3"], "error: give either --sample-rate and --steps, or --dataset-size"),
        (["--dataset-size", "100", "--epochs", "3"], "error: --batch-size is required with --dataset-size, --epochs"),
        (
            ["--dataset-size", "100", "--batch-size", "200", "--epochs", "1"],
            "error: --batch-size must be in (0, N = 100]",
        ),
        (["--sample-rate", "0.01"], "error: --steps is required"),
        ([], "error: --sample-rate and --steps are required"),
    ],
)
def test_schedule_errors(args, message):
    for command in (["account", "--noise-multiplier", "1"], ["calibrate", "--target-epsilon", "1"]):
        res = runner.invoke(app, [*command, *args])
        assert res.exit_code == 2 and res.stderr.startswith(message), res.output


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.strip() == f"dpopt {__version__}"


def test_unknown_accountant_lists_the_choices_in_words():
    res = runner.invoke(
        app, ["account", "--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "10", "--accountant", "foo"]
    )
    assert res.exit_code == 2
    assert res.stderr.startswith("error: unknown accountant 'foo' for --accountant; choose pld (privacy loss")
    assert "rdp (Rényi DP" in res.stderr and "or prv (privacy random variables" in res.stderr


def test_help_names_are_not_truncated_and_flags_have_no_type():
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH", "LINES")}
    res = subprocess.run(
        [sys.executable, "-m", "dpopt", "train", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0
    assert "…" not in res.stdout and "--reproducible-noise" in res.stdout and "--physical-batch-size" in res.stdout
    assert "<bool>" not in res.stdout
    account = runner.invoke(app, ["account", "--help"]).stdout
    assert "--dataset-size" in account and "<bool>" not in account


def test_run_file_errors_name_the_file(tmp_path):
    ledger = tmp_path / "ledger.json"
    ledger.write_text("{not json")
    for command in (
        ["ledger", str(tmp_path), "--delta", "1e-5"],
        ["check", str(tmp_path)],
        ["ledger", str(ledger), "--delta", "1e-5"],
    ):
        res = runner.invoke(app, command)
        assert res.exit_code == 2 and res.stderr.startswith(f"error: {ledger}: is not valid JSON"), res.output
    ledger.write_text('{"format": "dpopt-ledger", "version": 1}')
    res = runner.invoke(app, ["ledger", str(tmp_path), "--delta", "1e-5"])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: {ledger}: is not a readable dpopt ledger")
    from dpopt.accounting.ledger import PrivacyLedger

    PrivacyLedger().save(ledger)
    (tmp_path / "summary.json").write_text("[1, 2]")
    res = runner.invoke(app, ["check", str(tmp_path)])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: {tmp_path / 'summary.json'}: must hold a JSON object")
