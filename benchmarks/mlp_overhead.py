"""The MNIST MLP's `dp-sgd` step before and after a cut of 2026-12-07, in one process (issue 34;
docs/performance.md, "MLP: dp-sgd's cost above its floor").

Times, round-robin in one process (``step_time.time_round_robin``: median wall and process CPU time, all
threads, per step): the non-private step, the floor (non-private + one secret noise draw), ``dp-sgd`` as
it is, ``dp-sgd`` with the code a cut replaced restored for its step (patched in and out around each of
its steps, so that both run on the same machine state) and, with ``--ghost``, Opacus's ghost clipping.
``--before`` picks the cut:

* ``norms`` (default; the latest cut, 2026-12-07 06:00 UTC): the per-example norms as they were before a
  T = 1 linear layer's weight and bias shared one float64 ‖e_i‖² (the weight's float32 closed form
  ``e.square().sum(1) * a.square().sum(1)``, the bias's own float64 row norms of its summed rows, the
  non-finite check per parameter);
* ``release-pass``: that, with the release as it was before its one compiled pass, i.e.
  σS·z as its own float64 ``mul_`` in ``Privatizer._draw``, numpy's ``add`` and ``copyto`` rounding
  (the then ``add_and_round``), and ÷ B̄ as torch's ``div_`` in ``release``;
* ``bias-sums`` (the earlier cuts): that, with the release's ``z.add_(s).to(dtype)`` and the per-example
  bias sums as a reduction over positions.

Every ``dp-sgd`` variant releases the same values (``tests/core/test_add_and_round.py``,
``tests/core/test_release_kernel.py``), except that the norms before the ``norms`` cut differ from today's in
their last bits (rounded up now; ``tests/engine/test_shared_t1_norms.py``).

Usage::

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/mlp_overhead.py --ghost --rounds 30 --threads 2
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see step_time.py: shared CPUs

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from step_time import batch, dpopt_step, floor_step, non_private_step, opacus_step, time_round_robin  # noqa: E402

import dpopt.engine.rules as rules  # noqa: E402
from dpopt.engine.fast import FastPerSampleGrads  # noqa: E402
from dpopt.engine.layers import DirectBlock, FactoredBlock, LinearPart, shifted_sq_norms  # noqa: E402
from dpopt.privatizer import Privatizer  # noqa: E402


def old_add_noise(self, std, dtypes):
    """The release's add before 2026-12-07: torch's mixed-dtype ``add_`` over each parameter, then a cast into a new tensor."""
    noise, count_noise = self._draw(std)
    return [z.add_(s).to(dt) for z, s, dt in zip(noise, self._sum, dtypes)], count_noise


def numpy_add_and_round(z, s, dtype, into_sum=True):
    """``add_and_round`` before its compiled pass (2026-12-07, morning): numpy's ``add`` into ``z``, ``copyto`` rounding."""
    if z.dtype != torch.float64 or s.dtype not in (torch.float32, torch.float64) or not s.is_contiguous():
        return z.add_(s).to(dtype)
    out = s if s.dtype == dtype and into_sum else torch.empty(s.shape, dtype=dtype)
    zn = z.numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        np.add(zn, s.numpy(), out=zn)
        np.copyto(out.numpy(), zn, casting="same_kind")
    return out


def numpy_add_noise(self, std, dtypes):
    """The release before its compiled pass: ``_draw``'s σS·z (its own ``mul_``), numpy's add and rounding;
    ÷ B̄ is left to ``release`` (``_divided`` stays False)."""
    noise, count_noise = self._draw(std)
    into_sum = self.quantile is None
    return [numpy_add_and_round(z, s, dt, into_sum) for z, s, dt in zip(noise, self._sum, dtypes)], count_noise


def old_bias_sums(layer):
    """``rules.linear_bias_sums`` before 2026-12-07: a reduction over the positions even when there is one, then ``sum()``."""
    b = layer.batch_size
    return sum(e.reshape(b, -1, e.shape[-1]).sum(1, dtype=layer.dtype) for _, e in layer.calls)


def old_linear(layer):
    """``rules._linear`` before the shared norms: the bias's DirectBlock computes its own row norms."""
    b, calls, dt = layer.batch_size, layer.calls, layer.dtype
    blocks: list = []
    if "weight" in layer.index:
        parts = [LinearPart(a, e, dt) for a, e in calls]
        blocks.append(FactoredBlock(layer.index["weight"], layer.shapes["weight"], parts, layer.budget, b))
    if "bias" in layer.index:
        blocks.append(DirectBlock([layer.index["bias"]], [rules.linear_bias_sums(layer)]))
    return blocks


def old_closed(self, m, b):
    """``FactoredBlock._closed`` before the shared norms: the flat weight norm in float32."""
    pt = self.parts[0]
    a, e = pt.a[:, 0].to(pt.dtype), pt.e[:, 0].to(pt.dtype)
    if m is None and b is None:
        return e.square().sum(1) * a.square().sum(1)
    if m is None:
        return ((e.square() @ b.pow(-2)) * a.square()).sum(1)
    return shifted_sq_norms(e, a, m, b)[0]


def old_sq_norms(self, geometry, groups, num_groups):
    """``FastPerSampleGrads._sq_norms`` before the check on the totals: ``isfinite`` per parameter."""
    per_param = self._param_sq_norms(geometry)  # the collection step, unchanged since
    bad = torch.zeros(self.batch_size, dtype=torch.bool, device=self.device)
    for v in per_param:
        bad |= ~torch.isfinite(v)
    self._bad = bad
    out = torch.zeros(self.batch_size, num_groups, dtype=self.dtype, device=self.device)
    any_bad = bool(bad.any())
    for i, (v, k) in enumerate(zip(per_param, groups)):
        if any_bad:
            m, b = self._geo(geometry, i)
            zero = (m / b) if (m is not None and b is not None) else m
            zero_sq = zero.square().sum() if zero is not None else torch.zeros((), dtype=self.dtype)
            v = torch.where(bad, zero_sq.to(self.dtype), v)
        out[:, k] += v
    return out


def main(argv=None) -> dict:
    """Run the comparison; print and return ``{configuration: (cpu ms, wall ms)}``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ghost", action="store_true", help="also time Opacus ghost clipping (needs opacus)")
    ap.add_argument(
        "--before", choices=("norms", "release-pass", "bias-sums"), default="norms", help="the cut's old code"
    )
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    x, y = batch("mlp", 256)
    new_add, new_bias = Privatizer._add_noise, rules.linear_bias_sums
    dp_new, dp_old = dpopt_step("mlp", "dp-sgd", x, y), dpopt_step("mlp", "dp-sgd", x, y)

    new_rule, new_closed, new_sq = rules.RULES[torch.nn.Linear], FactoredBlock._closed, FastPerSampleGrads._sq_norms
    old_norms = (dataclasses.replace(new_rule, blocks=old_linear), old_closed, old_sq_norms)
    old = (numpy_add_noise, new_bias) if args.before == "release-pass" else (old_add_noise, old_bias_sums)
    if args.before == "norms":
        old = (new_add, new_bias)
    norms = old_norms  # every mode restores its cut and the later ones

    def before():
        Privatizer._add_noise, rules.linear_bias_sums = old  # type: ignore[method-assign]
        rules.RULES[torch.nn.Linear], FactoredBlock._closed, FastPerSampleGrads._sq_norms = norms  # type: ignore[method-assign]
        try:
            dp_old()
        finally:
            Privatizer._add_noise, rules.linear_bias_sums = new_add, new_bias  # type: ignore[method-assign]
            rules.RULES[torch.nn.Linear], FactoredBlock._closed, FastPerSampleGrads._sq_norms = (  # type: ignore[method-assign]
                new_rule,
                new_closed,
                new_sq,
            )

    steps = {
        "non-private": non_private_step("mlp", x, y),
        "floor": floor_step("mlp", x, y),
        "dp-sgd before": before,
        "dp-sgd after": dp_new,
    }
    ghost = opacus_step("mlp", x, y, "ghost") if args.ghost else None
    if ghost is not None:
        steps["opacus ghost"] = ghost
    r = time_round_robin(steps, rounds=args.rounds, per_round=3, warmup=3)
    c = {k: v["cpu_median"] * 1e3 for k, v in r.items()}
    w = {k: v["median"] * 1e3 for k, v in r.items()}
    print(f"threads {args.threads}, {args.rounds} rounds of 3 steps, round-robin; before = {args.before}")
    for k in r:
        print(f"{k:16s} cpu {c[k]:6.1f} ms  wall {w[k]:6.1f} ms")
    for tag in ("before", "after"):
        k = f"dp-sgd {tag}"
        line = f"{tag}: /non-private cpu {c[k] / c['non-private']:.2f} wall {w[k] / w['non-private']:.2f}"
        line += f"; /floor cpu {c[k] / c['floor']:.2f} wall {w[k] / w['floor']:.2f}"
        if "opacus ghost" in c:
            line += f"; /ghost cpu {c[k] / c['opacus ghost']:.2f} wall {w[k] / w['opacus ghost']:.2f}"
        print(line)
    if "opacus ghost" in c:
        print(f"floor / ghost: cpu {c['floor'] / c['opacus ghost']:.2f} wall {w['floor'] / w['opacus ghost']:.2f}")
    print(
        f"after / before: cpu {c['dp-sgd after'] / c['dp-sgd before']:.3f} wall {w['dp-sgd after'] / w['dp-sgd before']:.3f}"
    )
    return {k: (c[k], w[k]) for k in r}


if __name__ == "__main__":
    main()
