"""Layers whose rows are not examples, captured through an enclosing call (:mod:`dpopt.engine.lift`), hook door.

Each model below has a trainable layer that does not see ``[B, ...]`` rows:
tokens flattened to ``[B·T, H]``, experts over routed token subsets, a table
shared by the batch, a weight-norm parametrization, a sequence-first layer,
a parameter read by its parent outside its module's call. The per-example
gradients read out of :class:`~dpopt.engine.hooks.HookCapture`'s source
(one-hot weighted sums) must equal a loop of single-example autograd calls
(each example alone) to 1e-10 in float64, and ``sq_norms`` their squared
norms; a model that mixes examples is still refused when the layer is lifted
up to the root.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from dpopt.engine.hooks import HookCapture
from dpopt.types import ClipGeometry

B, T, H = 5, 3, 4


class Flat(nn.Module):
    """A block that flattens its tokens to [B·T, H] (OPT's decoder MLP)."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(H), nn.Linear(H, H)

    def forward(self, x):
        b, t, h = x.shape
        return x + self.fc(self.norm(x.reshape(-1, h))).reshape(b, t, h).tanh()


class Moe(nn.Module):
    """Top-1 routing: a router over all tokens, experts over their routed subsets, index_add back."""

    def __init__(self, experts=3):
        super().__init__()
        self.gate = nn.Linear(H, experts)
        self.experts = nn.ModuleList(nn.Linear(H, H) for _ in range(experts))

    def forward(self, x):
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        probs = self.gate(flat).softmax(-1)
        weight, pick = probs.max(-1)
        out = torch.zeros_like(flat)
        for k, expert in enumerate(self.experts):
            rows = torch.where(pick == k)[0]
            if len(rows):
                out = out.index_add(0, rows, expert(flat[rows]) * weight[rows, None])
        return out.reshape(b, t, h)


class RelBias(nn.Module):
    """Attention scores plus a relative-position bias looked up from a [T, T] table of ids (T5)."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Embedding(2 * T - 1, 1)
        self.q = nn.Linear(H, H)

    def forward(self, x):
        pos = torch.arange(x.shape[1])
        bias = self.bias(pos[None, :] - pos[:, None] + x.shape[1] - 1)[..., 0]  # [T, T], no batch
        q = self.q(x)
        return (q @ x.transpose(1, 2) + bias).softmax(-1) @ x


class WeightNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = weight_norm(nn.Linear(H, H))

    def forward(self, x):
        return self.fc(x).tanh()


class ReadsChild(nn.Module):
    """A parent that reads its child's weight directly (DeBERTa-v2's encoder and rel_embeddings)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(T, H)
        self.fc = nn.Linear(H, H)

    def forward(self, x):
        return self.fc(x + self.table.weight[: x.shape[1]])


class SeqFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x):  # [B, T, H] -> [T, B, H] for the layer
        return self.fc(x.transpose(0, 1)).transpose(0, 1)


class Model(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(H, H), block, nn.Linear(H, 2)

    def forward(self, x):
        return self.head(self.block(self.inp(x)).mean(1))


BLOCKS = {
    "flattened-tokens": Flat,
    "routed-experts": Moe,
    "shared-table": RelBias,
    "weight-norm": WeightNormed,
    "read-by-parent": ReadsChild,
    "sequence-first": SeqFirst,
}


def _single_example(model, x, y):
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(len(y)):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
        rows.append(torch.autograd.grad(loss, params, allow_unused=True))
    return [torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows]) for k, p in enumerate(params)]


def _captured(cap, model, x, y):
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction="sum").backward()
    src = cap.collect()
    n = src.num_params
    out = [[] for _ in range(n)]
    for i in range(src.batch_size):
        w = torch.zeros(src.batch_size, 1, dtype=torch.float64)
        w[i] = 1.0
        for k, g in enumerate(src.weighted_sum(w, ClipGeometry(), [0] * n)):
            out[k].append(g)
    return src, [torch.stack(o) for o in out]


@pytest.mark.parametrize("name", list(BLOCKS))
def test_per_example_gradients_through_an_enclosing_call_equal_single_example_autograd(name):
    torch.manual_seed(0)
    model = Model(BLOCKS[name]()).double()
    x, y = torch.randn(B, T, H, dtype=torch.float64), torch.randint(0, 2, (B,))
    cap = HookCapture(model, "sum")
    try:
        _captured(cap, model, x, y)  # the first batch: the check (and the decisions it makes)
        src, got = _captured(cap, model, x, y)
        assert cap._rec.lifts.targets  # the block's layer went through an enclosing call
    finally:
        cap.detach()
    want = _single_example(model, x, y)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12)
    sq = src.sq_norms(ClipGeometry(), list(range(len(want))), len(want))
    ref = torch.stack([w.flatten(1).square().sum(1) for w in want], 1)
    assert torch.allclose(sq, ref, rtol=1e-10, atol=1e-14)


def test_routed_experts_of_one_example_do_not_depend_on_the_others():
    """σ = 0 sensitivity at the source: example 0's captured gradient is the same with other companions."""
    torch.manual_seed(1)
    model = Model(Moe()).double()
    x, y = torch.randn(B, T, H, dtype=torch.float64), torch.randint(0, 2, (B,))
    x2 = torch.cat([x[:1], torch.randn(B - 1, T, H, dtype=torch.float64)])
    cap = HookCapture(model, "sum")
    try:
        _captured(cap, model, x, y)
        _, a = _captured(cap, model, x, y)
        _, b = _captured(cap, model, x2, y)
    finally:
        cap.detach()
    for ga, gb in zip(a, b):
        assert torch.allclose(ga[0], gb[0], rtol=1e-10, atol=1e-12)


class MixingFlat(nn.Module):
    """Flattened tokens AND batch statistics: lifting cannot make it per example."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x):
        b, t, h = x.shape
        return self.fc((x - x.mean(0, keepdim=True)).reshape(-1, h)).reshape(b, t, h)


class RootOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, 2)

    def forward(self, x):  # only the root encloses the flattened call
        return self.fc(x.reshape(-1, x.shape[-1])).reshape(x.shape[0], -1, 2).mean(1)


def test_a_layer_only_the_root_encloses_is_refused():
    """The root is never an enclosing call (its vjp alone could hide mixing): refused as before."""
    model = RootOnly().double()
    cap = HookCapture(model, "sum")
    try:
        F.cross_entropy(model(torch.randn(B, T, H, dtype=torch.float64)), torch.randint(0, 2, (B,))).backward()
        with pytest.raises(ValueError, match="does not keep the examples along dim 0"):
            cap.collect()
    finally:
        cap.detach()


def test_an_enclosing_call_that_mixes_examples_is_refused():
    torch.manual_seed(0)
    model = Model(MixingFlat()).double()
    cap = HookCapture(model, "sum")
    try:
        F.cross_entropy(model(torch.randn(B, T, H, dtype=torch.float64)), torch.randint(0, 2, (B,))).backward()
        with pytest.raises(ValueError, match="do not match single-example"):
            cap.collect()
    finally:
        cap.detach()
