"""benchmarks/transformer_floor.py: the noise it times is the release's, and its rounds summary is right.

The floor's noise term times the secret sampler as the Privatizer's streamed release adds it (chunk by chunk,
float64 normals · σ + the float32 sum, rounded once into the sum); before 2026-12-06 it timed
``NoiseSource.normal``'s one-buffer draw, which makes two fresh tensors the release never makes. The first test
checks that ``_secret_release`` computes exactly that sum (so the time is of the right work), against an
identically seeded ``NoiseSource.normal`` draw over three chunks; the second checks the median and range the
``--rounds`` summary reports on hand-made rounds.
"""

from __future__ import annotations

import torch
from benchmark_module import load_benchmark

from dpopt.noise import NORMAL_CHUNK, NoiseSource


def _floor():
    return load_benchmark("transformer_floor")


def test_secret_release_adds_the_draws_normals_times_std_rounded_once_into_the_sum():
    floor = _floor()
    n = 2 * NORMAL_CHUNK + 123  # three chunks, the last one short
    base = torch.randn(n, generator=torch.Generator().manual_seed(3))
    flat = base.clone()
    floor._secret_release(NoiseSource("reproducible", seed=11), flat, std=0.5)
    z = NoiseSource("reproducible", seed=11).normal((n,), dtype=torch.float64)
    expected = (0.5 * z + base.double()).float()
    assert flat.dtype == torch.float32
    assert torch.equal(flat, expected)
    assert not torch.equal(flat, base)  # the noise was added (|z| > 0 almost surely)


def test_summary_gives_median_min_and_max_of_each_ratio_over_rounds(capsys):
    floor = _floor()

    def round_(f, np_ms, noise_ms):
        return {
            "floor": f,
            "floor_buffered_noise": f + 0.1,
            "floor_torch_noise": f - 0.1,
            "floor_flop": f - 0.2,
            "engine": 2 * f,
            "np": {"step": np_ms},
            "best": 10.0,
            "noise": {"secret float64 sampler": noise_ms},
            "eng": {"step": 3 * np_ms, "noise": noise_ms + 1, "norms": 12.0},
        }

    out = floor.summarise("x", [round_(1.5, 200.0, 60.0), round_(1.4, 300.0, 50.0), round_(1.7, 250.0, 70.0)])
    assert out["floor"] == (1.5, 1.4, 1.7)
    assert out["engine"] == (3.0, 2.8, 3.4)
    assert out["np_ms"] == (250.0, 200.0, 300.0)
    assert out["engine_ms"] == (750.0, 600.0, 900.0)
    assert out["secret_noise_ms"] == (60.0, 50.0, 70.0)
    assert out["engine_noise_ms"] == (61.0, 51.0, 71.0)
    assert abs(out["floor_buffered_noise"][0] - 1.6) < 1e-12
    assert "3 rounds" in capsys.readouterr().out
