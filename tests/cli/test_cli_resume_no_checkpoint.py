"""``dpopt train --resume DIR`` without ``DIR/checkpoint.pt``: exit 2, and the error names the directory searched,
what it holds, the file names a resumable run has (checkpoint.pt beside ledger.jsonl), and how to start a new run
instead (with the options of the run's config.json when it has one); a directory whose ledger.jsonl records
releases says that a new run's ledger starts at 0, so the data's total epsilon is both runs' together. Nothing is written."""

from __future__ import annotations

from typer.testing import CliRunner

from dpopt.cli import app

runner = CliRunner()


def _error(run_dir) -> str:
    res = runner.invoke(app, ["train", "--resume", str(run_dir)])
    assert res.exit_code == 2, res.output
    return " ".join(res.output.split())  # unwrapped


def test_resume_of_a_missing_directory(tmp_path):
    err = _error(tmp_path / "nowhere")
    assert f"error: --resume found no checkpoint in {tmp_path / 'nowhere'} (it does not exist)" in err
    assert "it looked for checkpoint.pt, which dpopt train writes beside ledger.jsonl every epoch" in err
    assert "start a new run: dpopt train with the options of the run you meant to resume and --out NEW_DIR." in err
    assert "--overwrite" not in err  # nothing there to overwrite
    assert not (tmp_path / "nowhere").exists()


def test_resume_of_a_directory_without_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "ledger.jsonl").write_text("")
    err = _error(tmp_path)
    assert f"no checkpoint in {tmp_path} (it holds config.json, ledger.jsonl)" in err
    assert f"dpopt train with the options in {tmp_path / 'config.json'} and --out NEW_DIR (--overwrite" in err
    assert "a new run's ledger starts at 0 (--overwrite moves that journal aside), so the data's total" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "ledger.jsonl"]


def test_resume_of_an_empty_directory(tmp_path):
    err = _error(tmp_path)
    assert f"no checkpoint in {tmp_path} (it is empty)" in err and "records releases" not in err


def test_resume_of_a_file(tmp_path):
    target = tmp_path / "README.md"
    target.write_text("not a run")
    err = _error(target)
    assert f"no checkpoint in {target} (it is a file, not a run directory)" in err
