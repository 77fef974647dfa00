"""Poisson sampling: each example joins each batch independently with probability q.

This is the sampling the accountants assume (Abadi et al. 2016; Mironov,
Talwar, Zhang 2019, "sampled Gaussian mechanism"). ``sample_rate`` q and the
number of ``steps`` are public; the dataset size N is passed in (it is not
derived into any public constant here) and the realised batch sizes are
private — they are returned only to the caller that feeds the Privatizer.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from .accounting.events import check_sample_rate
from .noise import NoiseSource, make_noise_source

__all__ = ["PoissonSampler"]


class PoissonSampler:
    """Yield ``steps`` index tensors, each a Poisson sample of ``range(dataset_size)``.

    Args:
        dataset_size: N > 0 (private in general; used only to draw).
        sample_rate: q ∈ (0, 1].
        steps: number of batches to draw (≥ 0).
        generator: a seeded ``torch.Generator``: REPRODUCIBLE masks (research
            reruns only; the masks protect privacy like the noise does).
        secure_mode: draw the masks from the OS CSPRNG (:mod:`dpopt.noise`).
        noise: a :class:`~dpopt.noise.NoiseSource` (default: secret, seeded
            from OS entropy and never written).

    Yields:
        int64 tensors of indices (possibly empty: an empty batch is still a
        step, still released and still charged).

    Raises:
        ValueError: N ≤ 0, q outside (0, 1], steps < 0; more than one of
            ``noise``, ``generator``, ``secure_mode``.

    Each example joins with probability exactly q up to float64 rounding: the
    uniforms carry 53 random bits and are compared with q in float64 (a float32
    comparison would draw q = 1e-7 with probability 1.19e-7).

    Usable as a ``DataLoader`` ``batch_sampler`` only if the loader accepts
    empty batches; dpopt's own loop indexes tensors directly.
    """

    def __init__(self, dataset_size: int, sample_rate: float, steps: int,
                 generator: Optional[torch.Generator] = None, secure_mode: bool = False,
                 noise: Optional[NoiseSource] = None):
        if int(dataset_size) <= 0:
            raise ValueError(f"dataset_size must be > 0, got {dataset_size}")
        if int(steps) < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.dataset_size = int(dataset_size)
        self.sample_rate = check_sample_rate(sample_rate)
        self.steps = int(steps)
        self.noise = make_noise_source(noise, generator, secure_mode)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self.steps):
            mask = self.noise.uniform(self.dataset_size) < self.sample_rate
            yield mask.nonzero(as_tuple=True)[0]
