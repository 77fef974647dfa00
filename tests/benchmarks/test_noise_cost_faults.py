"""benchmarks/noise_cost.py's round-robin timer also reports each row's fewest minor page faults.

A row that writes a fresh 64 MiB tensor on every call (above glibc's largest mmap threshold, 32 MiB, so
its pages come fresh from the OS each time) has page faults in every timing; a row that touches no new
memory has fewer. This is what tells an allocator effect from a sampler's cost (docs/performance.md,
"Secure noise without cryptography").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_CHILD = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from benchmark_module import load_benchmark
nc = load_benchmark("noise_cost")
small = torch.zeros(8)
cases = {{
    "fresh 64 MiB": (1, lambda: torch.empty(8 << 20, dtype=torch.float64).fill_(1.0)),
    "no new memory": (1, lambda: small.add_(1.0)),
}}
wall, cpu, faults = nc._interleaved(cases, 3)
print(json.dumps({{"keys": [sorted(wall), sorted(cpu), sorted(faults)], "faults": faults}}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="getrusage's minor faults and glibc's mmap")
def test_interleaved_reports_fewest_page_faults_per_row():
    """In a fresh process: glibc's settings are process-wide, and a test before this one in the same worker may
    have tuned them (``dpopt.allocator.tune_cpu_allocator``, which ``dpopt train`` calls: a 512 MiB top pad
    then serves the 64 MiB block from resident heap, with no fault)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    code = _CHILD.format(tests=str(Path(__file__).resolve().parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=300)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(k == ["fresh 64 MiB", "no new memory"] for k in got["keys"])
    faults = got["faults"]
    assert all(isinstance(v, int) and v >= 0 for v in faults.values())
    assert faults["fresh 64 MiB"] > faults["no new memory"]
