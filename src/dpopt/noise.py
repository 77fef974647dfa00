"""Where the privacy-protecting randomness comes from: secret by default.

The Gaussian noise of every release and the Poisson masks of every batch are
what the (ε, δ) guarantee rests on. If an adversary who knows the two
neighbouring datasets can *replay* them (e.g. from a seed written to
``config.json``), they can subtract the noise and the guarantee is void
(ε = ∞ against that adversary). So dpopt draws them from one of three
sources, and records which in the ledger header (``noise``):

``"secret"`` (default)
    A ``torch.Generator`` (Mersenne Twister on CPU, Philox on CUDA) seeded
    from 63 bits of OS entropy (:func:`secrets.randbits`); the seed is never
    stored, printed or written. Protects against replay from anything written
    down. Does NOT protect against an adversary who reconstructs the
    generator's internal state from the noise values themselves (neither
    generator is cryptographic).
``"secure"``
    Opacus' ``secure_mode`` in spirit, without the unmaintained
    ``torchcsprng``: uniforms are read from the operating system's CSPRNG
    (:func:`os.urandom`; ChaCha20 in Linux ≥ 4.8), 53 bits each, and turned
    into Gaussians with the Box–Muller transform (Box & Muller 1958) in
    float64, then rounded to the parameter dtype. State recovery is then
    as hard as breaking the OS CSPRNG. About 8 bytes of OS randomness per
    noise coordinate: slower (measured in docs/pitfalls.md). Floating-point
    attacks (Mironov 2012; Jin et al. 2022, "Are we there yet? Timing and
    floating-point attacks on differential privacy systems") are NOT fully
    closed: sampling in float64 and rounding the sum to float32 blurs the
    low-order bits an attacker reads, but dpopt gives no proof, and no
    protection against timing side channels.
``"reproducible"``
    Seeded from a user-given seed — a research mode for bit-identical
    reruns. The ledger records it and ``dpopt check`` FAILS such a ledger
    ("noise reproducible from a published seed").

Only the :class:`~dpopt.privatizer.Privatizer` and the
:class:`~dpopt.sampling.PoissonSampler` draw from a :class:`NoiseSource`.
"""

from __future__ import annotations

import math
import os
import secrets
from typing import Optional, Union

import torch
from torch import Tensor

__all__ = ["NOISE_MODES", "NoiseSource", "make_noise_source"]

NOISE_MODES = ("secret", "secure", "reproducible")
_BITS = 53  # mantissa bits of a float64 uniform


def _entropy_seed() -> int:
    """63 bits from the OS CSPRNG (fits every torch generator's seed range)."""
    return secrets.randbits(63)


def _os_uniform(n: int) -> Tensor:
    """``n`` float64 uniforms on (0, 1], 53 random bits each, from :func:`os.urandom`."""
    if n == 0:
        return torch.empty(0, dtype=torch.float64)
    words = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64)
    mantissa = torch.bitwise_and(words, (1 << _BITS) - 1).to(torch.float64)
    return (mantissa + 1.0) * (2.0 ** -_BITS)  # k ∈ [0, 2^53) → (k+1)/2^53 ∈ (0, 1]


def _os_normal(n: int) -> Tensor:
    """``n`` float64 standard normals from OS-CSPRNG uniforms (Box–Muller, both outputs used)."""
    pairs = (n + 1) // 2
    u = _os_uniform(2 * pairs)
    r = torch.sqrt(-2.0 * torch.log(u[:pairs]))
    theta = (2.0 * math.pi) * u[pairs:]
    return torch.cat([r * torch.cos(theta), r * torch.sin(theta)])[:n]


class NoiseSource:
    """The random draws that protect privacy: Gaussian noise and Poisson-sampling uniforms.

    Args:
        mode: ``"secret"`` (default), ``"secure"`` or ``"reproducible"``
            (module docstring).
        seed: the seed of ``"reproducible"`` mode (required there, refused
            otherwise).
        generator: an existing ``torch.Generator`` for ``"reproducible"``
            mode (instead of ``seed``); the caller owns its seed, so the
            draws count as reproducible.

    Raises:
        ValueError: unknown mode; a seed/generator outside ``"reproducible"``
            mode, or neither in it.

    The seed of ``"secret"`` mode is drawn here from OS entropy and never
    exposed (no attribute holds it). CUDA tensors get their own generator on
    their device, seeded the same way.
    """

    def __init__(self, mode: str = "secret", seed: Optional[int] = None,
                 generator: Optional[torch.Generator] = None):
        if mode not in NOISE_MODES:
            raise ValueError(f"noise mode must be one of {NOISE_MODES}, got {mode!r}")
        given = seed is not None or generator is not None
        if mode == "reproducible" and not given:
            raise ValueError("reproducible noise needs a seed (or a torch.Generator)")
        if mode != "reproducible" and given:
            raise ValueError(f"a seed or generator makes the noise reproducible; {mode!r} noise takes "
                             "neither (use mode='reproducible' for research reruns)")
        if seed is not None and generator is not None:
            raise ValueError("give a seed or a generator, not both")
        self.mode = mode
        self._seed = seed
        self._generators: dict[str, torch.Generator] = {}
        if generator is not None:
            self._generators[str(generator.device)] = generator

    def _generator(self, device: Union[str, torch.device]) -> torch.Generator:
        key = str(torch.device(device))
        gen = self._generators.get(key)
        if gen is None:
            seed = self._seed if self.mode == "reproducible" else _entropy_seed()
            if seed is None:  # reproducible from a generator on another device
                seed = int(torch.randint(0, 2 ** 62, (), generator=next(iter(self._generators.values()))))
            gen = self._generators[key] = torch.Generator(device=key).manual_seed(int(seed))
        return gen

    def normal(self, shape, dtype: torch.dtype = torch.float32,
               device: Union[str, torch.device] = "cpu") -> Tensor:
        """Standard normal tensor of ``shape`` (std 1; the caller scales it)."""
        shape = torch.Size(shape)
        if self.mode == "secure":
            return _os_normal(shape.numel()).view(shape).to(dtype=dtype, device=device)
        return torch.randn(shape, generator=self._generator(device), dtype=dtype, device=device)

    def uniform(self, n: int, device: Union[str, torch.device] = "cpu") -> Tensor:
        """``n`` float64 uniforms (53 random bits; compare with q in float64 so small q are exact)."""
        if self.mode == "secure":
            return _os_uniform(int(n)).to(device) - 2.0 ** -_BITS  # (0, 1] → [0, 1)
        return torch.rand(int(n), generator=self._generator(device), dtype=torch.float64, device=device)

    def state_dict(self) -> dict:
        """``{device: generator state}`` of a REPRODUCIBLE source (for checkpoints).

        Raises:
            ValueError: for secret or secure noise, whose state is never written anywhere.
        """
        if self.mode != "reproducible":
            raise ValueError(f"the state of {self.mode!r} noise is never saved (it would let anyone replay the "
                             "noise); only reproducible noise has a saved state")
        return {device: gen.get_state() for device, gen in self._generators.items()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a reproducible source (a no-op for secret/secure ones,
        which stay seeded from OS entropy)."""
        if self.mode != "reproducible":
            return
        for device, gen_state in state.items():
            self._generator(device).set_state(gen_state.cpu() if hasattr(gen_state, "cpu") else gen_state)

    def __repr__(self) -> str:  # never shows a seed
        return f"NoiseSource(mode={self.mode!r})"


def make_noise_source(noise: Optional[NoiseSource] = None, generator: Optional[torch.Generator] = None,
                      secure_mode: bool = False) -> NoiseSource:
    """The :class:`NoiseSource` for the keyword arguments Privatizer / PoissonSampler accept.

    ``noise`` wins if given; else a ``generator`` means reproducible draws
    from it (the caller seeded it); else ``secure_mode`` selects the OS
    CSPRNG; else secret (OS-entropy-seeded) draws.

    Raises:
        ValueError: more than one of ``noise``, ``generator``, ``secure_mode``.
    """
    if sum([noise is not None, generator is not None, bool(secure_mode)]) > 1:
        raise ValueError("give at most one of noise=, generator= (reproducible) and secure_mode=True")
    if noise is not None:
        if not isinstance(noise, NoiseSource):
            raise TypeError(f"noise must be a dpopt.noise.NoiseSource, got {type(noise).__name__}")
        return noise
    if generator is not None:
        return NoiseSource("reproducible", generator=generator)
    return NoiseSource("secure" if secure_mode else "secret")
