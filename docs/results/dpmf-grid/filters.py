"""DiSK and DOPPLER (temporal filters) over correlated noise, against DP-SGD, on the 8×8 digits (issue 36).

    PYTHONPATH=src OMP_NUM_THREADS=1 python docs/results/dpmf-grid/filters.py RUNS OUT

DiSK's Kalman gain and DOPPLER's low-pass filter are derived for white (independent) noise; under banded / BLT
noise the noise they filter is correlated in time. This grid asks whether their gain over DP-SGD survives it:
digits MLP, 5 epochs (100 steps of B̄ = 64), ε ∈ {1, 8}, mechanisms independent / banded:4 / blt, methods
dp-sgd / disk-sgd / doppler-sgd, lr ∈ {0.3, 1, 3} tuned at seed 0 on the validation split, seeds 1–2 rerun at
the chosen lr (the same pipeline as ``dpopt train``, through run.py's ``run_one``; resumable: a run with a
summary.json is skipped). Writes OUT/filters.jsonl (one line per run) and OUT/filters.md (the table).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import run as grid  # noqa: E402  (docs/results/dpmf-grid/run.py)

METHODS = ("dp-sgd", "disk-sgd", "doppler-sgd")
MECHANISMS = ("independent", "banded:4", "blt")
EPSILONS = (1.0, 8.0)
LRS = (0.3, 1.0, 3.0)
EPOCHS, SEEDS = 5.0, 3


def main() -> None:
    runs, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    data = grid.load_dataset("digits", None)
    rows, cells = [], {}
    for eps in EPSILONS:
        for method in METHODS:
            for mech in MECHANISMS:
                scored = []
                for lr in LRS:
                    t0 = time.process_time()
                    s = grid.run_one(runs, data, None, "digits", EPOCHS, eps, method, mech, lr, 0)
                    rows.append((eps, method, mech, lr, 0, s, time.process_time() - t0))
                    scored.append((s["val_accuracy"], lr))
                best = max(scored)[1]
                accs = [next(s for e, m, k, lr, sd, s, _ in rows if (e, m, k, lr, sd) == (eps, method, mech, best, 0))]
                for seed in range(1, SEEDS):
                    t0 = time.process_time()
                    s = grid.run_one(runs, data, None, "digits", EPOCHS, eps, method, mech, best, seed)
                    rows.append((eps, method, mech, best, seed, s, time.process_time() - t0))
                    accs.append(s)
                cells[(eps, method, mech)] = (best, [a["test_accuracy"] for a in accs])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "filters.jsonl", "w") as f:
        for eps, method, mech, lr, seed, s, cpu in rows:
            keys = ("noise_multiplier", "val_accuracy", "test_accuracy", "epsilon", "steps", "check")
            line = {"epsilon_target": eps, "method": method, "mechanism": mech, "lr": lr, "seed": seed}
            f.write(json.dumps(line | {k: s.get(k) for k in keys} | {"driver_cpu_seconds": cpu}) + "\n")
    lines = [
        "| ε | method | independent | banded:4 | BLT |",
        "|---|---|---|---|---|",
    ]
    for eps in EPSILONS:
        for method in METHODS:
            cols = []
            for mech in MECHANISMS:
                best, accs = cells[(eps, method, mech)]
                cols.append(f"{statistics.fmean(accs):.4f} (lr {best:g}; " + " / ".join(f"{a:.3f}" for a in accs) + ")")
            lines.append(f"| {eps:g} | {method} | " + " | ".join(cols) + " |")
    (out / "filters.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
