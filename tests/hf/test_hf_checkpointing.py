"""Gradient checkpointing trains exactly: per-example gradients equal single-example autograd, both doors.

Hugging Face's ``gradient_checkpointing_enable()`` (GPT-2, Llama; both
``use_reentrant`` modes) and ``torch.utils.checkpoint`` in the user's own
forward re-run layer forwards inside the backward pass; the capture records
each layer call once (:mod:`dpopt.engine.recompute`). Checked: every
trainable parameter's per-example gradient (read out of the per-sample
source with one-hot weights) against an exact loop of single-example
autograd calls on the same model with checkpointing off, the batched pass's
dropout masks replayed (relative 1e-4 in float32); σ = 0 sensitivity ≤ C
through ``PrivacyEngine`` with checkpointing on (train mode, dropout 0:
transformers recomputes only in train mode).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("transformers")

import hf_zoo  # noqa: E402
from hf_zoo import make, mismatches, reference, source_grads, trainable  # noqa: E402

import dpopt  # noqa: E402
from dpopt.engine import iter_per_sample_sources  # noqa: E402
from dpopt.engine.check import RandomReplay  # noqa: E402
from dpopt.engine.fast import fast_per_sample_gradients  # noqa: E402
from dpopt.engine.hooks import HookCapture  # noqa: E402
from dpopt.types import EvaluationPoint  # noqa: E402

REENTRANT = [True, False]


def _enable(model, reentrant: bool) -> None:
    model.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _hook_grads(model, batch_loss, x, y, replay):
    cap = HookCapture(model, "mean")
    try:
        batch_loss(model(x), y).backward()
        cap.collect()  # first batch: the check (through the checkpointed forward)
        model.zero_grad()
        with replay.recording():
            batch_loss(model(x), y).backward()
        return source_grads(cap.collect())
    finally:
        cap.detach()


def _fast_grads(model, loss_fn, x, y, replay):
    next(iter(iter_per_sample_sources(model, loss_fn, x, y)))  # first batch: the check
    with replay.recording():
        return source_grads(next(iter(iter_per_sample_sources(model, loss_fn, x, y))))


@pytest.mark.parametrize("reentrant", REENTRANT, ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("door", ["hooks", "fast"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_gradient_checkpointing_equals_single_example_autograd(name, door, reentrant):
    model, x, y, loss_fn, batch_loss = make(name)
    _enable(model, reentrant)
    replay = RandomReplay(model)
    if door == "hooks":
        got = _hook_grads(model, batch_loss, x, y, replay)
    else:
        got = _fast_grads(model, loss_fn, x, y, replay)
    model.hf.gradient_checkpointing_disable()  # the reference: each example alone, no recomputation
    want = reference(model, loss_fn, x, y, replay)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert mismatches(got, want, names, 1e-4) == []
    assert max(float(w.abs().max()) for w in want) > 0  # the comparison is not of zeros


class Checkpointed(nn.Module):
    """Embedding → two residual blocks run through ``torch.utils.checkpoint`` → a head over the mean token."""

    def __init__(self, reentrant: bool, v: int = 11, d: int = 8):
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(v, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Dropout(0.2), nn.GELU(), nn.Linear(2 * d, d))
            for _ in range(2)
        )
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        h = self.emb(ids)
        for blk in self.blocks:
            h = h + checkpoint(blk, h, use_reentrant=self.reentrant)
        return self.head(h.mean(1))


def _ce(out, y):
    return nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("reentrant", REENTRANT, ids=["reentrant", "non-reentrant"])
def test_torch_utils_checkpoint_in_the_users_forward_equals_single_example_autograd(reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant).train()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 11, (4, 5), generator=gen), torch.randint(0, 3, (4,), generator=gen)
    replay = RandomReplay(model)
    got = _hook_grads(model, _ce, x, y, replay)
    model.reentrant = False  # the reference: torch.autograd.grad needs the non-reentrant form
    want = reference(model, _ce, x, y, replay)
    names = [n for n, _ in model.named_parameters()]
    assert mismatches(got, want, names, 1e-4) == []


@pytest.mark.parametrize("reentrant", REENTRANT, ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_sensitivity_with_checkpointing_through_privacy_engine(name, reentrant, monkeypatch):
    monkeypatch.setattr(hf_zoo, "P_DROP", 0.0)  # train mode (checkpointing on) with the same function per subset
    model, x, y, loss_fn, batch_loss = make(name)
    norms = torch.sqrt(sum(g.double().flatten(1).square().sum(1) for g in reference(model, loss_fn, x, y)))
    c = 0.5 * float(norms.median())  # some examples clipped, some not
    _enable(model, reentrant)
    engine = dpopt.PrivacyEngine()
    opt = torch.optim.SGD(trainable(model), lr=0.0)
    model, opt, _ = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=len(y)),
        poisson_sampling=False,  # the test steps on its own (neighbouring) batches
        noise_multiplier=0.0,
        max_grad_norm=c,
    )

    def released(xs, ys):
        opt.zero_grad()
        batch_loss(model(xs), ys).backward()
        opt.step()
        return torch.cat([p.grad.flatten() for p in trainable(model)]) * opt.expected_batch_size

    try:
        full = released(x, y)
        assert float(full.norm()) > 0
        for j in range(y.shape[0]):
            keep = torch.tensor([i for i in range(y.shape[0]) if i != j])
            assert float((full - released(x[keep], y[keep])).norm()) <= c * (1 + 1e-5), f"{name}: example {j}"
    finally:
        engine.detach()


@pytest.mark.parametrize("reentrant", REENTRANT, ids=["reentrant", "non-reentrant"])
def test_dpopts_loop_at_a_shifted_point_runs_hf_layers_without_checkpointing(reentrant, monkeypatch):
    """DiSK's θ + offset passes bind parameters through functional_call: checkpointing is off there, exact."""
    monkeypatch.setattr(hf_zoo, "P_DROP", 0.0)
    model, x, y, loss_fn, _ = make("gpt2")
    offset = tuple(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) for p in trainable(model))
    points = [EvaluationPoint(1.0, offset)]
    want = source_grads(fast_per_sample_gradients(model, loss_fn, x, y, points=points))
    _enable(model, reentrant)
    got = source_grads(fast_per_sample_gradients(model, loss_fn, x, y, points=points))
    assert all(m.gradient_checkpointing for m in model.modules() if "gradient_checkpointing" in m.__dict__)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert mismatches(got, want, names, 1e-6) == []
