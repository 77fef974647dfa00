"""What a new Opacus user ran into (issue 22, "Also found" and known defects), each fixed and checked.

* training past ``make_private_with_epsilon``'s planned epochs: warned once,
  at the first release whose ε (the engine's accountant) exceeds the target;
* a sum-reduced torch loss module under the default ``loss_reduction="mean"``:
  refused at the first ``step()``, nothing released (and the cases it must
  not refuse);
* ``load_checkpoint`` restores the σ a noise scheduler had set;
* ``copy.deepcopy(optimizer)`` alone: its ``step()`` says what happened; the
  model and optimizer copied together train the copy.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from opacus_setup import data, model, private, run_epoch
from torch import nn
from torch.utils.data import DataLoader

import dpopt
from dpopt.accounting.accountant import dpsgd_epsilon
from dpopt.averaging import unhooked_copy
from dpopt.schedulers import StepNoise

DELTA = 1e-5


# -- make_private_with_epsilon: past the target -------------------------------------------------
def _calibrated(target=2.0, epochs=2, accountant="rdp"):
    engine = dpopt.PrivacyEngine(accountant=accountant)
    m = model()
    gen = torch.Generator().manual_seed(3)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="noise_generator")
        m, opt, loader = engine.make_private_with_epsilon(
            module=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
            data_loader=DataLoader(data(), batch_size=16),
            target_epsilon=target,
            target_delta=DELTA,
            epochs=epochs,
            max_grad_norm=1.0,
            noise_generator=gen,
        )
    return engine, m, opt, loader


def _steps_recording_warnings(m, opt, loader, steps):
    seen = []
    for k in range(steps):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            run_epoch(m, opt, loader, steps=1)
        seen += [(k + 1, str(x.message)) for x in w if "target_epsilon" in str(x.message)]
    return seen


def test_training_past_the_planned_epochs_warns_once_when_epsilon_passes_the_target():
    engine, m, opt, loader = _calibrated(target=2.0, epochs=2)
    sigma, q = opt.noise_multiplier, 0.25
    # the first step count whose epsilon (rdp, the engine's accountant) exceeds the target, from the closed form
    first = next(n for n in range(1, 200) if dpsgd_epsilon(sigma, q, n, DELTA, "rdp") > 2.0)
    assert first > 8  # the 8 planned steps are within the target (calibration)
    seen = _steps_recording_warnings(m, opt, loader, first + 3)
    assert [k for k, _ in seen] == [first]  # once, at that very release
    assert f"release {first}" in seen[0][1] and "8 steps" in seen[0][1]
    assert engine.accountant.get_epsilon(DELTA) > 2.0


def test_within_the_plan_nothing_is_warned_and_a_noise_drop_is_caught_early():
    engine, m, opt, loader = _calibrated(target=2.0, epochs=2)
    assert _steps_recording_warnings(m, opt, loader, 8) == []
    engine, m, opt, loader = _calibrated(target=2.0, epochs=2)
    sigma0 = opt.noise_multiplier
    run_epoch(m, opt, loader, steps=2)
    opt.noise_multiplier = sigma0 / 4  # a schedule that spends faster than planned
    seen = _steps_recording_warnings(m, opt, loader, 6)
    assert len(seen) == 1, "epsilon passed the target before the planned 8 steps: warned once"
    k = seen[0][0]  # the k-th step after the change
    assert 2 + k < 8
    sigmas = [sigma0] * 2 + [sigma0 / 4] * k
    assert _rdp_epsilon(sigmas[:-1]) <= 2.0 < _rdp_epsilon(sigmas)  # the first release above the target


def _rdp_epsilon(sigmas, q=0.25):
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    from dpopt.accounting.rdp import RDP_ORDERS

    acc = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS))
    for s in sigmas:
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s)))
    return acc.get_epsilon(DELTA)


def test_make_private_alone_never_warns_about_a_target():
    engine, m, opt, loader = private(accountant="rdp", noise_multiplier=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_epoch(m, opt, loader)
        run_epoch(m, opt, loader)
    assert engine.accountant.get_epsilon(DELTA) > 5


# -- loss reduction -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "loss_fn",
    [nn.CrossEntropyLoss(reduction="sum"), lambda out, y: nn.CrossEntropyLoss(reduction="none")(out, y).sum()],
    ids=["sum-module", "none-module-summed"],
)
def test_a_sum_reduced_loss_module_under_mean_is_refused_before_any_release(loss_fn):
    engine, m, opt, loader = private()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ValueError, match="loss_reduction='sum'"):
        run_epoch(m, opt, loader, loss_fn=loss_fn)
    assert len(engine.ledger) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


@pytest.mark.parametrize(
    "reduction, loss_fn",
    [
        ("mean", nn.CrossEntropyLoss()),
        ("mean", lambda out, y: nn.CrossEntropyLoss(reduction="none")(out, y).mean()),
        ("mean", lambda out, y: nn.CrossEntropyLoss(reduction="sum")(out, y) / len(y)),  # a mean, written as sum / B
        ("mean", lambda out, y: nn.functional.cross_entropy(out, y)),
        ("sum", nn.CrossEntropyLoss(reduction="sum")),
        ("sum", lambda out, y: nn.CrossEntropyLoss(reduction="none")(out, y).sum()),
    ],
)
def test_losses_that_agree_with_loss_reduction_train_and_the_check_then_leaves(reduction, loss_fn):
    engine, m, opt, loader = private(loss_reduction=reduction)
    run_epoch(m, opt, loader, loss_fn=loss_fn)
    assert len(engine.ledger) == 4
    assert opt._loss_watch is None  # hooks removed after the first batch of >= 2 examples


def test_a_mean_loss_under_loss_reduction_sum_is_refused():
    engine, m, opt, loader = private(loss_reduction="sum")
    with pytest.raises(ValueError, match="loss_reduction='mean'"):
        run_epoch(m, opt, loader, loss_fn=lambda out, y: nn.CrossEntropyLoss(reduction="none")(out, y).mean())
    assert len(engine.ledger) == 0


def test_the_sum_reduced_refusal_against_the_per_sample_scale():
    # what the refusal prevents: under "mean", a summed loss gives per-example gradients B times too large.
    # sigma 0, C huge (nothing clipped), SGD lr 1: the update of the sum-loss run (had it been let through)
    # would be B x the mean-loss run's; with loss_reduction="sum" it equals it
    def update(reduction, loss_fn):
        engine, m, opt, loader = private(
            noise_multiplier=0.0, max_grad_norm=1e6, lr=1.0, loss_reduction=reduction, batch_size=64
        )
        w0 = m[0].weight.detach().clone()
        run_epoch(m, opt, loader, steps=1, loss_fn=loss_fn)
        return m[0].weight.detach() - w0

    mean_run = update("mean", nn.CrossEntropyLoss())
    sum_run = update("sum", nn.CrossEntropyLoss(reduction="sum"))
    torch.testing.assert_close(sum_run, mean_run, rtol=1e-5, atol=1e-7)


# -- checkpoints keep the scheduled sigma -------------------------------------------------------
def test_load_checkpoint_restores_the_sigma_a_noise_scheduler_set(tmp_path):
    engine, m, opt, loader = private(accountant="rdp")
    sched = StepNoise(opt, step_size=1, gamma=0.5)
    run_epoch(m, opt, loader)
    sched.step()
    sched.step()  # sigma 0.25 for the next release
    path = tmp_path / "ckpt.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.save_checkpoint(path=path, module=m, optimizer=opt, noise_scheduler=sched)
    fresh, m2, opt2, loader2 = private(accountant="rdp", seed=5)
    sched2 = StepNoise(opt2, step_size=1, gamma=0.5)
    assert opt2.noise_multiplier == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh.load_checkpoint(path=path, module=m2, optimizer=opt2, noise_scheduler=sched2)
    assert opt2.noise_multiplier == 0.25 and sched2.last_epoch == 2
    run_epoch(m2, opt2, loader2, steps=1)
    assert [e.meta["noise_multiplier"] for e in fresh.ledger.entries] == [1.0] * 4 + [0.25]
    sched2.step()  # the schedule goes on from the restored value
    assert opt2.noise_multiplier == 0.125


def test_optimizer_state_dict_round_trip_keeps_sigma():
    engine, m, opt, loader = private()
    run_epoch(m, opt, loader, steps=1)
    opt.noise_multiplier = 0.7
    state = opt.state_dict()
    opt.noise_multiplier = 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.load_state_dict(state)
    assert opt.noise_multiplier == 0.7


# -- deepcopy -----------------------------------------------------------------------------------
def test_deepcopy_of_the_optimizer_alone_says_what_happened():
    engine, m, opt, loader = private()
    run_epoch(m, opt, loader, steps=1)
    lone = copy.deepcopy(opt)
    x, y = next(iter(loader))
    lone.zero_grad()
    nn.functional.cross_entropy(m(x), y).backward()
    with pytest.raises(RuntimeError, match=r"deepcopy\(\(model, optimizer\)\)"):
        lone.step()
    opt.step()  # the original is untouched and steps
    assert len(engine.ledger) == 2


def test_deepcopy_of_model_and_optimizer_together_is_a_branch_that_trains():
    engine, m, opt, loader = private()
    run_epoch(m, opt, loader, steps=1)
    m2, opt2 = copy.deepcopy((m, opt))
    x, y = next(iter(loader))
    before = [p.detach().clone() for p in m.parameters()]
    opt2.zero_grad()
    nn.functional.cross_entropy(m2(x), y).backward()
    opt2.step()
    assert len(opt2._engine.ledger) == 2 and len(engine.ledger) == 1  # the copy's releases are its branch's
    assert opt2._engine.ledger.run_id == engine.ledger.run_id
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # the original model is not moved
    assert not all(torch.equal(a, b) for a, b in zip(before, m2.parameters()))


def test_a_model_and_optimizer_copied_before_the_first_step():
    engine, m, opt, loader = private()
    m2, opt2 = copy.deepcopy((m, opt))
    assert opt2._loss_watch is None and opt._loss_watch is not None
    with pytest.raises(ValueError, match="loss_reduction='sum'"):  # the original's check still watches its model
        run_epoch(m, opt, loader, loss_fn=nn.CrossEntropyLoss(reduction="sum"), steps=1)
    run_epoch(m2, opt2, loader, loss_fn=nn.CrossEntropyLoss(), steps=1)  # the copy trains (its check is not copied)
    assert len(opt2._engine.ledger) == 1 and len(engine.ledger) == 0


# -- a model made private twice -----------------------------------------------------------------
def _again(m, engine=None):
    return (engine or dpopt.PrivacyEngine()).make_private(
        module=m,
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        data_loader=DataLoader(data(), batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )


def test_a_model_still_hooked_by_an_engine_is_refused_until_that_engine_detaches():
    engine, m, opt, loader = private()
    run_epoch(m, opt, loader, steps=1)
    with pytest.raises(ValueError, match=r"detach\(\)"):  # two captures would both record every forward
        _again(m)
    with pytest.raises(ValueError, match="unhooked_copy"):  # a deep copy keeps the hooks (a copied recorder)
        _again(copy.deepcopy(m))
    _, _, fresh = _again(unhooked_copy(m))  # the documented way out, and detach():
    engine.detach()
    second = dpopt.PrivacyEngine()
    m2, opt2, loader2 = _again(m, second)
    assert sum(1 for h in m2._forward_pre_hooks.values() if hasattr(h, "__self__")) == 1  # one capture now
    run_epoch(m2, opt2, loader2, steps=1)
    assert second.get_epsilon(DELTA) > 0  # the new engine releases normally


@pytest.mark.parametrize("which", ["module", "data_loader"])
def test_a_wrong_type_for_module_or_data_loader_says_what_to_pass(which):
    m = model()
    args = dict(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), data_loader=DataLoader(data()))
    args[which] = "model" if which == "module" else data()  # a name; a Dataset where its DataLoader belongs
    with pytest.raises(TypeError, match=f"{which} must be .* got (str|TensorDataset)"):
        dpopt.PrivacyEngine().make_private(**args, noise_multiplier=1.0, max_grad_norm=1.0)


def test_a_part_or_a_parent_of_a_private_model_is_refused_too():
    kept = private()  # its optimizer alive: the capture stays attached
    m = kept[1]
    with pytest.raises(ValueError, match=r"detach\(\)"):  # a submodule: its layers carry the first capture's hooks
        _again(m[2])
    with pytest.raises(ValueError, match=r"detach\(\)"):  # a model that contains it
        _again(nn.Sequential(m, nn.Linear(m[2].out_features, 3)))
