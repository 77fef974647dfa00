"""heap_pins.py's shim: it keeps exactly the live small blocks allocated in a marked phase (issue 34).

The diagnostic behind docs/performance.md's "What pins the check's heap" reads which small blocks a first
step leaves live from an ``LD_PRELOAD`` shim. Here the shim runs under a bare Python child that allocates
blocks of known sizes through libc: the blocks of ≤ 1 KiB allocated while a phase is marked and not freed
are reported with that phase and their size, and nothing else is (freed ones, larger ones, ones allocated
while no phase is marked).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from benchmark_module import load_benchmark

CHILD = """
import ctypes, sys
shim = ctypes.CDLL(sys.argv[1])
shim.shim_dump.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
shim.shim_dump.restype = ctypes.c_long
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = libc.malloc(200)  # no phase marked: not kept
shim.shim_phase(3)
kept = [libc.malloc(72) for _ in range(50)]
gone = [libc.malloc(88) for _ in range(50)]
large = libc.malloc(4096)  # over 1 KiB: not kept
for p in gone:
    libc.free(p)
shim.shim_phase(0)
shim.shim_dump(sys.argv[2].encode(), 0)
print(" ".join(str(p) for p in kept))
print(" ".join(str(p) for p in gone + [before, large]))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("cc") is None, reason="needs Linux (glibc) and cc"
)
def test_the_shim_keeps_the_live_blocks_of_a_marked_phase_and_nothing_else(tmp_path):
    lib = load_benchmark("heap_pins").build_shim(str(tmp_path))
    dump = tmp_path / "live.txt"
    env = dict(os.environ, LD_PRELOAD=lib)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, lib, str(dump)], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    kept, others = ({int(a) for a in line.split()} for line in out[:2])
    rows = {int(r[2]): (int(r[0]), int(r[1])) for r in (line.split() for line in dump.read_text().splitlines())}
    assert len(kept) == 50
    assert all(rows.get(a) == (3, 72) for a in kept)  # offset above lo = 0: the address itself
    assert not others & rows.keys()
    assert all(phase == 3 for phase, _ in rows.values())
    assert not {size for _, size in rows.values()} & {88, 200, 4096}
