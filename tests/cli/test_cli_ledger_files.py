"""`dpopt check` / `dpopt ledger` on a run directory with both ledger files: the journal ``ledger.jsonl`` is
checked and scored, and ``ledger.json`` must say the same (a new-user review edited ``ledger.json`` eleven
ways and every copy passed). Also: the mechanism record's ``amplification`` label must match its fields."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.ledger_check import check_run
from dpopt.accounting.ledger_files import compare_ledger_files, first_disagreement
from dpopt.cli import app

BASE = ["train", "--dataset", "digits", "--epochs", "1", "--batch-size", "256", "--method", "dp-sgd"]


@pytest.fixture(scope="module")
def banded_run(tmp_path_factory):
    """digits, q = 0.5, banded:2 over cyclic Poisson sampling, σ = 2: 6 steps, 2 amplified rounds."""
    run_dir = tmp_path_factory.mktemp("files") / "run"
    args = BASE + ["--noise-multiplier", "2", "--noise-mechanism", "banded:2", "--sampling", "cyclic-poisson"]
    result = CliRunner().invoke(app, args + ["--sample-rate", "0.5", "--out", str(run_dir)])
    assert result.exit_code == 0, result.output
    return run_dir


def _copy(run_dir, tmp_path, name="copy"):
    out = tmp_path / name
    shutil.copytree(run_dir, out)
    return out


def _edit_snapshot(run_dir, edit) -> None:
    data = json.loads((run_dir / "ledger.json").read_text())
    edit(data)
    (run_dir / "ledger.json").write_text(json.dumps(data))


def _scale(d: dict, key: str, factor: float) -> None:
    d[key] = d[key] * factor


EDITS = {
    "sample_rate": lambda d: d["mechanism"].update(sample_rate=0.3),
    "drop_sample_rate": lambda d: d["mechanism"].pop("sample_rate"),
    "amplified_sensitivity": lambda d: _scale(d["mechanism"], "amplified_sensitivity", 0.5),
    "coefficient": lambda d: d["mechanism"]["strategy"]["coefficients"].__setitem__(1, 0.1),
    "sigma": lambda d: d["mechanism"].update(noise_multiplier=4.0),
    "event_sigma": lambda d: _scale(d["entries"][0]["event"]["event"], "noise_multiplier", 2.0),
    "min_separation": lambda d: d["mechanism"].update(min_separation=2),
    "drop_sensitivity_method": lambda d: d["mechanism"].pop("sensitivity_method"),
    "drop_amplification": lambda d: [d["mechanism"].pop(k) for k in ("amplification", "amplified_sensitivity")],
    "drop_mechanism": lambda d: d.pop("mechanism"),
    "delete_middle_entry": lambda d: d["entries"].pop(2),
    "delete_last_entry": lambda d: d["entries"].pop(),
}


def test_untouched_run_passes_and_names_both_files(banded_run):
    result = CliRunner().invoke(app, ["check", str(banded_run)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == "checked: ledger.jsonl, ledger.json"
    assert "(f) [PASS] Does ledger.json say what the journal ledger.jsonl says?" in result.output
    checked = check_run(banded_run)
    assert [i.key for i in checked.items][-1] == "ledger_files" and checked.passed
    assert checked.facts["ledger_files"] == ["ledger.jsonl", "ledger.json"]
    # the journal and ledger.json are the same parsed ledger; only ledger.json states δ (set at the stop)
    journal, snap = PrivacyLedger.load(banded_run / "ledger.jsonl"), PrivacyLedger.load(banded_run / "ledger.json")
    assert (journal.delta, snap.delta) == (None, 1e-5) and journal.entries == snap.entries
    assert journal.header() == {k: v for k, v in snap.header().items() if k != "delta"}
    ledger = CliRunner().invoke(app, ["ledger", str(banded_run)])
    assert ledger.exit_code == 0 and "(read ledger.jsonl)" in ledger.output and "warning" not in ledger.output


@pytest.mark.parametrize("name", sorted(EDITS))
def test_each_edit_of_ledger_json_fails_the_check(banded_run, tmp_path, name):
    run_dir = _copy(banded_run, tmp_path)
    _edit_snapshot(run_dir, EDITS[name])
    result = CliRunner().invoke(app, ["check", str(run_dir)])
    assert result.exit_code == 1, result.output
    assert "ledger.json disagrees with ledger.jsonl: " in result.output
    assert "RESULT: FAIL (ledger_files)" in result.output  # (a)-(e) still run on the journal, and pass
    ledger = CliRunner().invoke(app, ["ledger", str(run_dir)])
    assert ledger.exit_code == 0 and "warning: ledger.json disagrees with ledger.jsonl" in ledger.output


def test_the_first_disagreement_is_named(banded_run):
    journal = PrivacyLedger.load(banded_run / "ledger.jsonl")
    data = journal.to_dict()
    data["mechanism"]["sample_rate"] = 0.3
    assert first_disagreement(journal, PrivacyLedger.from_dict(data)) == (
        "ledger.json disagrees with ledger.jsonl: mechanism.sample_rate is 0.3 in ledger.json, 0.5 in ledger.jsonl"
    )
    data = journal.to_dict()
    data["entries"][4]["meta"]["noise_std"] = 1.0
    assert first_disagreement(journal, PrivacyLedger.from_dict(data)) == (
        "ledger.json disagrees with ledger.jsonl: entry 4 (step 4): meta.noise_std is 1.0 in ledger.json, "
        "2.0 in ledger.jsonl"
    )
    assert first_disagreement(journal, PrivacyLedger.from_dict(journal.to_dict())) is None


def test_a_prefix_written_at_an_earlier_stop_is_not_tampering(banded_run, tmp_path):
    """A run stopped after 4 releases (ledger.json + summary.json of 4 steps), resumed, and killed after 2 more
    (journal of 6): ledger.json is a prefix of the journal dated by the summary — a note, not a disagreement.
    The same prefix beside a summary of the journal's 6 steps (a completed run whose last entry was deleted
    from ledger.json) disagrees."""
    run_dir = _copy(banded_run, tmp_path)
    _edit_snapshot(run_dir, lambda d: d.update(entries=d["entries"][:4]))
    late = compare_ledger_files(run_dir, summary_steps=4)
    assert late.disagreement is None and "first 4 of the journal's 6 releases" in (late.note or "")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["steps"] = 4
    (run_dir / "summary.json").write_text(json.dumps(summary))
    checked = check_run(run_dir)
    assert checked["ledger_files"].passed
    assert checked["ledger_files"].evidence[0].startswith("note: ledger.json holds the first 4")
    assert not checked["releases"].passed  # the stale summary's 4 steps are not the journal's 6 releases
    bad = compare_ledger_files(run_dir, summary_steps=6)
    assert bad.disagreement is not None and "only the first 4 of the journal's 6" in bad.disagreement


def test_only_one_ledger_file_is_named(banded_run, tmp_path):
    run_dir = _copy(banded_run, tmp_path)
    (run_dir / "ledger.jsonl").unlink()
    result = CliRunner().invoke(app, ["check", str(run_dir)])
    assert result.exit_code == 0 and result.output.splitlines()[0] == "checked: ledger.json", result.output
    assert "(f)" not in result.output


def _edit_record_in_both(run_dir, edit) -> None:
    """Apply ``edit`` to the mechanism record of every journal header line and of ledger.json."""
    lines = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    for raw in lines:
        if "format" in raw:
            edit(raw["mechanism"])
    (run_dir / "ledger.jsonl").write_text("".join(json.dumps(raw) + "\n" for raw in lines))
    _edit_snapshot(run_dir, lambda d: edit(d["mechanism"]))


def test_amplification_label_must_match_the_record(tmp_path):
    """An unamplified BLT run (cyclic batches, no sample rate) records amplification "none"; relabelling it as the
    banded Thm-4 analysis (in both files, so the files agree) fails the mechanism re-derivation (b)."""
    run_dir = tmp_path / "run"
    args = BASE + ["--noise-multiplier", "2", "--noise-mechanism", "blt", "--sampling", "cyclic"]
    result = CliRunner().invoke(app, args + ["--out", str(run_dir)])
    assert result.exit_code == 0, result.output
    rec = PrivacyLedger.load(run_dir / "ledger.jsonl").mechanism
    assert rec["amplification"] == "none" and "sample_rate" not in rec
    # the run's summary line says what its ε reads: b = round(1437/256) = 6 cyclic batches, not a rate q
    assert "σ = 2, cyclic batches, b = 6, no amplification" in result.output and "q = " not in result.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["sampling"], summary["min_separation"]) == ("cyclic", rec["min_separation"]) == ("cyclic", 6)
    assert check_run(run_dir).passed
    _edit_record_in_both(run_dir, lambda m: m.update(amplification="cyclic-poisson (arXiv 2306.08153, Thm 4)"))
    checked = check_run(run_dir)
    assert checked.failures == ["noise"], checked.format()
    assert "recorded amplification 'cyclic-poisson (arXiv 2306.08153, Thm 4)' != 'none'" in checked.format()


def test_a_journal_torn_by_a_crash_is_read_once_and_named(banded_run, tmp_path):
    """A crash mid-flush leaves the journal's last line cut short: it is dropped with ONE warning (the journal is
    parsed once per command, not once per check), and ledger.json's extra release is named — exit 1, no
    traceback."""
    import warnings

    run_dir = _copy(banded_run, tmp_path)
    text = (run_dir / "ledger.jsonl").read_text()
    (run_dir / "ledger.jsonl").write_text(text[:-20])  # the last entry's line without its end
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        checked = check_run(run_dir)
    torn = [w for w in seen if "dropped an incomplete last line" in str(w.message)]
    assert len(torn) == 1, [str(w.message) for w in seen]
    assert checked.failures[-1] == "ledger_files"
    assert checked["ledger_files"].evidence == (
        "ledger.json disagrees with ledger.jsonl: ledger.json holds 6 releases, the journal only 5",
    )
    result = CliRunner().invoke(app, ["check", str(run_dir)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "ledger.json holds 6 releases, the journal only 5" in result.output
    # with ledger.json gone (the crash came before the stop) the journal alone is checked
    (run_dir / "ledger.json").unlink()
    result = CliRunner().invoke(app, ["ledger", str(run_dir)])
    assert result.exit_code == 0 and "(read ledger.jsonl): 5 releases" in result.output, result.output


def test_the_journal_file_itself_is_read_by_the_one_ledger_reader(banded_run, tmp_path):
    """`dpopt ledger RUN/ledger.jsonl` reads the journal (the CLI's pre-check used to parse it as one JSON
    document and refused it as "not valid JSON"); a damaged journal line is named in one error line."""
    run_dir = _copy(banded_run, tmp_path)
    journal = run_dir / "ledger.jsonl"
    result = CliRunner().invoke(app, ["ledger", str(journal), "--delta", "1e-5"])
    assert result.exit_code == 0, result.output
    assert f"ledger {journal}" in result.output and ": 6 releases" in result.output
    lines = journal.read_text().split("\n")
    lines[2] = lines[2][:10]  # a line before the last cut short: a damaged journal
    journal.write_text("\n".join(lines))
    for command in (["ledger", str(journal), "--delta", "1e-5"], ["check", str(run_dir)]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert result.stderr.startswith(f"error: {journal}") and "line 3: not a readable ledger entry" in result.stderr
