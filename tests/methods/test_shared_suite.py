"""The suite every method passes: reductions to the non-private twin, the privacy boundary
(no transform sees a batch axis) and one release per logical step."""

import copy

import pytest
import torch
from method_problems import small_problem
from torch import nn

from dpopt.engine.reference import per_sample_gradients
from dpopt.methods import make_optimizer
from dpopt.transforms.base import Chain, Partition, Transform

ALL = [
    "dp-sgd",
    "dp-adam",
    "dp-adambc",
    "adaclip",
    "dp-macadam",
    "dp-macadambc",
    "dp-muon",
    "dp-muon-s",
    "disk-sgd",
    "doppler-sgd",
    "disk-muon",
    "doppler-muon",
    "dp-muon-auto",
    "dp-muon-bc",
    "disk-muon-bc",
    "doppler-muon-bc",
]
LOSS = nn.functional.cross_entropy


pytestmark = pytest.mark.usefixtures("float64")  # see conftest.py


_problem = small_problem


def _small_problem(seed=0, n=16):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(n, 4)
    y = torch.randint(0, 3, (n,))
    return model, x, y


# ------------------------------------------------------------------ reductions
@pytest.mark.parametrize(
    "method, reference",
    [
        ("dp-sgd", lambda p: torch.optim.SGD(p, lr=0.1)),
        ("dp-adam", lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-8)),
        ("dp-macadam", lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-8)),
    ],
)
def test_reduction_to_non_private(method, reference):
    """σ = 0, C = ∞ and the full batch (B = B̄): the DP optimizer equals its non-private twin."""
    model, x, y = _small_problem()
    twin = copy.deepcopy(model)
    lr = 0.1 if method == "dp-sgd" else 1e-2
    opt = make_optimizer(
        method,
        model.parameters(),
        noise_multiplier=0.0,
        expected_batch_size=len(x),
        sample_rate=1.0,
        max_grad_norm=1e12,
        lr=lr,
    )
    ref = reference(twin.parameters())
    for _ in range(4):
        opt.step(per_sample_gradients(model, LOSS, x, y))
        ref.zero_grad()
        LOSS(twin(x), y).backward()
        ref.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p, q, atol=1e-10, rtol=1e-8)


# ------------------------------------------------------------------ privacy boundary
def _leaves(t: Transform):
    if isinstance(t, Chain):
        for s in t.transforms:
            yield from _leaves(s)
    elif isinstance(t, Partition):
        for s in t.transforms.values():
            yield from _leaves(s)
    else:
        yield t


def _guard(t: Transform, seen: dict):
    upd, geo, pts = t.update, t.geometry, t.evaluation_points

    def update(updates, states, params, ctx):
        assert len(updates) == len(params) == len(states) == len(ctx.noise_std) == len(ctx.lrs)
        for u, p, std in zip(updates, params, ctx.noise_std):
            assert u.shape == p.shape, (type(t).__name__, u.shape, p.shape)
            assert std.dim() == 0 or std.shape == p.shape
        seen["update"] += 1
        out = upd(updates, states, params, ctx)
        assert [o.shape for o in out] == [p.shape for p in params]
        return out

    def geometry(states, params):
        g = geo(states, params)
        for part in (g.shift, g.scale) if g is not None else ():
            if part is not None:
                assert [x.shape for x in part] == [p.shape for p in params]
        return g

    def evaluation_points(states, params):
        out = pts(states, params)
        for pt in out or ():
            if pt.offset is not None:
                assert [x.shape for x in pt.offset] == [p.shape for p in params]
        return out

    app = t.apply

    def apply(updates, states, params, ctx):  # the in-place door of the last transform (Transform.apply)
        assert len(updates) == len(params) == len(states) == len(ctx.lrs)
        assert [u.shape for u in updates] == [p.shape for p in params]
        seen["update"] += 1
        app(updates, states, params, ctx)

    t.update, t.geometry, t.evaluation_points, t.apply = update, geometry, evaluation_points, apply


@pytest.mark.parametrize("method", ALL)
def test_privacy_boundary_and_one_release_per_step(method):
    model, x, y = _problem(n=8)
    opt = make_optimizer(
        method,
        model.parameters(),
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        sample_rate=0.5,
        generator=torch.Generator().manual_seed(0),
    )
    seen = {"update": 0}
    for leaf in _leaves(opt.transform):
        _guard(leaf, seen)
    for step in range(3):
        idx = torch.arange(8)[torch.rand(8, generator=torch.Generator().manual_seed(step)) < 0.5]
        sources = [
            per_sample_gradients(model, LOSS, x[idx[:2]], y[idx[:2]], opt.evaluation_points()),
            per_sample_gradients(model, LOSS, x[idx[2:]], y[idx[2:]], opt.evaluation_points()),
        ]
        rel = opt.step(sources)  # two micro-batches, one logical step
        assert [g.shape for g in rel.grads] == [p.shape for p in model.parameters()]
    assert seen["update"] >= 3
    ledger = opt.privatizer.ledger
    assert len(ledger) == 3 and [e.step for e in ledger.entries] == [0, 1, 2]
    assert opt.privatizer.releases == 3 and opt.privatizer.reads == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())
