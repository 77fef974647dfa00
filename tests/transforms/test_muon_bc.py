"""DP-MuonBC (dpopt.transforms.muon_bc; dpopt's own leading-order derivation, see its docstring):
hand-computed κ and steps, the Monte Carlo check that the correction removes most of the bias of
E[polar(G + N)], the exact noise-variance propagation (D6) through momentum and DiSK/DOPPLER, and
the reductions (correction off = DP-Muon; σ = 0 = Muon)."""

import copy
import math

import pytest
import torch
from torch import nn

from dpopt.engine.reference import per_sample_gradients
from dpopt.methods import get_method, make_optimizer
from dpopt.transforms.base import StepContext
from dpopt.transforms.muon_bc import ScaleByMuonBC, heat_bias_correction, heat_bias_factors
from dpopt.transforms.newton_schulz import polar_exact

pytestmark = pytest.mark.usefixtures("float64")  # see conftest.py
LOSS = nn.functional.cross_entropy


def test_heat_bias_factors_by_hand():
    # 2 × 3, σ = (2, 1): κ_1 = 1/9 + 1/(2·4), κ_2 = 1/9 + 1/2
    k = heat_bias_factors(torch.tensor([2.0, 1.0]), 2, 3)
    assert k.tolist() == pytest.approx([1 / 9 + 1 / 8, 1 / 9 + 1 / 2], rel=1e-12)
    # square: no extra-dimension term; transposing the shape changes nothing
    assert heat_bias_factors(torch.tensor([2.0, 1.0]), 2, 2).tolist() == pytest.approx([1 / 9, 1 / 9])
    assert heat_bias_factors(torch.tensor([2.0, 1.0]), 3, 2).tolist() == k.tolist()
    with pytest.raises(ValueError, match="singular values"):
        heat_bias_factors(torch.tensor([1.0]), 2, 3)


def test_correction_term_by_hand_on_a_row_vector():
    # 1 × 2, u = (3, 4): σ = 5, κ = (2 − 1)/(2·25) = 0.02; s² = 1 → c = 0.02 → 0.02·(0.6, 0.8)
    corr = heat_bias_correction(torch.tensor([[3.0, 4.0]]), 1.0, max_correction=1.0)
    assert corr.flatten().tolist() == pytest.approx([0.012, 0.016], rel=1e-12)
    # the cap: s² = 100 → s²κ = 2 → capped at 0.5
    capped = heat_bias_correction(torch.tensor([[3.0, 4.0]]), 100.0, max_correction=0.5)
    assert capped.flatten().tolist() == pytest.approx([0.3, 0.4], rel=1e-12)
    assert heat_bias_correction(torch.tensor([[3.0, 4.0]]), 0.0).abs().max() == 0


def test_monte_carlo_predicted_bias_and_its_removal():
    """G = P diag(3, 2, 1.5, 1) Qᵀ (4 × 7), s = 0.15, 20,000 draws: (D4) predicts E[polar(G + N)]
    to O(s⁴), and the corrected map's mean is ≥ 4× closer to polar(G) than the uncorrected one's.
    (Measured: uncorrected error 0.048; (D4)'s prediction 0.0020 and the corrected mean 0.0018 from
    their targets, both at the Monte Carlo floor: the sd of the mean is ≈ 0.003 in Frobenius norm.)"""
    gen = torch.Generator().manual_seed(0)
    p, _ = torch.linalg.qr(torch.randn(4, 4, generator=gen))
    q, _ = torch.linalg.qr(torch.randn(7, 4, generator=gen))
    sig = torch.tensor([3.0, 2.0, 1.5, 1.0])
    g = (p * sig) @ q.T
    s = 0.15
    x = g + s * torch.randn(20_000, 4, 7, generator=gen)
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    pol = u @ vh
    target = polar_exact(g)
    kappa = heat_bias_factors(sig, 4, 7)
    predicted = (p * (1 - s * s * kappa)) @ q.T
    err_pred = float((pol.mean(0) - predicted).norm())
    err_unc = float((pol.mean(0) - target).norm())
    corr = torch.stack([heat_bias_correction(xi, s * s, 10.0) for xi in x])
    err_bc = float(((pol + corr).mean(0) - target).norm())
    assert err_unc > 0.03
    assert err_pred < 0.25 * err_unc
    assert err_bc < 0.25 * err_unc


def _ctx(std, step=1):
    return StepContext(step, [torch.tensor(std)], [1.0])


def test_two_steps_by_hand_exact_polar():
    """1 × 2 weight, β = 0.5, Nesterov, exact polar, noise std 1 of each release.
    Step 1: U = 0.75 g₁, s² = 0.75² = 0.5625; step 2: U = 0.75 g₂ + 0.125 g₁, s² = 0.5625 + 0.125² ."""
    t = ScaleByMuonBC(momentum=0.5, nesterov=True, orthogonalizer="svd", max_correction=1.0)
    w = torch.zeros(1, 2)
    st = t.init(w)
    g1, g2 = torch.tensor([[4.0, 0.0]]), torch.tensor([[0.0, 8.0]])
    o1 = t.update([g1], [st], [w], _ctx(1.0))[0]
    # U₁ = (3, 0): σ = 3, κ = 1/(2·9); s² = 0.5625 → gain 1 + 0.5625/18 ; shape scale √max(1, 1/2) = 1
    assert o1.flatten().tolist() == pytest.approx([1 + 0.5625 / 18, 0.0], rel=1e-12)
    o2 = t.update([g2], [st], [w], _ctx(1.0, 2))[0]
    u2 = torch.tensor([0.125 * 4, 0.75 * 8])  # (0.5, 6)
    s2 = 0.5625 + 0.125**2
    sigma = float(u2.norm())
    want = (u2 / sigma) * (1 + s2 / (2 * sigma**2))
    assert o2.flatten().tolist() == pytest.approx(want.tolist(), rel=1e-12)
    assert float(st["noise_cov"][1, 1]) == pytest.approx(0.25 * 0.25 + 0.25, rel=1e-12)  # Var M₂ = β⁴/4·… + (1−β)²


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"nesterov": False},
        {"input_filter": "disk", "filter_kappa": 0.7},
        {"input_filter": "iir1", "filter_a1": -0.9, "filter_b0": 0.1},
    ],
    ids=["nesterov", "plain", "disk", "doppler-ema"],
)
def test_noise_variance_propagation_matches_simulation(kw):
    """(D6) against a direct simulation of the filter + momentum on 200,000 scalar noise paths
    (release variance v_t varying over 6 steps); relative error ≤ 1.5 % (≈ 5 sd of the estimate)."""
    beta = 0.9
    t = ScaleByMuonBC(momentum=beta, **kw)
    st = t.init(torch.zeros(2, 2))
    vs = [1.0, 4.0, 0.25, 1.0, 2.0, 1.0]
    gen = torch.Generator().manual_seed(1)
    n = 200_000
    filt, m_state, mom = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for step, v in enumerate(vs, start=1):
        eps = math.sqrt(v) * torch.randn(n, generator=gen)
        if kw.get("input_filter") == "disk":
            f = eps if step == 1 else (1 - 0.7) * filt + 0.7 * eps
            filt = f
        elif kw.get("input_filter") == "iir1":
            m_state = 0.9 * m_state + 0.1 * eps
            f = m_state / (1 - 0.9**step)
        else:
            f = eps
        mom = beta * mom + (1 - beta) * f
        u = (1 - beta) * f + beta * mom if kw.get("nesterov", True) else mom
        s2 = t.noise_variance(st, v)
        assert s2 == pytest.approx(float(u.var()), rel=0.015)


def test_method_reductions_correction_off_is_dp_muon_and_sigma_zero_is_muon():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))

    def train(method, sigma, **kw):
        model = copy.deepcopy(base)
        opt = make_optimizer(
            method,
            model.parameters(),
            noise_multiplier=sigma,
            expected_batch_size=16.0,
            sample_rate=1.0,
            generator=torch.Generator().manual_seed(5),
            **kw,
        )
        for _ in range(4):
            opt.step(per_sample_gradients(model, LOSS, x, y, opt.evaluation_points()))
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    # correction off: DP-Muon exactly (same seeded noise)
    assert torch.equal(train("dp-muon-bc", 2.0, bias_correction=False), train("dp-muon", 2.0))
    # σ = 0: the correction vanishes (s² = 0) — Muon exactly
    assert torch.equal(train("dp-muon-bc", 0.0), train("dp-muon", 0.0))
    # with noise and the correction on, the update differs
    assert not torch.allclose(train("dp-muon-bc", 2.0), train("dp-muon", 2.0))
    for combo, twin in (("disk-muon-bc", "disk-muon"), ("doppler-muon-bc", "doppler-muon")):
        assert torch.equal(train(combo, 0.0), train(twin, 0.0))
        assert torch.equal(train(combo, 2.0, bias_correction=False), train(twin, 2.0))


def test_doppler_muon_bc_refuses_higher_order_filters_and_bad_options():
    p = [torch.zeros(3, 3, requires_grad=True), torch.zeros(3, 3, requires_grad=True)]
    with pytest.raises(ValueError, match="first-order"):
        make_optimizer(
            "doppler-muon-bc", p, noise_multiplier=1.0, expected_batch_size=2.0, sample_rate=0.5, filter="second-order"
        )
    with pytest.raises(ValueError, match="max_correction"):
        ScaleByMuonBC(max_correction=-1.0)
    with pytest.raises(ValueError, match="filter_kappa"):
        ScaleByMuonBC(input_filter="disk")
    assert "2605.12994" in get_method("dp-muon-bc").reference
    assert "dpopt's own" in get_method("dp-muon-bc").reference
