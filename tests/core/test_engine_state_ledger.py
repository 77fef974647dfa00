"""The ledger's run id: made once per run, kept by every copy of the ledger, absent from old files."""

from __future__ import annotations

import json
import re

import pytest
from dp_accounting import dp_event

from dpopt.accounting.ledger import PrivacyLedger


def _ledger(n: int = 3) -> PrivacyLedger:
    ledger = PrivacyLedger()
    event = dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.0))
    for step in range(n):
        ledger.record(step, event, max_grad_norm=1.0)
    return ledger


def test_run_id_is_fresh_uuid4_hex():
    a, b = PrivacyLedger(), PrivacyLedger()
    assert re.fullmatch(r"[0-9a-f]{32}", a.run_id)
    assert a.run_id[12] == "4"  # uuid version 4
    assert a.run_id != b.run_id


def test_run_id_kept_by_state_dict_and_dict_and_files(tmp_path):
    ledger = _ledger()
    other = PrivacyLedger()
    other.load_state_dict(ledger.state_dict())
    assert other.run_id == ledger.run_id and len(other) == 3
    assert PrivacyLedger.from_dict(ledger.to_dict()).run_id == ledger.run_id
    ledger.save(tmp_path / "ledger.json")
    assert json.loads((tmp_path / "ledger.json").read_text())["run_id"] == ledger.run_id
    assert PrivacyLedger.load(tmp_path / "ledger.json").run_id == ledger.run_id


def test_run_id_in_journal_header(tmp_path):
    ledger = _ledger(2)
    ledger.open_journal(tmp_path / "ledger.jsonl")
    ledger.flush()
    first = json.loads((tmp_path / "ledger.jsonl").read_text().split("\n")[0])
    assert first["run_id"] == ledger.run_id
    back = PrivacyLedger.read_journal(tmp_path / "ledger.jsonl")
    assert back.run_id == ledger.run_id and len(back) == 2


def test_old_files_without_run_id_load_as_none(tmp_path):
    data = _ledger().to_dict()
    del data["run_id"]
    old = PrivacyLedger.from_dict(data)
    assert old.run_id is None and len(old) == 3
    # loading an id-less state keeps the receiving ledger's id
    fresh = PrivacyLedger()
    rid = fresh.run_id
    fresh.load_state_dict(data)
    assert fresh.run_id == rid and len(fresh) == 3
    journal = tmp_path / "old.jsonl"
    lines = [
        json.dumps(
            {
                "format": "dpopt-ledger-journal",
                "version": 1,
                "entry_version": 2,
                "neighbouring": "add_or_remove_one",
                "sampling": "poisson",
                "noise": "secret",
                "dataset_size": "public",
            }
        )
    ]
    lines += [json.dumps(e) for e in data["entries"]]
    journal.write_text("\n".join(lines) + "\n")
    assert PrivacyLedger.read_journal(journal).run_id is None


def test_malformed_run_id_refused():
    with pytest.raises(ValueError, match="32 lowercase hex"):
        PrivacyLedger(run_id="run-1")
    data = _ledger().to_dict()
    data["run_id"] = 7
    with pytest.raises(ValueError, match="run_id"):
        PrivacyLedger.from_dict(data)


def test_autoflush_journal_holds_each_release_as_it_is_recorded(tmp_path):
    ledger = _ledger(2)
    ledger.open_journal(tmp_path / "j.jsonl", autoflush=True)
    ledger.flush()
    event = ledger.entries[0].event
    for step in range(2, 5):
        ledger.record(step, event, max_grad_norm=1.0)
        assert len(PrivacyLedger.read_journal(tmp_path / "j.jsonl")) == step + 1  # no flush() called
    assert ledger.unflushed == 0 and ledger.flush() == 0
