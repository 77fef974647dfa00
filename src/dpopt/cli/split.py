"""Command ``dpopt split``: the budget split explorer (what adaptive clipping's count costs, by batch size).

Example::

    dpopt split --target-epsilon 4 --dataset-size 60000 --epochs 5 --batch-sizes 8,32,256,1024 --out split/

Prints one line per batch size — σ without adaptive clipping, σ_grad under the
σ_b = B̄/20 rule (``no solution`` where B̄/10 ≤ σ), σ_grad with the budget
share r, and the best share r* with its inflation — and writes
``split.png`` and ``split.html`` (one self-contained page with sliders) into
``--out``. The work is :func:`dpopt.accounting.split.split_table` and
:mod:`dpopt.reports`; this module parses and prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, cast

import typer

from ..atomic import check_writable_dir
from ..jsonio import dumps
from .common import ACCOUNTING_ERRORS, accountant_option, cli_errors, delta_option, fail, flags_for, json_option

group = typer.Typer()

SPLIT_FLAGS = flags_for(
    [
        "target_epsilon",
        "dataset_size",
        "epochs",
        "batch_sizes",
        "delta",
        "accountant",
        "count_share",
        "quantile_lr",
        "epsilon_grid",
        "batch_size",
    ],
    batch_size="--batch-sizes",
)


def _numbers(text: Optional[str], flag: str) -> Optional[list]:
    if text is None:
        return None
    try:
        return [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        fail(f"{flag} takes comma-separated numbers, e.g. 8,32,256; got {text!r}")


def _pct(x: Optional[float]) -> str:
    return "n.a." if x is None else f"{100 * x:+.2f}%"


@group.command("split")
def split(
    target_epsilon: float = typer.Option(..., "--target-epsilon", help="Target ε (> 0)."),
    dataset_size: int = typer.Option(..., "--dataset-size", help="N, the number of training records (public)."),
    epochs: float = typer.Option(..., "--epochs", help="Epochs; steps = ceil(epochs·N/B̄) per batch size."),
    batch_sizes: str = typer.Option(
        "8,32,64,128,256,1024,4096", "--batch-sizes", help="Comma-separated expected batch sizes B̄."
    ),
    out: Path = typer.Option(Path("split"), "--out", help="Directory for split.png and split.html."),
    delta: float = delta_option(1e-5, help="δ in (0, 1)."),
    accountant: str = accountant_option(),
    count_share: float = typer.Option(0.05, "--count-share", help="Budget share r in (0, 1) of the count release."),
    quantile_lr: float = typer.Option(0.2, "--quantile-lr", help="η_C of the clip-bound update (for the best share)."),
    epsilon_grid: Optional[str] = typer.Option(
        None, "--epsilon-grid", help="ε values calibrated for the page's slider (default ε·¼, ½, 1, 2, 4)."
    ),
    as_json: bool = json_option("Print one JSON object (the table and the grid)."),
) -> None:
    """Gradient noise with adaptive clipping's count release: the B̄/20 rule vs a budget share, by batch size."""
    from ..accounting.split import split_table
    from ..reports import write_split_html, write_split_png

    sizes = _numbers(batch_sizes, "--batch-sizes")
    grid = _numbers(epsilon_grid, "--epsilon-grid")
    with cli_errors(SPLIT_FLAGS):  # an unwritable --out is refused before the calibrations run
        check_writable_dir(out)
    with cli_errors(SPLIT_FLAGS, errors=ACCOUNTING_ERRORS, interrupted="split interrupted; nothing was written"):
        table = split_table(
            target_epsilon,
            dataset_size,
            epochs,
            cast(list, sizes),
            delta=delta,
            accountant=accountant,
            count_share=count_share,
            quantile_lr=quantile_lr,
            epsilon_grid=grid,
        )
    with cli_errors(SPLIT_FLAGS, errors=(OSError, ImportError)):
        out.mkdir(parents=True, exist_ok=True)
        html_path = write_split_html(table, out / "split.html")
        png_path = write_split_png(table, out / "split.png")
    if as_json:
        typer.echo(dumps({**table.to_dict(), "html": str(html_path), "png": str(png_path)}))
        return
    typer.echo(
        f"target epsilon = {table.target_epsilon:g}, delta = {table.delta:g}, N = {table.dataset_size}, "
        f"epochs = {table.epochs:g}, accountant = {table.accountant}; steps = ceil(epochs*N/B)"
    )
    header = (
        f"{'B':>7} {'steps':>7} {'sigma':>9} | {'B/20 rule: sigma_grad (r)':>28} | "
        f"{'share r=' + format(table.count_share, 'g') + ': sigma_grad':>24} | {'best r*: r, sigma_grad':>28}"
    )
    typer.echo(header)
    for r in table.rows:
        if r.noise_multiplier is None:
            typer.echo(f"{r.batch_size:>7g} {r.steps:>7d} {'n.a.':>9} | cannot calibrate: {r.error}")
            continue
        b20 = (
            f"{r.b20_grad_noise_multiplier:.5g} ({r.b20_count_share:.3g}) {_pct(r.inflation(r.b20_grad_noise_multiplier))}"
            if r.b20_solvable
            else f"NO SOLUTION (B/10 = {r.batch_size / 10:g} <= sigma)"
        )
        share = f"{r.share_grad_noise_multiplier:.5g} {_pct(r.inflation(r.share_grad_noise_multiplier))}"
        best = (
            f"{r.best_count_share:.3g}, {r.best_grad_noise_multiplier:.5g} "
            f"{_pct(r.inflation(r.best_grad_noise_multiplier))}"
        )
        typer.echo(
            f"{r.batch_size:>7g} {r.steps:>7d} {r.noise_multiplier:>9.5g} | {b20:>28} | {share:>24} | {best:>28}"
        )
    typer.echo(f"wrote {png_path} and {html_path}")
