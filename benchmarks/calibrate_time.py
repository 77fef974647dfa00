"""Wall time of ``dpopt calibrate`` (pld) on the rows of Table 16 of the spectral-orthogonalization paper.

Issue 14, item 5: on the CIFAR-10 column of Table 16 (N = 50,000, 50 epochs, ε = 4, δ = 1e-5,
B ∈ {256, 512, 1024, 2048, 4096}; the paper's σ 0.85 / 1.04 / 1.32 / 1.74 / 2.35, computed with
the PRV accountant at 9750 / 4850 / 2400 / 1200 / 600 steps) each CLI call must take ≤ 2 s wall on a
quiet 2-core machine, and the σ it prints must still give ε ≤ target under dp_accounting's own PLD.

Per row this script

* runs ``dpopt calibrate --target-epsilon 4 --dataset-size 50000 --batch-size B --epochs 50 --json``
  as a subprocess ``--repeat`` times (after one untimed warm-up call for the whole table, so that a
  cold page cache does not land on the first row) and reports the median and the largest wall time
  of the whole process (interpreter start, imports, calibration, exit), its median CPU time (user +
  system: on a shared machine the wall time measures the neighbours, the CPU time much less) and the
  calibration's own ``seconds``;
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

``--compare REV`` measures, in the same run, the code of git revision REV beside the working tree's:
REV's ``src/`` is exported with ``git archive`` (read-only: no checkout, no worktree) to a temporary
directory and run as ``python -m dpopt`` with ``PYTHONPATH`` pointing there; the calls alternate
(this tree, REV, this tree, ...) so that both see the same load. Both import floors are timed too.

It also times what used to be asserted by unit tests (no test asserts a time): the refusal of absurd
targets (ε = 1e5 unreachable, 1e-9 below the PLD's resolution) and ε of a 100-step ledger alternating
two (σ, q) under RDP (grouped: was 13 s ungrouped), in-process after the imports.

Usage::

    python benchmarks/calibrate_time.py                 # table
    python benchmarks/calibrate_time.py --json          # table, then one JSON line (last line)
    python benchmarks/calibrate_time.py --compare HEAD~3 # before/after, side by side in one run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]

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
    return [
        "calibrate",
        "--target-epsilon",
        f"{TARGET_EPSILON:g}",
        "--dataset-size",
        str(DATASET_SIZE),
        "--batch-size",
        str(batch_size),
        "--epochs",
        str(EPOCHS),
        "--delta",
        f"{DELTA:g}",
        "--json",
    ]


def export_revision(rev: str, into: Path) -> Path:
    """``git archive REV src`` unpacked under ``into``; returns the ``src`` directory (the repo is not touched)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", rev, "src"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


#: CPU seconds (user + system) of each CLI process run by :func:`run_cli`, in order: on a loaded
#: machine the wall time measures the neighbours, the CPU time much less so.
CPU_SECONDS: list = []


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _env(src: Optional[Path]) -> Optional[dict]:
    if src is None:
        return None
    return dict(os.environ, PYTHONPATH=str(src))


def run_cli(batch_size: int, src: Optional[Path] = None) -> tuple[float, dict]:
    """(wall seconds of the whole process, the JSON object it printed); ``src``: another revision's src/."""
    cmd = (cli_command() if src is None else [sys.executable, "-m", "dpopt"]) + calibrate_args(batch_size)
    before = _children_cpu()
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(src), cwd=None if src is None else src)
    wall = time.perf_counter() - t
    CPU_SECONDS.append(_children_cpu() - before)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


IMPORT_FLOOR = "import dpopt.cli, dpopt.accounting.calibration, dpopt.accounting.budget"


def time_import_floor(src: Optional[Path] = None) -> float:
    """Wall seconds of a process that imports what ``dpopt calibrate`` imports, and exits."""
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", IMPORT_FLOOR],
        check=True,
        capture_output=True,
        env=_env(src),
        cwd=None if src is None else src,
    )
    return time.perf_counter() - t


def time_former_unit_tests() -> dict:
    """Seconds (in-process, imports done) of what unit tests used to assert: absurd targets, grouped RDP."""
    import warnings

    from dpopt.accounting.accountant import epsilon
    from dpopt.accounting.calibration import calibrate_noise_multiplier
    from dpopt.accounting.events import poisson_gaussian_step
    from dpopt.accounting.ledger import PrivacyLedger

    out = {}
    for name, target in (("refuse_unreachable_1e5", 1e5), ("refuse_below_resolution_1e-9", 1e-9)):
        t = time.perf_counter()
        try:
            calibrate_noise_multiplier(target, DELTA, 0.01, 100)
        except ValueError:
            pass
        out[name] = time.perf_counter() - t
    ledger = PrivacyLedger()
    for i in range(100):
        ledger.record(i, poisson_gaussian_step(1.0 if i % 2 else 1.3, 0.01 if i % 2 else 0.02))
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        epsilon(ledger, DELTA, "rdp")
    out["rdp_alternating_100_steps"] = time.perf_counter() - t
    return out


def dp_accounting_epsilon(
    sigma: float, sample_rate: float, steps: int, delta: float = DELTA, grid: float = 1e-4
) -> float:
    """ε of T Poisson-sampled Gaussian steps by dp_accounting's own PLD accountant (no dpopt code)."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    acc = PLDAccountant(value_discretization_interval=grid)
    acc.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(sigma)), steps
        )
    )
    return float(acc.get_epsilon(delta))


def _row(b: int, walls: list, out: dict, grid: float, max_seconds: float, label: str, cpus: list) -> dict:
    sigma, q, steps = float(out["noise_multiplier"]), float(out["sample_rate"]), int(out["steps"])
    assert steps == math.ceil(EPOCHS * DATASET_SIZE / b) and math.isclose(q, b / DATASET_SIZE)
    eps = dp_accounting_epsilon(sigma, q, steps, DELTA, grid)
    paper_sigma, paper_steps = PAPER.get(b, (math.nan, 0))
    med = statistics.median(walls)
    flags = (["SLOW"] if med > max_seconds else []) + (["EPS>TARGET"] if eps > TARGET_EPSILON else [])
    diff = 100.0 * (sigma / paper_sigma - 1.0)
    print(
        f"{label:>8s} {b:5d} {steps:6d} {paper_steps:6d} {med:10.2f} {max(walls):6.2f} "
        f"{statistics.median(cpus):7.2f} {out['seconds']:8.2f} "
        f"{sigma:8.5f} {paper_sigma:5.2f} {diff:+7.2f} {out['epsilon']:10.5f} {eps:10.5f}  "
        f"{' '.join(flags) or 'ok'}"
    )
    return {
        "code": label,
        "batch_size": b,
        "steps": steps,
        "paper_steps": paper_steps,
        "wall_seconds": walls,
        "wall_median": med,
        "cpu_seconds": cpus,
        "cpu_median": statistics.median(cpus),
        "calibration_seconds": out["seconds"],
        "noise_multiplier": sigma,
        "paper_noise_multiplier": paper_sigma,
        "epsilon_dpopt": out["epsilon"],
        "epsilon_dp_accounting": eps,
        "flags": flags,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default=",".join(str(b) for b in PAPER))
    ap.add_argument("--repeat", type=int, default=3, help="timed CLI calls per row (median and max reported)")
    ap.add_argument("--max-seconds", type=float, default=2.0, help="flag a row whose median wall time exceeds this")
    ap.add_argument(
        "--grid",
        type=float,
        default=1e-4,
        help="value_discretization_interval of the dp_accounting re-check (nats; ≤ 1e-3)",
    )
    ap.add_argument(
        "--compare",
        metavar="REV",
        default=None,
        help="also time git revision REV's code, alternating with this tree's (before/after in one run)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    tmp = tempfile.TemporaryDirectory(prefix="dpopt-calibrate-") if args.compare else None
    codes: dict = {"tree": None}
    if args.compare:
        codes[args.compare] = export_revision(args.compare, Path(tmp.name))

    for src in codes.values():
        run_cli(max(sizes), src)  # warm-up: page cache, .pyc files
    load = os.getloadavg()[0]
    print(
        f"dpopt calibrate (pld), N = {DATASET_SIZE}, {EPOCHS} epochs, target ε = {TARGET_EPSILON:g}, "
        f"δ = {DELTA:g}; {args.repeat} calls per row; 1-min load average {load:.2f} on {os.cpu_count()} CPUs"
    )
    print(
        f"{'code':>8s} {'B':>5s} {'steps':>6s} {'paper':>6s} {'wall med s':>10s} {'max s':>6s} {'cpu s':>7s} "
        f"{'calib s':>8s} "
        f"{'sigma':>8s} {'paper':>5s} {'diff %':>7s} {'eps dpopt':>10s} {'eps dp_acc':>10s}  flags"
    )
    rows, flagged = [], False
    for b in sizes:
        walls: dict = {label: [] for label in codes}
        cpus: dict = {label: [] for label in codes}
        outs: dict = {}
        for _ in range(max(1, args.repeat)):
            for label, src in codes.items():  # alternate: both codes see the same load
                wall, outs[label] = run_cli(b, src)
                walls[label].append(wall)
                cpus[label].append(CPU_SECONDS[-1])
        for label in codes:
            row = _row(b, walls[label], outs[label], args.grid, args.max_seconds, label, cpus[label])
            rows.append(row)
            flagged |= bool(row["flags"]) and label == "tree"
    floors: dict = {label: [] for label in codes}
    for _ in range(max(1, args.repeat)):
        for label, src in codes.items():
            floors[label].append(time_import_floor(src))
    floor = {label: statistics.median(v) for label, v in floors.items()}
    for label, value in floor.items():
        print(f"import floor ({label}: python -c '{IMPORT_FLOOR}'): {value:.2f} s median")
    former = time_former_unit_tests()
    print("in-process (imports done): " + ", ".join(f"{k} {v:.2f} s" for k, v in former.items()))
    print(
        f"re-check: dp_accounting.pld.PLDAccountant, value_discretization_interval {args.grid:g}; "
        f"{'FLAGGED rows above' if flagged else 'every row within ' + format(args.max_seconds, 'g') + ' s and ε ≤ target'}"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "rows": rows,
                    "loadavg_1min": round(load, 2),
                    "loadavg_1min_end": round(os.getloadavg()[0], 2),
                    "import_floor_seconds": floor["tree"],
                    "import_floor_by_code": floor,
                    "former_unit_test_seconds": former,
                    "compare": args.compare,
                    "max_seconds": args.max_seconds,
                    "grid": args.grid,
                    "ok": not flagged,
                }
            )
        )
    if tmp is not None:
        tmp.cleanup()
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
