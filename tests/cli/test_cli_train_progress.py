"""dpopt train's progress display: the private batch loss (--show-train-loss) is shown without a terminal too
and keeps its NOT private label at 80 columns; before the first evaluation ε is not shown as 0.000."""

import io

from rich.console import Console
from typer.testing import CliRunner

from dpopt.cli import app
from dpopt.cli.common import status_progress
from dpopt.cli.train import progress_status
from dpopt.training import LOSS_EVERY, TrainConfig, train

runner = CliRunner()


def test_status_before_the_first_evaluation_has_no_epsilon_value():
    info = {
        "step": 1,
        "steps": 67,
        "epsilon": None,
        "test_accuracy": None,
        "test_loss": None,
        "epsilon_bound": 0.8123,
        "accountant": "pld",
    }
    assert progress_status(info) == "ε ≤ 0.812 (rdp bound; pld ε at the first evaluation)"
    assert progress_status(dict(info, epsilon_bound=None)) == "ε at the first evaluation"
    later = dict(info, epsilon=1.8725, test_accuracy=0.1389, test_loss=2.2623, loss=2.29, metrics_step=45)
    assert progress_status(later) == (
        "ε ≤ 0.812 (rdp bound; pld ε 1.873 at step 45)\ntest acc 0.139  test loss 2.262  batch loss 2.290 (NOT private)"
    )
    assert progress_status(dict(later, accountant="rdp")).startswith(
        "ε 0.812\ntest acc 0.139  test loss 2.262 (at step 45)"
    )


def test_the_status_is_not_cut_at_80_columns():
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system=None)
    progress = status_progress(console, disable=False)
    status = progress_status(
        {
            "epsilon": 2.1,
            "epsilon_bound": 2.3124,
            "accountant": "pld",
            "test_accuracy": 0.4417,
            "test_loss": 2.1765,
            "loss": 2.2934,
        }
    )
    task = progress.add_task("dp-macadam on digits", total=67, status=status)
    progress.update(task, completed=45)
    console.print(*progress.get_renderables())
    text = " ".join(out.getvalue().split())
    assert "batch loss 2.293 (NOT private)" in text and "…" not in text
    assert "45/67" in text and "dp-macadam on digits" in text
    assert all(len(line) <= 80 for line in out.getvalue().splitlines())


def test_a_run_directory_with_brackets_is_shown_as_text():
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=True, color_system=None)
    progress = status_progress(console, disable=False)
    progress.add_task("resuming runs/[red]x", total=3, status="ε 0.100")
    console.print(*progress.get_renderables())
    assert "resuming runs/[red]x" in out.getvalue()


def test_show_train_loss_without_a_terminal(tmp_path):
    res = runner.invoke(
        app, ["train", "--method", "dp-sgd", "--epochs", "1", "--show-train-loss", "--out", str(tmp_path / "run")]
    )
    assert res.exit_code == 0, res.output
    lines = [line for line in res.stderr.splitlines() if "batch loss" in line]
    steps = [int(line.split()[1].split("/")[0]) for line in lines]
    assert steps == list(range(1, 23, LOSS_EVERY))  # 22 steps: refreshed at steps 1, 11, 21
    assert all("(NOT private" in line for line in lines)
    for name in ("metrics.jsonl", "summary.json"):  # never written anywhere
        assert 'loss"' not in (tmp_path / "run" / name).read_text().replace('test_loss"', "")


def test_on_step_epsilon_is_none_before_the_first_row(tmp_path):
    seen = []
    train(TrainConfig(method="dp-sgd", epochs=1, batch_size=271, out=str(tmp_path / "r")), on_step=seen.append)
    assert [i["epsilon"] is None for i in seen] == [True] * 4 + [False]  # 5 steps, the row after the last
    assert seen[-1]["epsilon"] > 0
