"""Only rank 0 writes a data-parallel ``PrivacyEngine``'s ledger journal (2 gloo processes, CPU).

Every rank's ledger holds the same releases; two ranks writing one journal appended each release twice
(or forked the file). So, with ``make_private(..., distributed=True)``:

* ``engine.open_journal`` and ``engine.save_checkpoint(path=...)`` on rank 1 raise a RuntimeError that
  says to call them on rank 0 only; on rank 0 they work;
* a journal opened on rank 1 BEFORE ``make_private`` makes ``make_private`` raise on both ranks;
* ``load_checkpoint`` works on every rank: both ranks' ledgers take the journal's later release in, and
  rank 1 does not reopen the journal, which holds each release exactly once after more training.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from gloo_ranks import gloo_group, spawn_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.data import load_dataset


def _private(engine: dpopt.PrivacyEngine):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 10))
    d = load_dataset("digits")
    loader = DataLoader(TensorDataset(d.x_train, d.y_train), batch_size=128)
    return engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        distributed=True,
    )


def _steps(model, opt, loader, n: int) -> None:
    for i, (x, y) in enumerate(loader):
        if i == n:
            return
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _error(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _worker(rank: int, world: int, tmp: str) -> None:
    journal, ckpt = Path(tmp) / "ledger.jsonl", Path(tmp) / "ckpt.pt"
    out: dict = {}
    with gloo_group(rank, world, tmp), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the journal's "releases after the checkpoint stay charged" warning
        early = dpopt.PrivacyEngine()
        if rank == 1:
            early.open_journal(Path(tmp) / f"early-rank{rank}.jsonl")  # before make_private: not yet known
        out["early"] = _error(lambda: _private(early))

        engine = dpopt.PrivacyEngine()
        model, opt, loader = _private(engine)
        if rank == 1:
            out["open_journal"] = _error(lambda: engine.open_journal(journal))
            out["save_checkpoint"] = _error(lambda: engine.save_checkpoint(path=ckpt, module=model, optimizer=opt))
        else:
            engine.open_journal(journal)
        _steps(model, opt, loader, 2)
        if rank == 0:
            engine.save_checkpoint(path=ckpt, module=model, optimizer=opt)
        _steps(model, opt, loader, 1)  # release 3: in the journal, not in the checkpoint
        dist.barrier()

        resumed = dpopt.PrivacyEngine()
        model, opt, loader = _private(resumed)
        resumed.load_checkpoint(path=ckpt, module=model, optimizer=opt)  # every rank
        out["loaded"] = len(resumed.ledger)
        out["journal"] = None if resumed.journal is None else Path(resumed.journal).resolve()
        _steps(model, opt, loader, 1)
        out["ledger"] = [e.step for e in resumed.ledger.entries]
        dist.barrier()
    torch.save(out, Path(tmp) / f"rank{rank}.pt")


def test_only_rank_0_writes_the_journal(tmp_path):
    spawn_ranks(_worker, tmp_path, deadline_s=150)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert r1["early"].startswith("RuntimeError: this engine keeps a ledger journal"), r1["early"]
    assert "on rank 1 of 2" in r1["early"] and "Call engine.open_journal() on rank 0 only" in r1["early"]
    assert r0["early"] == "RuntimeError: make_private was refused on another rank (its error is reported there)"
    for door in ("open_journal", "save_checkpoint"):
        assert r1[door].startswith(f"RuntimeError: engine.{door}() was called on rank 1 of 2"), r1[door]
        assert f"Call engine.{door}() on rank 0 only" in r1[door], r1[door]
        assert "load_checkpoint works on every rank" in r1[door], r1[door]
    # both ranks took the checkpoint's 2 releases and the journal's third; only rank 0 journals on
    assert r0["loaded"] == r1["loaded"] == 3
    assert r0["journal"] == (tmp_path / "ledger.jsonl").resolve() and r1["journal"] is None
    # the release after the load is the checkpoint's step 2 again (the journal's step 2 stays charged)
    assert r0["ledger"] == r1["ledger"] == [0, 1, 2, 2]
    assert [e.step for e in PrivacyLedger.load(tmp_path / "ledger.jsonl").entries] == [0, 1, 2, 2]  # each once
