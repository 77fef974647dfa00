"""Opacus's ``make_private`` arguments on dpopt's PrivacyEngine (issue 22 item 2).

Each Opacus argument is accepted and mapped onto dpopt's one engine, or
refused with advice that is right. Ports the argument cases of Opacus's
privacy_engine_test (grad_sample_mode variants, ghost's 4-tuple, adaptive
clipping's arguments, drop_last, get_compatible_module).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from opacus_setup import data, model, private, run_epoch
from torch import nn
from torch.utils.data import DataLoader

import dpopt
from dpopt.module_validator import ModuleValidator, UnsupportedModuleError


def _params(m):
    return torch.cat([p.detach().flatten() for p in m.parameters()])


@pytest.mark.parametrize("mode", ["functorch", "ew", "ghost"])
def test_every_grad_sample_mode_trains_as_hooks(mode):
    _, m0, opt0, loader0 = private(grad_sample_mode="hooks")
    run_epoch(m0, opt0, loader0)
    with pytest.warns(UserWarning, match="one engine"):
        engine, *out = private(grad_sample_mode=mode)
    if mode == "ghost":
        m1, opt1, criterion, loader1 = out
        assert isinstance(criterion, nn.CrossEntropyLoss)  # Opacus's default criterion, returned
    else:
        m1, opt1, loader1 = out
    run_epoch(m1, opt1, loader1)
    # same seeds (model, reproducible masks and noise): the same updates to float tolerance
    torch.testing.assert_close(_params(m1), _params(m0), rtol=1e-5, atol=1e-6)
    assert len(engine.ledger) == len(loader1)


def test_the_mode_note_is_said_once_per_engine():
    engine = dpopt.PrivacyEngine()
    kw = dict(data_loader=DataLoader(data(), batch_size=16), noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.warns(UserWarning, match="one engine"):
        m = model()
        engine.make_private(
            module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), grad_sample_mode="functorch", **kw
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = model()
        engine.make_private(
            module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), grad_sample_mode="functorch", **kw
        )


@pytest.mark.parametrize("mode, match", [("ghost_fsdp", "distributed=True"), ("expanded", "one of")])
def test_unsupported_modes_are_refused_with_advice(mode, match):
    with pytest.raises(ValueError, match=match):
        private(grad_sample_mode=mode)


def test_batch_first_false_is_refused_with_the_transpose_advice():
    private(batch_first=True)
    with pytest.raises(ValueError, match="transpose"):
        private(batch_first=False)


def test_a_sum_reduced_criterion_under_mean_is_refused():
    with pytest.raises(ValueError, match="loss_reduction='sum'"):
        private(grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss(reduction="sum"))
    *_, crit, _ = private(
        grad_sample_mode="ghost", criterion=nn.CrossEntropyLoss(reduction="sum"), loss_reduction="sum"
    )
    assert crit.reduction == "sum"


def _adaptive(**kw):
    # initial bound 100 >> every per-example norm (about 1): every example is unclipped, so the released
    # fraction is n/(2 B) + 1/2 + noise (n the realised batch, B = 16, noise std 1.5/16 = 0.094), above 0.6
    # unless n < 4 or the noise is below -3 std (together < 2e-3 per step); the bound then shrinks by
    # exp(-3 (frac - 0.05)) < 0.2 per step. The masks and noise are seeded (reproducible), so this run is fixed
    return private(
        clipping="adaptive",
        max_grad_norm=100.0,
        target_unclipped_quantile=0.05,
        clipbound_learning_rate=3.0,
        unclipped_num_std=1.5,
        **kw,
    )


def test_adaptive_clipping_with_opacus_arguments_clamps_the_bound():
    engine, m, opt, loader = _adaptive()
    run_epoch(m, opt, loader)
    free = [e.meta["max_grad_norm"][0] for e in engine.ledger.entries]
    assert free[0] == 100.0 and free[1] < 20.0  # without a floor it leaves [50, 100] at once
    engine, m, opt, loader = _adaptive(min_clipbound=50.0, max_clipbound=100.0)
    run_epoch(m, opt, loader)
    applied = [e.meta["max_grad_norm"][0] for e in engine.ledger.entries] + [opt.max_grad_norm]
    assert applied == [100.0, 50.0, 50.0, 50.0, 50.0]  # clamped to the floor and held there


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(min_clipbound=0.1), "clipping='adaptive'"),
        (dict(clipping="adaptive", min_clipbound=2.0, max_clipbound=1.0), "min_clipbound <= max_clipbound"),
        (dict(clipping="adaptive", min_clipbound=2.0, max_clipbound=3.0), "outside"),
    ],
)
def test_clip_bounds_refused_where_wrong(kw, match):
    with pytest.raises(ValueError, match=match):
        private(**kw)


def test_drop_last_warns_as_opacus_and_every_poisson_batch_is_used():
    with pytest.warns(UserWarning, match="Ignoring drop_last"):
        engine = dpopt.PrivacyEngine()
        m = model()
        engine.make_private(
            module=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
            data_loader=DataLoader(data(), batch_size=10, drop_last=True),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )


def test_secure_mode_per_call_and_its_exclusion_with_a_generator():
    engine = dpopt.PrivacyEngine()
    m = model()
    _, opt, _ = engine.make_private(
        module=m,
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        data_loader=DataLoader(data(), batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        secure_mode=True,
    )
    assert opt.privatizer.noise.mode == "secure"
    with pytest.raises(ValueError, match="exclusive"):
        private(secure_mode=True)


def test_unknown_keywords_with_a_torch_optimizer_point_to_the_migration_guide():
    with pytest.raises(TypeError, match="migrating-from-opacus"):
        private(max_steps=10)


def test_make_private_with_epsilon_takes_opacus_arguments_and_meets_the_target():
    engine = dpopt.PrivacyEngine(accountant="rdp")
    m = model()
    out = engine.make_private_with_epsilon(
        module=m,
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        data_loader=DataLoader(data(), batch_size=16),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=1.0,
        batch_first=True,
        poisson_sampling=True,
        grad_sample_mode="hooks",
        loss_reduction="mean",
    )
    m, opt, loader = out
    for _ in range(2):
        run_epoch(m, opt, loader)
    eps = engine.accountant.get_epsilon(delta=1e-5)
    assert 2.9 < eps <= 3.0


def test_make_private_with_epsilon_calibrates_fractional_epochs_for_all_their_steps():
    """epochs=2.5 over a 4-batch loader is 10 steps: σ is calibrated for 10 (it was for int(2.5)·4 = 8, so
    training the 2.5 epochs asked for went past the target)."""
    from dpopt.accounting.calibration import calibrate_noise_multiplier

    engine = dpopt.PrivacyEngine(accountant="rdp")
    m = model()
    loader = DataLoader(data(), batch_size=16)
    _, opt, _ = engine.make_private_with_epsilon(
        module=m,
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        data_loader=loader,
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=2.5,
        max_grad_norm=1.0,
    )
    want = calibrate_noise_multiplier(3.0, 1e-5, 1.0 / len(loader), math.ceil(2.5 * len(loader)), "rdp")
    assert opt.noise_multiplier == want.noise_multiplier
    assert (
        opt.noise_multiplier
        > calibrate_noise_multiplier(3.0, 1e-5, 1.0 / len(loader), 2 * len(loader), "rdp").noise_multiplier
    )
    for bad in (0, -1, float("nan"), "2"):
        with pytest.raises(ValueError, match="epochs must be a number > 0"):
            dpopt.PrivacyEngine().make_private_with_epsilon(
                module=model(),
                optimizer=torch.optim.SGD(model().parameters(), lr=0.1),
                data_loader=loader,
                target_epsilon=3.0,
                target_delta=1e-5,
                epochs=bad,
                max_grad_norm=1.0,
            )


class _BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_get_compatible_module_replaces_batchnorm_as_opacus():
    net = _BNNet()
    engine = dpopt.PrivacyEngine()
    assert not engine.is_compatible(module=net, optimizer=None, data_loader=None)
    assert not ModuleValidator.is_valid(net) and len(ModuleValidator.validate(net)) == 1
    with pytest.raises(UnsupportedModuleError, match="GroupNorm"):
        engine.validate(module=net, optimizer=None, data_loader=None)
    fixed = dpopt.PrivacyEngine.get_compatible_module(net)
    assert isinstance(fixed.bn, nn.GroupNorm) and fixed.bn.num_groups == 8
    assert engine.is_compatible(module=fixed, optimizer=None, data_loader=None)
    with pytest.raises(TypeError, match="num_groups"):
        ModuleValidator.fix(_BNNet(), num_groups=2)


def test_model_module_is_the_model_itself_and_not_a_child():
    m = model()
    keys = set(m.state_dict())
    n_modules = len(list(m.modules()))
    engine = dpopt.PrivacyEngine()
    out, _, _ = engine.make_private(
        module=m,
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        data_loader=DataLoader(data(), batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    assert out is m and m._module is m  # Opacus code unwraps its GradSampleModule with ._module
    assert set(m.state_dict()) == keys and len(list(m.modules())) == n_modules


def test_no_op_mode_reads_the_per_example_gradients_the_loop_writes():
    # cifar10.py's --grad_sample_mode no_op path: per-example gradients from torch.func written to p.grad_sample
    from torch.func import functional_call, grad, vmap

    _, m0, opt0, loader0 = private(grad_sample_mode="hooks")
    run_epoch(m0, opt0, loader0)
    with pytest.warns(UserWarning, match="no_op"):
        _, m1, opt1, loader1 = private(grad_sample_mode="no_op")
    crit = nn.CrossEntropyLoss()

    def loss(params, x, y):
        return crit(functional_call(m1, params, (x[None],)), y[None])

    for x, y in loader1:
        m1(x)  # the example's forward (its output feeds its accuracy)
        params = {k: v.detach() for k, v in m1.named_parameters()}
        grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
        for name, p in m1.named_parameters():
            p.grad_sample = grads[name]
        opt1.step()
        opt1.zero_grad()
    torch.testing.assert_close(_params(m1), _params(m0), rtol=1e-5, atol=1e-6)
