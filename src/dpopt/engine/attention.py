"""``nn.MultiheadAttention`` in the fast per-sample engine: exact per-example gradients of its projections.

``nn.MultiheadAttention.forward`` hands its parameters to
``F.multi_head_attention_forward``, which uses ``out_proj.weight`` without
calling ``out_proj`` and works sequence-first (``[T, B, E]``, the out
projection on ``[T·B, E]``): no module call exposes the projections' inputs
and outputs. :func:`mha_forward` is the layer's *tapped forward*
(:class:`~dpopt.engine.rules.Rule`): the same computation, written
batch-first with the projections as explicit ``F.linear`` calls, each
recorded for the capture paths:

* ``"qkv"`` (self-attention, ``query is key is value``): ``x [B, T, E] →
  [B, T, 3E]`` with ``in_proj_weight``; cross-attention records ``"q"`` and
  ``"kv"`` (``key is value``) or ``"q"``, ``"k"``, ``"v"``; with ``kdim``/``vdim``
  ≠ ``embed_dim`` the maps use ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``;
* the out projection ``attn [B, T, E] → [B, T, E]``, recorded as a call of
  ``out_proj`` (an ``NonDynamicallyQuantizableLinear``: it gets ``nn.Linear``'s rule);
* ``add_bias_kv``: the expanded ``bias_k``/``bias_v`` ``[B, 1, E]`` (their
  per-example gradient is that tensor's output gradient).

Per-example gradients then follow from g_i = Σ_t e_it a_itᵀ (the factored
blocks of :mod:`dpopt.engine.layers`: ghost norm or book-keeping), the row
blocks of the packed ``in_proj_weight`` ``[3E, E]`` placed by zero-padding
each map's output gradient to 3E rows (exact: disjoint rows). Any
``batch_first``, ``attn_mask`` (2-D, or 3-D ``[B·H, T, S]``; bool or float),
``key_padding_mask``, ``is_causal``, ``need_weights``/``average_attn_weights``,
``add_bias_kv``, ``add_zero_attn``, ``bias=False``, and attention dropout in
train mode (drawn with the shapes the torch kernel draws, so the first-batch
check's replay gives each example its masks). ``nn.TransformerEncoderLayer``
/ ``TransformerDecoderLayer`` call their attention modules, so they are
covered; their fused inference path runs only without gradients, so
training always runs this (the training) kernel. A sequence-first
``TransformerEncoderLayer(batch_first=False)`` is computed batch-first inside
(:func:`encoder_layer_forward`) so that its Linear/LayerNorm layers keep the
examples along dim 0 too (``TransformerDecoderLayer(batch_first=False)``'s
do not: they use the per-example path, or are refused by ``PrivacyEngine``). Unbatched (2-D) inputs are
refused while gradients are recorded (a batch needs its example axis).
Source of the computation: ``torch.nn.functional.multi_head_attention_forward``
(torch 2.x), re-expressed batch-first; equality is tested in float64.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .layers import DirectBlock, FactoredBlock, LinearPart
from .rules import LayerCalls, _linear, register_rule

__all__ = ["mha_forward"]

ROWS = {"qkv": (0, 3), "q": (0, 1), "kv": (1, 3), "k": (1, 2), "v": (2, 3)}
"""Tag → the row blocks (in units of embed_dim) of the packed in_proj_weight / in_proj_bias it produces."""


def _float_mask(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """A bool mask as an additive float mask (−inf where True), as ``F._canonical_mask`` does."""
    if mask is None or mask.is_floating_point():
        return mask
    if mask.dtype != torch.bool:
        raise ValueError(f"attention masks must be bool or floating, got {mask.dtype}")
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _project(
    m: nn.MultiheadAttention, record, q_in: Tensor, k_in: Tensor, v_in: Tensor, self_attn: bool, kv_same: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """The in-projections of batch-first q/k/v inputs, each recorded with its tag."""
    e = m.embed_dim
    b = m.in_proj_bias
    bq, bk, bv = (None, None, None) if b is None else b.chunk(3)

    def lin(tag: str, x: Tensor, w: Tensor, bias: Optional[Tensor]) -> Tensor:
        out = F.linear(x, w, bias)
        record(m, x, out, tag)
        return out

    if not m._qkv_same_embed_dim:
        return (
            lin("q", q_in, m.q_proj_weight, bq),
            lin("k", k_in, m.k_proj_weight, bk),
            lin("v", v_in, m.v_proj_weight, bv),
        )
    w = m.in_proj_weight
    if self_attn:
        q, k, v = lin("qkv", q_in, w, b).chunk(3, dim=-1)
        return q, k, v
    if kv_same:
        wq, wkv = w.split([e, 2 * e])
        bkv = None if b is None else b.split([e, 2 * e])[1]
        k, v = lin("kv", k_in, wkv, bkv).chunk(2, dim=-1)
        return lin("q", q_in, wq, bq), k, v
    wq, wk, wv = w.chunk(3)
    return lin("q", q_in, wq, bq), lin("k", k_in, wk, bk), lin("v", v_in, wv, bv)


def mha_forward(
    m: nn.MultiheadAttention,
    record,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Optional[Tensor] = None,
    need_weights: bool = True,
    attn_mask: Optional[Tensor] = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """``m(query, key, value, ...)`` with its projections recorded (module docstring).

    Args:
        m: the ``nn.MultiheadAttention``; record: ``record(owner, a, out, tag)``;
            the rest as ``nn.MultiheadAttention.forward``.

    Returns:
        ``(attn_output, attn_weights)`` as ``nn.MultiheadAttention.forward``
        (``[B, T, E]`` if ``batch_first`` else ``[T, B, E]``; weights ``[B, T, S]``,
        ``[B, H, T, S]`` or None). Without gradients the module's own forward runs
        (its fused inference path included) and nothing is recorded.

    Raises:
        ValueError: unbatched (2-D) inputs while gradients are recorded, or a mask of another dtype.
    """
    if not torch.is_grad_enabled():
        return type(m).forward(
            m,
            query,
            key,
            value,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            attn_mask=attn_mask,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )
    if query.dim() != 3:
        raise ValueError(
            f"nn.MultiheadAttention got an unbatched {query.dim()}-D query: per-sample gradients need "
            "batched inputs ([B, T, E] with batch_first=True, or [T, B, E]) with the examples along "
            "their batch axis"
        )
    self_attn, kv_same = query is key and key is value, key is value
    tr = (lambda t: t) if m.batch_first else (lambda t: t.transpose(0, 1))
    q_in = tr(query)
    k_in = q_in if key is query else tr(key)
    v_in = k_in if value is key else tr(value)
    bsz, tgt, e = q_in.shape
    h = m.num_heads
    hd = e // h
    key_padding_mask = _float_mask(key_padding_mask, query.dtype)
    attn_mask = _float_mask(attn_mask, query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # the kernel's causal mask instead
    elif key_padding_mask is not None:
        is_causal = False
    q, k, v = _project(m, record, q_in, k_in, v_in, self_attn, kv_same)
    if m.bias_k is not None and m.bias_v is not None:
        bk = m.bias_k.reshape(1, 1, e).expand(bsz, 1, e)
        bv = m.bias_v.reshape(1, 1, e).expand(bsz, 1, e)
        record(m, bk, bk, "bias_k")
        record(m, bv, bv, "bias_v")
        k, v = torch.cat([k, bk], dim=1), torch.cat([v, bv], dim=1)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    heads = lambda t: t.reshape(bsz, t.shape[1], h, hd).transpose(1, 2)  # noqa: E731  [B, H, len, hd]
    q, k, v = heads(q), heads(k), heads(v)
    if m.add_zero_attn:
        zeros = k.new_zeros(bsz, h, 1, hd)
        k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    src = k.shape[2]
    mask = None
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (tgt, src):
                raise RuntimeError(
                    f"The shape of the 2D attn_mask is {tuple(attn_mask.shape)}, but should be {(tgt, src)}."
                )
            mask = attn_mask.view(1, 1, tgt, src)
        elif attn_mask.dim() == 3:
            if tuple(attn_mask.shape) != (bsz * h, tgt, src):
                raise RuntimeError(
                    f"The shape of the 3D attn_mask is {tuple(attn_mask.shape)}, but should be {(bsz * h, tgt, src)}."
                )
            mask = attn_mask.view(bsz, h, tgt, src)
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
    if key_padding_mask is not None:
        kpm = key_padding_mask.view(bsz, 1, 1, src)
        mask = kpm if mask is None else mask + kpm
    p = m.dropout if m.training else 0.0
    weights = None
    if need_weights:
        scores = torch.matmul(q * math.sqrt(1.0 / float(hd)), k.transpose(-2, -1))  # [B, H, T, S]
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        if p > 0.0:
            weights = F.dropout(weights, p=p)
        ctx = torch.matmul(weights, v)
        if average_attn_weights:
            weights = weights.mean(dim=1)
    else:  # the kernel torch's path calls, with the same [B, H, T, S] attention (and dropout) shape
        ctx = F.scaled_dot_product_attention(q, k, v, mask, p, is_causal)
    attn = ctx.transpose(1, 2).reshape(bsz, tgt, e)
    out = F.linear(attn, m.out_proj.weight, m.out_proj.bias)
    record(m.out_proj, attn, out, None)
    # a fresh tensor: an in-place op of the caller on the output must not change the recorded one
    return (out.clone() if m.batch_first else out.transpose(0, 1).contiguous()), weights


# --------------------------------------------------------------------------- the rules
def _padded(e: Tensor, tag: str, dim: int) -> Tensor:
    """An in-projection's output gradient ``[B, ..., k·E]`` placed in its rows of ``[B, ..., 3E]``."""
    lo, hi = ROWS[tag]
    if (lo, hi) == (0, 3):
        return e
    return F.pad(e, (lo * dim, (3 - hi) * dim))


@register_rule(nn.MultiheadAttention, forward=mha_forward)
def _mha(layer: LayerCalls) -> list:
    """Blocks of in_proj_weight (or q/k/v_proj_weight), in_proj_bias, bias_k, bias_v from the tapped calls."""
    b, dim = layer.batch_size, layer.module.embed_dim
    tagged = [(tag, a, e) for (a, e), tag in zip(layer.calls, layer.tags)]
    blocks = []

    def zero(attr: str) -> DirectBlock:
        return DirectBlock([layer.index[attr]], [layer.calls[0][1].new_zeros((b, *layer.shapes[attr]))])

    if "in_proj_weight" in layer.index:
        parts = [LinearPart(a, _padded(e, tag, dim)) for tag, a, e in tagged if tag in ROWS]  # type: ignore[arg-type]
        blocks.append(
            FactoredBlock(layer.index["in_proj_weight"], layer.shapes["in_proj_weight"], parts, layer.budget, b)
        )
    for attr, want in (("q_proj_weight", "q"), ("k_proj_weight", "k"), ("v_proj_weight", "v")):
        if attr in layer.index:
            parts = [LinearPart(a, e) for tag, a, e in tagged if tag == want]
            blocks.append(FactoredBlock(layer.index[attr], layer.shapes[attr], parts, layer.budget, b))
    if "in_proj_bias" in layer.index:
        sums = [_padded(e.reshape(b, -1, e.shape[-1]).sum(1), tag, dim) for tag, _, e in tagged if tag in ROWS]  # type: ignore[arg-type]
        blocks.append(DirectBlock([layer.index["in_proj_bias"]], [sum(sums)]) if sums else zero("in_proj_bias"))  # type: ignore[arg-type, list-item]
    for attr in ("bias_k", "bias_v"):
        if attr in layer.index:
            gs = [e.reshape(b, *layer.shapes[attr]) for tag, _, e in tagged if tag == attr]
            blocks.append(DirectBlock([layer.index[attr]], [sum(gs)]) if gs else zero(attr))  # type: ignore[arg-type, list-item]
    return blocks


# out_proj is called by mha_forward (recorded as its own call): nn.Linear's rule, for this exact subclass
register_rule(NonDynamicallyQuantizableLinear, views="merge")(_linear)


# --------------------------------------------------------------------------- sequence-first encoder layers
def _dropout_seq_first(t: Tensor, module: nn.Module) -> Tensor:
    """``module(t)`` (an ``nn.Dropout``) of a batch-first ``t``, drawn on ``[T, B, ...]`` as the layer would."""
    return F.dropout(t.transpose(0, 1), module.p, module.training).transpose(0, 1)  # type: ignore[arg-type]


def encoder_layer_forward(
    m: nn.TransformerEncoderLayer,
    record,
    src: Tensor,
    src_mask: Optional[Tensor] = None,
    src_key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = False,
) -> Tensor:
    """``nn.TransformerEncoderLayer(batch_first=False)`` computed batch-first inside (``[T, B, E]`` in and out).

    Its Linear and LayerNorm layers would otherwise see ``[T, B, E]``
    (examples along dim 1: the per-call layout test moves them to the
    per-example path, and ``PrivacyEngine`` refuses them). The same
    computation as ``TransformerEncoderLayer.forward``'s training path (post-
    or pre-norm, ``_sa_block``, ``_ff_block``) on ``src.transpose(0, 1)``; its
    dropout masks are drawn on the sequence-first tensors, as the layer draws
    them (the first-batch check replays them). Records nothing itself (its
    sublayers are recorded). ``batch_first=True``, or no gradients: the
    layer's own forward.
    """
    if m.self_attn.batch_first or not torch.is_grad_enabled():
        return type(m).forward(m, src, src_mask, src_key_padding_mask, is_causal)
    if src.dim() != 3:
        raise ValueError(
            f"nn.TransformerEncoderLayer got an unbatched {src.dim()}-D input: per-sample gradients "
            "need batched inputs [T, B, E]"
        )

    def sa(x: Tensor) -> Tensor:
        xs = x.transpose(0, 1)
        out = m.self_attn(
            xs,
            xs,
            xs,
            attn_mask=src_mask,
            key_padding_mask=src_key_padding_mask,
            need_weights=False,
            is_causal=is_causal,
        )[0]
        return _dropout_seq_first(out.transpose(0, 1), m.dropout1)

    def ff(x: Tensor) -> Tensor:
        h = m.linear2(_dropout_seq_first(m.activation(m.linear1(x)), m.dropout))
        return _dropout_seq_first(h, m.dropout2)

    x = src.transpose(0, 1)
    if m.norm_first:
        x = x + sa(m.norm1(x))
        x = x + ff(m.norm2(x))
    else:
        x = m.norm1(x + sa(x))
        x = m.norm2(x + ff(x))
    return x.transpose(0, 1)


def _plain_dropouts(m: nn.Module) -> bool:
    return all(type(getattr(m, k)) is nn.Dropout for k in ("dropout", "dropout1", "dropout2"))


@register_rule(nn.TransformerEncoderLayer, supports=_plain_dropouts, forward=encoder_layer_forward)
def _encoder_layer(layer: LayerCalls) -> list:
    """No parameter of its own: its sublayers have the rules."""
    return []
