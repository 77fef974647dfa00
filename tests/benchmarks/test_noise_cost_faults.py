"""benchmarks/noise_cost.py's round-robin timer also reports each row's fewest minor page faults.

A row that writes a fresh 64 MiB tensor on every call (above glibc's largest mmap threshold, 32 MiB, so
its pages come fresh from the OS each time) has page faults in every timing; a row that touches no new
memory has fewer. This is what tells an allocator effect from a sampler's cost (docs/performance.md,
"Secure noise without cryptography").
"""

from __future__ import annotations

import sys

import pytest
import torch
from benchmark_module import load_benchmark


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="getrusage's minor faults and glibc's mmap")
def test_interleaved_reports_fewest_page_faults_per_row():
    nc = load_benchmark("noise_cost")
    small = torch.zeros(8)
    cases = {
        "fresh 64 MiB": (1, lambda: torch.empty(8 << 20, dtype=torch.float64).fill_(1.0)),
        "no new memory": (1, lambda: small.add_(1.0)),
    }
    wall, cpu, faults = nc._interleaved(cases, 3)
    assert set(wall) == set(cpu) == set(faults) == set(cases)
    assert all(isinstance(v, int) and v >= 0 for v in faults.values())
    assert faults["fresh 64 MiB"] > faults["no new memory"]
