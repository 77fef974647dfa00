"""Gram norm or direct form (cached or not): which is faster for a Linear layer's per-example clipping on this CPU.

For each shape (B examples, T positions, p inputs, q outputs) the median milliseconds of norms + clipped
sum of :class:`dpopt.engine.layers.FactoredBlock` in each form, forced:

* ``gram``: ‖g_i‖² = Σ_{t,s} (a_it·a_is)(e_it·e_is) in float64, then one GEMM for Σ_i c_i g_i;
* ``direct+cache``: g_i materialised in chunks (norms), kept, then Σ_i c_i g_i from the cache;
* ``direct``: g_i materialised in chunks for the norms only, then Σ_i c_i g_i as one GEMM Eᵀ diag(c) A
  (what a layer outside the memory budget does);

next to r = T(p+q)/(pq), the ratio the engine's choice reads
(:data:`dpopt.engine.layers.GRAM_WITH_CACHE_BELOW`, :data:`~dpopt.engine.layers.GRAM_WITHOUT_CACHE_BELOW`).
Not a test: nothing asserts a time.

Usage::

    python benchmarks/gram_or_direct.py [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dpopt.engine.layers import Budget, FactoredBlock, LinearPart

SHAPES = [
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
    (8, 128, 256, 1024),
    (8, 128, 1024, 256),
    (8, 128, 256, 8192),
]


def one(b: int, t: int, p: int, q: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    a, e, c = torch.randn(b, t, p, generator=g), torch.randn(b, t, q, generator=g), torch.rand(b, generator=g)
    out = {}
    for form in ("gram", "cache", "direct"):
        ts = []
        for _ in range(reps + 1):
            blk = FactoredBlock(0, (q, p), [LinearPart(a, e)], Budget(16 << 20, 256 << 20), b)
            t0 = time.perf_counter()
            if form == "gram":
                blk._gram()
            else:
                nbytes = b * p * q * 4
                blk._direct(None, None, form == "cache", nbytes)
            blk.grad_sums([c], None)
            ts.append(time.perf_counter() - t0)
        out[form] = statistics.median(ts[1:]) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'B':>3} {'T':>4} {'p':>5} {'q':>5} {'r':>6} {'gram ms':>8} {'cached ms':>10} {'direct ms':>10}")
    for b, t, p, q in SHAPES:
        r = one(b, t, p, q, args.reps)
        print(
            f"{b:3d} {t:4d} {p:5d} {q:5d} {t * (p + q) / (p * q):6.2f} {r['gram']:8.1f} {r['cache']:10.1f} "
            f"{r['direct']:10.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
