"""SIGKILL at chosen and random points of ``dpopt train`` (inside a checkpoint write, inside a journal
append, right after a release), then ``--resume``; and a console whose reader goes away
(``dpopt train 2>&1 | head -1``).

The kills run ``python tests/faults/inject.py SPEC -- train ...`` (a subprocess killed by the hook);
the resumes run in-process. After a kill: the checkpoint on disk is whole (the previous one), the
resumed run charges the releases made after it (``lost_steps``), its ledger has no step missing or
recorded twice, ``dpopt check`` passes, ε is that of the entries, no ``*.tmp`` is left, and what the
resume prints is plain lines (``warning: ...``: no Python warning with its source line).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import STEPS, TRAIN, assert_whole_run, invoke
from dpopt.training.checkpoint import load_checkpoint

INJECT = Path(__file__).parent / "inject.py"
SRC = Path(__file__).resolve().parents[2] / "src"


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    return env


def _killed_run(out: Path, spec: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(INJECT), spec, "--", *TRAIN, "--out", str(out)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])


def _resume_whole(out: Path) -> dict:
    ckpt = load_checkpoint(out)  # the last complete checkpoint: the kill never tears it
    res = invoke("train", "--resume", str(out))
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output and "warnings.warn" not in res.output and "Warning:" not in res.output
    summary = json.loads((out / "summary.json").read_text())
    lost = summary.get("lost_steps", 0)
    assert summary["resumed_from_step"] == ckpt["step"]
    if lost:  # said in one plain line
        assert any(line.startswith("warning:") and f"{lost} releases" in line for line in res.output.splitlines())
    return assert_whole_run(out, lost=lost)


@pytest.mark.slow  # a subprocess (~10 s on one idle core)
def test_kill_inside_a_checkpoint_write_then_resume(tmp_path):
    out = tmp_path / "run"
    _killed_run(out, "write:checkpoint.pt:1:300")  # the 2nd checkpoint (step 8), 300 bytes into it
    assert (out / "checkpoint.pt.tmp").exists() and load_checkpoint(out)["step"] == 4
    summary = _resume_whole(out)
    assert summary["lost_steps"] == 4  # steps 4-7 were released (journal flushed before the checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_kill_at_random_points_then_resume(tmp_path, seed):
    """A random point of the run: right after a release, or inside a journal append (a torn last line)."""
    rng = random.Random(seed)
    spec = f"release:{rng.randint(5, STEPS - 1)}" if seed % 2 == 0 else f"write:ledger.jsonl:{rng.randint(2, 5)}:40"
    out = tmp_path / "run"
    _killed_run(out, spec)
    _resume_whole(out)


@pytest.mark.slow  # a subprocess (~10 s on one idle core)
def test_closed_console_does_not_stop_the_run(tmp_path):
    """`dpopt train 2>&1 | head -1`: the reader goes after one line; the run finishes and writes every file.

    With --log-every 5 a line is printed at steps 5, 10, ...: the one of step 10 meets the closed pipe
    in the middle of the run (before, BrokenPipeError ended the run there, without a summary).
    """
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpopt", *TRAIN, "--log-every", "5", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=_env(),
    )
    assert proc.stdout is not None
    proc.stdout.readline()
    proc.stdout.close()  # the reader goes away: every later write meets a closed pipe
    assert proc.wait(timeout=300) == 0
    assert_whole_run(out)
