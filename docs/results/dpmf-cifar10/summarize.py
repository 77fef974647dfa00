"""Table and plot of the dpmf-cifar10 runs (run.py): tuning record, chosen-lr accuracy per seed and mean, σ.

    python docs/results/dpmf-cifar10/summarize.py RUNS docs/results/dpmf-cifar10

Reads RUNS/results.jsonl (one line per finished run, written by run.py); writes OUT/results.jsonl (the
same lines, sorted), OUT/results.md and OUT/test_accuracy.png. The chosen lr of a cell (epochs, ε,
method, mechanism) is the seed-0 run with the best validation accuracy (ties: the larger lr, as run.py);
the table averages the seeds run at it.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MECHS = ("independent", "banded:4", "blt")
METHODS = ("dp-sgd", "dp-adam", "dp-macadam", "dp-muon")
LABELS = {"dp-sgd": "DP-SGD", "dp-adam": "DP-Adam", "dp-macadam": "DP-MacAdam", "dp-muon": "DP-Muon"}


def load(path: Path) -> list[dict]:
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[r["run"]] = r  # a run appended twice (never expected): the last line
    order = lambda r: (r["epochs"], r["target_epsilon"], METHODS.index(r["method"]), MECHS.index(r["mechanism"]))  # noqa: E731
    return sorted(rows.values(), key=lambda r: (*order(r), r["seed"], r["lr"]))


def cells(rows: list[dict]) -> dict:
    """(epochs, ε, method, mechanism) → {"lr": chosen lr or None, "tuning": [seed-0 rows], "seeds": {seed: row}}."""
    out: dict = defaultdict(lambda: {"tuning": [], "seeds": {}, "lr": None})
    for r in rows:
        if r["seed"] == 0:
            out[(r["epochs"], r["target_epsilon"], r["method"], r["mechanism"])]["tuning"].append(r)
    for c in out.values():
        c["lr"] = max((r["val_accuracy"], r["lr"]) for r in c["tuning"])[1]
    for r in rows:
        c = out[(r["epochs"], r["target_epsilon"], r["method"], r["mechanism"])]
        if r["lr"] == c["lr"]:
            c["seeds"][r["seed"]] = r
    return out


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def main_table(cs: dict) -> list[str]:
    out = [
        "## Test accuracy at the chosen lr (11,000 evaluation images), mean over the seeds run at it\n",
        "Chosen lr in brackets († at an end of the 2-value grid); per-seed values after the mean; "
        "**bold**: best mechanism of the row; Δ: best correlated − independent.\n",
        "| epochs | ε | method | independent | banded:4 | blt | Δ |",
        "|---|---|---|---|---|---|---|",
    ]
    for ep, eps, meth in sorted({(k[0], k[1], k[2]) for k in cs}, key=lambda t: (t[0], t[1], METHODS.index(t[2]))):
        vals = {}
        for m in MECHS:
            c = cs.get((ep, eps, meth, m))
            if c and c["lr"] is not None and c["seeds"]:
                vals[m] = (mean([r["test_accuracy"] for r in c["seeds"].values()]), c)
        if not vals:
            continue
        best = max(v[0] for v in vals.values())
        cols = []
        for m in MECHS:
            if m not in vals:
                cols.append("—")
                continue
            a, c = vals[m]
            tried = sorted(r["lr"] for r in c["tuning"])
            edge = "†" if len(tried) > 1 and c["lr"] in (tried[0], tried[-1]) else ""
            seeds = " / ".join(f"{c['seeds'][s]['test_accuracy']:.3f}" for s in sorted(c["seeds"]))
            txt = f"{a:.4f} ({c['lr']:g}{edge}; n={len(c['seeds'])}: {seeds})"
            cols.append(f"**{txt}**" if a == best and len(vals) > 1 else txt)
        corr = [vals[m][0] for m in ("banded:4", "blt") if m in vals]
        delta = f"{max(corr) - vals['independent'][0]:+.4f}" if corr and "independent" in vals else "—"
        out.append(f"| {ep:g} | {eps:g} | {meth} | " + " | ".join(cols) + f" | {delta} |")
    return out + [""]


def sigma_table(rows: list[dict]) -> list[str]:
    out = [
        "## Calibrated σ (noise multiplier) and the ledger's ε per mechanism\n",
        "| epochs | steps | ε target | σ independent | σ banded:4 | σ blt | ε ledger (ind / banded / blt) |",
        "|---|---|---|---|---|---|---|",
    ]
    for ep, eps in sorted({(r["epochs"], r["target_epsilon"]) for r in rows}):
        rs = {
            m: next((r for r in rows if (r["epochs"], r["target_epsilon"], r["mechanism"]) == (ep, eps, m)), None)
            for m in MECHS
        }
        steps = next(r["steps"] for r in rs.values() if r)
        sig = [f"{rs[m]['noise_multiplier']:.3f}" if rs[m] else "—" for m in MECHS]
        ep_l = " / ".join(f"{rs[m]['epsilon']:.4f}" if rs[m] else "—" for m in MECHS)
        out.append(f"| {ep:g} | {steps} | {eps:g} | " + " | ".join(sig) + f" | {ep_l} |")
    return out + [""]


def every_run(rows: list[dict], cs: dict) -> list[str]:
    out = [
        "## Every run (tuning at seed 0, the chosen lr ✓ at the other seeds)\n",
        "| epochs | ε | method | mechanism | lr | seed | chosen | σ | ε ledger | val | test | wall s | CPU s | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        chosen = "✓" if cs[(r["epochs"], r["target_epsilon"], r["method"], r["mechanism"])]["lr"] == r["lr"] else ""
        out.append(
            f"| {r['epochs']:g} | {r['target_epsilon']:g} | {r['method']} | {r['mechanism']} | {r['lr']:g} | "
            f"{r['seed']} | {chosen} | {r['noise_multiplier']:.3f} | {r['epsilon']:.4f} | {r['val_accuracy']:.4f} | "
            f"{r['test_accuracy']:.4f} | {r['wall_seconds']:.1f} | {r['cpu_seconds']:.1f} | "
            f"{r['check']} / {r['check_run']} |"
        )
    return out + [""]


def plot(cs: dict, path: Path) -> None:
    """One panel per (epochs, ε): bars = mean test accuracy at the chosen lr, dots = the seeds."""
    panels = sorted({(k[0], k[1]) for k in cs})
    methods = [m for m in METHODS if any(k[2] == m for k in cs)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.4), sharey=True, squeeze=False)
    colors = {"independent": "tab:gray", "banded:4": "tab:blue", "blt": "tab:orange"}
    labels = {"independent": "independent (Poisson, amplified)", "banded:4": "banded:4 (cyclic)", "blt": "BLT (cyclic)"}
    for ax, (ep, eps) in zip(axes[0], panels):
        for i, meth in enumerate(methods):
            for j, m in enumerate(MECHS):
                c = cs.get((ep, eps, meth, m))
                if not c or not c["seeds"]:
                    continue
                x = i + (j - 1) * 0.27
                pts = [r["test_accuracy"] for r in c["seeds"].values()]
                ax.bar(x, mean(pts), width=0.25, color=colors[m], label=labels[m] if i == 0 else None)
                ax.plot([x] * len(pts), pts, "k.", ms=4)
        ax.set_xticks(range(len(methods)), [LABELS[m] for m in methods], fontsize=8)
        ax.set_title(f"CIFAR-10 CNN5 (9,000 records), {ep:g} epoch{'s' if ep != 1 else ''}, ε = {eps:g}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("test accuracy (11,000 images)")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    runs, out = Path(sys.argv[1]), Path(sys.argv[2])
    rows = load(runs / "results.jsonl")
    cs = cells(rows)
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    wall, cpu = sum(r["wall_seconds"] for r in rows), sum(r["cpu_seconds"] for r in rows)
    head = [
        f"# dpmf-cifar10 results (generated by summarize.py from {len(rows)} runs)\n",
        f"- {wall:.0f} s of run wall time (sum of `wall_seconds`), {cpu:.0f} CPU-s ({cpu / 60:.1f} CPU-min, "
        "driver process time per run)",
        f"- ledger checks: {sum(r['check'] == 'pass' for r in rows)} of {len(rows)} pass in the summary, "
        f"{sum(r['check_run'] == 'pass' for r in rows)} of {len(rows)} pass re-scored from the run directory\n",
    ]
    (out / "results.md").write_text("\n".join(head + main_table(cs) + sigma_table(rows) + every_run(rows, cs)))
    plot(cs, out / "test_accuracy.png")


if __name__ == "__main__":
    main()
