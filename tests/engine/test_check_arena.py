"""The dp-sgd door's first-batch check runs on its own glibc arena (issue 34, LoRA memory) and decides as inline.

docs/performance.md, "LoRA memory: glibc's heap modes": the check's passes at 9/8 of the batch grew the main
heap beyond the step's own extent and left live blocks through it; run on a short-lived thread, glibc serves
them from another arena (``dpopt.allocator.in_own_arena``). What is asserted here is the mechanism (the
check runs on another thread, once) and that nothing computed changes; the memory figures are measurements
(benchmarks/transformer_step.py --memory-child), not test assertions.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import dpopt.engine.fast as fast
from dpopt import allocator
from dpopt.engine.fast import PerSampleEngine
from dpopt.types import ClipGeometry


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _norms_and_sum(monkeypatch, inline: bool):
    idents: list = []
    raw = PerSampleEngine._verify

    def spy(self, *a, **k):
        idents.append(threading.get_ident())
        return raw(self, *a, **k)

    monkeypatch.setattr(PerSampleEngine, "_verify", spy)
    if inline:
        monkeypatch.setattr(fast, "in_own_arena", lambda fn, *a, **k: fn(*a, **k))
    model, (x, y) = _model(), _batch()
    engine = PerSampleEngine(model, lambda o, t: torch.nn.functional.cross_entropy(o, t, reduction="sum"))
    out, forms = [], {}
    for _ in range(2):  # the second batch is not checked again
        src = engine.compute(x, y)
        groups = [0] * src.num_params
        out.append([src.sq_norms(ClipGeometry(), groups, 1).clone()])
        out[-1] += [g.clone() for g in src.weighted_sum(torch.ones(8, 1), ClipGeometry(), groups)]
        forms = dict(src.forms())
        src.free()
    return idents, out, forms


@pytest.mark.skipif(allocator._glibc_trim() is None, reason="no glibc: the check runs inline")
def test_the_check_runs_once_on_another_thread_and_the_sums_are_unchanged(monkeypatch):
    idents, sums, forms = _norms_and_sum(monkeypatch, inline=False)
    assert len(idents) == 1 and idents[0] != threading.get_ident()
    with monkeypatch.context() as m:
        idents0, sums0, forms0 = _norms_and_sum(m, inline=True)
    assert idents0 == [threading.get_ident()]
    assert forms == forms0
    for step, step0 in zip(sums, sums0):
        assert all(torch.equal(a, b) for a, b in zip(step, step0))
    # the sum of the 8 examples' gradients of the last layer's bias: the softmax minus the one-hot rows
    model, (x, y) = _model(), _batch()
    p = torch.softmax(model(x), 1) - torch.nn.functional.one_hot(y, 3)
    torch.testing.assert_close(sums[0][-1], p.sum(0).detach(), rtol=1e-5, atol=1e-6)
    # and each example's squared norm of that bias's gradient is a part of its total (all parameters)
    assert bool((sums[0][0].flatten() >= (p**2).sum(1).detach() - 1e-6).all())
