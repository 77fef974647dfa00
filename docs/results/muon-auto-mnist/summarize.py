"""Summarise run_compare.py's runs into results.md (mean ± half-range over seeds; per-layer decisions)."""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main(runs: str, out: str) -> None:
    rows = defaultdict(list)
    hist = defaultdict(list)
    for d in sorted(Path(runs).iterdir()):
        s = d / "summary.json"
        if not s.exists():
            continue
        summ = json.loads(s.read_text())
        key = (summ["dataset"], summ["method"], int(summ["expected_batch_size"]))
        rows[key].append((summ["seed"] if "seed" in summ else d.name[-1], summ["test_accuracy"], summ["epsilon"],
                          summ["steps"], summ["wall_seconds"], summ["noise_multiplier"]))
        h = d / "history.json"
        if h.exists():
            hist[key].append((d.name, json.loads(h.read_text())))
    lines = ["| dataset | method | B̄ | σ | steps | seeds | test acc. (mean) | per seed | ε | wall s (mean) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(rows, key=lambda k: (k[0], k[2], k[1])):
        r = rows[key]
        accs = [x[1] for x in r]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {r[0][5]:.3f} | {r[0][3]} | {len(r)} | "
                     f"{statistics.mean(accs):.4f} | {', '.join(f'{a:.4f}' for a in accs)} | {r[0][2]:.3f} | "
                     f"{statistics.mean(x[4] for x in r):.0f} |")
    lines += ["", "Per-layer decisions of dp-muon-auto (1 = orthogonalized; ρ = σ₁(U)/noise edge):", "",
              "| run | layer | shape | fraction on | first on | last on | switches | ρ median | ρ last |",
              "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(hist, key=lambda k: (k[0], k[2])):
        for name, doc in hist[key]:
            for lay in doc["layers"]:
                dec, rho = lay["decisions"], lay["ratios"]
                on = [i + 1 for i, d in enumerate(dec) if d]
                switches = sum(1 for a, b in zip(dec, dec[1:]) if a != b)
                lines.append(f"| {name} | {lay['name']} | {tuple(lay['shape'])} | {lay['fraction_on']:.3f} | "
                             f"{on[0] if on else '–'} | {on[-1] if on else '–'} | {switches} | "
                             f"{statistics.median(rho):.3f} | {rho[-1]:.3f} |")
    Path(out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else str(Path(__file__).with_name("results.md")))
