"""Shared by the 2-process gloo tests: spawn ranks with a deadline, so a hung collective fails CI instead of
hanging it."""

from __future__ import annotations

import time

import pytest
import torch.multiprocessing as mp

DEADLINE_S = 240


def _spawn(worker, tmp: str, world: int = 2, deadline_s: float = DEADLINE_S) -> None:
    """``worker(rank, world, tmp)`` on ``world`` processes; kill them and fail the test past ``deadline_s``."""
    procs = mp.spawn(worker, args=(world, str(tmp)), nprocs=world, join=False)
    deadline = time.monotonic() + deadline_s
    while not procs.join(timeout=5):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail(f"the {world}-process run did not finish within {deadline_s} s")


@pytest.fixture(scope="session")
def spawn_ranks():
    """The :func:`_spawn` function (a fixture: test modules here are not importable packages)."""
    return _spawn
