"""Release t of a correlated-noise run holds the cyclic batch of step t, whatever the loop does (issue 36 red team).

The sensitivity of the strategy is computed for k = ⌈T/b⌉ participations exactly b steps apart: example i of
batch j may take part in releases j, j + b, j + 2b, … only. The loops below used to break that silently (the
ledger charged the analysed pattern while another ran):

* a batch skipped with ``continue`` (e.g. ``if len(x) == 0: continue`` on an empty balls-in-bins batch): every
  later release moved one batch on, so (b = 4, T = 8) an example took part 3 times, 3 steps apart;
* two ``step()`` calls on one batch: the same examples in two consecutive releases (separation 1);
* ``break`` out of a loader with ``num_workers > 0``: the workers had drawn batches ahead of the loop, the next
  pass started after them (b = 8, T = 8, k = 1: an example took part twice).

Now a skipped batch is released as pure noise when the loop moves on, a second ``step()`` on one batch is refused
with nothing released, and every pass starts at the batch of the next release. Each test records, for every
release, the dataset indices it held (the index is the input's first column) and checks them against the
sampler's fixed parts: release r ⊆ part r mod b.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dpopt import PrivacyEngine
from dpopt.utils.batch_memory_manager import BatchMemoryManager


def _private(n: int = 32, batch: int = 8, epochs: float = 2, mech: str = "banded:4", workers: int = 0, **kw):
    torch.manual_seed(0)
    x = torch.zeros(n, 2)
    x[:, 0] = torch.arange(n, dtype=torch.float32)  # the example's index rides along in column 0
    data = TensorDataset(x, torch.zeros(n, dtype=torch.long))
    return _make_private(DataLoader(data, batch_size=batch, num_workers=workers), mech, epochs, **kw)


def _make_private(loader, mech: str, epochs: float, **kw):
    """make_private of a Linear(2, 2) with DP-SGD over ``loader`` with correlated noise ``mech`` for ``epochs``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine().make_private(
            module=torch.nn.Linear(2, 2),
            optimizer="dp-sgd",
            data_loader=loader,
            lr=0.1,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            noise_mechanism=mech,
            epochs=epochs,
            **kw,
        )


def _parts(loader) -> list[set]:
    sampler = loader.batch_sampler
    parts = sampler.partitions if hasattr(sampler, "partitions") else sampler.batches
    return [set(p) for p in parts]


def _step(model, opt, x, y, held: dict) -> None:
    torch.nn.functional.cross_entropy(model(x), y).backward()
    release = opt.privatizer.steps
    opt.step()
    opt.zero_grad()
    held[release] = {int(i) for i in x[:, 0].tolist()}


def _check_order(loader, opt, held: dict, releases: int) -> None:
    parts = _parts(loader)
    assert opt.privatizer.steps == releases == len(opt.privatizer.ledger)
    for r, ids in held.items():
        assert ids <= parts[r % len(parts)], (r, ids)


@pytest.mark.parametrize("sampling", [{}, {"sampling": "cyclic-poisson", "sample_rate": 0.5}])
def test_a_skipped_batch_is_released_as_noise_and_later_releases_keep_their_batch(sampling):
    """b = 4, T = 8 (cyclic Poisson: b' = 2 parts, 4 steps per pass); the loop skips its second batch. The old code
    released batch 3 at release 2 and so on (separation 3 < b); now release 1 is pure noise (no example), and
    every release r holds examples of part r mod b only, 8 releases in all."""
    model, opt, loader = _private(**sampling)
    held: dict = {}
    seen = 0
    for _ in range(2):
        for x, y in loader:
            seen += 1
            if seen == 2:
                continue
            _step(model, opt, x, y, held)
    assert 1 not in held and sorted(held) == [0, 2, 3, 4, 5, 6, 7]
    _check_order(loader, opt, held, 8)
    assert opt.privatizer.ledger.entries[1].meta["mechanism"] == opt.privatizer.mechanism.kind  # charged


def test_a_second_step_on_one_batch_is_refused_and_releases_nothing():
    """Stepping twice on a batch would put its examples in releases 0 and 1 (separation 1, not b = 4)."""
    model, opt, loader = _private()
    x, y = next(iter(loader))
    held: dict = {}
    _step(model, opt, x, y, held)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="release 2 .* cyclic batch of step 1"):
        opt.step()
    assert opt.privatizer.steps == 1 == len(opt.privatizer.ledger)
    with pytest.raises(RuntimeError, match="release 2 .* cyclic batch of step 1.*repeats a refused step"):
        opt.step()  # again without a new backward: the same refusal, not "without a backward pass"
    assert opt.privatizer.steps == 1 == len(opt.privatizer.ledger)


def test_a_peeked_batch_costs_nothing_and_the_next_pass_hands_it_out_again():
    """``next(iter(loader))`` (a batch looked at, never stepped), then 2 full passes: the old code's passes began at
    step 1, so release r held the batch of step r + 1. Now a pass starts at the batch of the next release: the
    peeked batch 0 is handed out again and released at release 0; 8 releases, nothing extra charged."""
    model, opt, loader = _private()
    next(iter(loader))
    held: dict = {}
    for _ in range(2):
        for x, y in loader:
            _step(model, opt, x, y, held)
    assert sorted(held) == list(range(8))
    _check_order(loader, opt, held, 8)


def test_a_batch_left_by_break_is_handed_out_again_a_skipped_one_is_noise():
    """Pass 1 steps twice and breaks on its third batch (step 2, never stepped); pass 2 skips its first batch (that
    same step-2 batch, handed out again) with ``continue`` and breaks on its second (step 3): step 2 is released as
    pure noise when step 3 is handed out, and step 3's batch, left by the break, opens pass 3 at release 3."""
    model, opt, loader = _private()
    held: dict = {}
    for i, (x, y) in enumerate(loader):
        if i == 2:
            break
        _step(model, opt, x, y, held)
    assert opt.privatizer.steps == 2
    for i, (x, _y) in enumerate(loader):
        assert _parts(loader)[2 if i == 0 else 3] >= {int(v) for v in x[:, 0].tolist()}
        if i == 0:
            continue
        break
    assert opt.privatizer.steps == 3  # step 2: pure noise
    for _ in range(2):
        for x, y in loader:
            if opt.privatizer.steps == 8:
                break
            _step(model, opt, x, y, held)
    assert sorted(held) == [0, 1, 3, 4, 5, 6, 7]
    _check_order(loader, opt, held, 8)


def test_break_with_prefetching_workers_resumes_at_the_next_release():
    """b = 8, one epoch (T = 8, k = 1), ``num_workers=1``: the loop breaks after 2 steps of every pass. The worker
    had drawn up to 2 more batches; the old code's next pass started after them, so by release 8 the sampler was
    at step 16 and examples took part twice. Now every example takes part at most once."""
    model, opt, loader = _private(n=64, batch=8, epochs=1, workers=1)
    held: dict = {}
    for _ in range(4):
        for i, (x, y) in enumerate(loader):
            _step(model, opt, x, y, held)
            if i == 1:
                break
    _check_order(loader, opt, held, 8)
    ids = [i for r in sorted(held) for i in held[r]]
    assert len(ids) == len(set(ids))  # k = 1: nobody twice


def test_batch_memory_manager_break_keeps_the_order():
    """BatchMemoryManager (chunks of 4 of batches of 16, b = 4, T = 8), leaving the context after the first release
    of each pass: the open batch is released, the next pass starts at the next release's batch."""
    model, opt, loader = _private(n=64, batch=16, epochs=2)
    held: dict = {}
    for _ in range(8):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=opt) as chunks:
            pending: set = set()
            for x, y in chunks:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                pending |= {int(i) for i in x[:, 0].tolist()}
                release = opt.privatizer.steps
                opt.step()
                opt.zero_grad()
                if opt.privatizer.steps > release:
                    held[release] = pending
                    break
    _check_order(loader, opt, held, 8)


@pytest.mark.parametrize("sampling", [{}, {"sampling": "cyclic-poisson", "sample_rate": 0.5}])
def test_a_subset_sampler_is_refused_not_replaced_by_batches_over_the_whole_dataset(sampling):
    """``DataLoader(data, sampler=SubsetRandomSampler(first 32 of 64))``: the cyclic batches used to cover all 64
    examples (the 32 held out were trained on, silently); refused now, as Poisson sampling refuses it."""
    from torch.utils.data import SubsetRandomSampler

    data = TensorDataset(torch.randn(64, 2), torch.zeros(64, dtype=torch.long))
    loader = DataLoader(data, batch_size=8, sampler=SubsetRandomSampler(list(range(32))))
    with pytest.raises(ValueError, match="SubsetRandomSampler.*correlated noise_mechanism"):
        _make_private(loader, "banded:2", 1, **sampling)


def test_a_step_on_the_original_loaders_batches_is_refused():
    """Stepping on the user's own (reshuffled every epoch) loader instead of the cyclic one make_private returned:
    its batches carry no cyclic position (an example could be last in one epoch and first in the next,
    separation 1). The old code released them silently; now refused, nothing released."""
    n = 32
    data = TensorDataset(torch.randn(n, 2), torch.zeros(n, dtype=torch.long))
    original = DataLoader(data, batch_size=8, shuffle=True)
    model, opt, _ = _make_private(original, "banded:4", 2)
    x, y = next(iter(original))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="did not hand out"):
        opt.step()
    assert opt.privatizer.steps == 0 == len(opt.privatizer.ledger)


def test_augmentation_multiplicity_makes_one_release_per_cyclic_batch():
    """K = 3 views per example (the loader makes them): each batch of 3·|batch| rows is ONE release of its own
    cyclic batch (b = 4, T = 8: 8 releases, each within part r mod b, the views of one example counted once)."""

    def jitter(rows, generator=None):
        out = rows.clone()
        out[:, 1] += 0.01 * torch.randn(len(rows), generator=generator)  # column 0 (the index) untouched
        return out

    model, opt, loader = _private(augmentation_multiplicity=3, augmentation=jitter)
    held: dict = {}
    rows = 0
    for _ in range(2):
        for x, y in loader:
            rows += len(x)
            _step(model, opt, x, y, held)
    assert rows == 2 * 3 * 32  # 2 epochs, every example once per epoch, 3 views each
    _check_order(loader, opt, held, 8)


def test_a_step_that_fails_leaves_its_batch_owed_and_the_loop_can_go_on(monkeypatch):
    """A ``step()`` that raises inside the per-sample work (simulated out-of-memory at release 3) releases nothing;
    the loop catches it and goes on. Its cyclic batch is released as pure noise when the next batch is handed out,
    so release r still holds part r mod b (the next steps are not refused as misaligned); 8 releases in all."""
    model, opt, loader = _private()
    priv = opt.privatizer
    accumulate, calls = priv.accumulate, {"n": 0}

    def flaky(source):
        calls["n"] += 1
        if priv.steps == 2 and calls["n"] < 100:
            calls["n"] = 100
            raise MemoryError("simulated out of memory")
        return accumulate(source)

    monkeypatch.setattr(priv, "accumulate", flaky)
    held: dict = {}
    failed = 0
    for _ in range(2):
        for x, y in loader:
            try:
                _step(model, opt, x, y, held)
            except MemoryError:
                opt.zero_grad()
                failed += 1
    assert failed == 1 and 2 not in held and sorted(held) == [0, 1, 3, 4, 5, 6, 7]
    _check_order(loader, opt, held, 8)


@pytest.mark.parametrize("sampling", [{}, {"sampling": "cyclic-poisson", "sample_rate": 0.5}])
@pytest.mark.parametrize("skip", [4, 8])
def test_a_skipped_last_batch_of_a_pass_is_released_as_noise_when_the_pass_ends(sampling, skip):
    """b = 4, T = 8 (cyclic Poisson: b' = 2 parts, 4 steps per pass); the loop skips the last batch of pass 1 (step
    4) or of the run (step 8) with ``continue``. The old code released nothing when the pass ended: pass 2 began at
    the batch of the next release, i.e. handed the skipped batch of step 4 out again (trained on at release 3, so
    every later release held the batch of the step before it) and the run ended with 7 releases of 8. Now the pass's
    end releases it as pure noise (charged): release r holds part r mod b only, the skipped step holds no example,
    and pass 2's first batch is the batch of step 5."""
    model, opt, loader = _private(**sampling)
    held: dict = {}
    firsts = []
    seen = 0
    for _ in range(2):
        for i, (x, y) in enumerate(loader):
            seen += 1
            if i == 0:
                firsts.append(opt.privatizer.steps)  # the release the pass's first batch is for
            if seen == skip:
                continue
            _step(model, opt, x, y, held)
    assert firsts == [0, 4] and seen == 8
    assert sorted(held) == [r for r in range(8) if r != skip - 1]
    _check_order(loader, opt, held, 8)
    assert opt.privatizer.ledger.entries[skip - 1].meta["mechanism"] == opt.privatizer.mechanism.kind  # charged


def test_a_failed_step_on_the_last_batch_of_a_pass_is_released_as_noise_when_the_pass_ends(monkeypatch):
    """A ``step()`` raising on the last batch of pass 1 (release 3) releases nothing; the loop catches it and the
    pass ends: that batch is released as pure noise then, so pass 2 starts at step 5's batch; 8 releases."""
    model, opt, loader = _private()
    priv = opt.privatizer
    accumulate = priv.accumulate

    def flaky(source):
        if priv.steps == 3 and not flaky.failed:  # type: ignore[attr-defined]
            flaky.failed = True  # type: ignore[attr-defined]
            raise MemoryError("simulated out of memory")
        return accumulate(source)

    flaky.failed = False  # type: ignore[attr-defined]
    monkeypatch.setattr(priv, "accumulate", flaky)
    held: dict = {}
    for _ in range(2):
        for x, y in loader:
            try:
                _step(model, opt, x, y, held)
            except MemoryError:
                opt.zero_grad()
        assert priv.steps in (4, 8)  # the pass ended with all of its releases made
    assert sorted(held) == [0, 1, 2, 4, 5, 6, 7]
    _check_order(loader, opt, held, 8)


def test_break_mid_pass_then_a_pass_that_skips_its_last_batch():
    """Pass 1 steps once and breaks on its second batch (never stepped: the generator is not resumed, nothing is
    released for it); pass 2 starts at that batch (step 2), steps 2 to 4 and skips its last (step 5): released as
    pure noise at the pass's end; pass 3 starts at step 6 and runs to T = 8 releases."""
    model, opt, loader = _private()
    held: dict = {}
    for i, (x, y) in enumerate(loader):
        if i == 1:
            break
        _step(model, opt, x, y, held)
    assert opt.privatizer.steps == 1
    for x, y in loader:
        if opt.privatizer.steps == 4:
            continue  # step 5's batch, the last of this pass (it runs from step 2 to step 5)
        _step(model, opt, x, y, held)
    assert opt.privatizer.steps == 5 and sorted(held) == [0, 1, 2, 3]  # release 4: pure noise
    for x, y in loader:
        if opt.privatizer.steps == 8:
            break
        _step(model, opt, x, y, held)
    assert sorted(held) == [0, 1, 2, 3, 5, 6, 7]
    _check_order(loader, opt, held, 8)


def test_batch_memory_manager_skipping_the_last_batch_of_a_pass_releases_it_as_noise():
    """BatchMemoryManager (chunks of 8 of batches of 16, b = 4, T = 8): every chunk of the last logical batch of pass 1
    skipped with ``continue``; leaving the chunk iterator releases it as pure noise, pass 2 starts at step 5."""
    model, opt, loader = _private(n=64, batch=16, epochs=2)
    held: dict = {}
    for _ in range(2):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=8, optimizer=opt) as chunks:
            pending: set = set()
            for x, y in chunks:
                release = opt.privatizer.steps
                if release == 3:
                    continue
                torch.nn.functional.cross_entropy(model(x), y).backward()
                pending |= {int(i) for i in x[:, 0].tolist()}
                opt.step()
                opt.zero_grad()
                if opt.privatizer.steps > release:
                    held[release], pending = pending, set()
        assert opt.privatizer.steps in (4, 8)
    assert sorted(held) == [0, 1, 2, 4, 5, 6, 7]
    _check_order(loader, opt, held, 8)
