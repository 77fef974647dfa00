"""More of Opacus's privacy_engine_test.py, in our words, with dpopt's PrivacyEngine.

Ported cases (Opacus's names): ``test_compare_to_vanilla`` (σ 0 and no
clipping: the same updates as plain SGD; with clipping or noise they differ),
``test_flat_clipping`` and ``test_per_layer_clipping`` (B = 1, σ 0: the
released gradient's norm is min(‖g‖, C), per layer for per-layer clipping),
``test_sample_grad_aggregation`` (the release is the mean of the per-example
gradients, checked against torch.func), ``test_noise_changes_every_time``
(secret noise), ``test_deterministic_run`` (dpopt's reproducible mode:
``noise_generator=``), ``test_noise_level`` (the noise std is σC/B),
``test_get_compatible_module_inaction``, ``test_model_validator`` /
``..._after_fix``, ``test_validator_weight_update_check`` and
``test_parameters_match``. Opacus's ``p.summed_grad`` / ``p.grad_sample`` are
internals dpopt does not keep: the released ``p.grad`` is read instead.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.module_validator import UnsupportedModuleError

N, B = 32, 8


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc1 = nn.Linear(4 * 4 * 4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _data(n=N):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def _private(batch_size=B, noise_multiplier=1.0, max_grad_norm=1.0, seed=1337, noise_generator=None, **kw):
    torch.manual_seed(seed)
    m = _ConvNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    engine = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, opt, dl = engine.make_private(
            module=m,
            optimizer=opt,
            data_loader=DataLoader(_data(), batch_size=batch_size),
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            noise_generator=noise_generator,
            **kw,
        )
    return m, opt, dl


def _vanilla(batch_size=B, seed=1337):
    torch.manual_seed(seed)
    m = _ConvNet()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), DataLoader(_data(), batch_size=batch_size)


def _train(m, opt, dl, steps):
    for k, (x, y) in enumerate(dl):
        if k == steps:
            break
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _grads(m):
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


@pytest.mark.parametrize("do_clip, do_noise", [(False, False), (True, False), (False, True)])
def test_compare_to_vanilla(do_clip, do_noise):
    m, opt, dl = _private(
        noise_multiplier=1.0 if do_noise else 0.0, max_grad_norm=0.01 if do_clip else 1e6, poisson_sampling=False
    )
    v, vopt, vdl = _vanilla()
    _train(m, opt, dl, 3)
    _train(v, vopt, vdl, 3)
    if do_clip or do_noise:
        assert not torch.allclose(_flat(m), _flat(v), rtol=1e-3, atol=1e-5)
    else:
        torch.testing.assert_close(_flat(m), _flat(v), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(_grads(m), _grads(v), rtol=1e-5, atol=1e-6)


def test_flat_clipping():
    m, opt, dl = _private(batch_size=1, noise_multiplier=0.0, max_grad_norm=0.5, poisson_sampling=False)
    _train(m, opt, dl, 1)
    v, vopt, vdl = _vanilla(batch_size=1)
    _train(v, vopt, vdl, 1)
    assert float(_grads(m).norm()) == pytest.approx(0.5, abs=1e-3)
    assert float(_grads(v).norm()) > float(_grads(m).norm())
    torch.testing.assert_close(_grads(m), _grads(v) * 0.5 / _grads(v).norm(), rtol=1e-4, atol=1e-7)


def test_per_layer_clipping():
    bound = 0.3
    m, opt, dl = _private(
        batch_size=1, noise_multiplier=0.0, max_grad_norm=[bound] * 6, clipping="per_layer", poisson_sampling=False
    )
    _train(m, opt, dl, 1)
    v, vopt, vdl = _vanilla(batch_size=1)
    _train(v, vopt, vdl, 1)
    clipped = 0
    for p, q in zip(m.parameters(), v.parameters()):
        assert float(p.grad.norm()) == pytest.approx(min(float(q.grad.norm()), bound), abs=1e-4)
        clipped += float(q.grad.norm()) > bound
    assert clipped >= 2  # the bound binds for some layers and not for others
    assert clipped < 6


def test_sample_grad_aggregation():
    m, opt, dl = _private(noise_multiplier=0.0, max_grad_norm=99999.0, poisson_sampling=False)
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    x, y = next(iter(dl))

    def loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(m, p, (xi[None],)), yi[None])

    with torch.no_grad():
        per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    _train(m, opt, dl, 1)
    for name, p in m.named_parameters():
        torch.testing.assert_close(p.grad, per_example[name].sum(0) / B, rtol=1e-4, atol=1e-8)


def test_noise_changes_every_time():
    runs = []
    for _ in range(2):
        m, opt, dl = _private(poisson_sampling=False, max_grad_norm=1e6)
        _train(m, opt, dl, 1)
        runs.append(list(m.parameters()))
    for p0, p1 in zip(*runs):
        assert not torch.allclose(p0, p1)


def test_deterministic_run():
    runs = []
    for seed in (7, 7, 8):
        m, opt, dl = _private(noise_generator=torch.Generator().manual_seed(seed))
        _train(m, opt, dl, 4)
        runs.append(_flat(m))
    assert torch.equal(runs[0], runs[1]) and not torch.allclose(runs[0], runs[2])


def test_noise_level():
    # a loss with zero gradient: the release is the noise alone, N(0, (sigma C / B)^2) per coordinate
    torch.manual_seed(0)
    m = nn.Linear(100, 50)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    engine = dpopt.PrivacyEngine()
    ds = TensorDataset(torch.randn(64, 100), torch.zeros(64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, opt, dl = engine.make_private(
            module=m,
            optimizer=opt,
            data_loader=DataLoader(ds, batch_size=16),
            noise_multiplier=1.3,
            max_grad_norm=2.0,
            noise_generator=torch.Generator().manual_seed(0),
        )
    x, _ = next(iter(dl))
    opt.zero_grad()
    (0.0 * m(x).sum()).backward()
    opt.step()
    g = _grads(m)
    assert float(g.std()) == pytest.approx(1.3 * 2.0 / 16, rel=0.05)  # 5050 draws: sd of the estimate ~1 %
    assert abs(float(g.mean())) < 4 * 1.3 * 2.0 / 16 / 5050**0.5


def test_get_compatible_module_inaction():
    module = nn.Linear(1, 2)
    fixed = dpopt.PrivacyEngine.get_compatible_module(module)
    assert fixed is not module  # a copy, as Opacus's ModuleValidator.fix
    assert fixed.state_dict().keys() == module.state_dict().keys()
    assert all(torch.equal(fixed.state_dict()[k], v) for k, v in module.state_dict().items())


class _BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_model_validator_and_after_fix_and_weight_update():
    net = _BNNet()
    engine = dpopt.PrivacyEngine()
    with pytest.raises((UnsupportedModuleError, ValueError)):
        engine.make_private(
            module=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
            data_loader=DataLoader(_data(), batch_size=B),
            noise_multiplier=1.3,
            max_grad_norm=1.0,
        )
    fixed = dpopt.PrivacyEngine.get_compatible_module(net)
    assert isinstance(net.bn, nn.BatchNorm2d) and isinstance(fixed.bn, nn.GroupNorm)  # the original is unchanged
    before = _flat(fixed).clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, opt, dl = engine.make_private(
            module=fixed,
            optimizer=torch.optim.SGD(fixed.parameters(), lr=1.0),
            data_loader=DataLoader(_data(), batch_size=B),
            noise_multiplier=1.3,
            max_grad_norm=1.0,
            noise_generator=torch.Generator().manual_seed(0),
        )
    _train(m, opt, dl, 1)
    assert not torch.allclose(_flat(m), before)  # the fixed model's weights (GroupNorm's too) are trained
    assert not torch.equal(m.bn.weight.detach(), torch.ones(4))


def test_parameters_match():
    m = _ConvNet()
    other = _ConvNet()
    with pytest.raises(ValueError, match="exactly the model's trainable parameters"):
        dpopt.PrivacyEngine().make_private(
            module=m,
            optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=B),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
