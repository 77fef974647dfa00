"""Commands ``dpopt sweep`` (a resumable grid of training runs) and ``dpopt report`` (tables and plots).

The work is :mod:`dpopt.experiments`'; these commands parse options, show
progress and print where the files went. torch is imported inside the
command bodies only.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from .common import cli_errors, fail

group = typer.Typer()


@group.command("sweep")
def sweep_command(
    config: str = typer.Argument(..., help="sweep config (TOML): [sweep], [base], [grid], [[variant]]"),
    jobs: int = typer.Option(
        1, help="runs in parallel worker processes (1: one after another, with per-step progress)"
    ),
    results: Optional[str] = typer.Option(None, help="results JSONL (default: OUT/results.jsonl from the config)"),
    out: Optional[str] = typer.Option(None, help="sweep directory (default: [sweep] out, else runs/sweeps/NAME)"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads per run (default: [sweep] threads)"),
    data_dir: Optional[str] = typer.Option(
        None,
        help="read the datasets from this directory instead of the "
        "config's data_dir (finished runs are still recognised)",
    ),
    dry_run: bool = typer.Option(False, help="list the runs and which are finished; train nothing"),
) -> None:
    """Run a grid of `dpopt train` runs; each finished run is appended to the results JSONL.

    Running the same command again skips finished runs (a killed sweep resumes; a run with a checkpoint is
    continued). Seeds fix model initialisation only: the noise is secret unless the config sets
    reproducible_noise (research only, no privacy).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..experiments.sweep import describe, load_sweep, read_results, run_sweep
    from .train import train_flags

    if jobs < 1:
        fail(f"--jobs must be >= 1, got {jobs}")
    if threads is not None and threads < 1:
        fail(f"--threads must be >= 1, got {threads}")
    console = Console(stderr=True)
    terminal = console.is_terminal
    if not terminal:
        console = Console(stderr=True, width=10_000, soft_wrap=True)
    with cli_errors(
        train_flags(),
        interrupted="sweep interrupted",
        after_interrupt="; finished runs are in the results file, run the command again to resume",
    ):
        if data_dir is not None and not Path(data_dir).is_dir():
            fail(f"--data-dir {data_dir} is not a directory")
        sweep = load_sweep(config, out=out, results=results, data_dir=data_dir)
        if dry_run:
            done = {r.get("run_id") for r in read_results(sweep.results)}
            for p in sweep.points:
                typer.echo(f"{'done' if p.run_id in done else 'todo'}  {describe(p)}  -> {sweep.run_dir(p)}")
            return
        if any(p.options.get("reproducible_noise") for p in sweep.points):
            console.print(
                "[bold red]warning:[/] reproducible_noise: noise and masks seeded from the seed; these "
                "runs have NO privacy guarantee (research only)"
            )
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not terminal,
        )
        state = {"task": None, "run": None, "done": 0, "total": 0, "t0": time.perf_counter()}

        def on_event(kind: str, info: dict) -> None:
            if kind == "start":
                state.update(done=info["done"], total=info["total"])
                console.print(
                    f"sweep {sweep.name}: {info['total']} runs, {info['done']} already finished, "
                    f"{info['todo']} to run; results -> {sweep.results}",
                    markup=False,
                )
                state["task"] = progress.add_task(
                    f"sweep {sweep.name}", total=info["total"], completed=info["done"], status=""
                )
            elif kind == "run" and jobs == 1:
                state["run"] = progress.add_task(describe(info["point"]), total=None, status="starting")
            elif kind == "step" and state["run"] is not None:
                status = f"ε {info['epsilon']:.3f}" if info.get("epsilon") is not None else ""
                if info.get("test_accuracy") is not None:
                    status += f"  test acc {info['test_accuracy']:.3f}"
                progress.update(state["run"], total=info["steps"], completed=info["step"], status=status)  # type: ignore[arg-type]
            elif kind == "finished":
                state["done"] += 1  # type: ignore[operator]
                rec = info["record"]
                if state["run"] is not None:
                    progress.remove_task(state["run"])  # type: ignore[arg-type]
                    state["run"] = None
                progress.update(state["task"], completed=state["done"])  # type: ignore[arg-type]
                val = f", val acc {rec['val_accuracy']:.4f}" if rec.get("val_accuracy") is not None else ""
                console.print(
                    f"[{state['done']}/{state['total']}] {describe(info['point'])}: test acc "
                    f"{rec['test_accuracy']:.4f}{val}, ε {rec['epsilon']:.3f}, "
                    f"{rec['wall_seconds']:.1f} s",
                    markup=False,
                )
            elif kind == "stopped":
                s = info["summary"]
                console.print(
                    f"run {describe(info['point'])} stopped ({s.get('status')}) after {s.get('steps')} "
                    "steps; run the sweep again to resume it",
                    markup=False,
                )

        with progress:
            outcome = run_sweep(sweep, jobs=jobs, threads=threads, on_event=on_event)
    typer.echo(
        f"sweep {sweep.name}: {outcome['ran']} run(s) finished now, {outcome['skipped']} skipped as already "
        f"finished, of {outcome['total']}; {time.perf_counter() - state['t0']:.1f} s; results: "  # type: ignore[operator]
        f"{sweep.results}"
    )
    if outcome["interrupted"]:
        raise typer.Exit(130)


def _parse_where(items: Optional[list[str]]) -> dict:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            fail(f"--where takes KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


@group.command("report")
def report_command(
    results: str = typer.Argument(..., help="results JSONL written by `dpopt sweep`"),
    out: str = typer.Option(..., help="directory for table.md, table.csv and the PNG plots"),
    rows: str = typer.Option(
        "label",
        help="field for the table's rows (label: the variant's label, else the method; or method, model, lr, ...)",
    ),
    cols: str = typer.Option(
        "noise_multiplier", help="field for the columns (noise_multiplier, expected_batch_size, target_epsilon, ...)"
    ),
    metric: str = typer.Option(
        "test_accuracy",
        help="summary field averaged over seeds (test_accuracy, test_loss, val_accuracy, val_loss, epsilon, ...)",
    ),
    where: Optional[list[str]] = typer.Option(None, help="keep only records with KEY=VALUE (repeatable)"),
    no_plots: bool = typer.Option(False, help="tables only (no matplotlib needed)"),
) -> None:
    """Tables (markdown, CSV: mean ± std over seeds, ε per column, best in bold) and plots from a sweep."""
    from ..experiments.report import format_markdown, write_report

    with cli_errors({"metric": "--metric", "rows": "--rows", "cols": "--cols"}):
        done = write_report(
            results, out, rows=rows, cols=cols, metric=metric, where=_parse_where(where), plots=not no_plots
        )
    sys.stdout.write(format_markdown(done["table"]))
    typer.echo("wrote " + ", ".join(str(p) for p in done["files"]))
