"""Weight-standardized convolutions (:class:`dpopt.models.WSConv2d`) in the fast per-sample engine.

A :class:`~dpopt.models.WSConv2d` computes ``conv2d(x, ŵ) + bias`` with the
standardized weight ŵ = S(w) of its RAW parameter w, per output channel o
over its n inputs::

    ŵ_o = (w_o − μ_o) r_o,   r_o = (n·var(w_o) + eps)^(−1/2).

DP clips the per-example gradient w.r.t. the raw w. The standardization is
the same function for every example (it reads the parameter, not the data),
so with g_i = ∂ℓ_i/∂ŵ (the ordinary conv per-example gradient, g_i = Σ_t
e_it a_itᵀ through im2col) the chain rule gives, per output channel::

    ∂ℓ_i/∂w_o = J_oᵀ g_io = r_o (g_io − mean(g_io) − ŵ_o ⟨ŵ_o, g_io⟩)

(J_o = ∂ŵ_o/∂w_o = r_o (I − 11ᵀ/n − ŵ_o ŵ_oᵀ), symmetric; derived from the
definition above). Jᵀ is linear and shared by the examples, so the clipped
sum is Jᵀ(Σ_i c_i g_i) — one convolution weight-gradient kernel — and only
the norms need per-example gradients: :class:`WSConvBlock` forms Jᵀ g_i in
chunks of examples (bounded by the source's
:class:`~dpopt.engine.layers.Budget`), never the whole ``[B, *w.shape]``
unless it fits the cache. Ghost norms do not apply (‖Jᵀg‖ ≠ ‖g‖).

The layer's *tapped forward* (:func:`ws_conv2d_forward`, a
:class:`~dpopt.engine.rules.Rule` ``forward``) records the convolution's
input and output together with (ŵ, r) computed from the weight the call
actually used — under ``functional_call`` at a DiSK evaluation point θ +
offset that is the shifted weight, so each call gets its own Jacobian.
Both capture doors (dpopt's loop and ``PrivacyEngine``'s hooks) install it;
their first-batch check compares the result with single-example autograd.
The bias (if any) is the plain Σ_t e_it. ``groups`` ≠ 1 uses the exact
per-example reference path (as for ``nn.Conv2d``).

This module registers the rule itself (importing :mod:`dpopt.engine.rules`,
which imports nothing of it); :mod:`dpopt.engine` imports it, as it does the
MultiheadAttention and recurrent rules.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..models import WSConv2d
from .layers import Budget, ConvPart, DirectBlock, _geo_sq_norms, cached_grad_sum, constant_sq_norms, conv_method
from .rules import LayerCalls, register_rule

__all__ = ["WSConvBlock", "ws_conv2d_blocks", "ws_conv2d_forward", "ws_vjp"]


def ws_vjp(g: Tensor, w_hat: Tensor, r: Tensor) -> Tensor:
    """Jᵀ g: the gradient w.r.t. the raw weight from ``g`` = gradient w.r.t. ŵ.

    Args:
        g: ``[..., q, p]`` (any leading axes: examples, chunks).
        w_hat: standardized weight ``[q, p]``; r: ``[q, 1]`` (``WSConv2d.standardized``).

    Returns:
        ``[..., q, p]``: r_o (g_o − mean(g_o) − ŵ_o ⟨ŵ_o, g_o⟩) per output channel o.
    """
    inner = (g * w_hat).sum(-1, keepdim=True)
    return r * (g - g.mean(-1, keepdim=True) - w_hat * inner)


def ws_conv2d_forward(m, record, x: Tensor) -> Tensor:
    """``m(x)`` for a :class:`~dpopt.models.WSConv2d`, with its convolution recorded.

    ``record(m, x, out, (ŵ [q, p], r [q, 1]))`` (detached) when gradients are
    enabled; otherwise the plain forward. The output is exactly
    ``WSConv2d.forward``'s (the same operations).
    """
    w_hat, r = m.standardized()
    out = m._conv_forward(x, w_hat, m.bias)
    if torch.is_grad_enabled():
        record(m, x, out, (w_hat.detach().reshape(w_hat.shape[0], -1), r.detach()))
    return out


class WSConvBlock:
    """The raw weight of a WSConv2d: per-example Jᵀ g_i, formed in chunks of examples.

    Args:
        index: the weight's trainable-parameter index; shape: its shape ``[q, C, kh, kw]``.
        parts: ``(ConvPart, ŵ [q, p], r [q, 1])`` per recorded call (each its own Jacobian).
        budget: the source's :class:`~dpopt.engine.layers.Budget`; batch_size: B.

    ``sq_norms(geos)`` → ``[B]``: ‖(Jᵀg_i − m)/b‖² in the clip geometry;
    ``grad_sums(coefs, bad)`` → Σ_i c_i Jᵀg_i over the examples not ``bad``
    (raw coordinates). Private data (a block of the fast source).
    """

    def __init__(self, index: int, shape: Sequence[int], parts: Sequence, budget: Budget, batch_size: int):
        self.index = (index,)
        self.shape = tuple(shape)
        self.q, self.p = self.shape[0], int(math.prod(self.shape[1:]))
        self.parts = list(parts)
        self.budget = budget
        self.B = int(batch_size)
        self._cache: Optional[list[Tensor]] = None
        self._cache_bytes = 0

    def _dtype(self) -> torch.dtype:
        return self.parts[0][0].e.dtype

    def _chunk(self, s: int, t: int, step: int) -> Tensor:
        """Jᵀ g_i for examples s..t−1, ``[b, q, p]`` (summed over the calls)."""
        total = None
        for part, w_hat, r in self.parts:
            g = ws_vjp(part.per_sample(s, t, conv_method(part)), w_hat, r)
            total = g if total is None else total + g
        return total  # type: ignore[return-value]

    def sq_norms(self, geos) -> list[Tensor]:
        m, b = geos[0]
        m = None if m is None else m.reshape(self.q, self.p)
        b = None if b is None else b.reshape(self.q, self.p)
        if self.B == 0 or not self.parts:
            return [constant_sq_norms(m, b, self.B)]
        if self._cache is not None:
            return [torch.cat([_geo_sq_norms(g, m, b) for g in self._cache])]
        bits = torch.finfo(self._dtype()).bits // 8
        nbytes = self.B * self.q * self.p * bits
        keep = self.budget.take(nbytes)
        T = sum(pt.T for pt, _, _ in self.parts)
        per = (3 * self.q * self.p + (self.p + self.q) * T) * bits
        step = max(1, min(self.B, self.budget.chunk_bytes // max(per, 1)))
        out, cache = [], ([] if keep else None)  # type: ignore[var-annotated]
        for s in range(0, self.B, step):
            g = self._chunk(s, min(self.B, s + step), step)
            out.append(_geo_sq_norms(g, m, b))
            if cache is not None:
                cache.append(g)
        if cache is not None:
            self._cache, self._cache_bytes = cache, nbytes
        return [torch.cat(out)]

    def grad_sums(self, coefs, bad: Optional[Tensor]) -> list[Tensor]:
        c = coefs[0]
        if self.B == 0 or not self.parts:
            return [torch.zeros(self.shape, dtype=c.dtype, device=c.device)]
        if self._cache is not None:
            return [cached_grad_sum(self._cache, c, bad).reshape(self.shape)]
        total = None
        for part, w_hat, r in self.parts:  # Jᵀ is linear: Jᵀ(Σ_i c_i g_i), one weight-gradient kernel per call
            g = ws_vjp(part.grad_sum(c, bad), w_hat, r)
            total = g if total is None else total + g
        return [total.reshape(self.shape)]  # type: ignore[union-attr]

    def free(self) -> None:
        if self._cache is not None:
            self.budget.give(self._cache_bytes)
        self._cache, self._cache_bytes = None, 0
        self.parts = []


def ws_conv2d_blocks(layer: LayerCalls) -> list:
    """The rule of :class:`~dpopt.models.WSConv2d` (groups = 1): raw weight via Jᵀ, bias Σ_t e."""
    b, m, blocks = layer.batch_size, layer.module, []
    if "weight" in layer.index:
        parts = []
        for (a, e), tag in zip(layer.calls, layer.tags):
            if tag is None:
                raise RuntimeError(
                    "internal error: a WSConv2d call was recorded without its standardization "
                    "(its tapped forward, engine.ws.ws_conv2d_forward, was not installed)"
                )
            w_hat, r = tag
            parts.append((ConvPart(m, layer.rows(a), layer.rows(e), layer.views), w_hat.to(e.dtype), r.to(e.dtype)))
        blocks.append(WSConvBlock(layer.index["weight"], layer.shapes["weight"], parts, layer.budget, b))
    if "bias" in layer.index:
        blocks.append(DirectBlock([layer.index["bias"]], [layer.summed_outputs((2, 3))]))  # type: ignore[arg-type]
    return blocks


register_rule(WSConv2d, supports=lambda m: m.groups == 1, forward=ws_conv2d_forward, views="merge")(ws_conv2d_blocks)  # type: ignore[arg-type, return-value]
