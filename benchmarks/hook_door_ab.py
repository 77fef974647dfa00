"""The ``PrivacyEngine`` door's step before and after its two issue-34 cuts, side by side in one process.

CPU time (``time.process_time``) of steady steps (after the first-batch check's step and one more),
configurations interleaved round by round (order reversed every other round), medians. The models and
loops are ``benchmarks/transformer_step.py``'s (``non-private``, ``dp-sgd``: dpopt's own loop door).
Three variants of the hook door, in the same process:

* ``pe-before`` — the code before the cuts, reproduced: the user's backward forms ``p.grad`` of every
  rule layer (``HookCapture.forms_param_grads = True``, what ``Recorder(param_grads=True)`` keeps) and
  the door's scale (B for a mean loss) is copied into every layer's output gradient (the former
  ``Recorder._scaled``, re-created here as :func:`_copy_scale`) instead of folded into the blocks;
* ``pe-nograd`` — the weight-gradient products skipped, the scale still copied;
* ``pe-after`` — both cuts (the library as it is).

The hook door's forward, backward and ``step()`` are also timed apart. The copy reproduction holds for
models without a vjp-fallback layer (the transformer benchmark's models: every parameter has a rule).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/hook_door_ab.py --models gpt2-untied,gpt2-lora --rounds 7

docs/performance.md, "The PrivacyEngine door's extra time (issue 34)".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import transformer_step as ts  # noqa: E402

import dpopt  # noqa: E402
from dpopt.engine import capture, hooks  # noqa: E402

_COPY = {"on": False}
_build = capture.Recorder.build
_scaled_block = capture.scaled_block


def _copy_scale(calls, scale: float, other: dict) -> None:
    """The former ``Recorder._scaled``: each fast call's stored output gradient replaced by ``scale ·`` it
    (one copy per distinct tensor)."""
    memo: dict = {}
    for c in calls:
        if not c.fast or (c.index is not None and c.index in other) or c.grads[0] is None or scale == 1:
            continue
        g = c.grads[0]
        if id(g) not in memo:
            memo[id(g)] = g * scale
        c.grads[0] = memo[id(g)]


def _patched_build(self, calls, rows, scale, views=1, other=None):
    if not _COPY["on"]:
        return _build(self, calls, rows, scale, views, other)
    _copy_scale(calls, scale, other or {})
    capture.scaled_block = lambda blk, s: blk  # the gradients already carry the scale
    try:
        return _build(self, calls, rows, scale, views, other)
    finally:
        capture.scaled_block = _scaled_block


def privacy_engine_step(name: str, param_grads: bool, copy: bool, phases: dict) -> Callable[[], None]:
    """``transformer_step.privacy_engine_step``'s loop, its forward / backward / step timed apart."""
    hooks.HookCapture.forms_param_grads = param_grads
    try:
        model, (x, y) = ts.build(name), ts.batch(name)
        params = [p for p in model.parameters() if p.requires_grad]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # poisson_sampling=False (fixed benchmark batch) is warned about
            model, opt, _ = dpopt.PrivacyEngine().make_private(
                module=model,
                optimizer=torch.optim.SGD(params, lr=0.1),
                data_loader=ts._loader(x, y),
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                poisson_sampling=False,
            )
    finally:
        hooks.HookCapture.forms_param_grads = False

    def step():
        _COPY["on"] = copy
        try:
            t0 = time.process_time()
            opt.zero_grad(set_to_none=True)
            loss = ts.loss_fn(model(x), y)
            t1 = time.process_time()
            loss.backward()
            t2 = time.process_time()
            opt.step()
            t3 = time.process_time()
        finally:
            _COPY["on"] = False
        for k, v in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2)):
            phases.setdefault(k, []).append(v)

    return step


def run_model(name: str, rounds: int) -> None:
    phases: dict = {"pe-before": {}, "pe-nograd": {}, "pe-after": {}}
    steps = {
        "non-private": ts.non_private_step(name),
        "dp-sgd": ts.dpopt_step(name),
        "pe-before": privacy_engine_step(name, True, True, phases["pe-before"]),
        "pe-nograd": privacy_engine_step(name, False, True, phases["pe-nograd"]),
        "pe-after": privacy_engine_step(name, False, False, phases["pe-after"]),
    }
    for s in steps.values():  # the first step (first-batch check) and one steady step
        s()
        s()
    cpu: dict = {k: [] for k in steps}
    load = os.getloadavg()[0]
    for r in range(rounds):
        for k in list(steps) if r % 2 == 0 else list(reversed(steps)):
            t = time.process_time()
            steps[k]()
            cpu[k].append(time.process_time() - t)
    base = statistics.median(cpu["non-private"])
    print(f"{name}: {rounds} rounds, one thread, 1-minute load {load:.1f} -> {os.getloadavg()[0]:.1f}")
    for k, v in cpu.items():
        m = statistics.median(v)
        print(
            f"  {k:12s} {1e3 * m:8.1f} ms  {m / base:5.3f}x non-private  (min {1e3 * min(v):.1f}, max {1e3 * max(v):.1f})"
        )
    for k, ph in phases.items():
        parts = ", ".join(f"{n} {1e3 * statistics.median(v[-rounds:]):.1f}" for n, v in ph.items())
        print(f"  {k:12s} median ms: {parts}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-untied,gpt2-lora")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    capture.Recorder.build = _patched_build
    try:
        for name in args.models.split(","):
            run_model(name, args.rounds)
    finally:
        capture.Recorder.build = _build


if __name__ == "__main__":
    main()
