"""``dpopt train --resume DIR`` without ``DIR/checkpoint.pt``: exit 2, and the error names the directory searched,
what it holds, the file names a resumable run has (checkpoint.pt beside ledger.jsonl), and how to start a new run
instead; a directory whose ledger.jsonl records releases says a new run's epsilon adds to them. Nothing is written."""

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
    assert "the same dpopt train command without --resume (with --out NEW_DIR, or --overwrite" in err
    assert not (tmp_path / "nowhere").exists()


def test_resume_of_a_directory_without_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "ledger.jsonl").write_text("")
    err = _error(tmp_path)
    assert f"no checkpoint in {tmp_path} (it holds config.json, ledger.jsonl)" in err
    assert "Its ledger.jsonl records releases already made: a new run's epsilon adds to them." in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "ledger.jsonl"]


def test_resume_of_an_empty_directory(tmp_path):
    err = _error(tmp_path)
    assert f"no checkpoint in {tmp_path} (it is empty)" in err and "records releases" not in err
