"""CNN5's `dp-sgd` step against its floor, part by part (issue 34; docs/performance.md, "CNN5: profile and floor").

Times, round-robin in one process (process CPU time, all threads, and wall time, medians of ``--steps`` steps;
per part the totals per step, CPU and wall, and their ratio: the cores a part keeps busy):

* the non-private step and the non-private step plus one secret noise draw (``step_time.py``'s configurations),
* dpopt's ``dp-sgd`` step, with timers around its parts: the capture (``PerSampleEngine.compute``), GroupNorm's
  per-example affine gradients inside it (``rules.group_norm_grads``), each factored layer's ``sq_norms`` and
  ``grad_sums``, the per-example conv kernels (``ConvPart.per_sample``) and the float64 squared norms
  (``row_sq_norms64``),
* with ``--forms``: ``dp-sgd`` with the Gram form forced on every layer (``norm_form="gram"``) and with every
  layer's per-example gradients cached (``cache_bytes`` 1 GiB), to check that the cost model's form is the
  cheapest exact one here.

The floor is the non-private step + the noise + the exact norms (every ``sq_norms`` and GroupNorm's per-example
gradients): the clipped sums replace the weight gradients the non-private step computes.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/cnn5_floor.py --threads 1 --steps 5
    python benchmarks/cnn5_floor.py --threads 1 --steps 3 --forms
    python benchmarks/cnn5_floor.py --threads 2 --steps 5 --torch-norms   # the row-norm kernel against torch's path
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see step_time.py: shared CPUs

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import torch  # noqa: E402
from step_time import batch, dpopt_step, floor_step, loss_fn, non_private_step  # noqa: E402

from dpopt.engine import fast, iter_per_sample_sources, layers, row_norms, rules  # noqa: E402
from dpopt.methods import make_optimizer  # noqa: E402
from dpopt.models import build_model  # noqa: E402

ACC: dict[tuple[str, str], float] = defaultdict(float)
WALL: dict[tuple[str, str], float] = defaultdict(float)
MAIN: dict[tuple[str, str], float] = defaultdict(float)  # the calling thread's own CPU time
CUR = ["-"]


def _timed(inner: Callable, label: Callable[..., str]) -> Callable:
    def f(*a, **k):
        c, w, m = time.process_time(), time.perf_counter(), time.thread_time()
        try:
            return inner(*a, **k)
        finally:
            key = (CUR[0], label(*a))
            ACC[key] += time.process_time() - c
            WALL[key] += time.perf_counter() - w
            MAIN[key] += time.thread_time() - m

    return f


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each of this process's threads, by thread id (Linux ``/proc``; {} elsewhere).

    A step's busiest thread's CPU time is a lower bound of its wall time on idle cores, whatever the machine's
    load (a thread runs its own work serially): with the step's total CPU it gives the cores the step could keep
    busy (total / busiest).
    """
    out: dict[str, float] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[t] = (int(fields[11]) + int(fields[12])) / tick
    return out


def install_timers() -> None:
    """Wrap the engine's parts (in this process only) with process-CPU timers keyed by configuration."""
    for attr in ("sq_norms", "grad_sums"):
        inner = getattr(layers.FactoredBlock, attr)
        setattr(
            layers.FactoredBlock, attr, _timed(inner, lambda self, *a, _n=attr: f"{_n}[q{self.q},p{self.p},T{self.T}]")
        )
    layers.ConvPart.per_sample = _timed(layers.ConvPart.per_sample, lambda *a: "conv per_sample")
    layers.row_sq_norms64 = _timed(layers.row_sq_norms64, lambda *a: "row_sq_norms64")
    rules.group_norm_grads = _timed(rules.group_norm_grads, lambda *a: "group_norm_grads (in capture)")
    fast.PerSampleEngine.compute = _timed(fast.PerSampleEngine.compute, lambda *a: "capture")


def forced_step(x, y, norm_form: Optional[str] = None, cache_bytes: Optional[int] = None) -> Callable[[], None]:
    """``dp-sgd`` on cnn5 as ``step_time.dpopt_step``, with a forced norm form and/or cache budget."""
    torch.manual_seed(0)
    model = build_model("cnn5")
    opt = make_optimizer(
        "dp-sgd",
        list(model.parameters()),
        noise_multiplier=1.0,
        expected_batch_size=float(x.shape[0]),
        sample_rate=x.shape[0] / 50_000,
        dataset="cifar10",
        generator=torch.Generator().manual_seed(0),
    )
    return lambda: opt.step(
        iter_per_sample_sources(
            model, loss_fn, x, y, None, opt.evaluation_points(), norm_form=norm_form, cache_bytes=cache_bytes
        )
    )


def torch_row_norms(step: Callable[[], None]) -> Callable[[], None]:
    """``step`` with the float64 row norms on torch's path (float32 slices cast in cache-sized blocks of rows:
    the code before the compiled kernel), for a before/after pair in one process."""
    kernel = row_norms.row_sq_norms64_cpu

    def f() -> None:
        row_norms.row_sq_norms64_cpu = lambda flat: row_norms._torch_row_sq_norms64(flat, row_norms.ROW_NORM_COLUMNS)
        try:
            step()
        finally:
            row_norms.row_sq_norms64_cpu = kernel

    return f


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--forms", action="store_true", help="also dp-sgd with the Gram form forced and with the cache")
    ap.add_argument(
        "--torch-norms", action="store_true", help="also dp-sgd with the row norms on torch's path (before/after)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    install_timers()
    x, y = batch("cnn5", 512)
    steps = {
        "non-private": non_private_step("cnn5", x, y),
        "non-private + noise": floor_step("cnn5", x, y),
        "dp-sgd": dpopt_step("cnn5", "dp-sgd", x, y),
    }
    if args.torch_norms:
        steps["dp-sgd torch row norms"] = torch_row_norms(dpopt_step("cnn5", "dp-sgd", x, y))
    if args.forms:
        steps["dp-sgd gram forced"] = forced_step(x, y, norm_form="gram")
        steps["dp-sgd cached"] = forced_step(x, y, cache_bytes=1 << 30)
    for name, f in steps.items():
        CUR[0] = name
        for _ in range(args.warmup):
            f()
    ACC.clear()
    WALL.clear()
    MAIN.clear()
    cpu: dict[str, list[float]] = defaultdict(list)
    wall: dict[str, list[float]] = defaultdict(list)
    per_thread: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for _ in range(args.steps):
        for name, f in steps.items():
            CUR[0] = name
            before = thread_cpu()
            c, w = time.process_time(), time.perf_counter()
            f()
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
            for t, v in thread_cpu().items():
                per_thread[name][t] += v - before.get(t, 0.0)
    ms = {k: 1e3 * statistics.median(v) for k, v in cpu.items()}
    wall_ms = {k: 1e3 * statistics.median(v) for k, v in wall.items()}
    np_ms = ms["non-private"]
    busiest = {k: 1e3 * max(v.values(), default=0.0) / args.steps for k, v in per_thread.items()}
    total = {k: 1e3 * sum(v.values()) / args.steps for k, v in per_thread.items()}
    parts = {k: 1e3 * v / args.steps for k, v in ACC.items()}
    wall_parts = {k: 1e3 * v / args.steps for k, v in WALL.items()}
    main_parts = {k: 1e3 * v / args.steps for k, v in MAIN.items()}
    norms = sum(
        v for (cfg, lab), v in parts.items() if cfg == "dp-sgd" and (lab.startswith("sq_norms") or "group" in lab)
    )
    floor = ms["non-private + noise"] + norms
    print(
        f"cnn5, B = 512, {args.threads} thread(s), median CPU ms of {args.steps} steps; load {os.getloadavg()[0]:.1f}"
    )
    print(f"  {'':24s} {'CPU ms':>8s}  {'':16s} {'wall ms':>8s}  {'':16s} {'cores':>5s}")
    for k, v in ms.items():
        wv = wall_ms[k]
        print(
            f"  {k:24s} {v:8.1f}  {v / np_ms:5.3f}x non-private {wv:8.1f}  {wv / wall_ms['non-private']:5.3f}x non-private"
            f" {v / wv:5.2f}"
        )
    if busiest:
        print(
            "  busiest thread's CPU ms per step (mean; a lower bound of the wall time on idle cores), cores = total / it"
        )
        for k, v in busiest.items():
            print(
                f"  {k:24s} {v:8.1f}  {v / busiest['non-private']:5.3f}x non-private   cores {total[k] / max(v, 1e-9):4.2f}"
            )
    print(f"  exact norms (sq_norms + GroupNorm per-example grads) {norms:.1f}")
    print(
        f"  floor = non-private + noise + exact norms {floor:.1f}  {floor / np_ms:5.3f}x; dp-sgd / floor {ms['dp-sgd'] / floor:.3f}"
    )
    print(
        f"    {'configuration':20s} {'part':34s} {'CPU ms':>8s} {'wall ms':>8s} {'cores':>5s}"
        f" {'calling thread ms':>17s} {'CPU / it':>8s}"
    )
    for (cfg, lab), v in sorted(parts.items()):
        wv, mv = wall_parts[(cfg, lab)], main_parts[(cfg, lab)]
        print(
            f"    {cfg:20s} {lab:34s} {v:8.1f} {wv:8.1f} {v / max(wv, 1e-9):5.2f} {mv:17.1f} {v / max(mv, 1e-9):8.2f}"
        )
    return {
        "ms": ms,
        "wall_ms": wall_ms,
        "parts_cpu_ms": {f"{c}/{lab}": v for (c, lab), v in parts.items()},
        "parts_wall_ms": {f"{c}/{lab}": v for (c, lab), v in wall_parts.items()},
        "parts_calling_thread_ms": {f"{c}/{lab}": v for (c, lab), v in main_parts.items()},
        "norms_ms": norms,
        "floor/non-private": floor / np_ms,
        "dp-sgd/non-private": ms["dp-sgd"] / np_ms,
        "wall dp-sgd/non-private": wall_ms["dp-sgd"] / wall_ms["non-private"],
        "busiest_thread_ms": busiest,
        "busiest dp-sgd/non-private": busiest["dp-sgd"] / busiest["non-private"] if busiest else None,
    }


if __name__ == "__main__":
    main()
