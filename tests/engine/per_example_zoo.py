"""Models on which "dim 0 is the example" fails in some layer, and their ground truth.

Shared by tests/engine/test_per_example_models.py and tests/engine/test_sensitivity.py. Each
case builds a float64 model, a batch ``(x, y)`` with ``B`` examples along
``batch_dim`` of x, and the ground truth is :func:`loop_grads`: one autograd
call per example, the model seeing that example alone (a size-1 example axis
kept at ``batch_dim``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_padded_sequence

from dpopt.types import ClipGeometry

DT = torch.float64
V, D, H, C = 11, 7, 9, 3  # vocabulary, width, hidden, classes


def ce(out, target):
    return F.cross_entropy(out, target)


class TokPos(nn.Module):
    """Token + position embedding; position ids of shape [1, T] broadcast over the batch."""

    def __init__(self, t: int):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(V, D), nn.Embedding(t, D), nn.Linear(D, C)

    def forward(self, x):
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # [1, T]
        return self.head(torch.tanh(self.tok(x) + self.pos(pos)).mean(1))


class SeqFirst(nn.Module):
    """Takes x [T, B, D] (batch_dim=1): Linear over the sequence-first tensor, then a head."""

    def __init__(self):
        super().__init__()
        self.lin, self.ln, self.head = nn.Linear(D, H), nn.LayerNorm(H), nn.Linear(H, C)

    def forward(self, x):
        return self.head(self.ln(torch.tanh(self.lin(x))).mean(0))


class TransposeInside(nn.Module):
    """Batch-first x [B, T, D]; a Linear/LayerNorm and TransformerEncoderLayer(batch_first=False) inside."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0)  # batch_first=False
        self.head = nn.Linear(8, C)

    def forward(self, x):
        h = self.enc(self.lin(x.transpose(0, 1)))  # [T, B, 8]
        return self.head(h.mean(0))


class TimeDistributed(nn.Module):
    """x.reshape(B*T, D) through a Linear."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(D, H), nn.Linear(H, C)

    def forward(self, x):
        b, t, d = x.shape
        h = torch.tanh(self.lin(x.reshape(b * t, d))).reshape(b, t, -1)
        return self.head(h.mean(1))


class Recurrent(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        cls = {"gru": nn.GRU, "rnn": nn.RNN, "lstm": nn.LSTM}[kind]
        self.rnn, self.head = cls(D, H, batch_first=True), nn.Linear(H, C)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class SharedLinear(nn.Module):
    """One Linear used twice plus a tied embedding/output projection."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(V, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.lin(torch.tanh(self.lin(self.emb(x)))).mean(1)
        return F.linear(h, self.emb.weight)[:, :C]


class ConvGroupNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.gn, self.head = nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Linear(4, C)

    def forward(self, x):
        return self.head(torch.relu(self.gn(self.conv(x))).mean((2, 3)))


class MixesExamples(nn.Module):
    """Centres a hidden layer over the batch: defined per example as 'each example alone'."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(D, H), nn.Linear(H, C)

    def forward(self, x):
        h = self.lin(x)
        return self.head(torch.tanh(h - 0.5 * h.mean(0, keepdim=True)))


class BagWithOffsets(nn.Module):
    """x [B, L] token ids with 0 = padding → flat ids + offsets → EmbeddingBag(mean)."""

    def __init__(self):
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(V, D, mode="mean"), nn.Linear(D, C)

    def forward(self, x):
        lengths = (x != 0).sum(1)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
        return self.head(self.bag(x[x != 0], offsets))


class PackInside(nn.Module):
    """Padded x [B, T, D] whose last feature is 1 on valid steps; packs inside forward."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.GRU(D, H, batch_first=True), nn.Linear(H, C)

    def forward(self, x):
        lengths = x[..., -1].sum(1).long().cpu()
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return self.head(self.rnn(packed)[1][0])


@dataclass
class Case:
    name: str
    build: Callable[[int, int], nn.Module]  # (B, T) -> model
    batch: Callable[[int, int, torch.Generator], tuple]  # (B, T, gen) -> (x, y)
    batch_dim: int = 0


def _tokens(b, t, g):
    return torch.randint(1, V, (b, t), generator=g), torch.randint(0, C, (b,), generator=g)


def _seq(b, t, g):
    return torch.randn(b, t, D, generator=g, dtype=DT), torch.randint(0, C, (b,), generator=g)


def _seq_first(b, t, g):
    return torch.randn(t, b, D, generator=g, dtype=DT), torch.randint(0, C, (b,), generator=g)


def _image(b, t, g):
    return torch.randn(b, 2, t, t, generator=g, dtype=DT), torch.randint(0, C, (b,), generator=g)


def _flat(b, t, g):
    return torch.randn(b, D, generator=g, dtype=DT), torch.randint(0, C, (b,), generator=g)


def _bag(b, t, g):
    x, y = _tokens(b, t, g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    x[torch.arange(t).unsqueeze(0) >= lengths.unsqueeze(1)] = 0
    return x, y


def _padded(b, t, g):
    x, y = _seq(b, t, g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    valid = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(DT)
    x = x * valid.unsqueeze(-1)
    x[..., -1] = valid
    return x, y


CASES = {
    "tok-pos": Case("tok-pos", lambda b, t: TokPos(t), _tokens),
    "seq-first": Case("seq-first", lambda b, t: SeqFirst(), _seq_first, batch_dim=1),
    "transpose-inside": Case("transpose-inside", lambda b, t: TransposeInside(), _seq),
    "time-distributed": Case("time-distributed", lambda b, t: TimeDistributed(), _seq),
    "gru": Case("gru", lambda b, t: Recurrent("gru"), _seq),
    "rnn": Case("rnn", lambda b, t: Recurrent("rnn"), _seq),
    "lstm": Case("lstm", lambda b, t: Recurrent("lstm"), _seq),
    "shared": Case("shared", lambda b, t: SharedLinear(), _tokens),
    "conv-groupnorm": Case("conv-groupnorm", lambda b, t: ConvGroupNorm(), _image),
    "mixes-examples": Case("mixes-examples", lambda b, t: MixesExamples(), _flat),
    "bag-offsets": Case("bag-offsets", lambda b, t: BagWithOffsets(), _bag),
    "pack-inside": Case("pack-inside", lambda b, t: PackInside(), _padded),
}


def make(case: Case, b: int, t: int, seed: int = 0):
    torch.manual_seed(seed)
    model = case.build(b, t).to(DT)
    x, y = case.batch(b, t, torch.Generator().manual_seed(seed + 1))
    return model, x, y


def loop_grads(model: nn.Module, loss_fn, x, y, batch_dim: int = 0) -> list[torch.Tensor]:
    """Ground truth: per-example gradients [B, *p.shape] by one autograd call per example."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(y.shape[0]):
        loss = loss_fn(model(x.narrow(batch_dim, i, 1)), y[i : i + 1])
        gs = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, p in zip(gs, params)])
    return [torch.stack([r[k] for r in rows]) for k in range(len(params))]


def per_example_from_source(src, n_params: int):
    """(sq norms [B, n] per parameter, per-example gradients via one-hot weighted sums) of a source."""
    geo = ClipGeometry()
    groups = list(range(n_params))
    sq = src.sq_norms(geo, groups, n_params)
    b = src.batch_size
    grads = [[] for _ in range(n_params)]
    for i in range(b):
        w = torch.zeros(b, n_params, dtype=sq.dtype)
        w[i] = 1.0
        for k, s in enumerate(src.weighted_sum(w, geo, groups)):
            grads[k].append(s)
    return sq, [torch.stack(g) for g in grads]


def rel_err(got, want) -> float:
    """max over parameters of ‖got − want‖ / ‖want‖ (absolute when ‖want‖ = 0)."""
    worst = 0.0
    for a, b in zip(got, want):
        den = float(b.norm())
        worst = max(worst, float((a - b).norm()) / (den if den > 0 else 1.0))
    return worst
