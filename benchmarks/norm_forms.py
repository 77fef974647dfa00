"""Per-layer CPU time of each exact norm form on the GPT-2 / BERT benchmark shapes, next to the cost model's choice.

For every distinct factored-block shape (B, T, p, q) of the engine's source on the benchmark batch of
``benchmarks/transformer_step.py`` (``--models``), the median CPU milliseconds (``time.process_time``, one
process, reps interleaved across the forms so that a load swing hits all of them) of norms + clipped sum of
one :class:`dpopt.engine.layers.FactoredBlock`, each form forced:

* ``cache``: direct form, per-example gradients g_i = E_iᵀA_i materialised in chunks and kept, sum from them;
* ``direct``: direct form, g_i for the norms only, then the clipped sum as one GEMM Eᵀ diag(c) A;
* ``gram``: ‖g_i‖² = Σ_{t,s}(a_it·a_is)(e_it·e_is) in float64, then the same GEMM;
* ``chol``: the Cholesky form (:mod:`dpopt.engine.chol_norm`), then the same GEMM;

then the cost model's predicted times (:func:`dpopt.engine.layers.form_costs`' units: the cached direct form
= 1) and its choice with and without a cache, against the measured cheapest. Not a test: nothing asserts a
time.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/norm_forms.py --models bert,gpt2-untied --reps 7
    OMP_NUM_THREADS=1 python benchmarks/norm_forms.py --models "" --fixed --reps 5   # the fixed shape list
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import transformer_step as ts  # noqa: E402

from dpopt.engine import iter_per_sample_sources  # noqa: E402
from dpopt.engine.layers import Budget, FactoredBlock, LinearPart  # noqa: E402

FORMS = ("cache", "direct", "gram", "chol")

#: ``--fixed``: the shapes the Linear thresholds were first measured on (docs/performance.md, "Gram or
#: direct"; formerly ``benchmarks/gram_or_direct.py``); from the commented one on, the transformer benchmark's
#: (its (8, 128, 256, 1024) and (8, 128, 256, 768) are among the first ones).
FIXED_SHAPES = [
    (32, 4, 4096, 128),
    (16, 20, 1024, 1024),
    (32, 8, 4096, 128),
    (8, 32, 768, 768),
    (8, 64, 768, 3072),
    (32, 16, 4096, 128),
    (8, 48, 512, 512),
    (8, 128, 768, 3072),
    (32, 32, 4096, 128),
    (8, 256, 768, 3072),
    (16, 200, 768, 768),
    (8, 128, 256, 1024),
    (8, 128, 256, 768),
    (8, 128, 256, 256),  # the GPT-2 / BERT shapes of benchmarks/transformer_step.py (issue 34)
    (8, 128, 1024, 256),
    (8, 128, 256, 8192),
]


def layer_shapes(name: str) -> list[tuple[int, int, int, int]]:
    """Distinct (B, T, p, q) of the factored blocks of the engine's source for the benchmark batch, in order."""
    model, (x, y) = ts.build(name), ts.batch(name)
    src = next(iter(iter_per_sample_sources(model, ts.loss_fn, x, y)))
    out: list[tuple[int, int, int, int]] = []
    for blk in src.blocks:
        if isinstance(blk, FactoredBlock) and not blk.closed_form():
            shape = (blk.B, blk.T, blk.p, blk.q)
            if shape not in out:
                out.append(shape)
    return out


def run_form(a: torch.Tensor, e: torch.Tensor, c: torch.Tensor, form: str) -> float:
    """CPU seconds of one block's norms + clipped sum in ``form`` (forced)."""
    b, _, p = a.shape
    q = e.shape[2]
    if form == "cache":
        budget = Budget(16 << 20, b * p * q * 4 + 1, norm_form="direct")
    else:
        budget = Budget(16 << 20, 0, norm_form=form)
    blk = FactoredBlock(0, (q, p), [LinearPart(a, e)], budget, b)
    blk.cache_ok = form == "cache"
    t0 = time.process_time()
    blk.sq_norms([(None, None)])
    blk.grad_sums([c], None)
    dt = time.process_time() - t0
    assert blk.form == ("direct" if form == "cache" else form), blk.form
    blk.free()
    return dt


def measure(shape: tuple[int, int, int, int], reps: int) -> dict[str, float]:
    """Median CPU ms of each form of ``shape`` over ``reps`` interleaved rounds (after one warm-up round)."""
    b, t, p, q = shape
    g = torch.Generator().manual_seed(0)
    a, e, c = torch.randn(b, t, p, generator=g), torch.randn(b, t, q, generator=g), torch.rand(b, generator=g)
    times: dict[str, list[float]] = {f: [] for f in FORMS}
    for k in range(reps + 1):
        for f in FORMS:
            dt = run_form(a, e, c, f)
            if k:
                times[f].append(dt)
    return {f: 1e3 * statistics.median(v) for f, v in times.items()}


def model_choice(shape: tuple[int, int, int, int], cached: bool) -> str:
    """The engine's form for ``shape`` in the flat geometry (``"cache"`` for the cached direct form)."""
    b, t, p, q = shape
    a, e = torch.zeros(b, t, p), torch.zeros(b, t, q)
    blk = FactoredBlock(0, (q, p), [LinearPart(a, e)], Budget(), b)
    form = blk.cheapest_form(True, cached)
    return "cache" if (form == "direct" and cached) else form


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert,gpt2-untied")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", default="", help="extra B,T,p,q shapes, ';'-separated (e.g. the tests' shapes)")
    ap.add_argument("--fixed", action="store_true", help="also the FIXED_SHAPES (use --models '' for only them)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# threads {args.threads}, reps {args.reps}, load {os.getloadavg()[0]:.1f}, CPU ms (process_time)")
    hdr = f"{'model':12s} {'B':>3} {'T':>4} {'p':>5} {'q':>5} {'r':>5} " + " ".join(f"{f:>7s}" for f in FORMS)
    print(hdr + "  best(cached) best(uncached)  model(cached) model(uncached)")
    todo = [(name, shape) for name in filter(None, args.models.split(",")) for shape in layer_shapes(name)]
    todo += [("shape", tuple(int(v) for v in sh.split(","))) for sh in filter(None, args.shapes.split(";"))]
    todo += [("fixed", shape) for shape in FIXED_SHAPES] if args.fixed else []
    for name, shape in todo:
        b, t, p, q = shape
        ms = measure(shape, args.reps)
        best_c = min(FORMS, key=lambda f: ms[f])
        best_u = min(FORMS[1:], key=lambda f: ms[f])
        print(
            f"{name:12s} {b:3d} {t:4d} {p:5d} {q:5d} {t * (p + q) / (p * q):5.2f} "
            + " ".join(f"{ms[f]:7.1f}" for f in FORMS)
            + f"  {best_c:>12s} {best_u:>14s}  {model_choice(shape, True):>13s} {model_choice(shape, False):>15s}",
            flush=True,
        )
    print(f"# load at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
