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
        mask = self.noise.uniform(self.dataset_size) < self.sample_rate
        self.position += 1
        return mask.nonzero(as_tuple=True)[0]

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
