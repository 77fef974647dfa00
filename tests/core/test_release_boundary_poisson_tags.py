"""Poisson releases hold a batch make_private's loader drew, released once (independent noise, PrivacyEngine door).

Every release is charged in the ledger as a Poisson-subsampled Gaussian step at q. Before this module a
``step()`` on the ORIGINAL DataLoader's batches (shuffled, fixed size: no Poisson sample), a second ``step()``
on one Poisson batch (its examples in two releases), and steps on another loader after one Poisson batch were
all accepted and charged at q. Now they are refused (ValueError, nothing released or charged, parameters as
before), while the loops that step once per batch make_private's loader (or dpopt's / Opacus's
BatchMemoryManager over it) hands out keep working, with one ledger entry per release.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.utils.batch_memory_manager import BatchMemoryManager

N, B = 64, 8


def _data(n=N):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 2, (n,), generator=g))


def _private(batch_size=B, n=N, workers=0, **kw):
    torch.manual_seed(0)
    engine = dpopt.PrivacyEngine()
    model = nn.Linear(5, 2)
    original = DataLoader(_data(n), batch_size=batch_size, shuffle=True, num_workers=workers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=original,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            **kw,
        )
    return engine, model, opt, loader, original


def _backward(model, opt, x, y):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()


def _step(model, opt, x, y):
    _backward(model, opt, x, y)
    opt.step()


def _first(loader, k):
    """The first batch of ``loader`` with at least ``k`` examples (the later batches are not handed out)."""
    for batch in loader:
        if len(batch[0]) >= k:
            return batch
    raise AssertionError("no batch that large in one pass")


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


# -- refused: the probe's cases (all accepted and charged at q before) -------------------------------------


def test_a_step_on_the_original_loaders_batches_is_refused_nothing_released():
    engine, model, opt, _, original = _private()
    before = _params(model)
    x, y = next(iter(original))
    _backward(model, opt, x, y)
    with pytest.raises(ValueError, match="loader make_private returned"):
        opt.step()
    assert len(engine.ledger) == 0 and opt.privatizer.steps == 0
    assert torch.equal(_params(model), before)
    with pytest.raises(ValueError, match="loader make_private returned"):  # repeated: the same refusal
        opt.step()
    for x, y in original:  # a whole epoch of the original loader: every step refused
        _backward(model, opt, x, y)
        with pytest.raises(ValueError, match="no batch of the data loader make_private returned"):
            opt.step()
    assert len(engine.ledger) == 0 and torch.equal(_params(model), before)


def test_a_second_step_on_one_poisson_batch_is_refused():
    engine, model, opt, loader, _ = _private()
    x, y = next(iter(loader))
    _step(model, opt, x, y)
    assert len(engine.ledger) == 1
    after_one = _params(model)
    _backward(model, opt, x, y)  # the same batch again: its examples would be in two releases
    with pytest.raises(ValueError, match="already released"):
        opt.step()
    assert len(engine.ledger) == 1 and torch.equal(_params(model), after_one)


def test_the_original_loader_after_one_poisson_batch_is_refused_from_the_batchs_release_on():
    """One Poisson batch handed out (a loop that breaks at once), then the original loader's batches: at most
    ONE release is made while that batch is current (the step the loader handed it out for); every later step
    is refused instead of charged as another Poisson sample (that one step may also be refused by the
    rows-vs-examples check, when the original batch has more rows than the Poisson batch had examples)."""
    engine, model, opt, loader, original = _private()
    for _ in loader:
        break
    accepted = refused = 0
    for x, y in original:
        _backward(model, opt, x, y)
        try:
            opt.step()
            accepted += 1
        except ValueError as err:
            assert "already released" in str(err) or (accepted == 0 and "more rows" in str(err))
            refused += 1
    assert accepted <= 1 and accepted + refused == len(original)
    assert len(engine.ledger) == accepted


def test_the_original_loader_after_batch_memory_manager_is_refused():
    engine, model, opt, loader, original = _private()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=opt) as chunks:
        for x, y in chunks:
            _step(model, opt, x, y)
    assert len(engine.ledger) == len(loader)
    x, y = next(iter(original))
    _backward(model, opt, x, y)
    with pytest.raises(ValueError, match="loader make_private returned"):
        opt.step()
    assert len(engine.ledger) == len(loader)


def test_opacus_batch_memory_manager_over_the_original_loader_is_refused():
    bmm = pytest.importorskip("opacus.utils.batch_memory_manager")
    engine, model, opt, _, original = _private()
    with bmm.BatchMemoryManager(data_loader=original, max_physical_batch_size=3, optimizer=opt) as chunks:
        x, y = next(iter(chunks))
        _backward(model, opt, x, y)
        with pytest.raises(ValueError, match="loader make_private returned"):
            opt.step()
    assert len(engine.ledger) == 0


# -- accepted: the legitimate loops, one ledger entry per release ------------------------------------------


#: passes of the 8-batch loader at q = 1/8 over N = 8 in the empty-batch loops below. A batch is empty with
#: probability (7/8)^8 = 0.344 and the masks are secret (a new draw every run: torch.manual_seed does not fix
#: them), so no empty batch in 7 x 8 = 56 has probability 0.656^56 = 5.6e-11 per run (at 2 passes, 16 batches,
#: it was 0.656^16 = 1.2e-3) and every batch empty (7/8)^(8 x 56) < 1e-25
EPOCHS = 7


def test_epochs_with_empty_batches_forwarded_release_every_batch():
    engine, model, opt, loader, _ = _private(batch_size=1, n=8)  # q = 1/8, E|batch| = 1: empty batches happen
    sizes = []
    for _ in range(EPOCHS):
        for x, y in loader:
            sizes.append(len(x))
            _step(model, opt, x, y)
    assert len(engine.ledger) == len(sizes) == EPOCHS * len(loader)
    assert 0 in sizes  # fails with probability 5.6e-11 per run (EPOCHS)


def test_continue_on_empty_batches_releases_the_others():
    engine, model, opt, loader, _ = _private(batch_size=1, n=8)
    stepped = 0
    for _ in range(EPOCHS):
        for x, y in loader:
            if len(x) == 0:
                continue
            _step(model, opt, x, y)
            stepped += 1
    assert 0 < stepped < EPOCHS * len(loader) and len(engine.ledger) == stepped  # some skipped: 5.6e-11 (EPOCHS)


def test_break_then_a_new_pass_and_a_peek():
    engine, model, opt, loader, _ = _private()
    next(iter(loader))  # a peek: costs nothing
    for i, (x, y) in enumerate(loader):
        _step(model, opt, x, y)
        if i == 2:
            break
    for x, y in loader:
        _step(model, opt, x, y)
    assert len(engine.ledger) == 3 + len(loader)
    x, y = next(iter(loader))  # a peeked batch may be stepped on once
    _step(model, opt, x, y)
    assert len(engine.ledger) == 4 + len(loader)


def test_a_refused_step_retried_on_the_same_batch_is_accepted():
    engine, model, opt, loader, _ = _private()
    x, y = _first(loader, 1)
    opt.zero_grad()
    nn.functional.cross_entropy(model(torch.cat([x, x])), torch.cat([y, y])).backward()  # rows > examples
    with pytest.raises(ValueError, match="more rows"):
        opt.step()
    assert len(engine.ledger) == 0
    _step(model, opt, x, y)  # the refusal released nothing: the batch is still the current one
    assert len(engine.ledger) == 1


def test_batch_memory_manager_chunks_break_and_new_pass():
    engine, model, opt, loader, _ = _private()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=opt) as chunks:
        for i, (x, y) in enumerate(chunks):
            if len(x) == 0:
                continue  # an empty batch skipped: released as pure noise when the loop moves on
            _step(model, opt, x, y)
            if i == 4:
                break  # the open batch is released as its own step
    first = len(engine.ledger)
    assert first >= 1
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=opt) as chunks:
        for x, y in chunks:
            _step(model, opt, x, y)
    assert len(engine.ledger) == first + len(loader)


def test_manual_signal_skip_step_chunks_of_one_poisson_batch():
    engine, model, opt, loader, _ = _private()
    x, y = _first(loader, 2)
    h = len(x) // 2
    for part, skip in ((slice(0, h), True), (slice(h, None), False)):
        opt.signal_skip_step(skip)
        _step(model, opt, x[part], y[part])
    assert len(engine.ledger) == 1
    opt.signal_skip_step(True)  # another chunk of the released batch: refused
    _backward(model, opt, x[:h], y[:h])
    with pytest.raises(ValueError, match="already released"):
        opt.step()
    assert len(engine.ledger) == 1 and not opt._open


def test_opacus_batch_memory_manager_over_make_privates_loader():
    bmm = pytest.importorskip("opacus.utils.batch_memory_manager")
    engine, model, opt, loader, _ = _private()
    next(iter(loader))  # a stale tag does not stand in the way of the batches Opacus's manager draws
    for _ in range(2):
        with bmm.BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=opt) as chunks:
            for x, y in chunks:
                _step(model, opt, x, y)
    assert len(engine.ledger) == 2 * len(loader)


def test_augmentation_multiplicity_one_release_per_batch():
    def jitter(rows, generator=None):
        return rows + 0.01 * torch.randn(rows.shape, generator=generator)

    engine, model, opt, loader, _ = _private(augmentation_multiplicity=3, augmentation=jitter)
    rows = 0
    for x, y in loader:
        rows += len(x)
        _step(model, opt, x, y)
    assert rows % 3 == 0 and len(engine.ledger) == len(loader)


def test_out_of_order_loader_is_tagged_too():
    engine, model, opt, loader, original = _private()
    loader.in_order = False
    for x, y in loader:
        _step(model, opt, x, y)
    assert len(engine.ledger) == len(loader)
    _backward(model, opt, x, y)
    with pytest.raises(ValueError, match="already released"):
        opt.step()


def test_poisson_sampling_false_keeps_the_users_own_batches():
    """The user's loader (no tags): steps on it are accepted as before (the ledger says the sampling is not
    Poisson), even two on one batch: that loader's epsilon is not claimed."""
    engine, model, opt, loader, original = _private(poisson_sampling=False)
    assert loader is original
    x, y = next(iter(original))
    _step(model, opt, x, y)
    _step(model, opt, x, y)
    assert len(engine.ledger) == 2 and engine.ledger.sampling == "shuffled (not poisson)"


def test_prefetching_workers_break_then_original_loader_refused():
    """num_workers=1 (the sampler draws two batches ahead): the loop's own draws are never counted as drawn
    around the loader, so after `break` the original loader's batches are still refused."""
    engine, model, opt, loader, _ = _private(workers=1)
    for i, (x, y) in enumerate(loader):
        _step(model, opt, x, y)
        if i == 1:
            break
    assert len(engine.ledger) == 2
    x, y = next(iter(DataLoader(_data(), batch_size=B)))
    _backward(model, opt, x, y)
    with pytest.raises(ValueError, match="already released"):
        opt.step()
    assert len(engine.ledger) == 2
