"""How far the first-batch check's probe loss sees a forward that mixes examples, old loss against scalar ones.

The hook door's check (``dpopt.engine.capture.Recorder.check``) compares per-example gradients captured
from a batched pass with single-example autograd. Where no trainable layer follows a call that mixes
examples, the capture takes the vjp of that call on each example alone with the BATCHED pass's output
gradient e_r (``dpopt.engine.lift``), so the mixing shows only through e_r's dependence on the output's
value. Model here: ``out = fc(x) − a·mean_batch(fc(x))`` per token, float64, B = 9 rows; per row r the
relative discrepancy ‖Jᵀ(e_r(batched) − e_r(alone))‖ / ‖Jᵀ e_r(alone)‖ (J: the call's Jacobian in its
parameters on example r alone), and per probe seed its maximum over the rows (the check refuses a
parameter where one row disagrees). Losses, by their output gradient:

* ``old``: ⟨ρ, o⟩ + ⅛‖o‖²  → e = ρ + ¼·o (saves the output);
* ``k=K``: ⟨ρ, o⟩ + Σ_j ⟨s_j, o⟩² / (8√(mK)) → e = ρ + Σ_j ⟨s_j, o⟩·s_j / (4√(mK)), K random directions,
  scaled so E‖e − ρ‖² matches the old loss's (K = 1: the scalar loss of issue 34's branch ``probe``, one
  number per row saved, docs/performance.md);
* ``k=1 ×4`` and ``unscaled`` (K = 1 without 1/√m): larger quadratic terms, which also see 4× / √m×
  more of the rounding differences between the batched pass and the example alone.

Prints, per shape and output scale, each loss's margin ÷ the old loss's over ``--seeds`` probe seeds
(minimum, 5th percentile, median), then the false-alarm side: the same discrepancy in float32 without
mixing (rounding only), against the check's float32 tolerance 1e-3. Deterministic. Usage::

    python benchmarks/probe_loss_margin.py --seeds 150
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.func import functional_call, vjp


def margins(
    t: int, h: int, scale: float, seeds: int, mix: float = 1e-3, rows: int = 9, dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor]:
    """``{loss: [seeds] worst row's relative discrepancy}`` (``old``'s included) for ``[rows, t, h]`` inputs.

    ``fc``'s weights × ``scale``; ``dtype`` the model's (float32 with ``mix = 0``: the discrepancy is the
    rounding difference between the batched pass and the example alone, the check's false-alarm side).
    """
    torch.manual_seed(0)
    fc = torch.nn.Linear(h, h).double()
    with torch.no_grad():
        fc.weight.mul_(scale)
        fc.bias.mul_(scale)
    fc = fc.to(dtype)
    x = torch.randn(rows, t, h, dtype=torch.float64).to(dtype)
    params = {k: v.detach() for k, v in fc.named_parameters()}

    def call(p, xb):
        y = functional_call(fc, p, (xb,))
        return y - mix * y.mean(0, keepdim=True)

    m = t * h
    batched = call(params, x)
    pulls, alone = [], []
    for r in range(rows):
        out, pull = vjp(lambda p, r=r: call(p, x[r : r + 1]), params)
        pulls.append(pull)
        alone.append(out)

    def quad(k: int, weight: float):
        def e(o, rho, s):
            c = s[:k] @ o.flatten()
            return rho.view_as(o) + weight * (c[:, None] * s[:k]).sum(0).view_as(o) / (4 * (m * k) ** 0.5)

        return e

    losses = {"old": lambda o, rho, s: rho.view_as(o) + 0.25 * o}
    losses.update({f"k={k}": quad(k, 1.0) for k in (1, 2, 8)})
    losses["k=1 ×4"] = quad(1, 4.0)
    losses["unscaled"] = quad(1, m**0.5)
    got: dict[str, list] = {k: [] for k in losses}
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        rho = torch.randn(rows, m, generator=gen, dtype=torch.float64).to(dtype)
        s = torch.randn(rows, 8, m, generator=gen, dtype=torch.float64).to(dtype)
        for name, e in losses.items():
            worst = 0.0
            for r in range(rows):
                (gb,) = pulls[r](e(batched[r : r + 1], rho[r], s[r]))
                (ga,) = pulls[r](e(alone[r], rho[r], s[r]))
                num = math.sqrt(sum(float((gb[k] - ga[k]).square().sum()) for k in gb))
                den = math.sqrt(sum(float(ga[k].square().sum()) for k in ga))
                worst = max(worst, num / den)
            got[name].append(worst)
    return {k: torch.tensor(v) for k, v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=150)
    args = ap.parse_args()
    print("mixing a = 1e-3, float64: each loss's margin ÷ the old loss's (min / p5 / median over seeds)")
    for t, h in [(16, 32), (4, 8)]:
        for scale in (0.1, 1.0, 10.0):
            res = margins(t, h, scale, args.seeds)
            old = res.pop("old")
            cells = [f"{k} {q(v / old)}" for k, v in res.items()]
            print(f"T={t:2d} H={h:2d} weights ×{scale:<4} " + "; ".join(cells), flush=True)
    print("no mixing, float32: the worst row's rounding discrepancy (median / p95 / max over seeds; tolerance 1e-3)")
    for t, h in [(16, 32), (4, 8)]:
        for scale in (1.0, 10.0):
            res = margins(t, h, scale, args.seeds, mix=0.0, dtype=torch.float32)
            cells = [
                f"{k} {float(v.median()):.1e} / {float(v.quantile(0.95)):.1e} / {float(v.max()):.1e}"
                for k, v in res.items()
            ]
            print(f"T={t:2d} H={h:2d} weights ×{scale:<4} " + "; ".join(cells), flush=True)


def q(v: torch.Tensor) -> str:
    """``min / p5 / median`` of ``v``."""
    return f"{float(v.min()):.2f} / {float(v.quantile(0.05)):.2f} / {float(v.median()):.2f}"


if __name__ == "__main__":
    main()
