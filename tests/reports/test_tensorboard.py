"""--tensorboard writes an event file with the public scalars of every metrics row (issue 13 item 3)."""

import json

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from dpopt.reports.tensorboard import public_scalars  # noqa: E402
from dpopt.training import TrainConfig, train  # noqa: E402


def _scalars(log_dir):
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("method, clipping", [("dp-macadam", "flat"), ("dp-sgd", "quantile")])
def test_train_writes_public_scalars(tmp_path, method, clipping):
    tb = tmp_path / "tb"
    train(
        TrainConfig(
            dataset="digits",
            method=method,
            clipping=clipping,
            epochs=2,
            accountant="rdp",
            out=str(tmp_path / "run"),
            tensorboard=str(tb),
        )
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    got = _scalars(tb)
    for tag, key in (("test/accuracy", "test_accuracy"), ("test/loss", "test_loss"), ("privacy/epsilon", "epsilon")):
        assert [s for s, _ in got[tag]] == [r["step"] for r in rows]
        assert [v for _, v in got[tag]] == pytest.approx([r[key] for r in rows], rel=1e-6)
    assert {"train/lr", "privacy/max_grad_norm"} <= set(got)
    if clipping == "quantile":  # the noisy released count, not the true one
        assert "privacy/unclipped_fraction_released" in got
    if method == "dp-macadam":  # the clip scale b, computed from released gradients
        assert {"geometry/scale_mean", "geometry/scale_min", "geometry/scale_max"} <= set(got)
    # nothing computed from the private batch: every tag is one of the public families
    assert all(tag.split("/")[0] in ("test", "privacy", "train", "geometry") for tag in got)
    assert not any("loss" in tag and not tag.startswith("test/") for tag in got)


def test_public_scalars_without_optimizer():
    assert public_scalars({"step": 3, "test_accuracy": 0.5, "test_loss": 1.0, "epsilon": 2.0, "epoch": 1}) == {
        "test/accuracy": 0.5,
        "test/loss": 1.0,
        "privacy/epsilon": 2.0,
    }


def test_cli_tensorboard_flag(tmp_path):
    from typer.testing import CliRunner

    from dpopt.cli import app

    res = CliRunner().invoke(
        app,
        [
            "train",
            "--method",
            "dp-sgd",
            "--epochs",
            "1",
            "--accountant",
            "rdp",
            "--out",
            str(tmp_path / "run"),
            "--tensorboard",
            str(tmp_path / "tb"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "privacy/epsilon" in _scalars(tmp_path / "tb")
