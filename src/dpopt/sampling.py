"""Poisson sampling: each example joins each batch independently with probability q.

This is the sampling the accountants assume (Abadi et al. 2016; Mironov,
Talwar, Zhang 2019, "sampled Gaussian mechanism"). ``sample_rate`` q and the
number of ``steps`` are public; the dataset size N is passed in (it is not
derived into any public constant here) and the realised batch sizes are
private — they are returned only to the caller that feeds the Privatizer.

A step's sample is drawn in O(expected batch), never touching every record (issue 43): the gaps
between included indices are i.i.d. Geometric(q) (:func:`poisson_indices`), which is the same
distribution as one independent Bernoulli(q) per record.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch

from .accounting.events import check_sample_rate
from .noise import NoiseSource, make_noise_source

__all__ = ["PoissonSampler", "poisson_indices"]

_MARGIN_SD, _MARGIN = 6.0, 8  # a chunk of gaps: the expected remainder + 6 sd + 8 (the loop continues if short)


def poisson_indices(noise: NoiseSource, dataset_size: int, sample_rate: float) -> torch.Tensor:
    """The indices of one Poisson sample of ``range(dataset_size)``: each record independently with
    probability q, in O(K + 1) work and memory for K records drawn (never O(N)).

    Args:
        noise: the :class:`~dpopt.noise.NoiseSource` the uniforms come from (secret, secure or
            reproducible, as for the masks).
        dataset_size: N ≥ 0.
        sample_rate: q ∈ (0, 1] (checked by the caller).

    Returns:
        int64 ``[K]`` sorted, distinct indices in ``[0, N)`` (CPU).

    Method (geometric skipping; Devroye 1986, "Non-Uniform Random Variate Generation", §X.2): for
    independent Bernoulli(q) records the number of records skipped before each included one is
    G ~ Geometric(q), P(G ≥ k) = (1 − q)^k, i.i.d. and independent of everything before it. With
    U uniform on (0, 1], G = ⌊ln U / ln(1 − q)⌋ has exactly that law (ln U ≤ k·ln(1 − q) ⟺
    U ≤ (1 − q)^k). U = 1 − u for the source's float64 uniforms u ∈ [0, 1) (53 random bits, so
    every threshold probability is exact up to 2^-53, as the per-record comparison u < q was);
    ln(1 − q) is ``log1p(−q)`` (no cancellation at tiny q). Included index j_r = j_{r−1} + 1 + G_r
    (j_0 = −1) until it passes N − 1. Uniforms are drawn in chunks sized for the expected
    remainder plus 6 standard deviations, so one chunk almost always ends the sample.
    """
    n, q = int(dataset_size), float(sample_rate)
    if n <= 0:
        return torch.empty(0, dtype=torch.int64)
    if q >= 1.0:
        return torch.arange(n, dtype=torch.int64)
    log_keep = math.log1p(-q)
    parts: list[torch.Tensor] = []
    last = -1  # the last index drawn so far
    while True:
        rest = n - 1 - last  # records not yet decided
        mean = rest * q
        m = min(rest + 1, int(mean + _MARGIN_SD * math.sqrt(mean + 1.0)) + _MARGIN)  # gaps to draw; ≥ 1
        u = noise.uniform(m)
        gaps = torch.log1p(-u).div_(log_keep).floor_().clamp_(max=float(n))  # Geometric(q) ≥ 0
        idx = gaps.to(torch.int64).add_(1).cumsum_(0).add_(last)
        done = bool(idx[-1] >= n)
        idx = idx[idx < n]
        parts.append(idx)
        if done:
            break
        last = int(idx[-1])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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
    gaps between included examples are Geometric(q) from uniforms with 53 random
    bits (:func:`poisson_indices`; a float32 uniform would draw q = 1e-7 with
    probability 1.19e-7). A step costs O(q·N) work and memory, not O(N).

    Usable as a ``DataLoader`` ``batch_sampler`` only if the loader accepts
    empty batches; dpopt's own loop indexes tensors directly.

    ``position`` is the number of batches drawn so far: iterating (again)
    draws batches ``position … steps − 1``, so a sampler restored with
    :meth:`load_state_dict` draws exactly the remaining steps of a run.
    """

    def __init__(
        self,
        dataset_size: int,
        sample_rate: float,
        steps: int,
        generator: Optional[torch.Generator] = None,
        secure_mode: bool = False,
        noise: Optional[NoiseSource] = None,
    ):
        if int(dataset_size) <= 0:
            raise ValueError(f"dataset_size must be > 0, got {dataset_size}")
        if int(steps) < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.dataset_size = int(dataset_size)
        self.sample_rate = check_sample_rate(sample_rate)
        self.steps = int(steps)
        self.noise = make_noise_source(noise, generator, secure_mode)
        self.position = 0

    def __len__(self) -> int:
        return self.steps

    @property
    def remaining(self) -> int:
        """Batches still to draw."""
        return self.steps - self.position

    def sample(self) -> torch.Tensor:
        """Draw the next batch (advances ``position``).

        Raises:
            StopIteration: all ``steps`` batches were drawn.
        """
        if self.position >= self.steps:
            raise StopIteration
        idx = poisson_indices(self.noise, self.dataset_size, self.sample_rate)
        self.position += 1
        return idx

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.position < self.steps:
            yield self.sample()

    def state_dict(self) -> dict:
        """Public state: ``position``, ``steps``, ``sample_rate`` (never N); the generator state for
        reproducible noise only (a secret generator's state is never written)."""
        state = {"version": 1, "position": self.position, "steps": self.steps, "sample_rate": self.sample_rate}
        if self.noise.mode == "reproducible":
            state["noise_state"] = self.noise.state_dict()  # type: ignore[assignment]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`: the next batch drawn is batch ``position``.

        Raises:
            ValueError: a state of a sampler with another rate or number of steps.
        """
        if float(state["sample_rate"]) != self.sample_rate or int(state["steps"]) != self.steps:
            raise ValueError(
                f"sampler state of q = {state['sample_rate']}, {state['steps']} steps does not fit "
                f"this sampler (q = {self.sample_rate}, {self.steps} steps)"
            )
        if not 0 <= int(state["position"]) <= self.steps:
            raise ValueError(f"sampler position {state['position']} outside [0, {self.steps}]")
        self.position = int(state["position"])
        if "noise_state" in state:
            self.noise.load_state_dict(state["noise_state"])
