"""What the Gaussian noise costs per 10^6 normals, old and new samplers measured in ONE run.

    python benchmarks/noise_cost.py            # a table
    python benchmarks/noise_cost.py --json     # one JSON object

Rows (float32 output unless the name says float64; ms per 10^6 normals, the best of ``--repeats``
timings of a ``--size`` draw, all rows timed round-robin so that load changes reach them alike):

* ``torch.randn``: torch's CPU ``normal_`` (Box–Muller on 24-bit uniforms, |z| ≤ 5.77), one thread.
* ``old secret (T threads)``: dpopt's previous secret path, re-created here: the same kernel,
  chunk by chunk from derived MT19937 generators on T threads (|z| ≤ 5.77).
* ``old secure``: the previous ``secure_mode``: float64 Box–Muller on 53-bit OS-CSPRNG uniforms
  (|z| ≤ 8.57), rounded to float32.
* ``floor: MT words only``: the 64 random bits per normal the new sampler reads, nothing else.
* ``new secret/secure/reproducible``: :meth:`dpopt.noise.NoiseSource.normal` today
  (|z| ≤ :data:`dpopt.noise.CUT_RADIUS` = 37.64 in every mode).
* ``new secret streamed``: ``start_normal(n, stream=True)`` consumed chunk by chunk (the release of a
  model above the Privatizer's early-draw limit: no buffer of n values; issue 43).

ms per 10^6 normals is ns per normal.

Ratios are to ``torch.randn`` and to the old path of the same mode and thread count; CPU ms is the
process CPU time (all threads), which preemption on a loaded machine does not inflate. Timings
depend on the machine and its load: compare ratios from one run, never figures across runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from dpopt.noise import _MT_WORDS, CUT_RADIUS, NORMAL_CHUNK, NoiseSource, _cpu_generator_from_words


def _old_secret(n: int, pool, gen: torch.Generator) -> torch.Tensor:
    """The pre-issue-19 secret path: torch's float32 normal_ per chunk of NORMAL_CHUNK, derived MT states."""
    k = -(-n // NORMAL_CHUNK)
    words = torch.randint(0, 2**32, (k, _MT_WORDS), generator=gen, dtype=torch.int64)
    raw = words.to(torch.int32).numpy().tobytes()
    out = torch.empty(n)

    def fill(i: int) -> None:
        sub = _cpu_generator_from_words(raw[4 * _MT_WORDS * i : 4 * _MT_WORDS * (i + 1)])
        out[i * NORMAL_CHUNK : min(n, (i + 1) * NORMAL_CHUNK)].normal_(generator=sub)

    if pool is None:
        for i in range(k):
            fill(i)
    else:
        list(pool.map(fill, range(k)))
    return out


def _old_secure(n: int) -> torch.Tensor:
    """The pre-issue-19 secure path: float64 Box–Muller on 53-bit uniforms from os.urandom."""
    pairs = (n + 1) // 2
    words = torch.frombuffer(bytearray(os.urandom(16 * pairs)), dtype=torch.int64)
    u = ((words & ((1 << 53) - 1)).to(torch.float64) + 1.0) * 2.0**-53
    r = torch.sqrt(-2.0 * torch.log(u[:pairs]))
    theta = (2.0 * math.pi) * u[pairs:]
    return torch.cat([r * torch.cos(theta), r * torch.sin(theta)])[:n].to(torch.float32)


def _streamed(source: NoiseSource, n: int) -> None:
    """A streamed draw of ``n`` normals, each chunk handed to a consumer that does nothing with it."""
    source.start_normal(n, stream=True).consume(lambda lo, hi, z: None)


def _interleaved(cases: dict, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """(best wall ms, best process-CPU ms) of each case, timed round-robin (one timing of every case
    per round), so that a change of machine load during the run reaches every case alike. CPU time
    (all threads of this process) is what a loaded machine distorts least: preemption does not
    count. Each case is ``(threads, fn)``; its first call is a warm-up."""
    wall = {name: math.inf for name in cases}
    cpu = dict(wall)
    for _name, (threads, fn) in cases.items():
        torch.set_num_threads(threads)
        fn()
    for _ in range(repeats):
        for name, (threads, fn) in cases.items():
            torch.set_num_threads(threads)
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name] = min(wall[name], time.perf_counter() - start)
            cpu[name] = min(cpu[name], time.process_time() - start_cpu)
    return {k: v * 1e3 for k, v in wall.items()}, {k: v * 1e3 for k, v in cpu.items()}


def measure(size: int, repeats: int) -> dict:
    """ms per 10^6 normals for every row (module docstring), in one process, timed round-robin."""
    scale = 1e6 / size
    old_threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    pool = ThreadPoolExecutor(max_workers=2)
    secret, secure, repro = NoiseSource("secret"), NoiseSource("secure"), NoiseSource("reproducible", seed=0)
    cases = {
        "torch.randn": (1, lambda: torch.randn(size, generator=gen)),
        "old secret (1 thread)": (1, lambda: _old_secret(size, None, gen)),
        "new secret (1 thread)": (1, lambda: secret.normal((size,))),
        "new secret float64 (1 thread)": (1, lambda: secret.normal((size,), dtype=torch.float64)),
        "old secret (2 threads)": (2, lambda: _old_secret(size, pool, gen)),
        "new secret (2 threads)": (2, lambda: secret.normal((size,))),
        "new secret float64 (2 threads)": (2, lambda: secret.normal((size,), dtype=torch.float64)),
        "new secret streamed (1 thread)": (1, lambda: _streamed(secret, size)),
        "new secret streamed (2 threads)": (2, lambda: _streamed(secret, size)),
        "floor: MT words only (1 thread)": (
            1,
            lambda: torch.empty(size, dtype=torch.int64).random_(-(2**63), None, generator=gen),
        ),  # the new sampler's random bits alone: 64 per normal
        "old secure": (1, lambda: _old_secure(size)),
        "new secure": (1, lambda: secure.normal((size,))),
        "new reproducible (1 thread)": (1, lambda: repro.normal((size,))),
    }
    small_src = NoiseSource("secret")
    small_cases = {
        "old secret (torch.randn)": (1, lambda: torch.randn(10, generator=gen)),
        "new secret": (1, lambda: small_src.normal((10,))),
    }
    try:
        wall, cpu = _interleaved(cases, repeats)
        rows = {name: ms * scale for name, ms in wall.items()}
        cpu_rows = {name: ms * scale for name, ms in cpu.items()}
        # fixed cost of one small draw (a bias vector): µs per call of 10 normals, one thread
        small = {name: ms * 1e3 for name, ms in _interleaved(small_cases, 50 * repeats)[0].items()}
    finally:
        torch.set_num_threads(old_threads)
        pool.shutdown()
    base = rows["torch.randn"]
    old_of = {
        "new secret (1 thread)": "old secret (1 thread)",
        "new secret (2 threads)": "old secret (2 threads)",
        "new secret float64 (1 thread)": "old secret (1 thread)",
        "new secret float64 (2 threads)": "old secret (2 threads)",
        "new secret streamed (1 thread)": "old secret (1 thread)",
        "new secret streamed (2 threads)": "old secret (2 threads)",
        "new secure": "old secure",
        "new reproducible (1 thread)": "old secret (1 thread)",
    }
    return {
        "size": size,
        "repeats": repeats,
        "load_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cut_radius_new": CUT_RADIUS,
        "cut_radius_old_secret": math.sqrt(-2 * math.log(2.0**-24)),
        "cut_radius_old_secure": math.sqrt(-2 * math.log(2.0**-53)),
        "ms_per_1e6": rows,
        "ratio_to_torch_randn": {k: v / base for k, v in rows.items()},
        "ratio_to_old": {k: rows[k] / rows[v] for k, v in old_of.items()},
        "cpu_ms_per_1e6": cpu_rows,
        "cpu_ratio_to_old": {k: cpu_rows[k] / cpu_rows[v] for k, v in old_of.items()},
        "us_per_call_of_10": small,
    }


def main(argv=None) -> int:
    """Run the measurement and print a table or (``--json``) one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2_000_000, help="normals per timed draw (default 2e6)")
    parser.add_argument("--repeats", type=int, default=7, help="timings per row; the best is kept (default 7)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.size <= NORMAL_CHUNK or args.repeats < 1:
        parser.error(f"--size must exceed {NORMAL_CHUNK} (the chunked path) and --repeats be >= 1")
    result = measure(args.size, args.repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"noise cost per 10^6 normals (draws of {args.size:,}, best of {args.repeats}; "
        f"1-min load {result['load_1min']})"
    )
    print(
        f"{'sampler (ms per 1e6 = ns/normal)':34s} {'wall ms':>8s} {'x randn':>8s} {'x old':>7s} {'CPU ms':>8s} {'x old':>7s}"
    )
    for name, ms in result["ms_per_1e6"].items():
        old, cpu_old = result["ratio_to_old"].get(name), result["cpu_ratio_to_old"].get(name)
        print(
            f"{name:34s} {ms:8.2f} {result['ratio_to_torch_randn'][name]:8.2f} "
            f"{'' if old is None else f'{old:7.2f}':>7s} {result['cpu_ms_per_1e6'][name]:8.2f} "
            f"{'' if cpu_old is None else f'{cpu_old:7.2f}':>7s}"
        )
    print("µs per call of 10 normals: " + ", ".join(f"{k} {v:.1f}" for k, v in result["us_per_call_of_10"].items()))
    print(
        f"largest |z|: new {result['cut_radius_new']:.2f}, old secret {result['cut_radius_old_secret']:.2f}, "
        f"old secure {result['cut_radius_old_secure']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
