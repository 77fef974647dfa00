"""Per-example gradients on models where "dim 0 is the example" fails somewhere (issue 9).

For every model kind of tests/engine/per_example_zoo.py and both engines, the
source's per-example squared norms (identity geometry) and its per-example
gradients (weighted sums with one-hot weights) must equal a loop of
single-example autograd within 1e-4 relative — with batch sizes that collide
with a model dimension (B = T) and ones that do not. Models that cannot be
handled must be refused with a ValueError that names the fix.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from per_example_zoo import CASES, DT, ce, loop_grads, make, per_example_from_source, rel_err
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from dpopt.engine import PerSampleEngine, free_sizes, iter_per_sample_sources
from dpopt.engine.check import model_dims
from dpopt.engine.reference import PerSampleGrads, per_sample_gradients
from dpopt.types import EvaluationPoint

T = 5
ENGINES = ("fast", "reference")


def _source(model, x, y, engine, batch_dim=0, **kw):
    return next(iter(iter_per_sample_sources(model, ce, x, y, engine=engine, batch_dim=batch_dim, **kw)))


def _check(src, truth, b):
    assert src.batch_size == b
    sq, grads = per_example_from_source(src, len(truth))
    want_sq = torch.stack([g.flatten(1).square().sum(1) for g in truth], 1)
    assert rel_err([sq], [want_sq]) <= 1e-4
    assert rel_err(grads, truth) <= 1e-4


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("b", [T, 3], ids=["B=T", "B!=T"])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(CASES))
def test_per_example_gradients_equal_single_example_autograd(name, engine, b):
    case = CASES[name]
    model, x, y = make(case, b, T)
    truth = loop_grads(model, ce, x, y, case.batch_dim)
    _check(_source(model, x, y, engine, case.batch_dim), truth, b)
    # a later batch of another size (B = T after B != T and conversely) is still right
    b2 = 3 if b == T else T
    model2_x, model2_y = case.batch(b2, T, torch.Generator().manual_seed(9))
    _check(
        _source(model, model2_x, model2_y, engine, case.batch_dim),
        loop_grads(model, ce, model2_x, model2_y, case.batch_dim),
        b2,
    )


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("engine", ENGINES)
def test_physical_chunks_along_batch_dim(engine):
    case = CASES["seq-first"]
    model, x, y = make(case, 7, T)
    truth = loop_grads(model, ce, x, y, 1)
    srcs = iter_per_sample_sources(model, ce, x, y, physical_batch_size=3, engine=engine, batch_dim=1)
    start = 0
    for src in srcs:
        n = src.batch_size
        _check(src, [g[start : start + n] for g in truth], n)
        start += n
    assert start == 7


@pytest.mark.parametrize("engine", ENGINES)
def test_sequence_first_embedding_gives_n_examples_not_t(engine):
    """Issue 9 item 11: Embedding(16, 16) on x [1, 4, 4] returned 1 example (rel. error 1.99)."""
    torch.manual_seed(0)
    model = nn.Embedding(16, 16).to(DT)

    def loss(out, target):  # out [T=1, 1, 16] for one example
        return (out.squeeze(1) * target).sum()

    x = torch.randint(0, 16, (1, 4))  # sequence-first [T=1, N=4]
    y = torch.randn(4, 16, dtype=DT)
    truth = loop_grads(model, loss, x, y, 1)
    src = next(iter(iter_per_sample_sources(model, loss, x, y, engine=engine, batch_dim=1)))
    _check(src, truth, 4)


@pytest.mark.parametrize("engine", ENGINES)
def test_targets_of_another_length_are_refused_not_cut(engine):
    model, x, y = make(CASES["time-distributed"], 4, T)
    with pytest.raises(ValueError, match="y has 6 along dim 0"):
        list(iter_per_sample_sources(model, ce, x, torch.zeros(6, dtype=torch.long), engine=engine))
    with pytest.raises(ValueError, match="batch_dim=1"):
        list(iter_per_sample_sources(model, ce, x, y, engine=engine, batch_dim=1))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "layer, fix",
    [
        (nn.Embedding(V := 11, 4, max_norm=1.0), "max_norm=None"),
        (nn.Embedding(11, 4, sparse=True), "sparse=False"),
        (nn.EmbeddingBag(11, 4, sparse=True), "sparse=False"),
        (nn.EmbeddingBag(11, 4, max_norm=2.0), "max_norm=None"),
        (nn.BatchNorm1d(4), "GroupNorm"),
    ],
)
def test_refused_layers_name_the_fix(engine, layer, fix):
    model = (
        nn.Sequential(nn.Embedding(11, 4), nn.Flatten(), nn.Linear(12, 3))
        if isinstance(layer, nn.BatchNorm1d)
        else nn.Sequential(layer, nn.Flatten(), nn.Linear(12 if isinstance(layer, nn.Embedding) else 4, 3))
    )
    if isinstance(layer, nn.BatchNorm1d):
        model.append(layer)
    x, y = torch.randint(0, 11, (4, 3)), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match=fix):
        list(iter_per_sample_sources(model, ce, x, y, engine=engine))


@pytest.mark.parametrize("engine", ENGINES)
def test_packed_sequence_input_is_refused_with_advice(engine):
    model = nn.GRU(3, 4, batch_first=True)
    x = pack_padded_sequence(torch.randn(2, 5, 3), torch.tensor([5, 2]), batch_first=True)
    with pytest.raises(ValueError, match="pack_padded_sequence inside the model's forward"):
        list(iter_per_sample_sources(model, ce, x, torch.zeros(2, dtype=torch.long), engine=engine))


def test_fast_engine_moves_layers_whose_dim0_is_not_the_example_and_says_so():
    model, x, y = make(CASES["tok-pos"], 4, T)
    eng = PerSampleEngine(model, ce)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # [1, T] position ids: expanded per example (exact)
        eng.compute(x, y)
    assert eng.fallback_names == []
    model, x, y = make(CASES["transpose-inside"], 4, T)
    eng = PerSampleEngine(model, ce)
    with pytest.warns(RuntimeWarning, match="layer 'lin'.*does not keep the examples along dim 0"):
        eng.compute(x, y)
    # lin sees [T, B, D]: per-example path; the sequence-first encoder layer runs batch-first inside (attention.py)
    assert eng.fallback_names == ["lin.weight", "lin.bias"]


def test_fast_engine_demotes_a_forward_that_mixes_examples():
    model, x, y = make(CASES["mixes-examples"], 6, T)
    eng = PerSampleEngine(model, ce)
    with pytest.warns(RuntimeWarning, match="mixes examples"):
        eng.compute(x, y)
    assert "lin.weight" in eng.fallback_names


def test_verification_sizes_avoid_every_model_dimension():
    assert free_sizes({2, 3, 5, 7}) == [4, 6]
    model, x, y = make(CASES["tok-pos"], 2, 2)  # T = 2 and B = 2 collide with the smallest candidates
    eng = PerSampleEngine(model, ce)
    dims = model_dims(eng.model, (x,))
    assert {2, 3, 7, 11}.issubset(dims)
    assert not set(free_sizes(dims)) & dims


def test_recurrent_models_warn_once_that_the_loop_is_slower():
    model, x, y = make(CASES["gru"], 3, T)
    with pytest.warns(RuntimeWarning, match="exact loop"):
        per_sample_gradients(model, ce, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        per_sample_gradients(model, ce, x, y)  # no second warning


def test_a_model_that_fails_on_one_example_is_a_value_error():
    class Fixed(nn.Module):  # reshapes to a hard-coded batch size
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x).reshape(4, 3)

    x, y = torch.randn(4, 4), torch.zeros(4, dtype=torch.long)
    with pytest.warns(RuntimeWarning), pytest.raises(ValueError, match="one example"):
        per_sample_gradients(Fixed(), ce, x, y)


# ---------------------------------------------------------------- params / points of a source
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("engine", ENGINES)
def test_sources_carry_their_params_and_points(engine):
    model, x, y = make(CASES["shared"], 3, T)
    model.lin.bias.requires_grad_(False)
    src = _source(model, x, y, engine)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(src.params) == len(trainable) and all(a is b for a, b in zip(src.params, trainable))
    assert src.points == (EvaluationPoint(1.0),)
    pts = [EvaluationPoint(2.0), EvaluationPoint(-1.0, tuple(torch.zeros_like(p) for p in trainable))]
    src = _source(model, x, y, engine, points=pts)
    assert len(src.points) == 2 and all(a is b for a, b in zip(src.points, pts))


def test_hand_built_per_sample_grads_have_no_params_unless_given():
    g = [torch.zeros(2, 3)]
    assert PerSampleGrads(g).params is None and PerSampleGrads(g).points is None
    p = nn.Parameter(torch.zeros(3))
    pt = EvaluationPoint(1.0)
    src = PerSampleGrads(g, params=[p], points=[pt])
    assert src.params[0] is p and src.points[0] is pt


# ---------------------------------------------------------------- low precision and autocast
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_give_no_false_warning(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    x, y = torch.randn(5, 6).to(dtype), torch.randint(0, 3, (5,))
    eng = PerSampleEngine(model, ce)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        src = eng.compute(x, y)
    assert eng.fallback_names == []
    truth = loop_grads(model.float(), ce, x.float(), y)
    sq, grads = per_example_from_source(src, 4)
    assert rel_err([g.float() for g in grads], truth) <= 0.1


def test_cpu_bf16_autocast_with_conv2d():
    """oneDNN once crashed on the engine's conv math under autocast; it now runs outside autocast in float32."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3)
    )
    x, y = torch.randn(5, 2, 6, 6), torch.randint(0, 3, (5,))
    truth = loop_grads(model, ce, x, y)
    for engine in ENGINES:
        with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
            warnings.simplefilter("error")
            src = _source(model, x, y, engine)
            sq, grads = per_example_from_source(src, len(truth))
        assert sq.dtype == torch.float32
        assert rel_err(grads, truth) <= 0.1  # bf16 forward; the engine's own math is float32
