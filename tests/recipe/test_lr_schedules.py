"""lr warm-up + constant/cosine (dpopt.lr_schedules): hand-computed values, LambdaLR on PrivacyEngine's optimizer."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.lr_schedules import apply_lr, check_schedule, lr_multiplier, make_lr_scheduler


def test_hand_computed_multipliers():
    assert [lr_multiplier(s, 10, "constant", 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_multiplier(0, 10, "cosine", 0) == 1.0
    assert lr_multiplier(5, 10, "cosine", 0) == pytest.approx(0.5)
    assert lr_multiplier(9, 10, "cosine", 0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.9)))
    assert lr_multiplier(2, 12, "cosine", 2) == 1.0  # first step after the warm-up
    assert lr_multiplier(7, 12, "cosine", 2) == pytest.approx(0.5)


def test_refusals():
    with pytest.raises(ValueError, match="unknown lr schedule"):
        check_schedule("linear", 0)
    with pytest.raises(ValueError, match="warmup_steps"):
        check_schedule("constant", -1)
    with pytest.raises(ValueError, match="no step of the cosine"):
        check_schedule("cosine", 10, 10)
    with pytest.raises(ValueError, match="never reach its set value"):
        check_schedule("constant", 11, 10)
    check_schedule("constant", 10, 10)  # the last step reaches the set lr
    with pytest.raises(ValueError, match=r"total_steps must be an integer.*math.ceil"):
        check_schedule("cosine", 2, 2.5 * 10)  # epochs * len(loader) with fractional epochs
    check_schedule("cosine", 2, __import__("numpy").int64(25))


def test_dpopt_train_refuses_a_warmup_longer_than_the_run_naming_the_flag(tmp_path):
    """The CLI and dpopt.train plan the steps from epochs and q, then check the schedule against them."""
    from typer.testing import CliRunner

    from dpopt.cli import app

    args = [
        "train",
        "--dataset",
        "digits",
        "--epochs",
        "1",
        "--batch-size",
        "64",
        "--noise-multiplier",
        "1.0",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "500",
        "--out",
        str(tmp_path / "run"),
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code != 0
    text = " ".join((res.output + str(res.exception or "")).split())
    assert "--warmup-steps 500 leaves no step of the cosine decay in 22 steps" in text
    assert not (tmp_path / "run" / "summary.json").exists()


def test_apply_lr_from_initial_lr():
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.4)
    apply_lr(opt, 0, 10, "constant", 4)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    apply_lr(opt, 3, 10, "constant", 4)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.4)
    assert opt.param_groups[0]["initial_lr"] == 0.4


def test_lambda_lr_drives_privacy_engine_optimizer():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = dpopt.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.8),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
            noise_multiplier=0.0,
            max_grad_norm=1e6,
        )
    sched = make_lr_scheduler(opt, total_steps=8, schedule="cosine", warmup_steps=2)
    seen = []
    for _ in range(2):
        for xb, yb in loader:
            seen.append(opt.param_groups[0]["lr"])
            before = model.weight.detach().clone()
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            sched.step()
            # σ = 0: a batch moves the weights iff it is not empty. (The old "always moves" failed on an empty
            # batch of Binomial(32, 1/4): 0.75^32 = 1.0e-4 per batch, 8e-4 per run over the 8 batches.)
            assert torch.equal(before, model.weight) == (len(yb) == 0)
    want = [0.8 * lr_multiplier(s, 8, "cosine", 2) for s in range(len(seen))]
    assert seen == pytest.approx(want)
    assert seen[0] == pytest.approx(0.4) and seen[1] == pytest.approx(0.8)
    xb, yb = next(iter(loader))  # a fresh batch (a second step on the last one is refused), forwarded empty
    before = model.weight.detach().clone()
    opt.zero_grad()
    nn.functional.cross_entropy(model(xb[:0]), yb[:0]).backward()  # an empty batch, forced: released, no move
    opt.step()
    assert torch.equal(before, model.weight)


def test_dpopt_train_schedule_large_batch_micro_batches_and_target_epsilon(tmp_path):
    """dpopt train's loop: warm-up + cosine lr per update (recorded nowhere private), B̄ = 512 in
    micro-batches of 64 with σ calibrated for the target: one release per logical step, ε ≤ target."""
    from dpopt.training import TrainConfig, train

    cfg = TrainConfig(
        dataset="digits",
        method="dp-sgd",
        batch_size=512.0,
        physical_batch_size=64,
        epochs=1.5,
        target_epsilon=4.0,
        lr=0.5,
        lr_schedule="cosine",
        warmup_steps=1,
        out=str(tmp_path / "r"),
    )
    s = train(cfg)
    assert s["steps"] == 4 and s["privatizer_releases"] == 4
    assert s["epsilon"] <= 4.0 and s["lr_schedule"] == "cosine" and s["warmup_steps"] == 1
    import torch

    ck = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=False)
    group = ck["optimizer"]["param_groups"][0]
    assert group["initial_lr"] == 0.5
    assert group["lr"] == pytest.approx(0.5 * lr_multiplier(3, 4, "cosine", 1))  # the last update's lr


def test_cli_summary_prints_the_schedule_it_ran(tmp_path):
    """The printed summary names the lr schedule and warm-up (recorded in summary.json too)."""
    from typer.testing import CliRunner

    from dpopt.cli import app

    args = [
        "train",
        "--dataset",
        "digits",
        "--epochs",
        "1",
        "--batch-size",
        "64",
        "--noise-multiplier",
        "1.0",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "3",
        "--out",
        str(tmp_path / "run"),
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "recipe: lr schedule cosine, 3 warm-up step(s)" in text
    summary = __import__("json").loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["lr_schedule"], summary["warmup_steps"]) == ("cosine", 3)


def test_recipe_line_names_the_views_and_is_empty_without_a_recipe():
    from dpopt.cli.train import _recipe_line

    assert (
        _recipe_line({"augmentation_multiplicity": 8, "augment": "crop-flip"})
        == "recipe: 8 view(s) per example, augment crop-flip"
    )
    assert _recipe_line({"method": "dp-sgd"}) == ""
