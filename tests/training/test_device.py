"""--device cpu|cuda|auto (issue 13, item 5): model, batches and noise on the chosen device."""

import json

import pytest
import torch
from typer.testing import CliRunner

from dpopt.cli import app
from dpopt.errors import ConfigError
from dpopt.training import TrainConfig, resolve_device, train


def test_cpu_and_auto(tmp_path):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--method",
            "dp-sgd",
            "--epochs",
            "0.3",
            "--accountant",
            "rdp",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "r"),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "r" / "config.json").read_text())["device"] == "cpu"


def test_unknown_or_missing_device_is_refused(tmp_path):
    res = CliRunner().invoke(app, ["train", "--device", "tpu", "--out", str(tmp_path / "r")])
    assert res.exit_code == 2 and "unknown --device tpu" in res.stderr
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run_and_resume(tmp_path):
    import os
    import signal

    def interrupt(info):
        if info["step"] == 5:
            os.kill(os.getpid(), signal.SIGINT)

    s = train(
        TrainConfig(method="dp-macadam", epochs=0.5, accountant="rdp", device="cuda", out=str(tmp_path / "r")),
        on_step=interrupt,
    )
    assert s["status"] == "interrupted" and s["check"] == "pass"
    from dpopt.training import resume

    done = resume(tmp_path / "r")
    assert done["check"] == "pass" and done["status"] == "completed"
    state = torch.load(tmp_path / "r" / "model.pt")
    assert all(t.is_cuda for t in state.values())
