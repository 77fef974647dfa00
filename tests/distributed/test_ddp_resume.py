"""``resume`` of a data-parallel run (``dpopt train --resume RUN_DIR`` under torchrun): 2 gloo processes on CPU.

A 2-process run is stopped by SIGINT on rank 0 after step 4 (every rank stops after the same step;
rank 0 writes the checkpoint), then resumed with 2 processes:

* secret noise: the resumed run completes, the ledger holds each step exactly once (0 … planned−1, in
  the journal and in ledger.json), the ledger check passes and only rank 0 wrote the run directory;
* reproducible noise: the interrupted-and-resumed run ends with the parameters and ε of an
  uninterrupted one-process run with the same seed (float tolerance: summation order), also when the
  number of processes changes at the resume (2 → 1 and 1 → 2).

One spawn runs every 2-process segment; the processes are killed past the deadline and every
collective times out after 60 s, so a hang cannot stall CI.
"""

from __future__ import annotations

import json
import os
import signal
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import gloo_group, spawn_ranks

from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.ledger_check import check_run
from dpopt.training import TrainConfig, resume, train

STOP_AFTER = 4


def _cfg(out: Path, reproducible: bool) -> TrainConfig:
    # digits: q = 64/1437, 0.5 epoch -> 11 steps; RDP: the quicker accountant (ε is compared, not its value)
    return TrainConfig(
        dataset="digits",
        batch_size=64,
        epochs=0.5,
        noise_multiplier=1.0,
        seed=3,
        method="dp-adam",
        reproducible_noise=reproducible,
        out=str(out),
        checkpoint_every=0,
        accountant="rdp",
    )


def _stop_at(step: int):
    def on_step(info: dict) -> None:  # called on rank 0 only: the stop reaches the others through the loop
        if info["step"] == step:
            os.kill(os.getpid(), signal.SIGINT)

    return on_step


def _quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reproducible-noise warning
        return fn(*args, **kw)


def _worker(rank: int, world: int, tmp: str) -> None:
    with gloo_group(rank, world, tmp):
        root, results = Path(tmp), {}
        for name, reproducible in (("secret", False), ("repro", True), ("repro-to-1", True)):
            results[name] = _quiet(train, _cfg(root / name, reproducible), on_step=_stop_at(STOP_AFTER))
        dist.barrier()  # a new launch in real use: rank 0 has written everything of the first segment
        for name in ("secret", "repro", "repro-from-1"):
            results[name + "-resumed"] = _quiet(resume, root / name)
        (root / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp-resume")
    first = _quiet(train, _cfg(tmp / "repro-from-1", True), on_step=_stop_at(STOP_AFTER))  # 1 process
    assert first["status"] == "interrupted" and first["steps"] == STOP_AFTER
    spawn_ranks(_worker, tmp)
    to_one = _quiet(resume, tmp / "repro-to-1")  # interrupted with 2 processes, resumed with 1
    return tmp, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)], to_one


def test_secret_run_interrupted_and_resumed(runs):
    tmp, (r0, r1), _ = runs
    first, done = r0["secret"], r0["secret-resumed"]
    assert first["status"] == "interrupted" and first["stop_signal"] == "SIGINT" and first["world_size"] == 2
    assert first["steps"] == STOP_AFTER < first["planned_steps"] == 11
    assert r1["secret"] == {"rank": 1, "world_size": 2, "steps": STOP_AFTER, "run_dir": None}
    assert done["status"] == "completed" and done["steps"] == 11 and done["resumed_from_step"] == STOP_AFTER
    assert done["world_size"] == 2 and done["noise"] == "secret" and done["check"] == "pass"
    assert r1["secret-resumed"] == {"rank": 1, "world_size": 2, "steps": 11, "run_dir": None}
    out = tmp / "secret"
    assert [e.step for e in PrivacyLedger.load(out).entries] == list(range(11))  # the journal: each step once
    assert [e.step for e in PrivacyLedger.load(out / "ledger.json").entries] == list(range(11))
    assert len((out / "ledger.jsonl").read_text().splitlines()) == 11 + 1  # header + one line per step
    assert check_run(out).passed, (out / "check.txt").read_text()
    assert sorted(p.name for p in tmp.iterdir() if p.is_dir()) == [
        "repro",
        "repro-from-1",
        "repro-to-1",
        "secret",
    ]  # rank 1 wrote nothing


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    return out, _quiet(train, _cfg(out, True))


@pytest.mark.parametrize("name", ["repro", "repro-to-1", "repro-from-1"])
def test_reproducible_resume_equals_uninterrupted(runs, uninterrupted, name):
    tmp, (r0, _), to_one = runs
    single_dir, single = uninterrupted
    done = to_one if name == "repro-to-1" else r0[name + "-resumed"]
    assert done["status"] == "completed" and done["steps"] == single["steps"] == 11
    assert done["epsilon"] == pytest.approx(single["epsilon"], rel=1e-12)
    assert [e.step for e in PrivacyLedger.load(tmp / name).entries] == list(range(11))
    a = torch.load(tmp / name / "model.pt", weights_only=True)
    b = torch.load(single_dir / "model.pt", weights_only=True)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
