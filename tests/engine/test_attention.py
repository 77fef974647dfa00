"""nn.MultiheadAttention / nn.TransformerEncoderLayer on the fast path of both front doors (issue 20).

``out_proj`` is used inside ``F.multi_head_attention_forward`` (outside its module's forward) and the
fused kernels expose no projection input/output, so MHA used to be demoted (fast engine: per-example
``torch.func`` path) or refused (``PrivacyEngine``). :mod:`dpopt.engine.attention` gives the layer a
tapped forward: the same computation batch-first with its projections recorded. Checked here:

* the tapped forward equals ``nn.MultiheadAttention`` / ``TransformerEncoderLayer`` (float64, 1e-12)
  over batch_first, masks (bool/float, 2-D/3-D, key padding, causal), add_bias_kv, add_zero_attn,
  kdim/vdim, bias=False, need_weights/average_attn_weights;
* per-example gradients of EVERY trainable parameter through ``iter_per_sample_sources`` and through
  ``PrivacyEngine``'s hook capture equal single-example autograd (rel 1e-4 float32, 1e-10 float64),
  in train mode, nothing demoted; with attention dropout, given the batched pass's masks (replayed);
* σ = 0: removing one example moves the clipped sum (release × expected batch size) by at most C;
* the models are left as they were (no instance ``forward`` after a step or ``detach``), an
  unbatched input is refused with a message.
"""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.engine import get_engine, iter_per_sample_sources
from dpopt.engine.attention import encoder_layer_forward, mha_forward
from dpopt.engine.check import RandomReplay
from dpopt.engine.hooks import HookCapture
from dpopt.engine.reference import per_sample_gradient_tensors
from dpopt.types import ClipGeometry

B, T, E, K = 5, 4, 8, 3
C = 0.05  # small enough that every example is clipped (sensitivity test)
TOL = {torch.float32: 1e-4, torch.float64: 1e-10}


def ce(out, target):
    return F.cross_entropy(out, target)


def _nothing(*args) -> None:
    return None


# --------------------------------------------------------------------------- shared door helpers
def truth_loop(model, x, y):
    """Per-example gradients [B, *shape] of every trainable parameter: autograd on each example alone."""
    return per_sample_gradient_tensors(model, ce, x, y, method="loop")


def _one_hot(src, b):
    rows = []
    for i in range(b):
        w = torch.zeros(b, 1, dtype=src.dtype)
        w[i] = 1
        rows.append([t.clone() for t in src.weighted_sum(w, ClipGeometry(), [0] * src.num_params)])
    return [torch.stack([r[k] for r in rows]) for k in range(src.num_params)]


def _no_demotion(caught) -> None:
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not [m for m in msgs if "per-example" in m or "does not keep" in m], msgs


def fast_door(model, x, y):
    """(per-example gradients via one-hot clipped sums, per-example ‖g_i‖²) through iter_per_sample_sources."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        src = next(iter(iter_per_sample_sources(model, ce, x, y)))
    _no_demotion(caught)
    assert get_engine(model, ce).fallback_names == []
    sq = src.sq_norms(ClipGeometry(), [0] * src.num_params, 1)[:, 0]
    return _one_hot(src, len(y)), sq


def hook_door(model, x, y):
    """The same through PrivacyEngine's capture (HookCapture, loss_reduction="sum"); the first step is checked."""
    cap = HookCapture(model, loss_reduction="sum")
    try:
        for _ in range(2):  # the first collect runs the first-batch check
            model.zero_grad()
            F.cross_entropy(model(x), y, reduction="sum").backward()
            src = cap.collect()
        sq = src.sq_norms(ClipGeometry(), [0] * src.num_params, 1)[:, 0]
        return _one_hot(src, len(y)), sq
    finally:
        cap.detach()


def assert_matches(got, sq, truth, dtype) -> None:
    tol = TOL[dtype]
    for g, t in zip(got, truth):
        assert float((g - t).norm()) <= tol * float(t.norm()) + 1e-30
    want = sum(t.flatten(1).double().square().sum(1) for t in truth)
    assert float((sq.double() - want).abs().max()) <= tol * float(want.max())


def both_doors_match(make_model, x, y, dtype=torch.float32) -> None:
    """Per-example gradients through both doors equal single-example autograd, in train mode."""
    model = make_model().to(dtype).train()
    x = x.to(dtype) if x.is_floating_point() else x
    truth = truth_loop(model, x, y)
    assert_matches(*fast_door(model, x, y), truth, dtype)
    assert_matches(*hook_door(model, x, y), truth, dtype)
    assert not [m for m in model.modules() if "forward" in m.__dict__]  # left as it was given


def _fast_clipped_sum(model0, x, y):
    model = copy.deepcopy(model0)
    src = next(iter(iter_per_sample_sources(model, ce, x, y)))
    n, geo = src.num_params, ClipGeometry()
    w = torch.clamp(C / src.sq_norms(geo, [0] * n, 1)[:, 0].sqrt(), max=1.0).unsqueeze(1)
    return torch.cat([s.flatten() for s in src.weighted_sum(w, geo, [0] * n)])


def _engine_release_times_b(model0, x, y):
    model = copy.deepcopy(model0)
    params = list(model.parameters())
    loader = DataLoader(TensorDataset(x, y), batch_size=len(y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # poisson_sampling=False is warned about: not what is tested here
        model, opt, _ = dpopt.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(params, lr=1.0),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=C,
            poisson_sampling=False,
        )
    before = [p.detach().clone() for p in params]
    opt.zero_grad()
    ce(model(x), y).backward()
    opt.step()
    return torch.cat([(b - p.detach()).flatten() for b, p in zip(before, params)]) * opt.expected_batch_size


def sensitivity_within_c(model0, x, y) -> None:
    """σ = 0: removing any one example moves each door's clipped sum by at most C (and by something)."""
    for fn in (_fast_clipped_sum, _engine_release_times_b):
        full = fn(model0, x, y)
        moves = []
        for j in range(len(y)):
            keep = torch.tensor([i for i in range(len(y)) if i != j])
            moves.append(float((full - fn(model0, x[keep], y[keep])).norm()))
        assert max(moves) <= C * (1 + 1e-5)
        assert min(moves) > 0.5 * C  # every example is clipped to C here: its removal is visible


# --------------------------------------------------------------------------- models
class Encoder(nn.Module):
    """Batch-first x [B, T, E] → TransformerEncoderLayer (either layout) → mean → Linear."""

    def __init__(self, batch_first: bool, dropout: float = 0.0, norm_first: bool = False):
        super().__init__()
        self.batch_first = batch_first
        self.enc = nn.TransformerEncoderLayer(E, 2, 12, dropout=dropout, batch_first=batch_first, norm_first=norm_first)
        self.head = nn.Linear(E, K)

    def forward(self, x):
        h = self.enc(x if self.batch_first else x.transpose(0, 1))
        return self.head((h if self.batch_first else h.transpose(0, 1)).mean(1))


class Attend(nn.Module):
    """MHA with a per-example key padding mask (the last input feature > 0.8 marks padding), a causal
    attention mask, optional bias_kv / zero attention / cross-attention to a projected memory."""

    def __init__(
        self, batch_first=True, add_bias_kv=False, add_zero_attn=False, cross=False, kdim=None, need_weights=False
    ):
        super().__init__()
        self.batch_first, self.cross, self.need_weights = batch_first, cross, need_weights
        self.mem = nn.Linear(E, kdim or E)
        self.mha = nn.MultiheadAttention(
            E, 2, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim=kdim, vdim=kdim, batch_first=batch_first
        )
        self.head = nn.Linear(E, K)

    def forward(self, x):
        pad = x[..., -1] > 0.8
        pad[:, 0] = False
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        lay = (lambda t: t) if self.batch_first else (lambda t: t.transpose(0, 1))  # noqa: E731
        q = lay(x)
        kv = lay(self.mem(x)) if self.cross or self.mha.kdim != E else q  # q is k is v: self-attention
        out, _ = self.mha(q, kv, kv, key_padding_mask=pad, attn_mask=mask, need_weights=self.need_weights)
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(out.mean(1))


def _data(dtype=torch.float32, b=B):
    g = torch.Generator().manual_seed(3)
    return torch.rand(b, T, E, generator=g).to(dtype), torch.randint(0, K, (b,), generator=g)


# --------------------------------------------------------------------------- the tapped forward is the layer
@pytest.mark.parametrize("batch_first,bias,bias_kv,zero_attn", list(itertools.product([True, False], repeat=4)))
def test_tapped_mha_forward_equals_torch(batch_first, bias, bias_kv, zero_attn):
    torch.manual_seed(0)
    dt = torch.float64
    for kd in (None, 5):
        m = nn.MultiheadAttention(
            E,
            2,
            bias=bias,
            add_bias_kv=bias_kv,
            add_zero_attn=zero_attn,
            kdim=kd,
            vdim=kd,
            batch_first=batch_first,
            dtype=dt,
        ).train()
        m.dropout = 0.0
        q = torch.randn(3, T, E, dtype=dt)
        k, v = torch.randn(3, 6, kd or E, dtype=dt), torch.randn(3, 6, kd or E, dtype=dt)
        if not batch_first:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        cases = [(q, k, v)] if kd else [(q, q, q), (q, k, k), (q, k, v)]
        for qq, kk, vv in cases:
            s = kk.shape[1 if batch_first else 0]
            pad = torch.zeros(3, s, dtype=torch.bool)
            pad[1, -2:] = True
            for kw in (
                {},
                {"key_padding_mask": pad},
                {"attn_mask": torch.randn(T, s, dtype=dt)},
                {"attn_mask": torch.randn(T, s) > 1.0, "key_padding_mask": pad},
                {"attn_mask": torch.randn(3 * 2, T, s, dtype=dt)},
            ):
                for nw, avg in ((False, True), (True, True), (True, False)):
                    want = m(qq, kk, vv, need_weights=nw, average_attn_weights=avg, **kw)
                    got = mha_forward(m, _nothing, qq, kk, vv, need_weights=nw, average_attn_weights=avg, **kw)
                    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12, equal_nan=True)
                    if nw:
                        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-12, equal_nan=True)


def test_tapped_forwards_equal_torch_causal_and_sequence_first_encoder():
    dt = torch.float64
    torch.manual_seed(0)
    m = nn.MultiheadAttention(E, 2, batch_first=True, dtype=dt)
    x = torch.randn(3, 5, E, dtype=dt)
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=dt)
    for nw in (True, False):
        want = m(x, x, x, attn_mask=causal, is_causal=True, need_weights=nw)[0]
        torch.testing.assert_close(
            mha_forward(m, _nothing, x, x, x, attn_mask=causal, is_causal=True, need_weights=nw)[0],
            want,
            rtol=0,
            atol=1e-12,
        )
    for norm_first in (False, True):
        layer = nn.TransformerEncoderLayer(E, 2, 12, dropout=0.0, norm_first=norm_first, dtype=dt).train()
        src = torch.randn(5, 3, E, dtype=dt)
        pad = torch.zeros(3, 5, dtype=torch.bool)
        pad[0, -1] = True
        torch.testing.assert_close(
            encoder_layer_forward(layer, _nothing, src, src_key_padding_mask=pad),
            layer(src, src_key_padding_mask=pad),
            rtol=0,
            atol=1e-12,
        )


# --------------------------------------------------------------------------- both doors, exact
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_transformer_encoder_layer_per_example_gradients_both_doors(batch_first, dtype):
    torch.manual_seed(0)
    both_doors_match(lambda: Encoder(batch_first, norm_first=not batch_first), *_data(dtype), dtype=dtype)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(batch_first=False),
        dict(add_bias_kv=True, add_zero_attn=True),
        dict(cross=True),
        dict(kdim=6, batch_first=False),
        dict(need_weights=True),
    ],
    ids=["masks", "seq-first", "bias-kv-zero-attn", "cross", "kdim", "need-weights"],
)
def test_mha_with_masks_per_example_gradients_both_doors(kw):
    torch.manual_seed(1)
    both_doors_match(lambda: Attend(**kw), *_data())


def test_mha_float64_per_example_gradients_both_doors():
    torch.manual_seed(2)
    both_doors_match(lambda: Attend(add_bias_kv=True), *_data(torch.float64), dtype=torch.float64)


def _replayed_door(model, x, y, door):
    """Per-example gradients of one (checked) step through ``door`` and the loop truth given its masks."""
    replay = RandomReplay(model)
    if door == "fast":
        next(iter(iter_per_sample_sources(model, ce, x, y))).free()  # the first-batch check
        with replay.recording():
            src = next(iter(iter_per_sample_sources(model, ce, x, y)))
    else:
        cap = HookCapture(model, loss_reduction="sum")
        F.cross_entropy(model(x), y, reduction="sum").backward()
        cap.collect().free()  # the first-batch check (train mode, masks replayed)
        model.zero_grad()
        with replay.recording():
            F.cross_entropy(model(x), y, reduction="sum").backward()
        src = cap.collect()
        cap.detach()
    with replay.replaying(len(y)):
        truth = truth_loop(model, x, y)
    return _one_hot(src, len(y)), truth, replay


@pytest.mark.parametrize("door", ["fast", "hooks"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_attention_dropout_in_train_mode_both_doors_given_the_masks(door, batch_first):
    torch.manual_seed(4)
    model = Encoder(batch_first, dropout=0.3).train()
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, truth, replay = _replayed_door(model, x, y, door)
    _no_demotion(caught)
    for g, t in zip(got, truth):
        assert float((g - t).norm()) <= 1e-4 * float(t.norm())
    assert len(replay.outs) == 4  # attention, dropout1, ff dropout, dropout2: each drew its masks
    assert 0 < float(replay.outs[0].float().mean()) < 1


# --------------------------------------------------------------------------- sensitivity, refusals
@pytest.mark.parametrize(
    "make_model",
    [lambda: Encoder(True), lambda: Encoder(False), lambda: Attend(add_bias_kv=True)],
    ids=["encoder-batch-first", "encoder-seq-first", "mha-masks-bias-kv"],
)
def test_sigma_zero_sensitivity_within_c_both_doors(make_model):
    torch.manual_seed(5)
    sensitivity_within_c(make_model().train(), *_data())


def test_unbatched_attention_input_is_refused_with_the_fix():
    class Unbatched(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(E, 2)
            self.head = nn.Linear(E, K)

        def forward(self, x):
            return self.head(torch.stack([self.mha(r, r, r)[0].mean(0) for r in x]))

    model = Unbatched().train()
    x, y = _data()
    with pytest.raises(ValueError, match="unbatched 2-D query.*batched inputs"):
        next(iter(iter_per_sample_sources(model, ce, x, y)))
    assert "forward" not in model.mha.__dict__


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_attention_per_example_gradients(reentrant):
    """torch.utils.checkpoint recomputes the block in the backward pass; the tapped attention's maps are
    recorded once (engine.recompute) and match single-example autograd in both doors, either form."""
    from torch.utils.checkpoint import checkpoint

    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha, self.head = nn.MultiheadAttention(E, 2, batch_first=True), nn.Linear(E, K)

        def forward(self, x):
            return self.head(checkpoint(lambda h: self.mha(h, h, h)[0], x, use_reentrant=reentrant).mean(1))

    x, y = _data()
    torch.manual_seed(0)
    model = Ckpt().train()
    truth = truth_loop(model, x, y)
    assert_matches(*hook_door(model, x, y), truth, torch.float32)
    assert_matches(*fast_door(model, x, y), truth, torch.float32)
