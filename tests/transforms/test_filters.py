"""DiSK (simplified Kalman filter, extrapolated evaluation point) and DOPPLER (low-pass filter)."""

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dpopt.engine.reference import per_sample_gradients
from dpopt.methods import make_optimizer
from dpopt.transforms.base import StepContext
from dpopt.transforms.filters import DISK_PRESETS, DOPPLER_PRESETS, DiSK, LowPassFilter, doppler_coefficients

pytestmark = pytest.mark.usefixtures("float64")  # see conftest.py


def _ctx(n=1):
    return StepContext(step=1, noise_std=[torch.tensor(0.0)] * n, lrs=[1.0] * n)


def _run(filt, inputs):
    params = [torch.zeros(len(inputs[0]))]
    states = [filt.init(params[0])]
    outs = []
    for x in inputs:
        outs.append(filt.update([torch.tensor(x)], states, params, _ctx())[0].tolist())
    return outs


# ------------------------------------------------------------------ DOPPLER
def test_ema_preset_by_hand():
    # m_t = 0.1 g_t + 0.9 m_{t−1};  u_t = 0.1 + 0.9 u_{t−1};  output m_t/u_t
    out = _run(LowPassFilter(*DOPPLER_PRESETS["ema"]), [[1.0, 2.0], [3.0, 0.0], [-1.0, 1.0]])
    assert out[0] == pytest.approx([1.0, 2.0])  # m=0.1·g, u=0.1
    assert out[1] == pytest.approx([0.39 / 0.19, 0.18 / 0.19])  # m = 0.3 + 0.09 ; 0 + 0.18
    m3 = [-0.1 + 0.9 * 0.39, 0.1 + 0.9 * 0.18]  # = 0.251, 0.262
    assert out[2] == pytest.approx([m3[0] / 0.271, m3[1] / 0.271])  # u_3 = 0.1 + 0.9·0.19 = 0.271
    assert out[2][0] == pytest.approx(0.9261992619926, rel=1e-12)


def test_second_order_preset_by_hand():
    a, b = DOPPLER_PRESETS["second-order"]
    assert a == (1.0, -1.98343, 0.98550)
    assert b[1] == pytest.approx(2 * b[0]) and b[2] == pytest.approx(b[0])
    assert sum(b) == pytest.approx(sum(a))  # unit DC gain: Σb / Σa = 1
    b0 = (1 - 1.98343 + 0.98550) / 4  # = 0.0005175
    assert b[0] == pytest.approx(b0) and b0 == pytest.approx(5.175e-4)
    g1, g2, g3 = 2.0, -1.0, 4.0
    out = _run(LowPassFilter(a, b), [[g1], [g2], [g3]])
    m1, u1 = b0 * g1, b0
    m2, u2 = b0 * g2 + 2 * b0 * g1 + 1.98343 * m1, 3 * b0 + 1.98343 * u1
    m3 = b0 * g3 + 2 * b0 * g2 + b0 * g1 + 1.98343 * m2 - 0.98550 * m1
    u3 = 4 * b0 + 1.98343 * u2 - 0.98550 * u1
    assert [o[0] for o in out] == pytest.approx([g1, m2 / u2, m3 / u3], rel=1e-12)
    assert out[0][0] == pytest.approx(2.0)  # the first output is the first input (bias-corrected)


def test_trivial_filter_is_identity_and_bias_correction_can_be_off():
    assert _run(LowPassFilter((1.0,), (1.0,)), [[1.5], [-2.0]]) == [[1.5], [-2.0]]
    raw = _run(LowPassFilter((1.0, -0.9), (0.1,), bias_correction=False), [[1.0], [1.0]])
    assert raw[0][0] == pytest.approx(0.1) and raw[1][0] == pytest.approx(0.19)


def test_doppler_coefficients_and_errors():
    assert doppler_coefficients("ema") == ((1.0, -0.9), (0.1,))
    assert doppler_coefficients("ema", (1, -0.5), (0.5,)) == ((1.0, -0.5), (0.5,))
    with pytest.raises(ValueError, match="both"):
        doppler_coefficients("ema", a=(1.0,))
    with pytest.raises(ValueError, match="unknown DOPPLER"):
        doppler_coefficients("butterworth")
    with pytest.raises(ValueError, match="unstable"):
        LowPassFilter((1.0, -1.0), (1.0,))  # a pole at z = 1 (a pure sum)
    with pytest.raises(ValueError, match="DC gain"):
        LowPassFilter((1.0, -0.5), (1.0, -1.0))
    with pytest.raises(ValueError, match="a_0"):
        LowPassFilter((0.0, 1.0), (1.0,))


# ------------------------------------------------------------------ DiSK
def test_disk_filter_by_hand_and_points():
    disk = DiSK(kappa=0.7, gamma=0.5)
    assert disk.c == pytest.approx(0.3 / 0.35)  # c = (1−κ)/(κγ) = 6/7
    p = torch.tensor([1.0, -1.0])
    st = [disk.init(p)]
    assert disk.evaluation_points(st, [p]) is None  # first step: at θ_0
    g0 = disk.update([torch.tensor([2.0, 0.0])], st, [p], _ctx())[0]
    assert g0.tolist() == [2.0, 0.0]  # g_0 = ĝ_0
    p_new = p + torch.tensor([0.5, 0.25])  # the optimizer moved θ by d = (0.5, 0.25)
    pts = disk.evaluation_points(st, [p_new])
    assert [pt.coef for pt in pts] == pytest.approx([6 / 7, 1 / 7])
    assert pts[0].offset[0].tolist() == pytest.approx([0.25, 0.125])  # γ d
    assert pts[1].offset is None
    g1 = disk.update([torch.tensor([0.0, 1.0])], st, [p_new], _ctx())[0]
    assert g1.tolist() == pytest.approx([0.3 * 2.0, 0.7 * 1.0])  # (1−κ) g_0 + κ ĝ_1
    g2 = disk.update([torch.tensor([1.0, 1.0])], st, [p_new], _ctx())[0]
    assert g2.tolist() == pytest.approx([0.3 * 0.6 + 0.7, 0.3 * 0.7 + 0.7])


def test_disk_presets_and_errors():
    assert DiSK(*DISK_PRESETS["single-eval"]).c == 1.0  # (1−0.4)/(0.4·1.5) is exactly one evaluation
    assert DiSK(kappa=1.0, gamma=1.0).c == 0.0
    for kappa in (0.0, 1.5, -0.1):  # "κ = 1.5" (the spectral paper's table) is not a filter weight
        with pytest.raises(ValueError, match="kappa"):
            DiSK(kappa=kappa)
    with pytest.raises(ValueError, match="gamma"):
        DiSK(gamma=0.0)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


LOSS = nn.functional.cross_entropy


def _per_example_at(model, params, x, y):
    """Per-example gradients at explicit parameter values (independent of dpopt)."""
    names = [n for n, _ in model.named_parameters()]

    def f(ps, xi, yi):
        return LOSS(functional_call(model, dict(zip(names, ps)), (xi[None],)), yi[None])

    return vmap(grad(f), in_dims=(None, 0, 0))(tuple(params), x, y)


def _counting_loss(counter):
    def loss(out, target):
        counter["calls"] += 1
        return LOSS(out, target)

    return loss


def test_disk_c1_evaluates_one_gradient_at_the_extrapolated_point():
    model = _model()
    torch.manual_seed(1)
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    kappa, gamma = DISK_PRESETS["single-eval"]
    opt = make_optimizer(
        "disk-sgd",
        model.parameters(),
        noise_multiplier=0.0,
        expected_batch_size=6,
        sample_rate=1.0,
        max_grad_norm=1e9,
        lr=0.5,
        kappa=kappa,
        gamma=gamma,
    )
    counter = {"calls": 0}
    loss = _counting_loss(counter)
    history = [[p.detach().clone() for p in model.parameters()]]
    for step in range(3):
        pts = opt.evaluation_points()
        counter["calls"] = 0
        src = per_sample_gradients(model, loss, x, y, pts)
        assert counter["calls"] == 1  # exactly one gradient evaluation (one vmap trace) per step
        theta = history[-1]
        if step == 0:
            assert len(pts) == 1 and pts[0].offset is None and pts[0].coef == 1.0
            at = theta
        else:
            d = [a - b for a, b in zip(theta, history[-2])]
            assert len(pts) == 1 and pts[0].coef == 1.0
            at = [t + gamma * di for t, di in zip(theta, d)]
        expected = _per_example_at(model, at, x, y)
        for got, exp in zip(src.grads, expected):
            assert torch.allclose(got, exp, atol=1e-12)
        opt.step(src)
        history.append([p.detach().clone() for p in model.parameters()])
    assert len(opt.privatizer.ledger) == 3


def test_disk_combined_vector_is_clipped_once_with_sensitivity_c():
    model = _model()
    torch.manual_seed(2)
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    clip, kappa, gamma, bbar = 0.05, 0.7, 0.5, 4.0
    c = (1 - kappa) / (kappa * gamma)
    opt = make_optimizer(
        "disk-sgd",
        model.parameters(),
        noise_multiplier=0.0,
        expected_batch_size=bbar,
        sample_rate=0.5,
        max_grad_norm=clip,
        lr=1.0,
    )
    thetas = [[p.detach().clone() for p in model.parameters()]]
    for _ in range(2):
        opt.step(per_sample_gradients(model, LOSS, x, y, opt.evaluation_points()))
        thetas.append([p.detach().clone() for p in model.parameters()])
    # third step: h_i = c ∇ℓ(θ₂ + γ(θ₂ − θ₁)) + (1−c) ∇ℓ(θ₂), clipped as ONE vector to C
    pts = opt.evaluation_points()
    assert [pt.coef for pt in pts] == pytest.approx([c, 1 - c])
    release = opt.step(per_sample_gradients(model, LOSS, x, y, pts))
    th1, th2 = thetas[1], thetas[2]
    ga = _per_example_at(model, [t + gamma * (t - t1) for t, t1 in zip(th2, th1)], x, y)
    gb = _per_example_at(model, th2, x, y)
    h = [c * a + (1 - c) * b for a, b in zip(ga, gb)]
    norms = torch.sqrt(sum(hi.reshape(5, -1).pow(2).sum(1) for hi in h))
    assert (norms > clip).all()  # every example is clipped: the test exercises the bound
    scale = clip / norms
    expected = [torch.tensordot(scale, hi, dims=1) / bbar for hi in h]
    for got, exp in zip(release.grads, expected):
        assert torch.allclose(got, exp, atol=1e-12)
    # clipping each point's gradient separately would give a different release
    sep = [
        torch.tensordot(c * torch.clamp(clip / _norms(ga), max=1.0), a, dims=1)
        + torch.tensordot((1 - c) * torch.clamp(clip / _norms(gb), max=1.0), b, dims=1)
        for a, b in zip(ga, gb)
    ]
    gap = max(float((r * bbar - s_).abs().max()) for r, s_ in zip(release.grads, sep))
    assert gap > 1e-8, gap  # ... by far more than the 1e-12 tolerance above
    # one release per step, sensitivity C: noise is not rescaled by c or by the number of points
    ledger = opt.privatizer.ledger
    assert len(ledger) == 3 and opt.privatizer.releases == 3
    assert [e.meta["sensitivity"] for e in ledger.entries] == [clip] * 3
    assert all(e.meta["noise_multiplier"] == 0.0 for e in ledger.entries)


def _norms(g):
    return torch.sqrt(sum(gi.reshape(gi.shape[0], -1).pow(2).sum(1) for gi in g))


@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_disk_release_is_the_gradient_at_the_extrapolated_point(engine):
    """Through the training loop's entry point (either engine): with c = 1, σ = 0, C = ∞ and
    B̄ = n, the release is the full-batch gradient at θ_t + γ d_t (autograd, independent of dpopt)."""
    from dpopt.engine import iter_per_sample_sources

    model = _model()
    torch.manual_seed(3)
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    kappa, gamma = DISK_PRESETS["single-eval"]
    opt = make_optimizer(
        "disk-sgd",
        model.parameters(),
        noise_multiplier=0.0,
        expected_batch_size=6,
        sample_rate=1.0,
        max_grad_norm=1e9,
        lr=0.5,
        kappa=kappa,
        gamma=gamma,
    )
    prev = [p.detach().clone() for p in model.parameters()]
    opt.step(iter_per_sample_sources(model, LOSS, x, y, None, opt.evaluation_points(), engine=engine))
    for _ in range(2):
        now = [p.detach().clone() for p in model.parameters()]
        probe = copy.deepcopy(model)
        with torch.no_grad():
            for q, t, t_prev in zip(probe.parameters(), now, prev):
                q.copy_(t + gamma * (t - t_prev))
        LOSS(probe(x), y).backward()
        rel = opt.step(iter_per_sample_sources(model, LOSS, x, y, 4, opt.evaluation_points(), engine=engine))
        for got, q in zip(rel.grads, probe.parameters()):
            assert torch.allclose(got, q.grad, atol=1e-10)
        prev = now
