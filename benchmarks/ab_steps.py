"""Two dpopt source trees' steps, alternated: the same benchmark step timed in two worker processes that take
turns (issue 34; docs/performance.md, "MLP: the step's Python").

Each worker imports dpopt from its own ``src`` directory (``--before``: e.g. a ``git archive`` of the
commit before a change; ``--after``: default this checkout's ``src``), builds
``step_time.dpopt_step(model, method)`` (same seed, same reproducible noise generator) plus the
non-private step, warms up, and then, on the parent's signal, runs ``--per-round`` steps and reports the
process CPU time (``time.process_time``, all its threads) and wall time of each. The parent runs the
workers strictly one after the other, round after round (never both at once), so both see the same
machine state; it prints medians and the ratios after / before. Patch-free: any change between the two
trees is compared, whatever file it touched.

Usage::

    mkdir -p /tmp/before && git archive <commit> src | tar -x -C /tmp/before   # plus the built src/dpopt/_native*.so
    OMP_NUM_THREADS=1 python benchmarks/ab_steps.py --before /tmp/before/src --threads 1 --rounds 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(model: str, method: str, threads: int, per_round: int, warmup: int) -> None:
    """Worker side: build the steps, then answer each line ``go`` on stdin with one JSON line of timings."""
    import torch

    sys.path.insert(0, str(HERE))
    import step_time as st

    torch.set_num_threads(threads)
    x, y = st.batch(model, st.SHAPES[model][1])
    steps = {"dp": st.dpopt_step(model, method, x, y), "np": st.non_private_step(model, x, y)}
    for f in steps.values():
        for _ in range(warmup):
            f()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        out: dict = {}
        for name, f in steps.items():
            cpu, wall = [], []
            for _ in range(per_round):
                t, c = time.perf_counter(), time.process_time()
                f()
                wall.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
            out[name] = {"cpu": cpu, "wall": wall}
        print(json.dumps(out), flush=True)


def main(argv=None) -> dict:
    """Parent side: start both workers, alternate their rounds, print and return the medians and ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the src directory of the 'before' tree")
    ap.add_argument("--after", default=str(HERE.parent / "src"), help="the src directory of the 'after' tree")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--method", default="dp-sgd")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.model, args.method, args.threads, args.per_round, args.warmup)
        return {}
    procs = {}
    for tag, src in (("before", args.before), ("after", args.after)):
        # OMP_WAIT_POLICY as step_time.py sets it (PASSIVE unless the environment says otherwise): the worker
        # imports torch before step_time, so step_time's own default would come too late for OpenMP
        env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS=str(args.threads))
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        cmd = [sys.executable, __file__, "--worker", "--before", src, "--model", args.model, "--method", args.method]
        cmd += ["--threads", str(args.threads), "--per-round", str(args.per_round), "--warmup", str(args.warmup)]
        procs[tag] = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        json.loads(procs[tag].stdout.readline())  # ready (one at a time: the warm-ups do not overlap)
    res: dict = {tag: {"dp": {"cpu": [], "wall": []}, "np": {"cpu": [], "wall": []}} for tag in procs}
    for r in range(args.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for tag in order:
            p = procs[tag]
            p.stdin.write("go\n")
            p.stdin.flush()
            out = json.loads(p.stdout.readline())
            for name in ("dp", "np"):
                for k in ("cpu", "wall"):
                    res[tag][name][k] += out[name][k]
    for p in procs.values():
        p.stdin.close()
        p.wait()
    med = {tag: {n: {k: statistics.median(v) for k, v in d.items()} for n, d in r.items()} for tag, r in res.items()}
    summary = {
        "threads": args.threads,
        "rounds": args.rounds,
        "per_round": args.per_round,
        "ms": {tag: {n: {k: round(v * 1e3, 3) for k, v in d.items()} for n, d in m.items()} for tag, m in med.items()},
        "after/before cpu": med["after"]["dp"]["cpu"] / med["before"]["dp"]["cpu"],
        "after/before wall": med["after"]["dp"]["wall"] / med["before"]["dp"]["wall"],
        "dp/np cpu before": med["before"]["dp"]["cpu"] / med["before"]["np"]["cpu"],
        "dp/np cpu after": med["after"]["dp"]["cpu"] / med["after"]["np"]["cpu"],
        "dp/np wall before": med["before"]["dp"]["wall"] / med["before"]["np"]["wall"],
        "dp/np wall after": med["after"]["dp"]["wall"] / med["after"]["np"]["wall"],
    }
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
