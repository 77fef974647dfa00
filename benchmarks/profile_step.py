"""Where the time of one dpopt DP step goes, phase by phase (for docs/performance.md).

Wraps, in this process only, the phases of ``DPOptimizer.step`` with timers:

* ``capture``: forward + backward to layer outputs (``PerSampleEngine.compute``),
* ``sq_norms`` / ``weighted_sum``: per-sample norms and clipped sums (the engine),
* ``release``: noise, ÷B̄, map out of the geometry, ledger (``Privatizer.release``),
* ``transform``: post-processing chain (Adam/MacAdam/Muon moments, lr),
* ``geometry``: the chain's clip geometry for the next step,
* ``noise wait+add``: inside the release, waiting for the step's noise draw (started when the step
  began, :class:`dpopt.noise.CpuNormalDraw`) and adding it to the clipped sums chunk by chunk,
* ``ledger``: recording the release (``PrivacyLedger.record``),

and reports the median milliseconds of each per step, next to the whole step.
CPU time of this thread (``time.thread_time``) and of the whole process (``time.process_time``,
all threads: the noise workers and torch's) are reported too: on a shared machine they are less
disturbed by other processes than wall-clock time.

``--cprofile N`` also prints the N functions with the most own time per step (cProfile, one
method at a time), to find Python overhead (e.g. in ``dpopt/engine``) by file and function.

Usage::

    python benchmarks/profile_step.py --model mlp --methods dp-sgd,dp-macadam --threads 2
    python benchmarks/profile_step.py --model mlp --methods dp-sgd --cprofile 25
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see step_time.py: shared CPUs

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402

import torch  # noqa: E402
from step_time import SHAPES, batch, dpopt_step, non_private_step  # noqa: E402

from dpopt.accounting.ledger import PrivacyLedger  # noqa: E402
from dpopt.engine import fast as fast_mod  # noqa: E402
from dpopt.noise import CpuNormalDraw  # noqa: E402
from dpopt.optim import DPOptimizer  # noqa: E402
from dpopt.privatizer import Privatizer  # noqa: E402

ACC: dict[str, list[float]] = defaultdict(list)
CUR: dict[str, float] = defaultdict(float)


def wrap(owner, attr: str, label: str) -> None:
    inner = getattr(owner, attr)

    def timed(*args, **kw):
        t = time.perf_counter()
        try:
            return inner(*args, **kw)
        finally:
            CUR[label] += time.perf_counter() - t

    setattr(owner, attr, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--methods", default="dp-sgd,dp-macadam")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="N",
        help="also print the N functions with the most own time per step (cProfile)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    wrap(fast_mod.PerSampleEngine, "compute", "capture")
    wrap(fast_mod.FastPerSampleGrads, "sq_norms", "sq_norms")
    wrap(fast_mod.FastPerSampleGrads, "weighted_sum", "weighted_sum")
    wrap(Privatizer, "release", "release")
    wrap(DPOptimizer, "geometry", "geometry")
    wrap(CpuNormalDraw, "consume", "noise wait+add")
    wrap(PrivacyLedger, "record", "ledger")
    _, b, _, _ = SHAPES[args.model]
    x, y = batch(args.model, b)
    steps = {"non-private": non_private_step(args.model, x, y)}
    for m in args.methods.split(","):
        steps[m] = dpopt_step(args.model, m, x, y)
    for f in steps.values():
        f(), f()
    # wrap each optimizer's transform.update (instances differ per method)
    import gc

    for obj in gc.get_objects():
        if isinstance(obj, DPOptimizer):
            wrap(obj.transform, "update", "transform")
    print(f"{args.model}, B = {b}, {args.threads} threads, median of {args.steps} steps (ms)")
    for name, f in steps.items():
        ACC.clear()
        wall, cpu, proc = [], [], []
        for _ in range(args.steps):
            CUR.clear()
            t, c, pc = time.perf_counter(), time.thread_time(), time.process_time()
            f()
            wall.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
            proc.append(time.process_time() - pc)
            for k, v in CUR.items():
                ACC[k].append(v)
        parts = ", ".join(f"{k} {1e3 * statistics.median(v):.2f}" for k, v in ACC.items())
        print(
            f"{name:12s} step {1e3 * statistics.median(wall):7.1f} (thread cpu {1e3 * statistics.median(cpu):7.1f}, "
            f"process cpu {1e3 * statistics.median(proc):7.1f})  {parts}"
        )
    print(f"1-min load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.cprofile:
        import cProfile
        import pstats

        for name, f in steps.items():
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                f()
            prof.disable()
            stats = pstats.Stats(prof)
            rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[: args.cprofile]
            print(
                f"\n{name}: own time per step (µs), top {args.cprofile} (cProfile: its overhead inflates "
                "Python-heavy functions)"
            )
            for (file, line, func), (_, calls, own, cum, _) in rows:
                where = file.split("/src/")[-1] if "/src/" in file else file.split("/")[-1]
                print(
                    f"  {1e6 * own / args.steps:9.0f} own {1e6 * cum / args.steps:9.0f} cum "
                    f"{calls / args.steps:6.1f} calls  {where}:{line}({func})"
                )


if __name__ == "__main__":
    main()
