"""What the Gaussian noise costs per normal: dpopt's samplers, their parts and the candidates, in ONE run.

    python benchmarks/noise_cost.py            # a table
    python benchmarks/noise_cost.py --json     # one JSON object

ms per 10^6 normals = ns per normal: the best of ``--repeats`` timings of a ``--size`` draw, every
row timed round-robin (one timing of each row per round) so that load changes reach them alike.
Wall time is what a step waits; CPU time (process, all threads) is the work, which preemption on a
loaded machine does not inflate. Compare ratios from one run, never figures across runs. ``faults``
(``minor_page_faults_min`` in the JSON): the fewest minor page faults of a timing of the row — first
touches of memory fresh from the OS, which depend on what the rows before it freed: two rows whose
CPU times differ together with their faults differ by the allocator, not by the sampler.

Rows (float64 unless the name says float32; "T t" = T torch threads, the noise source's workers):

* ``torch float32 normal_`` / ``torch float64 normal_``: torch's CPU sampler (MT19937; float32:
  vectorised Box–Muller on 24-bit uniforms, |z| ≤ 5.77) — the yardstick of issue 34.
* ``words: …``: the random bits alone, 64 per normal: torch's MT19937 (``random_``), numpy's SFC64
  (``random_raw``), AES-256-CTR (only with the ``cryptography`` package, the ``secure`` extra; secure
  mode falls back to :func:`os.urandom` words without it), :func:`os.urandom`.
* ``numpy ziggurat (BITGEN)``: numpy's float64 ``standard_normal`` per chunk of ``NORMAL_CHUNK``,
  without dpopt's tail redraw (its tail stops at |z| ≈ 13.7).
* ``compiled ziggurat body (SFC64)``: :func:`dpopt.ziggurat.ziggurat_body` per chunk (the tail
  positions left unfilled): the kernel alone.
* ``previous secret``: issue 19's sampler, re-created (float64 Box–Muller on MT19937 words with a
  full-exponent radius, chunk by chunk; |z| ≤ 37.64).
* ``numpy-ziggurat secret``: the sampler before the compiled kernel, re-created (numpy's ziggurat
  on per-chunk SFC64 streams, the values with |z| ≥ 3.654 found by a scan and redrawn from the tail law).
* ``secret``: :meth:`dpopt.noise.NoiseSource.normal` today (the compiled ziggurat on per-chunk SFC64
  streams, the tail drawn exactly; |z| ≤ 37.63), also streamed (``start_normal(stream=True)``,
  the release of a model above the Privatizer's early-draw limit) and ``reproducible``.
* ``secure`` / ``previous secure``: Box–Muller on AES-256-CTR words / on :func:`os.urandom` words (without the
  ``cryptography`` package ``secure`` runs the same code as ``previous secure``, in one piece).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

try:
    import resource
except ImportError:  # Windows has no resource module
    resource = None  # type: ignore[assignment]

import numpy as np
import torch

from dpopt.kernels import native
from dpopt.noise import (
    _MT_WORDS,
    _SLOT_WORDS,
    BLOCK_PAIRS,
    CUT_RADIUS,
    NORMAL_CHUNK,
    ZIGGURAT_R,
    NoiseSource,
    _aes_ctr,
    _cpu_generator_from_words,
    _os_words,
    _random_words,
    _slots,
    gaussian_from_words,
)
from dpopt.ziggurat import SFC_DISCARD, sfc64_seed_state, ziggurat_body


def _previous_secret(n: int, gen: torch.Generator, pool) -> torch.Tensor:
    """Issue 19's CPU sampler: per chunk an MT19937 generator (whole state from ``gen``), its words,
    float64 Box–Muller with the continued exponent stream (:func:`gaussian_from_words`)."""
    k = -(-n // NORMAL_CHUNK)
    raw = torch.randint(0, 2**32, (k, _MT_WORDS), generator=gen, dtype=torch.int64).to(torch.int32).numpy().tobytes()
    out = torch.empty(n, dtype=torch.float64)

    def fill(i: int) -> None:
        sub = _cpu_generator_from_words(raw[4 * _MT_WORDS * i : 4 * _MT_WORDS * (i + 1)])
        lo, hi = i * NORMAL_CHUNK, min(n, (i + 1) * NORMAL_CHUNK)
        pairs = -(-(hi - lo) // 2)
        words = _random_words(2 * pairs, sub, "cpu")
        z = gaussian_from_words(words, _random_words((_slots(pairs), _SLOT_WORDS), sub, "cpu"), BLOCK_PAIRS)
        out[lo:hi] = z[: hi - lo]

    if pool is None:
        for i in range(k):
            fill(i)
    else:
        list(pool.map(fill, range(k)))
    return out


def _previous_secure(n: int) -> torch.Tensor:
    """Issue 19's secure mode: :func:`gaussian_from_words` on words from :func:`os.urandom`."""
    pairs = -(-n // 2)
    slots = _os_words(_slots(pairs) * _SLOT_WORDS).view(-1, _SLOT_WORDS)
    return gaussian_from_words(_os_words(2 * pairs), slots, BLOCK_PAIRS)


def _ziggurat_only(n: int, name: str) -> None:
    """numpy's float64 ziggurat on bit generator ``name``, chunk by chunk, no tail redraw."""
    out = np.empty(NORMAL_CHUNK)
    gen = np.random.Generator(getattr(np.random, name)(12345))
    for lo in range(0, n, NORMAL_CHUNK):
        gen.standard_normal(out=out[: min(NORMAL_CHUNK, n - lo)])


def _body_only(n: int) -> None:
    """dpopt's compiled ziggurat body on one SFC64 stream per chunk, the tail positions left unfilled."""
    out = np.empty(NORMAL_CHUNK)
    for lo in range(0, n, NORMAL_CHUNK):
        ziggurat_body(out[: min(NORMAL_CHUNK, n - lo)], sfc64_seed_state(os.urandom(24)))


def _numpy_ziggurat_secret(n: int, pool) -> torch.Tensor:
    """The secret sampler before the compiled kernel: per chunk numpy's ziggurat on a fresh SFC64 stream,
    then a scan for |z| ≥ r and the tail law's draws in those places."""
    k = -(-n // NORMAL_CHUNK)
    raw = os.urandom(24 * k)
    out = np.empty(n)

    def fill(i: int) -> None:
        bitgen = np.random.SFC64(0)  # then set to the chunk's stream
        state = {"state": sfc64_seed_state(raw[24 * i : 24 * (i + 1)])}
        bitgen.state = {"bit_generator": "SFC64", "state": state, "has_uint32": 0, "uinteger": 0}
        bitgen.random_raw(SFC_DISCARD)
        chunk = out[i * NORMAL_CHUNK : min(n, (i + 1) * NORMAL_CHUNK)]
        np.random.Generator(bitgen).standard_normal(out=chunk)
        idx = np.flatnonzero(np.abs(chunk) >= ZIGGURAT_R)
        after = np.array(bitgen.state["state"]["state"], dtype=np.uint64)
        native.fill_tails(chunk, after, idx, ZIGGURAT_R)  # the tail law's draws where the stream stopped

    if pool is None:
        for i in range(k):
            fill(i)
    else:
        list(pool.map(fill, range(k)))
    return torch.from_numpy(out)


def _aes_words(n: int) -> None:
    aes = _aes_ctr()
    if aes is not None:
        buf = bytearray(8 * n + 15)
        aes(os.urandom(32)).update_into(bytes(8 * n), buf)  # type: ignore[attr-defined]


def _minor_faults() -> int:
    """Minor page faults of this process so far (``getrusage``; 0 where there is no ``resource`` module)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def _interleaved(cases: dict, repeats: int) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
    """(best wall ms, best process-CPU ms, fewest minor page faults) of each ``(threads, fn)`` case, timed
    round-robin; each case's first call is a warm-up.

    The page faults are the first touches of memory the allocator took fresh from the OS: a row whose
    result is a fresh 16 MB tensor pays 0–5 ns per normal for them or not, depending on what the rows
    before it freed (glibc's mmap threshold adapts to freed blocks), so a CPU difference between two rows
    that comes with a fault difference is the allocator's, not the sampler's (see docs/performance.md,
    "Secure noise without cryptography").
    """
    wall = {name: math.inf for name in cases}
    cpu = dict(wall)
    faults = {name: sys.maxsize for name in cases}
    for _name, (threads, fn) in cases.items():
        torch.set_num_threads(threads)
        fn()
    for _ in range(repeats):
        for name, (threads, fn) in cases.items():
            torch.set_num_threads(threads)
            before = _minor_faults()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name] = min(wall[name], time.perf_counter() - start)
            cpu[name] = min(cpu[name], time.process_time() - start_cpu)
            faults[name] = min(faults[name], _minor_faults() - before)
    return {k: v * 1e3 for k, v in wall.items()}, {k: v * 1e3 for k, v in cpu.items()}, faults


def measure(size: int, repeats: int) -> dict:
    """ms per 10^6 normals for every row (module docstring), in one process, timed round-robin."""
    scale = 1e6 / size
    old_threads = torch.get_num_threads()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    gen = torch.Generator().manual_seed(0)
    secret, secure, repro = NoiseSource("secret"), NoiseSource("secure"), NoiseSource("reproducible", seed=0)
    prev_pool = NoiseSource("secret")  # only for its worker threads (the previous sampler ran there too)
    x32, x64 = torch.empty(size), torch.empty(size, dtype=torch.float64)
    cases = {
        "torch float32 normal_ (1 t)": (1, lambda: x32.normal_(generator=gen)),
        "torch float32 normal_ (2 t)": (2, lambda: x32.normal_(generator=gen)),
        "torch float64 normal_ (1 t)": (1, lambda: x64.normal_(generator=gen)),
        "words: torch MT19937": (
            1,
            lambda: torch.empty(size, dtype=torch.int64).random_(-(2**63), None, generator=gen),
        ),
        "words: numpy SFC64": (1, lambda: np.random.SFC64(1).random_raw(size)),
        "words: os.urandom": (1, lambda: os.urandom(8 * size)),
        "numpy ziggurat (SFC64)": (1, lambda: _ziggurat_only(size, "SFC64")),
        "numpy ziggurat (PCG64DXSM)": (1, lambda: _ziggurat_only(size, "PCG64DXSM")),
        "numpy ziggurat (Philox)": (1, lambda: _ziggurat_only(size, "Philox")),
        "numpy ziggurat (MT19937)": (1, lambda: _ziggurat_only(size, "MT19937")),
        "compiled ziggurat body (SFC64)": (1, lambda: _body_only(size)),
        "numpy-ziggurat secret (1 t)": (1, lambda: _numpy_ziggurat_secret(size, None)),
        "numpy-ziggurat secret (2 t)": (2, lambda: _numpy_ziggurat_secret(size, prev_pool._thread_pool())),
        "previous secret (1 t)": (1, lambda: _previous_secret(size, gen, None)),
        "previous secret (2 t)": (2, lambda: _previous_secret(size, gen, prev_pool._thread_pool())),
        "secret (1 t)": (1, lambda: secret.normal((size,), dtype=torch.float64)),
        "secret (2 t)": (2, lambda: secret.normal((size,), dtype=torch.float64)),
        "secret float32 (2 t)": (2, lambda: secret.normal((size,))),
        "secret streamed (1 t)": (1, lambda: secret.start_normal(size, stream=True).consume(lambda lo, hi, z: None)),
        "secret streamed (2 t)": (2, lambda: secret.start_normal(size, stream=True).consume(lambda lo, hi, z: None)),
        "reproducible (2 t)": (2, lambda: repro.normal((size,), dtype=torch.float64)),
        "previous secure (1 t)": (1, lambda: _previous_secure(size)),
        "secure (1 t)": (1, lambda: secure.normal((size,), dtype=torch.float64)),
    }
    if _aes_ctr() is not None:  # without the `cryptography` package (the `secure` extra) there is no such row
        cases["words: AES-256-CTR"] = (1, lambda: _aes_words(size))
    small_src = NoiseSource("secret")
    small_cases = {
        "torch.randn": (1, lambda: torch.randn(10, generator=gen)),
        "secret": (1, lambda: small_src.normal((10,))),
    }
    try:
        wall, cpu, faults = _interleaved(cases, repeats)
        small = {name: ms * 1e3 for name, ms in _interleaved(small_cases, 50 * repeats)[0].items()}
    finally:
        torch.set_num_threads(old_threads)
    rows = {name: ms * scale for name, ms in wall.items()}
    cpu_rows = {name: ms * scale for name, ms in cpu.items()}
    base, base_cpu = rows["torch float32 normal_ (1 t)"], cpu_rows["torch float32 normal_ (1 t)"]
    return {
        "size": size,
        "repeats": repeats,
        "cpus": os.cpu_count(),
        "load_1min_before_after": [load_before, os.getloadavg()[0] if hasattr(os, "getloadavg") else None],
        "aes_available": _aes_ctr() is not None,
        "numpy": np.__version__,
        "torch": torch.__version__,
        "largest_abs_z": {
            "secret/reproducible": float(math.sqrt(ZIGGURAT_R**2 + 2 * 1012 * math.log(2))),
            "secure/cuda": CUT_RADIUS,
            "numpy ziggurat alone": ZIGGURAT_R + 53 * math.log(2) / ZIGGURAT_R,
            "torch float32": math.sqrt(-2 * math.log(2.0**-24)),
        },
        "ns_per_normal_wall": rows,
        "ns_per_normal_cpu": cpu_rows,
        "minor_page_faults_min": faults,
        "wall_ratio_to_torch_float32": {k: v / base for k, v in rows.items()},
        "cpu_ratio_to_torch_float32": {k: v / base_cpu for k, v in cpu_rows.items()},
        "speedup_over_previous": {
            "secret (1 t), wall": rows["previous secret (1 t)"] / rows["secret (1 t)"],
            "secret (2 t), wall": rows["previous secret (2 t)"] / rows["secret (2 t)"],
            "secret (1 t), cpu": cpu_rows["previous secret (1 t)"] / cpu_rows["secret (1 t)"],
            "secret (2 t), cpu": cpu_rows["previous secret (2 t)"] / cpu_rows["secret (2 t)"],
            "secure, wall": rows["previous secure (1 t)"] / rows["secure (1 t)"],
        },
        "speedup_over_numpy_ziggurat": {
            f"secret ({t} t), {kind}": table[f"numpy-ziggurat secret ({t} t)"] / table[f"secret ({t} t)"]
            for t in (1, 2)
            for kind, table in (("wall", rows), ("cpu", cpu_rows))
        },
        "us_per_call_of_10": small,
    }


def main(argv=None) -> int:
    """Run the measurement and print a table or (``--json``) one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size",
        type=lambda v: int(float(v)),
        default=2_000_000,
        help="normals per timed draw (default 2e6; 2e5 or 200000)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timings per row; the best is kept (default 7)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.size <= NORMAL_CHUNK or args.repeats < 1:
        parser.error(f"--size must exceed {NORMAL_CHUNK} (the chunked path) and --repeats be >= 1")
    result = measure(args.size, args.repeats)
    if args.json:
        print(json.dumps(result))
        return 0
    load = result["load_1min_before_after"]
    print(f"ns per normal (draws of {args.size:,}, best of {args.repeats}; {result['cpus']} CPUs, 1-min load {load})")
    print(f"{'row':30s} {'wall':>7s} {'/torch32':>8s} {'CPU':>7s} {'/torch32':>8s} {'faults':>7s}")
    for name, ns in result["ns_per_normal_wall"].items():
        cpu = result["ns_per_normal_cpu"][name]
        print(
            f"{name:30s} {ns:7.2f} {result['wall_ratio_to_torch_float32'][name]:8.2f} {cpu:7.2f} "
            f"{result['cpu_ratio_to_torch_float32'][name]:8.2f} {result['minor_page_faults_min'][name]:7d}"
        )
    print(
        "speed-up over issue 19's Box–Muller samplers (the 'previous' rows): "
        + ", ".join(f"{k} {v:.2f}" for k, v in result["speedup_over_previous"].items())
    )
    print(
        "speed-up over the numpy-ziggurat sampler: "
        + ", ".join(f"{k} {v:.2f}" for k, v in result["speedup_over_numpy_ziggurat"].items())
    )
    print("µs per call of 10 normals: " + ", ".join(f"{k} {v:.1f}" for k, v in result["us_per_call_of_10"].items()))
    print("largest |z|: " + ", ".join(f"{k} {v:.2f}" for k, v in result["largest_abs_z"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
