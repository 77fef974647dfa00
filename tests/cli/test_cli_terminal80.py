"""A terminal for people (issue 39): ``dpopt train --help``, the progress lines and the summary at 80 columns,
and the first progress line after ``--resume``.

Before (main 7967c13): ``COLUMNS=80 dpopt train --help`` was 339 lines, every help squeezed into ~20 characters
beside a 44-character name column (``--reproducible-noise / --no-reproducible-noise``); the status line (ε,
test metrics, batch loss; ~110 characters) and the summary line (~125) wrapped mid-figure; a resumed run's
first progress line showed the previous segment's ε and test metrics under the new step's number.
"""

import inspect
import json
import os
import signal
import subprocess
import sys
import warnings

import typer
from rich.cells import cell_len
from typer.testing import CliRunner

from dpopt.cli import app
from dpopt.cli.train import TRAIN_PANELS, progress_status, train_command
from dpopt.training import TrainConfig, train

runner = CliRunner()


def test_train_help_at_80_columns_is_grouped_and_readable():
    env = dict(os.environ, COLUMNS="80")
    env.pop("TERMINAL_WIDTH", None)
    res = subprocess.run(
        [sys.executable, "-m", "dpopt", "train", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) <= 185, len(lines)  # 339 before; 156 after grouping; 176 with 4 options added since
    assert all(cell_len(line) <= 80 for line in lines), max(lines, key=cell_len)  # B̄: a combining macron
    for panel in TRAIN_PANELS:
        assert any(f"─ {panel} ─" in line for line in lines), panel
    # the help column is wide enough for a phrase (it was ~20 characters: "F in [0, 1): hold" / "out")
    assert any("--validation-fraction" in line and "F in [0, 1): hold out round(F×N)" in line for line in lines)
    assert "--no-reproducible-noise" not in res.stdout and "--reproducible-noise" in res.stdout


def test_every_visible_train_option_is_in_one_panel():
    where = {}
    for panel, names in TRAIN_PANELS.items():
        for name in names:
            assert name not in where, name
            where[name] = panel
    for name, param in inspect.signature(train_command).parameters.items():
        info = param.default
        if isinstance(info, typer.models.ParameterInfo) and not info.hidden:
            assert info.rich_help_panel == where.get(name), name


def test_status_lines_fit_80_columns():
    info = {
        "step": 45,
        "steps": 67,
        "epsilon": 12.3456,
        "epsilon_bound": 13.3124,
        "accountant": "prv",
        "test_accuracy": 0.4417,
        "test_loss": 12.1765,
        "metrics_step": 44,
        "loss": 12.2934,
    }
    lines = progress_status(info).splitlines()
    assert lines == [
        "ε ≤ 13.312 (rdp bound; prv ε 12.346 at step 44)",
        "test acc 0.442  test loss 12.177  batch loss 12.293 (NOT private)",
    ]
    assert all(cell_len("  " + line) <= 80 for line in lines)


def _interrupted(tmp_path, at):
    def interrupt(info):
        if info["step"] == at:
            os.kill(os.getpid(), signal.SIGINT)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        s = train(TrainConfig(method="dp-sgd", epochs=2, accountant="rdp", out=str(tmp_path / "r")), on_step=interrupt)
    assert s["status"] == "interrupted" and s["steps"] == at
    return tmp_path / "r"


def test_resume_shows_no_earlier_step_numbers_and_the_summary_fits_80_columns(tmp_path, monkeypatch):
    run = _interrupted(tmp_path, 30)
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["train", "--resume", "r"])
    assert res.exit_code == 0, res.output
    printed = [line for line in res.stderr.splitlines() if line.startswith("step ")]
    # before: "step 31/44  ε <step 22's>  test acc <step 22's> ..." came first
    total = json.loads((run / "summary.json").read_text())["steps"]  # 45: rows at steps 22 (epoch 1) and 45
    assert [line.split()[1] for line in printed] == [f"{total}/{total}"], printed
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["step"] == total][-1]
    assert f"ε {last['epsilon']:.4f}" in printed[0]
    summary = res.stdout.splitlines()
    assert summary[0].startswith("dp-sgd on digits (mlp-small): test accuracy ") and "ε = " in summary[1]
    assert all(cell_len(line) <= 80 for line in summary), summary


def test_resumed_on_step_names_the_step_of_its_metrics(tmp_path):
    from dpopt.training import resume

    run = _interrupted(tmp_path, 30)
    seen = []
    resume(run, on_step=seen.append)
    # the earlier segment's row (step 30, written when it stopped): named by its step, not shown as step 31's
    assert seen[0]["step"] == 31 and seen[0]["metrics_step"] == 30
    assert "at step 30" in progress_status(seen[0]) and seen[-1]["metrics_step"] == seen[-1]["step"]
