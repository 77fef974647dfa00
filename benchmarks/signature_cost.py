"""Per-step cost of the first-batch check's signature (issue 33, case 6) against a CNN5 DP-SGD step.

Each step, both doors compute the release's signature
(:func:`dpopt.engine.check.signature`: train/eval flags, the module-state
fingerprint, the batch-size class) and compare the buffers by value
(:func:`dpopt.engine.inputs.snapshot_buffers` / :func:`~dpopt.engine.inputs.changed_buffers`).
This script times those per-step additions alone (median of many calls) and a
full dpopt DP-SGD step on ``cnn5`` (B = 512 by default, as ``benchmarks/step_time.py``)
and prints the ratio; the target is ≤ 1 % of the step.

Usage::

    python benchmarks/signature_cost.py               # cnn5, B = 512, CPU
    python benchmarks/signature_cost.py --batch 64 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


from step_time import batch, dpopt_step  # noqa: E402

from dpopt.engine.check import signature  # noqa: E402
from dpopt.engine.inputs import changed_buffers, snapshot_buffers  # noqa: E402
from dpopt.models import build_model  # noqa: E402


def median_time(fn, reps: int) -> float:
    """Median wall-clock seconds of ``fn()`` over ``reps`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn5")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    x, y = batch(args.model, args.batch)
    step = dpopt_step(args.model, "dp-sgd", x, y)
    t_step = median_time(step, args.steps)
    model = build_model(args.model)
    t_sig = median_time(lambda: signature(model, args.batch), 2000)
    snap = snapshot_buffers(model)
    t_buf = median_time(lambda: (snapshot_buffers(model, reuse=snap), changed_buffers(model, snap)), 2000)
    out = {
        "model": args.model,
        "batch": args.batch,
        "modules": len(list(model.modules())),
        "buffers": len(list(model.buffers())),
        "step_s": t_step,
        "signature_s": t_sig,
        "buffer_check_s": t_buf,
        "signature_share": t_sig / t_step,
        "per_step_share": (t_sig + t_buf) / t_step,
    }
    print(
        f"{args.model} B={args.batch}: step {t_step * 1e3:.1f} ms; signature {t_sig * 1e6:.1f} us "
        f"({100 * t_sig / t_step:.4f} %); buffers by value {t_buf * 1e6:.1f} us; "
        f"together {100 * (t_sig + t_buf) / t_step:.4f} % of the step"
    )
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
