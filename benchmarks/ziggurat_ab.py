"""Before/after CPU time of the compiled ziggurat: this checkout's ``dpopt._native`` against another build of it.

    cp src/dpopt/_native*.so /tmp/before.so        # on the commit before the change (built there)
    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/ziggurat_ab.py /tmp/before.so [--size 795010] [--rounds 80]

Both extension modules are loaded in ONE process and timed alternately (before, after, before, ...), so that
load changes on a shared machine reach both alike; CPU time (``time.process_time``), one thread. Two rows, ns of
CPU per normal (median over the rounds, the first 3 dropped) and the after/before ratio:

* ``kernel``: ``ziggurat_fill_chunks`` on the chunks of a ``--size`` draw (``NORMAL_CHUNK`` each, the last one
  short), states fixed, the result buffer reused: the compiled loop alone.
* ``draw``: ``NoiseSource("secret").start_normal(size, defer=False).values()`` with ``dpopt.noise``'s kernel
  module swapped: the bodies, the tail fill and the result's allocation.

The two builds must give the same values (``tests/core/test_ziggurat_fast_path.py`` checks this build against
digests of the previous one); this script checks the kernel rows' values and states agree before timing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from types import ModuleType

import numpy as np
import torch

import dpopt.noise as noise
import dpopt.ziggurat as zig
from dpopt import kernels
from dpopt.noise import NORMAL_CHUNK, NoiseSource
from dpopt.ziggurat import SFC_DISCARD, ziggurat_tables


def _load(path: str) -> ModuleType:
    """The extension module at ``path`` (a built ``_native*.so``), loaded under the name ``_native``."""
    spec = importlib.util.spec_from_file_location("_native", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    """Time both builds alternately and print one line per row; returns 0 (1 if the kernels' values differ)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="the other build's extension module (.so)")
    parser.add_argument("--size", type=int, default=795_010, help="normals per draw (default 795,010: the MNIST MLP)")
    parser.add_argument("--rounds", type=int, default=80, help="alternated timings of each build (default 80)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    before, after = _load(args.before), kernels.native
    k, w, f, _ = ziggurat_tables()
    n, m = args.size, -(-args.size // NORMAL_CHUNK)
    states = np.random.default_rng(1).integers(0, 2**63, size=(m, 4), dtype=np.uint64)
    states[:, 3] = 1
    out = np.empty(n)
    tail_idx = np.empty((m, 64), np.int64)
    tail_count = np.zeros(m, np.int64)

    def kernel(mod: ModuleType) -> tuple[float, bytes]:
        s = states.copy()
        t = time.process_time()
        mod.ziggurat_fill_chunks(
            out, s, np.zeros(2, np.int64), NORMAL_CHUNK, SFC_DISCARD, k, w, f, tail_idx, 64, tail_count
        )
        return time.process_time() - t, out.tobytes() + s.tobytes()

    if kernel(before)[1] != kernel(after)[1]:
        print("the two builds' values or states differ")
        return 1
    source = NoiseSource("secret")

    def draw(mod: ModuleType) -> tuple[float, bytes]:
        noise.native = zig.native = mod  # type: ignore[attr-defined]
        try:
            t = time.process_time()
            source.start_normal(n, defer=False).values()
            return time.process_time() - t, b""
        finally:
            noise.native = zig.native = after  # type: ignore[attr-defined]

    print(f"{n:,} normals, 1 thread, {args.rounds} alternated rounds, load {os.getloadavg()[0]:.2f}")
    for name, fn in (("kernel", kernel), ("draw", draw)):
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.rounds):
            times["before"].append(fn(before)[0])
            times["after"].append(fn(after)[0])
        b, a = (float(np.median(times[key][3:])) for key in ("before", "after"))
        print(f"{name:7s} before {b / n * 1e9:.3f}  after {a / n * 1e9:.3f} ns of CPU per normal  ratio {a / b:.3f}")
    print(f"load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
