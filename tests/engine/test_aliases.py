"""Aliased parameters (one parameter registered on a module and on its child): counted once, exact.

Opacus's ``DPLSTM`` (``RenameParamsMixin``) registers its ``RNNLinear`` cells'
parameters again on itself (``weight_ih_l0`` is ``l0.ih.weight``). The plan
recognises the alias by identity (:mod:`dpopt.engine.aliases`) and gives the
parameter to the child, whose forward uses it. Checked: per-example gradients
through ``PrivacyEngine``'s hooks and dpopt's own loop equal single-example
autograd (each example alone; one- and two-layer, bidirectional DPLSTM);
σ = 0 sensitivity ≤ C through ``make_private``; a parent that ALSO uses the
aliased parameter in its own code is refused by the first-batch check.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.engine import iter_per_sample_sources
from dpopt.engine.aliases import alias_names
from dpopt.engine.hooks import HookCapture
from dpopt.types import ClipGeometry

layers = pytest.importorskip("opacus.layers")

V, E_, H, T, B = 13, 6, 5, 7, 4


class CharClassifier(nn.Module):
    """Opacus char-lstm-classification.py's model: embedding → DPLSTM → last step → linear."""

    def __init__(self, num_layers=1, bidirectional=False):
        super().__init__()
        self.embedding = nn.Embedding(V, E_)
        self.rnn = layers.DPLSTM(E_, H, num_layers=num_layers, bidirectional=bidirectional, batch_first=True)
        self.out_layer = nn.Linear(H * (2 if bidirectional else 1), 3)

    def forward(self, x):
        h, _ = self.rnn(self.embedding(x))
        return self.out_layer(h[:, -1, :])


def _data(**kw):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return (
        CharClassifier(**kw).train(),
        torch.randint(0, V, (B, T), generator=gen),
        torch.randint(0, 3, (B,), generator=gen),
    )


def _reference(model, x, y):
    params = list(model.parameters())
    rows = [torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), params) for i in range(B)]
    return [torch.stack([r[k] for r in rows]) for k in range(len(params))]


def _read(src):
    n = src.num_params
    out = [[] for _ in range(n)]
    for i in range(src.batch_size):
        w = torch.zeros(src.batch_size, 1, dtype=torch.float64)
        w[i] = 1.0
        for k, g in enumerate(src.weighted_sum(w, ClipGeometry(), [0] * n)):
            out[k].append(g)
    return [torch.stack(o) for o in out]


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-4, atol=1e-7)


def test_dplstm_registers_its_cells_parameters_twice():
    model, _, _ = _data()
    aliases = alias_names(model)
    assert aliases == {model.rnn: {"weight_ih_l0", "bias_ih_l0", "weight_hh_l0", "bias_hh_l0"}}
    assert model.rnn.weight_ih_l0 is model.rnn.l0.ih.weight


@pytest.mark.parametrize("kw", [{}, {"num_layers": 2, "bidirectional": True}], ids=["1-layer", "2-layer-bidi"])
def test_privacy_engine_door_is_exact_on_dplstm(kw):
    model, x, y = _data(**kw)
    cap = HookCapture(model, "mean")
    try:
        for _ in range(2):  # the first batch runs the check
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            src = cap.collect()
    finally:
        cap.detach()
    _close(_read(src), _reference(model, x, y))


def test_dpopts_loop_is_exact_on_dplstm():
    model, x, y = _data()
    src = next(iter(iter_per_sample_sources(model, F.cross_entropy, x, y)))
    _close(_read(src), _reference(model, x, y))


def test_sensitivity_through_make_private_on_dplstm():
    model, x, y = _data()
    model.eval()
    norms = torch.sqrt(sum(g.double().flatten(1).square().sum(1) for g in _reference(model, x, y)))
    c = 0.5 * float(norms.median())
    engine = dpopt.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt, _ = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=c,
        poisson_sampling=False,  # the sensitivity test steps on neighbouring batches of its own
    )

    def released(xs, ys):
        opt.zero_grad()
        F.cross_entropy(model(xs), ys).backward()
        opt.step()
        return torch.cat([p.grad.flatten() for p in model.parameters()]) * opt.expected_batch_size

    try:
        full = released(x, y)
        assert float(full.norm()) > 0
        for j in range(B):
            keep = torch.tensor([i for i in range(B) if i != j])
            assert float((full - released(x[keep], y[keep])).norm()) <= c * (1 + 1e-5)
    finally:
        engine.detach()


class ParentUsesAlias(nn.Module):
    """A parent that registers its child's weight again AND uses it in its own forward: not a mere alias."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.w = self.inner.weight  # the alias
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.inner(x) + F.linear(x, self.w))


def test_a_parent_that_uses_the_aliased_parameter_is_refused():
    torch.manual_seed(0)
    model = ParentUsesAlias()
    x, y = torch.randn(B, 4), torch.randint(0, 2, (B,))
    cap = HookCapture(model, "mean")
    try:
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(ValueError, match="do not match single-example autograd"):
            cap.collect()
    finally:
        cap.detach()
