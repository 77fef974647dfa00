"""Shared by the 2-process gloo tests (imported like tests/engine/per_example_zoo.py).

* :func:`torchrun_env` — the environment torchrun gives a rank (what transformers' Trainer reads);
* :func:`gloo_group` — a rank's process group (file rendezvous, 60 s collective timeout), left by both
  ranks together;
* :func:`spawn_ranks` — the ranks, with a deadline, so a hung collective fails CI instead of hanging it;
  a rank that finished its work (:func:`gloo_group` wrote its ``done`` mark) and then died in gloo's
  teardown is not a failure (see :func:`spawn_ranks`);
* :func:`progress` — a rank's heartbeat (one timestamped line per finished phase): with ``stall_s``,
  :func:`spawn_ranks` tells a SLOW run (some rank still finishing phases: the deadline is extended, up
  to ``max_s``) from a STUCK one (no rank has finished a phase for ``stall_s``: killed). On a loaded
  2-core machine a healthy 2-rank FSDP run took 58-268 s (7 runs, nice 19, load 13-22) where a quiet one takes
  ~30 s: a fixed deadline read those slow runs as hangs.
"""

from __future__ import annotations

import datetime
import glob
import os
import sys
import time
import warnings
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEADLINE_S = 240


def torchrun_env(rank: int, world: int, **extra: str) -> None:
    """Set the variables torchrun sets for ``rank`` of ``world`` on one node (transformers' Trainer and
    accelerate read them), plus ``extra``."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        **extra,
    )


@contextmanager
def gloo_group(rank: int, world: int, tmp: str) -> Iterator[None]:
    """Join the gloo group of ``world`` ranks rendezvousing in ``tmp``; one torch thread per rank."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield
        _mark_done(tmp, rank)
        # both ranks leave together: a rank tearing gloo down while the other is still working aborted
        # the process ("terminate called without an active exception") in one of several full-suite runs
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _mark_done(tmp: str, rank: int) -> None:
    """This rank's work (everything inside :func:`gloo_group`) finished without an exception."""
    with open(os.path.join(str(tmp), f"done-rank{rank}"), "w") as fh:
        fh.write(f"{time.time():.1f}\n")


def _all_done(tmp, world: int) -> bool:
    return all(os.path.exists(os.path.join(str(tmp), f"done-rank{r}")) for r in range(world))


def _rank_main(rank: int, worker, world: int, tmp: str) -> None:
    """Run ``worker(rank, world, tmp)``, then leave with ``os._exit(0)`` (streams flushed).

    Skipping the interpreter's finalization is deliberate: with gloo's threads and the process
    group's C++ objects torn down during finalization, CI saw a rank abort
    ("terminate called without an active exception", SIGABRT) after all its work was done and
    written (seen in two full-suite runs, the second on CI 2026-12-04 in test_ddp_equivalence's
    fixture; not reproduced in 31 back-to-back runs of that fixture on a loaded 2-core machine).
    An exception in ``worker`` propagates as before (mp.spawn reports it and the test fails).
    """
    worker(rank, world, tmp)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def progress(tmp: str, rank: int, label: str) -> None:
    """Append ``<unix time> <label>`` to ``tmp/progress-rank<rank>.txt`` (flushed): this rank finished a phase."""
    with open(os.path.join(str(tmp), f"progress-rank{rank}.txt"), "a") as fh:
        fh.write(f"{time.time():.1f} {label}\n")


def progress_log(tmp) -> str:
    """Every rank's progress lines (for a failure message)."""
    out = []
    for path in sorted(glob.glob(os.path.join(str(tmp), "progress-rank*.txt"))):
        with open(path) as fh:
            out.append(f"{os.path.basename(path)}: " + " | ".join(line.strip() for line in fh))
    return "\n".join(out)


def _last_progress(tmp) -> float:
    times = [os.path.getmtime(p) for p in glob.glob(os.path.join(str(tmp), "progress-rank*.txt"))]
    return max(times) if times else 0.0


def spawn_ranks(
    worker, tmp, world: int = 2, deadline_s: float = DEADLINE_S, stall_s: float = None, max_s: float = 1200.0
) -> None:
    """``worker(rank, world, tmp)`` on ``world`` processes; kill them and fail the test past ``deadline_s``.

    With ``stall_s`` (ranks reporting :func:`progress`): past ``deadline_s`` the run goes on while some rank
    finished a phase within the last ``stall_s`` seconds, until ``max_s``; the failure says which (stuck or
    too slow) and shows the progress lines.
    """
    procs = mp.spawn(_rank_main, args=(worker, world, str(tmp)), nprocs=world, join=False)
    start = time.monotonic()
    while not _joined(procs, tmp, world):
        elapsed = time.monotonic() - start
        if elapsed <= deadline_s:
            continue
        idle = time.time() - max(_last_progress(tmp), time.time() - elapsed)
        if stall_s is not None and idle <= stall_s and elapsed <= max_s:
            continue  # slow, not stuck
        for p in procs.processes:
            p.kill()
        why = (
            f"no rank finished a phase for {idle:.0f} s (stuck)"
            if stall_s is not None and idle > stall_s
            else f"still progressing after {elapsed:.0f} s (too slow)"
            if stall_s is not None
            else f"did not finish within {deadline_s} s"
        )
        pytest.fail(f"the {world}-process run {why}\n{progress_log(tmp)}")


def _joined(procs, tmp, world: int) -> bool:
    """``procs.join(timeout=5)``, except that a rank killed by a signal AFTER every rank's work was
    done (all ``done`` marks written inside :func:`gloo_group`) only warns: the results on disk are
    complete, and the crash is in torch/gloo's teardown, not in the code under test. A rank that dies
    before the marks — mid-collective, mid-training — still fails the test."""
    try:
        return procs.join(timeout=5)
    except mp.ProcessExitedException as exc:
        if exc.signal_name is None or not _all_done(tmp, world):
            raise
        for p in procs.processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        warnings.warn(
            f"rank {exc.error_index} died with {exc.signal_name} in gloo's teardown after every "
            "rank finished its work; the results are complete",
            stacklevel=2,
        )
        return True
