"""DP-MacAdam's ``center_shrinkage`` option (dpopt's; docs/results/macadam-high-noise).

The paper's clip centre m̂ is re-added to every release (g̃_t = m̂_{t−1} + b⊙w̃_t), so its DP noise is a
random walk (variance ∝ t). The option tracks that variance, N_t, from public quantities and feeds back
λ⊙m̂ with λ = clamp(1 − V/m̂², 0, 1).
"""

import math

import pytest
import torch

from dpopt.methods import make_optimizer
from dpopt.transforms.base import StepContext
from dpopt.transforms.macadam import MacAdam


def _step(mac, states, param, g, std, t):
    ctx = StepContext(step=t, noise_std=[torch.tensor(std, dtype=g.dtype)], lrs=[1.0])
    return mac.update([g], states, [param], ctx)


def test_two_steps_hand_computed():
    """N, λ and the centre after two steps on one coordinate, β1 = 0.9, noise std 0.5 (Φ = 0.25)."""
    mac = MacAdam(center_shrinkage=True)
    param = torch.zeros(1, dtype=torch.float64)
    states = [mac.init(param)]
    mac.geometry(states, [param])
    _step(mac, states, param, torch.tensor([2.0], dtype=torch.float64), 0.5, 1)
    st = states[0]
    # t = 1: N_1 = (1−β1)²Φ = 0.01·0.25; m̂_1 = 2; V_1 = N_1/0.1² = 0.25; λ_1 = 1 − 0.25/4
    assert float(st["center_noise_var"]) == pytest.approx(0.0025, rel=1e-12)
    assert float(st["center_gain"]) == pytest.approx(0.9375, rel=1e-12)
    assert float(st["center"]) == pytest.approx(1.875, rel=1e-12)
    _step(mac, states, param, torch.tensor([1.0], dtype=torch.float64), 0.5, 2)
    # t = 2: a = 0.9 + 0.1·0.9375/0.1 = 1.8375; N_2 = a²·0.0025 + 0.0025; m_2 = 0.28, m̂_2 = 0.28/0.19
    n2 = 1.8375**2 * 0.0025 + 0.0025
    m_hat = 0.28 / 0.19
    lam = 1 - (n2 / 0.19**2) / m_hat**2
    assert float(st["center_noise_var"]) == pytest.approx(n2, rel=1e-12)
    assert float(st["center_gain"]) == pytest.approx(lam, rel=1e-12)
    assert float(st["center"]) == pytest.approx(lam * m_hat, rel=1e-12)
    assert 0 < lam < 1


def test_default_is_the_paper_centre():
    """Without the option the state has no extra keys and the centre is m̂ itself."""
    mac = MacAdam()
    param = torch.zeros(2, dtype=torch.float64)
    states = [mac.init(param)]
    assert "center_noise_var" not in states[0] and "center_gain" not in states[0]
    mac.geometry(states, [param])
    _step(mac, states, param, torch.tensor([1.0, -3.0], dtype=torch.float64), 0.5, 1)
    # m̂_1 = (1−β1)g/(1−β1) = g
    assert torch.allclose(states[0]["center"], torch.tensor([1.0, -3.0], dtype=torch.float64), rtol=1e-12)


def _closed_loop(mac, d, steps, std, first_signal, seed):
    """Releases as the Privatizer makes them, g̃_t = c_{t−1} + s_t + std·z_t, with s_1 = first_signal, s_t = 0
    afterwards (no signal that depends on the centre): the centre's noise is then exactly what N tracks."""
    gen = torch.Generator().manual_seed(seed)
    param = torch.zeros(d, dtype=torch.float64)
    states = [mac.init(param)]
    mac.geometry(states, [param])
    for t in range(1, steps + 1):
        signal = first_signal if t == 1 else 0.0
        g = states[0]["center"] + signal + std * torch.randn(d, generator=gen, dtype=torch.float64)
        _step(mac, states, param, g, std, t)
    return states[0]


def test_tracked_noise_variance_matches_monte_carlo():
    """With a large mean (λ ≈ 1: the paper's centre) the tracked V_t equals the spread of m̂_t over 200,000
    independent coordinates, and grows like t (a random walk).

    The sample variance of 200,000 Gaussians has relative std √(2/200000) = 0.32%: the ±3% window has a
    false-alarm rate far below 1e-6; a recursion off by a factor (1−β1)/(1+β1) (an EMA's stationary
    variance instead of the random walk) would be 20x off at t = 60.
    """
    d, std = 200_000, 0.5
    mac = MacAdam(center_shrinkage=True)
    st = _closed_loop(mac, d, 60, std, first_signal=100.0, seed=3)
    m_hat = st["exp_avg"] / (1 - 0.9**60)
    tracked = float((st["center_noise_var"] / (1 - 0.9**60) ** 2).mean())
    assert float(st["center_gain"].min()) > 0.999
    assert float(m_hat.var()) == pytest.approx(tracked, rel=0.03)
    # closed form with λ = 1: m̂_t = m̂_{t−1} + (1−β1)/(1−β1^t)·std·z_t, so V_t = Φ·Σ_s ((1−β1)/(1−β1^s))²
    # (a random walk: each late step adds (1−β1)²Φ = 0.01Φ, nothing is forgotten)
    closed = std**2 * sum((0.1 / (1 - 0.9**s)) ** 2 for s in range(1, 61))
    assert tracked == pytest.approx(closed, rel=1e-3)


def test_shrinkage_keeps_the_centre_noise_bounded():
    """Pure noise, 400 steps, 20,000 coordinates: the paper's centre carries noise power ≈ t(1−β1)²Φ
    (≈ 5.7Φ at t = 400: Σ_s ((1−β1)/(1−β1^s))², the closed form above); the shrunk centre stays near the stationary level of an
    EMA that forgets, (1−β1)/(1+β1)·Φ ≈ 0.053Φ.

    Measured (seed 5): 5.68Φ for the paper's centre, 0.081Φ (t = 200: 0.080Φ) shrunk; the thresholds (2Φ, 0.2Φ) sit
    far from both (a mean over 20,000 coordinates has a relative std of a few %).
    """
    d, std, steps = 20_000, 0.5, 400
    phi = std**2
    paper = MacAdam()
    st_p = _closed_loop(paper, d, steps, std, first_signal=0.0, seed=5)
    shrunk = MacAdam(center_shrinkage=True)
    st_s = _closed_loop(shrunk, d, steps, std, first_signal=0.0, seed=5)
    power_paper = float(st_p["center"].square().mean()) / phi
    power_shrunk = float(st_s["center"].square().mean()) / phi
    assert power_paper > 2.0
    assert power_shrunk < 0.2


def test_option_through_the_registry():
    theta = torch.nn.Parameter(torch.zeros(3))
    opt = make_optimizer(
        "dp-macadam", [theta], noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.1, center_shrinkage=True
    )
    assert opt.transform.transforms[0].center_shrinkage is True
    opt = make_optimizer("dp-macadambc", [theta], noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.1)
    assert opt.transform.transforms[0].center_shrinkage is False
    assert math.isclose(opt.transform.transforms[0].betas[0], 0.9)
