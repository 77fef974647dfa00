"""Each method step by step: reductions to non-private twins, hand-computed steps, Muon routing.

Hand-computed steps feed fixed per-sample gradients (a linear loss, so the
gradient does not depend on θ) straight to ``DPOptimizer.step`` and compare
the parameter updates with the algorithm boxes evaluated by scalar arithmetic.
Where noise is on (σ > 0) the expected update is computed from the released
values read back from the optimizer (``Release.grads``, ``Release.noise_std``).
"""

import copy
import math

import numpy as np
import pytest
import torch
from method_problems import small_problem
from torch import nn

from dpopt.engine.reference import PerSampleGrads, per_sample_gradients
from dpopt.methods import make_optimizer
from dpopt.noise import NoiseSource
from dpopt.transforms.base import StepContext
from dpopt.transforms.macadam import MacAdam
from dpopt.transforms.muon import hidden_matrix_labels
from dpopt.transforms.newton_schulz import NS_COEFFICIENTS

LOSS = nn.functional.cross_entropy
NS_A, NS_B, NS_C = NS_COEFFICIENTS


pytestmark = pytest.mark.usefixtures("float64")  # see conftest.py


# ------------------------------------------------------------------ reductions
_problem = small_problem


def _nonprivate(method, model, n, **kw):
    return make_optimizer(
        method,
        model.parameters(),
        noise_multiplier=0.0,
        expected_batch_size=n,
        sample_rate=1.0,
        max_grad_norm=1e12,
        **kw,
    )


def _train_pair(opt, model, twin, ref_step, x, y, steps=4):
    for _ in range(steps):
        opt.step(per_sample_gradients(model, LOSS, x, y, opt.evaluation_points()))
        for p in twin.parameters():
            p.grad = None
        LOSS(twin(x), y).backward()
        ref_step()


def test_dp_adambc_reduces_to_adam():
    """σ = 0 (Φ = 0), C = ∞, γ′ → 0: DP-AdamBC is Adam with ε = 0."""
    model, x, y = _problem()
    twin = copy.deepcopy(model)
    opt = _nonprivate("dp-adambc", model, len(x), lr=1e-2, gamma_prime=1e-300)
    ref = torch.optim.Adam(twin.parameters(), lr=1e-2, eps=0.0)
    _train_pair(opt, model, twin, ref.step, x, y)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p, q, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize(
    "method, kw",
    [
        ("doppler-sgd", {"filter": "none"}),
        ("doppler-sgd", {"filter_a": (1.0,), "filter_b": (1.0,)}),
        ("disk-sgd", {"kappa": 1.0}),  # κ = 1: g_t = ĝ_t and c = 0 (no extrapolation)
    ],
)
def test_trivial_filters_reduce_to_sgd(method, kw):
    model, x, y = _problem()
    twin = copy.deepcopy(model)
    opt = _nonprivate(method, model, len(x), lr=0.3, **kw)
    ref = torch.optim.SGD(twin.parameters(), lr=0.3)
    _train_pair(opt, model, twin, ref.step, x, y)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p, q, atol=1e-12, rtol=1e-10)


def _np_newton_schulz(g, steps=5, eps=1e-7):
    """Muon's quintic Newton–Schulz in numpy float64 (written independently of dpopt)."""
    x = np.asarray(g, dtype=np.float64)
    flip = x.shape[0] > x.shape[1]
    if flip:
        x = x.T
    x = x / (np.sqrt((x * x).sum()) + eps)
    for _ in range(steps):
        a = x @ x.T
        x = NS_A * x + (NS_B * a + NS_C * a @ a) @ x
    return x.T if flip else x


class _ReferenceMuon:
    """Non-private Muon (EMA momentum, Nesterov blend, NS5, √max(1, rows/cols)) + Adam for the rest."""

    def __init__(self, params, is_muon, lr=0.02, other_lr=1e-3, beta=0.95, betas=(0.9, 0.999), eps=1e-8):
        self.params, self.is_muon = list(params), list(is_muon)
        self.lr, self.other_lr, self.beta, self.betas, self.eps = lr, other_lr, beta, betas, eps
        self.buf = [np.zeros(tuple(p.shape)) for p in self.params]
        self.m = [np.zeros(tuple(p.shape)) for p in self.params]
        self.v = [np.zeros(tuple(p.shape)) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        b1, b2 = self.betas
        for i, p in enumerate(self.params):
            g = p.grad.numpy().astype(np.float64)
            if self.is_muon[i]:
                self.buf[i] = self.beta * self.buf[i] + (1 - self.beta) * g
                u = (1 - self.beta) * g + self.beta * self.buf[i]
                o = _np_newton_schulz(u) * math.sqrt(max(1.0, u.shape[0] / u.shape[1]))
                p -= torch.from_numpy(self.lr * o)
            else:
                self.m[i] = b1 * self.m[i] + (1 - b1) * g
                self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
                mh, vh = self.m[i] / (1 - b1**self.t), self.v[i] / (1 - b2**self.t)
                p -= torch.from_numpy(self.other_lr * mh / (np.sqrt(vh) + self.eps))


def test_dp_muon_reduces_to_non_private_muon():
    model, x, y = _problem()
    twin = copy.deepcopy(model)
    opt = _nonprivate("dp-muon", model, len(x))
    # routing: the MLP's first linear (a dense hidden matrix) and the middle one are Muon; the head,
    # and every bias, are Adam
    assert hidden_matrix_labels(list(model.parameters())).labels == ["muon", "other", "muon", "other", "other", "other"]
    ref = _ReferenceMuon(twin.parameters(), [p.dim() == 2 for p in twin.parameters()][:4] + [False, False])
    _train_pair(opt, model, twin, ref.step, x, y, steps=5)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p, q, atol=1e-12, rtol=1e-10)
    init = _problem()[0].parameters()
    moved = [float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), init)]
    assert min(moved) > 1e-4  # every parameter was actually trained


def test_dp_muon_matches_torch_optim_muon():
    """torch.optim.Muon (bfloat16 Newton–Schulz, hence the tolerance) + torch Adam for the rest."""
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon not available")
    model, x, y = _problem(seed=1)
    twin = copy.deepcopy(model)
    opt = _nonprivate("dp-muon", model, len(x))
    ps = list(twin.parameters())
    muon_p, adam_p = [ps[0], ps[2]], [ps[1], ps[3], ps[4], ps[5]]
    t_muon = torch.optim.Muon(muon_p, lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True, adjust_lr_fn="original")
    t_adam = torch.optim.Adam(adam_p, lr=1e-3, eps=1e-8)

    def ref_step():
        t_muon.step()
        t_adam.step()

    start = [p.detach().clone() for p in model.parameters()]
    _train_pair(opt, model, twin, ref_step, x, y, steps=3)
    for p, q, s in zip(model.parameters(), twin.parameters(), start):
        # bf16 NS differs by ~1% of the Muon step; the Adam parameters then see slightly different
        # gradients. Both stay within 10% of how far the parameter moved.
        assert float((p - q).detach().abs().max()) < 0.1 * float((p - s).detach().abs().max())


# ------------------------------------------------------------------ hand-computed steps
def _p5(s):
    """Five quintic Newton–Schulz steps on one (signed) singular value: p is odd."""
    for _ in range(5):
        s = NS_A * s + NS_B * s**3 + NS_C * s**5
    return s


def _adam_scalar(gs, lr, betas=(0.9, 0.999), eps=1e-8):
    """Adam updates for one scalar coordinate, by hand."""
    b1, b2 = betas
    m = v = 0.0
    out = []
    for t, g in enumerate(gs, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        out.append(-lr * (m / (1 - b1**t)) / (math.sqrt(v / (1 - b2**t)) + eps))
    return out


def _muon_params():
    """W: 2×2 hidden matrix (Muon), c: bias (other), H: 1×2 head (other, last matrix)."""
    return [torch.zeros(2, 2), torch.zeros(2), torch.zeros(1, 2)]


def _muon_grads(wdiag, c, h, points=None):
    """Two examples whose per-sample gradients sum (÷ B̄ = 2) to diag(wdiag), c, h.

    ``points``: where they count as evaluated (DiSK asks for θ + γd from step 2 on; these
    hand-made gradients do not depend on θ, so any point is honest)."""
    gw = torch.zeros(2, 2, 2)
    gw[0, 0, 0], gw[1, 1, 1] = 2 * wdiag[0], 2 * wdiag[1]
    gc = torch.tensor([[2 * c[0], 0.0], [0.0, 2 * c[1]]])
    gh = torch.tensor([[[2 * h[0], 0.0]], [[0.0, 2 * h[1]]]])
    return PerSampleGrads([gw, gc, gh], points=points)


def _nonprivate_tiny(method, params, **kw):
    return make_optimizer(
        method, params, noise_multiplier=0.0, expected_batch_size=2.0, sample_rate=0.5, max_grad_norm=1e9, **kw
    )


STEPS = [
    ((3.0, 4.0), (1.0, -2.0), (0.5, 0.25)),
    ((-1.0, 2.0), (0.5, 1.0), (-1.0, 0.5)),
    ((2.0, 1.0), (-3.0, 1.0), (0.25, -0.5)),
]


def _check_other(params, deltas_c, deltas_h):
    c, h = params[1], params[2]
    assert c.tolist() == pytest.approx(deltas_c, rel=1e-9, abs=1e-15)
    assert h[0].tolist() == pytest.approx(deltas_h, rel=1e-9, abs=1e-15)


def _diag_muon_expected(filtered, beta=0.95, nesterov=True, lr=0.02):
    """Muon on diagonal 2×2 gradients: NS acts on each diagonal entry (signed singular value)."""
    buf = [0.0, 0.0]
    w = [0.0, 0.0]
    for g in filtered:
        buf = [beta * b + (1 - beta) * gi for b, gi in zip(buf, g)]
        u = [(1 - beta) * gi + beta * b for gi, b in zip(g, buf)] if nesterov else list(buf)
        fro = math.sqrt(u[0] ** 2 + u[1] ** 2) + 1e-7
        w = [wi - lr * _p5(ui / fro) for wi, ui in zip(w, u)]
    return w


def _run_muon_like(method, filtered_fn, **kw):
    params = _muon_params()
    opt = _nonprivate_tiny(method, params, **kw)
    for wdiag, c, h in STEPS:
        opt.step(_muon_grads(wdiag, c, h, points=opt.evaluation_points()))
    filt_w = filtered_fn([s[0] for s in STEPS])
    filt_c = filtered_fn([s[1] for s in STEPS])
    filt_h = filtered_fn([s[2] for s in STEPS])
    w = _diag_muon_expected(filt_w)
    assert params[0].flatten().tolist() == pytest.approx([w[0], 0.0, 0.0, w[1]], rel=1e-9, abs=1e-15)
    other = [[sum(_adam_scalar([g[j] for g in seq], 1e-3)) for j in range(2)] for seq in (filt_c, filt_h)]
    _check_other(params, other[0], other[1])
    return params


def test_dp_muon_three_steps_by_hand():
    params = _run_muon_like("dp-muon", lambda gs: gs)
    # first step alone, fully by hand: U_1 = 0.0975·diag(1.5, 2) → X_0 = diag(0.6, 0.8) (up to ε)
    p1 = _muon_params()
    _nonprivate_tiny("dp-muon", p1).step(_muon_grads(*STEPS[0]))
    assert torch.diagonal(p1[0]).tolist() == pytest.approx([-0.02 * _p5(0.6), -0.02 * _p5(0.8)], rel=1e-5)
    assert p1[1].tolist() == pytest.approx([-1e-3, 1e-3], rel=1e-6)  # Adam's first step: −lr·sign(g)
    assert params[0][0, 1].item() == 0.0


def test_disk_muon_three_steps_by_hand():
    def disk(gs, kappa=0.7):
        out, f = [], None
        for g in gs:
            f = list(g) if f is None else [(1 - kappa) * a + kappa * b for a, b in zip(f, g)]
            out.append(f)
        return out

    _run_muon_like("disk-muon", disk)


def test_doppler_muon_three_steps_by_hand():
    def ema(gs):
        out, m = [], [0.0, 0.0]
        for t, g in enumerate(gs, start=1):
            m = [0.9 * a + 0.1 * b for a, b in zip(m, g)]
            out.append([a / (1 - 0.9**t) for a in m])
        return out

    _run_muon_like("doppler-muon", ema)


def test_dp_muon_s_by_hand_rank_one_and_exact():
    # rank-1 W gradients s·e₁e₂ᵀ: the power iteration is exact after one step, and the normalised
    # matrix has the single singular value s/(s + ε), so O = σ₁(U)·p⁵(s/(s+ε))·e₁e₂ᵀ.
    params = _muon_params()
    opt = _nonprivate_tiny("dp-muon-s", params)
    beta, lr, buf, w = 0.9, 0.3, 0.0, 0.0
    for s in (2.0, -1.0, 3.0):
        gw = torch.zeros(2, 2, 2)
        gw[0, 0, 1] = 2 * s
        opt.step(PerSampleGrads([gw, torch.zeros(2, 2), torch.zeros(2, 1, 2)]))
        buf = beta * buf + (1 - beta) * s  # no Nesterov: U = M
        w -= lr * abs(buf) * _p5(buf / (abs(buf) + 1e-7))
        assert params[0].flatten().tolist() == pytest.approx([0.0, w, 0.0, 0.0], rel=1e-9, abs=1e-15)
    assert w == pytest.approx(-0.3 * (0.2 * _p5(1.0) + 0.08 * _p5(1.0) + 0.372 * _p5(1.0)), rel=1e-5)
    # exact (SVD) mode: O = σ₁(U)·UVᵀ; for a diagonal U, UVᵀ = diag(sign)
    params = _muon_params()
    opt = _nonprivate_tiny("dp-muon-s", params, orthogonalizer="svd")
    opt.step(_muon_grads((3.0, -4.0), (0.0, 0.0), (0.0, 0.0)))
    assert torch.diagonal(params[0]).tolist() == pytest.approx([-0.3 * 0.4 * 1.0, -0.3 * 0.4 * -1.0])


def test_dp_adambc_two_steps_by_hand_with_noise():
    theta = torch.zeros(3)
    sigma, clip, bbar, lr, gp = 1.0, 1.0, 2.0, 1e-3, 1e-8
    opt = make_optimizer(
        "dp-adambc",
        [theta],
        noise_multiplier=sigma,
        expected_batch_size=bbar,
        sample_rate=0.5,
        max_grad_norm=clip,
        lr=lr,
        gamma_prime=gp,
        generator=torch.Generator().manual_seed(3),
    )
    grads = [torch.tensor([[0.6, 0.0, 0.8], [3.0, 4.0, 0.0]]), torch.tensor([[0.0, 0.0, 0.1], [0.2, 0.0, 0.0]])]
    m = [0.0] * 3
    v = [0.0] * 3
    floors = 0
    for t, g in enumerate(grads, start=1):
        before = theta.clone()
        rel = opt.step(PerSampleGrads([g]))
        phi = (sigma * clip / bbar) ** 2  # Φ = (σC/B̄)² = 0.25
        assert float(rel.noise_std[0]) ** 2 == pytest.approx(phi)
        gt = rel.grads[0].tolist()
        for j in range(3):
            m[j] = 0.9 * m[j] + 0.1 * gt[j]
            v[j] = 0.999 * v[j] + 0.001 * gt[j] ** 2
            mh, vh = m[j] / (1 - 0.9**t), v[j] / (1 - 0.999**t)
            floors += vh - phi < gp
            expected = -lr * mh / math.sqrt(max(vh - phi, gp))
            assert float(theta[j] - before[j]) == pytest.approx(expected, rel=1e-9)
    assert floors >= 1  # with this seed the floor γ′ is exercised at least once


def test_dp_macadambc_two_steps_by_hand_with_noise():
    theta = torch.zeros(2)
    sigma, bbar, lr, gp, h1, h2 = 1.0, 4.0, 1e-3, 1e-8, 1e-9, 1e-2
    opt = make_optimizer(
        "dp-macadambc",
        [theta],
        noise_multiplier=sigma,
        expected_batch_size=bbar,
        sample_rate=0.5,
        lr=lr,
        h1=h1,
        h2=h2,
        generator=torch.Generator().manual_seed(5),
    )
    grads = [torch.tensor([[0.3, -0.1], [0.2, 0.4]]), torch.tensor([[0.1, 0.1], [-0.2, 0.3]])]
    b = [0.5, 0.5]  # b_0 = 1/d
    mhat_prev = [0.0, 0.0]
    m, v, s = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
    for t, g in enumerate(grads, start=1):
        geo = opt.geometry()
        assert geo.shift[0].tolist() == pytest.approx(mhat_prev, rel=1e-12)
        assert geo.scale[0].tolist() == pytest.approx(b, rel=1e-12)
        before = theta.clone()
        rel = opt.step(PerSampleGrads([g]))
        gt = rel.grads[0].tolist()
        phi = [(bj * sigma / bbar) ** 2 for bj in b]  # b_{t−1}² σ² / B̄² per coordinate
        assert (rel.noise_std[0] ** 2).tolist() == pytest.approx(phi, rel=1e-12)
        mhat = [0.0, 0.0]
        for j in range(2):
            m[j] = 0.9 * m[j] + 0.1 * gt[j]
            v[j] = 0.999 * v[j] + 0.001 * gt[j] ** 2
            mhat[j], vh = m[j] / (1 - 0.9**t), v[j] / (1 - 0.999**t)
            expected = -lr * mhat[j] / math.sqrt(max(vh - phi[j], gp))
            assert float(theta[j] - before[j]) == pytest.approx(expected, rel=1e-9)
            s[j] = 0.9 * s[j] + 0.1 * (gt[j] - mhat[j]) ** 2  # line 18 "paper"
        kappa = 2 * (0.9 - 0.9**t) / 1.9
        if t >= 2:  # κ_1 = 0: b is kept at t = 1 (ALGORITHMS.md)
            shat = [min(max(s[j] / kappa - phi[j], h1), h2) for j in range(2)]
            root = sum(math.sqrt(x) for x in shat)
            b = [x**0.25 * root**0.5 for x in shat]
        mhat_prev = mhat
    geo = opt.geometry()
    assert geo.scale[0].tolist() == pytest.approx(b, rel=1e-9)
    assert geo.shift[0].tolist() == pytest.approx(mhat_prev, rel=1e-12)


def test_disk_sgd_three_steps_by_hand():
    theta = torch.zeros(2)
    lr, kappa, gamma = 0.5, 0.7, 0.5
    opt = _nonprivate_tiny("disk-sgd", [theta], lr=lr)
    gs = [(1.0, 2.0), (-1.0, 0.0), (0.5, 0.5)]
    f, th, prev = None, [0.0, 0.0], None
    for g in gs:
        pts = opt.evaluation_points()
        if prev is None:
            assert len(pts) == 1 and pts[0].offset is None
        else:
            c = (1 - kappa) / (kappa * gamma)
            assert [p.coef for p in pts] == pytest.approx([c, 1 - c])
            assert pts[0].offset[0].tolist() == pytest.approx([gamma * (a - b) for a, b in zip(th, prev)])
        opt.step(PerSampleGrads([torch.tensor([[2 * g[0], 2 * g[1]], [0.0, 0.0]])], points=pts))
        f = list(g) if f is None else [(1 - kappa) * a + kappa * b for a, b in zip(f, g)]
        prev, th = th, [a - lr * b for a, b in zip(th, f)]
        assert theta.tolist() == pytest.approx(th, rel=1e-12)
    assert th == pytest.approx(
        [-0.5 * (1.0 + (0.3 - 0.7)) - 0.5 * (0.3 * -0.4 + 0.35), -0.5 * (2.0 + 0.6) - 0.5 * (0.18 + 0.35)]
    )


def test_doppler_sgd_three_steps_by_hand():
    theta = torch.zeros(1)
    opt = _nonprivate_tiny("doppler-sgd", [theta])  # lr 3.0, EMA β = 0.9, bias-corrected
    for g in (1.0, 3.0, -1.0):
        opt.step(PerSampleGrads([torch.tensor([[2 * g], [0.0]])]))
    expected = -3.0 * (1.0 + 0.39 / 0.19 + 0.251 / 0.271)
    assert theta.item() == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------ routing
def test_hidden_matrix_labels_and_override():
    conv = [
        torch.zeros(8, 3, 3, 3),
        torch.zeros(8),
        torch.zeros(16, 8, 3, 3),
        torch.zeros(16),
        torch.zeros(4, 16, 1, 1),
    ]
    conv.insert(4, torch.zeros(16))  # a norm gain
    conv += [torch.zeros(10, 64), torch.zeros(10)]
    assert hidden_matrix_labels(conv).labels == ["other", "other", "muon", "other", "other", "muon", "other", "other"]
    assert hidden_matrix_labels(conv, exclude_first="never", exclude_last=False).labels[0] == "muon"
    mlp = [torch.zeros(64, 64), torch.zeros(64), torch.zeros(10, 64), torch.zeros(10)]
    assert hidden_matrix_labels(mlp).labels == ["muon", "other", "other", "other"]
    assert hidden_matrix_labels(mlp, exclude_first="always").labels == ["other"] * 4
    with pytest.raises(ValueError, match="was not in the list"):
        hidden_matrix_labels(mlp)(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="exclude_first"):
        hidden_matrix_labels(mlp, exclude_first="first")
    # user override: everything to the "other" optimizer makes dp-muon exactly Adam at other_lr
    w = torch.zeros(2, 2)
    opt = make_optimizer(
        "dp-muon",
        [w],
        noise_multiplier=0.0,
        expected_batch_size=2.0,
        sample_rate=0.5,
        max_grad_norm=1e9,
        label_fn=lambda p: "other",
    )
    opt.step(PerSampleGrads([torch.tensor([[[1.0, -2.0], [0.0, 4.0]], [[0.0, 0.0], [0.0, 0.0]]])]))
    assert w.flatten().tolist() == pytest.approx([-1e-3, 1e-3, 0.0, -1e-3], rel=1e-6)
    with pytest.raises(ValueError, match="matrices"):
        make_optimizer(
            "dp-muon",
            [torch.zeros(3)],
            noise_multiplier=0.0,
            expected_batch_size=2.0,
            sample_rate=0.5,
            label_fn=lambda p: "muon",
        ).step(PerSampleGrads([torch.zeros(1, 3)]))


def test_lr_applies_to_muon_and_other_lr_to_the_rest():
    """--lr is the Muon lr; the other part runs at other_lr (its multiplier tracks lr schedules)."""
    params = _muon_params()
    opt = _nonprivate_tiny("dp-muon", params, lr=0.05, other_lr=0.01, orthogonalizer="svd")
    opt.param_groups[0]["lr"] = 0.1  # e.g. an LR scheduler doubling the lr
    opt.step(_muon_grads((3.0, 4.0), (1.0, -1.0), (0.0, 0.0)))
    assert torch.diagonal(params[0]).tolist() == pytest.approx([-0.1, -0.1])  # polar of diag(+,+) = I
    assert params[1].tolist() == pytest.approx([-0.02, 0.02], rel=1e-6)  # 0.01 × (0.1/0.05)


# ------------------------------------------------------------------ DP-MacAdam (Algorithm 1)
def _macadam_reference(grads, sigma, bbar, noise, lr, betas=(0.9, 0.999), gamma=1e-8, h1=1e-9, h2=1e-6, unbiased=False):
    """Algorithm 1 of dp-macadam.txt, written out in numpy for a flat parameter vector.

    grads[t]: per-sample gradients [B, d] at step t (given, not re-evaluated: a linear loss);
    noise[t]: the standard normal draws z_t [d]. Returns the list of parameter updates.
    """
    b1, b2 = betas
    d = grads[0].shape[1]
    m = np.zeros(d)
    v = np.zeros(d)
    s = np.zeros(d)
    m_hat = np.zeros(d)
    b = np.full(d, 1.0 / d)
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
    grads = [
        np.array([[0.02, -0.01, 0.005], [0.0, 0.0, 0.0], [0.01, 0.03, -0.02]]),
        np.array([[0.015, -0.002, 0.0], [0.004, 0.001, 0.002], [-0.01, 0.02, 0.001]]),
        np.array([[0.001, 0.0005, -0.0002], [0.0, 0.002, 0.0001], [0.003, -0.001, 0.0]]),
    ]
    sigma, bbar, lr = 0.5, 4.0, 0.01
    h1, h2 = 1e-8, 1e-4
    param = torch.zeros(3, requires_grad=True)
    gen = torch.Generator().manual_seed(3)
    opt = make_optimizer(
        "dp-macadam",
        [param],
        noise_multiplier=sigma,
        expected_batch_size=bbar,
        sample_rate=0.1,
        generator=gen,
        lr=lr,
        h1=h1,
        h2=h2,
        variance_update="unbiased" if unbiased else "paper",
    )
    replay = torch.Generator().manual_seed(3)
    source = NoiseSource("reproducible", generator=replay)  # the Privatizer's draws, replayed
    noise = [source.normal((3,), dtype=torch.float64).numpy() for _ in range(3)]
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


@pytest.mark.parametrize(
    "variance_update, expected_t2, expected_t60",
    [
        ("paper", 0.9 / 1.9, 0.9),  # E[s_t]/κ_t = β/(1+β) V at t = 2, → β V later
        ("unbiased", 1.0, 1.0),
    ],
)
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
