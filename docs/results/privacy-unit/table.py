"""The results table (markdown) from runs/*/summary.json; per-user protection of record-level runs by group privacy."""

import glob
import json
import statistics
from collections import defaultdict

sizes = defaultdict(int)
for line in open("zipf_users.txt"):
    sizes[line.strip()] += 1
largest, median = max(sizes.values()), int(statistics.median(sizes.values()))
rows = defaultdict(list)
for path in sorted(glob.glob("runs/*/summary.json")):
    s = json.load(open(path))
    name = path.split("/")[1].rsplit("-s", 1)[0]
    rows[name].append(s)
print(f"digits (1437 training records), {len(sizes)} synthetic users (Zipf 1.8, median {median}, largest {largest}")
print("records); target ε = 4 at δ = 1e-5 per UNIT, 10 epochs, dp-macadam defaults; 3 seeds (mean ± sd).\n")
print(
    "| unit | q | steps | σ | test accuracy | ε per unit | ε for the median user | ε for the largest user | wall s/run |"
)
print("|---|---|---|---|---|---|---|---|---|")
for name in ("record", "user-k16", "user-k4"):
    runs = rows[name]
    acc = [r["test_accuracy"] for r in runs]
    eps = runs[0]["epsilon"]
    if name == "record":  # group privacy: k records → k·ε (Dwork & Roth Thm 2.2; δ grows too)
        med, big = f"≤ {median * eps:.0f} (group)", f"≤ {largest * eps:.0f} (group)"
        unit = "record"
    else:
        med = big = f"{eps:.2f}"
        unit = f"user, k = {name.split('k')[1]}"
    wall = statistics.mean(r["wall_seconds"] for r in runs)
    print(
        f"| {unit} | {runs[0]['sample_rate']:.4f} | {runs[0]['steps']} | {runs[0]['noise_multiplier']:.3f} | "
        f"{statistics.mean(acc):.3f} ± {statistics.stdev(acc):.3f} | {eps:.2f} | {med} | {big} | {wall:.1f} |"
    )
