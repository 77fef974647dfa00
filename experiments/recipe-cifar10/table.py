"""Table and plot of the recipe ablation (experiments/recipe-cifar10/run.py) from its run directories.

Reads ``RUNS/*/summary.json`` (finished runs) and ``RUNS/*/metrics.jsonl`` (every run, finished or
not: the per-epoch rows), writes into docs/results/recipe-cifar10/:

* ``results.jsonl``: one line per finished run (its summary, public values only, plus the arm);
* ``table.md``: per arm, test accuracy of the raw and of the EMA model (mean ± sample std over
  seeds, the seeds listed), ε, steps, wall time per run, and K× the per-step work;
* ``accuracy.png``: test accuracy (raw and EMA) against the epoch, per run.

Usage: ``python experiments/recipe-cifar10/table.py RUNS_DIR``
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "docs/results/recipe-cifar10"
ARM_ORDER = ["cnn5 K=1", "cnn5-ws K=1", "cnn5-ws K=1 +aug", "cnn5-ws K=2", "cnn5-ws K=1 4 epochs", "cnn5-ws K=4"]


def arm_of(name: str) -> str:
    model, rest = name.split("-k")
    k = rest.split("-")[0]
    return f"{model} K={k}" + (" +aug" if "-aug-" in name else "") + (" 4 epochs" if "-4ep-" in name else "")


def fmt(values: list) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def main(runs: Path) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    done, curves = [], {}
    for d in sorted(p for p in runs.iterdir() if p.is_dir()):
        if (d / "metrics.jsonl").exists():
            curves[d.name] = [json.loads(r) for r in (d / "metrics.jsonl").read_text().splitlines() if r.strip()]
        s = d / "summary.json"
        if s.exists():
            rec = json.loads(s.read_text())
            if rec.get("status", "completed") == "completed":
                rec.update(name=d.name, arm=arm_of(d.name))
                rec.pop("run_dir", None)
                done.append(rec)
    with open(OUT / "results.jsonl", "w") as fh:
        for rec in done:
            fh.write(json.dumps(rec) + "\n")
    lines = ["| arm | work (rows, × cnn5 K=1) | seeds | test accuracy (raw) | test accuracy (EMA 0.999) | ε | "
             "steps | wall s per run |", "|---|---|---|---|---|---|---|---|"]
    for arm in ARM_ORDER:
        rs = [r for r in done if r["arm"] == arm]
        if not rs:
            continue
        k = rs[0].get("augmentation_multiplicity", 1)
        work = k * rs[0]["steps"] / 156
        lines.append(f"| {arm} | {work:g}× | {', '.join(str(r['seed']) for r in rs)} | "
                     f"{fmt([r['test_accuracy'] for r in rs])} | {fmt([r['ema_test_accuracy'] for r in rs])} | "
                     f"{statistics.mean(r['epsilon'] for r in rs):.3f} | {rs[0]['steps']} | "
                     f"{statistics.mean(r['wall_seconds'] for r in rs):.0f} |")
    unfinished = sorted(set(curves) - {r["name"] for r in done})
    lines.append("")
    lines.append("Mean ± sample std over the seeds listed (one value: one seed). Test accuracy on the first 5,000 "
                 "CIFAR-10 test images; raw = the final parameters, EMA = their average from the same run "
                 "(post-processing, no extra privacy cost). Wall time on a 2-core machine shared with other jobs "
                 "(1 thread, nice 19): a measure of load as much as of cost.")
    if unfinished:
        lines.append("")
        lines.append("Not finished when this table was written: " + ", ".join(unfinished) + " (last rows: " + "; ".join(
            f"{n} epoch {curves[n][-1].get('epoch')} acc {curves[n][-1]['test_accuracy']:.4f} / EMA "
            f"{curves[n][-1].get('ema_test_accuracy', float('nan')):.4f}" for n in unfinished if curves[n]) + ").")
    (OUT / "table.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for name, rows in sorted(curves.items()):
        ep = [r["epoch"] for r in rows]
        axes[0].plot(ep, [r["test_accuracy"] for r in rows], marker="o", label=name)
        axes[1].plot(ep, [r.get("ema_test_accuracy", float("nan")) for r in rows], marker="o", label=name)
    for ax, title in zip(axes, ("raw parameters", "EMA of the parameters (0.999, warm-up)")):
        ax.set_xlabel("epoch")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (5,000 images)")
    axes[1].legend(fontsize=7)
    fig.suptitle("CIFAR-10 subset (N = 10,000), DP-SGD at ε = 8, B̄ = 128, 2 epochs")
    fig.tight_layout()
    fig.savefig(OUT / "accuracy.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/recipe-cifar10"))
