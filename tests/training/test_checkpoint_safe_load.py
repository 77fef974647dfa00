"""Loading a checkpoint never runs code from it: ``weights_only=True`` refuses a crafted pickle."""

import builtins

import pytest
import torch
from typer.testing import CliRunner

from dpopt.cli import app
from dpopt.training.checkpoint import CHECKPOINT_NAME, CHECKPOINT_VERSION, load_checkpoint


class _WritesAFile:
    """Unpickling this calls exec(), which writes ``marker``: what a malicious run directory would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _crafted(run_dir, marker):
    run_dir.mkdir()
    torch.save(
        {"format": "dpopt-checkpoint", "version": CHECKPOINT_VERSION, "config": {}, "payload": _WritesAFile(marker)},
        run_dir / CHECKPOINT_NAME,
    )
    assert not marker.exists()


def test_load_checkpoint_refuses_a_crafted_pickle(tmp_path):
    marker = tmp_path / "marker"
    _crafted(tmp_path / "run", marker)
    with pytest.raises(ValueError, match="was refused: it holds objects a dpopt checkpoint never holds"):
        load_checkpoint(tmp_path / "run")
    assert not marker.exists()


def test_resume_refuses_a_crafted_pickle(tmp_path):
    marker = tmp_path / "marker"
    _crafted(tmp_path / "run", marker)
    res = CliRunner().invoke(app, ["train", "--resume", str(tmp_path / "run")])
    assert res.exit_code != 0
    assert "was refused" in res.output and "weights_only=False" in res.output
    assert not marker.exists()


def test_plain_data_checkpoint_still_loads(tmp_path):
    (tmp_path / "run").mkdir()
    state = {
        "format": "dpopt-checkpoint",
        "version": CHECKPOINT_VERSION,
        "config": {"method": "dp-sgd"},
        "model": {"w": torch.ones(2)},
        "rng": {"python": (3, tuple(range(5)), None), "numpy": ["MT19937", 1]},
        "noise": {torch.device("cpu"): torch.zeros(3, dtype=torch.uint8)},
        "size": torch.Size([2, 3]),
    }
    torch.save(state, tmp_path / "run" / CHECKPOINT_NAME)
    loaded = load_checkpoint(tmp_path / "run")
    assert loaded["config"] == {"method": "dp-sgd"} and torch.equal(loaded["model"]["w"], torch.ones(2))
