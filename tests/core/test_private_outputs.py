"""Nothing private leaves the process (issue 9, items 3 and 5).

The adversary knows the neighbouring dataset. Run the same configuration with
the same (reproducible, for the comparison only) noise on D and on D' (one
record changed to inf, or removed): every value written to a run file or the
``--json`` line that is NOT a released value (the model and what is computed
from it on public test data) must be identical. Before issue 9,
``nonfinite_steps`` read 5 on D' and 0 on D — a perfect membership test.
"""

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

from dpopt.cli import app
from dpopt.data import load_dataset
from dpopt.training import TrainConfig, train

# Computed from the released model on public test data, or not data at all (time, paths).
RELEASED = {
    "test_accuracy",
    "test_loss",
    "wall_seconds",
    "run_dir",
    "out",
    "final_max_grad_norm",
    # validation_fraction > 0: the released model on held-out training records, which get no protection
    "val_accuracy",
    "val_loss",
    # random per run (OS entropy), nothing about the data: the ledger header's run id, the segment ids
    "run_id",
    "ledger_run_id",
    "segments",
}
# Every key the summary / --json line may carry: public config, released values, accountant output.
PUBLIC_SUMMARY = RELEASED | {
    "method",
    "dataset",
    "model",
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
    "check",
    "target_epsilon",
    "calibrated_epsilon",
    "layer_bounds",
    "layers",
    "noise_multiplier_total",
    "grad_noise_multiplier",
    "count_noise_multiplier",
    "count_share",
    # runs that stop early or resume (issue 10): public schedule facts
    "status",
    "planned_steps",
    "stop_signal",
    "max_epsilon",
    "resumed_from_step",
    "lost_steps",
    # a validation split carved from the training set (issue 11): public configuration
    "validation_fraction",
}


def _files(run_dir):
    out = {}
    for name in ("config.json", "summary.json", "ledger.json"):
        out[name] = json.loads((run_dir / name).read_text())
    out["metrics.jsonl"] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out["check.txt"] = (run_dir / "check.txt").read_text()
    return out


def _strip(value, drop=RELEASED):
    """Remove released fields (recursively) so the rest can be compared exactly."""
    if isinstance(value, dict):
        return {k: _strip(v, drop) for k, v in value.items() if k not in drop}
    if isinstance(value, list):
        return [_strip(v, drop) for v in value]
    return value


@pytest.mark.parametrize("method", ["dp-sgd", "dp-macadam"])
@pytest.mark.parametrize("change", ["inf", "remove"])
def test_neighbouring_datasets_give_identical_public_outputs(tmp_path, method, change):
    data = load_dataset("digits")
    x = data.x_train.clone()
    i = 8  # an example the seed-1 reproducible masks sample (else the runs cannot differ)
    if change == "inf":
        x[i] = float("inf")  # a non-finite per-sample gradient in every step that samples it
        neighbour = dataclasses.replace(data, x_train=x)
    else:
        keep = torch.arange(data.n_train) != i
        neighbour = dataclasses.replace(data, x_train=x[keep], y_train=data.y_train[keep])
    runs = {}
    for name, d in (("D", data), ("D2", neighbour)):
        cfg = TrainConfig(
            dataset="digits",
            method=method,
            epochs=1.0,
            seed=1,
            accountant="rdp",
            sample_rate=64 / 1437,
            reproducible_noise=True,
            out=str(tmp_path / name),
        )
        with pytest.warns(UserWarning, match="reproducible"):
            train(cfg, data=d)
        runs[name] = _files(tmp_path / name)
    for name in runs["D"]:
        assert _strip(runs["D"][name]) == _strip(runs["D2"][name]), name
    # the released model itself does depend on the data (the comparison is not vacuous)
    a, b = (torch.load(tmp_path / n / "model.pt") for n in ("D", "D2"))
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert set(runs["D"]["summary.json"]) <= PUBLIC_SUMMARY, set(runs["D"]["summary.json"]) - PUBLIC_SUMMARY
    assert "nonfinite_steps" not in runs["D2"]["summary.json"]


def test_default_sample_rate_states_that_n_is_public(tmp_path):
    s = train(TrainConfig(dataset="digits", method="dp-sgd", epochs=0.2, accountant="rdp", out=str(tmp_path / "a")))
    assert s["sample_rate"] == 64 / 1437 and s["dataset_size"] == "public"
    ledger = json.loads((tmp_path / "a" / "ledger.json").read_text())
    assert ledger["dataset_size"] == "public"
    s = train(
        TrainConfig(
            dataset="digits", method="dp-sgd", epochs=0.2, accountant="rdp", sample_rate=0.05, out=str(tmp_path / "b")
        )
    )
    assert s["sample_rate"] == 0.05 and s["dataset_size"] != "public"
    assert s["steps"] == round(0.2 / 0.05)


def test_progress_shows_no_private_loss_unless_asked(tmp_path):
    seen = []
    train(
        TrainConfig(dataset="digits", method="dp-sgd", epochs=1.2, accountant="rdp", out=str(tmp_path / "a")),
        on_step=seen.append,
    )
    assert all("loss" not in info for info in seen)
    assert seen[0]["test_accuracy"] is None and seen[-1]["test_accuracy"] is not None
    seen.clear()
    train(
        TrainConfig(
            dataset="digits",
            method="dp-sgd",
            epochs=0.2,
            accountant="rdp",
            show_train_loss=True,
            out=str(tmp_path / "b"),
        ),
        on_step=seen.append,
    )
    assert all("loss" in info for info in seen)


def test_cli_json_line_and_output_are_public(tmp_path):
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--epochs",
            "0.5",
            "--method",
            "dp-sgd",
            "--accountant",
            "rdp",
            "--out",
            str(tmp_path / "r"),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(line) <= PUBLIC_SUMMARY, set(line) - PUBLIC_SUMMARY
    assert "non-finite" not in res.output and "batch loss" not in res.output


def test_show_train_loss_never_reaches_a_file(tmp_path):
    """Review finding: with show_train_loss and log_every, the private batch loss was written to
    metrics.jsonl (and the checkpoint). It belongs to the on_step display only."""
    seen = []
    train(
        TrainConfig(
            dataset="digits",
            method="dp-sgd",
            epochs=0.5,
            accountant="rdp",
            show_train_loss=True,
            log_every=3,
            out=str(tmp_path / "a"),
        ),
        on_step=seen.append,
    )
    assert any("loss" in info for info in seen)  # the display got it, as asked
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) > 1 and all(
        set(r) <= {"epoch", "step", "log", "test_accuracy", "test_loss", "epsilon", "status"} for r in rows
    ), rows


def test_validation_split_outputs_are_public(tmp_path):
    """validation_fraction (issue 11): the run files carry only the allow-listed keys, and a changed TRAINING
    record moves nothing but released values (the held-out records' metrics are released like test metrics)."""
    from dpopt.data import validation_indices

    data = load_dataset("digits")
    train_idx, _ = validation_indices(data.n_train, 0.1)
    x = data.x_train.clone()
    x[int(train_idx[7])] = float("inf")  # a record that stays in training
    runs = {}
    for name, d in (("D", data), ("D2", dataclasses.replace(data, x_train=x))):
        cfg = TrainConfig(
            dataset="digits",
            method="dp-sgd",
            epochs=1.0,
            seed=1,
            accountant="rdp",
            validation_fraction=0.1,
            reproducible_noise=True,
            out=str(tmp_path / name),
        )
        with pytest.warns(UserWarning, match="reproducible"):
            train(cfg, data=d)
        runs[name] = _files(tmp_path / name)
    for name in runs["D"]:
        assert _strip(runs["D"][name]) == _strip(runs["D2"][name]), name
    summary = runs["D"]["summary.json"]
    assert {"val_accuracy", "val_loss", "validation_fraction"} <= set(summary) <= PUBLIC_SUMMARY, (
        set(summary) - PUBLIC_SUMMARY
    )
    assert all(
        set(r) <= {"epoch", "step", "test_accuracy", "test_loss", "val_accuracy", "val_loss", "epsilon"}
        for r in runs["D"]["metrics.jsonl"]
    )
