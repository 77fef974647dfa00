"""Tiny Hugging Face models built from configs (no downloads) and the exact single-example reference.

Each case returns ``(model, x, y, loss_fn, batch_loss)``: ``model(x)`` returns
a tensor ``[B, ...]`` (a thin wrapper passes the HF model its keyword
inputs), ``loss_fn(out_i, y_i)`` is one example's loss (dpopt's own loop),
``batch_loss(out, y)`` the mean of the per-example losses (PrivacyEngine,
``loss_reduction="mean"``). Dropout is on (p = 0.1) and the models are in
train mode; :func:`reference` replays the batched pass's dropout masks
(:class:`dpopt.engine.check.RandomReplay`) in an exact loop of single-example
autograd calls.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
import transformers as T
from torch import nn

from dpopt.engine.inputs import example_loss
from dpopt.losses import per_example_lm_loss

V, D, L, B = 37, 16, 6, 3
P_DROP = 0.1


class Wrap(nn.Module):
    """``x [B, k, T]`` (token ids; mask and token types stacked along dim 1 when k > 1) → logits."""

    def __init__(self, hf: nn.Module, keys=("input_ids",)):
        super().__init__()
        self.hf, self.keys = hf, tuple(keys)

    def forward(self, x):
        if len(self.keys) == 1 and x.dtype != torch.long:
            return self.hf(**{self.keys[0]: x}).logits
        if len(self.keys) == 1:
            return self.hf(**{self.keys[0]: x}).logits
        return self.hf(**dict(zip(self.keys, x.unbind(1)))).logits


def _ce(out, y):
    return F.cross_entropy(out, y)


def _lm_batch(out, y):
    return per_example_lm_loss(out, y).mean()


def _labels(ids: torch.Tensor, gen) -> torch.Tensor:
    y = ids.clone()
    y[0, -2:] = -100  # example 0 has fewer valid tokens (the per-example mean's own count)
    return y


def gpt2(dtype, gen, lora=False):
    cfg = T.GPT2Config(
        n_layer=2,
        n_embd=D,
        n_head=2,
        vocab_size=V,
        n_positions=16,
        resid_pdrop=P_DROP,
        embd_pdrop=P_DROP,
        attn_pdrop=P_DROP,
        bos_token_id=0,
        eos_token_id=0,
    )
    hf = T.GPT2LMHeadModel(cfg)
    assert hf.lm_head.weight is hf.transformer.wte.weight  # tied
    if lora:
        import peft

        hf = peft.get_peft_model(
            hf,
            peft.LoraConfig(
                r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, lora_dropout=P_DROP
            ),
        )
    model = Wrap(hf).to(dtype).train()
    ids = torch.randint(0, V, (B, L), generator=gen)
    return model, ids, _labels(ids, gen), per_example_lm_loss, _lm_batch


def bert(dtype, gen):
    cfg = T.BertConfig(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        type_vocab_size=2,
        num_labels=3,
        hidden_dropout_prob=P_DROP,
        attention_probs_dropout_prob=P_DROP,
        pad_token_id=0,
    )
    model = Wrap(T.BertForSequenceClassification(cfg), ("input_ids", "attention_mask", "token_type_ids"))
    model = model.to(dtype).train()
    ids = torch.randint(1, V, (B, L), generator=gen)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, -2:] = 0  # example 0 is padded
    ids[0, -2:] = 0
    tt = torch.zeros(B, L, dtype=torch.long)
    tt[:, L // 2 :] = 1
    y = torch.randint(0, 3, (B,), generator=gen)
    return model, torch.stack([ids, mask, tt], 1), y, _ce, _ce


def vit(dtype, gen):
    cfg = T.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
        hidden_dropout_prob=P_DROP,
        attention_probs_dropout_prob=P_DROP,
    )
    model = Wrap(T.ViTForImageClassification(cfg), ("pixel_values",)).to(dtype).train()
    x = torch.randn(B, 3, 8, 8, generator=gen, dtype=dtype)
    return model, x, torch.randint(0, 3, (B,), generator=gen), _ce, _ce


def llama(dtype, gen):
    cfg = T.LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        attention_dropout=P_DROP,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = Wrap(T.LlamaForCausalLM(cfg)).to(dtype).train()
    ids = torch.randint(0, V, (B, L), generator=gen)
    return model, ids, _labels(ids, gen), per_example_lm_loss, _lm_batch


CASES = {"gpt2": gpt2, "bert": bert, "vit": vit, "llama": llama, "lora-gpt2": lambda d, g: gpt2(d, g, lora=True)}


def make(name: str, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    return CASES[name](dtype, torch.Generator().manual_seed(seed + 1))


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def reference(model, loss_fn, x, y, replay=None):
    """Exact per-example gradients ``[B, *p.shape]`` per trainable parameter (one autograd call per example)."""
    params = trainable(model)
    rows = []
    with replay.replaying(int(y.shape[0])) if replay is not None else nullcontext():
        for i in range(int(y.shape[0])):
            loss = example_loss(loss_fn(model(x[i : i + 1]), y[i : i + 1]))
            gs = torch.autograd.grad(loss, params, allow_unused=True)
            rows.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, gs)])
    return [torch.stack([r[k] for r in rows]) for k in range(len(params))]


def source_grads(src):
    """Per-example gradients read out of a per-sample source: ``weighted_sum`` with one-hot weights."""
    from dpopt.types import ClipGeometry

    n, b = src.num_params, src.batch_size
    out = [[] for _ in range(n)]
    for i in range(b):
        w = torch.zeros(b, 1, dtype=torch.float64)
        w[i] = 1.0
        for k, g in enumerate(src.weighted_sum(w, ClipGeometry(), [0] * n)):
            out[k].append(g)
    return [torch.stack(o) for o in out]


def mismatches(got, want, names, rtol):
    """Parameters whose per-example gradient (or squared norm) differs by more than rtol (relative).

    Relative to the parameter's own gradient norm, with a floor of 1e-3 of the
    example's whole gradient norm (a parameter whose gradient is exactly zero
    agrees with float noise).
    """
    total = torch.sqrt(sum(w.double().flatten(1).square().sum(1) for w in want))  # [B]
    bad = []
    for n, g, w in zip(names, got, want):
        err = (g.double() - w.double()).flatten(1).norm(dim=1)
        scale = w.double().flatten(1).norm(dim=1) + 1e-3 * total
        if not bool((err <= rtol * scale).all()):
            bad.append((n, float((err / scale).max())))
    return bad
