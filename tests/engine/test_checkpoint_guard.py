"""Gradient checkpointing switched on after a capture was built: refused at the next forward, read cheaply.

Hooks fire again when checkpointing recomputes a forward inside backward
(privacy-relevant: a call recorded twice, or not at all), so a missed
detection must not happen. The guard (:class:`dpopt.engine.hf_guards.CheckpointGuard`)
finds once the modules that carry transformers' per-layer
``gradient_checkpointing`` flag and reads those flags at every forward with
gradients; the deprecated model-level ``is_gradient_checkpointing`` (a
``FutureWarning`` per read on transformers 5) is never read.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

T = pytest.importorskip("transformers")

from dpopt.engine import iter_per_sample_sources  # noqa: E402
from dpopt.engine.hf_guards import CheckpointGuard  # noqa: E402
from dpopt.engine.hooks import HookCapture  # noqa: E402
from dpopt.losses import per_example_lm_loss  # noqa: E402


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        cfg = T.GPT2Config(
            n_layer=2, n_embd=8, n_head=2, vocab_size=19, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
        )
        self.hf = T.GPT2LMHeadModel(cfg)

    def forward(self, ids):
        return self.hf(input_ids=ids).logits


def _data():
    torch.manual_seed(0)
    ids = torch.randint(0, 19, (3, 5), generator=torch.Generator().manual_seed(1))
    return LM().train(), ids, ids.clone()


def test_enabled_after_the_engine_planned_is_refused_at_the_next_batch():
    model, x, y = _data()
    assert next(iter(iter_per_sample_sources(model, per_example_lm_loss, x, y))).batch_size == 3
    model.hf.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        next(iter(iter_per_sample_sources(model, per_example_lm_loss, x, y)))
    model.hf.gradient_checkpointing_disable()
    assert next(iter(iter_per_sample_sources(model, per_example_lm_loss, x, y))).batch_size == 3


def test_enabled_after_the_hook_capture_is_refused_at_the_next_forward_and_steps_warn_nothing():
    model, x, y = _data()
    cap = HookCapture(model, "mean")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # no deprecated property read per step
            for _ in range(2):
                per_example_lm_loss(model(x), y).mean().backward()
                assert cap.collect().batch_size == 3
                model.zero_grad()
        model.hf.gradient_checkpointing_enable()
        with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
            model(x)
    finally:
        cap.detach()


def test_one_layer_flagged_alone_is_refused_and_eval_mode_is_not():
    model, x, y = _data()
    guard = CheckpointGuard(model)
    names = [n for n, _ in guard.watched]
    assert "hf.transformer.h.0" in names and "hf.transformer.h.1" in names
    layer = model.hf.transformer.h[1]
    layer.gradient_checkpointing = True  # what every_n_layers > 1 leaves on: one block
    with pytest.raises(ValueError, match="enabled on 'hf.transformer.h.1'"):
        guard.check()
    model.eval()  # transformers recomputes only in train mode (self.gradient_checkpointing and self.training)
    guard.check()
