"""Per-example gradients of tiny HF transformers equal single-example autograd, through both doors, in train mode.

Done-when of issue 20 (HF part): GPT-2 (tied wte/lm_head, broadcast position
ids), BERT (padding mask, token types, padding_idx), ViT (bare class token and
position embeddings), Llama (RMSNorm, rotary, GQA), LoRA-GPT-2 (peft) — every
trainable parameter, read out of the per-sample source with one-hot weights,
against an exact loop of single-example autograd calls given the batched
pass's dropout masks (relative 1e-4 in float32, 1e-10 in float64); the fast
rules are used (no parameter demoted); σ = 0 sensitivity ≤ C.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from hf_zoo import CASES, make, mismatches, reference, source_grads  # noqa: E402

from dpopt.engine import iter_per_sample_sources  # noqa: E402
from dpopt.engine.check import RandomReplay  # noqa: E402
from dpopt.engine.fast import get_engine  # noqa: E402
from dpopt.engine.hooks import HookCapture  # noqa: E402
from dpopt.types import ClipGeometry  # noqa: E402

RTOL = {torch.float32: 1e-4, torch.float64: 1e-10}
MODELS = list(CASES)


def _fast_source(model, loss_fn, x, y, replay):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no layer demoted, no loop fallback
        next(iter(iter_per_sample_sources(model, loss_fn, x, y)))  # first batch: the check
    with replay.recording():
        return next(iter(iter_per_sample_sources(model, loss_fn, x, y)))


def _hook_source(model, batch_loss, x, y, replay, reduction):
    cap = HookCapture(model, reduction)
    assert cap.plan.fallback_names == [] and not cap.vjp  # every parameter by a rule or a tap: no vjp fallback
    k = 1.0 if reduction == "mean" else float(y.shape[0])  # batch_loss is the mean of the per-example losses
    try:
        (k * batch_loss(model(x), y)).backward()
        cap.collect()  # first batch: the check
        model.zero_grad()
        with replay.recording():
            (k * batch_loss(model(x), y)).backward()
        return cap.collect()
    finally:
        cap.detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("door", ["fast", "hooks"])
@pytest.mark.parametrize("name", MODELS)
def test_per_example_gradients_equal_single_example_autograd(name, door, dtype):
    model, x, y, loss_fn, batch_loss = make(name, dtype)
    replay = RandomReplay(model)
    if door == "fast":
        src = _fast_source(model, loss_fn, x, y, replay)
        assert get_engine(model, loss_fn).fallback_names == []
    else:
        # float64: loss_reduction="sum", the reference's own scale (LlamaRMSNorm normalises in float32,
        # where the 1/B of a mean rounds differently from the single-example pass by ~1e-7)
        src = _hook_source(model, batch_loss, x, y, replay, "mean" if dtype == torch.float32 else "sum")
    ref = reference(model, loss_fn, x, y, replay)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert src.batch_size == y.shape[0] and len(ref) == src.num_params
    got = source_grads(src)
    assert mismatches(got, ref, names, RTOL[dtype]) == []
    n = src.num_params
    sq = src.sq_norms(ClipGeometry(), list(range(n)), n)  # [B, P]: per-parameter squared norms
    want = torch.stack([r.double().flatten(1).square().sum(1) for r in ref], 1)
    tot = want.sum(1, keepdim=True)
    assert bool(((sq.double() - want).abs() <= 2 * RTOL[dtype] * (want + 1e-6 * tot)).all())
