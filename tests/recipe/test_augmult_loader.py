"""make_private(..., augmentation_multiplicity=K, augmentation=fn): the returned loader builds the views.

* layout by construction: every batch the loader yields is B·K rows, rows i·K … i·K + K − 1 the
  views of ONE example (traced with examples whose pixels carry their index), labels and any other
  per-example tensor repeated alongside; BatchMemoryManager chunks hold whole examples with all
  their views;
* the same release as the loop that repeats the views itself (σ = 0, a deterministic augmentation);
* σ = 0 sensitivity through this door: removing one example (all K of its views) moves the
  released clipped sum by ≤ C;
* refusals: an unknown name, a non-callable, ``"none"`` with K > 1, a dict batch, a non-tensor
  element; and a loop that repeats the loader's rows again (K² per example) is refused by the batch
  check before any release.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import dpopt
from dpopt.augment import ViewCollate, crop_flip, expand_views, repeat_labels, repeat_views
from dpopt.utils.batch_memory_manager import BatchMemoryManager

K, C = 3, 0.05


def small_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def shift_by_view(rows, generator=None):
    """A deterministic 'augmentation': view v of each example (row index mod K) gets + 0.1·v."""
    v = (torch.arange(rows.shape[0], dtype=rows.dtype) % K).view(-1, *[1] * (rows.dim() - 1))
    return rows + 0.1 * v


def _indexed(n):
    """Example i: every pixel = i (so a row's example is recoverable after a crop/flip: the padding is 0,
    and a 3-pixel crop offset keeps most pixels), label i % 3, weight 10·i."""
    x = torch.arange(n, dtype=torch.float64).view(n, 1, 1, 1).expand(n, 3, 8, 8).clone()
    return TensorDataset(x, torch.arange(n) % 3, 10.0 * torch.arange(n, dtype=torch.float64))


def _private(ds, batch, sigma=1.0, poisson=True, augmentation=crop_flip, k=K, model=None):
    torch.manual_seed(0)
    model = model if model is not None else small_cnn().double().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = dpopt.PrivacyEngine()
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(ds, batch_size=batch),
            noise_multiplier=sigma,
            max_grad_norm=C,
            poisson_sampling=poisson,
            augmentation_multiplicity=k,
            augmentation=augmentation,
        )
    return model, opt, loader, engine


def _check_layout(x, y, w):
    assert x.shape[0] == y.shape[0] == w.shape[0] and x.shape[0] % K == 0
    ids = x.amax(dim=(1, 2, 3)).round().long()  # the crop keeps some pixels of the example: its max is i
    for i in range(0, x.shape[0], K):
        ex = w[i] / 10
        assert torch.all(w[i : i + K] == w[i]) and torch.all(ids[i : i + K] == ex.long())
        assert torch.all(y[i : i + K] == ex.long() % 3)


def test_the_loader_yields_example_major_views_of_whole_examples():
    _, opt, loader, _ = _private(_indexed(40), batch=8)
    seen = 0
    for x, y, w in loader:
        _check_layout(x, y, w)
        seen += x.shape[0]
    assert seen > 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as chunks:
        sizes = []
        for x, y, w in chunks:
            _check_layout(x, y, w)
            sizes.append(x.shape[0])
    assert max(sizes) <= 2 * K and all(s % K == 0 for s in sizes)


def test_views_differ_between_the_copies_of_one_example():
    torch.manual_seed(1)
    x = torch.randn(4, 3, 8, 8)
    rows = expand_views(x, K, crop_flip)
    assert rows.shape == (4 * K, 3, 8, 8)
    assert not torch.equal(rows[0], rows[1]) or not torch.equal(rows[1], rows[2])


def test_release_equals_the_loop_that_repeats_the_views_itself_and_training_steps():
    """σ = 0, a deterministic augmentation, full batch without Poisson sampling: the same parameters."""
    g = torch.Generator().manual_seed(2)
    ds = TensorDataset(
        torch.randn(6, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
    )
    torch.manual_seed(3)
    model0 = small_cnn().double().train()
    m1, o1, l1, _ = _private(
        ds, batch=6, sigma=0.0, poisson=False, augmentation=shift_by_view, model=copy.deepcopy(model0)
    )
    m2, o2, l2, _ = _private(ds, batch=6, sigma=0.0, poisson=False, augmentation=None, model=copy.deepcopy(model0))
    (x1, y1), (x2, y2) = next(iter(l1)), next(iter(l2))
    assert x1.shape[0] == 6 * K and x2.shape[0] == 6
    for model, opt, x, y in ((m1, o1, x1, y1), (m2, o2, repeat_views(x2, K, shift_by_view), repeat_labels(y2, K))):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    moved = [torch.cat([(a - b).flatten() for a, b in zip(m.parameters(), model0.parameters())]) for m in (m1, m2)]
    assert moved[0].abs().max() > 0
    assert torch.allclose(moved[0], moved[1], rtol=1e-9, atol=1e-12)


def test_sigma_zero_removing_one_example_with_all_its_views_moves_at_most_c():
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(6, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
    torch.manual_seed(5)
    model0 = small_cnn().double().train()

    def release(keep):
        model, opt, loader, _ = _private(
            TensorDataset(x[keep], y[keep]),
            batch=len(keep),
            sigma=0.0,
            poisson=False,
            augmentation=shift_by_view,
            model=copy.deepcopy(model0),
        )
        xb, yb = next(iter(loader))
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()  # lr 1: the update is the clipped sum / B̄ (B̄ = the examples here)
        return (
            torch.cat([(a - b).detach().flatten() for a, b in zip(model0.parameters(), model.parameters())])
            * opt.expected_batch_size
        )

    full = release(list(range(6)))
    moves = [float((full - release([i for i in range(6) if i != j])).norm()) for j in range(6)]
    assert max(moves) <= C * (1 + 1e-6) and min(moves) > 0.5 * C


@pytest.mark.parametrize(
    "augmentation, k, error, match",
    [
        ("rotate", K, ValueError, "unknown augmentation 'rotate'"),
        (3.0, K, TypeError, "augmentation must be one of"),
        ("none", K, ValueError, "3 identical views"),
    ],
)
def test_bad_augmentations_are_refused_with_what_to_give(augmentation, k, error, match):
    with pytest.raises(error, match=match):
        _private(_indexed(10), batch=5, augmentation=augmentation, k=k)


class DictData(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {"x": torch.zeros(3, 8, 8), "y": i % 3}


def test_batches_it_cannot_expand_are_refused_with_advice():
    with pytest.raises(TypeError, match="leave augmentation=None"):
        expand_views({"x": torch.zeros(2, 3, 8, 8)}, K, crop_flip)
    with pytest.raises(TypeError, match="element 1 of the batch is list"):
        expand_views([torch.zeros(2, 3, 8, 8), ["a", "b"]], K, crop_flip)
    with pytest.raises(ValueError, match=r"element 1 of the batch is a tensor of shape \(3,\)"):
        expand_views((torch.zeros(2, 3, 8, 8), torch.zeros(3)), K, crop_flip)
    _, _, loader, _ = _private(DictData(), batch=3, poisson=False)
    with pytest.raises(TypeError, match="got dict"):
        next(iter(loader))


def test_repeating_the_loaders_views_again_is_refused_before_any_release():
    model, opt, loader, _ = _private(_indexed(40), batch=8)
    refused = 0
    for x, y, _ in loader:
        if len(y) == 0:
            continue
        opt.zero_grad()
        F.cross_entropy(model(repeat_views(x, K, crop_flip)), repeat_labels(y, K)).backward()  # K² rows each
        with pytest.raises(ValueError, match=r"already yields each example's 3 views") as info:
            opt.step()
        assert set(re.findall(r"\d+", str(info.value))) <= {"3"}  # K only: realised batch sizes are private
        refused += 1
        break
    assert refused == 1 and len(opt.privatizer.ledger) == 0


def test_the_users_loader_is_not_modified_and_one_view_is_allowed():
    ds = _indexed(10)
    user = DataLoader(ds, batch_size=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = small_cnn().double()
        _, _, loader = dpopt.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=user,
            noise_multiplier=1.0,
            max_grad_norm=C,
            poisson_sampling=False,
            augmentation="flip",
        )
    assert loader is not user and not isinstance(user.collate_fn, ViewCollate)
    x, y, w = next(iter(loader))
    assert x.shape == (5, 3, 8, 8) and torch.equal(w, ds.tensors[2][:5])  # K = 1: one (flipped or not) view


def test_a_batch_memory_manager_loop_over_the_views_loader_releases_once_per_logical_batch():
    model, opt, loader, _ = _private(_indexed(40), batch=10)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=opt) as chunks:
        for x, y, _ in chunks:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()  # the batch check sees rows / K = the chunk's examples
    assert len(opt.privatizer.ledger) == len(loader)


def test_k_views_forwarded_without_augmentation_multiplicity_are_refused():
    """The default K = 1 with a loop that repeats each example K times: every row would be clipped as its own
    example (sensitivity K·C); refused before any release, naming augmentation_multiplicity."""
    model, opt, loader, _ = _private(_indexed(40), batch=8, k=1, augmentation=None)
    for x, y, _ in loader:
        if len(y) == 0:
            continue
        opt.zero_grad()
        F.cross_entropy(model(repeat_views(x, K, crop_flip)), repeat_labels(y, K)).backward()
        with pytest.raises(
            ValueError,
            match=r"carried more rows than the data loader's last batch had examples.*"
            r"augmentation_multiplicity=K",
        ) as info:
            opt.step()
        assert re.findall(r"\d+", str(info.value)) == []  # no count: realised batch sizes are private
        break
    assert len(opt.privatizer.ledger) == 0
    for x, y, _ in loader:  # the loader's own rows (or fewer: one dropped) are fine
        opt.zero_grad()
        keep = max(1, len(y) - 1) if len(y) else 0  # an empty Poisson batch (p ≈ 1e-4): forward and backward it
        F.cross_entropy(model(x[:keep]), y[:keep]).backward()
        opt.step()
    x, y, _ = next(iter(loader))  # a new batch handed out (the last one is released: a step on it is refused)
    opt.zero_grad()
    F.cross_entropy(model(x[:0]), y[:0]).backward()  # an empty subset of it, forced: a pure-noise release
    opt.step()
    assert len(opt.privatizer.ledger) == len(loader) + 1


def test_last_step_released_tells_updates_from_chunks_for_schedulers_and_averagers():
    from dpopt.averaging import ParameterAverager
    from dpopt.lr_schedules import make_lr_scheduler

    model, opt, loader, _ = _private(_indexed(40), batch=10)
    sched = make_lr_scheduler(opt, total_steps=len(loader), schedule="cosine", warmup_steps=1)
    ema = ParameterAverager(model, decay=0.9)
    chunks_seen = 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as chunks:
        for x, y, _ in chunks:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            chunks_seen += 1
            if opt.last_step_released:
                sched.step()
                ema.update()
    assert chunks_seen > len(loader)  # several chunks per logical batch (expected 10 examples, chunks of 2)
    assert len(opt.privatizer.ledger) == len(loader) == sched.last_epoch == ema.step
