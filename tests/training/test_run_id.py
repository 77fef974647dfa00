"""Run ids of run directories (issue 19, item 5): in the ledger header and summary.json, kept by resume;
a checkpoint of another run refused; a journal longer than the checkpoint charged in full; copies of a
run directory resumed in two places caught by `dpopt check A B`."""

import json
import os
import shutil
import signal

import pytest
import torch
from typer.testing import CliRunner

from dpopt.accounting.accountant import epsilon
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.ledger_check import check_run, repeated_run_ids
from dpopt.cli import app
from dpopt.training import TrainConfig, resume, train

runner = CliRunner()


def _interrupted(out, at=4):
    def interrupt(info):
        if info["step"] == at:
            os.kill(os.getpid(), signal.SIGINT)

    s = train(TrainConfig(method="dp-sgd", epochs=0.5, accountant="rdp", out=str(out)), on_step=interrupt)
    assert s["status"] == "interrupted"
    return s


def test_run_id_in_summary_and_ledger_and_kept_by_resume(tmp_path):
    out = tmp_path / "r"
    first = _interrupted(out)
    run_id = first["ledger_run_id"]
    assert len(run_id) == 32 and int(run_id, 16) >= 0
    assert json.loads((out / "summary.json").read_text())["ledger_run_id"] == run_id
    assert PrivacyLedger.load(out).run_id == run_id
    assert torch.load(out / "checkpoint.pt", weights_only=False)["run_id"] == run_id
    done = resume(out)
    assert done["ledger_run_id"] == run_id and PrivacyLedger.load(out).run_id == run_id
    assert json.loads((out / "summary.json").read_text())["ledger_run_id"] == run_id and check_run(out).passed
    other = train(TrainConfig(method="dp-sgd", epochs=0.1, accountant="rdp", out=str(tmp_path / "o")))
    assert other["ledger_run_id"] != run_id  # a new run, a new id


def test_summary_of_another_run_fails_the_check(tmp_path):
    out = tmp_path / "r"
    train(TrainConfig(method="dp-sgd", epochs=0.1, accountant="rdp", out=str(out)))
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps(dict(summary, ledger_run_id="0" * 32)))
    result = check_run(out)
    assert result.failures == ["composition"]
    assert any("different runs" in e for e in result["composition"].evidence)


def test_checkpoint_of_another_run_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _interrupted(a)
    _interrupted(b)
    shutil.copy(b / "checkpoint.pt", a / "checkpoint.pt")
    journal = (a / "ledger.jsonl").read_bytes()
    with pytest.raises(ValueError, match="belongs to run"):
        resume(a)
    assert (a / "ledger.jsonl").read_bytes() == journal  # nothing rewritten


def test_older_checkpoint_warns_and_every_journaled_release_stays_charged(tmp_path):
    """Put back the checkpoint of step 4 after the run went on to step 8: the 4 releases after it stay."""
    out = tmp_path / "r"
    _interrupted(out, at=4)
    old = (out / "checkpoint.pt").read_bytes()
    resumed = _resume_until(out, 8)
    assert resumed["steps"] == 8
    (out / "checkpoint.pt").write_bytes(old)  # an older checkpoint (or a branch taken from it)
    with pytest.warns(UserWarning, match="an older checkpoint put back"):
        done = resume(out)
    ledger = PrivacyLedger.load(out)
    assert done["lost_steps"] == 4 and done["steps"] == len(ledger) == 8 + 7  # 4 -> 11 again: 7 more releases
    assert done["epsilon"] == pytest.approx(epsilon(ledger, 1e-5, "rdp"), rel=1e-9)
    assert check_run(out).passed


def _resume_until(out, step):
    def interrupt(info):
        if info["step"] == step:
            os.kill(os.getpid(), signal.SIGINT)

    return resume(out, on_step=interrupt)


def test_copied_run_directory_resumed_twice_fails_check_of_both(tmp_path):
    """Each copy passes its own check; `dpopt check A B` sees one run id, two branches: exit 1, and the
    combined ε (shared releases once, both branches' own) is above either copy's."""
    a, b = tmp_path / "a", tmp_path / "b"
    _interrupted(a, at=4)
    shutil.copytree(a, b)
    sa, sb = resume(a), resume(b)
    assert sa["ledger_run_id"] == sb["ledger_run_id"]
    assert check_run(a).passed and check_run(b).passed
    res = runner.invoke(app, ["check", str(a), str(b)])
    assert res.exit_code == 1, res.output
    assert f"share run id {sa['ledger_run_id']} and DIVERGE after 4 shared releases" in res.output
    js = runner.invoke(app, ["check", str(a), str(b), "--json"])
    doc = json.loads(js.stdout)
    assert js.exit_code == 1 and doc["passed"] is False
    (group,) = doc["repeated_run_ids"]
    assert group["diverged"] and group["shared_releases"] == 4 and group["combined_releases"] == 4 + 7 + 7
    la, lb = PrivacyLedger.load(a), PrivacyLedger.load(b)
    union = PrivacyLedger(run_id=la.run_id)
    for e in list(la.entries) + list(lb.entries[4:]):
        union.record(e.step, e.event, **e.meta)
    assert group["combined_epsilon"] == pytest.approx(epsilon(union, 1e-5, "rdp"), rel=1e-12)
    assert group["combined_epsilon"] > max(sa["epsilon"], sb["epsilon"])
    assert runner.invoke(app, ["check", str(a)]).exit_code == 0  # alone, each copy passes


def test_a_plain_copy_is_a_note_not_a_failure(tmp_path):
    a = tmp_path / "a"
    train(TrainConfig(method="dp-sgd", epochs=0.2, accountant="rdp", out=str(a)))
    shutil.copytree(a, tmp_path / "backup")
    other = tmp_path / "other"
    train(TrainConfig(method="dp-sgd", epochs=0.2, accountant="rdp", out=str(other)))
    res = runner.invoke(app, ["check", str(a), str(tmp_path / "backup"), str(other)])
    assert res.exit_code == 0, res.output
    assert res.output.count("RESULT: PASS") == 3 and "note:" in res.output and "copies of one run" in res.output
    assert str(other) not in res.output.split("note:")[1]


def test_repeated_run_ids_ignores_ledgers_without_an_id():
    old1, old2 = PrivacyLedger(run_id=None), PrivacyLedger(run_id=None)
    old1.run_id = old2.run_id = None  # files written before run ids
    assert repeated_run_ids({"x": old1, "y": old2}) == []
