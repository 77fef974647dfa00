"""``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` in the fast per-sample engine: per-example gradients from the cells.

The fused recurrent kernels expose no gate gradient, so the per-sample
engines used to compute these layers' parameters one example at a time.
:func:`rnn_forward` is their *tapped forward* (:class:`~dpopt.engine.rules.Rule`),
the recurrence written as a loop over time steps (as Opacus's ``DPLSTM``
does), batch-first, per layer and direction:

* the input projection of all steps at once, ``gi = x W_ihᵀ + b_ih``
  (``[B, T, G·H]``, G = 4 / 3 / 1 gates), recorded as ``("ih", layer, dir)``
  with its input ``x [B, T, D]``;
* the hidden projection per step, ``gh_t = h_{t−1} W_hhᵀ + b_hh``. In LSTM and
  RNN cells the gates are ``gi_t + gh_t``, so ∂ℓ/∂gh_t = ∂ℓ/∂gi_t: the hidden
  map is recorded once as ``("hh", layer, dir)`` with input the stacked
  ``h_{t−1} [B, T, H]`` and output ``gi`` (its gradient). In a GRU the
  candidate gate uses ``r ⊙ gh_n``, so each step's ``gh_t`` is recorded.

Per example: ∇W_ih = Σ_t e_it x_itᵀ, ∇W_hh = Σ_t e^h_it h_{i,t−1}ᵀ, ∇b = Σ_t e_it
(the factored blocks of :mod:`dpopt.engine.layers`: ghost norm or
book-keeping). Covered: ``num_layers`` ≥ 1, ``bidirectional``, ``batch_first``,
``bias=False``, given initial states, RNN ``tanh``/``relu``, dropout between
layers in train mode (drawn sequence-first like torch's kernel, so the
first-batch check's replay gives each example its masks), and
``PackedSequence`` inputs (packed inside the model's forward): the padded
steps of a shorter sequence leave its state unchanged (``torch.where``: no
gradient flows through them), its outputs there are 0 as
``pad_packed_sequence`` gives, and the reverse direction starts at each
sequence's last step. ``nn.LSTM(proj_size > 0)`` keeps the per-example path.
Cell equations: the ``torch.nn.LSTM``/``GRU``/``RNN`` documentation (gate order
i, f, g, o and r, z, n); equality with the fused kernels is tested in float64.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from .layers import DirectBlock, FactoredBlock, LinearPart
from .rules import LayerCalls, register_rule

__all__ = ["rnn_forward"]

_NAME = re.compile(r"(weight|bias)_(ih|hh)_l(\d+)(_reverse)?")


def _cell(kind: str, nonlinearity: str, gi: Tensor, gh: Tensor, h: Tensor, c: Optional[Tensor]):
    """One step: ``(h', c')`` from the step's input projection ``gi [B, G·H]`` and hidden projection ``gh``."""
    if kind == "LSTM":
        i, f, g, o = (gi + gh).chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)  # type: ignore[operator]
        return torch.sigmoid(o) * torch.tanh(c), c
    if kind == "GRU":
        ir, iz, in_ = gi.chunk(3, dim=1)
        hr, hz, hn = gh.chunk(3, dim=1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        return n + z * (h - n), None
    pre = gi + gh
    return (torch.tanh(pre) if nonlinearity == "tanh" else torch.relu(pre)), None


def _direction(
    m: nn.RNNBase, record, x: Tensor, layer: int, reverse: bool, h: Tensor, c: Optional[Tensor], valid: Optional[Tensor]
) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """One layer and direction over ``x [B, T, D]``: outputs ``[B, T, H]``, final ``h``, ``c``."""
    sfx = f"_l{layer}" + ("_reverse" if reverse else "")
    w_ih, w_hh = getattr(m, "weight_ih" + sfx), getattr(m, "weight_hh" + sfx)
    b_ih = getattr(m, "bias_ih" + sfx) if m.bias else None
    b_hh = getattr(m, "bias_hh" + sfx) if m.bias else None
    tag = (layer, int(reverse))
    gi = F.linear(x, w_ih, b_ih)
    record(m, x, gi, ("ih",) + tag)
    kind, t_len = m.mode if m.mode in ("LSTM", "GRU") else "RNN", x.shape[1]
    nonlin = getattr(m, "nonlinearity", "tanh")
    outs: list[Optional[Tensor]] = [None] * t_len
    prev: list[Optional[Tensor]] = [None] * t_len
    for t in reversed(range(t_len)) if reverse else range(t_len):
        prev[t] = h
        if kind == "GRU":  # [B, 1, 3H]: the recorded tensor itself feeds the cell
            a = h.unsqueeze(1)
            gh3 = F.linear(a, w_hh, b_hh)
            record(m, a, gh3, ("hh",) + tag)
            gh = gh3.squeeze(1)
        else:
            gh = F.linear(h, w_hh, b_hh)
        h_new, c_new = _cell(kind, nonlin, gi[:, t], gh, h, c)
        if valid is not None:  # packed: a finished (or not yet started) sequence keeps its state
            keep = valid[:, t].unsqueeze(1)
            h_new = torch.where(keep, h_new, h)
            c_new = None if c is None else torch.where(keep, c_new, c)
            outs[t] = torch.where(keep, h_new, torch.zeros((), dtype=h_new.dtype, device=h_new.device))
        else:
            outs[t] = h_new
        h, c = h_new, c_new
    if kind != "GRU":  # gates = gi_t + gh_t: the hidden map's output gradient is gi's
        record(m, torch.stack(prev, dim=1), gi, ("hh",) + tag)  # type: ignore[arg-type]
    return torch.stack(outs, dim=1), h, c  # type: ignore[arg-type]


def rnn_forward(m: nn.RNNBase, record, input, hx=None):
    """``m(input, hx)`` for ``nn.LSTM``/``nn.GRU``/``nn.RNN`` with its linear maps recorded (module docstring).

    Args:
        m: the recurrent layer; record: ``record(owner, a, out, tag)``;
            input, hx: as the layer's ``forward`` (a tensor or a ``PackedSequence``).

    Returns:
        what the layer returns: ``(output, h_n)`` or ``(output, (h_n, c_n))``,
        output a tensor or a ``PackedSequence`` like ``input``. Without
        gradients the layer's own (fused) forward runs and nothing is recorded.

    Raises:
        ValueError: an unbatched (2-D) input while gradients are recorded.
    """
    if not torch.is_grad_enabled():
        return type(m).forward(m, input, hx)
    packed = isinstance(input, PackedSequence)
    valid = None
    if packed:
        x, lengths = pad_packed_sequence(input, batch_first=True)
        steps = torch.arange(x.shape[1]).unsqueeze(0)
        valid = (steps < lengths.unsqueeze(1)).to(x.device)
    else:
        if input.dim() != 3:
            raise ValueError(
                f"{type(m).__name__} got an unbatched {input.dim()}-D input: per-sample gradients need "
                "batched inputs ([B, T, D] with batch_first=True, or [T, B, D])"
            )
        x = input if m.batch_first else input.transpose(0, 1)
    b, dirs, hidden = x.shape[0], 2 if m.bidirectional else 1, m.hidden_size
    lstm = m.mode == "LSTM"
    if hx is None:
        h0 = x.new_zeros(m.num_layers * dirs, b, hidden)
        c0 = h0 if lstm else None
    else:
        h0, c0 = hx if lstm else (hx, None)
    hs, cs = [], []
    layer_in = x
    for layer in range(m.num_layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            out, h, c = _direction(m, record, layer_in, layer, bool(d), h0[k], None if c0 is None else c0[k], valid)
            outs.append(out)
            hs.append(h)
            cs.append(c)
        layer_out = outs[0] if dirs == 1 else torch.cat(outs, dim=2)
        if m.dropout > 0 and m.training and layer < m.num_layers - 1:
            layer_out = F.dropout(layer_out.transpose(0, 1), m.dropout, True).transpose(0, 1)  # [T, B, D] draw
        layer_in = layer_out
    h_n = torch.stack(hs)
    state = (h_n, torch.stack(cs)) if lstm else h_n  # type: ignore[arg-type]
    if packed:
        order = input.sorted_indices
        sorted_out = layer_in if order is None else layer_in.index_select(0, order)
        steps_sorted = valid if order is None else valid.index_select(0, order)  # type: ignore[union-attr]
        data = sorted_out.transpose(0, 1)[steps_sorted.transpose(0, 1)]  # type: ignore[union-attr]  # time-major, as packed data is
        return PackedSequence(data, input.batch_sizes, input.sorted_indices, input.unsorted_indices), state
    return (layer_in if m.batch_first else layer_in.transpose(0, 1)), state


# --------------------------------------------------------------------------- the rule
def _rnn(layer: LayerCalls) -> list:
    """Blocks of every weight/bias of the layer from the tapped (input, output-gradient) pairs, per tag."""
    b = layer.batch_size
    by_tag: dict = {}
    for (a, e), tag in zip(layer.calls, layer.tags):
        by_tag.setdefault(tag, []).append((a.reshape(b, -1, a.shape[-1]), e.reshape(b, -1, e.shape[-1])))
    blocks = []
    for attr, i in layer.index.items():
        kind, which, num, rev = _NAME.fullmatch(attr).groups()  # type: ignore[union-attr]
        pairs = by_tag.get((which, int(num), int(rev is not None)), [])
        if kind == "weight":
            parts = (
                [LinearPart(torch.cat([a for a, _ in pairs], 1), torch.cat([e for _, e in pairs], 1))] if pairs else []
            )
            blocks.append(FactoredBlock(i, layer.shapes[attr], parts, layer.budget, b))
        else:
            g = sum(e.sum(1) for _, e in pairs) if pairs else layer.calls[0][1].new_zeros((b, *layer.shapes[attr]))
            blocks.append(DirectBlock([i], [g]))  # type: ignore[arg-type]
    return blocks


register_rule(nn.LSTM, supports=lambda m: m.proj_size == 0, forward=rnn_forward, views="merge")(_rnn)  # type: ignore[arg-type, return-value]
register_rule(nn.GRU, nn.RNN, forward=rnn_forward, views="merge")(_rnn)
