"""Shared checks of the fault-injection suite: one-line errors, no temporary files, a whole ledger.

Every fault ends with one ``error:`` line (no traceback) and the CLI's own exit code, leaves no
``*.tmp`` file, and a run directory whose ledger is whole: steps 0, 1, ... without a gap or a
repeat, ``dpopt check`` passes, and ε is that of the entries (recomputed here from the ledger).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpopt.accounting.accountant import epsilon
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.cli import app

sys.path.insert(0, str(Path(__file__).parent))  # inject.py: the fault hooks

#: A short run on the bundled digits: 22 steps (q = 64/1437), a checkpoint every 4 steps.
TRAIN = ["train", "--method", "dp-sgd", "--epochs", "1", "--checkpoint-every", "4"]
STEPS = 22


def invoke(*args: str):
    """``dpopt ARGS`` in-process (stdout and stderr mixed in ``.output``)."""
    return CliRunner().invoke(app, list(args))


def assert_one_line_error(result, code: int, *phrases: str) -> str:
    """Exit ``code``, exactly one ``error:`` line (containing ``phrases``), no traceback; returns the line."""
    out = result.output
    assert result.exit_code == code, out
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in out and 'File "' not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out
    for phrase in phrases:
        assert phrase in errors[0], errors[0]
    return errors[0]


def assert_no_tmp(directory: Path) -> None:
    leftovers = [p.name for p in Path(directory).rglob("*") if p.name.endswith(".tmp") or ".tmp." in p.name]
    assert not leftovers, leftovers


def digest(directory: Path) -> dict:
    """``{file name: sha256}`` of every file under ``directory`` (nothing previously written may change)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(directory).rglob("*"))
        if p.is_file()
    }


def assert_whole_run(run_dir: Path, lost: int = 0) -> dict:
    """A finished run: steps 0..n-1 each once, n = planned + lost steps, check passes, ε = that of the entries."""
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = PrivacyLedger.load(run_dir)
    steps = [e.step for e in ledger]
    assert summary["status"] == "completed"
    assert summary.get("lost_steps", 0) == lost
    assert len(steps) == STEPS + lost == summary["steps"]
    # the releases of the killed segment after its checkpoint (c) stay, then steps c.. are trained again:
    # no release missing, none recorded twice
    c = summary.get("resumed_from_step", STEPS)
    assert steps == list(range(c + lost)) + list(range(c, STEPS)), steps
    assert epsilon(ledger.composed_event(), summary["delta"]) == pytest.approx(summary["epsilon"], rel=1e-6)
    check = invoke("check", str(run_dir))
    assert check.exit_code == 0, check.output
    assert_no_tmp(run_dir)
    return summary
