"""The method registry (dpopt.methods): the twelve methods, their hyperparameters, `dpopt methods`, `--hp`."""

import pytest
import torch
from typer.testing import CliRunner

from dpopt.cli import app
from dpopt.methods import get_method, list_methods, make_optimizer
from dpopt.optim import DPOptimizer

ALL = [
    "dp-sgd",
    "dp-adam",
    "dp-adambc",
    "adaclip",
    "dp-macadam",
    "dp-macadambc",
    "dp-muon",
    "dp-muon-s",
    "disk-sgd",
    "doppler-sgd",
    "disk-muon",
    "doppler-muon",
    "dp-muon-auto",
    "dp-muon-bc",
    "disk-muon-bc",
    "doppler-muon-bc",
]

pytestmark = pytest.mark.usefixtures("float64")  # see conftest.py


def test_registry_has_all_twelve_methods():
    specs = {s.name: s for s in list_methods()}
    assert set(ALL) <= set(specs)
    for name in ALL:
        s = specs[name]
        assert s.description and s.reference and s.defaults["lr"] > 0 and s.defaults["max_grad_norm"] > 0
    assert specs["adaclip"].geometry == specs["dp-macadambc"].geometry == "shift-scale"
    assert specs["dp-muon"].defaults["lr"] == 0.02 and specs["dp-muon"].defaults["other_lr"] == 1e-3
    assert specs["dp-muon-s"].defaults["lr"] == 0.3 and specs["dp-muon-s"].defaults["momentum"] == 0.9
    assert (specs["disk-sgd"].defaults["kappa"], specs["disk-sgd"].defaults["gamma"]) == (0.7, 0.5)
    with pytest.raises(ValueError, match="disk-muon"):
        get_method("dp-nope")


def test_cli_methods_lists_all_twelve():
    res = CliRunner().invoke(app, ["methods"])
    assert res.exit_code == 0, res.output
    for name in ALL:
        assert f"\n{name} " in "\n" + res.output
    assert "kappa=0.7" in res.output and "other_lr=0.001" in res.output


def test_unknown_hyperparameter_is_refused():
    with pytest.raises(ValueError, match="does not take"):
        make_optimizer(
            "dp-muon", [torch.zeros(2, 2)], noise_multiplier=1.0, expected_batch_size=2.0, sample_rate=0.5, kappa=0.5
        )


def test_bad_lr_and_unknown_names():
    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="lr must be > 0"):
        make_optimizer("dp-sgd", p, noise_multiplier=1.0, expected_batch_size=1, sample_rate=0.1, lr=0.0)
    with pytest.raises(ValueError, match="unknown method 'dp-foo'.*dp-sgd"):
        get_method("dp-foo")
    with pytest.raises(ValueError, match="does not take"):
        make_optimizer("dp-sgd", p, noise_multiplier=1.0, expected_batch_size=1, sample_rate=0.1, h1=1.0)


def test_registry_lists_the_foundation_methods():
    names = [s.name for s in list_methods()]
    for name in ("dp-sgd", "dp-adam", "dp-macadam"):
        assert name in names
    assert isinstance(
        make_optimizer(
            "dp-sgd", [torch.zeros(1, requires_grad=True)], noise_multiplier=1.0, expected_batch_size=1, sample_rate=0.1
        ),
        DPOptimizer,
    )


def test_cli_hp_options_reach_the_method(tmp_path):
    import json

    torch.set_default_dtype(torch.float32)  # a real run: float32 model and data (restored by the fixture)

    out = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--method",
            "doppler-muon",
            "--epochs",
            "0.1",
            "--out",
            str(out),
            "--hp",
            "filter=second-order",
            "--hp",
            "betas=(0.8, 0.99)",
            "--hp",
            "ns_steps=3",
            "--hp",
            "nesterov=False",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    hp = json.loads((out / "config.json").read_text())["hparams"]
    assert hp["filter"] == "second-order" and hp["ns_steps"] == 3 and hp["nesterov"] is False
    assert hp["betas"] in ([0.8, 0.99], "(0.8, 0.99)")
    bad = CliRunner().invoke(app, ["train", "--method", "dp-muon", "--epochs", "0.1", "--hp", "kappa=0.5"])
    assert bad.exit_code == 2 and "does not take ['kappa']" in bad.output
    bad = CliRunner().invoke(app, ["train", "--method", "disk-sgd", "--epochs", "0.1", "--hp", "kappa"])
    assert bad.exit_code == 2 and "KEY=VALUE" in bad.output
    bad = CliRunner().invoke(app, ["train", "--method", "disk-sgd", "--epochs", "0.1", "--hp", "kappa=1.5"])
    assert bad.exit_code == 2 and "kappa must be in (0, 1]" in bad.output


# ------------------------------------------------------------------ hyperparameters resolved once
class _Strict(dict):
    """Resolved hyperparameters that refuse ``.get``: a factory must read declared keys by name."""

    def get(self, key, default=None):  # noqa: D401
        raise AssertionError(f"factory reads {key!r} with a fallback default; declare it in the spec")


@pytest.mark.parametrize("method", ALL)
def test_factories_read_declared_hyperparameters_by_name(method):
    """Every key a factory reads is in the method's defaults (KeyError otherwise), with no second default."""
    spec = get_method(method)
    for dataset in (None, "digits", "mnist", "cifar10"):
        hp = spec.hparams(dataset)
        assert set(hp) == set(spec.defaults)
        params = [
            torch.zeros(4, 3, requires_grad=True),
            torch.zeros(4, requires_grad=True),
            torch.zeros(2, 4, requires_grad=True),
        ]
        spec.build(_Strict({k: v for k, v in hp.items() if k != "max_grad_norm"}), params)


def test_build_optimizer_takes_resolved_hyperparameters():
    from dpopt.methods import build_optimizer

    spec = get_method("dp-adam")
    hp = spec.hparams("digits", lr=0.5)
    p = [torch.zeros(2, requires_grad=True)]
    opt = build_optimizer(spec, p, hp, noise_multiplier=1.0, expected_batch_size=1.0, sample_rate=0.1)
    assert isinstance(opt, DPOptimizer) and opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(ValueError, match="resolved.*missing \\['eps'\\]"):
        build_optimizer(
            spec,
            p,
            {k: v for k, v in hp.items() if k != "eps"},
            noise_multiplier=1.0,
            expected_batch_size=1.0,
            sample_rate=0.1,
        )


def test_train_resolves_hyperparameters_once(tmp_path, monkeypatch):
    from dpopt.methods import MethodSpec
    from dpopt.training import TrainConfig, train

    torch.set_default_dtype(torch.float32)  # a real run (restored by the fixture)
    calls = []
    original = MethodSpec.hparams

    def counting(self, *args, **kwargs):
        calls.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MethodSpec, "hparams", counting)
    train(TrainConfig(method="dp-muon-s", epochs=0.05, out=str(tmp_path / "run"), hparams={"power_iters": 3}))
    assert calls == ["dp-muon-s"]


def test_library_errors_name_arguments_not_flags():
    from dpopt.errors import ConfigError, translate

    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ConfigError) as info:
        make_optimizer("dp-sgd", p, noise_multiplier=1.0, expected_batch_size=1, sample_rate=0.1, lr=-1.0)
    assert "--" not in str(info.value) and info.value.arguments == ("lr",)
    assert translate(info.value, {"lr": "--lr"}).startswith("--lr must be > 0")
