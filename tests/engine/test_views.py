"""Example identity across views (``rows_per_example=K``, augmentation multiplicity) through both doors.

Rows i·K … i·K + K − 1 of a batch are K views of example i; its per-example
gradient is the MEAN over its views, g_i = (1/K) Σ_v ∇ℓ(x_{iK+v}, y_{iK+v}).
The truth is single-example autograd: each row alone through the model, the
K gradients of an example averaged. Checked for Linear, Conv2d, WSConv2d, GroupNorm,
Embedding, LayerNorm (the rules that merge the views into positions and those
that get them as K calls), MultiheadAttention and an LSTM, through
:class:`~dpopt.engine.fast.PerSampleEngine` (``dpopt train``'s door) and
:class:`~dpopt.engine.hooks.HookCapture` (``PrivacyEngine``'s, mean and sum
losses); then σ = 0 sensitivity when removing one example with all its views,
chunking that never splits an example, and the refusals.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpopt.engine import PerSampleEngine, iter_per_sample_sources
from dpopt.engine.hooks import HookCapture
from dpopt.engine.layers import CONV_METHODS, Budget, ConvPart, FactoredBlock
from dpopt.models import WSConv2d
from dpopt.types import ClipGeometry

DT = torch.float64
K = 3
B = 4


def ce(out, y):
    return F.cross_entropy(out, y)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.gn = nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.head = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.gn(self.conv(x))).flatten(1))


class WSConvNet(nn.Module):
    """Weight-standardized convolutions (the recipe's cnn5-ws layers), one strided with a bias, + GroupNorm."""

    def __init__(self):
        super().__init__()
        self.conv1 = WSConv2d(2, 4, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(2, 4)
        self.conv2 = WSConv2d(4, 4, 3, stride=2, padding=1)
        self.head = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x):
        return self.head(torch.relu(self.conv2(torch.tanh(self.gn(self.conv1(x))))).flatten(1))


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.ln, self.lin = nn.Embedding(11, 6, padding_idx=0), nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, ids):
        return self.lin(torch.tanh(self.ln(self.emb(ids)))).mean(1)


class AttnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.head = nn.MultiheadAttention(6, 2, batch_first=True), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


class LstmNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.LSTM(6, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def _batch(kind: str, n: int, gen: torch.Generator):
    if kind in ("conv", "ws-conv"):
        x = torch.randn(n, 2, 5, 5, generator=gen, dtype=DT)
    elif kind == "tokens":
        x = torch.randint(0, 11, (n, 7), generator=gen)
    else:
        x = torch.randn(n, 5, 6, generator=gen, dtype=DT)
    return x, torch.randint(0, 3, (n,), generator=gen)


MODELS = {"conv": ConvNet, "ws-conv": WSConvNet, "tokens": TokenNet, "attn": AttnNet, "lstm": LstmNet}


def make(kind: str, b: int = B, seed: int = 0):
    torch.manual_seed(seed)
    model = MODELS[kind]().to(DT)
    x, y = _batch(kind, b * K, torch.Generator().manual_seed(seed + 1))
    return model, x, y


def truth(model, x, y) -> list[torch.Tensor]:
    """[B, *p.shape] per parameter: each row alone, the K rows of an example averaged."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for r in range(x.shape[0]):
        gs = torch.autograd.grad(ce(model(x[r : r + 1]), y[r : r + 1]), params, allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, gs)])
    per_row = [torch.stack([row[k] for row in rows]) for k in range(len(params))]
    return [g.reshape(-1, K, *g.shape[1:]).mean(1) for g in per_row]


def per_example(src) -> list[torch.Tensor]:
    """The source's per-example gradients, from one-hot weighted sums, and its squared norms [B]."""
    n, geo = src.num_params, ClipGeometry()
    rows = []
    for i in range(src.batch_size):
        w = torch.zeros(src.batch_size, 1, dtype=DT)
        w[i] = 1.0
        rows.append(src.weighted_sum(w, geo, [0] * n))
    return [torch.stack([r[k] for r in rows]) for k in range(n)]


def assert_matches(src, want) -> None:
    assert src.batch_size == want[0].shape[0]
    sq = src.sq_norms(ClipGeometry(), [0] * src.num_params, 1)[:, 0]
    want_sq = sum(g.reshape(g.shape[0], -1).square().sum(1) for g in want)
    torch.testing.assert_close(sq, want_sq, rtol=1e-10, atol=1e-12)
    for got, g in zip(per_example(src), want):
        torch.testing.assert_close(got, g, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", list(MODELS))
def test_engine_door_views_equal_single_example_autograd_mean(kind):
    model, x, y = make(kind)
    want = truth(model, x, y)
    eng = PerSampleEngine(model, ce, rows_per_example=K)
    assert_matches(eng.compute(x, y), want)  # the first batch runs the check (no demotion expected)
    assert eng.fallback_names == []
    assert_matches(eng.compute(x, y), want)  # after the check


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_hook_door_views_equal_single_example_autograd_mean(kind, reduction):
    model, x, y = make(kind)
    want = truth(model, x, y)
    cap = HookCapture(model, reduction, rows_per_example=K)
    try:
        for _ in range(2):  # the first step runs the check
            loss = F.cross_entropy(model(x), y, reduction=reduction)  # mean over the B·K rows, or their sum
            loss.backward()
            src = cap.collect()
            assert_matches(src, want)
            model.zero_grad()
        assert cap.verified
    finally:
        cap.detach()


def test_views_through_the_reference_path_and_batch_dim():
    """Parameters without a rule (and inputs with the rows along another axis) average the views too."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain, self.lin = nn.Parameter(torch.ones(6)), nn.Linear(6, 3)

        def forward(self, x):
            return self.lin(x * self.gain).mean(1)

    torch.manual_seed(0)
    model = Scaled().to(DT)
    x, y = _batch("attn", B * K, torch.Generator().manual_seed(1))
    want = truth(model, x, y)
    eng = PerSampleEngine(model, ce, rows_per_example=K)
    assert_matches(eng.compute(x, y), want)
    assert eng.fallback_names == ["gain"]

    def seq_first_loss(out, t):
        return ce(out, t)

    class SeqFirst(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):  # x [T, n, D]
            return self.inner(x.transpose(0, 1))

    wrapped = SeqFirst(model)
    src = PerSampleEngine(wrapped, seq_first_loss, rows_per_example=K).compute(x.transpose(0, 1), y, batch_dim=1)
    assert_matches(src, want)


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
@pytest.mark.parametrize("method", CONV_METHODS)
def test_conv_views_both_kernels_and_gram_equal_the_sum_over_views(method, padding_mode):
    """ConvPart with K views: per-example Σ_v Σ_t e a^T by each kernel, the Gram norm, and the clipped sum."""
    gen = torch.Generator().manual_seed(5)
    conv = nn.Conv2d(3, 4, 3, stride=2, padding=1, dilation=1, padding_mode=padding_mode).to(DT)
    x = torch.randn(B * K, 3, 7, 6, generator=gen, dtype=DT)
    out = conv(x)
    e = torch.randn(out.shape, generator=gen, dtype=DT)
    rows = []  # per-row weight gradients by autograd: d<conv(x_r), e_r>/dw
    for r in range(B * K):
        rows.append(torch.autograd.grad((conv(x[r : r + 1]) * e[r : r + 1]).sum(), conv.weight)[0])
    want = torch.stack(rows).reshape(B, K, 4, -1).sum(1)  # [B, q, p]
    part = ConvPart(conv, x, e, views=K)
    assert part.T == K * out.shape[2] * out.shape[3]
    torch.testing.assert_close(part.per_sample(0, B, method), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(part.per_sample(1, 3, method), want[1:3], rtol=1e-10, atol=1e-12)
    blk = FactoredBlock(0, tuple(conv.weight.shape), [part], Budget(1 << 20, 0), B)
    torch.testing.assert_close(blk._gram(), want.reshape(B, -1).square().sum(1), rtol=1e-10, atol=1e-12)
    c = torch.rand(B, generator=gen, dtype=DT)
    bad = torch.tensor([False, True, False, False])
    want_sum = torch.einsum("b,bqp->qp", c * (~bad), want)
    torch.testing.assert_close(part.grad_sum(c, bad), want_sum, rtol=1e-10, atol=1e-12)


def _clipped_sum(model, x, y, c, door: str):
    if door == "engine":
        src = next(iter(iter_per_sample_sources(model, ce, x, y, rows_per_example=K)))
    else:
        cap = HookCapture(model, "mean", rows_per_example=K)
        try:
            F.cross_entropy(model(x), y).backward()
            src = cap.collect()
        finally:
            cap.detach()
            model.zero_grad()
    n, geo = src.num_params, ClipGeometry()
    norms = src.sq_norms(geo, [0] * n, 1)[:, 0].sqrt()
    w = torch.clamp(c / norms, max=1.0).unsqueeze(1)
    return torch.cat([s.flatten() for s in src.weighted_sum(w, geo, [0] * n)]), norms


@pytest.mark.parametrize("door", ["engine", "hooks"])
@pytest.mark.parametrize("kind", ["conv", "ws-conv", "tokens"])
def test_sigma_zero_removing_one_example_with_all_its_views_moves_the_sum_by_at_most_c(kind, door):
    model, x, y = make(kind, b=5)
    norms = truth(model, x, y)
    c = 0.5 * float(sum(g.reshape(5, -1).square().sum(1) for g in norms).sqrt().median())  # most are clipped
    full, got_norms = _clipped_sum(model, x, y, c, door)
    assert got_norms.shape == (5,)
    moves = []
    for j in range(5):
        keep = torch.tensor([r for r in range(5 * K) if r // K != j])
        part, _ = _clipped_sum(model, x[keep], y[keep], c, door)
        moves.append(float((full - part).norm()))
    assert max(moves) <= c * (1 + 1e-9) and min(moves) > 0.1 * c


def test_chunks_never_split_an_example():
    """physical_batch_size counts examples: 5 examples in chunks of 2 → 2, 2, 1 examples (6, 6, 3 rows)."""
    model, x, y = make("conv", b=5)
    want = truth(model, x, y)
    eng = PerSampleEngine(model, ce, rows_per_example=K)
    got, sizes = [], []
    for src in eng.iterate(x, y, physical_batch_size=2):
        sizes.append(src.batch_size)
        got.append(per_example(src))
    assert sizes == [2, 2, 1]
    for k, g in enumerate(want):
        torch.testing.assert_close(torch.cat([chunk[k] for chunk in got]), g, rtol=1e-9, atol=1e-12)


def test_a_row_count_that_is_not_a_multiple_of_k_is_refused_by_both_doors():
    model, x, y = make("conv")
    with pytest.raises(ValueError, match="not a multiple of K=3 views per example"):
        PerSampleEngine(model, ce, rows_per_example=K).compute(x[:-1], y[:-1])
    cap = HookCapture(model, rows_per_example=K)
    try:
        F.cross_entropy(model(x[:-1]), y[:-1]).backward()
        with pytest.raises(ValueError, match="not a multiple of K=3 views per example"):
            cap.collect()
    finally:
        cap.detach()
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="rows_per_example"):
            PerSampleEngine(model, ce, rows_per_example=bad)
        with pytest.raises(ValueError, match="rows_per_example"):
            HookCapture(model, rows_per_example=bad)


def test_a_model_that_mixes_the_views_of_an_example_is_caught_by_the_check():
    """Mixing across rows (here: batch centring) is mixing across examples too: the engine demotes, hooks refuse."""

    class Centre(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = nn.Linear(6, 5), nn.Linear(5, 3)

        def forward(self, x):
            h = self.lin(x.mean(1))
            return self.head(torch.tanh(h - h.mean(0, keepdim=True)))

    torch.manual_seed(0)
    model = Centre().to(DT)
    x, y = _batch("attn", B * K, torch.Generator().manual_seed(1))
    with pytest.warns(RuntimeWarning, match="mixes examples"):
        src = PerSampleEngine(model, ce, rows_per_example=K).compute(x, y)
    assert_matches(src, truth(model, x, y))  # the per-example definition: each row alone, views averaged
    cap = HookCapture(model, rows_per_example=K)
    try:
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(ValueError, match="do not match single-example"):
            cap.collect()
    finally:
        cap.detach()
