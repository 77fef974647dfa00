"""Steps and epochs (issue 22): a run takes round(epochs / q) steps, epoch k ends after step round(k / q),
every summary has a status, and epochs that round to no step are refused.

Before: a 1-epoch MNIST run (B̄ = 256, 1/q = 234.375) had 234 steps but a 3-epoch run's first epoch ended
at step 235 (the first step >= 1/q); finished runs' summary.json had no "status"; --epochs 1e-9 ran one
step silently.
"""

import json

import pytest
from typer.testing import CliRunner

from dpopt.cli import app
from dpopt.errors import ConfigError
from dpopt.training import TrainConfig, train
from dpopt.training.config import epoch_end_step, planned_steps

runner = CliRunner()
DIGITS_N = 1437  # the bundled digits training split
B = 271  # 1/q = 1437/271 = 5.30: the fractional part < 1/2 is where the two rules differed


def test_mnist_numbers():
    q = 256 / 60000
    assert planned_steps(1, q) == 234 and planned_steps(3, q) == 703
    assert [epoch_end_step(k, q, 703) for k in (1, 2, 3)] == [234, 469, 703]
    assert epoch_end_step(1, q, 234) == planned_steps(1, q)
    assert epoch_end_step(4, q, 703) == 703  # never past the planned steps


@pytest.mark.parametrize("epochs", [1e-9, 0.0001, 0.5 * B / DIGITS_N])  # the last: 0.5 steps, rounds to 0
def test_epochs_below_one_step_are_refused(epochs):
    with pytest.raises(ConfigError, match="rounds to no step") as err:
        planned_steps(epochs, B / DIGITS_N)
    assert err.value.arguments == ("epochs",)
    assert planned_steps(B / DIGITS_N, B / DIGITS_N) == 1  # epochs = q: one step


def test_cli_refuses_epochs_1e_9(tmp_path):
    res = runner.invoke(app, ["train", "--epochs", "1e-9", "--out", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output
    assert "--epochs 1e-09 is" in res.stderr and "rounds to no step" in res.stderr
    assert "give --epochs >= 0.04454" in res.stderr  # q = 64/1437
    assert not (tmp_path / "run" / "summary.json").exists()


def _run(tmp_path, name, epochs):
    cfg = TrainConfig(method="dp-sgd", batch_size=B, epochs=epochs, out=str(tmp_path / name), seed=0)
    summary = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def test_epoch_boundaries_match_the_step_count(tmp_path):
    one, one_rows = _run(tmp_path, "one", 1)
    three, rows = _run(tmp_path, "three", 3)
    assert one["steps"] == 5 == round(DIGITS_N / B)  # 5.30 steps per epoch
    assert [(r["epoch"], r["step"]) for r in one_rows] == [(1, 5)]
    assert [(r["epoch"], r["step"]) for r in rows] == [(1, 5), (2, 11), (3, 16)]  # was (1, 6)
    assert three["steps"] == 16
    for s in (one, three):  # every finished summary says so
        assert s["status"] == "completed" and s["planned_steps"] == s["steps"]
        on_disk = json.loads((tmp_path / ("one" if s is one else "three") / "summary.json").read_text())
        assert on_disk["status"] == "completed"


def test_a_fractional_last_epoch_is_labelled_by_the_epochs(tmp_path):
    summary, rows = _run(tmp_path, "frac", 2.5)
    assert summary["steps"] == 13  # round(2.5 × 5.30) = round(13.26)
    assert [(r["epoch"], r["step"]) for r in rows] == [(1, 5), (2, 11), (2.5, 13)]


def test_diagnose_refuses_epochs_below_one_step(tmp_path):
    res = runner.invoke(
        app,
        [
            "diagnose",
            "--dataset",
            "digits",
            "--target-epsilon",
            "1",
            "--epochs",
            "1e-9",
            "--batch-sizes",
            "8",
            "--out",
            str(tmp_path / "diag"),
        ],
    )
    assert res.exit_code == 2, res.output
    assert "--epochs 1e-09 is" in res.stderr and "rounds to no step" in res.stderr
