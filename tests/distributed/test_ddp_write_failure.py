"""A failed write of rank 0 (disk full) in data-parallel ``dpopt train`` (DDP: :func:`dpopt.training.train`;
FSDP: :func:`dpopt.fsdp_train.train_fsdp`), 2 gloo processes on CPU.

Only rank 0 writes the run's files (ledger journal, metrics rows). Its journal flush fails with ENOSPC
before the metrics row of step 2 (``log_every=1``): EVERY rank raises :class:`~dpopt.errors.RunWriteError`
(errno ENOSPC, the same run directory, so the same advice from
:func:`~dpopt.accounting.run_continuation.continuation`) after the same release (2 releases on each rank),
and no rank waits in a collective (the spawn's deadline; a collective times out after 60 s, which
would raise a gloo error instead of RunWriteError). The journal on disk holds the one release flushed.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from gloo_ranks import gloo_group, spawn_ranks

from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.run_continuation import continuation
from dpopt.errors import RunWriteError
from dpopt.training import TrainConfig

FAIL_AT = 2  # rank 0's flush fails once the ledger holds this many releases


def _cfg(out: Path) -> TrainConfig:
    # digits: q = 256/1437, 1 epoch -> 6 planned steps; a metrics row (and a journal flush) after every step
    return TrainConfig(
        dataset="digits", method="dp-sgd", batch_size=256, epochs=1.0, seed=3, log_every=1, out=str(out),
        accountant="rdp", physical_batch_size=128,
    )  # fmt: skip


def _attempt(fn, cfg: TrainConfig, counted: list) -> dict:
    try:
        fn(cfg, on_step=lambda info: counted.append(info["step"]))
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return {
            "type": type(exc).__name__,
            "errno": getattr(exc, "errno", None),
            "run_dir": str(getattr(exc, "run_dir", None)),
            "cause": type(getattr(exc, "cause", None)).__name__,
        }
    return {"type": None}


def _worker(rank: int, world: int, tmp: str) -> None:
    from dpopt.fsdp_train import train_fsdp
    from dpopt.training import train

    with gloo_group(rank, world, tmp), pytest.MonkeyPatch.context() as m:
        if rank == 0:
            flush = PrivacyLedger.flush

            def full(self, sync=True):
                if self._journal is not None and len(self) >= FAIL_AT and self.unflushed:
                    raise OSError(errno.ENOSPC, "No space left on device", str(self._journal))
                return flush(self, sync)

            m.setattr(PrivacyLedger, "flush", full)
        results, steps = {}, {}
        for name, fn in (("ddp", train), ("fsdp", train_fsdp)):
            counted: list = []
            results[name] = _attempt(fn, _cfg(Path(tmp) / name), counted)
            steps[name] = counted
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps({"results": results, "on_step": steps}))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("write-failure")
    spawn_ranks(_worker, tmp, deadline_s=200)
    return tmp, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("door", ["ddp", "fsdp"])
def test_rank0_write_failure_is_a_run_write_error_on_every_rank(ranks, door):
    tmp, (r0, r1) = ranks
    run_dir = str(tmp / door)
    for r in (r0, r1):
        got = r["results"][door]
        assert got["type"] == "RunWriteError", got
        assert got["errno"] == errno.ENOSPC and got["run_dir"] == run_dir
    assert r0["results"][door]["cause"] == "OSError"
    assert r0["on_step"][door] == list(range(1, FAIL_AT + 1))  # rank 0 stopped after the same release
    assert r1["on_step"][door] == []  # on_step is rank 0's
    ledger = PrivacyLedger.load(tmp / door / "ledger.jsonl")
    assert [e.step for e in ledger.entries] == list(range(FAIL_AT - 1))  # what was flushed before the failure
    how = continuation(run_dir)  # what every rank's front end prints (a function of the shared run_dir)
    assert (how.releases, how.resumable) == (FAIL_AT - 1, False)  # no checkpoint before step 6's epoch end
    assert "1 charged release(s)" in how.advice(free_space=True) and run_dir in how.advice(free_space=True)


def test_run_write_error_keeps_its_directory():
    cause = OSError(errno.ENOSPC, "No space left on device", "/r/ledger.jsonl")
    err = RunWriteError(cause, "/r")
    assert (err.errno, err.run_dir, str(err)) == (errno.ENOSPC, "/r", str(cause))
