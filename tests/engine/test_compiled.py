"""The compiled capture (``compile=``, :mod:`dpopt.engine.compiled`) against the eager one.

Tolerance: float32, relative 2e-5 of each quantity's scale. The compiled graph runs the same aten
kernels (``aot_eager``) or fused C++ kernels (``inductor``) that may reassociate sums: differences of a
few float32 ulps (≈ 1e-7 relative) per reduction, far below 2e-5 for these sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dpopt.engine import iter_per_sample_sources
from dpopt.engine.fast import PerSampleEngine
from dpopt.methods import make_optimizer
from dpopt.types import ClipGeometry

RTOL = 2e-5


def loss_fn(out, target):
    return nn.functional.cross_entropy(out, target)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16, 3),
    )


def pooled_cnn():
    """A CNN that takes any image size (adaptive pooling): a new input shape compiles a new graph."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 3),
    )


def data(model_name: str, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (12,) if model_name == "mlp" else (3, 8, 8)
    return torch.randn(n, *shape, generator=g), torch.randint(0, 3, (n,), generator=g)


def norms_and_sum(src, seed: int):
    k = src.num_params
    sq = src.sq_norms(ClipGeometry(), [0] * k, 1)[:, 0]
    w = torch.rand(src.batch_size, 1, generator=torch.Generator().manual_seed(seed))
    return sq, src.weighted_sum(w, ClipGeometry(), [0] * k)


def close(a, b) -> bool:
    return bool((a - b).abs().max() <= RTOL * b.abs().max() + 1e-12)


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_compiled_norms_and_clipped_sum_equal_eager(model_name):
    """Per-example squared norms and Σ_i w_i g_i of the compiled capture = the eager capture's, at several
    Poisson-like batch sizes, with ONE compiled graph for all of them (the batch axis is dynamic)."""
    build = mlp if model_name == "mlp" else cnn
    eager_model, comp_model = build(), build()
    eng = PerSampleEngine(comp_model, loss_fn, compile="aot_eager")
    for step, n in enumerate((11, 7, 13)):
        x, y = data(model_name, n, step)
        ref = next(iter_per_sample_sources(eager_model, loss_fn, x, y))
        got = eng.compute(x, y)
        sq_ref, sum_ref = norms_and_sum(ref, step)
        sq, sums = norms_and_sum(got, step)
        assert close(sq, sq_ref)
        assert all(close(a, b) for a, b in zip(sums, sum_ref))
        assert float(sq.min()) > 0  # real gradients, not zeros that would agree trivially
    assert eng._compiled.compiles == 1


def test_sigma_zero_step_equals_eager():
    """σ = 0: one DP-SGD step through the compiled capture moves the parameters as the eager one does."""
    a, b = cnn(), cnn()
    x, y = data("cnn", 9, 0)
    after = []
    for model, comp in ((a, False), (b, "aot_eager")):
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer("dp-sgd", params, noise_multiplier=0.0, expected_batch_size=9.0, sample_rate=0.1, lr=0.5)
        opt.step(iter_per_sample_sources(model, loss_fn, x, y, compile=comp))
        after.append([p.detach().clone() for p in params])
    moved = [pa - p0 for pa, p0 in zip(after[0], cnn().parameters())]
    assert max(float(m.abs().max()) for m in moved) > 1e-3  # the step did something
    for pe, pc in zip(*after):
        assert torch.allclose(pe, pc, rtol=RTOL, atol=1e-7)


def scaling_backend(gm, example_inputs):
    """A deliberately wrong compiled kernel: the recorded input of every layer comes out 1 % too large."""

    def run(*args):
        outs = gm(*args)
        return (outs[0],) + tuple(o * 1.01 for o in outs[1:])

    return run


def test_first_batch_check_catches_a_wrong_compiled_kernel():
    model = cnn()
    eng = PerSampleEngine(model, loss_fn, compile="aot_eager")
    eng._compiled._real = scaling_backend  # the graph compiled from now on is wrong
    x, y = data("cnn", 9, 0)
    with pytest.warns(RuntimeWarning), pytest.raises(ValueError, match="compile=True: the first-batch check"):
        eng.compute(x, y)


def test_a_new_graph_is_checked_at_its_batch():
    """A graph compiled after the first batch's check (here: a new image size) is checked at that batch
    before its results are used; a new batch size, or one example (run eagerly: no size-specialised graph,
    whose kernels inductor would cache on disk with the size in them), compiles nothing."""
    torch._dynamo.reset()  # dynamo's shape history of earlier tests could make the image axes dynamic already
    model = pooled_cnn()
    eng = PerSampleEngine(model, loss_fn, compile="aot_eager")
    x, y = data("cnn", 9, 0)
    eng.compute(x, y)
    assert eng._compiled.compiles == 1
    eng._compiled._real = scaling_backend  # the next graph compiled is wrong
    eng.compute(x[:5], y[:5])  # the same (dynamic) graph: nothing new to check
    eng.compute(x[:1], y[:1])  # eager
    assert eng._compiled.compiles == 1
    with pytest.warns(RuntimeWarning), pytest.raises(ValueError, match="compile=True"):
        eng.compute(torch.randn(9, 3, 10, 10), y)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        return self.a(x) if float(x.sum()) > 0 else self.b(x)  # data-dependent control flow


def test_data_dependent_control_flow_is_refused():
    x, y, model = torch.randn(6, 4), torch.randint(0, 3, (6,)), Branchy()
    with pytest.raises(ValueError, match="cannot trace this model's forward as one graph"):
        next(iter_per_sample_sources(model, loss_fn, x, y, compile="aot_eager"))


def test_tapped_layers_and_bad_arguments_are_refused():
    lstm = nn.LSTM(4, 3, batch_first=True)
    with pytest.raises(ValueError, match="compile=True: layers whose rule taps"):
        PerSampleEngine(lstm, loss_fn, compile="aot_eager")
    with pytest.raises(ValueError, match="unchecked"):
        PerSampleEngine(mlp(), loss_fn, compile=True, verify=False)
    with pytest.raises(ValueError, match="backend name"):
        PerSampleEngine(mlp(), loss_fn, compile="tensorrt")
    x, y, model = *data("mlp", 4, 0), mlp()
    with pytest.raises(ValueError, match="engine='fast'"):
        iter_per_sample_sources(model, loss_fn, x, y, engine="reference", compile=True)


def test_compiled_capture_leaves_the_model_as_given():
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    eng = PerSampleEngine(model, loss_fn, compile="aot_eager")
    x, y = data("mlp", 5, 0)
    eng.compute(x, y)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    eng.close()
    assert not any(m._forward_hooks for m in model.modules())


@pytest.mark.slow
def test_inductor_norms_and_clipped_sum_equal_eager():
    """The default backend (inductor: generated C++ kernels) on the tiny CNN; slow (compiles with gcc)."""
    eager_model, comp_model = cnn(), cnn()
    x, y = data("cnn", 10, 1)
    ref = next(iter_per_sample_sources(eager_model, loss_fn, x, y))
    got = next(iter_per_sample_sources(comp_model, loss_fn, x, y, compile=True))
    sq_ref, sum_ref = norms_and_sum(ref, 1)
    sq, sums = norms_and_sum(got, 1)
    assert close(sq, sq_ref)
    assert all(close(a, b) for a, b in zip(sums, sum_ref))


@pytest.mark.slow
def test_train_compiled_equals_eager_with_reproducible_noise(tmp_path):
    """``dpopt train --compile`` (TrainConfig.compile): the same seeded noise and batches give the same model."""
    from dpopt.training import train
    from dpopt.training.config import TrainConfig

    states = []
    for comp in (False, "aot_eager"):
        out = tmp_path / str(comp)
        cfg = TrainConfig(dataset="digits", epochs=0.15, method="dp-sgd", compile=comp, reproducible_noise=True)
        cfg.out = str(out)
        with pytest.warns(UserWarning):  # reproducible noise is research-only: warned
            summary = train(cfg)
        assert summary["steps"] >= 3
        states.append(torch.load(out / "model.pt", weights_only=True))
    sd_e, sd_c = states
    sd_e = sd_e.get("model", sd_e)
    sd_c = sd_c.get("model", sd_c)
    for k, v in sd_e.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            assert torch.allclose(v, sd_c[k], rtol=1e-4, atol=1e-6), k


def test_inductor_options_apply_only_while_the_capture_compiles(monkeypatch):
    """``INDUCTOR_OPTIONS`` are inductor's config while THIS capture's graphs compile (an inductor capture,
    here with its backend swapped for ``aot_eager`` so that no C++ is built), and nowhere else: not after the
    compile, not for another backend's capture; the results still equal eager."""
    from torch._inductor import config

    import dpopt.engine.compiled as compiled

    monkeypatch.setattr(compiled, "INDUCTOR_OPTIONS", {"cpp_wrapper": True})
    real = torch._dynamo.lookup_backend("aot_eager")
    seen: dict = {"inductor": [], "aot_eager": []}
    x, y = data("mlp", 9, 3)
    ref_model = mlp()  # sources and engines hold their models weakly
    ref = next(iter_per_sample_sources(ref_model, loss_fn, x, y))
    for backend in seen:
        model = mlp()
        eng = PerSampleEngine(model, loss_fn, compile=backend)

        def spy(gm, example_inputs, backend=backend):
            seen[backend].append(config.cpp_wrapper)
            return real(gm, example_inputs)

        eng._compiled._real = spy
        got = eng.compute(x, y)
        assert config.cpp_wrapper is False  # not left set after the compile
        (sq, sums), (sq_ref, sum_ref) = norms_and_sum(got, 3), norms_and_sum(ref, 3)
        assert close(sq, sq_ref)
        assert all(close(a, b) for a, b in zip(sums, sum_ref))
    assert seen["inductor"] and all(seen["inductor"])
    assert seen["aot_eager"] and not any(seen["aot_eager"])


@pytest.mark.slow
def test_inductor_cpp_wrapper_equals_eager(monkeypatch):
    """Inductor with ``cpp_wrapper=True`` (measured in docs/performance.md): the same norms and clipped sums."""
    import dpopt.engine.compiled as compiled

    monkeypatch.setattr(compiled, "INDUCTOR_OPTIONS", {"cpp_wrapper": True})
    x, y = data("mlp", 10, 2)
    eager_model, comp_model = mlp(), mlp()  # sources hold their models weakly
    ref = next(iter_per_sample_sources(eager_model, loss_fn, x, y))
    got = next(iter_per_sample_sources(comp_model, loss_fn, x, y, compile=True))
    (sq, sums), (sq_ref, sum_ref) = norms_and_sum(got, 2), norms_and_sum(ref, 2)
    assert close(sq, sq_ref)
    assert all(close(a, b) for a, b in zip(sums, sum_ref))


def test_a_hook_removed_while_compiling_is_retried_after_a_collection(monkeypatch):
    """A process-wide module hook removed mid-compile (a collected PrivacyEngine watch) makes dynamo raise an
    InternalTorchDynamoError from a KeyError on ``_global_forward_hooks``: the capture collects garbage and runs
    the graph once more; any other internal error propagates."""
    import gc

    from dpopt.engine.compiled import CompiledCapture

    model = mlp()
    eng = PerSampleEngine(model, loss_fn, compile="aot_eager")
    x, y = data("mlp", 5, 0)
    eng.compute(x, y)  # builds the capture (and its graph)
    cap = next(v for v in vars(eng).values() if isinstance(v, CompiledCapture))
    real, calls, collected = cap._fn, [], []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:
            try:
                {}[23197]
            except KeyError:
                raise torch._dynamo.exc.InternalTorchDynamoError("KeyError: 23197") from None
        return real(*args)

    monkeypatch.setattr(cap, "_fn", flaky)
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    eager_model = mlp()
    ref = next(iter(iter_per_sample_sources(eager_model, loss_fn, x, y)))
    got = eng.compute(x, y)
    assert len(calls) == 2 and collected == [1]
    geo = ClipGeometry()
    assert torch.allclose(got.sq_norms(geo, [0] * got.num_params, 1), ref.sq_norms(geo, [0] * ref.num_params, 1))

    def broken(*args):
        raise torch._dynamo.exc.InternalTorchDynamoError("AttributeError: something else")

    monkeypatch.setattr(cap, "_fn", broken)
    with pytest.raises(torch._dynamo.exc.InternalTorchDynamoError, match="something else"):
        eng.compute(x, y)
