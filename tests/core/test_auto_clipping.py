"""Automatic clipping (AUTO-S, Bu et al. arXiv:2206.07136): hand-computed release, σ = 0 sensitivity
through both doors (PrivacyEngine.make_private and dpopt.training's build_run/engine path), the
ledger record, γ parsing and the refusals."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpopt import PrivacyEngine
from dpopt.auto_clipping import AutoClipping, AutoClipPrivatizer, split_gamma
from dpopt.engine.reference import PerSampleGrads, per_sample_gradients
from dpopt.methods import make_optimizer
from dpopt.privatizer import Privatizer, QuantileClipping

pytestmark = pytest.mark.usefixtures("float64")  # see conftest.py


def test_hand_computed_release_and_ledger():
    """Examples (3, 4), (0, 0), (0.3, 0.4); C = 2, γ = 0.01, σ = 0, B̄ = 4:
    Σ 2·g/(‖g‖ + γ) = 2·(3,4)/5.01 + 0 + 2·(0.3,0.4)/0.51, ÷ 4."""
    g = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.3, 0.4]])
    priv = AutoClipPrivatizer(0.0, 2.0, 4.0, 0.5, auto=AutoClipping(0.01))
    rel = priv.privatize(PerSampleGrads([g]))
    want = (2 * torch.tensor([3.0, 4.0]) / 5.01 + 2 * torch.tensor([0.3, 0.4]) / 0.51) / 4
    torch.testing.assert_close(rel.grads[0], want, rtol=1e-12, atol=1e-12)
    # the small example is scaled UP (0.5/0.51·2 ≈ 1.96 in norm): normalisation, not clipping
    assert float((2 * torch.tensor([0.3, 0.4]) / 0.51).norm()) == pytest.approx(2 * 0.5 / 0.51)
    meta = priv.ledger.entries[-1].meta
    assert meta["clipping"] == "auto" and meta["gamma"] == 0.01 and meta["sensitivity"] == 2.0


def test_noise_std_is_sigma_times_the_scale():
    priv = AutoClipPrivatizer(1.5, 2.0, 4.0, 0.5, generator=torch.Generator().manual_seed(0))
    rel = priv.privatize(PerSampleGrads([torch.ones(3, 5)]))
    assert float(rel.noise_std[0]) == pytest.approx(1.5 * 2.0 / 4.0)
    assert priv.ledger.entries[-1].meta["noise_std"] == pytest.approx(3.0)
    # same DpEvent as flat clipping at the same σ and q
    assert priv.step_event() == Privatizer(1.5, 2.0, 4.0, 0.5).step_event()


def test_refusals():
    with pytest.raises(ValueError, match="gamma"):
        AutoClipping(0.0)
    with pytest.raises(ValueError, match="per-layer"):
        AutoClipPrivatizer(1.0, [1.0, 1.0], 4.0, 0.5, groups=[0, 1])
    with pytest.raises(ValueError, match="quantile"):
        AutoClipPrivatizer(1.0, 1.0, 4.0, 0.5, quantile=QuantileClipping(2.0))
    p = [torch.zeros(2, 2, requires_grad=True)]
    with pytest.raises(ValueError, match="flat-clipping"):
        make_optimizer(
            "dp-macadam", p, noise_multiplier=1.0, expected_batch_size=2.0, sample_rate=0.5, auto_clip=AutoClipping()
        )
    opt = make_optimizer(
        "dp-adam", p, noise_multiplier=1.0, expected_batch_size=2.0, sample_rate=0.5, auto_clip=AutoClipping(0.05)
    )
    assert isinstance(opt.privatizer, AutoClipPrivatizer) and opt.privatizer.gamma == 0.05


def test_split_gamma():
    assert split_gamma({"gamma": 0.05, "momentum": 0.9}, ["lr", "momentum"]) == (0.05, {"momentum": 0.9})
    # DiSK's gamma stays DiSK's; auto_gamma is always AUTO-S's
    assert split_gamma({"gamma": 1.5}, ["lr", "gamma", "kappa"]) == (0.01, {"gamma": 1.5})
    assert split_gamma({"gamma": 1.5, "auto_gamma": 0.2}, ["gamma"]) == (0.2, {"gamma": 1.5})


def test_state_dict_round_trip_and_refuses_another_gamma():
    a = AutoClipPrivatizer(1.0, 1.0, 4.0, 0.5, auto=AutoClipping(0.01))
    a.privatize(PerSampleGrads([torch.ones(2, 3)]))
    b = AutoClipPrivatizer(1.0, 1.0, 4.0, 0.5, auto=AutoClipping(0.01))
    b.load_state_dict(a.state_dict())
    assert b.steps == 1 and len(b.ledger) == 1
    with pytest.raises(ValueError, match="gamma"):
        AutoClipPrivatizer(1.0, 1.0, 4.0, 0.5, auto=AutoClipping(0.02)).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="automatic clipping"):
        AutoClipPrivatizer(1.0, 1.0, 4.0, 0.5).load_state_dict(Privatizer(1.0, 1.0, 4.0, 0.5).state_dict())


# ----------------------------------------------------------------------------- σ = 0 sensitivity, both doors
C, B = 0.7, 6


def _data():
    torch.manual_seed(3)
    x = torch.randn(B, 5) * torch.tensor([[0.01], [1], [3], [0.1], [10], [1]])  # norms far below and above C
    return x, torch.randint(0, 3, (B,))


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def test_sigma_zero_sensitivity_engine_door(tmp_path):
    """dpopt.training's door: the optimizer build_run makes (clipping 'auto', --hp gamma) on the
    reference per-sample engine; removing any one example moves B̄·release by ≤ C (and > 0)."""
    from dpopt.data import load_dataset
    from dpopt.training import TrainConfig
    from dpopt.training.build import build_run

    cfg = TrainConfig(
        dataset="digits",
        method="dp-sgd",
        noise_multiplier=0.0,
        batch_size=8.0,
        epochs=1,
        clipping="auto",
        max_grad_norm=C,
        hparams={"gamma": 0.05},
        out=str(tmp_path / "r"),
    )
    run = build_run(cfg, load_dataset("digits"))
    priv = run.optimizer.privatizer
    assert isinstance(priv, AutoClipPrivatizer) and priv.gamma == 0.05 and priv.sensitivity == C
    model = run.model
    x, y = run.data.x_train[:B].to(torch.get_default_dtype()), run.data.y_train[:B]
    loss = nn.functional.cross_entropy

    def released(xs, ys):
        return torch.cat([g.flatten() for g in priv.privatize(per_sample_gradients(model, loss, xs, ys)).grads])

    full = released(x, y)
    moves = [
        float((full - released(x[torch.arange(B) != j], y[torch.arange(B) != j])).norm()) * priv.expected_batch_size
        for j in range(B)
    ]
    assert max(moves) <= C * (1 + 1e-9) and min(moves) > 0
    assert run.optimizer.privatizer.ledger.entries[-1].meta["clipping"] == "auto"


def _engine_release(model, x, y, gamma):
    model = copy.deepcopy(model)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.warns(UserWarning, match="poisson_sampling=False"):  # the test steps on its own neighbouring batches
        model, opt, _ = PrivacyEngine().make_private(
            module=model,
            optimizer=sgd,
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=C,
            clipping="auto",
            clipping_gamma=gamma,
            poisson_sampling=False,
        )
    return model, opt


def test_sigma_zero_sensitivity_privacy_engine_door():
    """PrivacyEngine.make_private(clipping='auto'): σ = 0; the torch optimizer receives the release as .grad."""
    x, y = _data()
    base = _model()
    model, opt = _engine_release(base, x, y, 0.01)
    assert isinstance(opt._dp.privatizer, AutoClipPrivatizer) and opt._dp.privatizer.gamma == 0.01
    bbar = opt._dp.privatizer.expected_batch_size
    start = copy.deepcopy(model.state_dict())

    def released(xs, ys):
        model.load_state_dict(start)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xs), ys).backward()
        opt.step()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    full = released(x, y)
    moves = [float((full - released(x[torch.arange(B) != j], y[torch.arange(B) != j])).norm()) * bbar for j in range(B)]
    assert max(moves) <= C * (1 + 1e-9)
    assert min(moves) > 0
    # every example is normalised, not clipped: the biggest move is close to C (the 10× example)
    assert max(moves) > 0.9 * C
    assert opt._dp.privatizer.ledger.entries[-1].meta["clipping"] == "auto"


def test_cli_train_clipping_auto_records_gamma(tmp_path):
    """``dpopt train --clipping auto --hp gamma=0.05``: every ledger entry records clipping 'auto',
    γ = 0.05 and sensitivity C; the summary records the γ."""
    import json

    from typer.testing import CliRunner

    from dpopt.cli import app

    out = tmp_path / "run"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # the CLI trains in float32 (this module's fixture sets float64)
    try:
        res = CliRunner().invoke(
            app,
            [
                "train",
                "--dataset",
                "digits",
                "--method",
                "dp-sgd",
                "--clipping",
                "auto",
                "--hp",
                "gamma=0.05",
                "--epochs",
                "1",
                "--noise-multiplier",
                "1.0",
                "--max-grad-norm",
                "0.5",
                "--out",
                str(out),
            ],
        )
    finally:
        torch.set_default_dtype(old)
    assert res.exit_code == 0, res.output
    entries = json.loads((out / "ledger.json").read_text())["entries"]
    assert len(entries) == 22
    assert all(
        e["meta"]["clipping"] == "auto"
        and e["meta"]["gamma"] == 0.05
        and e["meta"]["sensitivity"] == 0.5
        and e["meta"]["noise_std"] == 0.5
        for e in entries
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clipping"] == "auto" and summary["clipping_gamma"] == 0.05
