"""``dpopt train`` has no bf16 path: its built-in models train in float32 and there is no dtype option. Both ways a
user might ask for bf16 are refused before anything is written (exit 2), naming what exists instead: the option
(``--dtype``: click's "No such option") and a hyperparameter (``--hp dtype=bf16``: the method's hyperparameters).
bf16 is tested through the doors that have it (``make_private`` / the engine: tests/engine/test_bf16_weights.py;
``DPTrainer``: tests/hf/test_trainer_bf16_sensitivity.py)."""

from __future__ import annotations

from typer.testing import CliRunner

from dpopt.cli import app

runner = CliRunner()


def test_train_refuses_a_dtype_option(tmp_path):
    res = runner.invoke(app, ["train", "--dtype", "bf16", "--out", str(tmp_path / "run")])
    assert res.exit_code == 2 and "No such option: --dtype" in res.output
    assert not (tmp_path / "run").exists()


def test_train_refuses_dtype_as_a_hyperparameter(tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(
        app, ["train", "--dataset", "digits", "--epochs", "0.05", "--hp", "dtype=bf16", "--out", str(out)]
    )
    assert res.exit_code == 2 and "does not take ['dtype']" in res.output and "its hyperparameters are" in res.output
    assert not out.exists()
