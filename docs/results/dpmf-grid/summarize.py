"""Tables and plots of the dpmf-grid runs (run.py): tuning record, chosen-lr accuracy per seed and mean, σ.

    python docs/results/dpmf-grid/summarize.py RUNS_DIR [RUNS_DIR ...] docs/results/dpmf-grid
    python docs/results/dpmf-grid/summarize.py docs/results/dpmf-grid/results.jsonl NEW_RUNS_DIR docs/results/dpmf-grid

An input ending in ``.jsonl`` is a committed results file (its rows are taken as they are; the run
directories they came from need not exist any more); a run in several inputs: the last input's row.

Writes OUT/results.jsonl (one public row per run), OUT/results.md and OUT/test_accuracy_<dataset>.png.
The chosen lr of a cell (dataset, epochs, ε, method, mechanism) is the seed-0 run with the best
validation accuracy (ties: the larger lr, as run.py); the main table averages seeds 0 and 1 of it.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MECHS = ("independent", "banded4", "blt", "banded4-cpq0.2")
#: column headers; banded4-cpq0.2: amplified banded MF (run.py's banded:4@q0.2: cyclic Poisson, q = 0.2, b' = 4)
HEAD = {"independent": "independent", "banded4": "banded:4", "blt": "blt", "banded4-cpq0.2": "banded:4 amplified q=0.2"}
METHODS = ("dp-sgd", "dp-adam", "dp-macadam", "dp-muon")
NAME = re.compile(
    r"^(\w+)-ep([\d.]+)-eps([\d.]+)-(dp-\w+)-(independent|banded4|blt|banded4-cpq0\.2)-lr([\d.e-]+)-s(\d+)$"
)


def load(runs: Path) -> list[dict]:
    if runs.suffix == ".jsonl":  # a committed results.jsonl (rows as summarize.py wrote them)
        return [json.loads(line) for line in runs.read_text().splitlines() if line.strip()]
    rows = []
    for d in sorted(runs.iterdir()):  # directories of other names (diagnostics) are skipped
        m = NAME.match(d.name)
        if not m or not (d / "summary.json").exists():
            continue
        s = json.loads((d / "summary.json").read_text())
        drv = json.loads((d / "driver.json").read_text()) if (d / "driver.json").exists() else {}
        rows.append(
            {
                "run": d.name,
                "dataset": m[1],
                "epochs": float(m[2]),
                "target_epsilon": float(m[3]),
                "method": m[4],
                "mechanism": m[5],
                "lr": float(m[6]),
                "seed": int(m[7]),
                "sigma": s["noise_multiplier"],
                "epsilon": s["epsilon"],
                "steps": s["steps"],
                "val_accuracy": s["val_accuracy"],
                "test_accuracy": s["test_accuracy"],
                "wall_seconds": s["wall_seconds"],
                "cpu_seconds": drv.get("cpu_seconds"),
                "check": s["check"],
                "check_run": drv.get("check_run"),
            }
        )
    return rows


def cells(rows: list[dict]) -> dict:
    """(dataset, epochs, ε, method, mech) → {"lr": chosen lr, "tuning": [...], "seeds": {seed: row}}."""
    out: dict = defaultdict(lambda: {"tuning": [], "seeds": {}})
    for r in rows:
        c = out[(r["dataset"], r["epochs"], r["target_epsilon"], r["method"], r["mechanism"])]
        if r["seed"] == 0:
            c["tuning"].append(r)
    for c in out.values():
        c["lr"] = max((r["val_accuracy"], r["lr"]) for r in c["tuning"])[1]
    for r in rows:
        c = out[(r["dataset"], r["epochs"], r["target_epsilon"], r["method"], r["mechanism"])]
        if r["lr"] == c["lr"]:
            c["seeds"][r["seed"]] = r
    return out


def mean(xs):
    return statistics.fmean(xs) if xs else float("nan")


def acc2(c) -> tuple[float, int]:
    """Mean test accuracy over seeds 0 and 1 of the chosen lr (and how many of the two exist)."""
    xs = [c["seeds"][s]["test_accuracy"] for s in (0, 1) if s in c["seeds"]]
    return mean(xs), len(xs)


def tables(rows: list[dict], cs: dict) -> str:
    out = []
    datasets = sorted({k[0] for k in cs}, key=lambda d: ("digits", "mnist").index(d))
    for ds in datasets:
        keys = sorted(k for k in cs if k[0] == ds)
        out.append(f"## {ds}: test accuracy at the chosen lr, mean of seeds 0 and 1\n")
        out.append(
            "Chosen lr in brackets († at an end of the lr grid); **bold**: best mechanism of the row; Δ: best correlated − independent.\n"
        )
        mechs = [m for m in MECHS if any(k[4] == m for k in keys)]
        out.append("| epochs | ε | method | " + " | ".join(HEAD[m] for m in mechs) + " | Δ |")
        out.append("|---|---|---|" + "---|" * len(mechs) + "---|")
        for ep, eps in sorted({(k[1], k[2]) for k in keys}):
            for meth in METHODS:
                vals = {
                    m: (acc2(cs[(ds, ep, eps, meth, m)]), cs[(ds, ep, eps, meth, m)]["lr"])
                    for m in MECHS
                    if (ds, ep, eps, meth, m) in cs
                }
                if not vals:
                    continue
                best = max(v[0][0] for v in vals.values())
                cols = []
                for m in mechs:
                    if m not in vals:
                        cols.append("—")
                        continue
                    (a, n), lr = vals[m]
                    tried = [r["lr"] for r in cs[(ds, ep, eps, meth, m)]["tuning"]]
                    edge = "†" if len(tried) > 1 and lr in (min(tried), max(tried)) else ""
                    txt = f"{a:.4f} ({lr:g}{edge})" + ("" if n == 2 else " [1 seed]")
                    cols.append(f"**{txt}**" if a == best else txt)
                corr = [vals[m][0][0] for m in MECHS[1:] if m in vals]
                delta = f"{max(corr) - vals['independent'][0][0]:+.4f}" if corr and "independent" in vals else "—"
                out.append(f"| {ep:g} | {eps:g} | {meth} | " + " | ".join(cols) + f" | {delta} |")
        out.append("")
        many = [k for k in keys if len(cs[k]["seeds"]) > 2]
        if many:
            out.append(
                f"### {ds}: mean ± std over all seeds of the chosen lr (seeds 0–{max(max(cs[k]['seeds']) for k in many)})\n"
            )
            out.append("| epochs | ε | method | " + " | ".join(HEAD[m] for m in mechs) + " |")
            out.append("|---|---|---|" + "---|" * len(mechs))
            for ep, eps in sorted({(k[1], k[2]) for k in keys}):
                for meth in METHODS:
                    cols = []
                    for m in mechs:
                        c = cs.get((ds, ep, eps, meth, m))
                        xs = [r["test_accuracy"] for r in c["seeds"].values()] if c else []
                        sd = statistics.stdev(xs) if len(xs) > 1 else float("nan")
                        cols.append(f"{mean(xs):.4f} ± {sd:.4f} (n={len(xs)})" if xs else "—")
                    out.append(f"| {ep:g} | {eps:g} | {meth} | " + " | ".join(cols) + " |")
            out.append("")
        out.append(f"### {ds}: calibrated σ (noise multiplier) and ledger ε per mechanism\n")
        out.append(
            "| epochs | steps | ε target | "
            + " | ".join(f"σ {HEAD[m]}" for m in mechs)
            + " | ε ledger ("
            + " / ".join(HEAD[m] for m in mechs)
            + ") |"
        )
        out.append("|---|---|---|" + "---|" * (len(mechs) + 1))
        for ep, eps in sorted({(k[1], k[2]) for k in keys}):
            rs = {
                m: next(
                    (
                        r
                        for r in rows
                        if (r["dataset"], r["epochs"], r["target_epsilon"], r["mechanism"]) == (ds, ep, eps, m)
                    ),
                    None,
                )
                for m in mechs
            }
            steps = next(r["steps"] for r in rs.values() if r)
            sig = [f"{rs[m]['sigma']:.3f}" if rs[m] else "—" for m in mechs]
            ep_l = " / ".join(f"{rs[m]['epsilon']:.4f}" if rs[m] else "—" for m in mechs)
            out.append(f"| {ep:g} | {steps} | {eps:g} | " + " | ".join(sig) + f" | {ep_l} |")
        out.append("")
    out.append("## Every run (tuning at seed 0, chosen lr at the other seeds)\n")
    out.append(
        "| dataset | epochs | ε | method | mechanism | lr | seed | chosen | σ | ε ledger | val | test | wall s | CPU s |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(
        rows,
        key=lambda r: (
            r["dataset"],
            r["epochs"],
            r["target_epsilon"],
            METHODS.index(r["method"]),
            MECHS.index(r["mechanism"]),
            r["seed"],
            r["lr"],
        ),
    ):
        chosen = (
            "✓"
            if cs[(r["dataset"], r["epochs"], r["target_epsilon"], r["method"], r["mechanism"])]["lr"] == r["lr"]
            else ""
        )
        cpu = f"{r['cpu_seconds']:.1f}" if r["cpu_seconds"] is not None else "—"
        out.append(
            f"| {r['dataset']} | {r['epochs']:g} | {r['target_epsilon']:g} | {r['method']} | {r['mechanism']} | "
            f"{r['lr']:g} | {r['seed']} | {chosen} | {r['sigma']:.3f} | {r['epsilon']:.4f} | "
            f"{r['val_accuracy']:.4f} | {r['test_accuracy']:.4f} | {r['wall_seconds']:.1f} | {cpu} |"
        )
    return "\n".join(out) + "\n"


LABELS = {"dp-sgd": "DP-SGD", "dp-adam": "DP-Adam", "dp-macadam": "DP-MacAdam", "dp-muon": "DP-Muon"}


def plot(cs: dict, ds: str, path: Path) -> None:
    """One panel per (epochs, ε): bars = mean test accuracy over every seed of the chosen lr, dots = the seeds."""
    epochs = sorted({k[1] for k in cs if k[0] == ds})
    epsilons = sorted({k[2] for k in cs if k[0] == ds})
    fig, axes = plt.subplots(
        len(epochs), len(epsilons), figsize=(5.0 * len(epsilons), 3.2 * len(epochs)), sharey=True, squeeze=False
    )
    colors = {"independent": "tab:gray", "banded4": "tab:blue", "blt": "tab:orange", "banded4-cpq0.2": "tab:green"}
    labels = {
        "independent": "independent (Poisson, amplified)",
        "banded4": "banded:4 (cyclic)",
        "blt": "BLT (cyclic)",
        "banded4-cpq0.2": "banded:4 (cyclic Poisson q=0.2, amplified)",
    }
    mechs = [m for m in MECHS if any(k[0] == ds and k[4] == m for k in cs)]
    width = 0.8 / len(mechs)
    for row, ep in enumerate(epochs):
        for col, eps in enumerate(epsilons):
            ax = axes[row][col]
            for i, meth in enumerate(METHODS):
                for j, m in enumerate(mechs):
                    c = cs.get((ds, ep, eps, meth, m))
                    if not c:
                        continue
                    x = i + (j - (len(mechs) - 1) / 2) * width
                    pts = [r["test_accuracy"] for r in c["seeds"].values()]
                    ax.bar(x, mean(pts), width=width * 0.92, color=colors[m], label=labels[m] if i == 0 else None)
                    ax.plot([x] * len(pts), pts, "k.", ms=3)
            ax.set_xticks(range(len(METHODS)), [LABELS[m] for m in METHODS], fontsize=8)
            ax.set_title(f"{ds}, {ep:g} epoch{'s' if ep != 1 else ''}, ε = {eps:g}", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
            ax.set_ylim(0.0, 1.0)
        axes[row][0].set_ylabel("test accuracy")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="upper center", ncol=min(4, len(mechs)), fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    *runs, out = map(Path, sys.argv[1:])
    by_run = {r["run"]: r for d in runs for r in load(d)}  # a run in several inputs: the last one
    rows = list(by_run.values())  # input order (a .jsonl's rows first, as committed)
    cs = cells(rows)
    with open(out / "results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    total_wall = sum(r["wall_seconds"] for r in rows)
    total_cpu = sum(r["cpu_seconds"] or 0.0 for r in rows)
    by_ds = defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        by_ds[r["dataset"]][0] += 1
        by_ds[r["dataset"]][1] += r["wall_seconds"]
        by_ds[r["dataset"]][2] += r["cpu_seconds"] or 0.0
    head = [f"# dpmf-grid results (generated by summarize.py from {len(rows)} runs)\n"]
    for ds, (n, w, c) in by_ds.items():
        head.append(f"- {ds}: {n} runs, {w:.0f} s of run wall time (wall_seconds), {c:.0f} CPU-s (driver process time)")
    head.append(
        f"- total: {total_wall:.0f} s wall, {total_cpu:.0f} CPU-s; checks: "
        f"{sum(r['check'] == 'pass' for r in rows)} of {len(rows)} pass (summary), "
        f"{sum(r['check_run'] == 'pass' for r in rows)} of {sum(r['check_run'] is not None for r in rows)} pass "
        f"(check_run re-read)\n"
    )
    (out / "results.md").write_text("\n".join(head) + "\n" + tables(rows, cs))
    for ds in sorted({k[0] for k in cs}):
        plot(cs, ds, out / f"test_accuracy_{ds}.png")


if __name__ == "__main__":
    main()
