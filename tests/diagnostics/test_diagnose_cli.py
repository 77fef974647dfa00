"""Clean clipped mean gradient (= the Privatizer's at σ = 0, no ledger) and `dpopt diagnose`."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from dpopt.cli import app
from dpopt.diagnostics import clean_clipped_mean_gradient, diagnose_model
from dpopt.engine import iter_per_sample_sources
from dpopt.privatizer import Privatizer

LOSS = nn.functional.cross_entropy


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def test_clean_gradient_equals_privatizer_without_noise_and_records_nothing():
    model = _model()
    x, y = torch.randn(12, 5) * 3, torch.randint(0, 3, (12,))
    clean = clean_clipped_mean_gradient(model, LOSS, x, y, max_grad_norm=0.5, physical_batch_size=5)
    priv = Privatizer(0.0, 0.5, expected_batch_size=12.0, sample_rate=1.0)
    rel = priv.privatize(iter_per_sample_sources(model, LOSS, x, y, 5))
    for a, b in zip(clean, rel.grads):
        assert torch.allclose(a, b, atol=1e-6)
    # by hand with autograd, one example at a time
    hand = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(12):
        model.zero_grad()
        LOSS(model(x[i : i + 1]), y[i : i + 1]).backward()
        gs = [p.grad.clone() for p in model.parameters()]
        norm = torch.sqrt(sum((g**2).sum() for g in gs))
        for h, g in zip(hand, gs):
            h += g * min(1.0, 0.5 / float(norm)) / 12
    for a, b in zip(clean, hand):
        assert torch.allclose(a, b, atol=1e-6)


def test_diagnose_model_rows():
    model = _model()
    x, y = torch.randn(32, 5), torch.randint(0, 3, (32,))
    d = diagnose_model(
        model, LOSS, x, y, batch_sizes=[8, 64], noise_multipliers={8: 1.0, 64: 2.0}, max_grad_norm=1.0, trials=3
    )
    assert [lay.name for lay in d.layers] == ["0.weight", "2.weight"]
    row = d.layers[0].rows[64]
    assert row.noise_std == pytest.approx(2.0 / 64) and row.mc.trials == 3
    assert "NON-PRIVATE" in d.to_dict()["notice"]


def test_cli_diagnose_writes_tables_and_figures(tmp_path):
    out = tmp_path / "diag"
    res = CliRunner().invoke(
        app,
        [
            "diagnose",
            "--dataset",
            "digits",
            "--batch-sizes",
            "64,256",
            "--target-epsilon",
            "4",
            "--epochs",
            "2",
            "--examples",
            "128",
            "--trials",
            "3",
            "--curve-points",
            "3",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "NON-PRIVATE" in res.output and ("✓" in res.output or "–" in res.output)
    for name in ("recovery.md", "snr.md", "cosines.md", "diagnostics.json", "spectrum.png", "recovery.png"):
        assert (out / name).stat().st_size > 0
    doc = json.loads((out / "diagnostics.json").read_text())
    assert doc["notice"].startswith("NON-PRIVATE") and set(doc["noise_multipliers"]) == {"64.0", "256.0"}
    assert float(doc["noise_multipliers"]["256.0"]) > float(doc["noise_multipliers"]["64.0"])
    assert (out / "recovery.md").read_text().startswith("# NON-PRIVATE")


def test_cli_diagnose_checkpoint_and_errors(tmp_path):
    from dpopt.training import TrainConfig, train

    run = tmp_path / "run"
    train(TrainConfig(method="dp-sgd", epochs=0.05, out=str(run)))
    res = CliRunner().invoke(
        app,
        [
            "diagnose",
            "--dataset",
            "digits",
            "--checkpoint",
            str(run),
            "--noise-multiplier",
            "1",
            "--batch-sizes",
            "64",
            "--examples",
            "64",
            "--trials",
            "2",
            "--out",
            str(tmp_path / "d"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "checkpoint" in (tmp_path / "d" / "recovery.md").read_text()
    both = CliRunner().invoke(
        app,
        [
            "diagnose",
            "--dataset",
            "digits",
            "--noise-multiplier",
            "1",
            "--target-epsilon",
            "4",
            "--out",
            str(tmp_path / "e"),
        ],
    )
    assert both.exit_code == 2 and "exactly one" in both.output
    missing = CliRunner().invoke(
        app,
        [
            "diagnose",
            "--dataset",
            "digits",
            "--checkpoint",
            str(tmp_path / "nope"),
            "--noise-multiplier",
            "1",
            "--out",
            str(tmp_path / "f"),
        ],
    )
    assert missing.exit_code == 2 and "error:" in missing.output
