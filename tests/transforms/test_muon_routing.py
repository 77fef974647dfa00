"""Muon routing: embeddings and the classifier head go to the other branch; torch.optim.Muon cross-check."""

from __future__ import annotations

import pytest
import torch
import torch.optim._muon as torch_muon
from torch import nn

from dpopt.engine.reference import PerSampleGrads
from dpopt.methods import get_method, make_optimizer
from dpopt.transforms.muon import embedding_parameters, hidden_matrix_labels
from dpopt.transforms.newton_schulz import newton_schulz

pytestmark = pytest.mark.usefixtures("float64")


class Tagger(nn.Module):
    """Embedding → two hidden linears → head (a token classifier)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.fc1, self.fc2, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, tokens):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(self.emb(tokens))))))


def test_embeddings_and_head_are_routed_to_the_other_branch():
    model = Tagger()
    by_model = hidden_matrix_labels(model)
    names = [n for n, _ in model.named_parameters()]
    assert dict(zip(names, by_model.labels)) == {
        "emb.weight": "other",
        "fc1.weight": "muon",
        "fc1.bias": "other",
        "fc2.weight": "muon",
        "fc2.bias": "other",
        "head.weight": "other",
        "head.bias": "other",
    }
    # the same from a parameter list plus the embeddings, found by module type
    assert embedding_parameters(model) == [model.emb.weight]
    by_list = hidden_matrix_labels(list(model.parameters()), embeddings=embedding_parameters(model))
    assert by_list.labels == by_model.labels
    # a bare parameter list cannot see module types: the embedding looks like a first hidden matrix
    assert hidden_matrix_labels(list(model.parameters())).labels[0] == "muon"
    # the head can be kept on Muon explicitly
    assert hidden_matrix_labels(model, exclude_last=False).labels[names.index("head.weight")] == "muon"


@pytest.mark.parametrize("method", ["dp-muon", "dp-muon-auto"])
def test_make_optimizer_routes_embedding_to_adam(method):
    model = Tagger()
    opt = make_optimizer(
        method,
        model.parameters(),
        noise_multiplier=0.0,
        expected_batch_size=4,
        sample_rate=1.0,
        max_grad_norm=1e9,
        label_fn=hidden_matrix_labels(model),
    )
    grads = [torch.randn(4, *p.shape) for p in model.parameters()]
    opt.step(PerSampleGrads(grads))
    assert opt.state[model.emb.weight]["label"] == "other"
    assert opt.state[model.fc1.weight]["label"] == "muon"
    assert opt.state[model.head.weight]["label"] == "other"
    # dp-muon-auto's factory also takes the model itself
    if method == "dp-muon-auto":
        spec = get_method(method)
        part = spec.build(spec.hparams(), None, model=model)
        assert part.label_fn(model.emb.weight) == "other" and part.label_fn(model.fc2.weight) == "muon"


def _ns_like_dpopt(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton–Schulz lined up with dpopt's: computed in the input dtype (not
    bfloat16) and normalised by ‖G‖_F + ε (torch: max(‖G‖_F, ε); equal for ‖G‖_F ≫ ε up to ε/‖G‖_F)."""
    return newton_schulz(grad, ns_steps, ns_coefficients, eps)


def test_dp_muon_at_sigma_zero_matches_torch_optim_muon(monkeypatch):
    """σ = 0, C = ∞, every parameter a hidden matrix: dpopt's DP-Muon equals torch.optim.Muon (float64,
    bf16 Newton–Schulz replaced by dpopt's) to 1e-6 relative over 5 steps."""
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon not available")
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _ns_like_dpopt)
    torch.manual_seed(0)
    shapes = [(16, 8), (8, 24), (12, 12)]
    ours = [nn.Parameter(torch.randn(*s)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = make_optimizer(
        "dp-muon",
        ours,
        noise_multiplier=0.0,
        expected_batch_size=4,
        sample_rate=1.0,
        max_grad_norm=1e12,
        label_fn=lambda p: "muon",
    )
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True, adjust_lr_fn="original")
    start = [p.detach().clone() for p in ours]
    for _ in range(5):
        per_sample = [torch.randn(4, *s) for s in shapes]
        opt.step(PerSampleGrads(per_sample))
        for q, g in zip(theirs, per_sample):
            q.grad = g.mean(0)
        ref.step()
    for p, q, s in zip(ours, theirs, start):
        moved = float((p - s).detach().abs().max())
        assert moved > 1e-3
        assert float((p - q).detach().abs().max()) < 1e-6 * max(moved, 1.0)


class TinyViT(nn.Module):
    """A ViT's parameter order: class token, position table, patch conv, a hidden linear, the head."""

    def __init__(self, d=8, patches=4):
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.position_embeddings = nn.Parameter(torch.zeros(1, patches + 1, d))
        self.patch = nn.Conv2d(3, d, kernel_size=4, stride=4)
        self.fc, self.head = nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x):
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls_token.expand(len(x), -1, -1), t], 1) + self.position_embeddings
        return self.head(torch.tanh(self.fc(t))[:, 0])


def test_a_vits_class_token_and_position_table_are_embeddings_and_its_patch_conv_is_the_first_conv():
    model = TinyViT()
    labels = dict(zip([n for n, _ in model.named_parameters()], hidden_matrix_labels(model).labels))
    # the [1, 1, D] / [1, T, D] tables are added, not multiplied: not hidden matrices, and not "the first weight"
    # either, so the input-facing patch conv is the first weight and is excluded as the first conv
    assert labels == {
        "cls_token": "other",
        "position_embeddings": "other",
        "patch.weight": "other",
        "patch.bias": "other",
        "fc.weight": "muon",
        "fc.bias": "other",
        "head.weight": "other",
        "head.bias": "other",
    }
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 3)
