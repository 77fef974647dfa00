"""Tables and plots from a sweep's results JSONL (``dpopt report RESULTS.jsonl``).

Post-processing of public values only: each record is a run's public summary
(test-set metrics of the released model, accountant output, configuration).

* :func:`summarize` — mean ± std (sample std, ddof = 1; 0 with one seed) of a
  metric over the records sharing a (row, column) cell, with the mean ε of the
  column's runs;
* :func:`write_report` — ``table.md`` (best mean per column in bold: highest
  for accuracies, lowest for losses and ε), ``table.csv``, and PNG plots:
  ``<metric>_vs_<x>.png`` for each of noise multiplier, ε and batch size that
  takes more than one value (one line per row value, error bars = std), and
  ``curves_by_epoch.png`` (test accuracy and ε against epoch from each run's
  ``metrics.jsonl``, mean over seeds, one panel per column value).

A field is looked up in the record, then in its ``point`` (the grid point);
``label`` is the sweep variant's label (the method name unless the config
sets one).
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

from ..atomic import atomic_savefig, atomic_write_text
from ..errors import ConfigError
from ..jsonio import loads
from .sweep import read_results

__all__ = ["Cell", "Table", "record_fields", "summarize", "format_markdown", "write_csv", "write_report", "field_value"]

_X_AXES = (("noise_multiplier", "noise multiplier σ"), ("epsilon", "ε"), ("expected_batch_size", "batch size B̄"))
_NAMES = {
    "noise_multiplier": "σ",
    "epsilon": "ε",
    "expected_batch_size": "B̄",
    "batch_size": "B̄",
    "target_epsilon": "target ε",
    "lr": "lr",
    "seed": "seed",
}


def field_value(record: dict, key: str) -> Any:
    """``record[key]``, else ``record["point"][key]``; ``batch_size`` also reads ``expected_batch_size``."""
    if key == "batch_size" and "expected_batch_size" in record:
        return record["expected_batch_size"]
    if key in record:
        return record[key]
    return (record.get("point") or {}).get(key)


def record_fields(records: Iterable[dict]) -> list:
    """The fields a table can be keyed by: every scalar (or list) field of the records and their points, sorted."""
    names: set = set()
    for rec in records:
        for source in (rec, rec.get("point") or {}):
            names.update(k for k, v in source.items() if v is not None and not isinstance(v, dict))
    if any("expected_batch_size" in n for n in names):
        names.add("batch_size")
    return sorted(names)


@dataclass
class Cell:
    values: list = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def std(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else 0.0


@dataclass
class Table:
    rows_key: str
    cols_key: str
    metric: str
    rows: list
    cols: list
    cells: dict  # (row, col) -> Cell
    epsilon: dict  # col -> mean ε of the column's runs

    def best(self, col) -> Optional[Any]:
        """The row with the best mean in ``col`` (highest, or lowest for losses and ε)."""
        cand = [(self.cells[(r, col)].mean, r) for r in self.rows if (r, col) in self.cells]
        if not cand:
            return None
        lower = "loss" in self.metric or "epsilon" in self.metric
        return (min if lower else max)(cand, key=lambda t: t[0])[1]


def _sortable(value):
    return (0, value) if isinstance(value, (int, float)) else (1, str(value))


def _hashable(value):
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value


def summarize(
    records: Iterable[dict], rows: str = "label", cols: str = "noise_multiplier", metric: str = "test_accuracy"
) -> Table:
    """Group records into (row, column) cells of ``metric`` (mean ± std over the remaining runs: the seeds).

    Raises:
        ConfigError: no record has the metric, or ``rows`` / ``cols`` is a field that no record has
            (every run would pool into one cell; the message lists the fields there are).
    """
    records = list(records)
    for key, arg in ((rows, "rows"), (cols, "cols")):
        if records and all(field_value(rec, key) is None for rec in records):
            raise ConfigError(
                f"{arg} {key!r} is a field of no record (every run would be pooled into one cell); "
                f"choose one of: {', '.join(record_fields(records))}",
                arg,
            )
    cells: dict = {}
    eps: dict = {}
    row_order: list = []
    for rec in records:
        value = field_value(rec, metric)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        r, c = _hashable(field_value(rec, rows)), _hashable(field_value(rec, cols))
        if r not in row_order:
            row_order.append(r)
        cells.setdefault((r, c), Cell()).values.append(float(value))
        e = rec.get("epsilon")
        if e is not None:
            eps.setdefault(c, []).append(float(e))
    if not cells:
        raise ConfigError(f"no record has a value for {metric!r}", "metric")
    col_order = sorted({c for _, c in cells}, key=_sortable)
    return Table(rows, cols, metric, row_order, col_order, cells, {c: statistics.fmean(v) for c, v in eps.items()})


def _value(c) -> str:
    return str(int(c)) if isinstance(c, float) and c.is_integer() and abs(c) >= 10 else str(c)


def _fmt(x: float, metric: str) -> str:
    return f"{x:.4f}" if abs(x) < 100 else f"{x:.1f}"


def format_markdown(table: Table) -> str:
    """The table as markdown: one column per column value, a row of ε, best mean per column in bold."""
    name = _NAMES.get(table.cols_key, table.cols_key)
    head = [table.rows_key] + [f"{name} = {_value(c)}" for c in table.cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if table.cols_key != "epsilon":
        lines.append(
            "| ε | " + " | ".join(f"{table.epsilon[c]:.3f}" if c in table.epsilon else "—" for c in table.cols) + " |"
        )
    best = {c: table.best(c) for c in table.cols}
    for r in table.rows:
        out = [str(r)]
        for c in table.cols:
            cell = table.cells.get((r, c))
            if cell is None:
                out.append("—")
                continue
            text = _fmt(cell.mean, table.metric)
            if cell.n > 1:
                text += f" ± {_fmt(cell.std, table.metric)}"
            if cell.n != max(x.n for x in table.cells.values()):
                text += f" (n={cell.n})"
            out.append(f"**{text}**" if best[c] == r else text)
        lines.append("| " + " | ".join(out) + " |")
    n = sorted({x.n for x in table.cells.values()})
    lines.append("")
    lines.append(
        f"{table.metric}: mean ± std over {'/'.join(map(str, n))} run(s) per cell (sample std; "
        "none shown for one run); ε: mean over the column's runs; bold: best mean per column."
    )
    return "\n".join(lines) + "\n"


def write_csv(table: Table, path: Union[str, Path]) -> None:
    """One line per cell: row, column, mean, std, n, ε of the column, best."""
    fh = io.StringIO(newline="")
    w = csv.writer(fh)
    w.writerow([table.rows_key, table.cols_key, f"{table.metric}_mean", f"{table.metric}_std", "n", "epsilon", "best"])
    for r in table.rows:
        for c in table.cols:
            cell = table.cells.get((r, c))
            if cell is None:
                continue
            w.writerow(
                [
                    r,
                    c,
                    repr(cell.mean),
                    repr(cell.std),
                    cell.n,
                    repr(table.epsilon.get(c, "")),
                    int(table.best(c) == r),
                ]
            )
    atomic_write_text(path, fh.getvalue())


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib: pip install 'dpopt[plots]'") from exc
    return plt


def _deltas(records: Sequence[dict]) -> str:
    """``δ = 1e-05`` (or ``δ = 1e-05, 1e-06`` when the runs differ; ``δ not recorded`` without any)."""
    values = sorted({float(d) for d in (field_value(r, "delta") for r in records) if d is not None})
    return "δ = " + ", ".join(f"{d:g}" for d in values) if values else "δ not recorded"


def _plot_vs(records: Sequence[dict], rows: str, metric: str, x: str, xlabel: str, path: Path) -> bool:
    groups: dict = {}
    for rec in records:
        xv, yv = field_value(rec, x), field_value(rec, metric)
        if xv is None or yv is None:
            continue
        key = x if x != "epsilon" else "noise_multiplier"  # ε: average the runs that share σ (and B̄)
        groups.setdefault(_hashable(field_value(rec, rows)), {}).setdefault(
            (field_value(rec, key), field_value(rec, "expected_batch_size")), []
        ).append((float(xv), float(yv)))
    xs = {round(float(field_value(r, x)), 6) for r in records if field_value(r, x) is not None}
    if len(xs) < 2:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.2), dpi=110)
    for label, cells in groups.items():
        pts = sorted(
            (
                statistics.fmean(p[0] for p in v),
                statistics.fmean(p[1] for p in v),
                statistics.stdev([p[1] for p in v]) if len(v) > 1 else 0.0,
            )
            for v in cells.values()
        )
        ax.errorbar(
            [p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3, label=str(label)
        )
    if x == "expected_batch_size":
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title(f"{metric.replace('_', ' ')} vs {xlabel} (mean ± std over seeds; ε at {_deltas(records)})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)
    return True


def _metrics_rows(record: dict, base: Optional[Path]) -> list[dict]:
    run_dir = record.get("run_dir")
    if not run_dir:
        return []
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file() and base is not None:
        path = base / run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("test_accuracy") is not None and not row.get("log"):
            rows.append(row)
    return rows


def _plot_epochs(records: Sequence[dict], rows: str, cols: str, path: Path, base: Optional[Path]) -> bool:
    data: dict = {}
    steps: dict = {}  # (column, row, epoch) -> its step
    for rec in records:
        mrows = _metrics_rows(rec, base)
        if not mrows:
            continue
        c, r = _hashable(field_value(rec, cols)), _hashable(field_value(rec, rows))
        for row in mrows:
            data.setdefault(c, {}).setdefault(r, {}).setdefault(float(row["epoch"]), []).append(
                (float(row["test_accuracy"]), float(row["epsilon"]))
            )
            steps.setdefault((c, r, float(row["epoch"])), row.get("step"))
    if not data:
        return False
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    # sub-epoch runs (every row before epoch 1, e.g. epochs 0.5): single points at fractional epochs read as
    # nothing; draw them against the step (integer ticks) with visible markers
    by_step = all(e < 1 for (_, _, e) in steps) and all(s is not None for s in steps.values())
    col_values = sorted(data, key=_sortable)[:6]
    fig, axes = plt.subplots(2, len(col_values), figsize=(4.2 * len(col_values), 6.5), dpi=100, squeeze=False)
    for j, c in enumerate(col_values):
        for r, by_epoch in data[c].items():
            ep = sorted(by_epoch)
            xs = [steps[(c, r, e)] for e in ep] if by_step else ep
            axes[0][j].plot(xs, [statistics.fmean(a for a, _ in by_epoch[e]) for e in ep], marker="o", label=str(r))
            axes[1][j].plot(xs, [statistics.fmean(b for _, b in by_epoch[e]) for e in ep], marker="o", label=str(r))
        axes[0][j].set_title(f"{_NAMES.get(cols, cols)} = {c}", fontsize=10)
        axes[1][j].set_xlabel("step (the runs are shorter than one epoch)" if by_step else "epoch")
        for ax in (axes[0][j], axes[1][j]):
            ax.grid(alpha=0.3)
            if by_step:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    axes[0][0].set_ylabel("test accuracy")
    axes[1][0].set_ylabel("ε spent")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"test accuracy and ε spent during training (mean over seeds; ε at {_deltas(records)})", fontsize=10)
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)
    return True


def write_report(
    results: Union[str, Path, Sequence[dict]],
    out: Union[str, Path],
    *,
    rows: str = "label",
    cols: str = "noise_multiplier",
    metric: str = "test_accuracy",
    where: Optional[dict] = None,
    plots: bool = True,
) -> dict:
    """Write ``table.md``, ``table.csv`` and the plots into ``out``; return ``{"table", "files"}``.

    Args:
        results: a results JSONL path (from ``dpopt sweep``) or its records.
        out: the output directory (created).
        rows, cols: the record fields for the table's rows and columns.
        metric: the summary field averaged over the runs of a cell (``test_accuracy``, ``test_loss``, ...).
        where: keep only records whose fields equal these values (compared as strings).
        plots: write the PNGs (needs matplotlib).

    Raises:
        FileNotFoundError: no results file. ConfigError: no usable records.
    """
    base = None
    if isinstance(results, (str, Path)):
        path = Path(results)
        if not path.is_file():
            raise FileNotFoundError(f"no results file at {path}")
        records = read_results(path)
        base = path.parent
    else:
        records = list(results)
    for key, value in (where or {}).items():
        records = [r for r in records if str(field_value(r, key)) == str(value)]
    if not records:
        raise ConfigError("no results to report" + (f" matching {where}" if where else ""))
    table = summarize(records, rows, cols, metric)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "table.md", format_markdown(table))
    write_csv(table, out / "table.csv")
    files = [out / "table.md", out / "table.csv"]
    if plots:
        for x, xlabel in _X_AXES:
            p = out / f"{metric}_vs_{x}.png"
            if _plot_vs(records, rows, metric, x, xlabel, p):
                files.append(p)
        p = out / "curves_by_epoch.png"
        if _plot_epochs(records, rows, cols, p, base):
            files.append(p)
    return {"table": table, "files": files}
