"""transformer_step.py --malloc-mmap-threshold: glibc's threshold is dynamic, and the flag fixes it (issue 34).

The `PrivacyEngine` door's steady-step excess on the GPT-2 shape (docs/performance.md, "The steady step's
excess is glibc's dynamic mmap threshold") is dpopt's own 6-8 MiB float64 blocks served from the heap, which
the dynamic threshold (raised by every freed mmapped block of up to 32 MiB) allows. The child below shows that
mechanism with glibc alone — a freed 12 MiB mmapped block makes a later 9 MiB block come from the heap — and
that the benchmark's ``fix_mmap_threshold`` stops it, in its own process (``mallopt``) and in a process it
starts (``MALLOC_MMAP_THRESHOLD_``), as the memory children are.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from benchmark_module import BENCHMARKS, load_benchmark

PROBE = """
import ctypes

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                                                 "keepcost").split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mapped(size):
    before = libc.mallinfo2().hblks
    ptr = libc.malloc(size)
    out = libc.mallinfo2().hblks > before
    libc.free(ptr)
    return out

print(int(mapped(12 << 20)), int(mapped(9 << 20)), end=" ")
"""

CHILD = (
    """
import os, subprocess, sys
sys.path.insert(0, {bench!r})
if sys.argv[1] == "fix":
    import transformer_step
    transformer_step.fix_mmap_threshold(8 << 20)
"""
    + PROBE
    + """
print(subprocess.run([sys.executable, "-c", {probe!r}], capture_output=True, text=True, check=True).stdout)
"""
).format(bench=str(BENCHMARKS), probe=PROBE)


def _run(mode: str) -> list[int]:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env, check=False, timeout=300
    )
    if "mallinfo2" in out.stderr:  # not glibc ≥ 2.33
        pytest.skip("no glibc mallinfo2 here")
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(v) for v in out.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mmap threshold: Linux only")
def test_a_freed_large_block_raises_glibcs_threshold_and_the_flag_fixes_it():
    # default: 12 MiB is mmapped (above the 128 KiB start); its free raises the threshold, so 9 MiB is not;
    # the same in a fresh process started from it
    assert _run("default") == [1, 0, 1, 0]
    # fixed at 8 MiB: both stay mmapped, here (mallopt) and in the process it starts (the environment)
    assert _run("fix") == [1, 1, 1, 1]


def test_the_flag_refuses_what_glibc_cannot_take():
    ts = load_benchmark("transformer_step")
    for bad in (-1, (32 << 20) + 1):
        with pytest.raises(ValueError, match="0..33554432"):
            ts.fix_mmap_threshold(bad)
