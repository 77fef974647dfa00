"""Where a step's memory above the non-private step goes, phase by phase, in both doors (issue 34).

For each model of ``transformer_step.py`` (``gpt2-untied``, ``bert``, ``gpt2-lora``) and each door
(``non-private``, ``dp-sgd``: dpopt's own loop, ``pe``: ``dpopt.PrivacyEngine``'s hooks), runs
``--steps`` steps, each under ``torch.profiler`` with ``profile_memory=True``, with dpopt's phases
wrapped in ``record_function`` labels (the capture's forward/backward, the first-batch check and its
parts, the blocks, the per-example norms, the clipped sums, the release with its noise, the
optimizer). From the CPU allocator's allocation and free events it prints per step:

* ``peak``: the most bytes allocated during the step and not yet freed (MiB; blocks from before the
  step do not count: the parameters, and the ``.grad`` / optimizer state kept between steps);
* ``at peak``: those live bytes at the peak's moment, by the innermost phase that allocated them
  (``torch``: outside every dpopt phase — the user's forward/backward in the hook door, the
  non-private step);
* ``phase peaks``: each phase's own peak of bytes it allocated (its children's included) and
  still held, relative to its start.

Deterministic (tensor sizes, not timings): the figures of a configuration do not move between runs.

Usage::

    python benchmarks/step_memory_phases.py --models gpt2-untied,bert,gpt2-lora --steps 2 [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch
from torch._C._profiler import _EventType
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from transformer_step import dpopt_step, non_private_step, privacy_engine_step  # noqa: E402

from dpopt import private_optimizer as po_mod  # noqa: E402
from dpopt import privatizer as priv_mod  # noqa: E402
from dpopt.engine import capture as cap_mod  # noqa: E402
from dpopt.engine import fast as fast_mod  # noqa: E402
from dpopt.engine import hooks as hooks_mod  # noqa: E402
from dpopt.optim import DPOptimizer  # noqa: E402

MIB = float(1 << 20)
DETAIL = False  # --detail: also by the outermost torch op under the phase
#: (owner, method, label): the phases, innermost label wins
PHASES = [
    (fast_mod.PerSampleEngine, "_verify", "check"),
    (fast_mod.PerSampleEngine, "_verify_reference", "check:vmap-vs-loop"),
    (cap_mod.Recorder, "check", "check"),
    (cap_mod.Recorder, "_loop_streamed", "check:single-example"),
    (hooks_mod.HookCapture, "finish_check", "check"),
    (fast_mod.PerSampleEngine, "_capture", "capture"),
    (hooks_mod.HookCapture, "collect", "collect"),
    (cap_mod.Recorder, "build", "blocks"),
    (cap_mod.Plan, "blocks", "blocks"),
    (fast_mod.FastPerSampleGrads, "sq_norms", "norms"),
    (fast_mod.FastPerSampleGrads, "weighted_sum", "clipped sums"),
    (priv_mod.Privatizer, "accumulate", "accumulate"),
    (priv_mod.Privatizer, "release", "release+noise"),
    (DPOptimizer, "apply_release", "apply"),
    (po_mod.PrivateOptimizer, "step", "optimizer.step"),
]


def label_methods() -> None:
    """Wrap every phase method in a ``record_function`` of its label (this process only)."""
    for owner, attr, label in PHASES:
        inner = getattr(owner, attr)

        def wrapped(*args, _inner=inner, _label=label, **kw):
            with record_function("phase:" + _label):
                return _inner(*args, **kw)

        setattr(owner, attr, wrapped)


def allocations(prof) -> list:
    """[(time ns, bytes (+ alloc / − free), ptr, innermost phase label)] in time order."""
    out = []

    def walk(node, label, op):
        name = getattr(node, "name", "")
        if name.startswith("phase:"):
            label, op = name[len("phase:") :], ""
        elif node.tag == _EventType.TorchOp and not op:
            op = name  # the outermost torch op under the phase
        if node.tag == _EventType.Allocation:
            key = f"{label}/{op}" if DETAIL and op else label
            out.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr, key))
        for child in node.children:
            walk(child, label, op)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, "torch", "")
    out.sort(key=lambda e: e[0])
    return out


def analyse(events: list) -> dict:
    """Peak of the live bytes allocated in the profile, what they were (by phase) at that moment."""
    live: dict = {}  # ptr → (bytes, label)
    cur = peak = 0
    at_peak: dict = {}
    for _t, size, ptr, label in events:
        if size > 0:
            live[ptr] = (size, label)
        else:
            if live.pop(ptr, None) is None:
                continue  # a block from before the step
        cur += size
        if cur > peak:
            peak = cur
            at_peak = defaultdict(int)
            for s, lab in live.values():
                at_peak[lab] += s
    return {
        "peak_mib": round(peak / MIB, 1),
        "at_peak_mib": {k: round(v / MIB, 1) for k, v in sorted(at_peak.items(), key=lambda kv: -kv[1]) if v > 0},
    }


def run(model: str, door: str, steps: int) -> list:
    make = {"non-private": non_private_step, "dp-sgd": dpopt_step, "pe": privacy_engine_step}[door]
    f = make(model)
    res = []
    for _ in range(steps):  # noqa: B007
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            f()
        res.append(analyse(allocations(prof)))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2-untied,bert,gpt2-lora")
    ap.add_argument("--doors", default="non-private,dp-sgd,pe")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--detail", action="store_true", help="split each phase's bytes by the torch op that made them")
    args = ap.parse_args()
    global DETAIL
    DETAIL = args.detail
    torch.set_num_threads(args.threads)
    label_methods()
    out: dict = {}
    for m in args.models.split(","):
        out[m] = {}
        for d in args.doors.split(","):
            out[m][d] = run(m, d, args.steps)
            for i, r in enumerate(out[m][d]):
                parts = ", ".join(f"{k} {v}" for k, v in r["at_peak_mib"].items())
                print(f"{m:12s} {d:12s} step {i + 1}: peak {r['peak_mib']:7.1f} MiB  at peak: {parts}", flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
