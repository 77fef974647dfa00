"""AdaClip: coordinate-wise shift/scale clipping, its running estimates and its geometry feedback."""

import math

import pytest
import torch

from dpopt.engine.reference import PerSampleGrads
from dpopt.methods import make_optimizer
from dpopt.transforms.adaclip import AdaClip
from dpopt.transforms.base import StepContext

pytestmark = pytest.mark.usefixtures("float64")  # see conftest.py


def _opt(theta, **kw):
    args = dict(noise_multiplier=0.0, expected_batch_size=2.0, sample_rate=0.5, lr=0.1, h1=1e-9, h2=1.0)
    args.update(kw)
    return make_optimizer("adaclip", [theta], **args)


def test_two_steps_by_hand():
    theta = torch.tensor([1.0, -1.0])
    opt = _opt(theta)
    geo = opt.geometry()
    assert geo.shift[0].tolist() == [0.0, 0.0] and geo.scale[0].tolist() == [0.5, 0.5]  # b_0 = 1/d, d = 2

    # step 1: w_1 = (3,4)/0.5 = (6,8), ‖w_1‖ = 10 → (0.6, 0.8); w_2 = 0; w̃ = (0.3, 0.4); g̃ = b⊙w̃ = (0.15, 0.2)
    rel = opt.step(PerSampleGrads([torch.tensor([[3.0, 4.0], [0.0, 0.0]])]))
    assert rel.grads[0].tolist() == pytest.approx([0.15, 0.2], rel=1e-12)
    assert theta.tolist() == pytest.approx([1.0 - 0.015, -1.0 - 0.02], rel=1e-12)  # plain SGD, lr 0.1
    # v_1 = g̃² (m_0 = 0, Φ = 0) = (0.0225, 0.04); m_1 = 0.1 g̃; s_1 = 0.01 v_1 = (2.25e-4, 4e-4)
    # b_1 = s^{1/4} (Σ s^{1/2})^{1/2} = (√(0.015·0.035), √(0.02·0.035))
    m1 = [0.015, 0.02]
    b1 = [math.sqrt(0.015 * 0.035), math.sqrt(0.02 * 0.035)]
    geo = opt.geometry()
    assert geo.shift[0].tolist() == pytest.approx(m1, rel=1e-12)
    assert geo.scale[0].tolist() == pytest.approx(b1, rel=1e-12)
    assert b1[0] == pytest.approx(0.0229128784747792, rel=1e-12)

    # step 2: example 1 has w = (0.3, 0.4) (inside the unit ball), example 2 has w = (3, 4) → (0.6, 0.8)
    g = torch.tensor([[m1[0] + b1[0] * 0.3, m1[1] + b1[1] * 0.4], [m1[0] + b1[0] * 3.0, m1[1] + b1[1] * 4.0]])
    theta_before = theta.clone()
    rel = opt.step(PerSampleGrads([g]))
    g2 = [b1[0] * 0.45 + m1[0], b1[1] * 0.6 + m1[1]]
    assert rel.grads[0].tolist() == pytest.approx(g2, rel=1e-12)
    assert (theta_before - theta).tolist() == pytest.approx([0.1 * g2[0], 0.1 * g2[1]], rel=1e-12)
    v2 = [b1[0] ** 2 * 0.45**2, b1[1] ** 2 * 0.6**2]  # (g̃_2 − m_1)²
    s2 = [0.99 * 2.25e-4 + 0.01 * v2[0], 0.99 * 4e-4 + 0.01 * v2[1]]
    root = math.sqrt(s2[0]) + math.sqrt(s2[1])
    geo = opt.geometry()
    assert geo.shift[0].tolist() == pytest.approx([0.9 * m1[0] + 0.1 * g2[0], 0.9 * m1[1] + 0.1 * g2[1]], rel=1e-12)
    assert geo.scale[0].tolist() == pytest.approx([s2[0] ** 0.25 * root**0.5, s2[1] ** 0.25 * root**0.5], rel=1e-12)
    assert len(opt.privatizer.ledger) == 2


def test_noise_correction_and_clamp():
    """v = clamp((g̃ − m_{t−1})² − Φ, h1, h2) with Φ = noise_std² of the release."""
    t = AdaClip(betas=(0.5, 0.5), h1=1e-3, h2=0.5)
    p = torch.zeros(3)
    st = [t.init(p)]
    t.geometry(st, [p])
    ctx = StepContext(step=1, noise_std=[torch.tensor(0.2)], lrs=[1.0])  # Φ = 0.04
    out = t.update([torch.tensor([0.1, 0.3, 2.0])], st, [p], ctx)
    assert out[0].tolist() == pytest.approx([0.1, 0.3, 2.0])  # identity: SGD consumes g̃ itself
    # (0.01 − 0.04) → h1 = 1e-3 ; 0.09 − 0.04 = 0.05 ; 4 − 0.04 = 3.96 → h2 = 0.5
    s = [0.5 * 1e-3, 0.5 * 0.05, 0.5 * 0.5]
    assert st[0]["var_ema"].tolist() == pytest.approx(s)
    assert st[0]["center"].tolist() == pytest.approx([0.05, 0.15, 1.0])
    b = st[0]["scale"]
    # b minimises Σ b_j² subject to Σ s_j / b_j² ≤ 1: the constraint is active
    assert float((st[0]["var_ema"] / b**2).sum()) == pytest.approx(1.0, rel=1e-12)
    root = sum(math.sqrt(x) for x in s)
    assert b.tolist() == pytest.approx([x**0.25 * root**0.5 for x in s], rel=1e-12)


def test_scale_sums_over_every_parameter():
    t = AdaClip(h1=1e-9, h2=1.0)
    ps = [torch.zeros(2), torch.zeros(1, 1)]
    st = [t.init(p) for p in ps]
    geo = t.geometry(st, ps)
    assert [g.tolist() for g in geo.scale] == [[1 / 3, 1 / 3], [[1 / 3]]]  # d = 3 over both tensors
    ctx = StepContext(step=1, noise_std=[torch.tensor(0.0)] * 2, lrs=[1.0, 1.0])
    t.update([torch.tensor([1.0, 2.0]), torch.tensor([[0.5]])], st, ps, ctx)
    s = [0.01 * 1.0, 0.01 * 1.0, 0.01 * 0.25]  # v = g̃² (m_0 = 0), clamped at h2 = 1
    root = sum(math.sqrt(x) for x in s)
    assert st[0]["scale"].tolist() == pytest.approx([s[0] ** 0.25 * root**0.5] * 2, rel=1e-12)
    assert st[1]["scale"].item() == pytest.approx(s[2] ** 0.25 * root**0.5, rel=1e-12)


def test_release_noise_std_is_in_released_coordinates():
    theta = torch.zeros(2)
    opt = _opt(
        theta,
        noise_multiplier=2.0,
        expected_batch_size=4.0,
        sample_rate=0.25,
        generator=torch.Generator().manual_seed(0),
    )
    rel = opt.step(PerSampleGrads([torch.zeros(0, 2)]))  # an empty batch is still a charged release
    assert torch.allclose(rel.noise_std[0], torch.full((2,), 2.0 * 0.5 / 4.0))  # σ C b / B̄ with b = 1/2
    assert len(opt.privatizer.ledger) == 1


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"betas": (0.9, -0.1)}, "betas"),
        ({"h1": 0.0}, "h1"),
        ({"h1": 1e-3, "h2": 1e-4}, "h1"),
    ],
)
def test_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        AdaClip(**kw)


def test_quantile_and_per_layer_clipping_are_refused():
    with pytest.raises(ValueError, match="own shift/scale geometry"):
        make_optimizer(
            "adaclip",
            [torch.zeros(2)],
            noise_multiplier=1.0,
            expected_batch_size=2.0,
            sample_rate=0.5,
            groups=[0],
            group_bounds=[1.0],
        )
