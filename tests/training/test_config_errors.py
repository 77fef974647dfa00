"""Library errors of the training path name TrainConfig fields (the CLI maps them to flags)."""

import dataclasses

import pytest

from dpopt.errors import ConfigError, translate
from dpopt.models import build_model
from dpopt.training import TrainConfig, validate_config
from dpopt.training.results import run_directory


def _flags():
    return {f.name: "--" + f.name.replace("_", "-") for f in dataclasses.fields(TrainConfig)}


@pytest.mark.parametrize(
    "change, arguments, text",
    [
        ({"batch_size": 0}, ("batch_size",), "batch_size (the expected batch size) must be a number >= 1"),
        ({"batch_size": 5000}, ("batch_size",), "batch_size 5000 exceeds the 1437 training examples"),
        ({"sample_rate": 1.5}, ("sample_rate",), "sample_rate must be in (0, 1]"),
        ({"reproducible_noise": True, "secure_mode": True}, ("reproducible_noise", "secure_mode"), "exclude"),
        ({"lr": 0.0}, ("lr",), "lr must be > 0"),
        ({"lr": float("inf")}, ("lr",), "lr must be finite"),
        ({"epochs": float("inf")}, ("epochs",), "epochs must be a finite number > 0"),
        ({"max_grad_norm": 0.0}, ("max_grad_norm",), "max_grad_norm must be > 0"),
        ({"physical_batch_size": 0}, ("physical_batch_size",), "physical_batch_size must be > 0"),
        ({"count_share": 0.1}, ("count_share", "count_noise_multiplier", "clipping"), "apply to clipping"),
        ({"layer_bounds": [1.0]}, ("layer_bounds", "clipping"), "layer_bounds applies to clipping"),
        ({"target_epsilon": -1.0}, ("target_epsilon",), "target_epsilon must be > 0"),
    ],
)
def test_validate_config_names_fields(change, arguments, text):
    with pytest.raises(ConfigError) as info:
        validate_config(dataclasses.replace(TrainConfig(), **change), 1437)
    assert info.value.arguments == arguments
    assert text in str(info.value) and "--" not in str(info.value)
    shown = translate(info.value, _flags())
    assert all(_flags()[a] in shown for a in arguments)


def test_run_directory_and_model_errors_name_fields(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(ConfigError) as info:
        run_directory(TrainConfig(out=str(a_file)))
    assert info.value.arguments == ("out",) and translate(info.value, _flags()).startswith("--out ")
    run = tmp_path / "run"
    run.mkdir()
    (run / "ledger.json").write_text("{}")
    with pytest.raises(
        ConfigError, match=r"already holds a run( \(.*\))?; choose a new directory or allow overwrite"
    ) as info:
        run_directory(TrainConfig(out=str(run)))
    assert translate(info.value, _flags()).endswith("allow --overwrite")
    assert run_directory(TrainConfig(out=str(run), overwrite=True)) == run
    with pytest.raises(ConfigError, match="does not take digits inputs; use model mlp-small") as info:
        build_model("mlp", "digits")
    assert translate(info.value, _flags()).endswith("use --model mlp-small")


def test_default_run_directories_started_in_one_second_do_not_meet(tmp_path, monkeypatch):
    """Without --out the name carries the second it starts; a second run in that second gets ``-2``, not a refusal."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda fmt, *a: "20261206-120000")
    cfg = TrainConfig()
    first = run_directory(cfg)
    (first / "ledger.jsonl").write_text("{}\n")  # it holds a run now
    second = run_directory(cfg)
    assert first.name.endswith("-20261206-120000") and second == first.with_name(first.name + "-2")
    assert second.is_dir() and first != second
