"""Logical batches from micro-batches: one release per logical step, equal to the unsplit step.

The Privatizer accumulates clipped sums (and the quantile count) over the
chunks that :func:`dpopt.engine.iter_per_sample_sources` yields lazily; with the
same noise seed, a split step equals an unsplit one to float tolerance.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpopt.data import load_dataset
from dpopt.engine import fast as fast_mod
from dpopt.engine import iter_per_sample_sources
from dpopt.methods import make_optimizer
from dpopt.privatizer import Privatizer, QuantileClipping
from dpopt.training import TrainConfig, train

DT = torch.float64


def ce(out, target):
    return nn.functional.cross_entropy(out, target)


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)
    ).to(DT)


def batch(b: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 1, 6, 6, generator=g, dtype=DT), torch.randint(0, 5, (b,), generator=g)


@pytest.mark.parametrize("engine", ["fast", "reference"])
@pytest.mark.parametrize("quantile", [False, True])
def test_split_step_equals_unsplit_step_and_records_one_event(engine, quantile):
    x, y = batch(11)
    out = []
    for physical in (None, 4, 1):
        model = small_cnn()
        priv = Privatizer(
            1.1,
            0.5,
            expected_batch_size=10.0,
            sample_rate=0.01,
            quantile=QuantileClipping(2.0) if quantile else None,
            generator=torch.Generator().manual_seed(7),
        )
        rel = priv.privatize(
            iter_per_sample_sources(model, ce, x, y, physical, engine=engine), params_like=list(model.parameters())
        )
        assert len(priv.ledger) == 1 and priv.releases == (2 if quantile else 1)
        out.append((rel, priv.bounds))
    (ref, ref_bounds), *split = out
    for rel, bounds in split:
        for a, b in zip(rel.grads, ref.grads):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
        assert bounds == pytest.approx(ref_bounds, rel=1e-12)


def test_macadam_geometry_split_equals_unsplit_over_steps():
    x, y = batch(9)
    finals = []
    for physical in (None, 2):
        model = small_cnn()
        opt = make_optimizer(
            "dp-macadam",
            model.parameters(),
            noise_multiplier=1.0,
            expected_batch_size=9.0,
            sample_rate=0.1,
            generator=torch.Generator().manual_seed(3),
            lr=1e-2,
            h1=1e-6,
            h2=1.0,
        )
        for _ in range(3):
            opt.step(iter_per_sample_sources(model, ce, x, y, physical, opt.evaluation_points()))
        assert len(opt.privatizer.ledger) == 3
        finals.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*finals):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)


def test_chunks_are_produced_lazily_and_freed(monkeypatch):
    model = small_cnn()
    x, y = batch(10)
    made = []
    real = fast_mod.PerSampleEngine.compute

    def counting(self, xs, ys, points=None, batch_dim=0):
        src = real(self, xs, ys, points, batch_dim)
        made.append(src)
        return src

    monkeypatch.setattr(fast_mod.PerSampleEngine, "compute", counting)
    it = iter_per_sample_sources(model, ce, x, y, physical_batch_size=3)
    assert made == []  # nothing computed before the first chunk is asked for
    first = next(it)
    assert len(made) == 1 and first.batch_size == 3
    second = next(it)
    assert len(made) == 2 and second.batch_size == 3
    with pytest.raises(RuntimeError, match="freed"):
        first.sq_norms(fast_mod.ClipGeometry(), [0] * first.num_params, 1)  # released on advance
    rest = [s.batch_size for s in it]
    assert rest == [3, 1]


def test_empty_logical_batch_still_released_once():
    model = small_cnn()
    x, y = batch(0)
    priv = Privatizer(1.0, 1.0, expected_batch_size=4.0, sample_rate=0.1, generator=torch.Generator().manual_seed(0))
    sources = list(iter_per_sample_sources(model, ce, x, y, physical_batch_size=3))
    assert len(sources) == 1 and sources[0].batch_size == 0
    rel = priv.privatize(
        iter_per_sample_sources(model, ce, x, y, physical_batch_size=3), params_like=list(model.parameters())
    )
    assert len(priv.ledger) == 1
    # pure noise / B̄: std σC/B̄ = 0.25 per coordinate; nonzero and finite
    flat = torch.cat([g.flatten() for g in rel.grads])
    assert torch.isfinite(flat).all() and 0.15 < float(flat.std()) < 0.35


def test_physical_batch_size_must_be_positive():
    model = small_cnn()
    x, y = batch(4)
    with pytest.raises(ValueError, match="physical_batch_size"):
        iter_per_sample_sources(model, ce, x, y, physical_batch_size=0)  # refused before any work


def test_engine_cache_does_not_keep_models_alive():
    import gc
    import weakref

    model = small_cnn()
    x, y = batch(3)
    list(iter_per_sample_sources(model, ce, x, y))
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


@pytest.mark.filterwarnings("ignore:reproducible_noise")
def test_train_with_physical_batches_equals_unsplit(tmp_path):
    data = load_dataset("digits")
    runs = []
    for physical in (None, 16):
        cfg = TrainConfig(
            dataset="digits",
            method="dp-sgd",
            batch_size=64,
            epochs=0.15,
            seed=3,
            physical_batch_size=physical,
            out=str(tmp_path / f"run{physical}"),
            reproducible_noise=True,
        )  # same noise in both runs: research mode
        summary = train(cfg, data)
        state = torch.load(tmp_path / f"run{physical}" / "model.pt")
        runs.append((summary, state))
    (s0, w0), (s1, w1) = runs
    assert s0["steps"] == s1["steps"] >= 3 and s0["privatizer_releases"] == s1["privatizer_releases"] == s0["steps"]
    for k in w0:
        assert torch.allclose(w0[k], w1[k], rtol=1e-5, atol=1e-6)
    assert s0["test_accuracy"] == s1["test_accuracy"]
