"""Read-only output directories for every command that writes, missing optional packages, a truncated
or foreign checkpoint, and a damaged ledger journal (with the way forward, ``--repair-journal``).

Every case: one ``error:`` line, exit 2 (a path or a file the user must change), no traceback,
nothing previously written changed, no ``*.tmp``. Read-only directories are simulated
(:func:`inject.read_only`: ``EROFS`` from the OS calls), since ``chmod`` does not bind root.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from inject import full_disk, read_only

from conftest import TRAIN, assert_no_tmp, assert_one_line_error, assert_whole_run, digest, invoke
from dpopt.accounting.events import poisson_gaussian_step
from dpopt.accounting.journal_repair import repair_journal
from dpopt.accounting.ledger import PrivacyLedger


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run stopped by a full disk at its 2nd checkpoint: checkpoint of step 4, journal of 8 releases."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    with pytest.MonkeyPatch.context() as m:
        full_disk(m, "checkpoint.pt", skip=1)
        assert invoke(*TRAIN, "--out", str(out)).exit_code == 4
    return out


@pytest.fixture
def run(stopped, tmp_path):
    """A fresh copy of the stopped run."""
    return shutil.copytree(stopped, tmp_path / "run")


# --------------------------------------------------------------------------- read-only outputs
def test_train_into_a_read_only_directory(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    read_only(monkeypatch, ro)
    assert_one_line_error(invoke(*TRAIN, "--out", str(ro / "run")), 2, "cannot create the run directory", "Read-only")
    assert_one_line_error(invoke(*TRAIN, "--out", str(ro)), 2, "config.json", "Read-only file system")
    assert list(ro.iterdir()) == []


def test_tensorboard_into_a_read_only_directory_leaves_no_run(tmp_path, monkeypatch):
    ro, out = tmp_path / "ro", tmp_path / "run"
    read_only(monkeypatch, ro)
    assert_one_line_error(invoke(*TRAIN, "--out", str(out), "--tensorboard", str(ro / "tb")), 2, "--tensorboard")
    assert not out.exists()  # refused before the run directory was made


def test_resume_into_a_read_only_run_changes_nothing(run, monkeypatch):
    before = digest(run)
    read_only(monkeypatch, run)
    assert_one_line_error(invoke("train", "--resume", str(run)), 2, "Read-only file system")
    monkeypatch.undo()
    assert digest(run) == before


def test_report_diagnose_audit_sweep_split_into_a_read_only_directory(tmp_path, monkeypatch):
    results = tmp_path / "results.jsonl"
    results.write_text(
        json.dumps({"method": "dp-sgd", "label": "a", "noise_multiplier": 1.0, "test_accuracy": 0.5, "epsilon": 1.0})
        + "\n"
    )
    sweep = tmp_path / "tiny.toml"
    sweep.write_text(
        '[sweep]\nname = "tiny"\n[base]\ndataset = "digits"\nepochs = 0.5\n[grid]\nseed = [0]\n'
        '[[variant]]\nmethod = ["dp-sgd"]\n'
    )
    ro = tmp_path / "ro"
    read_only(monkeypatch, ro)
    for args in (
        ["report", str(results), "--out", str(ro / "rep")],
        ["report", str(results), "--out", str(ro)],
        ["diagnose", "--noise-multiplier", "1", "--out", str(ro / "diag")],
        ["audit", "--one-run", "--canaries", "10", "--epochs", "1", "--report", str(ro / "audit")],
        ["sweep", str(sweep), "--out", str(ro / "sweep")],
        [
            "split",
            "--target-epsilon",
            "4",
            "--dataset-size",
            "100000",
            "--epochs",
            "1",
            "--batch-sizes",
            "64",
            "--out",
            str(ro / "split"),
        ],
    ):
        assert_one_line_error(invoke(*args), 2, "Read-only file system")
    assert list(ro.iterdir()) == []


# --------------------------------------------------------------------------- optional packages
@pytest.mark.parametrize(
    "module, args, flag",
    [
        ("torch.utils.tensorboard", ["--tensorboard", "tb"], "--tensorboard"),
        ("prv_accountant", ["--accountant", "prv"], "--accountant"),
    ],
)
def test_a_missing_optional_package_is_refused_before_the_run_directory(tmp_path, monkeypatch, module, args, flag):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert_one_line_error(invoke(*TRAIN, "--out", str(out), *args), 2, flag, "pip install")
    assert not out.exists()
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    res = invoke(*TRAIN, "--out", str(out))  # the same --out is free
    assert res.exit_code == 0, res.output


# --------------------------------------------------------------------------- truncated or foreign checkpoints
@pytest.mark.parametrize("damage", ["half", "empty", "text", "foreign"])
def test_a_truncated_or_foreign_checkpoint_is_refused_in_one_line(run, damage):
    ckpt = run / "checkpoint.pt"
    data = ckpt.read_bytes()
    if damage == "foreign":
        torch.save({"weight": torch.zeros(3)}, ckpt)
    else:
        ckpt.write_bytes({"half": data[: len(data) // 2], "empty": b"", "text": b"hello\n"}[damage])
    before = digest(run)
    line = assert_one_line_error(invoke("train", "--resume", str(run)), 2, "checkpoint.pt")
    assert ("not a dpopt checkpoint" if damage == "foreign" else "not a complete dpopt checkpoint") in line
    for command in ("ledger", "check"):
        line = assert_one_line_error(invoke(command, str(ckpt)), 2, "checkpoint.pt")
        if damage in ("half", "foreign"):  # binary: the way forward is the run directory
            assert "pass the run directory" in line, line
    assert digest(run) == before
    assert_no_tmp(run)


# --------------------------------------------------------------------------- a damaged journal
def test_a_damaged_journal_is_refused_then_repaired_and_charged(run):
    journal = run / "ledger.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    lines[3] = '{"step": 2, "event": {"garbled\n'  # the entry of step 2 (line 1 is the header)
    journal.write_text("".join(lines))
    before = digest(run)
    assert_one_line_error(invoke("train", "--resume", str(run)), 2, "ledger.jsonl, line 4", "--repair-journal")
    assert digest(run) == before
    res = invoke("train", "--resume", str(run), "--repair-journal")
    assert res.exit_code == 0, res.output
    assert any(line.startswith("warning: repaired") and "1 release(s)" in line for line in res.output.splitlines())
    assert (run / "ledger.jsonl.damaged").read_text() == "".join(lines)  # the original is kept
    summary = assert_whole_run(run, lost=4)
    assert summary["journal_repair"] == {"damaged_lines": [4], "charged": 1}


def test_repair_journal_flag_needs_resume():
    assert_one_line_error(invoke(*TRAIN, "--repair-journal"), 2, "--repair-journal", "--resume")


def _journal(tmp_path, sigmas):
    ledger = PrivacyLedger()
    path = tmp_path / "ledger.jsonl"
    ledger.open_journal(path)
    for step, sigma in enumerate(sigmas):
        ledger.record(step, poisson_gaussian_step(sigma, 0.01), releases=1)
    ledger.flush()
    return path, path.read_text().splitlines(keepends=True)


def test_repair_charges_what_damaged_lines_may_have_held(tmp_path):
    path, lines = _journal(tmp_path, [1.0] * 6)
    # a torn line written again in full after it (gap 0: nothing of its own) and two lost trailing lines
    damaged = lines[:3] + ['{"step": 2, "ev\n'] + lines[3:5] + ["garbage\n", "\x00\x00\n"]
    path.write_text("".join(damaged))
    with pytest.raises(ValueError, match="line 4.*repair"):
        PrivacyLedger.read_journal(path)
    result = repair_journal(path)
    assert result.damaged_lines == (4, 7, 8) and result.charged == 2
    ledger = PrivacyLedger.read_journal(path)
    assert [e.step for e in ledger] == [0, 1, 2, 3, 4, 5]  # steps 0-3 readable, 4-5 charged for the lost lines
    assert len({e.event for e in ledger}) == 1


def test_repair_charges_a_lost_middle_entry_and_refuses_what_it_cannot_tell(tmp_path):
    path, lines = _journal(tmp_path, [1.0, 1.0, 1.0, 2.0, 2.0])
    path.write_text("".join(lines[:2] + ["xx\n"] + lines[3:]))  # step 1 lost between equal events
    assert repair_journal(path).charged == 1
    assert [e.step for e in PrivacyLedger.read_journal(path)] == [0, 1, 2, 3, 4]
    path.write_text("".join(lines[:4] + ["xx\n"] + lines[5:]))  # step 3 lost between σ 1 and σ 2: unknown
    with pytest.raises(ValueError, match="different events"):
        repair_journal(path)
    path.write_text("".join(["xx\n"] + lines[1:]))
    with pytest.raises(ValueError, match="header"):
        repair_journal(path)
