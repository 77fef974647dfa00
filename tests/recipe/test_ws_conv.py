"""WSConv2d (weight standardization) and its per-example rule (engine.ws), issue 24.

Checked: the forward equals a hand-written standardization; the Jacobian-transpose formula equals
autograd; per-example gradients w.r.t. the RAW weights through dpopt train's engine
(``iter_per_sample_sources``) and through PrivacyEngine's hook capture equal ``torch.func``
single-example autograd in train mode, with the fast rule in use (nothing demoted); a shift/scale
geometry; a DiSK evaluation point (the Jacobian at θ + offset); σ = 0 sensitivity ≤ C through both
doors; the zoo entries.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.engine import get_engine, iter_per_sample_sources
from dpopt.engine.hooks import HookCapture
from dpopt.engine.ws import WSConvBlock, ws_vjp
from dpopt.models import MODELS, WSConv2d, build_model, num_parameters
from dpopt.types import ClipGeometry, EvaluationPoint

C = 0.02  # every example is clipped in the sensitivity test


def ce(out, target):
    return F.cross_entropy(out, target)


class Small(nn.Module):
    """WSConv2d (bias, stride 2) → GN → ReLU → WSConv2d (no bias, called twice: shared weights) → Linear."""

    def __init__(self):
        super().__init__()
        self.c1 = WSConv2d(3, 6, 3, stride=2, padding=1)
        self.gn = nn.GroupNorm(2, 6)
        self.c2 = WSConv2d(6, 6, 3, padding=1, bias=False)
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        h = F.relu(self.gn(self.c1(x)))
        h = self.c2(F.relu(self.c2(h)))
        return self.fc(h.mean((2, 3)))


def data(b=6, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, 8, 8, generator=g, dtype=dtype), torch.randint(0, 4, (b,), generator=g)


def truth(model, x, y):
    """torch.func: vmap over examples of grad of the single-example loss, w.r.t. every raw parameter."""
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss(ps, xi, yi):
        return ce(functional_call(model, ps, (xi[None],)), yi[None])

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return [g[k] for k in names]


def one_hot_grads(src):
    """Per-example gradients recovered from the source's weighted sums with one-hot weights."""
    b, n = src.batch_size, src.num_params
    src.sq_norms(ClipGeometry(), [0] * n, 1)
    rows = []
    for i in range(b):
        w = torch.zeros(b, 1, dtype=src.dtype)
        w[i] = 1
        rows.append([t.clone() for t in src.weighted_sum(w, ClipGeometry(), [0] * n)])
    return [torch.stack([r[k] for r in rows]) for k in range(n)]


def assert_close_lists(got, want, tol):
    assert len(got) == len(want)
    for g, t in zip(got, want):
        assert g.shape == t.shape
        assert float((g - t).norm()) <= tol * float(t.norm()) + 1e-30


def test_forward_is_the_standardization():
    torch.manual_seed(0)
    m = WSConv2d(3, 5, 3, padding=1).double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    w = m.weight.detach()
    n = 3 * 3 * 3
    mu = w.mean((1, 2, 3), keepdim=True)
    var = ((w - mu) ** 2).mean((1, 2, 3), keepdim=True)
    w_hat = (w - mu) / torch.sqrt(n * var + 1e-4)
    assert torch.allclose(m(x), F.conv2d(x, w_hat, m.bias, padding=1), atol=1e-12)
    assert torch.allclose(w_hat.flatten(1).square().sum(1), torch.ones(5, dtype=torch.float64), atol=1e-3)
    with pytest.raises(ValueError, match="eps"):
        WSConv2d(3, 5, 3, eps=0.0)


def test_vjp_formula_equals_autograd():
    torch.manual_seed(1)
    m = WSConv2d(4, 3, 3).double()
    g = torch.randn(3, 36, dtype=torch.float64)
    w = m.weight.detach().clone().requires_grad_(True)
    w_hat, r = m.standardized(w)
    (want,) = torch.autograd.grad((w_hat.reshape(3, -1) * g).sum(), w)
    w_hat, r = m.standardized()
    got = ws_vjp(g, w_hat.detach().reshape(3, -1), r.detach())
    assert torch.allclose(got, want.reshape(3, -1), atol=1e-12)
    assert float(got.norm()) != pytest.approx(float(g.norm()), rel=1e-3)  # the chain is material


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 2e-4)])
def test_per_example_grads_through_dpopt_engine_equal_torch_func(dtype, tol):
    torch.manual_seed(2)
    model = Small().to(dtype).train()
    x, y = data(dtype=dtype)
    want = truth(model, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a demotion (rule disagreeing) would warn
        src = next(iter(iter_per_sample_sources(model, ce, x, y)))
    eng = get_engine(model, ce)
    assert eng.fallback_names == []
    assert any(isinstance(b, WSConvBlock) for b in src.blocks)
    sq = src.sq_norms(ClipGeometry(), [0] * src.num_params, 1)[:, 0]
    assert_close_lists(one_hot_grads(src), want, tol)
    want_sq = sum(t.flatten(1).double().square().sum(1) for t in want)
    assert torch.allclose(sq.double(), want_sq, rtol=tol)
    assert not [m for m in model.modules() if "forward" in m.__dict__]  # the tapped forward is undone


def test_per_example_grads_through_privacy_engine_hooks_equal_torch_func():
    torch.manual_seed(3)
    model = Small().double().train()
    x, y = data()
    want = truth(model, x, y)
    cap = HookCapture(model, loss_reduction="sum")
    try:
        for _ in range(2):  # the first collect runs the first-batch check
            model.zero_grad()
            F.cross_entropy(model(x), y, reduction="sum").backward()
            src = cap.collect()
        assert any(isinstance(b, WSConvBlock) for b in src.blocks)
        assert_close_lists(one_hot_grads(src), want, 1e-9)
    finally:
        cap.detach()
    assert not [m for m in model.modules() if "forward" in m.__dict__]


def test_shift_scale_geometry_norms_equal_materialised():
    torch.manual_seed(4)
    model = Small().double().train()
    x, y = data()
    want = truth(model, x, y)
    shifts = [torch.randn_like(p) * 0.01 for p in model.parameters()]
    scales = [torch.rand_like(p) + 0.5 for p in model.parameters()]
    geo = ClipGeometry(shift=shifts, scale=scales)
    src = next(iter(iter_per_sample_sources(model, ce, x, y)))
    sq = src.sq_norms(geo, [0] * src.num_params, 1)[:, 0]
    expect = sum(((g - m) / s).flatten(1).square().sum(1) for g, m, s in zip(want, shifts, scales))
    assert torch.allclose(sq, expect, rtol=1e-9)


def test_disk_evaluation_point_uses_the_shifted_weights_jacobian():
    torch.manual_seed(5)
    model = Small().double().train()
    x, y = data()
    offset = [torch.randn_like(p) * 0.3 for p in model.parameters()]
    pts = [EvaluationPoint(offset=offset, coef=1.0)]
    src = next(iter(iter_per_sample_sources(model, ce, x, y, points=pts)))
    shifted = copy.deepcopy(model)
    with torch.no_grad():
        for p, o in zip(shifted.parameters(), offset):
            p.add_(o)
    assert_close_lists(one_hot_grads(src), truth(shifted, x, y), 1e-9)


def _engine_release_times_b(model0, x, y):
    model = copy.deepcopy(model0)
    params = list(model.parameters())
    loader = DataLoader(TensorDataset(x, y), batch_size=len(y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # poisson_sampling=False is warned about
        model, opt, _ = dpopt.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(params, lr=1.0),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=C,
            poisson_sampling=False,
        )
    before = [p.detach().clone() for p in params]
    opt.zero_grad()
    ce(model(x), y).backward()
    opt.step()
    return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, params)]) * opt.expected_batch_size


def _fast_clipped_sum(model0, x, y):
    model = copy.deepcopy(model0)
    src = next(iter(iter_per_sample_sources(model, ce, x, y)))
    n, geo = src.num_params, ClipGeometry()
    w = torch.clamp(C / src.sq_norms(geo, [0] * n, 1)[:, 0].sqrt(), max=1.0).unsqueeze(1)
    return torch.cat([s.flatten() for s in src.weighted_sum(w, geo, [0] * n)])


@pytest.mark.parametrize("door", [_fast_clipped_sum, _engine_release_times_b], ids=["dpopt-engine", "privacy-engine"])
def test_sigma_zero_sensitivity_within_c(door):
    torch.manual_seed(6)
    model = Small().double().train()
    x, y = data()
    full = door(model, x, y)
    moves = []
    for j in range(len(y)):
        keep = torch.tensor([i for i in range(len(y)) if i != j])
        moves.append(float((full - door(model, x[keep], y[keep])).norm()))
    assert max(moves) <= C * (1 + 1e-9)
    assert min(moves) > 0.5 * C  # each example is clipped to C: its removal is visible


def test_zoo_entries():
    assert {"cnn5-ws", "wrn16-4-ws"} <= set(MODELS)
    for ws, plain in (("cnn5-ws", "cnn5"), ("wrn16-4-ws", "wrn16-4")):
        a, b = build_model(ws, "cifar10"), build_model(plain, "cifar10")
        assert num_parameters(a) == num_parameters(b)
        convs = [m for m in a.modules() if isinstance(m, nn.Conv2d)]
        assert convs and all(type(m) is WSConv2d for m in convs)
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in a.modules())
        assert any(isinstance(m, nn.GroupNorm) for m in a.modules())
    torch.manual_seed(0)
    out = build_model("cnn5-ws")(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
