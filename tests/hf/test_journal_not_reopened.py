"""``dpopt.hf.distributed.journal_not_reopened`` is not redundant with the engine's rank-0 journal rule.

The engine's rule (``LedgerKeeper.check_main``; ``adopt`` opens a recorded journal only on rank 0) stops a
rank > 0 from WRITING rank 0's journal. The DPTrainer's context manager also keeps a rank > 0 from READING it
while loading a checkpoint: the file is rank 0's (on a multi-node run it may be absent, or another file, at
that path on this node; rank 0 may be appending to it in ``open_journal`` at that moment), and the rank takes
rank 0's ledger afterwards anyway (``share_ledger``). One process plays rank 1 here (its engine's keeper told
so, as ``make_private(..., distributed=True)`` does): loading a state whose journal holds a later release
reads it (and warns) without the context manager, and leaves it alone with it; the journal is never written.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.distributed import DistributedContext
from dpopt.hf.distributed import journal_not_reopened


def _private(rank: int = 0):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    engine = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    engine._keeper.rank, engine._keeper.world_size = rank, 2  # what make_private(distributed=True) sets
    return engine, model, opt, loader


def _step(model, opt, loader) -> None:
    x, y = next(iter(loader))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _saved_state_and_longer_journal(tmp_path):
    """Rank 0: a state saved after 1 release; its journal then holds 2 (the second made after the save)."""
    engine, model, opt, loader = _private()
    journal = tmp_path / "ledger.jsonl"
    engine.open_journal(journal)
    _step(model, opt, loader)
    state = opt.state_dict()
    _step(model, opt, loader)
    assert len(engine.ledger) == 2 and state["dpopt"]["journal"] == str(journal.resolve())
    return state, journal


def test_rank_1_reads_the_journal_without_it_and_not_with_it(tmp_path):
    state, journal = _saved_state_and_longer_journal(tmp_path)
    lines = journal.read_text()

    engine, _, opt, _ = _private(rank=1)  # the engine's rule alone: reads rank 0's journal (never writes it)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.load_state_dict(state)
    assert len(engine.ledger) == 2 and engine._keeper.journal is None
    assert any("stay charged" in str(w.message) for w in seen)

    engine, _, opt, _ = _private(rank=1)  # with the DPTrainer's context manager: the journal is not read
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with journal_not_reopened(opt, DistributedContext(rank=1, world_size=2)):
            opt.load_state_dict(state)
    assert len(engine.ledger) == 1 and engine._keeper.journal is None  # rank 0's 2 come by share_ledger
    assert not [w for w in seen if "journal" in str(w.message) or "stay charged" in str(w.message)]
    assert "load_state_dict" not in vars(opt)  # the wrapper is gone after the block
    assert journal.read_text() == lines  # never written by rank 1, either way


def test_rank_1_with_the_journal_absent_on_its_node(tmp_path):
    state, journal = _saved_state_and_longer_journal(tmp_path)
    journal.unlink()  # e.g. another node, whose disk does not hold rank 0's file

    engine, _, opt, _ = _private(rank=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.load_state_dict(state)
    assert any("which is missing" in str(w.message) for w in seen)  # a false alarm on that rank

    engine, _, opt, _ = _private(rank=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with journal_not_reopened(opt, DistributedContext(rank=1, world_size=2)):
            opt.load_state_dict(state)
    assert not [w for w in seen if "missing" in str(w.message)]
    assert len(engine.ledger) == 1 and not journal.exists()


def test_rank_0_loads_as_usual(tmp_path):
    state, journal = _saved_state_and_longer_journal(tmp_path)
    engine, _, opt, _ = _private(rank=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with journal_not_reopened(opt, DistributedContext(rank=0, world_size=2)):
            opt.load_state_dict(state)
    assert len(engine.ledger) == 2 and engine._keeper.journal == journal.resolve()
