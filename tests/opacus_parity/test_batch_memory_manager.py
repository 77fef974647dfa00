"""BatchMemoryManager: one Poisson logical batch in physical chunks, ONE release per logical batch (item 4).

Ports Opacus's batch_memory_manager_test: chunks never exceed the physical
size, and training through the manager equals training on the whole logical
batches (Opacus checks this at σ = 0; here also at σ = 1 with the same
reproducible noise, since the noise is drawn once per logical step).
"""

from __future__ import annotations

import math

import pytest
import torch
from opacus_setup import private

from dpopt.utils.batch_memory_manager import BatchMemoryManager, BatchSplittingSampler


def _params(m):
    return torch.cat([p.detach().flatten() for p in m.parameters()])


def _train(optimizer="sgd", physical=None, epochs=2, sigma=0.0, **kw):
    if optimizer == "sgd":
        engine, m, opt, loader = private(noise_multiplier=sigma, max_grad_norm=0.5, **kw)
    else:
        from opacus_setup import data, model

        import dpopt

        engine = dpopt.PrivacyEngine()
        m = model()
        gen = torch.Generator().manual_seed(1)
        with pytest.warns(UserWarning, match="noise_generator"):
            m, opt, loader = engine.make_private(
                module=m,
                optimizer=optimizer,
                lr=0.05,
                data_loader=torch.utils.data.DataLoader(data(), batch_size=16),
                noise_multiplier=sigma,
                max_grad_norm=0.5,
                noise_generator=gen,
            )
    crit = torch.nn.CrossEntropyLoss()
    sizes = []
    for _ in range(epochs):
        if physical is None:
            batches = loader
        else:
            manager = BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=opt)
            batches = manager.__enter__()
        for x, y in batches:
            sizes.append(len(x))
            opt.zero_grad()
            crit(m(x), y).backward()
            opt.step()
    return engine, m, sizes


@pytest.mark.parametrize("sigma", [0.0, 1.0])
@pytest.mark.parametrize("optimizer", ["sgd", "dp-adam"])
def test_chunks_of_one_logical_batch_equal_the_whole_batch(sigma, optimizer):
    whole, m_whole, big = _train(optimizer, None, sigma=sigma)
    split, m_split, small = _train(optimizer, 3, sigma=sigma)
    assert max(small) <= 3 and sum(small) == sum(big)  # the same examples, in chunks of at most 3
    assert len(small) == sum(max(1, math.ceil(b / 3)) for b in big)
    assert len(split.ledger) == len(whole.ledger) == 8  # one release per logical batch
    torch.testing.assert_close(_params(m_split), _params(m_whole), rtol=1e-5, atol=1e-6)


def test_a_skipped_step_changes_nothing_and_releases_nothing():
    engine, m, opt, loader = private()
    x, y = next(iter(loader))
    before = _params(m)
    opt.signal_skip_step(do_skip=True)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x[1:]), y[1:]).backward()  # chunks of disjoint examples
    opt.step()
    assert len(engine.ledger) == 0 and torch.equal(_params(m), before) and opt._is_last_step_skipped
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x[:1]), y[:1]).backward()
    opt.step()  # the end of the logical batch: one release of both chunks
    assert len(engine.ledger) == 1 and not torch.equal(_params(m), before)


class _Signals:
    def __init__(self):
        self.calls = []

    def signal_skip_step(self, do_skip=True):
        self.calls.append(do_skip)


def test_splitting_sampler_chunks_and_signals_as_opacus():
    opt = _Signals()
    sampler = BatchSplittingSampler(sampler=[[0, 1, 2, 3, 4], [], [5]], max_batch_size=2, optimizer=opt)
    assert list(sampler) == [[0, 1], [2, 3], [4], [], [5]]
    assert opt.calls == [True, True, False, False, False]  # an empty logical batch is one (noise) step


def test_refusals():
    with pytest.raises(ValueError, match=">= 1"):
        BatchSplittingSampler(sampler=[], max_batch_size=0, optimizer=_Signals())
    with pytest.raises(ValueError, match="make_private"):
        BatchSplittingSampler(sampler=[], max_batch_size=4, optimizer=torch.optim.SGD([torch.zeros(1)], lr=1))


def test_len_estimates_from_the_expected_batch_size():
    _, _, opt, loader = private(batch_size=16)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=5, optimizer=opt) as chunks:
        assert len(chunks) == 4 * math.ceil(16 / 5)


def test_opacus_own_batch_memory_manager_drives_dpopt_optimizer():
    bmm = pytest.importorskip("opacus.utils.batch_memory_manager")
    engine, m, opt, loader = private(noise_multiplier=0.0)
    with bmm.BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=opt) as chunks:
        for x, y in chunks:
            assert len(x) <= 3
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    assert len(engine.ledger) == len(loader)
