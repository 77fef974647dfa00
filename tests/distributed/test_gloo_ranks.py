"""gloo_ranks.spawn_ranks tells a slow run from a stuck one (no process group: plain processes, ~40 s).

* a run that keeps reporting progress past its deadline is left to finish;
* a run in which no rank reported progress for ``stall_s`` is killed and fails, saying "stuck", with the
  progress lines;
* a rank killed by a signal after every rank marked its work done (gloo's teardown) warns; one killed
  before that fails the test.
"""

from __future__ import annotations

import os
import time

import pytest
import torch.multiprocessing as mp
from gloo_ranks import _mark_done, progress, spawn_ranks

pytestmark = pytest.mark.slow  # two spawns of plain processes that import torch: ~25-55 s under load


def _slow(rank: int, world: int, tmp: str) -> None:
    for i in range(6):  # 3 s in all, a phase every 0.5 s: past a 1 s deadline, never stalled for 2 s
        time.sleep(0.5)
        progress(tmp, rank, f"phase{i}")


def _stuck(rank: int, world: int, tmp: str) -> None:
    progress(tmp, rank, "started")
    time.sleep(600)  # never reports again


def test_slow_but_progressing_run_is_not_killed(tmp_path):
    spawn_ranks(_slow, tmp_path, deadline_s=1, stall_s=60)  # the ranks start (import torch) within the stall
    for r in range(2):
        assert (tmp_path / f"progress-rank{r}.txt").read_text().count("phase") == 6


def test_stuck_run_fails_and_says_so(tmp_path):
    t = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="stuck") as info:
        spawn_ranks(_stuck, tmp_path, deadline_s=30, stall_s=3)  # past startup: "started" is on disk
    assert "progress-rank0.txt" in str(info.value) and "started" in str(info.value)
    assert time.monotonic() - t < 120  # killed, not waited out


def _abort_after_done(rank: int, world: int, tmp: str) -> None:
    _mark_done(tmp, rank)  # what gloo_group does when the body returned
    if rank == 0:
        while not os.path.exists(os.path.join(tmp, f"done-rank{world - 1}")):  # rank 1 has marked too
            time.sleep(0.1)
        os.abort()  # the teardown crash CI saw: SIGABRT, no Python exception


def _abort_before_done(rank: int, world: int, tmp: str) -> None:
    if rank == 0:
        os.abort()
    _mark_done(tmp, rank)


def test_abort_after_every_rank_is_done_only_warns(tmp_path):
    with pytest.warns(UserWarning, match="SIGABRT in gloo's teardown"):
        spawn_ranks(_abort_after_done, tmp_path, deadline_s=120)
    assert all((tmp_path / f"done-rank{r}").exists() for r in range(2))


def test_abort_before_the_work_is_done_fails(tmp_path):
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        spawn_ranks(_abort_before_done, tmp_path, deadline_s=120)
