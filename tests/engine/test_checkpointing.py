"""``torch.utils.checkpoint`` in the user's forward: each layer call recorded once, gradients exact, both doors.

A checkpointed region runs its forward twice (the second time inside the
backward pass); the capture keeps the run whose outputs receive the gradient
(:mod:`dpopt.engine.recompute`): the first run for ``use_reentrant=False``,
the recomputation for ``use_reentrant=True``. Checked against an exact loop
of single-example autograd (each example alone, the batched pass's dropout
masks replayed), including a layer without a rule (the hook door's vjp of its
recorded call) inside the region and a LayerNorm whose saved statistics a
checkpoint hides; σ = 0 sensitivity ≤ C through ``PrivacyEngine``; dpopt's own
loop refuses the reentrant form in user code with the fix (it differentiates
w.r.t. layer outputs, which that form refuses) and is exact with the other.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.engine import iter_per_sample_sources
from dpopt.engine.check import RandomReplay
from dpopt.engine.fast import fast_per_sample_gradients
from dpopt.engine.hooks import HookCapture
from dpopt.engine.inputs import example_loss
from dpopt.types import ClipGeometry, EvaluationPoint

V, D, T, B = 11, 8, 5, 4


class Scale(nn.Module):
    """A layer without a rule (the hook door's vjp fallback)."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return torch.tanh(x * self.w)


class Checkpointed(nn.Module):
    """Embedding → two residual blocks through ``torch.utils.checkpoint`` → a head over the mean token."""

    def __init__(self, reentrant: bool, p: float = 0.2, scale: bool = True):
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(D),
                nn.Linear(D, 2 * D),
                nn.Dropout(p),
                Scale(2 * D) if scale else nn.Tanh(),
                nn.Linear(2 * D, D),
            )
            for _ in range(2)
        )
        self.head = nn.Linear(D, 3)

    def forward(self, ids):
        h = self.emb(ids)
        for blk in self.blocks:
            h = h + (checkpoint(blk, h, use_reentrant=self.reentrant) if self.reentrant is not None else blk(h))
        return self.head(h.mean(1))


def _data(reentrant, p=0.2, scale=True):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = Checkpointed(reentrant, p, scale).train()
    return model, torch.randint(0, V, (B, T), generator=gen), torch.randint(0, 3, (B,), generator=gen)


def _reference(model, x, y, replay=None):
    """Per-example gradients, each example alone, without checkpointing (the batched pass's masks replayed)."""
    saved, model.reentrant = model.reentrant, None
    params = list(model.parameters())
    rows = []
    try:
        with replay.replaying(B) if replay is not None else torch.enable_grad():
            for i in range(B):
                loss = example_loss(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]))
                rows.append(torch.autograd.grad(loss, params))
    finally:
        model.reentrant = saved
    return [torch.stack([r[k] for r in rows]) for k in range(len(params))]


def _read(src):
    """Per-example gradients out of a source (one-hot weighted sums)."""
    n = src.num_params
    out = [[] for _ in range(n)]
    for i in range(src.batch_size):
        w = torch.zeros(src.batch_size, 1, dtype=torch.float64)
        w[i] = 1.0
        for k, g in enumerate(src.weighted_sum(w, ClipGeometry(), [0] * n)):
            out[k].append(g)
    return [torch.stack(o) for o in out]


def _close(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-4, atol=1e-6)
    assert max(float(w.abs().max()) for w in want) > 1e-3


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_privacy_engine_door_is_exact_with_checkpointed_blocks(reentrant):
    model, x, y = _data(reentrant)
    replay = RandomReplay(model)
    cap = HookCapture(model, "mean")
    try:
        F.cross_entropy(model(x), y).backward()
        cap.collect()  # the first-batch check, through the checkpointed forward
        model.zero_grad()
        with replay.recording():
            F.cross_entropy(model(x), y).backward()
        got = _read(cap.collect())
    finally:
        cap.detach()
    _close(got, _reference(model, x, y, replay))


def test_dpopts_loop_is_exact_with_non_reentrant_checkpoints():
    # every parameter on a rule (dpopt's loop runs its torch.func path outside checkpoints); no dropout to replay
    model, x, y = _data(False, p=0.0, scale=False)
    src = next(iter(iter_per_sample_sources(model, F.cross_entropy, x, y)))
    _close(_read(src), _reference(model, x, y))


def test_dpopts_loop_refuses_reentrant_checkpoints_in_user_code_with_the_fix():
    model, x, y = _data(True, p=0.0, scale=False)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        next(iter(iter_per_sample_sources(model, F.cross_entropy, x, y)))


def test_dpopts_loop_refuses_a_checkpoint_in_user_code_at_a_shifted_point():
    model, x, y = _data(False, p=0.0, scale=False)
    next(iter(iter_per_sample_sources(model, F.cross_entropy, x, y)))  # the first-batch check, at θ
    offset = tuple(torch.full_like(p, 0.1) for p in model.parameters())
    with pytest.raises(ValueError, match="shifted parameters"):
        fast_per_sample_gradients(model, F.cross_entropy, x, y, points=[EvaluationPoint(1.0, offset)])


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_sensitivity_through_privacy_engine_with_checkpointed_blocks(reentrant):
    model, x, y = _data(reentrant, p=0.0)
    norms = torch.sqrt(sum(g.double().flatten(1).square().sum(1) for g in _reference(model, x, y)))
    c = 0.5 * float(norms.median())
    engine = dpopt.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt, _ = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=c,
        poisson_sampling=False,  # the sensitivity test steps on neighbouring batches of its own
    )

    def released(xs, ys):
        opt.zero_grad()
        F.cross_entropy(model(xs), ys).backward()
        opt.step()
        return torch.cat([p.grad.flatten() for p in model.parameters()]) * opt.expected_batch_size

    try:
        full = released(x, y)
        assert float(full.norm()) > 0
        for j in range(B):
            keep = torch.tensor([i for i in range(B) if i != j])
            assert float((full - released(x[keep], y[keep])).norm()) <= c * (1 + 1e-5)
    finally:
        engine.detach()
