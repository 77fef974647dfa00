"""The CPU floor of a DP step on the transformer shapes of ``transformer_step.py``: each unavoidable kernel timed alone.

A DP-SGD step with book-keeping (Bu et al. 2023, arXiv 2210.00038) does the non-private step's work with the
weight-gradient GEMMs replaced by the clipped sums (same FLOPs), plus per-example norms and the noise. So

    floor = non-private step + Σ_layers (cheapest exact norm kernel of the layer) + noise + small per-example terms.

This script measures, in one process (CPU time, medians of ``--reps``), on the layers the engine builds for
the model (every factored block of a real ``iter_per_sample_sources`` source, its B, T, p, q):

* ``np``: the non-private step (forward, backward, SGD), and its parts: the backward without weight gradients
  (every parameter frozen, the embedding output requiring grad), i.e. the capture's floor;
* per layer: the direct norm (``bmm`` of ``[B, q, T]·[B, T, p]`` in float32, squared norms in float64 slices:
  the engine's direct form), the Gram norm in float64 (the engine's Gram form: float64 because the terms
  cancel, docs/performance.md) and in float32 (the FLOP floor of the ghost norm, not safe to use), the
  Cholesky form (``engine/chol_norm.py``: float64 Gram of the narrow side, its Cholesky factor, the product
  with the wide side in float32), and the weight-gradient GEMM ``Eᵀ A`` (the clipped sum, which replaces
  the non-private weight gradient);
* the noise for every trainable parameter: dpopt's secret sampler (float64, tail-preserving) and torch's
  float32 ``normal_`` (what Opacus draws);
* the engine's own step parts (capture, norms, clipped sums, noise), by wrapping its methods.

Not a test: nothing asserts a time. Usage::

    python benchmarks/transformer_floor.py --models gpt2-untied,bert --threads 1 --reps 5
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import transformer_step as ts  # noqa: E402

from dpopt.engine import fast, iter_per_sample_sources  # noqa: E402
from dpopt.engine.chol_norm import cholesky_sq_norms  # noqa: E402
from dpopt.engine.layers import FactoredBlock, row_sq_norms64  # noqa: E402
from dpopt.noise import CpuNormalDraw, NoiseSource  # noqa: E402


def med_ms(f: Callable[[], object], reps: int) -> float:
    """Median CPU milliseconds of ``f`` over ``reps`` calls after one warm-up call."""
    f()
    out = []
    for _ in range(reps):
        c = time.process_time()
        f()
        out.append(time.process_time() - c)
    return 1e3 * statistics.median(out)


def layer_shapes(name: str) -> list[tuple[int, int, int, int]]:
    """(B, T, p, q) of every factored block of the engine's source for the benchmark batch."""
    model, (x, y) = ts.build(name), ts.batch(name)
    src = next(iter(iter_per_sample_sources(model, ts.loss_fn, x, y)))
    return [(blk.B, blk.T, blk.p, blk.q) for blk in src.blocks if isinstance(blk, FactoredBlock)]


def kernels(b: int, t: int, p: int, q: int, reps: int) -> dict[str, float]:
    """Per-layer kernels alone (ms): direct norm, Gram norm float64 / float32, Cholesky form, weight-gradient GEMM."""
    g = torch.Generator().manual_seed(0)
    a, e = torch.randn(b, t, p, generator=g), torch.randn(b, t, q, generator=g)
    # examples in chunks of at most 16 MiB of temporaries, as the engine's Budget.chunk_bytes (a whole-batch
    # float64 copy of the head's [8, 128, 8192] output gradients is 64 MiB of fresh pages: slower per FLOP)
    step_direct = max(1, min(b, (16 << 20) // ((2 * p * q + (p + q) * t) * 4)))
    step_gram = max(1, min(b, (16 << 20) // ((2 * t * t + (p + q) * t) * 8)))
    n, w = min(p, q), max(p, q)
    step_chol = max(1, min(b, (16 << 20) // ((3 * t * t + n * t) * 8 + 2 * w * t * 4)))
    narrow, wide = (a, e) if p <= q else (e, a)

    def chol():
        return [cholesky_sq_norms(narrow[s : s + step_chol], wide[s : s + step_chol]) for s in range(0, b, step_chol)]

    def direct():
        return [
            row_sq_norms64(torch.bmm(e[s : s + step_direct].transpose(1, 2), a[s : s + step_direct]).flatten(1))
            for s in range(0, b, step_direct)
        ]

    def gram(dtype):
        out = []
        for s in range(0, b, step_gram):
            aa, ee = a[s : s + step_gram].to(dtype), e[s : s + step_gram].to(dtype)
            out.append((torch.bmm(aa, aa.transpose(1, 2)) * torch.bmm(ee, ee.transpose(1, 2))).sum((1, 2)))
        return out

    return {
        "direct": med_ms(direct, reps),
        "gram64": med_ms(lambda: gram(torch.float64), reps),
        "gram32": med_ms(lambda: gram(torch.float32), reps),
        "chol": med_ms(chol, reps),
        "wgrad": med_ms(lambda: e.reshape(-1, q).t() @ a.reshape(-1, p), reps),
    }


def engine_parts(name: str, reps: int) -> dict[str, float]:
    """CPU ms per dp-sgd step in the engine's parts (methods wrapped with CPU timers)."""
    acc: dict[str, float] = defaultdict(float)
    wrapped = [
        (fast.PerSampleEngine, "_capture", "capture"),
        (fast.FastPerSampleGrads, "sq_norms", "norms"),
        (fast.FastPerSampleGrads, "weighted_sum", "clipped sums"),
        (CpuNormalDraw, "consume", "noise"),
    ]
    saved = [(cls, meth, getattr(cls, meth)) for cls, meth, _ in wrapped]

    def timed(f, key):
        @functools.wraps(f)
        def inner(*args, **kwargs):
            c = time.process_time()
            try:
                return f(*args, **kwargs)
            finally:
                acc[key] += time.process_time() - c

        return inner

    try:
        for (cls, meth, key), (_, _, f) in zip(wrapped, saved):
            setattr(cls, meth, timed(f, key))
        step = ts.factory(name, "dp-sgd")
        step()
        acc.clear()
        total = []
        for _ in range(reps):
            c = time.process_time()
            step()
            total.append(time.process_time() - c)
    finally:
        for cls, meth, f in saved:
            setattr(cls, meth, f)
    out = {k: 1e3 * v / reps for k, v in acc.items()}
    out["step"] = 1e3 * statistics.mean(total)
    out["rest"] = out["step"] - sum(v for k, v in out.items() if k != "step")
    return out


def np_parts(name: str, reps: int) -> dict[str, float]:
    """Non-private step and its backward without weight gradients (ms)."""
    step = ts.factory(name, "non-private")
    frozen, (x, y) = ts.build(name), ts.batch(name)
    frozen.requires_grad_(False)
    first = frozen.wte if name.startswith("gpt2") else frozen.tok
    first.register_forward_hook(lambda m, i, o: o.requires_grad_())
    return {
        "step": med_ms(step, reps),
        "fwd+bwd, no weight grads": med_ms(lambda: ts.loss_fn(frozen(x), y).backward(), reps),
    }


def _torch_normal(n: int) -> torch.Tensor:
    return torch.empty(n).normal_()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2-untied,bert")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        model = ts.build(name)
        n = sum(p.numel() for p in model.parameters() if p.requires_grad)
        npp = np_parts(name, args.reps)
        eng = engine_parts(name, args.reps)
        secret = NoiseSource("secret")
        noise = {
            "secret float64 sampler": med_ms(functools.partial(secret.normal, (n,)), args.reps),
            "torch float32 normal_": med_ms(functools.partial(_torch_normal, n), args.reps),
        }
        rows, best, best32, wgrad = [], 0.0, 0.0, 0.0
        for shape, k in [(s, kernels(*s, args.reps)) for s in layer_shapes(name)]:
            b, t, p, q = shape
            safe = min(k["direct"], k["gram64"], k["chol"])
            best += safe
            best32 += min(k["direct"], k["gram32"])
            wgrad += k["wgrad"]
            rows.append((shape, t * (p + q) / (p * q), k, safe))
        base = npp["step"]
        print(f"\n{name}: {n} trainable parameters, {args.threads} thread(s), 1-min load {os.getloadavg()[0]:.1f}")
        print(
            f"  non-private step {base:.1f} ms; fwd+bwd without weight gradients {npp['fwd+bwd, no weight grads']:.1f}"
        )
        print("  dp-sgd step parts (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in eng.items()))
        print(
            f"  {'B':>3s} {'T':>4s} {'p':>5s} {'q':>5s} {'r':>5s} {'direct':>7s} {'gram64':>7s} {'gram32':>7s} "
            f"{'chol':>7s} {'wgrad':>6s}"
        )
        for (b, t, p, q), r, k, _ in rows:
            print(
                f"  {b:3d} {t:4d} {p:5d} {q:5d} {r:5.2f} {k['direct']:7.1f} {k['gram64']:7.1f} {k['gram32']:7.1f} "
                f"{k['chol']:7.1f} {k['wgrad']:6.1f}"
            )
        sec, t32 = noise["secret float64 sampler"], noise["torch float32 normal_"]
        print(
            f"  norms, cheapest exact kernel per layer: {best:.1f} ms (float32 Gram allowed: {best32:.1f}); "
            f"weight-gradient GEMMs {wgrad:.1f}; noise: secret {sec:.1f}, torch float32 {t32:.1f}"
        )
        print(
            f"  floor / non-private: {(base + best + sec) / base:.3f} (engine's exact forms, secret noise); "
            f"{(base + best + t32) / base:.3f} (torch noise); {(base + best32 + t32) / base:.3f} (float32 Gram, "
            f"torch noise: the FLOP floor); engine step / non-private {eng['step'] / base:.3f}"
        )


if __name__ == "__main__":
    main()
