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
* the noise for every trainable parameter: dpopt's secret sampler (float64, tail-preserving) as the release
  draws it (streamed chunk by chunk into the float32 sum, :func:`_secret_release`; ``NoiseSource.normal``'s
  one-buffer path is printed beside it) and torch's float32 ``normal_`` (what Opacus draws);
* the engine's own step parts (capture, norms, clipped sums, noise), by wrapping its methods.

Not a test: nothing asserts a time. Usage::

    python benchmarks/transformer_floor.py --models gpt2-untied,bert --threads 1 --reps 5
    python benchmarks/transformer_floor.py --models bert --reps 3 --rounds 7   # each ratio's median and range
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


def _secret_release(source: NoiseSource, flat: torch.Tensor, std: float = 1.0) -> None:
    """The secret noise as the release adds it (``Privatizer``'s streamed path, ``EARLY_DRAW_MAX`` < n):
    chunk by chunk, float64 normals · std + the float32 sum, rounded once into the sum's own storage.

    ``flat``: the float32 sum ``[n]`` (changed in place). Timing :meth:`NoiseSource.normal` instead counts a
    fresh float64 buffer of all n values and its rounding to a second float32 tensor, which the release never
    makes (their page faults are CPU time too): that overstated the noise part of the floor.
    """

    def add(lo: int, hi: int, z: torch.Tensor) -> None:
        flat[lo:hi].copy_(z.mul_(std).add_(flat[lo:hi]))

    source.start_normal(flat.numel(), stream=True).consume(add)


def measure(name: str, reps: int) -> dict:
    """One round for ``name``: every quantity of the floor timed once more (CPU ms), and the floor ratios.

    Returns ``n`` (trainable parameters), ``np`` / ``eng`` (:func:`np_parts` / :func:`engine_parts`),
    ``noise`` (secret sampler and torch's float32 ``normal_``, ms), ``rows`` (per layer: shape, r, kernels,
    cheapest exact kernel), ``best`` / ``best32`` / ``wgrad`` (sums over layers, ms) and the ratios
    ``floor`` (exact forms + secret noise as the release draws it), ``floor_buffered_noise`` (the same with
    ``NoiseSource.normal``'s one-buffer draw, this script's noise before 2026-12-06), ``floor_torch_noise``, ``floor_flop`` (float32 Gram + torch noise)
    and ``engine`` (the engine's ``dp-sgd`` step), each over the same round's non-private step.
    """
    model = ts.build(name)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    npp = np_parts(name, reps)
    eng = engine_parts(name, reps)
    secret = NoiseSource("secret")
    noise = {
        "secret float64 sampler": med_ms(functools.partial(_secret_release, secret, torch.zeros(n)), reps),
        "secret, one buffer (NoiseSource.normal)": med_ms(functools.partial(secret.normal, (n,)), reps),
        "torch float32 normal_": med_ms(functools.partial(_torch_normal, n), reps),
    }
    rows, best, best32, wgrad = [], 0.0, 0.0, 0.0
    for shape, k in [(s, kernels(*s, reps)) for s in layer_shapes(name)]:
        b, t, p, q = shape
        safe = min(k["direct"], k["gram64"], k["chol"])
        best += safe
        best32 += min(k["direct"], k["gram32"])
        wgrad += k["wgrad"]
        rows.append((shape, t * (p + q) / (p * q), k, safe))
    base = npp["step"]
    sec, t32 = noise["secret float64 sampler"], noise["torch float32 normal_"]
    return {
        "n": n,
        "np": npp,
        "eng": eng,
        "noise": noise,
        "rows": rows,
        "best": best,
        "best32": best32,
        "wgrad": wgrad,
        "floor": (base + best + sec) / base,
        "floor_buffered_noise": (base + best + noise["secret, one buffer (NoiseSource.normal)"]) / base,
        "floor_torch_noise": (base + best + t32) / base,
        "floor_flop": (base + best32 + t32) / base,
        "engine": eng["step"] / base,
    }


def report(name: str, m: dict, threads: int) -> None:
    """Print one round's measurement (:func:`measure`) in full."""
    npp, eng, noise = m["np"], m["eng"], m["noise"]
    base = npp["step"]
    print(f"\n{name}: {m['n']} trainable parameters, {threads} thread(s), 1-min load {os.getloadavg()[0]:.1f}")
    print(f"  non-private step {base:.1f} ms; fwd+bwd without weight gradients {npp['fwd+bwd, no weight grads']:.1f}")
    print("  dp-sgd step parts (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in eng.items()))
    print(
        f"  {'B':>3s} {'T':>4s} {'p':>5s} {'q':>5s} {'r':>5s} {'direct':>7s} {'gram64':>7s} {'gram32':>7s} "
        f"{'chol':>7s} {'wgrad':>6s}"
    )
    for (b, t, p, q), r, k, _ in m["rows"]:
        print(
            f"  {b:3d} {t:4d} {p:5d} {q:5d} {r:5.2f} {k['direct']:7.1f} {k['gram64']:7.1f} {k['gram32']:7.1f} "
            f"{k['chol']:7.1f} {k['wgrad']:6.1f}"
        )
    sec, t32 = noise["secret float64 sampler"], noise["torch float32 normal_"]
    buf = noise["secret, one buffer (NoiseSource.normal)"]
    print(
        f"  norms, cheapest exact kernel per layer: {m['best']:.1f} ms (float32 Gram allowed: {m['best32']:.1f}); "
        f"weight-gradient GEMMs {m['wgrad']:.1f}; noise: secret, streamed into the sum {sec:.1f} "
        f"(NoiseSource.normal's one buffer: {buf:.1f}), torch float32 {t32:.1f}"
    )
    print(
        f"  floor / non-private: {m['floor']:.3f} (engine's exact forms, secret noise); "
        f"{m['floor_torch_noise']:.3f} (torch noise); {m['floor_flop']:.3f} (float32 Gram, "
        f"torch noise: the FLOP floor); engine step / non-private {m['engine']:.3f}"
    )


def summarise(name: str, ms: list[dict]) -> dict:
    """Median, min and max over rounds of each ratio and of the parts (ms) that make the floor; printed too."""
    keys = {
        "floor": lambda m: m["floor"],
        "floor_buffered_noise": lambda m: m["floor_buffered_noise"],
        "floor_torch_noise": lambda m: m["floor_torch_noise"],
        "floor_flop": lambda m: m["floor_flop"],
        "engine": lambda m: m["engine"],
        "np_ms": lambda m: m["np"]["step"],
        "norms_ms": lambda m: m["best"],
        "secret_noise_ms": lambda m: m["noise"]["secret float64 sampler"],
        "engine_noise_ms": lambda m: m["eng"].get("noise", float("nan")),
        "engine_norms_ms": lambda m: m["eng"].get("norms", float("nan")),
        "engine_ms": lambda m: m["eng"]["step"],
    }
    out = {}
    print(f"\n{name}: {len(ms)} rounds, each quantity re-timed every round (CPU ms; median [min, max])")
    for k, f in keys.items():
        v = [f(m) for m in ms]
        out[k] = (statistics.median(v), min(v), max(v))
        print(
            f"  {k:18s} {out[k][0]:8.3f}  [{out[k][1]:.3f}, {out[k][2]:.3f}]   rounds: "
            + " ".join(f"{x:.3f}" for x in v)
        )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2-untied,bert")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the whole measurement (non-private step, engine step, kernels, noise) this many times "
        "and print each ratio's median and range over the rounds",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        ms = []
        for r in range(args.rounds):
            ms.append(measure(name, args.reps))
            if args.rounds > 1:
                print(f"[round {r + 1}/{args.rounds}]", end="")
            report(name, ms[-1], args.threads)
        if args.rounds > 1:
            summarise(name, ms)


if __name__ == "__main__":
    main()
