"""A full disk (ENOSPC, simulated by :func:`inject.full_disk`) at each write site of ``dpopt train``,
then ``dpopt train --resume`` once space is back; and ``dpopt report`` on a full disk.

Each fault: one ``error:`` line, exit 4 (docs: "Faults"), no traceback, no ``*.tmp``, every file written
before unchanged or whole; the resumed run is whole (conftest.assert_whole_run). A write that fails
before the first release leaves no run directory behind (the same ``--out`` works again).
"""

from __future__ import annotations

import json

import pytest
from inject import full_disk

from conftest import TRAIN, assert_no_tmp, assert_one_line_error, assert_whole_run, invoke
from dpopt.accounting.ledger import PrivacyLedger
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
