"""A ledger write that fails on ONE rank of a data-parallel ``PrivacyEngine`` run (2 gloo processes, CPU).

Only the rank that opened a journal writes (``engine.open_journal``: rank 0 here, as the docs ask; the
other ranks' ledgers are in memory). The ledger is write-ahead: rank 0's entry of release 2 cannot be
written (ENOSPC). Then EVERY rank raises :class:`~dpopt.errors.LedgerWriteError` from ``opt.step()``
(rank 0 its own, rank 1 "another rank could not write"), none waits in the release's all-reduce (the
spawn's deadline; without the agreement rank 1 hung in it until gloo's 60 s timeout), and on both ranks
the parameters are bit-for-bit those before the step, the ledger and the Privatizer's step, reads and
releases are as after release 1. The noise stream did not advance: with reproducible noise the run whose
step 2 is retried (after the disk has space again) ends with exactly the parameters and ledger of the same
run without the failure.
"""

from __future__ import annotations

import errno
import warnings
from pathlib import Path

import pytest
import torch
from gloo_ranks import gloo_group, spawn_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.data import load_dataset
from dpopt.errors import LedgerWriteError

STEPS, FAIL_AT = 4, 2  # release FAIL_AT (1-based) fails once on rank 0


def _run(rank: int, tmp: str, name: str, fail: bool) -> dict:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    d = load_dataset("digits")
    loader = DataLoader(TensorDataset(d.x_train, d.y_train), batch_size=128)
    engine = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reproducible-noise warning
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            noise_generator=torch.Generator().manual_seed(7),
            distributed=True,
        )
    if rank == 0:
        engine.open_journal(Path(tmp) / f"{name}.jsonl")
    priv = opt.privatizer
    out: dict = {"failures": []}
    armed = [fail and rank == 0]
    flush = PrivacyLedger.flush

    def full(self, sync=True):
        if armed[0] and self._journal is not None and len(self) >= FAIL_AT and self.unflushed:
            raise OSError(errno.ENOSPC, "No space left on device", str(self._journal))
        return flush(self, sync)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(PrivacyLedger, "flush", full)
        for i, (x, y) in enumerate(loader):
            if i == STEPS:
                break
            while True:
                before = [p.detach().clone() for p in model.parameters()]
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                try:
                    opt.step()
                    break
                except LedgerWriteError as exc:
                    same = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
                    out["failures"].append(
                        dict(step=i, message=str(exc), errno=exc.errno, unchanged=same, ledger=len(engine.ledger),
                             steps=priv.steps, reads=priv.reads, releases=priv.releases)
                    )  # fmt: skip
                    armed[0] = False  # space freed: the step is taken again
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["ledger"] = [(e.step, e.meta["noise_std"]) for e in engine.ledger.entries]
    out["counts"] = (priv.steps, priv.reads, priv.releases)
    return out


def _worker(rank: int, world: int, tmp: str) -> None:
    with gloo_group(rank, world, tmp):
        results = {name: _run(rank, tmp, name, fail) for name, fail in (("failed", True), ("clean", False))}
        torch.save(results, Path(tmp) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ledger-write-failure")
    spawn_ranks(_worker, tmp, deadline_s=150)
    return tmp, [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_a_write_failed_on_one_rank_releases_on_no_rank(ranks):
    _, (r0, r1) = ranks
    for r in (r0, r1):
        (f,) = r["failed"]["failures"]  # one failure, on every rank, at the same step
        assert f["step"] == FAIL_AT - 1 and f["unchanged"], f
        # release 1 only: nothing of release 2 counted on any rank (rank 1's in-memory entry taken back)
        assert (f["ledger"], f["steps"]) == (FAIL_AT - 1, FAIL_AT - 1), f
        assert (f["reads"], f["releases"]) == (FAIL_AT - 1, FAIL_AT - 1), f
    assert r0["failed"]["failures"][0]["errno"] == errno.ENOSPC  # rank 0's own write error
    assert "another rank could not write its ledger entry" in r1["failed"]["failures"][0]["message"]
    assert "No noise was drawn" in r1["failed"]["failures"][0]["message"]


def test_the_retried_run_equals_the_run_without_failure(ranks):
    tmp, (r0, r1) = ranks
    for r in (r0, r1):
        assert r["clean"]["failures"] == []
        assert r["failed"]["ledger"] == r["clean"]["ledger"] and [s for s, _ in r["clean"]["ledger"]] == [0, 1, 2, 3]
        assert r["failed"]["counts"] == r["clean"]["counts"] == (STEPS, STEPS, STEPS)
        for a, b in zip(r["failed"]["params"], r["clean"]["params"]):
            assert torch.equal(a, b)  # the reproducible stream did not advance on the failed attempt
    for a, b in zip(r0["failed"]["params"], r1["failed"]["params"]):
        assert torch.equal(a, b)  # replicas equal
    assert [e.step for e in PrivacyLedger.load(tmp / "failed.jsonl").entries] == [0, 1, 2, 3]  # rank 0's journal
