"""``dpopt train --norm-form`` / ``TrainConfig.norm_form``: the forced per-layer norm form reaches the engine.

``norm_form="gram"`` forces the Gram form on every factored layer in the flat geometry
(:attr:`dpopt.engine.layers.Budget.norm_form`; docs/performance.md, "Forcing a form"). On CNN5 (CIFAR-10
shapes) the cost model takes the direct form for every convolution (T = H·W positions against few
channels), so a forced form that did not reach the blocks reads as 0 Gram calls. Checked through dpopt's own
loop (``build_run`` + ``run_steps``, what ``dpopt train`` runs), in train mode, one step at q = 1 on random
CIFAR-shaped records: the Gram form ran on the three convolutions and the direct form on none; with
noise_multiplier = 0, removing one record moves the update × B̄/lr (the released clipped sum) by C — every
example is clipped (C is far below each gradient's norm) — and never more; the forced and the cost model's
forms give the same update within float32 rounding. A bad value is refused in one line (exit 2) by the CLI.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import dpopt.engine.layers as layers
from dpopt.cli import app
from dpopt.data import Dataset
from dpopt.training import TrainConfig, build_run
from dpopt.training.loop import run_steps

N, C, LR = 4, 1e-2, 100.0  # C far below every record's gradient norm; lr large against θ's float32 ulp


def _data(drop=None) -> Dataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 3, 32, 32, generator=g), torch.randint(0, 10, (N,), generator=g)
    keep = [i for i in range(N) if i != drop]
    return Dataset("cifar10", x[keep], y[keep], x[:2].clone(), y[:2].clone())


@pytest.fixture
def forms(monkeypatch):
    """Counts the factored blocks' Gram and direct norm evaluations."""
    calls = {"gram": 0, "direct": 0}
    real_gram, real_direct = layers.FactoredBlock._gram, layers.FactoredBlock._direct

    def gram(self, *args, **kwargs):
        calls["gram"] += 1
        return real_gram(self, *args, **kwargs)

    def direct(self, *args, **kwargs):
        calls["direct"] += 1
        return real_direct(self, *args, **kwargs)

    monkeypatch.setattr(layers.FactoredBlock, "_gram", gram)
    monkeypatch.setattr(layers.FactoredBlock, "_direct", direct)
    return calls


def _update(norm_form, drop=None) -> torch.Tensor:
    """The released clipped sum of one σ = 0 dp-sgd step over every record (q = 1): (θ0 − θ1)·B̄/lr."""
    cfg = TrainConfig(
        dataset="cifar10",
        model="cnn5",
        method="dp-sgd",
        noise_multiplier=0.0,
        max_grad_norm=C,
        lr=LR,
        sample_rate=1.0,
        batch_size=float(N),
        epochs=1.0,
        reproducible_noise=True,
        norm_form=norm_form,
    )
    run = build_run(cfg, _data(drop))
    run.model.train()
    before = [p.detach().clone() for p in run.model.parameters()]
    run_steps(run)
    assert len(run.ledger) == 1
    return torch.cat([((b - p.detach()) * N / LR).flatten() for b, p in zip(before, run.model.parameters())])


@pytest.mark.slow  # five one-step CNN5 runs, each with its first-batch check: ~11 s on a loaded machine
def test_forced_gram_reaches_the_blocks_and_keeps_the_sensitivity(forms):
    full = _update("gram")
    assert forms["gram"] >= 3 and forms["direct"] == 0  # 3 convolutions per pass (and the first-batch check's)
    moves = [float((full - _update("gram", drop=j)).norm()) for j in (0, N - 1)]
    assert max(moves) <= C * (1 + 1e-4)
    assert min(moves) == pytest.approx(C, rel=1e-3)  # removing an example removes its clipped gradient (norm C)
    forms.update(gram=0, direct=0)
    chosen = _update(None)
    assert forms["gram"] == 0 and forms["direct"] >= 3  # without the option: the cost model's direct form
    torch.testing.assert_close(full, chosen, rtol=1e-4, atol=1e-4 * C)


def test_norm_form_is_checked(tmp_path):
    with pytest.raises(ValueError, match="norm_form must be one of gram, chol, direct"):
        build_run(TrainConfig(dataset="cifar10", model="cnn5", batch_size=2.0, norm_form="fast"), _data())
    res = CliRunner().invoke(app, ["train", "--norm-form", "ghost", "--out", str(tmp_path / "run")])
    assert res.exit_code == 2 and "Traceback" not in res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--norm-form" in lines[0] and "gram, chol, direct" in lines[0], res.output
