"""Where the privacy-protecting randomness comes from: secret by default.

The Gaussian noise of every release and the Poisson masks of every batch are
what the (ε, δ) guarantee rests on. If an adversary who knows the two
neighbouring datasets can *replay* them (e.g. from a seed written to
``config.json``), they can subtract the noise and the guarantee is void
(ε = ∞ against that adversary). So dpopt draws them from one of three
sources, and records which in the ledger header (``noise``):

``"secret"`` (default)
    A ``torch.Generator`` whose state comes from OS entropy and is never
    stored, printed or written. On CPU (Mersenne Twister, MT19937) the WHOLE
    624-word state is filled from :func:`os.urandom` (19,968 bits):
    ``manual_seed`` alone would not do, because torch's CPU generator keeps
    only the low 32 bits of a seed, so seeding it with 63 random bits leaves
    2^32 possible noise streams — few enough to replay every one of them
    against a small model (see :func:`_secret_cpu_generator`). On CUDA
    (Philox4x32-10, whose key is the full 64-bit seed) it is seeded with 63
    bits from :func:`secrets.randbits`. Protects against replay from
    anything written down. Does NOT protect against an adversary who
    reconstructs the generator's internal state from the noise values
    themselves (neither generator is cryptographic).
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
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Optional, Union

import torch
from torch import Tensor

__all__ = ["NOISE_MODES", "NoiseSource", "make_noise_source"]

NOISE_MODES = ("secret", "secure", "reproducible")
_BITS = 53  # mantissa bits of a float64 uniform


def _entropy_seed() -> int:
    """63 bits from the OS CSPRNG (fits every torch generator's seed range)."""
    return secrets.randbits(63)


_MT_WORDS = 624  # MT19937 state size (Matsumoto & Nishimura 1998)
NORMAL_CHUNK = 1 << 17  # CPU normals per generator in NoiseSource.normal (131,072)
_MT_PROBE_SEED = 20130917


def _mt_init(seed: int, n: int) -> list[int]:
    """The first ``n`` words of MT19937's state after ``init_genrand(seed)`` (Matsumoto & Nishimura 1998)."""
    words = [seed & 0xFFFFFFFF]
    for i in range(1, n):
        prev = words[-1]
        words.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    return words


@lru_cache(maxsize=1)
def _mt_state_layout() -> tuple[int, int]:
    """(byte offset, bytes per word) of the MT19937 state inside ``torch.Generator().get_state()``.

    Found, not assumed: a generator seeded with a probe seed must hold the
    words ``init_genrand`` gives for that seed. Raises RuntimeError when this
    torch build stores its CPU generator state some other way.
    """
    raw = torch.Generator().manual_seed(_MT_PROBE_SEED).get_state().numpy().tobytes()
    words = _mt_init(_MT_PROBE_SEED, _MT_WORDS)
    for width in (8, 4):
        probe = b"".join(w.to_bytes(width, "little") for w in words)
        at = raw.find(probe)
        if at >= 0:
            return at, width
    raise RuntimeError("cannot locate the Mersenne Twister state in torch's CPU generator state")


def _cpu_generator_from_words(words: bytes) -> torch.Generator:
    """A CPU generator whose 624-word MT19937 state is ``words`` (624·4 bytes, little-endian uint32).

    Raises:
        RuntimeError: the state layout is not recognised (:func:`_mt_state_layout`).
        ValueError: ``words`` has the wrong length or is all zero (a degenerate MT state).
    """
    if len(words) != 4 * _MT_WORDS:
        raise ValueError(f"need {4 * _MT_WORDS} bytes of state, got {len(words)}")
    if not any(words):
        raise ValueError("an all-zero Mersenne Twister state is degenerate")
    gen = torch.Generator().manual_seed(_MT_PROBE_SEED)
    state = gen.get_state()  # uint8 bytes; ours to modify
    at, width = _mt_state_layout()
    slots = state[at:at + width * _MT_WORDS].view(_MT_WORDS, width)
    slots.zero_()
    slots[:, :4] = torch.frombuffer(bytearray(words), dtype=torch.uint8).view(_MT_WORDS, 4)  # little-endian
    # the other fields stay those of a freshly seeded generator: the next draw twists the new state
    gen.set_state(state)
    return gen


def _secret_cpu_generator() -> torch.Generator:
    """A CPU generator with its whole MT19937 state (19,968 bits) from :func:`os.urandom`.

    ``torch.Generator().manual_seed(s)`` keeps only ``s mod 2^32`` (measured:
    seeds 5 and 5 + 2^32 give identical draws), so a "63-bit" seed would give
    an adversary only 2^32 noise streams to try.

    Raises:
        RuntimeError: this torch build's generator state layout is not recognised.
    """
    words = os.urandom(4 * _MT_WORDS)
    while not any(words):  # probability 2^-19968
        words = os.urandom(4 * _MT_WORDS)
    return _cpu_generator_from_words(words)


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

    The state of ``"secret"`` mode is drawn here from OS entropy and never
    exposed (no attribute holds it): the whole Mersenne Twister state on CPU,
    a 63-bit Philox seed on CUDA (module docstring). CUDA tensors get their
    own generator on their device.
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
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_threads = 0
        self._pool_pid = 0
        if generator is not None:
            self._generators[str(generator.device)] = generator

    def _generator(self, device: Union[str, torch.device]) -> torch.Generator:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" must share one generator
            dev = torch.device("cuda", torch.cuda.current_device())
        key = str(dev)
        gen = self._generators.get(key)
        if gen is None:
            if self.mode != "reproducible" and dev.type == "cpu":
                gen = self._generators[key] = _secret_cpu_generator()
                return gen
            seed = self._seed if self.mode == "reproducible" else _entropy_seed()
            if seed is None:  # reproducible from a generator on another device
                seed = int(torch.randint(0, 2 ** 62, (), generator=next(iter(self._generators.values()))))
            gen = self._generators[key] = torch.Generator(device=key).manual_seed(int(seed))
        return gen

    def normal(self, shape, dtype: torch.dtype = torch.float32,
               device: Union[str, torch.device] = "cpu") -> Tensor:
        """Standard normal tensor of ``shape`` (std 1; the caller scales it).

        On CPU, a tensor of more than :data:`NORMAL_CHUNK` elements is filled in
        chunks of that size, each by its own MT19937 generator whose whole
        state (624 words) is drawn from this source's generator, on up to
        ``torch.get_num_threads()`` threads (torch's CPU ``normal_`` is
        single-threaded: 2.0 ms per 795k float32 normals here). Chunk i always
        gets the i-th state, so the values do not depend on the thread count
        (reproducible mode gives the same tensor on any machine).
        """
        shape = torch.Size(shape)
        if self.mode == "secure":
            return _os_normal(shape.numel()).view(shape).to(dtype=dtype, device=device)
        gen = self._generator(device)
        if torch.device(device).type != "cpu" or shape.numel() <= NORMAL_CHUNK:
            return torch.randn(shape, generator=gen, dtype=dtype, device=device)
        return self._chunked_normal(shape, dtype, gen)

    def _chunked_normal(self, shape: torch.Size, dtype: torch.dtype, gen: torch.Generator) -> Tensor:
        n = shape.numel()
        k = -(-n // NORMAL_CHUNK)
        words = torch.randint(0, 2 ** 32, (k, _MT_WORDS), generator=gen, dtype=torch.int64)
        raw = words.to(torch.int32).numpy().tobytes()  # two's complement: the low 32 bits, little-endian
        out = torch.empty(n, dtype=dtype)

        def fill(i: int) -> None:
            sub = _cpu_generator_from_words(raw[4 * _MT_WORDS * i:4 * _MT_WORDS * (i + 1)])
            out[i * NORMAL_CHUNK:min(n, (i + 1) * NORMAL_CHUNK)].normal_(generator=sub)

        pool = self._thread_pool()
        if pool is None or k == 1:
            for i in range(k):
                fill(i)
        else:
            list(pool.map(fill, range(k)))
        return out.view(shape)

    def _thread_pool(self) -> Optional[ThreadPoolExecutor]:
        """Worker threads for chunked draws (None with one torch thread); kept between draws."""
        threads = torch.get_num_threads()
        if threads <= 1:
            return None
        if self._pool is not None and self._pool_pid != os.getpid():  # a forked child: the threads stayed behind
            self._pool = None
        if self._pool is None or self._pool_threads != threads:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dpopt-noise")
            self._pool_threads, self._pool_pid = threads, os.getpid()
        return self._pool

    def __getstate__(self) -> dict:  # copies and pickles carry no threads
        state = dict(self.__dict__)
        state["_pool"], state["_pool_threads"], state["_pool_pid"] = None, 0, 0
        return state

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
