"""Where the time of one dpopt DP step goes, phase by phase (for docs/performance.md).

Wraps, in this process only, the phases of ``DPOptimizer.step`` with timers:

* ``capture``: forward + backward to layer outputs (``PerSampleEngine.compute``),
* ``sq_norms`` / ``weighted_sum``: per-sample norms and clipped sums (the engine),
* ``release``: noise, ÷B̄, map out of the geometry, ledger (``Privatizer.release``),
* ``transform``: post-processing chain (Adam/MacAdam/Muon moments, lr),
* ``geometry``: the chain's clip geometry for the next step,

and reports the median milliseconds of each per step, next to the whole step.
CPU time of this thread (``time.thread_time``) is reported too: on a shared
machine it is less disturbed by other processes than wall-clock time.

Usage::

    python benchmarks/profile_step.py --model mlp --methods dp-sgd,dp-macadam --threads 2
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see step_time.py: shared CPUs

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402

import torch  # noqa: E402

from dpopt.engine import fast as fast_mod  # noqa: E402
from dpopt.optim import DPOptimizer  # noqa: E402
from dpopt.privatizer import Privatizer  # noqa: E402

from step_time import SHAPES, batch, dpopt_step, non_private_step  # noqa: E402

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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    wrap(fast_mod.PerSampleEngine, "compute", "capture")
    wrap(fast_mod.FastPerSampleGrads, "sq_norms", "sq_norms")
    wrap(fast_mod.FastPerSampleGrads, "weighted_sum", "weighted_sum")
    wrap(Privatizer, "release", "release")
    wrap(DPOptimizer, "geometry", "geometry")
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
        wall, cpu = [], []
        for _ in range(args.steps):
            CUR.clear()
            t, c = time.perf_counter(), time.thread_time()
            f()
            wall.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
            for k, v in CUR.items():
                ACC[k].append(v)
        parts = ", ".join(f"{k} {1e3 * statistics.median(v):.1f}" for k, v in ACC.items())
        print(f"{name:12s} step {1e3 * statistics.median(wall):7.1f} (thread cpu {1e3 * statistics.median(cpu):7.1f})"
              f"  {parts}")


if __name__ == "__main__":
    main()
