"""Wall time of ``dpopt calibrate`` (pld) on the rows of Table 16 of the spectral-orthogonalization paper.

Issue 14, item 5: on the CIFAR-10 column of Table 16 (N = 50,000, 50 epochs, ε = 4, δ = 1e-5,
B ∈ {256, 512, 1024, 2048, 4096}; the paper's σ 0.85 / 1.04 / 1.32 / 1.74 / 2.35, computed with
the PRV accountant at 9750 / 4850 / 2400 / 1200 / 600 steps) each CLI call must take ≤ 2 s wall on a
quiet 2-core machine, and the σ it prints must still give ε ≤ target under dp_accounting's own PLD.

Per row this script

* runs ``dpopt calibrate --target-epsilon 4 --dataset-size 50000 --batch-size B --epochs 50 --json``
  as a subprocess ``--repeat`` times (after one untimed warm-up call for the whole table, so that a
  cold page cache does not land on the first row) and reports the median and the largest wall time
  of the whole process (interpreter start, imports, calibration, exit) next to the calibration's
  own ``seconds``;
* re-checks the printed σ directly with ``dp_accounting.pld.PLDAccountant`` (not through dpopt):
  ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), T)`` with q = B/N and
  T = ceil(epochs·N/B) — dpopt's step count, not the paper's — at ``--grid`` nats
  (default 1e-4, dp_accounting's default and dpopt's accurate grid);
* flags a row whose median wall time exceeds ``--max-seconds`` (``SLOW``) or whose re-checked
  ε exceeds the target (``EPS>TARGET``).

It also times, as many times, a process that only imports what ``calibrate`` imports
(``dpopt.cli`` and the accounting modules, hence dp_accounting, scipy and numpy) and exits: the
floor under every row, whatever the calibration costs.

Exit code 1 if any row is flagged, else 0. The machine's 1-minute load average is printed, since
wall times on a shared machine move with it.

Usage::

    python benchmarks/calibrate_time.py                 # table
    python benchmarks/calibrate_time.py --json          # table, then one JSON line (last line)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

DATASET_SIZE = 50_000
EPOCHS = 50
TARGET_EPSILON = 4.0
DELTA = 1e-5
#: Table 16, CIFAR-10 column: B → (σ, steps) as printed in the paper (PRV accountant).
PAPER = {256: (0.85, 9750), 512: (1.04, 4850), 1024: (1.32, 2400), 2048: (1.74, 1200), 4096: (2.35, 600)}


def cli_command() -> list[str]:
    """The ``dpopt`` console script of this interpreter's environment, else ``python -m dpopt``."""
    script = Path(sys.executable).with_name("dpopt")
    if script.exists():
        return [str(script)]
    found = shutil.which("dpopt")
    return [found] if found else [sys.executable, "-m", "dpopt"]


def calibrate_args(batch_size: int) -> list[str]:
    return ["calibrate", "--target-epsilon", f"{TARGET_EPSILON:g}", "--dataset-size", str(DATASET_SIZE),
            "--batch-size", str(batch_size), "--epochs", str(EPOCHS), "--delta", f"{DELTA:g}", "--json"]


def run_cli(batch_size: int) -> tuple[float, dict]:
    """(wall seconds of the whole process, the JSON object it printed)."""
    cmd = cli_command() + calibrate_args(batch_size)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


IMPORT_FLOOR = "import dpopt.cli, dpopt.accounting.calibration, dpopt.accounting.budget"


def time_import_floor() -> float:
    """Wall seconds of a process that imports what ``dpopt calibrate`` imports, and exits."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORT_FLOOR], check=True, capture_output=True)
    return time.perf_counter() - t


def dp_accounting_epsilon(sigma: float, sample_rate: float, steps: int, delta: float = DELTA,
                          grid: float = 1e-4) -> float:
    """ε of T Poisson-sampled Gaussian steps by dp_accounting's own PLD accountant (no dpopt code)."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    acc = PLDAccountant(value_discretization_interval=grid)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(sigma)), steps))
    return float(acc.get_epsilon(delta))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default=",".join(str(b) for b in PAPER))
    ap.add_argument("--repeat", type=int, default=3, help="timed CLI calls per row (median and max reported)")
    ap.add_argument("--max-seconds", type=float, default=2.0, help="flag a row whose median wall time exceeds this")
    ap.add_argument("--grid", type=float, default=1e-4,
                    help="value_discretization_interval of the dp_accounting re-check (nats; ≤ 1e-3)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",") if b]

    run_cli(max(sizes))  # warm-up: page cache, .pyc files
    load = os.getloadavg()[0]
    print(f"dpopt calibrate (pld), N = {DATASET_SIZE}, {EPOCHS} epochs, target ε = {TARGET_EPSILON:g}, "
          f"δ = {DELTA:g}; {args.repeat} calls per row; 1-min load average {load:.2f} on {os.cpu_count()} CPUs")
    print(f"{'B':>5s} {'steps':>6s} {'paper':>6s} {'wall med s':>10s} {'max s':>6s} {'calib s':>8s} "
          f"{'sigma':>8s} {'paper':>5s} {'diff %':>7s} {'eps dpopt':>10s} {'eps dp_acc':>10s}  flags")
    rows, flagged = [], False
    for b in sizes:
        walls, out = [], {}
        for _ in range(max(1, args.repeat)):
            wall, out = run_cli(b)
            walls.append(wall)
        sigma, q, steps = float(out["noise_multiplier"]), float(out["sample_rate"]), int(out["steps"])
        assert steps == math.ceil(EPOCHS * DATASET_SIZE / b) and math.isclose(q, b / DATASET_SIZE)
        eps = dp_accounting_epsilon(sigma, q, steps, DELTA, args.grid)
        paper_sigma, paper_steps = PAPER.get(b, (math.nan, 0))
        med = statistics.median(walls)
        flags = (["SLOW"] if med > args.max_seconds else []) + (["EPS>TARGET"] if eps > TARGET_EPSILON else [])
        flagged |= bool(flags)
        diff = 100.0 * (sigma / paper_sigma - 1.0)
        print(f"{b:5d} {steps:6d} {paper_steps:6d} {med:10.2f} {max(walls):6.2f} {out['seconds']:8.2f} "
              f"{sigma:8.5f} {paper_sigma:5.2f} {diff:+7.2f} {out['epsilon']:10.5f} {eps:10.5f}  "
              f"{' '.join(flags) or 'ok'}")
        rows.append({"batch_size": b, "steps": steps, "paper_steps": paper_steps, "wall_seconds": walls,
                     "wall_median": med, "calibration_seconds": out["seconds"], "noise_multiplier": sigma,
                     "paper_noise_multiplier": paper_sigma, "epsilon_dpopt": out["epsilon"],
                     "epsilon_dp_accounting": eps, "flags": flags})
    floor = statistics.median(time_import_floor() for _ in range(max(1, args.repeat)))
    print(f"import floor (python -c '{IMPORT_FLOOR}'): {floor:.2f} s median")
    print(f"re-check: dp_accounting.pld.PLDAccountant, value_discretization_interval {args.grid:g}; "
          f"{'FLAGGED rows above' if flagged else 'every row within ' + format(args.max_seconds, 'g') + ' s and ε ≤ target'}")
    if args.json:
        print(json.dumps({"rows": rows, "loadavg_1min": round(load, 2), "import_floor_seconds": floor,
                          "max_seconds": args.max_seconds,
                          "grid": args.grid, "ok": not flagged}))
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
