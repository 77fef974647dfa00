"""A validation split carved from the training set (issue 11, item 5): ``validation_fraction``.

floor(F·N + 1/2) training records (a fixed public permutation) are held out before anything else: never trained
on, evaluated like the test set (val_accuracy / val_loss), no protection; N, q and the ledger are those of the
remaining records. F = 0 is the behaviour without the option.
"""

import dataclasses
import json
import math
import warnings

import pytest
import torch
from typer.testing import CliRunner

from dpopt.cli import app
from dpopt.data import load_dataset, split_validation, validation_indices, validation_size
from dpopt.errors import ConfigError
from dpopt.models import build_model
from dpopt.training import TrainConfig, build_run, train, validate_config

N_DIGITS = 1437  # the bundled digits' fixed training split
# the summary keys of a flat-clipping dp-sgd run before validation_fraction existed
OLD_SUMMARY_KEYS = {
    "method",
    "dataset",
    "model",
    "test_accuracy",
    "test_loss",
    "epsilon",
    "delta",
    "noise_multiplier",
    "max_grad_norm",
    "clipping",
    "sample_rate",
    "expected_batch_size",
    "steps",
    "epochs",
    "lr",
    "accountant",
    "seed",
    "num_parameters",
    "noise",
    "dataset_size",
    "privatizer_reads",
    "privatizer_releases",
    "wall_seconds",
    "run_dir",
    "check",
    "ledger_run_id",
    "segments",
    "status",
    "planned_steps",
}  # status: every summary since issue 22
OLD_ROW_KEYS = {"epoch", "step", "test_accuracy", "test_loss", "epsilon"}


@pytest.mark.parametrize(
    "n, fraction, held_out",
    [
        (N_DIGITS, 0.1, 144),  # 143.7 -> 144
        (N_DIGITS, 0.25, 359),  # 359.25 -> 359
        (60000, 0.1, 6000),
        (5, 0.5, 3),  # 2.5 -> 3: halves round up (Python's round() would give 2)
        (7, 0.5, 4),  # 3.5 -> 4
        (10, 0.0, 0),
    ],
)
def test_indices_are_disjoint_cover_and_hold_out_floor_fn_plus_half(n, fraction, held_out):
    assert validation_size(n, fraction) == held_out == math.floor(fraction * n + 0.5)
    train_idx, val_idx = validation_indices(n, fraction)
    assert len(val_idx) == held_out and len(train_idx) == n - held_out
    assert set(train_idx.tolist()).isdisjoint(val_idx.tolist())
    assert sorted(train_idx.tolist() + val_idx.tolist()) == list(range(n))
    assert train_idx.tolist() == sorted(train_idx.tolist()) and val_idx.tolist() == sorted(val_idx.tolist())
    again = validation_indices(n, fraction)  # a fixed public choice: the same every time
    assert torch.equal(again[0], train_idx) and torch.equal(again[1], val_idx)


def test_split_shrinks_the_training_set_and_leaves_the_test_set_alone():
    data = load_dataset("digits")
    split = split_validation(data, 0.1)
    train_idx, val_idx = validation_indices(N_DIGITS, 0.1)
    assert split.n_train == N_DIGITS - round(0.1 * N_DIGITS) == 1293
    assert torch.equal(split.x_train, data.x_train[train_idx]) and torch.equal(split.y_train, data.y_train[train_idx])
    assert torch.equal(split.x_val, data.x_train[val_idx]) and torch.equal(split.y_val, data.y_train[val_idx])
    assert split.x_test is data.x_test and split.y_test is data.y_test  # untouched
    assert data.x_val is None and data.n_train == N_DIGITS  # the input is not modified
    assert split_validation(data, 0.0) is data
    # the permutation does not depend on the records: the same positions for other data of the same size
    shuffled = dataclasses.replace(data, x_train=data.x_train.flip(0), y_train=data.y_train.flip(0))
    assert torch.equal(split_validation(shuffled, 0.1).x_val, data.x_train.flip(0)[val_idx])


def test_run_trains_on_the_rest_and_reports_val_accuracy_of_the_saved_model(tmp_path):
    data = load_dataset("digits")
    n_rest = N_DIGITS - validation_size(N_DIGITS, 0.2)
    cfg = TrainConfig(
        dataset="digits",
        method="dp-sgd",
        epochs=1.0,
        seed=3,
        accountant="rdp",
        validation_fraction=0.2,
        out=str(tmp_path / "r"),
    )
    run = build_run(dataclasses.replace(cfg, out=None), data)
    assert run.data.n_train == n_rest and run.sample_rate == 64 / n_rest and data.n_train == N_DIGITS
    summary = train(cfg, data=data)
    assert summary["sample_rate"] == 64 / n_rest and summary["steps"] == round(1.0 / (64 / n_rest))
    assert summary["validation_fraction"] == 0.2 and summary["check"] == "pass"
    ledger = json.loads((tmp_path / "r" / "ledger.json").read_text())
    assert {e["event"]["sampling_probability"] for e in ledger["entries"]} == {64 / n_rest}
    # val_accuracy by hand: the saved model on the held-out records
    _, val_idx = validation_indices(N_DIGITS, 0.2)
    model = build_model(summary["model"], "digits")
    model.load_state_dict(torch.load(tmp_path / "r" / "model.pt"))
    model.eval()
    with torch.no_grad():
        out = model(data.x_train[val_idx])
    y = data.y_train[val_idx]
    assert summary["val_accuracy"] == int((out.argmax(1) == y).sum()) / len(y)  # exactly: a count over 287
    assert summary["val_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(out, y)), rel=1e-5)
    with torch.no_grad():
        test_out = model(data.x_test)
    assert summary["test_accuracy"] == int((test_out.argmax(1) == data.y_test).sum()) / len(data.y_test)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(set(r) == OLD_ROW_KEYS | {"val_accuracy", "val_loss"} for r in rows)
    assert rows[-1]["val_accuracy"] == summary["val_accuracy"]


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 1.5, float("nan"), float("inf"), "a tenth", True])
def test_bad_fractions_raise_config_error_naming_the_field(fraction):
    with pytest.raises(ConfigError, match="validation_fraction") as info:
        validate_config(TrainConfig(validation_fraction=fraction), N_DIGITS)
    assert info.value.arguments == ("validation_fraction",)
    with pytest.raises(ConfigError, match="validation_fraction"):
        build_run(TrainConfig(validation_fraction=fraction), load_dataset("digits"))


def test_fractions_that_hold_out_nothing_or_everything_are_refused():
    data = load_dataset("digits")
    with pytest.raises(ConfigError, match="holds out none") as info:
        split_validation(data, 1e-4)  # 0.14 records
    assert info.value.arguments == ("validation_fraction",)
    with pytest.raises(ConfigError, match="holds out all"):
        validation_indices(10, 0.96)  # 9.6 -> 10 of 10
    with pytest.raises(ConfigError, match="already has a validation split"):
        split_validation(split_validation(data, 0.1), 0.1)
    with pytest.raises(ConfigError, match="batch_size 1300 exceeds the 1293 training examples"):
        build_run(TrainConfig(batch_size=1300, validation_fraction=0.1), data)  # N is the remaining records'


@pytest.mark.parametrize("value", ["1", "-0.5", "1.2"])
def test_cli_names_the_flag(tmp_path, value):
    res = CliRunner().invoke(
        app, ["train", "--epochs", "0.1", "--validation-fraction", value, "--out", str(tmp_path / "r")]
    )
    assert res.exit_code == 2, res.output
    assert "--validation-fraction" in res.stderr and "[0, 1)" in res.stderr
    assert not (tmp_path / "r" / "summary.json").exists()


def test_cli_help_states_the_privacy_stance():
    res = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    text = " ".join(res.output.replace("│", " ").split())  # the help panel's borders and wrapping removed
    assert "--validation-fraction" in text and "NO protection" in text and "NOT charged to ε" in text


def test_fraction_zero_reproduces_the_run_without_the_option(tmp_path):
    kw = dict(dataset="digits", method="dp-sgd", epochs=0.5, seed=1, accountant="rdp", reproducible_noise=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        a = train(TrainConfig(out=str(tmp_path / "a"), **kw))
        b = train(TrainConfig(out=str(tmp_path / "b"), validation_fraction=0.0, **kw))
    assert set(a) == set(b) == OLD_SUMMARY_KEYS
    assert a["sample_rate"] == 64 / N_DIGITS
    for key in OLD_SUMMARY_KEYS - {"wall_seconds", "run_dir", "ledger_run_id", "segments"}:  # ids: random per run
        assert a[key] == b[key], key
    la, lb = (json.loads((tmp_path / n / "ledger.json").read_text()) for n in ("a", "b"))
    assert la.pop("run_id") != lb.pop("run_id") and la == lb
    for name in ("a", "b"):
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert rows and all(set(r) == OLD_ROW_KEYS for r in rows)
    ma, mb = torch.load(tmp_path / "a" / "model.pt"), torch.load(tmp_path / "b" / "model.pt")
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_sweep_passes_the_fraction_through_and_report_reads_val_accuracy(tmp_path):
    from dpopt.experiments.report import summarize
    from dpopt.experiments.sweep import parse_sweep, read_results, run_sweep

    sweep = parse_sweep(
        {
            "sweep": {"threads": 1},
            "base": {
                "dataset": "digits",
                "method": "dp-sgd",
                "epochs": 0.3,
                "accountant": "rdp",
                "validation_fraction": 0.1,
            },
            "grid": {"lr": [0.05, 0.1]},
        },
        name="vf",
        out=tmp_path / "sweep",
    )
    assert run_sweep(sweep)["ran"] == 2
    records = read_results(sweep.results)
    assert all(r["validation_fraction"] == 0.1 and 0.0 <= r["val_accuracy"] <= 1.0 for r in records)
    table = summarize(records, rows="label", cols="lr", metric="val_accuracy")
    assert table.cols == [0.05, 0.1]
    assert {c: table.cells[("dp-sgd", c)].mean for c in table.cols} == {r["lr"]: r["val_accuracy"] for r in records}
