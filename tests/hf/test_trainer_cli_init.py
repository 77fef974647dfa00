"""``dpopt train --init-from / --freeze / --lora-rank / --model hf:DIR`` (issue 21): fine-tuning from local files."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import transformers as T  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from dpopt.cli import app  # noqa: E402
from dpopt.data import load_dataset  # noqa: E402
from dpopt.errors import ConfigError  # noqa: E402
from dpopt.hf.pretrained import HFLogits, freeze, load_weights  # noqa: E402
from dpopt.models import build_model  # noqa: E402
from dpopt.training import TrainConfig, build_run  # noqa: E402

runner = CliRunner()
QUICK = ["--epochs", "1", "--method", "dp-sgd", "--batch-size", "128", "--json"]


def _run(args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        res = runner.invoke(app, ["train", *QUICK, *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A digits mlp-small trained WITHOUT privacy (full-batch SGD, standing in for public pretraining): its state dict."""
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("mlp-small", "digits")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(150):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(data.x_train), data.y_train).backward()
        opt.step()
    with torch.no_grad():
        acc = float((model(data.x_test).argmax(1) == data.y_test).float().mean())
    assert acc > 0.85
    path = tmp_path_factory.mktemp("pre") / "state.pt"
    torch.save(model.state_dict(), path)
    return path, acc


def test_init_from_a_state_dict_fine_tunes_and_a_saved_dpopt_model_loads(pretrained, tmp_path):
    path, acc = pretrained
    # one epoch at sigma 3 from the pretrained weights stays far above one epoch at sigma 3 from scratch
    tuned = _run(["--out", str(tmp_path / "ft"), "--init-from", str(path), "--noise-multiplier", "3", "--lr", "0.05"])
    scratch = _run(["--out", str(tmp_path / "sc"), "--noise-multiplier", "3", "--lr", "0.05"])
    assert tuned["test_accuracy"] > 0.7 and tuned["test_accuracy"] > scratch["test_accuracy"] + 0.3
    assert json.loads((tmp_path / "ft" / "config.json").read_text())["init_from"] == str(path)
    saved = tmp_path / "ft" / "model.pt"  # a dpopt run's model.pt as the next starting point
    run = build_run(TrainConfig(method="dp-sgd", init_from=str(saved)), load_dataset("digits"))
    want = torch.load(saved, weights_only=True)
    assert all(torch.equal(p, want[n]) for n, p in run.model.state_dict().items())
    again = _run(["--out", str(tmp_path / "ft2"), "--init-from", str(saved), "--noise-multiplier", "3", "--lr", "0.05"])
    assert again["test_accuracy"] > 0.7


def test_freeze_keeps_matching_parameters_fixed(pretrained, tmp_path):
    path, _ = pretrained
    _run(["--out", str(tmp_path / "fz"), "--init-from", str(path), "--freeze", "1.*"])
    before, after = torch.load(path, weights_only=True), torch.load(tmp_path / "fz" / "model.pt", weights_only=True)
    assert torch.equal(before["1.weight"], after["1.weight"]) and torch.equal(before["1.bias"], after["1.bias"])
    assert not torch.equal(before["3.weight"], after["3.weight"])


def test_lora_rank_trains_only_adapters(pretrained, tmp_path):
    path, _ = pretrained
    run = build_run(TrainConfig(method="dp-sgd", init_from=str(path), lora_rank=2), load_dataset("digits"))
    names = [n for n, p in run.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    hidden = torch.load(path, weights_only=True)["1.weight"].shape[0]  # Linear(64, h) then Linear(h, 10)
    assert sum(p.numel() for p in run.model.parameters() if p.requires_grad) == 2 * (64 + hidden) + 2 * (hidden + 10)
    summary = _run(["--out", str(tmp_path / "lo"), "--init-from", str(path), "--lora-rank", "2"])
    state = torch.load(tmp_path / "lo" / "model.pt", weights_only=True)
    assert any("lora_A" in k for k in state) and summary["test_accuracy"] > 0.7


def test_model_hf_dir_loads_a_local_save_pretrained_directory(tmp_path):
    torch.manual_seed(0)
    cfg = T.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=10,
    )
    T.ViTForImageClassification(cfg).save_pretrained(tmp_path / "vit")
    run = build_run(TrainConfig(method="dp-sgd", model=f"hf:{tmp_path / 'vit'}"), load_dataset("digits"))
    assert isinstance(run.model, HFLogits) and run.model.image_shape == (1, 8, 8)
    assert run.model(torch.zeros(3, 64)).shape == (3, 10)
    summary = _run(["--out", str(tmp_path / "r"), "--model", f"hf:{tmp_path / 'vit'}", "--lr", "0.5"])
    assert summary["steps"] >= 1 and summary["model"] == f"hf:{tmp_path / 'vit'}"


def test_bad_starting_points_get_clear_errors(tmp_path):
    model = build_model("mlp-small", "digits")
    with pytest.raises(ConfigError, match="no file"):
        load_weights(model, tmp_path / "nope.pt")
    torch.save({"x.weight": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="does not fit the model"):
        load_weights(model, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="matches no parameter"):
        freeze(model, ["encoder.*"])
    with pytest.raises(ConfigError, match="every parameter is frozen"):
        freeze(model, ["*"])
    with pytest.raises(ConfigError, match="save_pretrained directory"):
        build_run(TrainConfig(model=f"hf:{tmp_path}"), load_dataset("digits"))
