"""Fast-engine rules registered per layer type (dpopt.engine.rules): lookup, registration, verification."""

import pytest
import torch
from torch import nn

from dpopt.engine import PerSampleEngine
from dpopt.engine.layers import DirectBlock
from dpopt.engine.reference import per_sample_gradients
from dpopt.engine.rules import RULES, LayerCalls, register_rule, rule_for
from dpopt.types import ClipGeometry

DT = torch.float64


@pytest.fixture
def registry():
    """Restore the global rule registry after a test registers its own rules."""
    saved = dict(RULES)
    yield RULES
    RULES.clear()
    RULES.update(saved)


def test_builtin_rules_and_their_conditions():
    assert {nn.Linear, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm} <= set(
        RULES
    )  # + attention, recurrent
    assert rule_for(nn.RMSNorm(4)) is RULES[nn.RMSNorm]
    assert rule_for(nn.Linear(2, 3)) is RULES[nn.Linear]
    assert rule_for(nn.Conv2d(4, 4, 3)) is not None
    assert rule_for(nn.Conv2d(4, 4, 3, groups=2)) is None
    assert rule_for(nn.Embedding(5, 2)) is not None
    assert rule_for(nn.Embedding(5, 2, max_norm=1.0)) is None
    assert rule_for(nn.Embedding(5, 2, scale_grad_by_freq=True)) is None
    assert rule_for(nn.GroupNorm(2, 4)) is not None and rule_for(nn.LayerNorm(4)) is not None
    assert rule_for(nn.ReLU()) is None and rule_for(nn.BatchNorm1d(3)) is None

    class MyLinear(nn.Linear):  # a subclass may change forward: exact types only
        pass

    assert rule_for(MyLinear(2, 3)) is None


def test_register_rule_refuses_duplicates_and_no_type(registry):
    with pytest.raises(ValueError, match="already has a fast rule"):
        register_rule(nn.Linear)(lambda layer: [])
    with pytest.raises(ValueError, match="at least one layer type"):
        register_rule()


class Scale(nn.Module):
    """y = x ⊙ w: per-example weight gradient a_i ⊙ e_i (summed over leading positions)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, dtype=DT))

    def forward(self, x):
        return x * self.weight


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4, dtype=DT), Scale(4), nn.Tanh(), nn.Linear(4, 2, dtype=DT))


def _norms(src, n):
    return src.sq_norms(ClipGeometry(), list(range(n)), n)


def test_a_registered_rule_is_used_and_exact(registry):
    @register_rule(Scale)
    def _scale(layer: LayerCalls) -> list:
        return [DirectBlock([layer.index["weight"]], [sum(a * e for a, e in layer.calls)])]

    model, ce = _model(), nn.functional.cross_entropy
    x, y = torch.randn(6, 3, dtype=DT), torch.randint(0, 2, (6,))
    eng = PerSampleEngine(model, ce)
    assert eng.fallback_names == []  # every parameter has a fast rule, the new one included
    src = eng.compute(x, y)
    assert eng.fallback_names == []  # and it passed the first-batch verification
    ref = per_sample_gradients(model, ce, x, y)
    torch.testing.assert_close(_norms(src, 5), _norms(ref, 5), rtol=1e-9, atol=1e-12)


def test_a_wrong_rule_is_demoted_by_the_verification(registry):
    @register_rule(Scale)
    def _wrong(layer: LayerCalls) -> list:
        return [DirectBlock([layer.index["weight"]], [sum(2 * a * e for a, e in layer.calls)])]

    model, ce = _model(), nn.functional.cross_entropy
    x, y = torch.randn(6, 3, dtype=DT), torch.randint(0, 2, (6,))
    eng = PerSampleEngine(model, ce)
    with pytest.warns(RuntimeWarning, match="do not reproduce"):
        src = eng.compute(x, y)
    assert eng.fallback_names == ["1.weight"]
    ref = per_sample_gradients(model, ce, x, y)
    torch.testing.assert_close(_norms(src, 5), _norms(ref, 5), rtol=1e-9, atol=1e-12)
