"""Augmentation multiplicity (dpopt.augment) through dpopt train's door, issue 24.

* crop_flip equals a hand-made crop of the zero-padded image at the drawn offsets (then the drawn flip);
* repeat_views is example-major; ViewsOf + views_loss give per-example gradients equal to the MEAN
  over the example's K views of single-view torch.func gradients;
* micro-batches split examples, never an example's views (chunked sources = one source);
* σ = 0: removing one example (all K of its views) moves the clipped sum by ≤ C;
* ε and the ledger's events of a `train` run with K = 4 equal those of K = 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from recipe_grads import one_hot_grads  # tests/recipe/recipe_grads.py (shared helper)
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from dpopt.augment import ViewBatches, ViewsOf, crop_flip, repeat_labels, repeat_views, views_loss
from dpopt.data import Dataset
from dpopt.engine import iter_per_sample_sources
from dpopt.models import WSConv2d
from dpopt.training import TrainConfig, train
from dpopt.types import ClipGeometry

C = 0.05


def ce(out, target):
    return F.cross_entropy(out, target)


def small_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def test_crop_flip_is_the_drawn_crop_and_flip():
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float64).reshape(2, 3, 6, 6)
    g = torch.Generator().manual_seed(7)
    out = crop_flip(x, torch.Generator().manual_seed(7))
    dy = torch.randint(0, 9, (2,), generator=g)
    dx = torch.randint(0, 9, (2,), generator=g)
    flip = torch.rand(2, generator=g) < 0.5
    xp = F.pad(x, (4, 4, 4, 4))
    for i in range(2):
        want = xp[i, :, dy[i] : dy[i] + 6, dx[i] : dx[i] + 6]
        want = want.flip(-1) if flip[i] else want
        assert torch.equal(out[i], want)
    assert out.shape == x.shape
    many = crop_flip(x.repeat(64, 1, 1, 1), torch.Generator().manual_seed(0))
    assert not all(torch.equal(many[i], many[0]) for i in range(0, 128, 2))  # the draws differ per image
    with pytest.raises(ValueError, match="images"):
        crop_flip(x[0])


def test_repeat_views_is_example_major():
    x = torch.arange(3.0).view(3, 1)
    assert repeat_views(x, 2).flatten().tolist() == [0, 0, 1, 1, 2, 2]
    assert repeat_labels(torch.tensor([5, 6]), 3).tolist() == [5, 5, 5, 6, 6, 6]
    with pytest.raises(ValueError, match="augmentation_multiplicity"):
        repeat_views(x, 0)


def _views(b=5, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 3, 8, 8, generator=g, dtype=torch.float64)
    rows = repeat_views(x, k, crop_flip, g)
    return rows.reshape(b, k, 3, 8, 8), torch.randint(0, 3, (b,), generator=g)


def _mean_view_truth(model, xv, y):
    """Example i: mean over its K views of the single-view gradient (torch.func, one view at a time)."""
    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss(ps, xi, yi):
        return ce(functional_call(model, ps, (xi[None],)), yi[None])

    b, k = xv.shape[:2]
    per_view = vmap(grad(loss), in_dims=(None, 0, 0))(params, xv.reshape(b * k, *xv.shape[2:]), y.repeat_interleave(k))
    return [per_view[n].reshape(b, k, *per_view[n].shape[1:]).mean(1) for n in params]


def test_per_example_gradient_is_the_mean_over_views():
    torch.manual_seed(0)
    model = small_cnn().double().train()
    xv, y = _views()
    wrapped = ViewsOf(model, 3)
    src = next(iter(iter_per_sample_sources(wrapped, views_loss(ce), xv, y, engine="reference")))
    assert src.batch_size == 5  # examples, not views
    got = one_hot_grads(src, torch.float64)
    for g, t in zip(got, _mean_view_truth(model, xv, y)):
        assert torch.allclose(g, t, atol=1e-12)


@pytest.mark.parametrize("physical", [1, 2, 4])
def test_micro_batches_never_split_views(physical):
    torch.manual_seed(1)
    model = ViewsOf(small_cnn().double().train(), 3)
    xv, y = _views(b=5)
    whole = one_hot_grads(
        next(iter(iter_per_sample_sources(model, views_loss(ce), xv, y, engine="reference"))), torch.float64
    )
    chunks = list(iter_per_sample_sources(model, views_loss(ce), xv, y, physical, engine="reference"))
    sizes = [c.batch_size for c in chunks]
    assert sum(sizes) == 5 and max(sizes) <= physical
    parts = [one_hot_grads(c, torch.float64) for c in chunks]
    for j, t in enumerate(whole):
        assert torch.allclose(torch.cat([p[j] for p in parts]), t, atol=1e-12)


def _clipped_sum(model, xv, y):
    src = next(iter(iter_per_sample_sources(model, views_loss(ce), xv, y, engine="reference")))
    n, geo = src.num_params, ClipGeometry()
    w = torch.clamp(C / src.sq_norms(geo, [0] * n, 1)[:, 0].sqrt(), max=1.0).unsqueeze(1)
    return torch.cat([s.flatten() for s in src.weighted_sum(w, geo, [0] * n)])


def test_sigma_zero_removing_one_example_with_all_views_moves_at_most_c():
    torch.manual_seed(2)
    model = ViewsOf(small_cnn().double().train(), 4)
    xv, y = _views(b=6, k=4)
    full = _clipped_sum(model, xv, y)
    moves = []
    for j in range(6):
        keep = torch.tensor([i for i in range(6) if i != j])
        moves.append(float((full - _clipped_sum(model, xv[keep], y[keep])).norm()))
    assert max(moves) <= C * (1 + 1e-9)
    assert min(moves) > 0.5 * C


def test_view_batches_layout_and_reproducible_draws():
    model = small_cnn()
    vb = ViewBatches(model, ce, 3, "crop-flip", seed=5, grouped=False)
    x, y = torch.randn(4, 3, 8, 8), torch.arange(4)
    m1, loss1, xv, yv, kw = vb.batch(x, y, step=2)
    assert isinstance(m1, ViewsOf) and kw == {"engine": "reference"} and xv.shape == (4, 3, 3, 8, 8)
    assert torch.equal(yv, y)
    assert torch.equal(vb.batch(x, y, step=2)[2], xv)  # seeded by (seed, step): resumable
    assert not torch.equal(vb.batch(x, y, step=3)[2], xv)
    grouped = ViewBatches(model, ce, 3, "crop-flip", seed=5, grouped=True).batch(x, y, step=2)
    assert grouped[0] is model and grouped[4] == {"rows_per_example": 3}
    assert torch.equal(grouped[2], xv.reshape(12, 3, 8, 8)) and grouped[3].tolist() == [
        0,
        0,
        0,
        1,
        1,
        1,
        2,
        2,
        2,
        3,
        3,
        3,
    ]
    one = ViewBatches(model, ce, 1, "crop-flip", seed=5).batch(x, y, 0)
    assert one[0] is model and one[2].shape == x.shape and one[4] == {}


@pytest.mark.parametrize(
    "make",
    [
        small_cnn,
        lambda: nn.Sequential(
            WSConv2d(3, 4, 3, padding=1),
            nn.GroupNorm(2, 4),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4, 3),
        ),
    ],
    ids=["conv", "ws-conv"],
)
@pytest.mark.parametrize("physical", [None, 2])
def test_fast_rows_per_example_equals_the_views_path_and_torch_func(make, physical):
    """The fast engine's grouping of K consecutive rows = the wrapper path = mean-of-views torch.func truth."""
    torch.manual_seed(4)
    model = make().double().train()
    xv, y = _views(b=5, k=3)
    rows = xv.reshape(15, 3, 8, 8)
    parts, sizes = [], []
    for src in iter_per_sample_sources(model, ce, rows, repeat_labels(y, 3), physical, rows_per_example=3):
        sizes.append(src.batch_size)  # consumed one at a time (a fast source is freed by the next)
        parts.append(one_hot_grads(src, torch.float64))
    assert sum(sizes) == 5 and (physical is None or max(sizes) <= physical)
    got = [torch.cat(ps) for ps in zip(*parts)]
    for g, t in zip(got, _mean_view_truth(model, xv, y)):
        assert torch.allclose(g, t, atol=1e-10)


def _tiny_cifar(n=64):
    g = torch.Generator().manual_seed(0)
    return Dataset(
        "cifar10",
        torch.randn(n, 3, 32, 32, generator=g),
        torch.randint(0, 10, (n,), generator=g),
        torch.randn(16, 3, 32, 32, generator=g),
        torch.randint(0, 10, (16,), generator=g),
    )


def test_epsilon_and_ledger_identical_to_k1(tmp_path: Path):
    data = _tiny_cifar()
    out = {}
    for k in (1, 4):
        cfg = TrainConfig(
            dataset="cifar10",
            model="cnn5-ws",
            method="dp-sgd",
            batch_size=8,
            epochs=0.25,
            noise_multiplier=1.1,
            augmentation_multiplicity=k,
            ema_decay=0.9,
            physical_batch_size=4,
            out=str(tmp_path / f"k{k}"),
        )
        out[k] = train(cfg, data=data)
    assert out[1]["epsilon"] == out[4]["epsilon"] and out[1]["steps"] == out[4]["steps"] == 2
    ledgers = {k: json.loads((tmp_path / f"k{k}" / "ledger.json").read_text()) for k in out}
    events = {k: [e["event"] for e in ledgers[k]["entries"]] for k in ledgers}
    assert events[1] == events[4]
    assert out[4]["augmentation_multiplicity"] == 4 and out[4]["augment"] == "crop-flip"
    assert "ema_test_accuracy" in out[4] and (tmp_path / "k4" / "model_ema.pt").exists()
    rows = [json.loads(r) for r in (tmp_path / "k4" / "metrics.jsonl").read_text().splitlines()]
    assert all("ema_test_accuracy" in r for r in rows)


def test_identical_views_and_other_datasets_are_refused_with_the_setting_named():
    """K > 1 with augment 'none' would make K identical views (the same clipped gradient at K× the
    cost): refused, naming both settings; augmentation on a dataset other than cifar10 likewise."""
    from dpopt.errors import ConfigError
    from dpopt.training.config import validate_config

    base = dict(dataset="cifar10", model="cnn5-ws", method="dp-sgd", batch_size=8, epochs=1.0, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="identical views") as e:
        validate_config(TrainConfig(**base, augmentation_multiplicity=4, augment="none"), 1000)
    assert set(e.value.arguments) == {"augmentation_multiplicity", "augment"}
    with pytest.raises(ConfigError, match="cifar10 dataset only"):
        validate_config(TrainConfig(**{**base, "dataset": "digits", "model": "mlp"}, augmentation_multiplicity=2), 1000)
    for ok in (dict(augmentation_multiplicity=4, augment="flip"), dict(augmentation_multiplicity=1, augment="none")):
        validate_config(TrainConfig(**base, **ok), 1000)
