"""Table and plots of the recipe ablation (experiments/recipe-cifar10/run.py) from its run directories.

Reads ``RUNS/*/summary.json`` (finished runs) and ``RUNS/*/metrics.jsonl`` (every run, finished or
not: the per-epoch rows) and merges them with what an earlier call kept in docs/results/recipe-cifar10/
(a run directory wins over a kept record of the same name), then writes there:

* ``results.jsonl``: one line per finished run (its summary, public values only, plus the arm);
* ``curves.jsonl``: one line per run with its metrics rows (so the plots survive the run directories);
* ``table.md``: per arm, held-out accuracy of the raw and of the EMA parameters (mean ± sample std
  over seeds, the seeds listed), the EMA's gain, ε, steps, wall time per run, and the work per run
  (view rows processed) relative to ``cnn5-ws K=1``;
* ``accuracy-main.png``, ``accuracy-long.png``: held-out accuracy (raw and EMA) against the step,
  mean over each arm's seeds, per group (a group without curves keeps its existing plot).

Usage: ``python experiments/recipe-cifar10/table.py [RUNS_DIR]`` (default runs/recipe-cifar10-v2)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import ARMS, GROUPS, LONG  # noqa: E402  (the arms' names, labels and sizes)

ALL = ARMS + LONG

OUT = Path(__file__).resolve().parents[2] / "docs/results/recipe-cifar10"
LABEL = {stem: label for stem, label, *_ in ALL}
WORK = {stem: k * b * steps / (128 * 600) for stem, _, _, k, _, b, steps, _ in ALL}  # view rows, relative to ws K=1


BASELINE = {stem: ("ws-k1-long" if any(stem == st for st, *_ in LONG) else "ws-k1") for stem, *_ in ALL}
"""The paired differences: against cnn5-ws K=1's run of the same seed and horizon (600 or 1200 steps)."""


def stem_of(name: str) -> str:
    return name.rsplit("-s", 1)[0]


def fmt(values: list) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def load(runs: Path) -> tuple[list, dict]:
    """(finished runs' records, name → metrics rows): the kept ones in OUT, then RUNS's (which win)."""
    done = {}
    curves = {}
    if (OUT / "results.jsonl").exists():
        done = {r["name"]: r for r in map(json.loads, (OUT / "results.jsonl").read_text().splitlines()) if r}
    if (OUT / "curves.jsonl").exists():
        curves = {c["name"]: c["rows"] for c in map(json.loads, (OUT / "curves.jsonl").read_text().splitlines()) if c}
    for d in sorted(p for p in runs.iterdir() if p.is_dir()) if runs.exists() else []:
        if (d / "metrics.jsonl").exists():
            curves[d.name] = [json.loads(r) for r in (d / "metrics.jsonl").read_text().splitlines() if r.strip()]
        s = d / "summary.json"
        if s.exists():
            rec = json.loads(s.read_text())
            if rec.get("status", "completed") == "completed":
                rec.update(name=d.name, arm=LABEL[stem_of(d.name)])
                rec.pop("run_dir", None)
                done[d.name] = rec
    return sorted(done.values(), key=lambda r: r["name"]), curves


def _wall(rs: list) -> str:
    """Mean wall seconds of the runs that ran in one segment (a resumed run's summary times its last segment)."""
    whole = [r["wall_seconds"] for r in rs if len(r.get("segments", [])) == 1]
    return f"{statistics.mean(whole):.0f}" if whole else "(resumed)"


def table(done: list, curves: dict) -> list[str]:
    base = {(stem_of(r["name"]), r["seed"]): r["test_accuracy"] for r in done}
    lines = [
        "| arm | work per run | seeds | held-out accuracy, raw | held-out accuracy, EMA | EMA − raw | "
        "Δ raw vs cnn5-ws K=1, same seed and steps | ε | steps | wall s per run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stem, label, *_ in ALL:
        rs = sorted((r for r in done if stem_of(r["name"]) == stem), key=lambda r: r["seed"])
        if not rs:
            continue
        raw, ema = [r["test_accuracy"] for r in rs], [r["ema_test_accuracy"] for r in rs]
        eps = [r["epsilon"] for r in rs]
        eps_s = f"{min(eps):.3f}" if max(eps) - min(eps) < 5e-4 else f"{min(eps):.3f}–{max(eps):.3f}"
        lines.append(
            f"| {label} | {WORK[stem]:g}× | {', '.join(str(r['seed']) for r in rs)} | {fmt(raw)} | "
            f"{fmt(ema)} | {fmt([e - a for e, a in zip(ema, raw)])} | "
            f"{fmt([r['test_accuracy'] - base[BASELINE[stem], r['seed']] for r in rs if (BASELINE[stem], r['seed']) in base])} | "
            f"{eps_s} | {', '.join(sorted({str(r['steps']) for r in rs}))} | "
            f"{_wall(rs)} |"
        )
    unfinished = sorted(set(curves) - {r["name"] for r in done})
    lines += [
        "",
        "Mean ± sample std over the seeds listed (one value: one seed). Held-out accuracy on 11,000 "
        "images never trained on (CIFAR-10 training records 40,000–49,999 and the 1,000 test images of "
        "cifar10.npz); raw = the final parameters, EMA = their exponential average from the same run "
        "(post-processing: no extra privacy cost). Δ: the arm's raw accuracy minus that of cnn5-ws K=1 with the "
        "same seed and number of steps (model initialisation and augmentation draws; the Poisson sampling and the noise are never seeded). Steps: "
        "releases in the ledger (a run that trained steps twice after a kill lists more). Work = view rows per step × steps, relative to "
        "cnn5-ws K=1. Wall time: one thread per run, two runs at a time on a 2-core machine, mean over the "
        "runs that were not interrupted and resumed.",
    ]
    if unfinished:
        lines += [
            "",
            "Not finished when this table was written: "
            + "; ".join(
                f"{n} (step {curves[n][-1].get('step')}: {curves[n][-1]['test_accuracy']:.4f} / EMA "
                f"{curves[n][-1].get('ema_test_accuracy', float('nan')):.4f})"
                for n in unfinished
                if curves[n]
            )
            + ".",
        ]
    return lines


def plot(curves: dict, group: str) -> None:
    """``accuracy-{group}.png`` from the curves of the group's arms (nothing if it has none)."""
    arms = GROUPS[group]
    if not any(stem_of(name) == stem for name in curves for stem, *_ in arms):
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for stem, label, *_ in arms:
        runs = [rows for name, rows in curves.items() if stem_of(name) == stem and rows]
        if not runs:
            continue
        steps = sorted({r["step"] for rows in runs for r in rows})
        for ax, key in zip(axes, ("test_accuracy", "ema_test_accuracy")):
            ys = []
            for s in steps:
                vals = [r[key] for rows in runs for r in rows if r["step"] == s and key in r]
                ys.append(statistics.mean(vals) if vals else float("nan"))
            ax.plot(steps, ys, marker="o", ms=3, label=f"{label} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
    for ax, title in zip(axes, ("raw parameters", "EMA of the parameters (0.999, warm-up)")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy (11,000 images)")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle("CIFAR-10 (N = 10,000 training images), DP-SGD at ε = 8: mean over seeds")
    fig.tight_layout()
    fig.savefig(OUT / f"accuracy-{group}.png", dpi=110)


def main(runs: Path) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    done, curves = load(runs)
    with open(OUT / "results.jsonl", "w") as fh:
        for rec in done:
            fh.write(json.dumps(rec) + "\n")
    with open(OUT / "curves.jsonl", "w") as fh:
        for name in sorted(curves):
            fh.write(json.dumps({"name": name, "rows": curves[name]}) + "\n")
    (OUT / "table.md").write_text("\n".join(table(done, curves)) + "\n")
    for group in GROUPS:
        plot(curves, group)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/recipe-cifar10-v2"))
