"""Where a compiled per-sample step spends its time: the compiled capture against the eager one, side by side.

For each model (``mlp``: MNIST MLP, ``cnn5``: CIFAR-10 CNN, the shapes of ``benchmarks/step_time.py``)
one process builds the same model three times and times, round-robin (R rounds × K calls each, wall
and CPU-time medians):

* ``capture``: the fast engine's forward and backward to the layer outputs only
  (:meth:`~dpopt.engine.fast.PerSampleEngine._capture`), eager and ``compile=BACKEND``
  (:mod:`dpopt.engine.compiled`: one graph, taps on the planned layers);
* ``source``: the whole per-sample work of a step: the capture, the blocks, the per-example
  squared norms and one clipped sum (what the Privatizer consumes; no noise), eager and compiled;
* ``non-private``: forward + backward of the bare model, eager and ``torch.compile(model)`` with
  the same backend (what inductor does for this model without any capture).

Then it prints ``compiled/eager`` for each, the graphs the compiled capture compiled over batches of
several Poisson-like sizes (1 = no recompilation per batch size), and, with ``--profile``, the top
operators of one compiled and one eager source (``torch.profiler``, self CPU time).

Usage::

    nice -n 10 python benchmarks/compile_step.py --models mlp,cnn5 --json
    nice -n 10 python benchmarks/compile_step.py --models cnn5 --batch 128 --profile

The first compiled call (compilation and the first-batch check on the compiled path) is timed apart
(``compile_seconds``). No test asserts these times; docs/performance.md ("torch.compile") records them.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as benchmarks/step_time.py: shared CPUs

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402
from step_time import loss_fn, time_round_robin  # noqa: E402  (benchmarks/ is on sys.path when run)
from torch import nn  # noqa: E402

from dpopt.engine.fast import PerSampleEngine  # noqa: E402
from dpopt.models import build_model  # noqa: E402
from dpopt.types import ClipGeometry, EvaluationPoint  # noqa: E402

SHAPES = {"mlp": ((1, 28, 28), 256), "cnn5": ((3, 32, 32), 512)}


def batch(model_name: str, b: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = SHAPES[model_name][0]
    return torch.randn(b, *shape, generator=g), torch.randint(0, 10, (b,), generator=g)


MODELS: list = []  # the engines hold their models weakly: keep them alive here


def engine(model_name: str, compile: object) -> PerSampleEngine:
    torch.manual_seed(0)
    MODELS.append(build_model(model_name))
    return PerSampleEngine(MODELS[-1], loss_fn, compile=compile)


def source_work(eng: PerSampleEngine, x, y) -> Callable[[], None]:
    """The per-sample work of one step: capture, blocks, squared norms, one clipped sum (C = 1)."""
    k = len(eng.params)

    def run():
        src = eng.compute(x, y)
        sq = src.sq_norms(ClipGeometry(), [0] * k, 1)[:, 0]
        src.weighted_sum((1.0 / sq.sqrt().clamp(min=1.0)).unsqueeze(1), ClipGeometry(), [0] * k)

    return run


def non_private(model: nn.Module, x, y) -> Callable[[], None]:
    params = [p for p in model.parameters() if p.requires_grad]

    def run():
        torch.autograd.grad(loss_fn(model(x), y), params)

    return run


def profile(name: str, fn: Callable[[], None], rows: int) -> None:
    from torch.profiler import profile as prof

    with prof() as p:
        fn()
    print(f"\n{name}: top operators by self CPU time")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def run_model(model_name: str, args) -> dict:
    b = args.batch or SHAPES[model_name][1]
    x, y = batch(model_name, b)
    eager, comp = engine(model_name, False), engine(model_name, args.backend)
    t = time.perf_counter()
    eager.compute(x, y)  # the first-batch check
    eager_first = time.perf_counter() - t
    t = time.perf_counter()
    comp.compute(x, y)  # compilation + the first-batch check on the compiled path
    compile_s = time.perf_counter() - t
    graphs_first = comp._compiled.compiles
    for i, n in enumerate((b - 3, b + 5, b - 11)):  # Poisson-like sizes: no new graph expected
        comp.compute(*batch(model_name, n, seed=i + 1))
    recompiles = comp._compiled.compiles - graphs_first
    torch.manual_seed(0)
    bare = build_model(model_name)
    compiled_bare = torch.compile(bare, backend=args.backend)
    t = time.perf_counter()
    non_private(compiled_bare, x, y)()
    np_compile_s = time.perf_counter() - t
    pt = EvaluationPoint(1.0)
    fns = {
        "capture eager": lambda: eager._capture(x, y, pt),
        "capture compiled": lambda: comp._capture(x, y, pt),
        "source eager": source_work(eager, x, y),
        "source compiled": source_work(comp, x, y),
        "non-private eager": non_private(bare, x, y),
        "non-private compiled": non_private(compiled_bare, x, y),
    }
    res = {  # one warm-up call each, then round-robin: median wall and CPU seconds per call
        k: (r["median"], r["cpu_median"])
        for k, r in time_round_robin(fns, args.rounds, args.per_round, warmup=1).items()
    }
    load = os.getloadavg()[0]
    print(f"\n{model_name}: B = {b}, {args.threads} threads, backend {args.backend}, 1-min load {load:.1f}")
    for k, (w, c) in res.items():
        print(f"{k:22s} {1e3 * w:9.1f} ms wall {1e3 * c:9.1f} ms cpu")
    out: dict = {"batch": b, "backend": args.backend, "threads": args.threads, "loadavg_1min": round(load, 2)}
    for part in ("capture", "source", "non-private"):
        (we, ce), (wc, cc) = res[f"{part} eager"], res[f"{part} compiled"]
        print(f"{part:12s} compiled/eager {wc / we:5.2f} wall, {cc / ce:5.2f} cpu")
        out[f"{part}:compiled/eager"] = round(wc / we, 3)
        out[f"cpu:{part}:compiled/eager"] = round(cc / ce, 3)
    out["ms"] = {k: round(1e3 * w, 2) for k, (w, _) in res.items()}
    out["cpu_ms"] = {k: round(1e3 * c, 2) for k, (_, c) in res.items()}
    out.update(
        compile_seconds=round(compile_s, 1),
        eager_first_seconds=round(eager_first, 1),
        non_private_compile_seconds=round(np_compile_s, 1),
        graphs_first_batch=graphs_first,
        recompiles_over_3_batch_sizes=recompiles,
    )
    print(
        f"first compiled call (compile + check) {compile_s:.1f} s ({graphs_first} graphs: the batch and the check's "
        f"float64 pass), first eager call (check) {eager_first:.1f} s; graphs compiled over 3 other batch sizes: "
        f"{recompiles}"
    )
    if args.profile:
        profile(f"{model_name} source eager", fns["source eager"], args.profile)
        profile(f"{model_name} source compiled", fns["source compiled"], args.profile)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,cnn5", help="comma-separated: mlp, cnn5")
    ap.add_argument("--batch", type=int, default=0, help="batch size (default: mlp 256, cnn5 512)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-round", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", type=int, nargs="?", const=12, default=0, help="print the top N operators")
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
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
