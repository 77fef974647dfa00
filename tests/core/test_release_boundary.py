"""The release boundary (issue 33, cases 1-3): one release is (a part of) ONE Poisson batch, whatever the loop does.

The σ = 0 sensitivity test in its sharpest form: example i is the one-hot
vector e_i of a bias-free linear model with loss ``out.sum()`` (sum
reduction), so its per-sample gradient is e_i, of norm C = 1 (not clipped),
and every release × the expected batch size is the vector of the examples'
MULTIPLICITIES in it. Removing example i moves that release by m_i · C, so
"sensitivity ≤ C" is "every multiplicity ≤ 1"; the release must also be a
subset of one Poisson batch the sampler drew (never two batches merged).

Doors: the plain loop over make_private's loader and dpopt's
``BatchMemoryManager`` (the DPTrainer door: tests/hf/test_hf_trainer_guarantee.py).
Before this module (main fb334df) the BMM cases released multiplicity 2
(2·C) and K = 1 / K = 4 row mismatches were released under BMM.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import dpopt
from dpopt.data_loader import PoissonBatchSampler
from dpopt.utils.batch_memory_manager import BatchMemoryManager

N = 48


class OneHot(Dataset):
    """Example i: (e_i, 0) in R^N (its gradient under loss out.sum() is e_i)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.eye(N, dtype=torch.float64)[i], torch.tensor(0)


class _Recording(PoissonBatchSampler):
    def __iter__(self):
        for b in super().__iter__():
            self.batches.append(frozenset(b))
            yield b


def _setup(batch_size=12, seed=3, **kw):
    engine = dpopt.PrivacyEngine()
    model = nn.Linear(N, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=sgd,
            data_loader=DataLoader(OneHot(), batch_size=batch_size),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            loss_reduction="sum",
            noise_generator=torch.Generator().manual_seed(seed),
            **kw,
        )
    loader.poisson.__class__ = _Recording
    loader.poisson.batches = []
    releases = []
    ebs = opt.expected_batch_size
    sgd.register_step_pre_hook(lambda o, a, k: releases.append(model.weight.grad.detach().flatten() * ebs))
    return engine, model, opt, loader, releases


def _step(model, opt, x):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


def _assert_each_release_is_part_of_one_batch(releases, drawn, engine):
    assert len(releases) == len(engine.ledger) > 0
    for r in releases:
        m = r.round()
        torch.testing.assert_close(r, m, rtol=0, atol=1e-9)
        # sigma = 0: removing example i moves this release by m_i * C; every m_i <= 1 (at most C)
        assert m.max().item() <= 1.0, f"an example added {m.max().item():.0f} times into one release"
        support = frozenset(torch.nonzero(m).flatten().tolist())
        assert any(support <= b for b in drawn), "a release merged examples of two Poisson batches"


# -- case 1: leaving a BatchMemoryManager loop mid-logical-batch --------------------------
def test_break_mid_logical_batch_closes_the_open_step_as_its_own_release():
    engine, model, opt, loader, releases = _setup()
    forwarded = 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as chunks:
        for i, (x, _) in enumerate(chunks):
            _step(model, opt, x)
            forwarded += len(x)
            if i == 1:  # two physical steps of the first logical batch (of ~12 examples: ~6 chunks)
                break
    assert len(engine.ledger) == 1  # the two chunks, released when the context was left
    assert releases[0].sum().item() == forwarded > 0  # each of their examples once
    for _ in range(2):  # the next epochs: nothing of the first batch is added again
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as chunks:
            for x, _ in chunks:
                _step(model, opt, x)
    assert len(engine.ledger) == 1 + 2 * len(loader)
    _assert_each_release_is_part_of_one_batch(releases, loader.poisson.batches, engine)


def test_break_without_the_context_manager_and_a_new_epoch_never_merge():
    """The chunk iterator itself closes the step when the loop leaves it (no ``with``)."""
    engine, model, opt, loader, releases = _setup()
    manager = BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=opt)
    chunks = manager.__enter__()
    for i, (x, _) in enumerate(chunks):
        _step(model, opt, x)
        if i == 0:
            break
    for x, _ in chunks:  # a new epoch over the same chunked loader
        _step(model, opt, x)
    assert len(engine.ledger) == 1 + len(loader)
    _assert_each_release_is_part_of_one_batch(releases, loader.poisson.batches, engine)


def test_an_exception_leaving_the_context_closes_the_open_step():
    engine, model, opt, loader, releases = _setup()
    with pytest.raises(KeyError):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as chunks:
            for i, (x, _) in enumerate(chunks):
                _step(model, opt, x)
                if i == 2:
                    raise KeyError("the user's loop failed")
    assert len(engine.ledger) == 1 and not opt._open
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as chunks:
        for x, _ in chunks:
            _step(model, opt, x)
    _assert_each_release_is_part_of_one_batch(releases, loader.poisson.batches, engine)


def test_an_exception_caught_inside_the_loop_skips_that_chunk_only():
    engine, model, opt, loader, releases = _setup()
    forwarded = 0
    for _ in range(2):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as chunks:
            for i, (x, _) in enumerate(chunks):
                try:
                    opt.zero_grad()
                    model(x).sum().backward()
                    if i % 3 == 2:
                        raise RuntimeError("a failure between backward and step")
                    opt.step()
                    forwarded += len(x)
                except RuntimeError:
                    continue
    assert len(engine.ledger) == 2 * len(loader)  # still one release per logical batch
    assert sum(r.sum().item() for r in releases) == forwarded
    _assert_each_release_is_part_of_one_batch(releases, loader.poisson.batches, engine)


def test_a_failed_step_discards_its_chunk_and_the_batch_goes_on():
    """An exception inside ``step()`` (here: a refused row count) resets the open step; the signals of later
    chunks are not shifted (before: the failed chunk's queued signal released the tail of one batch with the
    head of the next)."""
    engine, model, opt, loader, releases = _setup()
    for _ in range(2):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as chunks:
            for i, (x, _) in enumerate(chunks):
                if i == 1 and len(x):
                    with pytest.raises(ValueError, match="more rows"):
                        _step(model, opt, torch.cat([x, x[:1]]))
                    continue
                _step(model, opt, x)
    _assert_each_release_is_part_of_one_batch(releases, loader.poisson.batches, engine)


# -- case 2: a skipped chunk (continue) under BatchMemoryManager ----------------------------
@pytest.mark.parametrize("physical", [1, 2])
def test_continue_on_empty_chunks_never_merges_batches(physical):
    """Tiny q: many empty logical batches; the loop skips them (``if len(x) == 0: continue``). Before: 19 of
    192 releases added an example twice; now every release is part of one batch, each example at most once,
    and a skipped batch is still released (pure noise: the number of releases does not depend on the data)."""
    engine, model, opt, loader, releases = _setup(batch_size=1, seed=5)  # q = 1/48: ~37% empty batches
    forwarded = 0
    for _ in range(4):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=opt) as chunks:
            for x, _ in chunks:
                if len(x) == 0:
                    continue
                _step(model, opt, x)
                forwarded += len(x)
    drawn = loader.poisson.batches
    assert sum(1 for b in drawn if not b) > 10  # the loop skipped many empty batches
    assert len(engine.ledger) == len(drawn)  # still one release per logical batch (skipped ones: pure noise)
    assert sum(r.sum().item() for r in releases) == forwarded
    _assert_each_release_is_part_of_one_batch(releases, drawn, engine)


def test_continue_on_a_middle_chunk_adds_the_rest_of_the_batch():
    engine, model, opt, loader, releases = _setup()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as chunks:
        for i, (x, _) in enumerate(chunks):
            if i % 2 == 1:
                continue
            _step(model, opt, x)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as chunks:
        for x, _ in chunks:
            _step(model, opt, x)
    assert len(engine.ledger) == 2 * len(loader)
    _assert_each_release_is_part_of_one_batch(releases, loader.poisson.batches, engine)


def test_plain_loop_continue_on_empty_batches():
    engine, model, opt, loader, releases = _setup(batch_size=1, seed=5)
    for _ in range(2):
        for x, _ in loader:
            if len(x) == 0:
                continue
            _step(model, opt, x)
    _assert_each_release_is_part_of_one_batch(releases, loader.poisson.batches, engine)


# -- case 3: rows vs examples, from the same place on every path -------------------------------
def _forward_twice(x):
    return torch.cat([x, x[:1]]) if len(x) else x


def test_k1_an_example_forwarded_twice_is_refused_in_the_plain_loop_and_under_bmm():
    engine, model, opt, loader, releases = _setup()
    for x, _ in loader:
        if len(x):
            with pytest.raises(ValueError, match="more rows than the data loader's last batch had examples"):
                _step(model, opt, _forward_twice(x))
            break
    refused = 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=opt) as chunks:
        for i, (x, _) in enumerate(chunks):
            if i == 1 and len(x):
                with pytest.raises(ValueError, match="more rows than the data loader's last batch had examples"):
                    _step(model, opt, _forward_twice(x))  # released at 2.0 C before
                refused += 1
                continue
            _step(model, opt, x)
    assert refused == 1
    _assert_each_release_is_part_of_one_batch(releases, loader.poisson.batches, engine)


def test_k4_declared_but_views_not_repeated_is_refused_under_bmm():
    """augmentation_multiplicity=4, the loop forwards each chunk's rows once: 4 different examples would be
    averaged and clipped as one (before: released under BMM). Refused at the logical batch's last chunk,
    nothing released."""
    engine = dpopt.PrivacyEngine()
    model = nn.Linear(N, 1, bias=False).double()
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    ds = OneHot()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=sgd,
            data_loader=DataLoader(ds, batch_size=24),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            loss_reduction="sum",
            augmentation_multiplicity=4,
            noise_generator=torch.Generator().manual_seed(0),
        )
    refused = 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=8, optimizer=opt) as chunks:
        for x, _ in chunks:
            x = x[: len(x) // 4 * 4]
            if len(x) == 0:
                continue
            try:
                _step(model, opt, x)
            except ValueError as e:
                assert "did not carry 4 rows per example" in str(e) and "repeat_views" in str(e)
                refused += 1
    assert refused >= 1 and len(engine.ledger) == 0
    # the same loop with the views repeated: one release per logical batch
    from dpopt.augment import repeat_views

    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=8, optimizer=opt) as chunks:
        for x, _ in chunks:
            _step(model, opt, repeat_views(x, 4))
    assert len(engine.ledger) == len(loader)


def test_a_new_batch_while_a_manual_chunk_is_open_closes_it_first():
    """The signal_skip_step protocol by hand over the plain loader: a skipped step left open when the next
    batch is drawn is released on its own, not merged into the next batch."""
    engine, model, opt, loader, releases = _setup()
    it = iter(loader)
    x, _ = next(it)
    opt.signal_skip_step(True)
    _step(model, opt, x[: len(x) // 2])  # open: half of batch 1
    assert len(engine.ledger) == 0 and opt._open
    x2, _ = next(it)  # batch 2 drawn: batch 1's part is released first
    assert len(engine.ledger) == 1 and not opt._open
    _step(model, opt, x2)
    assert len(engine.ledger) == 2
    _assert_each_release_is_part_of_one_batch(releases, loader.poisson.batches, engine)


def test_a_batch_skipped_entirely_under_bmm_is_released_as_pure_noise():
    engine, model, opt, loader, releases = _setup()
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=opt) as chunks:
        for x, _ in chunks:
            if len(engine.ledger) == 1:  # skip every chunk of the second logical batch
                continue
            _step(model, opt, x)
    assert len(engine.ledger) == len(loader)
    assert sum(1 for r in releases if r.abs().sum() == 0) >= 1  # sigma = 0: the skipped batch released 0
    _assert_each_release_is_part_of_one_batch(releases, loader.poisson.batches, engine)


def test_dpopt_train_door_one_sampled_batch_is_one_privatize_call():
    """dpopt's own loop: one Poisson batch -> ONE ``DPOptimizer.step(sources)`` (begin, its micro-batches,
    release); a micro-batch that raises discards the partial sums, nothing released, and the next batch starts
    a fresh step (never merged)."""
    from dpopt.engine import iter_per_sample_sources
    from dpopt.methods import make_optimizer

    model = nn.Linear(N, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    opt = make_optimizer(
        "dp-sgd",
        list(model.parameters()),
        lr=1.0,
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=6.0,
        sample_rate=0.125,
    )
    x = torch.eye(N, dtype=torch.float64)
    y = torch.zeros(N)

    def loss(out, y):
        return out.sum()

    def failing(sources):
        for i, src in enumerate(sources):
            if i == 1:
                raise RuntimeError("the second micro-batch fails")
            yield src

    with pytest.raises(RuntimeError):
        opt.step(failing(iter_per_sample_sources(model, loss, x[:6], y[:6], 2, opt.evaluation_points())))
    assert len(opt.privatizer.ledger) == 0
    release = opt.step(iter_per_sample_sources(model, loss, x[6:12], y[6:12], 2, opt.evaluation_points()))
    m = (release.grads[0].flatten() * 6.0).round()
    assert len(opt.privatizer.ledger) == 1 and m.max().item() == 1.0 and m.sum().item() == 6.0
    assert set(torch.nonzero(m).flatten().tolist()) == set(range(6, 12))  # nothing of the failed batch
