"""dpopt.allocator: the glibc tuning is applied once, can be switched off, and changes no computed value."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = """
import ctypes, os, sys
from dpopt.allocator import tune_cpu_allocator, MMAP_THRESHOLD
first = tune_cpu_allocator()
print(first, tune_cpu_allocator())
if first:
    # glibc then serves a block just below the threshold from the heap, not from a fresh mapping
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = open('/proc/self/maps').read().count('\\n')
    ptrs = [libc.malloc(MMAP_THRESHOLD - 4096) for _ in range(4)]
    after = open('/proc/self/maps').read().count('\\n')
    for p in ptrs:
        libc.free(p)
    print(after - before)
"""


def _child(env_extra: dict) -> list[str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "DPOPT_NO_ALLOCATOR_TUNING"}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, check=True)
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt: Linux only")
def test_tuning_applies_once_and_large_blocks_come_from_the_heap():
    first, second, *maps = _child({})
    if first == "False":
        pytest.skip("this libc refuses mallopt (not glibc)")
    assert (first, second) == ("True", "True")
    # four 32 MiB - 4 KiB blocks: without the tuning each is its own mmap (4 new mappings);
    # with it they come from the heap (at most one heap mapping grows or appears)
    assert int(maps[0]) <= 1


def test_environment_switch_turns_it_off():
    first, second = _child({"DPOPT_NO_ALLOCATOR_TUNING": "1"})[:2]
    assert (first, second) == ("False", "False")


def test_step_values_do_not_depend_on_it():
    """The same seeded DP-SGD step with and without the tuning gives the same parameters.

    Equal up to float rounding (the BLAS may take another path for differently aligned
    buffers); the step's noise (σ = 1, seeded) moves the parameters by far more than that
    tolerance."""
    code = """
import torch, sys
from dpopt.allocator import tune_cpu_allocator
if sys.argv[1] == '1':
    assert tune_cpu_allocator() or True
from dpopt.engine import iter_per_sample_sources
from dpopt.methods import make_optimizer
from dpopt.models import build_model
torch.manual_seed(0)
m = build_model('cnn5-ws')
g = torch.Generator().manual_seed(1)
x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
opt = make_optimizer('dp-sgd', list(m.parameters()), noise_multiplier=1.0, expected_batch_size=8.0, sample_rate=0.01,
                     dataset='cifar10', generator=torch.Generator().manual_seed(0))
ce = torch.nn.functional.cross_entropy
opt.step(iter_per_sample_sources(m, ce, x, y, 4, opt.evaluation_points(), rows_per_example=2))
print(repr(float(sum(p.double().abs().sum() for p in m.parameters()))))
"""
    import os

    env = {k: v for k, v in os.environ.items() if k != "DPOPT_NO_ALLOCATOR_TUNING"}
    outs = [
        subprocess.run(
            [sys.executable, "-c", code, flag], capture_output=True, text=True, env=env, check=True
        ).stdout.strip()
        for flag in ("0", "1")
    ]
    a, b = float(outs[0]), float(outs[1])
    assert abs(a - b) <= 1e-9 * abs(a)


TRIM_CHILD = """
import ctypes, sys
from dpopt.allocator import release_free_heap

def anon_kib():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon'):
            return int(line.split()[1])

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n, size = 1024, 64 << 10  # 64 MiB in 64 KiB blocks: under glibc's 128 KiB mmap threshold, so from the heap
ptrs = [libc.malloc(size) for _ in range(n)]
for p in ptrs:
    ctypes.memset(p, 1, size)  # resident
held = anon_kib()
for i, p in enumerate(ptrs):
    if i % 8 != 7:  # every 8th block (the last included) stays live: the freed ones sit inside the heap,
        libc.free(p)  # where free() never trims the top
after_free = anon_kib()
ok = release_free_heap()
print(ok, held, after_free, anon_kib(), n * size >> 10)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim: Linux only")
def test_release_free_heap_hands_back_the_free_pages_inside_the_heap():
    """7/8 of 64 MiB freed inside the heap stay resident after free(); release_free_heap drops them.

    56 MiB freed in runs of 7 × 64 KiB between live blocks: glibc keeps them (resident memory does not fall
    by more than a quarter of that after free()); ``malloc_trim(0)`` releases the whole pages of every free
    chunk, so resident memory then falls by at least 3/4 of the freed bytes (the partial pages at each run's
    ends are the rest: 128 runs × ≤ 8 KiB). With the switch set, nothing is called and nothing falls."""
    env = {k: v for k, v in os.environ.items() if k != "DPOPT_NO_ALLOCATOR_TUNING"}
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD], capture_output=True, text=True, env=env, check=True)
    ok, held, after_free, after_trim, total = out.stdout.split()
    if ok == "False":
        pytest.skip("no glibc malloc_trim here")
    freed = int(total) * 7 // 8
    assert int(held) - int(after_free) <= freed // 4, (held, after_free, freed)  # free() alone keeps them
    assert int(after_free) - int(after_trim) >= 3 * freed // 4, (after_free, after_trim, freed)
    env["DPOPT_NO_ALLOCATOR_TUNING"] = "1"
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD], capture_output=True, text=True, env=env, check=True)
    ok, held, after_free, after_trim, total = out.stdout.split()
    assert ok == "False"
    assert abs(int(after_free) - int(after_trim)) <= freed // 4, (after_free, after_trim, freed)
