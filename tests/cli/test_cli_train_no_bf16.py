"""``dpopt train`` has no bf16 path: its built-in models train in float32. Both ways a user might ask for bf16 are
refused before anything is written (exit 2), naming what exists instead: the option (``--dtype bf16``: the accepted
value, float32, and the doors that train in bf16) and a hyperparameter (``--hp dtype=bf16``: the method's
hyperparameters). bf16 is tested through the doors that have it (``make_private`` / the engine:
tests/engine/test_bf16_weights.py; ``DPTrainer``: tests/hf/test_trainer_bf16_sensitivity.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dpopt.cli import app

runner = CliRunner()


def test_train_refuses_a_dtype_other_than_float32(tmp_path):
    res = runner.invoke(app, ["train", "--dtype", "bf16", "--out", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output
    err = res.output.replace("\n", " ")
    assert "error: --dtype 'bf16' is not accepted: dpopt train trains its built-in models in float32 only" in err
    assert "(accepted value: float32, the default, also spelled fp32 or torch.float32; or leave --dtype out)" in err
    assert "PrivacyEngine.make_private" in err and "TrainingArguments(bf16=True)" in err
    assert "No such option" not in err
    assert not (tmp_path / "run").exists()


def test_train_refuses_dtype_as_a_hyperparameter(tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(
        app, ["train", "--dataset", "digits", "--epochs", "0.05", "--hp", "dtype=bf16", "--out", str(out)]
    )
    assert res.exit_code == 2 and "does not take ['dtype']" in res.output and "its hyperparameters are" in res.output
    assert not out.exists()


@pytest.mark.parametrize("spelling", ["float32", "fp32"])
def test_train_accepts_dtype_float32(tmp_path, spelling):
    out = tmp_path / "run"
    res = runner.invoke(
        app, ["train", "--dataset", "digits", "--epochs", "0.05", "--dtype", spelling, "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert (out / "summary.json").is_file()
