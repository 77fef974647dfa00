"""What one step's Poisson sample costs against the dataset size N, at a fixed expected batch B̄.

    python benchmarks/sampler_cost.py            # a table
    python benchmarks/sampler_cost.py --json     # one JSON object

Rows, per N (q = B̄ / N, default B̄ = 256), ms per step (the median of ``--repeats`` steps, one
thread unless ``--threads``; secret noise unless ``--mode``):

* ``geometric``: :func:`dpopt.sampling.poisson_indices` (issue 43): Geometric(q) gaps between the
  included indices, O(B̄) uniforms per step whatever N is.
* ``mask``: the previous method, re-created here: one float64 uniform per record, compared with q,
  then ``nonzero`` — O(N) time and 8 bytes per record of transient memory. Timed only up to
  ``--mask-max`` (default 10^7) where it is still cheap.

Timings depend on the machine and its load: compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from dpopt.noise import NoiseSource
from dpopt.sampling import poisson_indices


def _mask(noise: NoiseSource, n: int, q: float) -> torch.Tensor:
    """The previous sampler: ``uniform(N) < q``, then the indices of the hits."""
    return (noise.uniform(n) < q).nonzero(as_tuple=True)[0]


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(sizes: list[int], bbar: float, repeats: int, mask_max: int, mode: str) -> dict:
    """ms per step of both samplers for every N in ``sizes`` (module docstring)."""
    noise = NoiseSource(mode) if mode != "reproducible" else NoiseSource("reproducible", seed=0)
    rows = []
    for n in sizes:
        q = min(1.0, bbar / n)
        row = {"N": n, "q": q, "geometric_ms": _median_ms(lambda n=n, q=q: poisson_indices(noise, n, q), repeats)}
        if n <= mask_max:
            row["mask_ms"] = _median_ms(lambda n=n, q=q: _mask(noise, n, q), max(3, repeats // 10))
        rows.append(row)
    return {
        "expected_batch_size": bbar,
        "mode": mode,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "load_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "rows": rows,
    }


def main(argv=None) -> int:
    """Run the measurement and print a table or (``--json``) one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1e4,1e5,1e6,1e7,1e8,1e9", help="comma-separated N (default 1e4..1e9)")
    parser.add_argument("--expected-batch-size", type=float, default=256.0, help="B̄ = q·N (default 256)")
    parser.add_argument("--repeats", type=int, default=200, help="steps timed per row (default 200)")
    parser.add_argument("--mask-max", type=float, default=1e7, help="largest N for the old mask sampler (1e7)")
    parser.add_argument("--mode", choices=["secret", "secure", "reproducible"], default="secret")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        sizes = [int(float(s)) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be comma-separated numbers, got {args.sizes!r}")
    if min(sizes) < 1 or args.repeats < 1 or args.expected_batch_size <= 0 or args.threads < 1:
        parser.error("--sizes must be >= 1, --repeats and --threads >= 1, --expected-batch-size > 0")
    torch.set_num_threads(args.threads)
    result = measure(sizes, args.expected_batch_size, args.repeats, int(args.mask_max), args.mode)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"Poisson sample cost per step, B̄ = {args.expected_batch_size:g}, {args.mode} noise, "
        f"{result['threads']} thread(s), median of {args.repeats}; 1-min load {result['load_1min']}"
    )
    print(f"{'N':>14s} {'geometric ms':>13s} {'mask ms':>10s}")
    for row in result["rows"]:
        mask = f"{row['mask_ms']:10.3f}" if "mask_ms" in row else f"{'-':>10s}"
        print(f"{row['N']:>14,d} {row['geometric_ms']:13.3f} {mask}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
