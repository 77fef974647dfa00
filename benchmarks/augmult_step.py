"""Step cost of augmentation multiplicity: a DP step over K·B views vs the non-private step over the same views.

For K ∈ {1, 2, 4, 8} (``--ks``) and B examples (``--batch``, default 32) on CIFAR-10-shaped inputs
(``--model``, default cnn5-ws), per configuration the median wall-clock time of

* **non-private** (``np``): forward + backward + ``torch.optim.SGD`` step over the K·B view rows in one
  pass, and (``np-ch``) over the same rows in the DP step's physical chunks (gradient accumulation:
  the same memory bound as the DP step);
* **dp (views)**: a DP-SGD step of dpopt over the same K·B rows grouped as B examples of K views
  (per-example gradient = mean over the views, clipped, summed, noised: one release), by
  :class:`dpopt.augment.ViewsOf` + the per-example (``torch.func``) engine, physical chunks of
  ``--physical`` examples;
* **dp (rows_per_example)**: the same step through the fast engine's ``rows_per_example=K``
  grouping, when ``dpopt.engine.iter_per_sample_sources`` has that argument (else skipped);

timed round-robin (so a slow period of a shared machine hits every configuration alike), and
the ratio DP / non-private printed side by side, of wall time and of this process's CPU time (less
disturbed by other processes). The issue's target is ≤ 1.15×.
``--tune-allocator`` applies :func:`dpopt.allocator.tune_cpu_allocator` (as ``dpopt train`` does) to
the whole process, so to every column.
Inputs are synthetic (the time does not depend on pixel values). Not a test: nothing asserts a time.

Usage::

    nice -n 19 python benchmarks/augmult_step.py [--ks 1,4] [--batch 32] [--rounds 5] [--json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared CPUs: sleeping waits (see step_time.py)

import argparse  # noqa: E402
import json  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402
from step_time import loss_fn, non_private_step, time_round_robin  # noqa: E402  (benchmarks/ is on sys.path when run)

from dpopt.augment import ViewsOf, crop_flip, repeat_views, views_loss  # noqa: E402
from dpopt.engine import iter_per_sample_sources  # noqa: E402
from dpopt.methods import make_optimizer  # noqa: E402
from dpopt.models import build_model  # noqa: E402

N_TRAIN = 50_000  # CIFAR-10: only the public sample rate q = B/N of the ledger uses it


ce = loss_fn  # the benchmarks' cross-entropy


def _data(b: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (b,), generator=g)
    return repeat_views(x, k, crop_flip, g), y  # [B·K, 3, 32, 32] example-major, labels per example


def _dp_opt(model, b: int):
    return make_optimizer(
        "dp-sgd",
        [p for p in model.parameters() if p.requires_grad],
        noise_multiplier=1.0,
        expected_batch_size=float(b),
        sample_rate=b / N_TRAIN,
        dataset="cifar10",
        generator=torch.Generator().manual_seed(0),
    )


def dp_views(model_name: str, rows, y, k: int, physical: int) -> Callable[[], None]:
    torch.manual_seed(0)
    model = build_model(model_name)
    wrapped, loss = ViewsOf(model, k), views_loss(ce)
    opt = _dp_opt(model, y.shape[0])
    xv = rows.reshape(y.shape[0], k, *rows.shape[1:])

    def step():
        opt.step(iter_per_sample_sources(wrapped, loss, xv, y, physical, opt.evaluation_points(), engine="reference"))

    return step


def dp_rows_per_example(model_name: str, rows, y, k: int, physical: int) -> Callable[[], None]:
    torch.manual_seed(0)
    model = build_model(model_name)
    opt = _dp_opt(model, y.shape[0])
    y_rows = y.repeat_interleave(k)

    def step():
        opt.step(
            iter_per_sample_sources(model, ce, rows, y_rows, physical * k, opt.evaluation_points(), rows_per_example=k)
        )

    return step


def non_private_chunked(model_name: str, rows, y_rows, chunk_rows: int) -> Callable[[], None]:
    """The non-private step over the same rows in the DP step's physical chunks (gradient accumulation)."""
    torch.manual_seed(0)
    model = build_model(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = rows.shape[0]

    def step():
        opt.zero_grad(set_to_none=True)
        for s in range(0, n, chunk_rows):
            xb, yb = rows[s : s + chunk_rows], y_rows[s : s + chunk_rows]
            (ce(model(xb), yb) * (xb.shape[0] / n)).backward()
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn5-ws")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--batch", type=int, default=32, help="B examples (the step has K·B view rows)")
    ap.add_argument("--physical", type=int, default=None, help="examples per chunk (default: B)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--tune-allocator",
        action="store_true",
        help="dpopt.allocator.tune_cpu_allocator() first (what dpopt train does; both sides get it)",
    )
    ap.add_argument(
        "--no-reference", action="store_true", help="skip the ViewsOf + torch.func column (the slow reference path)"
    )
    ap.add_argument("--json", action="store_true", help="also print one JSON line (last line)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.tune_allocator:
        from dpopt.allocator import tune_cpu_allocator

        print("allocator tuned:", tune_cpu_allocator())
    physical = args.physical or args.batch
    rows_out = []
    print(
        f"{args.model}, B = {args.batch} examples in chunks of {physical}, {args.threads} thread(s); seconds per "
        "step (median); ratios to the non-private step over the same K·B rows, in one pass (np) and in the "
        "DP step's chunks (np-ch)"
    )
    print(
        f"{'K':>3} {'rows':>6} {'np':>7} {'np-ch':>7} {'dp (views)':>11} {'/np':>5} "
        f"{'dp (rows/ex)':>13} {'/np':>5} {'/np-ch':>6}   CPU-time ratios {'/np':>5} {'/np-ch':>6}"
    )
    for k in [int(v) for v in args.ks.split(",")]:
        rows, y = _data(args.batch, k)
        y_rows = y.repeat_interleave(k)
        steps = {
            "non_private": non_private_step(args.model, rows, y_rows),
            "non_private_chunked": non_private_chunked(args.model, rows, y_rows, physical * k),
            "dp_rows_per_example": dp_rows_per_example(args.model, rows, y, k, physical),
        }
        if not args.no_reference:
            steps["dp_views"] = dp_views(args.model, rows, y, k, physical)
        res = time_round_robin(steps, args.rounds, args.per_round, warmup=1)
        base, base_ch = res["non_private"]["median"], res["non_private_chunked"]["median"]
        rec = {
            "k": k,
            "batch": args.batch,
            "physical": physical,
            "rows": k * args.batch,
            "model": args.model,
            "threads": args.threads,
            "allocator_tuned": bool(args.tune_allocator),
            **{f"{n}_s": r["median"] for n, r in res.items()},
            **{f"{n}_ratio": r["median"] / base for n, r in res.items() if n.startswith("dp")},
            "dp_rows_per_example_ratio_chunked": res["dp_rows_per_example"]["median"] / base_ch,
            **{f"{n}_cpu_s": r["cpu_median"] for n, r in res.items()},
            "dp_rows_per_example_cpu_ratio": res["dp_rows_per_example"]["cpu_median"]
            / res["non_private"]["cpu_median"],
            "dp_rows_per_example_cpu_ratio_chunked": (
                res["dp_rows_per_example"]["cpu_median"] / res["non_private_chunked"]["cpu_median"]
            ),
        }
        rows_out.append(rec)
        ref = f"{rec['dp_views_s']:11.3f} {rec['dp_views_ratio']:5.2f}" if "dp_views_s" in rec else f"{'–':>11} {'':>5}"
        print(
            f"{k:3d} {k * args.batch:6d} {base:7.3f} {base_ch:7.3f} {ref} {rec['dp_rows_per_example_s']:13.3f} "
            f"{rec['dp_rows_per_example_ratio']:5.2f} {rec['dp_rows_per_example_ratio_chunked']:6.2f}   "
            f"{'':>15} {rec['dp_rows_per_example_cpu_ratio']:5.2f} {rec['dp_rows_per_example_cpu_ratio_chunked']:6.2f}",
            flush=True,
        )
    if args.json:
        print(json.dumps(rows_out))


if __name__ == "__main__":
    main()
