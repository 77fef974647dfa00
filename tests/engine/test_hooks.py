"""Hook capture (PrivacyEngine's per-sample path): per-example gradients from the user's own backward.

Checked against a loop of single-example autograd on several model kinds (fast rules, the vjp
fallback, vmap-less layers), for both loss reductions; sensitivity with σ = 0; and the refusals
(BatchNorm, examples mixed, layout, several passes, buffers).
"""

from __future__ import annotations

import pytest
import torch
from test_deferred_check_refusal import _MixesInLargeBatches, private_one_batch
from torch import nn

from dpopt.engine.hooks import HookCapture, grad_sample_source
from dpopt.privatizer import Privatizer
from dpopt.types import ClipGeometry


class Scale(nn.Module):
    """A layer without a fast rule: its parameter goes through the vjp fallback."""

    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return torch.tanh(x * self.w)


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, t):
        return self.head(self.norm(self.emb(t)).mean(1))


class RNNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _models():
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, stride=2),
        nn.Flatten(),
        nn.Linear(36, 3),
    )
    return {
        "mlp": (nn.Sequential(nn.Linear(5, 7), nn.ReLU(), Scale(7), nn.Linear(7, 3)), lambda b: torch.randn(b, 5)),
        "cnn": (cnn, lambda b: torch.randn(b, 1, 8, 8)),
        "tokens": (TokenNet(), lambda b: torch.randint(0, 11, (b, 4))),
        "gru": (RNNNet(), lambda b: torch.randn(b, 3, 4)),
    }


def _per_example(src, b):
    """g_i for every i from a source, through its public weighted_sum (one-hot weights)."""
    rows = []
    for i in range(b):
        w = torch.zeros(b, 1, dtype=torch.float64)
        w[i] = 1
        rows.append([t.clone() for t in src.weighted_sum(w.float(), ClipGeometry(), [0] * src.num_params)])
    return [torch.stack([r[k] for r in rows]) for k in range(src.num_params)]


def _loop(model, x, y):
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(len(y)):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        rows.append(
            [
                torch.zeros_like(p) if g is None else g
                for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True))
            ]
        )
    return [torch.stack([r[k] for r in rows]) for k in range(len(params))]


@pytest.mark.parametrize("kind", ["mlp", "cnn", "tokens", "gru"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_hook_per_example_gradients_match_single_example_autograd(kind, reduction):
    model, make = _models()[kind]
    b = 5
    x, y = make(b), torch.randint(0, 3, (b,))
    want = _loop(model, x, y)  # before the hooks are attached
    cap = HookCapture(model, loss_reduction=reduction)
    loss = nn.functional.cross_entropy(model(x), y, reduction=reduction)
    loss.backward()
    src = cap.collect()
    assert src.batch_size == b and cap.verified
    for g, w in zip(_per_example(src, b), want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    # a second step (verification done) gives the same
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y, reduction=reduction).backward()
    for g, w in zip(_per_example(cap.collect(), b), want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    cap.detach()


def test_sensitivity_removing_one_example_moves_clipped_sum_by_at_most_c():
    model, make = _models()["cnn"]
    cap = HookCapture(model)
    torch.manual_seed(1)
    x, y = make(6) * 10, torch.randint(0, 3, (6,))
    clip = 0.05

    def clipped_sum(xb, yb):
        nn.functional.cross_entropy(model(xb), yb).backward()
        priv = Privatizer(0.0, clip, expected_batch_size=1.0, sample_rate=0.5)
        return torch.cat([g.flatten() for g in priv.privatize(cap.collect(), params_like=cap.params).grads])

    full = clipped_sum(x, y)
    for i in range(6):
        keep = [j for j in range(6) if j != i]
        assert float((full - clipped_sum(x[keep], y[keep])).norm()) <= clip * (1 + 1e-4)


def test_empty_batch_and_no_backward():
    model, make = _models()["mlp"]
    cap = HookCapture(model)
    out = model(make(0))
    nn.functional.cross_entropy(out, torch.zeros(0, dtype=torch.long)).backward()
    assert cap.collect().batch_size == 0
    assert cap.collect().batch_size == 0  # step without forward: empty
    model(make(3))
    with pytest.warns(RuntimeWarning, match="without loss.backward"):
        assert cap.collect().batch_size == 0


def test_refusals():
    with pytest.raises(ValueError, match="BatchNorm|batch normalisation"):
        HookCapture(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))

    class Mixer(nn.Module):  # mixes examples: x - x.mean(0)
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(x - x.mean(0, keepdim=True))

    m = Mixer()
    cap = HookCapture(m)
    nn.functional.cross_entropy(m(torch.randn(4, 3)), torch.tensor([0, 1, 0, 1])).backward()
    with pytest.raises(ValueError, match="do not match single-example"):
        cap.collect()

    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):  # [B, T, 3] -> transposed to [T, B, 3] for the layer; only the root encloses it
            return self.fc(x.transpose(0, 1)).mean(0)

    m = SeqFirst()
    cap = HookCapture(m)
    nn.functional.cross_entropy(m(torch.randn(4, 5, 3)), torch.tensor([0, 1, 0, 1])).backward()
    with pytest.raises(ValueError, match="along dim 0"):
        cap.collect()

    m = nn.Linear(3, 2)
    cap = HookCapture(m, verify=False)
    (m(torch.randn(4, 3)).sum() + m(torch.randn(4, 3)).sum()).backward()
    with pytest.raises(ValueError, match="2 forward passes"):
        cap.collect()

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)
            self.register_buffer("seen", torch.zeros(3))

        def forward(self, x):
            self.seen += x.sum(0)
            return self.fc(x)

    m = Counter()
    HookCapture(m)
    with pytest.raises(ValueError, match="changed its buffers"):
        m(torch.randn(2, 3))
    assert torch.equal(m.seen, torch.zeros(3))  # rolled back: the batch statistic does not stay in the model

    # a first batch of ONE example cannot reveal the mixing (tiled copies agree): the check waits for ≥ 2
    m = Mixer()
    cap = HookCapture(m)
    nn.functional.cross_entropy(m(torch.randn(1, 3)), torch.tensor([0])).backward()
    cap.collect()
    assert not cap.verified
    m.zero_grad()
    nn.functional.cross_entropy(m(torch.randn(4, 3)), torch.tensor([0, 1, 0, 1])).backward()
    with pytest.raises(ValueError, match="do not match single-example"):
        cap.collect()


def test_grad_sample_adapter():
    lin = nn.Linear(3, 2)
    assert grad_sample_source(list(lin.parameters())) is None
    g_w, g_b = torch.randn(4, 2, 3), torch.randn(4, 2)
    lin.weight.grad_sample, lin.bias.grad_sample = g_w, g_b
    src = grad_sample_source(list(lin.parameters()))
    assert src.batch_size == 4 and src.params == (lin.weight, lin.bias)
    sq = src.sq_norms(ClipGeometry(), [0, 0], 1)[:, 0]
    torch.testing.assert_close(sq, g_w.flatten(1).square().sum(1) + g_b.square().sum(1))
    lin.bias.grad_sample = None
    with pytest.raises(ValueError, match="some trainable parameters"):
        grad_sample_source(list(lin.parameters()))


def test_check_at_the_batch_size_runs_after_the_sums_and_refuses_before_the_release():
    """PrivacyEngine defers the check's pass at the batch's size (issue 34: memory) — still before any release.

    The small verification sizes (≤ 4 rows) cannot see this mixing; the pass at the batch's size (8) can.
    The step must raise and leave the parameters, the step count and the accounting untouched.
    """
    torch.manual_seed(0)
    model = _MixesInLargeBatches()
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    engine, model, opt = private_one_batch(model, x, y, optimizer=torch.optim.SGD)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match="do not match single-example autograd"):
        opt.step()
    assert opt._capture._deferred == []  # the deferred pass ran (and refused)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    assert engine.accountant.history == []  # nothing released, nothing charged
