"""nn.LSTM / nn.GRU / nn.RNN on the fast path of both front doors (issue 20).

The fused recurrent kernels expose no gate gradient; both engines used to compute these layers one
example at a time (PrivacyEngine: a vjp loop over examples, minutes per epoch; dropout between layers
refused). :mod:`dpopt.engine.recurrent` gives them a tapped forward, the recurrence as a loop over
time steps with the input/hidden projections recorded. Checked here:

* the tapped forward equals the fused layer (float64, 1e-12): LSTM/GRU/RNN(tanh, relu), 1 and 2
  layers, bidirectional, batch_first either way, bias=False, given initial states, PackedSequence;
* per-example gradients of every trainable parameter through ``iter_per_sample_sources`` and through
  ``PrivacyEngine``'s hook capture equal single-example autograd (rel 1e-4 float32, 1e-10 float64),
  train mode, nothing demoted; dropout between layers in train mode given the replayed masks;
* σ = 0: removing one example moves each door's clipped sum by at most C.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from test_attention import _replayed_door, both_doors_match, sensitivity_within_c
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from dpopt.engine import get_engine
from dpopt.engine.recurrent import rnn_forward
from dpopt.engine.rules import rule_for

B, T, D, H, K = 5, 4, 3, 6, 3
CELLS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}


def _nothing(*args) -> None:
    return None


class Classifier(nn.Module):
    """x [B, T, D] → recurrent layer (either layout) → last step's output (or the packed final state) → Linear."""

    def __init__(
        self,
        kind: str,
        layers: int = 1,
        bidirectional: bool = False,
        batch_first: bool = True,
        dropout: float = 0.0,
        packed: bool = False,
    ):
        super().__init__()
        self.batch_first, self.packed = batch_first, packed
        self.rnn = CELLS[kind](
            D, H, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, dropout=dropout
        )
        self.head = nn.Linear(H * (2 if bidirectional else 1), K)

    def forward(self, x):
        if self.packed:  # the last feature marks the valid steps (at least one per example)
            lengths = (x[..., -1] > 0.25).sum(1).clamp_min(1).cpu()
            h = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))[1]
            h = h[0] if isinstance(h, tuple) else h
            return self.head(torch.cat(list(h[-(2 if self.rnn.bidirectional else 1) :]), dim=1))
        out = self.rnn(x if self.batch_first else x.transpose(0, 1))[0]
        return self.head((out if self.batch_first else out.transpose(0, 1))[:, -1])


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    return torch.rand(B, T, D, generator=g).to(dtype), torch.randint(0, K, (B,), generator=g)


@pytest.mark.parametrize("kind", list(CELLS))
def test_tapped_recurrent_forward_equals_the_fused_layer(kind):
    dt = torch.float64
    torch.manual_seed(0)
    for layers, bi, bf, bias in itertools.product([1, 2], [False, True], [True, False], [True, False]):
        kw = {"nonlinearity": "relu"} if kind == "rnn" and layers == 2 else {}
        m = CELLS[kind](D, H, num_layers=layers, bidirectional=bi, batch_first=bf, bias=bias, dtype=dt, **kw)
        x = torch.randn(3, 6, D, dtype=dt)
        x_in = x if bf else x.transpose(0, 1)
        h0 = torch.randn(layers * (1 + bi), 3, H, dtype=dt)
        hx = (h0, torch.randn_like(h0)) if kind == "lstm" else h0
        packed = pack_padded_sequence(x, torch.tensor([6, 2, 4]), batch_first=True, enforce_sorted=False)
        for inp, state in ((x_in, None), (x_in, hx), (packed, hx)):
            want, got = m(inp, state), rnn_forward(m, _nothing, inp, state)
            w0, g0 = (want[0].data, got[0].data) if inp is packed else (want[0], got[0])
            torch.testing.assert_close(g0, w0, rtol=0, atol=1e-12)
            for a, b in zip(torch.utils._pytree.tree_leaves(got[1]), torch.utils._pytree.tree_leaves(want[1])):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", list(CELLS))
@pytest.mark.parametrize("layers,bidirectional", [(1, False), (2, True)])
def test_recurrent_per_example_gradients_both_doors(kind, layers, bidirectional):
    torch.manual_seed(1)
    both_doors_match(lambda: Classifier(kind, layers, bidirectional), *_data())


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_recurrent_sequence_first_packed_and_float64_both_doors(kind):
    torch.manual_seed(2)
    both_doors_match(lambda: Classifier(kind, 2, True, batch_first=False), *_data())
    both_doors_match(lambda: Classifier(kind, 1, True, packed=True), *_data())
    both_doors_match(lambda: Classifier(kind, 2, False), *_data(torch.float64), dtype=torch.float64)


@pytest.mark.parametrize("door", ["fast", "hooks"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_dropout_between_layers_in_train_mode_both_doors_given_the_masks(door, kind):
    """num_layers = 2, dropout 0.3: PrivacyEngine used to refuse it (the per-example vjp loop drew new masks)."""
    torch.manual_seed(3)
    model = Classifier(kind, 2, True, dropout=0.3).train()
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, truth, replay = _replayed_door(model, x, y, door)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not [m for m in msgs if "per-example" in m], msgs
    if door == "fast":
        assert get_engine(model, __import__("test_attention").ce).fallback_names == []
    for g, t in zip(got, truth):
        assert float((g - t).norm()) <= 1e-4 * float(t.norm())
    assert len(replay.outs) == 1 and 0 < float(replay.outs[0].float().mean()) < 1  # one mask, between the layers


@pytest.mark.parametrize("kind", list(CELLS))
def test_sigma_zero_sensitivity_within_c_both_doors(kind):
    torch.manual_seed(4)
    sensitivity_within_c(Classifier(kind, 1, True).train(), *_data())


def test_lstm_with_projections_keeps_the_per_example_path():
    assert rule_for(nn.LSTM(3, 4, proj_size=2)) is None
    assert rule_for(nn.LSTM(3, 4)) is not None and rule_for(nn.GRU(3, 4)) is not None
