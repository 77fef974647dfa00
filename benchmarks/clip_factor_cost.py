"""CPU cost of the clip factors that respect C under rounding (2026-12-07), before/after in one process.

``Privatizer.accumulate`` on the MNIST MLP's fast per-sample source (batch 256, 6 parameters, flat or
per-layer groups), alternated round by round with the code of before the change patched in:

* before: ``FastPerSampleGrads._sq_norms`` summing the group totals in float32 (rounded to nearest)
  and ``Privatizer._clip_weights`` = min(1, C/√sq) in float32;
* after: the totals summed in float64 and rounded up, the factor from float64 rounded down
  (:func:`dpopt.privatizer.clip_factors`).

Also timed: the norms-and-factor part alone (``sq_norms`` + ``_clip_weights``), where the change lives.
The source is built once; its per-parameter float64 row norms are cached after the first call, so the
totals and factor weigh MORE here than in a step (an upper bound of the relative cost). Reported: median
process CPU time per call and the after/before ratios.

Usage::

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/clip_factor_cost.py --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from step_time import batch, loss_fn

from dpopt.engine import iter_per_sample_sources
from dpopt.engine.fast import FastPerSampleGrads
from dpopt.models import build_model
from dpopt.privatizer import Privatizer
from dpopt.types import ClipGeometry


def old_sq_norms(self, geometry, groups, num_groups):
    """``FastPerSampleGrads._sq_norms`` before 2026-12-07 (all-finite path): float32 group totals."""
    per_param = self._param_sq_norms(geometry)  # the collection step, unchanged since
    out = torch.zeros(self.batch_size, num_groups, dtype=self.dtype, device=self.device)
    for v, k in zip(per_param, groups):
        out[:, k] += v
    assert bool(torch.isfinite(out).all())
    self._bad = torch.zeros(self.batch_size, dtype=torch.bool, device=self.device)
    return out


def old_clip_weights(self, sq, bounds):
    """``Privatizer._clip_weights`` before 2026-12-07: min(1, C/‖w‖) in the norms' dtype."""
    norms = sq.clamp_min(0).sqrt()
    return torch.clamp(torch.as_tensor(bounds, dtype=norms.dtype) / norms.clamp_min(1e-30), max=1.0)


def main(argv=None) -> dict:
    """Run the comparison; print and return ``{name: after/before CPU ratio}``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--reps", type=int, default=20, help="calls per timed block")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("mlp")
    x, y = batch("mlp", 256)
    src = next(iter(iter_per_sample_sources(model, loss_fn, x, y, engine="fast")))
    n = src.num_params
    new = (FastPerSampleGrads._sq_norms, Privatizer._clip_weights)
    old = (old_sq_norms, old_clip_weights)
    ratios = {}
    for label, groups, bounds in (("flat", None, 1.0), ("per-layer", [i // 2 for i in range(n)], [1.0] * (n // 2))):
        priv = Privatizer(1.0, bounds, expected_batch_size=256.0, sample_rate=256 / 60000, groups=groups)
        g = groups if groups is not None else [0] * n
        g_count = len(priv.bounds)
        b64 = torch.tensor(priv.bounds, dtype=torch.float64)

        def accumulate(priv=priv):
            priv.begin()
            priv.accumulate(src)
            priv._reset()

        def norms_factor(priv=priv, g=g, g_count=g_count, b64=b64):
            priv._clip_weights(src.sq_norms(ClipGeometry(), g, g_count), b64)

        for name, fn in (("accumulate", accumulate), ("norms+factor", norms_factor)):
            times: dict[str, list[float]] = {"before": [], "after": []}
            for r in range(args.rounds + 2):
                for tag, (sqn, cw) in (("before", old), ("after", new)) if r % 2 else (("after", new), ("before", old)):
                    FastPerSampleGrads._sq_norms, Privatizer._clip_weights = sqn, cw  # type: ignore[method-assign]
                    try:
                        t0 = time.process_time()
                        for _ in range(args.reps):
                            fn()
                        dt = (time.process_time() - t0) / args.reps
                    finally:
                        FastPerSampleGrads._sq_norms, Privatizer._clip_weights = new  # type: ignore[method-assign]
                    if r >= 2:  # two warm-up rounds
                        times[tag].append(dt)
            med = {k: statistics.median(v) for k, v in times.items()}
            ratios[f"{label} {name}"] = med["after"] / med["before"]
            print(
                f"{label:9s} {name:13s} before {med['before'] * 1e3:7.3f} ms  after {med['after'] * 1e3:7.3f} ms  "
                f"after/before {med['after'] / med['before']:.3f}"
            )
    return ratios


if __name__ == "__main__":
    main()
