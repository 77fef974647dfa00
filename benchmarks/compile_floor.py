"""The floor of a compiled DP step on this CPU: what inductor does to the capture's computation without dpopt.

The compiled DP step (``compile=True``, :mod:`dpopt.engine.compiled`) compiles only the capture — the
forward and the backward to the layer outputs; the rest of the step (blocks, per-example norms, clipped
sums, noise: the Privatizer) stays eager by design (DESIGN.md: no protecting random draw in compiled code).
So ``compiled step = compiled capture + R`` and ``eager step = eager capture + R`` with the same eager
remainder ``R``, and the compiled step is faster only if the compiled capture is faster than the eager one.
For each model (``mlp``, ``cnn5``: the shapes of ``benchmarks/step_time.py``) this times, round-robin in one
process (R rounds × K calls, CPU-time medians, ``time.process_time``):

* ``capture eager`` / ``capture compiled``: the fast engine's forward + backward to the layer outputs
  (:meth:`~dpopt.engine.fast.PerSampleEngine._capture`), eager and through the compiled capture (taps);
* ``chain eager`` / ``chain compiled``: the same model, nothing of dpopt: parameters frozen
  (``requires_grad=False``), the input requiring grad, ``torch.autograd.grad(loss, x)`` of a plain
  ``model(x)`` and of ``torch.compile(model)`` (static shapes: inductor's best case). Its backward computes
  every layer's output gradient — exactly the capture's backward — plus the first layer's input gradient
  on both sides; no taps, no weight gradient;
* ``non-private eager`` / ``non-private compiled``: forward + backward with the weight gradients
  (``torch.compile(model)``), for reference;
* ``step eager``: one eager ``dp-sgd`` step (σ = 1, C = 1), whose remainder ``R = step − capture``
  is the eager part a compiled step keeps.

It prints the ratios, ``R`` and the compiled step these predict, ``(capture compiled + R) / step eager``.

``--option NAME=VALUE`` (repeatable; Python literals) sets ``torch._inductor.config`` options while
the capture's graphs and the chain's compile (:data:`dpopt.engine.compiled.INDUCTOR_OPTIONS`, scoped by
``config.patch``): e.g. ``cpp_wrapper=True``, ``max_autotune=True``. ``--static`` compiles the capture
with a static batch axis (one graph per batch size).

Usage::

    nice -n 10 python benchmarks/compile_floor.py --models mlp --json
    nice -n 10 python benchmarks/compile_floor.py --models cnn5 --batch 128 --option cpp_wrapper=True

The first call of each compiled function (its compilation; the capture's includes the first-batch check)
is outside the timing. No test asserts these times; docs/performance.md ("the floor") records them.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as benchmarks/step_time.py: shared CPUs

import argparse  # noqa: E402
import ast  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402
from compile_step import MODELS, SHAPES, batch, non_private  # noqa: E402  (benchmarks/ is on sys.path)
from step_time import dpopt_step, loss_fn, time_round_robin  # noqa: E402
from torch import nn  # noqa: E402

import dpopt.engine.compiled as compiled_mod  # noqa: E402
from dpopt.engine.fast import PerSampleEngine  # noqa: E402
from dpopt.models import build_model  # noqa: E402
from dpopt.types import EvaluationPoint  # noqa: E402


def chain(model: nn.Module, x, y) -> Callable[[], None]:
    """Forward + backward to the input of a model with frozen parameters: every layer's output gradient."""
    xg = x.detach().clone().requires_grad_(True)

    def run():
        torch.autograd.grad(loss_fn(model(xg), y), [xg])

    return run


def run_model(model_name: str, args) -> dict:
    b = args.batch or SHAPES[model_name][1]
    x, y = batch(model_name, b)
    torch.manual_seed(0)
    MODELS.append(build_model(model_name))
    eager = PerSampleEngine(MODELS[-1], loss_fn, compile=False)
    torch.manual_seed(0)
    MODELS.append(build_model(model_name))
    comp = PerSampleEngine(MODELS[-1], loss_fn, compile=args.backend)
    eager.compute(x, y)  # the first-batch check
    t = time.perf_counter()
    comp.compute(x, y)  # compilation + the first-batch check on the compiled path
    compile_s = time.perf_counter() - t
    torch.manual_seed(0)
    bare = build_model(model_name)
    frozen = copy.deepcopy(bare).requires_grad_(False)
    fns = {
        "capture eager": lambda: eager._capture(x, y, EvaluationPoint(1.0)),
        "capture compiled": lambda: comp._capture(x, y, EvaluationPoint(1.0)),
        "chain eager": chain(frozen, x, y),
        "chain compiled": chain(torch.compile(frozen, backend=args.backend, dynamic=False), x, y),
        "non-private eager": non_private(bare, x, y),
        "non-private compiled": non_private(torch.compile(bare, backend=args.backend, dynamic=False), x, y),
        "step eager": dpopt_step(model_name, "dp-sgd", x, y),
    }
    from torch._inductor import config

    with config.patch(**compiled_mod.INDUCTOR_OPTIONS):  # the chain's and non-private compiles, same options
        fns["chain compiled"]()
        fns["non-private compiled"]()
    res = {k: r["cpu_median"] for k, r in time_round_robin(fns, args.rounds, args.per_round, warmup=1).items()}
    load = os.getloadavg()[0]
    print(f"\n{model_name}: B = {b}, {args.threads} threads, backend {args.backend}, 1-min load {load:.1f}")
    print(f"options {compiled_mod.INDUCTOR_OPTIONS}, static capture: {args.static}")
    for k, c in res.items():
        print(f"{k:22s} {1e3 * c:9.1f} ms cpu")
    out: dict = {"batch": b, "backend": args.backend, "threads": args.threads, "loadavg_1min": round(load, 2)}
    out["options"] = {k: repr(v) for k, v in compiled_mod.INDUCTOR_OPTIONS.items()}
    out["static_capture"] = args.static
    for part in ("capture", "chain", "non-private"):
        r = res[f"{part} compiled"] / res[f"{part} eager"]
        print(f"{part:12s} compiled/eager {r:5.2f} cpu")
        out[f"cpu:{part}:compiled/eager"] = round(r, 3)
    rest = res["step eager"] - res["capture eager"]
    predicted = (res["capture compiled"] + rest) / res["step eager"]
    print(
        f"eager remainder R = step - capture = {1e3 * rest:.1f} ms ({rest / res['step eager']:.0%} of the step); "
        f"predicted compiled step / eager step = {predicted:.2f}; floor with inductor's own chain ratio: "
        f"{(res['capture eager'] * out['cpu:chain:compiled/eager'] + rest) / res['step eager']:.2f}"
    )
    out["cpu:remainder/step"] = round(rest / res["step eager"], 3)
    out["cpu:predicted_compiled_step/eager_step"] = round(predicted, 3)
    out["cpu_ms"] = {k: round(1e3 * c, 2) for k, c in res.items()}
    out["compile_seconds"] = round(compile_s, 1)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,cnn5", help="comma-separated: mlp, cnn5")
    ap.add_argument("--batch", type=int, default=0, help="batch size (default: mlp 256, cnn5 512)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager)")
    ap.add_argument("--option", action="append", default=[], help="NAME=VALUE: an inductor config option")
    ap.add_argument("--static", action="store_true", help="the capture's batch axis static (a graph per size)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-round", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for opt in args.option:
        name, _, value = opt.partition("=")
        compiled_mod.INDUCTOR_OPTIONS[name] = ast.literal_eval(value)
    if args.static:
        compiled_mod.torch._dynamo.maybe_mark_dynamic = lambda *a, **k: None  # this process only
    result = {}
    for name in [m for m in args.models.split(",") if m]:
        if name not in SHAPES:
            sys.exit(f"unknown model {name!r}; choose from {sorted(SHAPES)}")
        result[name] = run_model(name, args)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
