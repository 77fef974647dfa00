"""A full disk (ENOSPC, simulated by :func:`inject.full_disk`) at each write site of ``dpopt train``,
then ``dpopt train --resume`` once space is back; and ``dpopt report`` on a full disk.

Each fault: one ``error:`` line, exit 4 (docs: "Faults"), no traceback, no ``*.tmp``, every file written
before unchanged or whole; the resumed run is whole (conftest.assert_whole_run). A write that fails
before the first release leaves no run directory behind (the same ``--out`` works again). A run that
cannot resume (no checkpoint yet, or correlated noise) is never told to ``--resume``: the message, the
refused re-run and ``dpopt check`` say its journal's releases stay charged and a new run needs another
``--out``; ``--overwrite`` keeps that journal aside (warned).
"""

from __future__ import annotations

import json

import pytest
from inject import full_disk

from conftest import STEPS, TRAIN, assert_no_tmp, assert_one_line_error, assert_whole_run, invoke
from dpopt.accounting.ledger import JOURNAL_NAME, PrivacyLedger
from dpopt.training.checkpoint import load_checkpoint


@pytest.mark.parametrize(
    "site, skip, lost",
    [
        ("checkpoint.pt", 1, 4),  # the 2nd checkpoint (step 8): the run stops; the 1st (step 4) is intact
        ("ledger.jsonl", 2, 0),  # a journal append: cut back, the run stops at its last checkpoint
        ("metrics.jsonl", 0, 2),  # the epoch-end row (step 22): the last checkpoint is of step 20
        ("model.pt", 0, 0),
        ("summary.json", 0, 0),
    ],
)
def test_full_disk_while_training_then_resume(tmp_path, monkeypatch, site, skip, lost):
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        full_disk(m, site, skip=skip, budget=64)
        res = invoke(*TRAIN, "--out", str(out))
    assert_one_line_error(res, 4, f"{site}: No space left on device", "--resume")
    assert_no_tmp(out)
    assert not (out / site).exists() or site in ("ledger.jsonl", "checkpoint.pt", "metrics.jsonl")
    ckpt = load_checkpoint(out)  # whole: the atomic write never leaves a torn checkpoint
    journal = PrivacyLedger.load(out / "ledger.jsonl")  # whole: no torn line (an append is cut back)
    assert len(journal) >= ckpt["ledger_length"]
    for line in (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []:
        json.loads(line)
    if site not in ("model.pt", "summary.json"):  # stopped before summary.json: check says how it goes on
        check = invoke("check", str(out))
        assert check.exit_code == 2 and f"dpopt train --resume {out}" in check.output, check.output
    again = invoke("train", "--resume", str(out))
    assert again.exit_code == 0, again.output
    assert "Traceback" not in again.output and "UserWarning" not in again.output  # warnings: one plain line
    assert_whole_run(out, lost=lost)


@pytest.mark.parametrize("site, skip", [("config.json", 0), ("ledger.jsonl", 0)])
def test_full_disk_before_the_first_release_leaves_no_run(tmp_path, monkeypatch, site, skip):
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        full_disk(m, site, skip=skip)
        res = invoke(*TRAIN, "--out", str(out))
    assert_one_line_error(res, 4, "No space left on device")
    assert sorted(p.name for p in out.iterdir()) == []  # nothing half-made: the same --out is accepted again
    res = invoke(*TRAIN, "--out", str(out))
    assert res.exit_code == 0, res.output
    assert_whole_run(out)


def _assert_cannot_continue(text: str, out, releases: int, *reason: str) -> None:
    """``text`` says the run in ``out`` cannot continue, names its ``releases`` charged ones, offers no --resume."""
    assert "--resume" not in text, text
    for phrase in ("cannot continue", f"{releases} charged release(s)", "another --out", f"mv {out} {out}.failed"):
        assert phrase in text, text
    for phrase in reason:
        assert phrase in text, text


def test_full_disk_before_the_first_checkpoint_keeps_the_charged_journal_and_never_offers_resume(tmp_path, monkeypatch):
    """The user's report: `--epochs 1` checkpoints at its end only; the disk fills there, after 22 releases."""
    out = tmp_path / "run"
    args = ["train", "--method", "dp-sgd", "--epochs", "1", "--out", str(out)]
    with monkeypatch.context() as m:
        full_disk(m, "checkpoint.pt", budget=64)
        res = invoke(*args)
    line = assert_one_line_error(res, 4, "checkpoint.pt: No space left on device", "once there is space")
    _assert_cannot_continue(line, out, STEPS, "no checkpoint was written")
    assert len(PrivacyLedger.load(out / JOURNAL_NAME)) == STEPS
    assert not (out / "checkpoint.pt").exists()
    # the commands the old message led to: each refusal says the same, none offers --resume
    resumed = invoke("train", "--resume", str(out))
    assert resumed.exit_code == 2 and "no checkpoint" in resumed.output, resumed.output
    again = invoke(*args)
    line = assert_one_line_error(again, 2, "already holds a run", "stopped before its end")
    _assert_cannot_continue(line, out, STEPS)
    check = invoke("check", str(out))
    assert check.exit_code == 2 and "no summary.json" in check.output, check.output
    _assert_cannot_continue(check.output, out, STEPS, "no checkpoint was written")
    journal = (out / JOURNAL_NAME).read_text()
    # --overwrite keeps the charged journal aside (warned), then the new run is whole
    replaced = invoke(*args, "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    warning = [line for line in replaced.output.splitlines() if line.startswith("warning: overwrite")]
    assert len(warning) == 1 and f"held {STEPS} charged release(s)" in warning[0], replaced.output
    (aside,) = out.glob("ledger-replaced-*.jsonl")
    assert aside.read_text() == journal and aside.name in warning[0]
    assert len(PrivacyLedger.load(aside)) == STEPS
    assert_whole_run(out)


def test_full_disk_in_a_correlated_noise_run_never_offers_resume(tmp_path, monkeypatch):
    """BLT noise cannot resume (its stream is never saved): not even with a checkpoint on disk."""
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        full_disk(m, "checkpoint.pt", skip=1, budget=64)  # the 2nd checkpoint (step 8); the 1st (step 4) exists
        res = invoke(*TRAIN, "--noise-mechanism", "blt", "--out", str(out))
    line = assert_one_line_error(res, 4, "checkpoint.pt: No space left on device")
    assert (out / "checkpoint.pt").exists()
    _assert_cannot_continue(line, out, 8, "correlated-noise run (blt) cannot be resumed")
    check = invoke("check", str(out))
    assert check.exit_code == 2, check.output
    _assert_cannot_continue(check.output, out, 8, "correlated-noise run (blt)")


def test_a_plot_on_a_full_disk_warns_in_one_line_and_the_run_completes(tmp_path, monkeypatch):
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        full_disk(m, "curves.png")
        res = invoke(*TRAIN, "--out", str(out))
    assert res.exit_code == 0, res.output
    warning = [line for line in res.output.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "curves.png" in warning[0] and "No space left" in warning[0], res.output
    assert not (out / "curves.png").exists()
    assert_whole_run(out)


def _results(tmp_path):
    path = tmp_path / "results.jsonl"
    rows = [
        {"method": m, "label": m, "noise_multiplier": s, "seed": 0, "test_accuracy": a, "epsilon": e}
        for m, s, a, e in [("dp-sgd", 0.5, 0.8, 5.0), ("dp-sgd", 1.0, 0.7, 1.25), ("dp-adam", 0.5, 0.9, 5.0)]
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("site", ["table.md", "table.csv", "test_accuracy_vs_noise_multiplier.png"])
def test_report_on_a_full_disk_leaves_the_earlier_report_unchanged(tmp_path, monkeypatch, site):
    from conftest import digest

    results, out = _results(tmp_path), tmp_path / "report"
    assert invoke("report", str(results), "--out", str(out)).exit_code == 0
    before = digest(out)
    with monkeypatch.context() as m:
        full_disk(m, site, budget=10)
        res = invoke("report", str(results), "--out", str(out))
    assert_one_line_error(res, 4, site, "No space left on device")
    assert digest(out) == before  # no truncated PNG or table: the old files stay whole
    assert_no_tmp(out)
