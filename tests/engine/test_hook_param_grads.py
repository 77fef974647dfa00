"""The hook door's backward skips the rule layers' weight-gradient products; its scale is folded into the blocks.

``HookCapture`` records ``(a, e)`` of every rule layer from the user's backward, and ``step()``
drops the backward's ``p.grad`` unread (the release replaces it). So the rule layers' parameters
leave each call's graph (``Recorder(param_grads=False)``): the backward forms no ``p.grad`` for
them, and the per-example gradients are those of single-example autograd all the same. The door's
scale (B for a mean loss) multiplies the blocks' norms and sums (``ScaledBlock``) instead of a copy
of every output gradient. Issue 34, docs/performance.md "The PrivacyEngine door's extra time".
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_hooks import _loop, _per_example
from torch import nn
from torch.utils.checkpoint import checkpoint

from dpopt.engine.hooks import HookCapture
from dpopt.engine.layers import Budget, DirectBlock, FactoredBlock, LinearPart, ScaledBlock, scaled_block
from dpopt.privatizer import Privatizer


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 3))


def test_backward_forms_no_grad_of_rule_layers_fed_by_activations_and_per_example_gradients_are_exact():
    model = _mlp()
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    want = _loop(model, x, y)  # before the hooks
    cap = HookCapture(model)
    nn.functional.cross_entropy(model(x), y).backward()
    # the first Linear's input is data: its output requires a gradient only through its parameters, kept
    assert model[0].weight.grad is not None and model[0].bias.grad is not None
    # LayerNorm and the last Linear are fed by activations: no weight-gradient product, no p.grad
    assert all(p.grad is None for m in (model[1], model[3]) for p in m.parameters())
    assert all(p.requires_grad for p in model.parameters())  # switched off for each call only
    src = cap.collect()
    assert cap.verified
    for g, w in zip(_per_example(src, 6), want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    cap.detach()
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()  # detached: the user's model again
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_layers_get_the_same_graph_when_recomputed(reentrant):
    torch.manual_seed(1)
    model = _mlp()

    class Ckpt(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            h = self.inner[0](x)
            return self.inner[3](checkpoint(lambda t: self.inner[2](self.inner[1](t)), h, use_reentrant=reentrant))

    wrapped = Ckpt(model)
    x, y = torch.randn(5, 5), torch.randint(0, 3, (5,))
    want = _loop(model, x, y)  # the same function, without the checkpoint (autograd.grad refuses a reentrant one)
    cap = HookCapture(wrapped)
    for _ in range(2):  # the first step runs the first-batch check; the second is a steady one
        wrapped.zero_grad()
        nn.functional.cross_entropy(wrapped(x), y).backward()
        for g, w in zip(_per_example(cap.collect(), 5), want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    cap.detach()


def test_a_forward_that_raises_leaves_every_parameter_trainable():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(6, 3))  # the last Linear's width is wrong
    cap = HookCapture(model)
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 5))  # raises inside the last Linear's call, after its parameters were switched off
    assert all(p.requires_grad for p in model.parameters())
    cap.detach()


def test_a_deep_copy_of_the_private_model_forms_its_gradients():
    model = _mlp()
    cap = HookCapture(model)
    ref = copy.deepcopy(model)  # copies the hooks with a copy of the recorder: the copy is the user's plain model
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    nn.functional.cross_entropy(ref(x), y).backward()
    assert all(p.grad is not None for p in ref.parameters())
    cap.detach()


def test_sensitivity_with_the_skipped_products_and_the_folded_scale():
    model = _mlp()
    cap = HookCapture(model)
    torch.manual_seed(2)
    x, y = torch.randn(7, 5) * 10, torch.randint(0, 3, (7,))
    clip = 0.05

    def clipped_sum(xb, yb):
        model.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        priv = Privatizer(0.0, clip, expected_batch_size=1.0, sample_rate=0.5)
        return torch.cat([g.flatten() for g in priv.privatize(cap.collect(), params_like=cap.params).grads])

    full = clipped_sum(x, y)
    for i in range(7):
        keep = [j for j in range(7) if j != i]
        assert float((full - clipped_sum(x[keep], y[keep])).norm()) <= clip * (1 + 1e-4)
    cap.detach()


@pytest.mark.parametrize("scale", [3.0, 0.25])
def test_scaled_block_equals_the_block_of_scaled_output_gradients(scale):
    torch.manual_seed(3)
    b, t, p, q = 4, 6, 5, 3
    a, e = torch.randn(b, t, p, dtype=torch.float64), torch.randn(b, t, q, dtype=torch.float64)
    budget = Budget(1 << 20, 0)
    want = FactoredBlock(0, (q, p), [LinearPart(a, e * scale)], budget, b)
    got = ScaledBlock(FactoredBlock(0, (q, p), [LinearPart(a, e)], Budget(1 << 20, 0), b), scale)
    g = torch.einsum("bto,bti->boi", e * scale, a)  # per-example gradients of the scaled e
    shift, div = torch.randn(q, p, dtype=torch.float64), torch.rand(q, p, dtype=torch.float64) + 0.5
    for geo in [(None, None), (shift, None), (shift, div)]:
        exact = (((g - (geo[0] if geo[0] is not None else 0)) / (geo[1] if geo[1] is not None else 1)) ** 2).sum((1, 2))
        torch.testing.assert_close(got.sq_norms([geo])[0], exact, rtol=1e-12, atol=0)
        torch.testing.assert_close(want.sq_norms([geo])[0], exact, rtol=1e-12, atol=0)
    c = torch.rand(b, dtype=torch.float64)
    torch.testing.assert_close(got.grad_sums([c], None)[0], torch.einsum("b,boi->oi", c, g), rtol=1e-12, atol=0)
    # a direct block's held gradients are multiplied (a copy, never in place: they may be views of e)
    held = torch.randn(b, q, dtype=torch.float64)
    direct = scaled_block(DirectBlock([1], [held]), scale)
    assert type(direct) is DirectBlock and direct.grads[0] is not held
    torch.testing.assert_close(direct.grads[0], held * scale, rtol=0, atol=0)
    assert scaled_block(got, 1.0) is got
    with pytest.raises(ValueError, match="nonzero"):
        ScaledBlock(want, 0.0)
