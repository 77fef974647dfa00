"""DP-SGD, DP-Adam, DP-MacAdam: reductions, hand-computed steps, the variance-bias Monte Carlo."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from dpopt.methods import get_method, list_methods, make_optimizer
from dpopt.models import build_model, check_model
from dpopt.optim import DPOptimizer
from dpopt.per_sample import PerSampleGrads, per_sample_gradients
from dpopt.transforms.base import StepContext
from dpopt.transforms.macadam import MacAdam


pytestmark = pytest.mark.usefixtures("float64")  # see conftest.py


def _problem(seed=0, n=16):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(n, 4)
    y = torch.randint(0, 3, (n,))
    return model, x, y


LOSS = nn.functional.cross_entropy


@pytest.mark.parametrize("method, reference", [
    ("dp-sgd", lambda p: torch.optim.SGD(p, lr=0.1)),
    ("dp-adam", lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-8)),
    ("dp-macadam", lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-8)),
])
def test_reduction_to_non_private(method, reference):
    """σ = 0, C = ∞ and the full batch (B = B̄): the DP optimizer equals its non-private twin."""
    model, x, y = _problem()
    twin = copy.deepcopy(model)
    lr = 0.1 if method == "dp-sgd" else 1e-2
    opt = make_optimizer(method, model.parameters(), noise_multiplier=0.0, expected_batch_size=len(x),
                         sample_rate=1.0, max_grad_norm=1e12, lr=lr)
    ref = reference(twin.parameters())
    for _ in range(4):
        opt.step(per_sample_gradients(model, LOSS, x, y))
        ref.zero_grad()
        LOSS(twin(x), y).backward()
        ref.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p, q, atol=1e-10, rtol=1e-8)


def _macadam_reference(grads, sigma, bbar, noise, lr, betas=(0.9, 0.999), gamma=1e-8, h1=1e-9, h2=1e-6,
                       unbiased=False):
    """Algorithm 1 of dp-macadam.txt, written out in numpy for a flat parameter vector.

    grads[t]: per-sample gradients [B, d] at step t (given, not re-evaluated: a linear loss);
    noise[t]: the standard normal draws z_t [d]. Returns the list of parameter updates.
    """
    b1, b2 = betas
    d = grads[0].shape[1]
    m = np.zeros(d); v = np.zeros(d); s = np.zeros(d); m_hat = np.zeros(d); b = np.full(d, 1.0 / d)
    updates = []
    for t in range(1, len(grads) + 1):
        w = (grads[t - 1] - m_hat) / b
        w = w / np.maximum(1.0, np.linalg.norm(w, axis=1, keepdims=True))
        w_tilde = (w.sum(0) + sigma * noise[t - 1]) / bbar
        g = b * w_tilde + m_hat
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat_new = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        updates.append(-lr * m_hat_new / (np.sqrt(v_hat) + gamma))
        u = (g - m_hat) * (g - m_hat_new) if unbiased else (g - m_hat_new) ** 2
        s = b1 * s + (1 - b1) * u
        kappa = 2 * (b1 - b1**t) / (1 + b1)
        if kappa > 1e-12:
            s_hat = np.clip(s / kappa - b**2 * sigma**2 / bbar**2, h1, h2)
            b = s_hat**0.25 * np.sqrt(np.sqrt(s_hat).sum())
        m_hat = m_hat_new
    return updates


@pytest.mark.parametrize("unbiased", [False, True])
def test_macadam_first_three_steps_hand_computed(unbiased):
    """Three DP-MacAdam steps on a 3-parameter problem, noise included, against Algorithm 1."""
    grads = [np.array([[0.02, -0.01, 0.005], [0.0, 0.0, 0.0], [0.01, 0.03, -0.02]]),
             np.array([[0.015, -0.002, 0.0], [0.004, 0.001, 0.002], [-0.01, 0.02, 0.001]]),
             np.array([[0.001, 0.0005, -0.0002], [0.0, 0.002, 0.0001], [0.003, -0.001, 0.0]])]
    sigma, bbar, lr = 0.5, 4.0, 0.01
    h1, h2 = 1e-8, 1e-4
    param = torch.zeros(3, requires_grad=True)
    gen = torch.Generator().manual_seed(3)
    opt = make_optimizer("dp-macadam", [param], noise_multiplier=sigma, expected_batch_size=bbar,
                         sample_rate=0.1, generator=gen, lr=lr, h1=h1, h2=h2,
                         variance_update="unbiased" if unbiased else "paper")
    replay = torch.Generator().manual_seed(3)
    noise = [torch.randn(3, generator=replay).numpy() for _ in range(3)]
    expected = _macadam_reference(grads, sigma, bbar, noise, lr, h1=h1, h2=h2, unbiased=unbiased)
    # t = 1 by hand: geometry is (0, 1/3); all three examples have ‖w‖ = 3‖g‖ ≤ 0.12 < 1 → unclipped.
    assert float(opt.geometry().scale[0][0]) == pytest.approx(1 / 3)
    before = param.detach().clone()
    for t in range(3):
        opt.step(PerSampleGrads([torch.tensor(grads[t])]))
        after = param.detach().clone()
        assert np.allclose((after - before).numpy(), expected[t], rtol=1e-9, atol=1e-12), f"step {t + 1}"
        before = after
        if t == 0:
            # κ_1 = 0: b is not updated at t = 1
            assert torch.allclose(opt.geometry().scale[0], torch.full((3,), 1 / 3))
            # first Adam step moves every coordinate by ≈ lr (m̂/√v̂ = sign)
            assert np.allclose(np.abs(expected[0]), lr, rtol=1e-3)
    assert not torch.allclose(opt.geometry().scale[0], torch.full((3,), 1 / 3))


def test_kappa_values():
    mac = MacAdam()
    assert mac.kappa(1) == 0.0
    assert mac.kappa(2) == pytest.approx(2 * 0.9 * 0.1 / 1.9)
    assert mac.kappa(10_000) == pytest.approx(2 * 0.9 / 1.9)


@pytest.mark.parametrize("variance_update, expected_t2, expected_t60", [
    ("paper", 0.9 / 1.9, 0.9),  # E[s_t]/κ_t = β/(1+β) V at t = 2, → β V later
    ("unbiased", 1.0, 1.0),
])
def test_variance_recursion_bias_monte_carlo(variance_update, expected_t2, expected_t60):
    """200,000 independent coordinates, each an i.i.d. N(μ, V) release stream.

    The relative standard error of the mean of s_t/κ_t is below 0.6% at both
    t, so a ±3% window has a false-alarm rate far below 1e-6; the two recursions
    differ by 53% (t = 2) and 10% (t = 60), which the test separates.
    """
    d, v_true = 200_000, 4.0
    gen = torch.Generator().manual_seed(11)
    mac = MacAdam(variance_update=variance_update)
    param = torch.zeros(d)
    states = [mac.init(param)]
    mac.geometry(states, [param])
    ratios = {}
    for t in range(1, 61):
        g = 0.3 + math.sqrt(v_true) * torch.randn(d, generator=gen)
        ctx = StepContext(step=t, noise_std=[torch.tensor(0.0)], lrs=[1.0])
        mac.update([g], states, [param], ctx)
        if t in (2, 60):
            ratios[t] = float(states[0]["var_ema"].mean()) / mac.kappa(t) / v_true
    assert ratios[2] == pytest.approx(expected_t2, rel=0.03)
    assert ratios[60] == pytest.approx(expected_t60, rel=0.03)


def test_dp_optimizer_is_a_torch_optimizer():
    model, x, y = _problem()
    opt = make_optimizer("dp-adam", model.parameters(), noise_multiplier=1.0, expected_batch_size=16,
                         sample_rate=0.5, lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step(per_sample_gradients(model, LOSS, x, y))
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    with pytest.raises(TypeError, match="closure"):
        opt.step(per_sample_gradients(model, LOSS, x, y), closure=lambda: 0.0)
    with pytest.raises(TypeError, match="closure"):
        opt.step(lambda: 0.0)  # a closure passed positionally
    state = opt.state_dict()
    assert state["state"]  # Adam moments are in optimizer.state, torch-style
    assert len(opt.privatizer.ledger) == 1


def test_lr_schedule_changes_the_update():
    """The −lr scaling reads the param group at every step (so schedulers really act)."""
    p = torch.zeros(2, requires_grad=True)
    opt = make_optimizer("dp-sgd", [p], noise_multiplier=0.0, expected_batch_size=1.0, sample_rate=1.0, lr=1.0)
    opt.step(PerSampleGrads([torch.tensor([[0.3, 0.4]])]))
    assert torch.allclose(p.detach(), torch.tensor([-0.3, -0.4]))
    opt.param_groups[0]["lr"] = 0.5
    opt.step(PerSampleGrads([torch.tensor([[0.3, 0.4]])]))
    assert torch.allclose(p.detach(), torch.tensor([-0.45, -0.6]))


def test_bad_lr_and_unknown_names():
    p = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(ValueError, match="lr must be > 0"):
        make_optimizer("dp-sgd", p, noise_multiplier=1.0, expected_batch_size=1, sample_rate=0.1, lr=0.0)
    with pytest.raises(ValueError, match="unknown method 'dp-foo'.*dp-sgd"):
        get_method("dp-foo")
    with pytest.raises(ValueError, match="does not take"):
        make_optimizer("dp-sgd", p, noise_multiplier=1.0, expected_batch_size=1, sample_rate=0.1, h1=1.0)


def test_batchnorm_is_refused_with_advice():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    with pytest.raises(ValueError, match=r"'1' is BatchNorm2d.*GroupNorm"):
        check_model(model)
    check_model(build_model("cnn5"))  # GroupNorm is fine


def test_paper_model_sizes():
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(build_model("mlp")) == 795_010
    assert count(build_model("cnn5")) == 582_346


def test_registry_lists_the_foundation_methods():
    names = [s.name for s in list_methods()]
    for name in ("dp-sgd", "dp-adam", "dp-macadam"):
        assert name in names
    assert isinstance(make_optimizer("dp-sgd", [torch.zeros(1, requires_grad=True)], noise_multiplier=1.0,
                                     expected_batch_size=1, sample_rate=0.1), DPOptimizer)


def test_batchnorm_is_refused_by_both_per_sample_engines():
    from dpopt.engine import iter_per_sample_sources

    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match="BatchNorm1d.*GroupNorm"):
        per_sample_gradients(model, LOSS, x, y)
    with pytest.raises(ValueError, match="BatchNorm1d.*GroupNorm"):
        list(iter_per_sample_sources(model, LOSS, x, y))
