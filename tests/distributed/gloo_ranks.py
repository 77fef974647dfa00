"""Shared by the 2-process gloo tests (imported like tests/engine/per_example_zoo.py).

* :func:`gloo_group` — a rank's process group (file rendezvous, 60 s collective timeout), left by both
  ranks together;
* :func:`spawn_ranks` — the ranks, with a deadline, so a hung collective fails CI instead of hanging it.
"""

from __future__ import annotations

import datetime
import time
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEADLINE_S = 240


@contextmanager
def gloo_group(rank: int, world: int, tmp: str) -> Iterator[None]:
    """Join the gloo group of ``world`` ranks rendezvousing in ``tmp``; one torch thread per rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
        # both ranks leave together: a rank tearing gloo down while the other is still working aborted
        # the process ("terminate called without an active exception") in one of several full-suite runs
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker, tmp, world: int = 2, deadline_s: float = DEADLINE_S) -> None:
    """``worker(rank, world, tmp)`` on ``world`` processes; kill them and fail the test past ``deadline_s``."""
    procs = mp.spawn(worker, args=(world, str(tmp)), nprocs=world, join=False)
    deadline = time.monotonic() + deadline_s
    while not procs.join(timeout=5):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail(f"the {world}-process run did not finish within {deadline_s} s")
