"""bf16 autocast on transformer blocks through both doors: the engine's norms and clipped sums in float32.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` the model's matmuls run
in bf16, so the recorded activations a and output gradients e are bf16
values (LayerNorm runs in float32 under autocast). The engine casts them to
the parameters' dtype (float32) and computes every per-example norm, the
clip factors and the clipped sums outside autocast, in float32, from the SAME
a and e: g_i is then the float32 gradient of the bf16 forward, and the
bound is a float32 statement — ‖c_i g_i‖ ≤ C up to float32 rounding of the
norm (a relative few·1e-7, far inside the 1e-5 asserted here), whatever
bf16 did to g_i itself. Checked: no layer demoted or refused by the
first-batch check (its tolerance is bf16's, the autocast dtype), float32
norms, per-example gradients within bf16's few percent of single-example
autograd under the same autocast, and σ = 0 sensitivity ≤ C when removing one
example.

Against the float32 reference (single-example autograd without autocast, float32 weights), issue 34's
bf16 exactness: bf16 keeps 8 significant bits (unit roundoff u = 2⁻⁸ ≈ 3.9e-3) and a block's forward and
backward chain about a dozen roundings, so the stated tolerance is 5 % (≈ 13 u) of each example's gradient,
2 % of the whole batch's and 1 % of each per-example norm (measured: 2.6 %, 0.9 %, 0.2 % under autocast;
2.6 %, 0.9 % and 0.25 % with bf16 weights — most of it the rounding of the weights to bf16, which the float32
reference does not share; their norms and sums are float32 too: tests/engine/test_bf16_weights.py compares
them with a float32 reference on the same bf16 weights).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpopt.engine import iter_per_sample_sources
from dpopt.engine.hooks import HookCapture
from dpopt.types import ClipGeometry

B, T, E, C_OUT = 5, 4, 8, 3


class Block(nn.Module):
    """A pre-norm transformer block (attention + MLP, both with LayerNorm) and a head; x [B, T, E]."""

    def __init__(self, batch_first: bool = True):
        super().__init__()
        self.batch_first = batch_first
        self.enc = nn.TransformerEncoderLayer(E, 2, 16, dropout=0.0, batch_first=batch_first, norm_first=True)
        self.head = nn.Linear(E, C_OUT)

    def forward(self, x):
        h = self.enc(x if self.batch_first else x.transpose(0, 1))
        return self.head((h if self.batch_first else h.transpose(0, 1)).mean(1))


def ce(out, y):
    return F.cross_entropy(out.float(), y)


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(B, T, E, generator=gen), torch.randint(0, C_OUT, (B,), generator=gen)


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _truth(model, x, y):
    params = list(model.parameters())
    rows = []
    for i in range(len(y)):
        with _bf16():
            loss = ce(model(x[i : i + 1]), y[i : i + 1])
        rows.append(torch.autograd.grad(loss, params))
    return [torch.stack([r[k] for r in rows]) for k in range(len(params))]


def _engine_source(model, x, y):
    with _bf16():
        return next(iter(iter_per_sample_sources(model, ce, x, y)))


def _hook_source(model, x, y):
    cap = HookCapture(model, "sum")
    try:
        for _ in range(2):  # the first collect runs the first-batch check
            model.zero_grad()
            with _bf16():
                loss = F.cross_entropy(model(x).float(), y, reduction="sum")
            loss.backward()
            src = cap.collect()
        return src
    finally:
        cap.detach()


DOORS = {"engine": _engine_source, "hooks": _hook_source}


def _per_example(src):
    rows = []
    for i in range(src.batch_size):
        w = torch.zeros(src.batch_size, 1)
        w[i] = 1
        rows.append(src.weighted_sum(w, ClipGeometry(), [0] * src.num_params))
    return [torch.stack([r[k] for r in rows]) for k in range(src.num_params)]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("door", list(DOORS))
def test_bf16_autocast_block_per_example_gradients_in_float32(door, batch_first):
    torch.manual_seed(0)
    model = Block(batch_first).train()
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no demotion, no loop fallback
        src = DOORS[door](model, x, y)
    sq = src.sq_norms(ClipGeometry(), [0] * src.num_params, 1)[:, 0]
    assert sq.dtype == torch.float32
    got, want = _per_example(src), _truth(model, x, y)
    assert all(g.dtype == torch.float32 for g in got)
    num = sum(float((g - t).square().sum()) for g, t in zip(got, want)) ** 0.5
    den = sum(float(t.square().sum()) for t in want) ** 0.5
    assert num <= 0.05 * den  # bf16 forward on both sides (different batch shapes: different roundings)
    want_sq = sum(g.flatten(1).square().sum(1) for g in got)  # the norms are those of the summed gradients
    torch.testing.assert_close(sq, want_sq, rtol=1e-4, atol=0.0)


def _clipped_sum(model0, x, y, door, c):
    model = copy.deepcopy(model0)
    src = DOORS[door](model, x, y)
    n, geo = src.num_params, ClipGeometry()
    w = torch.clamp(c / src.sq_norms(geo, [0] * n, 1)[:, 0].sqrt(), max=1.0).unsqueeze(1)
    return torch.cat([s.flatten() for s in src.weighted_sum(w, geo, [0] * n)])


@pytest.mark.parametrize("door", list(DOORS))
def test_bf16_autocast_sigma_zero_sensitivity_within_c(door):
    torch.manual_seed(0)
    model, (x, y) = Block().train(), _data()
    c = 0.05  # below every example's norm here: each is clipped
    full = _clipped_sum(model, x, y, door, c)
    moves = []
    for j in range(B):
        keep = torch.tensor([i for i in range(B) if i != j])
        moves.append(float((full - _clipped_sum(model, x[keep], y[keep], door, c)).norm()))
    assert max(moves) <= c * (1 + 1e-5)
    assert min(moves) > 0.5 * c


def _fp32_truth(model, x, y):
    """Single-example float32 autograd, no autocast: ``[B, *p.shape]`` per parameter."""
    params = list(model.parameters())
    rows = [torch.autograd.grad(ce(model(x[i : i + 1]), y[i : i + 1]), params) for i in range(len(y))]
    return [torch.stack([r[k] for r in rows]) for k in range(len(params))]


def _assert_within_bf16_tolerance(src, want):
    got = [g.float() for g in _per_example(src)]
    row = [sum(float((g[i] - t[i]).square().sum()) for g, t in zip(got, want)) ** 0.5 for i in range(B)]
    ref = [sum(float(t[i].square().sum()) for t in want) ** 0.5 for i in range(B)]
    assert max(r / n for r, n in zip(row, ref)) <= 0.05
    assert sum(r * r for r in row) ** 0.5 <= 0.02 * sum(n * n for n in ref) ** 0.5
    norms = src.sq_norms(ClipGeometry(), [0] * src.num_params, 1)[:, 0].float().sqrt()
    torch.testing.assert_close(norms, torch.tensor(ref), rtol=0.01, atol=0.0)


@pytest.mark.parametrize("door", list(DOORS))
def test_bf16_autocast_against_the_float32_reference(door):
    torch.manual_seed(0)
    model = Block().train()
    x, y = _data()
    want = _fp32_truth(model, x, y)
    _assert_within_bf16_tolerance(DOORS[door](model, x, y), want)


def _bf16_weights_hook_source(model, x, y):
    cap = HookCapture(model, "sum")
    try:
        for _ in range(2):  # the first collect runs the first-batch check
            model.zero_grad()
            F.cross_entropy(model(x).float(), y, reduction="sum").backward()
            src = cap.collect()
        return src
    finally:
        cap.detach()


@pytest.mark.parametrize("door", list(DOORS))
def test_bf16_weights_against_the_float32_reference(door):
    torch.manual_seed(0)
    model = Block().train()
    x, y = _data()
    want = _fp32_truth(model, x, y)
    low, xb = copy.deepcopy(model).to(torch.bfloat16), x.to(torch.bfloat16)
    if door == "engine":
        src = next(iter(iter_per_sample_sources(low, ce, xb, y)))
    else:
        src = _bf16_weights_hook_source(low, xb, y)
    _assert_within_bf16_tolerance(src, want)
