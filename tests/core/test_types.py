"""Core types (dpopt.types): one definition, re-exported by transforms; sources satisfy PerSampleSource."""

import torch
from torch import nn

import dpopt
import dpopt.transforms as transforms
import dpopt.transforms.base as base
from dpopt.engine import fast_per_sample_gradients, iter_per_sample_sources
from dpopt.engine.reference import PerSampleGrads, per_sample_gradients
from dpopt.optim import _Reordered
from dpopt.types import ClipGeometry, EvaluationPoint, PerSampleSource


def test_one_definition_re_exported():
    assert transforms.ClipGeometry is base.ClipGeometry is dpopt.ClipGeometry is ClipGeometry
    assert transforms.EvaluationPoint is base.EvaluationPoint is EvaluationPoint
    assert "ClipGeometry" in transforms.__all__ and "EvaluationPoint" in base.__all__


def _model_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return model, torch.randn(5, 3), torch.randint(0, 2, (5,))


def test_engine_sources_satisfy_the_protocol():
    model, x, y = _model_batch()
    ce = nn.functional.cross_entropy
    sources = [
        per_sample_gradients(model, ce, x, y),
        fast_per_sample_gradients(model, ce, x, y),
        *iter_per_sample_sources(model, ce, x, y, 2, engine="reference"),
        PerSampleGrads([torch.ones(3, 2)]),
    ]
    for src in sources:
        assert isinstance(src, PerSampleSource), type(src).__name__
    src = sources[0]
    assert src.batch_size == 5 and src.num_params == 4 and src.nonfinite == 0
    assert src.params == tuple(model.parameters()) and src.points == (EvaluationPoint(1.0),)
    sq = src.sq_norms(ClipGeometry(), [0, 0, 1, 1], 2)
    assert sq.shape == (5, 2)
    sums = src.weighted_sum(torch.ones(5, 2), ClipGeometry(), [0, 0, 1, 1])
    assert [s.shape for s in sums] == [p.shape for p in model.parameters()]


def test_reordered_source_keeps_the_protocol():
    model, x, y = _model_batch()
    src = per_sample_gradients(model, nn.functional.cross_entropy, x, y)
    view = _Reordered(src, [3, 2, 1, 0])
    assert isinstance(view, PerSampleSource)
    assert view.params == tuple(reversed(src.params)) and view.batch_size == 5 and view.points == src.points


def test_something_else_is_not_a_source():
    assert not isinstance(torch.ones(3), PerSampleSource)
    assert not isinstance([torch.ones(3)], PerSampleSource)
