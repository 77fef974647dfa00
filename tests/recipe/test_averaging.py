"""ParameterAverager (dpopt.averaging): EMA with warm-up and Polyak averaging of RELEASED parameters.

The averages equal hand-computed averages of the parameter trajectory θ_0, θ_1, ... recorded after
each optimizer step (so they use the released parameters only: nothing else is read); swapping in
and out restores the raw values exactly; the state round-trips; a PrivacyEngine model is averaged
without copying its hooks; unhooked_copy leaves the original's hooks and strips the copy's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.averaging import ParameterAverager, ema_decay_at, unhooked_copy


def test_warmup_decay_values():
    assert ema_decay_at(1, 0.999) == pytest.approx(2 / 11)
    assert ema_decay_at(8, 0.999) == pytest.approx(9 / 18)
    assert ema_decay_at(100_000, 0.999) == 0.999
    assert ema_decay_at(1, 0.999, warmup=False) == 0.999


@pytest.mark.parametrize("warmup", [True, False])
def test_ema_equals_hand_average_of_the_parameter_trajectory(warmup):
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = ParameterAverager(model, 0.9, warmup=warmup)
    flat = lambda: torch.cat([p.detach().flatten() for p in model.parameters()])  # noqa: E731
    want = flat().clone()
    for t in range(1, 26):
        opt.zero_grad()
        model(torch.randn(5, 3, dtype=torch.float64)).square().sum().backward()
        opt.step()
        ema.update()
        d = min(0.9, (1 + t) / (10 + t)) if warmup else 0.9
        want = d * want + (1 - d) * flat()
    got = torch.cat([a.flatten() for a in ema.averaged])
    assert torch.allclose(got, want, atol=1e-14)
    assert not torch.allclose(got, flat())  # an average, not the last iterate


@pytest.mark.parametrize("start", [0, 4])
def test_polyak_is_the_mean_of_the_iterates_from_start(start):
    torch.manual_seed(1)
    model = nn.Linear(3, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    avg = ParameterAverager(model, mode="polyak", start_step=start)
    traj = [torch.cat([p.detach().flatten() for p in model.parameters()]).clone()]
    for _ in range(10):
        opt.zero_grad()
        model(torch.randn(5, 3, dtype=torch.float64)).square().sum().backward()
        opt.step()
        avg.update()
        traj.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())
    want = torch.stack(traj[start:]).mean(0)
    assert torch.allclose(torch.cat([a.flatten() for a in avg.averaged]), want, atol=1e-14)


def test_swapped_evaluates_the_average_and_restores_the_raw_parameters():
    torch.manual_seed(2)
    model = nn.Linear(3, 2).double()
    ema = ParameterAverager(model, 0.5, warmup=False)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update()
    raw = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 3, dtype=torch.float64)
    with ema.swapped(model):
        out = model(x)
        assert all(torch.equal(p, a) for p, a in zip(model.parameters(), ema.averaged))
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), raw))
    assert torch.allclose(out, x @ ema.averaged[0].T + ema.averaged[1])
    sd = ema.averaged_state_dict(model)
    assert torch.equal(sd["weight"], ema.averaged[0]) and torch.equal(model.weight, raw[0])
    with pytest.raises(ValueError, match="not the module"):
        with ema.swapped(nn.Linear(3, 2)):
            pass


def test_state_round_trip_and_refusals():
    model = nn.Linear(3, 2)
    ema = ParameterAverager(model, 0.99)
    ema.update()
    other = ParameterAverager(model, 0.99)
    other.load_state_dict(ema.state_dict())
    assert other.step == 1 and all(torch.equal(a, b) for a, b in zip(ema.averaged, other.averaged))
    with pytest.raises(ValueError, match="loaded into"):
        ParameterAverager(model, 0.9).load_state_dict(ema.state_dict())
    for bad in (None, 1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="decay"):
            ParameterAverager(model, bad)
    with pytest.raises(ValueError, match="mode"):
        ParameterAverager(model, 0.9, mode="swa")
    with pytest.raises(ValueError, match="polyak|uniform"):
        ParameterAverager(model, 0.9, mode="polyak")


def _private(model):
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dpopt.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )


def test_privacy_engine_model_averaged_without_copying_hooks():
    torch.manual_seed(3)
    model, opt, loader = _private(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    ema = ParameterAverager(model, 0.9)
    traj = []
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        ema.update()
        traj.append([p.detach().clone() for p in model.parameters()])
    assert len(traj) > 0
    hooks_before = [dict(m._forward_hooks) for m in model.modules()]
    with ema.swapped(model), torch.no_grad():
        model(torch.randn(2, 4))
    assert [dict(m._forward_hooks) for m in model.modules()] == hooks_before
    # the next DP step still works after evaluating the average
    xb, yb = next(iter(loader))
    opt.zero_grad()
    nn.functional.cross_entropy(model(xb), yb).backward()
    opt.step()


def test_unhooked_copy_strips_the_copy_and_keeps_the_original():
    # the optimizer is kept alive: a deleted PrivateOptimizer takes its hooks off the model (issue 42)
    model, opt, _ = _private(nn.Sequential(nn.Linear(4, 3)))
    assert model[0]._forward_hooks
    copy_ = unhooked_copy(model)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in copy_.modules())
    assert model[0]._forward_hooks and model._forward_pre_hooks
    assert torch.equal(copy_[0].weight, model[0].weight) and copy_[0].weight is not model[0].weight
    from torch.optim.swa_utils import AveragedModel

    avg = AveragedModel(unhooked_copy(model))
    avg.update_parameters(model)
    assert all(not m._forward_hooks for m in avg.modules())
