"""Table of run.py's runs: per (entry, ε) the configuration chosen on validation (seed 0) and its test
accuracy at seeds 0 and 1; then every tuning run. Usage: summarize.py RUNS_DIR OUT.md"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main() -> None:
    runs, out = Path(sys.argv[1]), Path(sys.argv[2])
    rows = []
    for f in sorted(runs.glob("*/summary.json")):
        s = json.loads(f.read_text())
        cfg = json.loads((f.parent / "config.json").read_text()) if (f.parent / "config.json").exists() else {}
        entry, rest = f.parent.name.split("-eps")
        eps, *tags = rest.split("-")
        seed = int(tags[-1][1:])
        rows.append({"entry": entry, "eps": float(eps), "config": "-".join(tags[:-1]), "seed": seed,
                     "val": s.get("val_accuracy"), "test": s["test_accuracy"], "epsilon": s["epsilon"],
                     "sigma": s.get("noise_multiplier"), "wall": s.get("wall_seconds", 0.0)})
    order = ["dp-sgd", "dp-sgd-auto", "dp-adam", "dp-muon", "dp-muon-bc"]
    tuning = defaultdict(list)
    for r in rows:
        if r["seed"] == 0:
            tuning[(r["entry"], r["eps"])].append(r)
    lines = ["# DP-MuonBC and AUTO-S on MNIST `mlp`, 1 epoch, B̄ = 256 (issue 40)", "",
             "Chosen configuration = best validation accuracy at seed 0 (10 % of the training records held out);",
             "test accuracy at seeds 0 and 1 of that configuration.", "",
             "| ε | entry | chosen config | val (s0) | test s0 | test s1 | test mean |",
             "|---|---|---|---|---|---|---|"]
    for eps in sorted({r["eps"] for r in rows}):
        for entry in order:
            cand = tuning.get((entry, eps))
            if not cand:
                continue
            best = max(cand, key=lambda r: r["val"])
            s1 = [r for r in rows if r["entry"] == entry and r["eps"] == eps and r["config"] == best["config"]
                  and r["seed"] == 1]
            t1 = s1[0]["test"] if s1 else None
            mean = (best["test"] + t1) / 2 if t1 is not None else None
            fmt = lambda v: "—" if v is None else f"{v:.4f}"  # noqa: E731
            lines.append(f"| {eps:g} | {entry} | {best['config']} | {fmt(best['val'])} | {fmt(best['test'])} | "
                         f"{fmt(t1)} | {fmt(mean)} |")
    total = sum(r["wall"] for r in rows)
    lines += ["", f"Runs: {len(rows)}; sum of wall_seconds {total:.0f} s (one thread, shared 2-core machine).", "",
              "## Every run", "", "| ε | entry | config | seed | σ | ε spent | val | test | wall s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["eps"], order.index(r["entry"]) if r["entry"] in order else 99,
                                         r["config"], r["seed"])):
        val = "—" if r["val"] is None else f"{r['val']:.4f}"
        sig = "—" if r["sigma"] is None else f"{r['sigma']:.4g}"
        lines.append(f"| {r['eps']:g} | {r['entry']} | {r['config']} | {r['seed']} | {sig} | {r['epsilon']:.4f} | "
                     f"{val} | {r['test']:.4f} | {r['wall']:.0f} |")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:20]))


if __name__ == "__main__":
    main()
