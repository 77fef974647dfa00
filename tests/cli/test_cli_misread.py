"""Figures a user could misread and messages that did not say what to change (issue 39).

Before (main 7967c13): ``dpopt report --rows nokey`` exited 0 and pooled every run into one cell (an ε row of
2.472, the mean of 3.916 and 1.027); ``sweep --dry-run`` listed an unknown method as "todo"; ``--hp
momentum=abc`` said "could not convert string to float: 'abc'"; ``--hp lr=0.01 --lr 0.1`` silently trained at
0.1; ``--target-quantile`` with flat clipping was ignored; ``diagnose --checkpoint runs/nothere`` gave a raw
Errno; the RDP accountant printed dp_accounting's "failed to converge" warning (with its source line) for an
ordinary σ = 1.1, q = 0.083; ``errors.translate`` turned ``runs/x/model.pt`` into ``runs/x/--model.pt``.
"""

import json
import math

import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from typer.testing import CliRunner

from dpopt.accounting.events import poisson_gaussian_step
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.rdp import RDP_ORDERS, _excluded_note, rdp_epsilon_report, unconverged_orders
from dpopt.cli import app
from dpopt.errors import ConfigError, translate
from dpopt.methods import get_method

runner = CliRunner()


def _one_line_error(res, *needles):
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# --------------------------------------------------------------------------- report keys
def _results(tmp_path):
    path = tmp_path / "results.jsonl"
    rows = [("dp-sgd", 0.5, 3.916, 0.8), ("dp-adam", 1.0, 1.027, 0.7)]
    path.write_text(
        "".join(
            json.dumps(
                {
                    "method": m,
                    "label": m,
                    "noise_multiplier": s,
                    "epsilon": e,
                    "test_accuracy": a,
                    "point": {"noise_multiplier": s, "label": m},
                }
            )
            + "\n"
            for m, s, e, a in rows
        )
    )
    return path


@pytest.mark.parametrize("flag", ["--rows", "--cols"])
def test_report_refuses_a_key_no_record_has(tmp_path, flag):
    res = runner.invoke(app, ["report", str(_results(tmp_path)), "--out", str(tmp_path / "o"), flag, "nokey"])
    line = _one_line_error(res, f"{flag} nokey", "pooled")
    listed = line.split("choose one of: ")[1].split(", ")
    assert {"label", "method", "noise_multiplier", "epsilon"} <= set(listed)
    assert not (tmp_path / "o").exists()  # nothing written


def test_report_with_known_keys_still_separates_the_runs(tmp_path):
    res = runner.invoke(
        app, ["report", str(_results(tmp_path)), "--out", str(tmp_path / "o"), "--rows", "method", "--no-plots"]
    )
    assert res.exit_code == 0, res.output
    assert "3.916" in res.stdout and "1.027" in res.stdout and "2.47" not in res.stdout


# --------------------------------------------------------------------------- sweep --dry-run
def test_sweep_dry_run_refuses_an_unknown_method(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text('[base]\ndataset = "digits"\nepochs = 0.1\n[grid]\nmethod = ["dp-sgd", "nomethod"]\n')
    res = runner.invoke(app, ["sweep", str(cfg), "--dry-run", "--out", str(tmp_path / "sw")])
    _one_line_error(res, "unknown method 'nomethod'", "dp-sgd")
    assert "todo" not in res.stdout


# --------------------------------------------------------------------------- train options
@pytest.mark.parametrize(
    "args, needles",
    [
        (["--method", "dp-sgd", "--hp", "momentum=abc"], ["--hp momentum must be a number", "'abc'"]),
        (["--method", "dp-muon", "--hp", "ns_steps=2.5"], ["--hp ns_steps must be an integer"]),
        (["--method", "dp-adam", "--hp", "betas=0.9"], ["--hp betas must be a tuple of 2 numbers"]),
        (["--method", "dp-sgd", "--hp", "lr=0.01", "--lr", "0.1"], ["--hp lr=0.01 and --lr 0.1", "give one"]),
        (["--hp", "max_grad_norm=2", "--max-grad-norm", "1"], ["--hp max_grad_norm=2 and --max-grad-norm 1"]),
        (["--target-quantile", "0.3"], ["--target-quantile applies to --clipping quantile only", "flat"]),
        (["--quantile-lr", "0.1", "--clipping", "auto"], ["--quantile-lr applies to --clipping quantile", "auto"]),
    ],
)
def test_train_refuses_bad_or_conflicting_options_before_training(tmp_path, args, needles):
    out = tmp_path / "run"
    res = runner.invoke(app, ["train", "--epochs", "0.05", "--out", str(out), *args])
    _one_line_error(res, *needles)
    assert not out.exists()


def test_hparam_types_in_the_library():
    spec = get_method("dp-sgd")
    assert spec.hparams(momentum=1)["momentum"] == 1  # an integer is a number
    with pytest.raises(ConfigError, match=r"momentum must be a number \(default 0.0\), got 'abc'") as info:
        spec.hparams(momentum="abc")
    assert info.value.arguments == ("momentum",)
    with pytest.raises(ConfigError, match="nesterov must be True or False"):
        get_method("dp-muon").hparams(nesterov="yes")


def test_library_refuses_lr_given_twice(tmp_path):
    from dpopt.training import TrainConfig
    from dpopt.training.config import validate_config

    validate_config(TrainConfig(lr=0.1, hparams={"lr": 0.1}), 1000)  # the same value twice: fine
    with pytest.raises(ConfigError, match=r"lr is given twice \(0.1 and hparams lr=0.01\)"):
        validate_config(TrainConfig(lr=0.1, hparams={"lr": 0.01}), 1000)


# --------------------------------------------------------------------------- diagnose --checkpoint
@pytest.mark.parametrize("make", ["missing", "file", "empty"])
def test_diagnose_checkpoint_that_is_not_a_run_is_one_line(tmp_path, make):
    ckpt = tmp_path / "nothere"
    if make == "file":
        ckpt.write_text("x")
    elif make == "empty":
        ckpt.mkdir()
    # no --noise-multiplier: the checkpoint is checked first (a fresh user typed just this)
    res = runner.invoke(app, ["diagnose", "--checkpoint", str(ckpt), "--out", str(tmp_path / "d")])
    want = {"missing": "does not exist", "file": "is a file", "empty": "has no config.json or model.pt"}[make]
    _one_line_error(res, f"--checkpoint {ckpt} {want}")
    assert "Errno" not in res.output and not (tmp_path / "d").exists()


# --------------------------------------------------------------------------- errors.translate
def test_translate_leaves_paths_alone():
    exc = ConfigError("runs/mnist1/model.pt does not fit the model (model.x, model, ./model); model.", "model")
    assert translate(exc, {"model": "--model"}) == (
        "runs/mnist1/model.pt does not fit the --model (model.x, --model, ./model); --model."
    )
    exc = ConfigError("C:\\runs\\model does not fit model", "model")
    assert translate(exc, {"model": "--model"}) == "C:\\runs\\model does not fit --model"


# --------------------------------------------------------------------------- RDP: unconverged orders
def test_rdp_unconverged_orders_are_not_printed_and_epsilon_is_that_of_the_other_orders(capfd):
    book = PrivacyLedger()
    for step in range(100):
        book.record(step, poisson_gaussian_step(1.1, 0.083))
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")  # no AccountingWarning, no RuntimeWarning
        report = rdp_epsilon_report(book, 1e-5)
    assert report.notes == ()
    err = capfd.readouterr().err
    assert "failed to converge" not in err
    # the same ε as dp_accounting over the orders that converge (1.1-1.3 left out by dp_accounting itself)
    kept = [a for a in RDP_ORDERS if a > 1.35]
    acc = rdp_privacy_accountant.RdpAccountant(kept)
    acc.compose(poisson_gaussian_step(1.1, 0.083), 100)
    assert report.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    assert 5.0 < report.epsilon < 6.0  # the value `dpopt account` printed before (5.47718)


def test_rdp_states_excluded_orders_only_when_the_best_order_is_next_to_them():
    msgs = [
        "_compute_log_a_frac failed to converge after 1000 iterations with q=0.083000, sigma=1.100000, "
        "alpha=1.100000. Excluding this order from the epsilon computation.",
        "something else",
    ]
    assert unconverged_orders(msgs) == ([1.1], ["something else"])
    assert _excluded_note([1.1, 1.2], 12.0, RDP_ORDERS) == ()  # the optimum is far away: ε unaffected
    (note,) = _excluded_note([1.1, 1.2], 1.3, RDP_ORDERS)  # the optimum at the edge: said, in words
    assert "α = 1.1, 1.2" in note and "upper bound" in note
    assert _excluded_note([1.1], math.inf, RDP_ORDERS) != ()


def test_cli_account_rdp_prints_no_library_warning():
    res = runner.invoke(
        app, ["account", "--noise-multiplier", "1.1", "--sample-rate", "0.083", "--steps", "100", "--accountant", "rdp"]
    )
    assert res.exit_code == 0 and res.stderr == "", res.stderr
    assert res.stdout.startswith("epsilon = 5.477")


# --------------------------------------------------------------------------- ledger at the run's δ
def test_ledger_states_a_delta_override(tmp_path):
    book = PrivacyLedger()
    for step in range(50):
        book.record(step, poisson_gaussian_step(1.0, 0.02), sensitivity=1.0)
    book.delta = 1e-6
    book.save(tmp_path / "alone.json")
    res = runner.invoke(app, ["ledger", str(tmp_path / "alone.json")])
    assert res.exit_code == 0 and "epsilon at delta = 1e-06 (the run's;" in res.stdout and res.stderr == ""
    res = runner.invoke(app, ["ledger", str(tmp_path / "alone.json"), "--delta", "1e-5"])
    assert res.exit_code == 0 and "epsilon at delta = 1e-05 (--delta;" in res.stdout
    assert "not at the run's own delta 1e-06" in res.stderr
    res = runner.invoke(app, ["ledger", str(tmp_path / "alone.json"), "--delta", "1e-5", "--json"])
    out = json.loads(res.stdout)
    assert out["delta"] == 1e-5 and out["run_delta"] == 1e-6


def test_ledger_reads_a_trainer_checkpoint_directory_with_or_without_its_summary(tmp_path):
    """A DPTrainer checkpoint-N/ holds privacy_ledger.json (+ privacy_summary.json, which `dpopt check` needs)."""
    from dpopt.accounting.accountant import epsilon

    book = PrivacyLedger()
    for step in range(40):
        book.record(step, poisson_gaussian_step(1.0, 0.02), sensitivity=1.0)
    book.delta = 1e-6
    ckpt = tmp_path / "checkpoint-40"
    ckpt.mkdir()
    book.save(ckpt / "privacy_ledger.json")
    res = runner.invoke(app, ["ledger", str(ckpt), "--json"])
    assert res.exit_code == 0, res.output  # before: "no ledger at checkpoint-40/ledger.json"
    out = json.loads(res.stdout)
    assert out["delta"] == 1e-6 and out["releases"] == 40
    assert out["epsilon_by_accountant"]["pld"] == pytest.approx(epsilon(book, 1e-6, "pld"), rel=1e-9)
    (ckpt / "privacy_summary.json").write_text(json.dumps({"delta": 1e-6, "accountant": "rdp", "epsilon": 1.0}))
    out = json.loads(runner.invoke(app, ["ledger", str(ckpt), "--json"]).stdout)
    assert out["accountant"] == "rdp" and out["delta"] == 1e-6
