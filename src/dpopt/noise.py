"""Where the privacy-protecting randomness comes from, and the Gaussian sampler that uses it.

The Gaussian noise of every release and the Poisson masks of every batch are
what the (ε, δ) guarantee rests on. If an adversary who knows the two
neighbouring datasets can *replay* them (e.g. from a seed written to
``config.json``, a pickle or a forked process), they can subtract the noise
and the guarantee is void (ε = ∞ against that adversary). So dpopt draws them
from one of three sources, and records which in the ledger header (``noise``):

``"secret"`` (default)
    State from OS entropy, never stored, printed or written. The CPU normals
    come from SFC64 streams (Doty-Humphrey's Small Fast Chaotic PRNG),
    one per chunk of :data:`NORMAL_CHUNK` normals, each with a fresh 192-bit
    state from :func:`os.urandom` when the draw starts. The CPU uniforms
    (Poisson masks) come from a ``torch.Generator`` (Mersenne Twister,
    MT19937) whose WHOLE 624-word state is filled from :func:`os.urandom`
    (19,968 bits): ``manual_seed`` alone would not do, because torch's CPU
    generator keeps only the low 32 bits of a seed (see
    :func:`_secret_cpu_generator`). On CUDA (Philox4x32-10, whose key is the
    full 64-bit seed) it is seeded with 63 bits from :func:`secrets.randbits`.
    Protects against replay from anything written down. Does NOT protect
    against an adversary who reconstructs a generator's internal state from
    the noise values themselves (none of these generators is cryptographic).
``"secure"``
    The random words come from a cryptographically secure generator: the
    AES-256-CTR keystream under a fresh 256-bit key from :func:`os.urandom`
    per draw (NIST SP 800-90A's CTR_DRBG construction; the ``cryptography``
    package), or :func:`os.urandom` itself (ChaCha20 in Linux ≥ 4.8) when that
    package is not installed: state recovery is then as hard as breaking
    AES-256 (or the OS generator). Slower (``benchmarks/noise_cost.py``).
``"reproducible"``
    Seeded from a user-given seed — a research mode for bit-identical
    reruns. The ledger records it and ``dpopt check`` FAILS such a ledger
    ("noise reproducible from a published seed").

**Two samplers, one tail requirement.** The guarantee needs every |z| up to
11.5 + 1/σ to be possible: an output beyond the sampler's largest |z| (its cut)
is impossible without the example, so the truncation costs
δ ≥ P(Z > r_max − 1/σ) per inclusion (torch's CPU float32 ``normal_``, 24-bit
uniforms, never exceeds 5.77: 8e-5 at σ = 0.5). Both samplers reach
:data:`CUT_RADIUS` = √(2·1022·ln 2) = 37.64 or just under it, so
P(Z > r_max − 1/σ) < 1e-160 per inclusion for every σ ≥ 0.1; below
:data:`MIN_NOISE_MULTIPLIER` = 1/(37.63 − 11.5) = 0.0383 it would exceed
P(Z > 11.5) = 6.4e-31, and the Privatizer refuses such a σ
(:func:`check_tail_reach`) rather than release a silently truncated tail.

* *Secret and reproducible noise on CPU* (issue 34, for speed): a compiled float64
  ziggurat (Marsaglia & Tsang 2000; :mod:`dpopt.ziggurat`, C) on the chunk's SFC64 stream, with every
  value of its base-strip tail branch (exactly the values with |z| ≥
  :data:`ZIGGURAT_R` = 3.654) redrawn from the exact tail law by Marsaglia's
  (1964) method on uniforms with the full float64 exponent range
  (:func:`ziggurat_normals`): largest |z| √(r² + 2·1012·ln 2) = 37.63 (numpy's
  ziggurat's own tail stops at 13.71). The values do not depend on the thread count.
* *Secure noise, and every mode on CUDA*: float64 Box–Muller on random 64-bit
  words (:func:`gaussian_from_words`, the same torch ops on CPU and CUDA),
  z = √(−2 ln u)·(cos 2πt, sin 2πt), with t on a 2^-52 grid and u = m·2^-(k+1),
  m a 52-bit mantissa in [1, 2) and k geometric from random bits — u is uniform
  with full relative precision at EVERY scale, not a fixed-point grid (a 53-bit
  fixed-point uniform, dpopt's earlier secure mode, stops at 8.57). Here k runs
  to 1021 (u ≥ 2^-1022): the largest |z| is :data:`CUT_RADIUS`.

Other departures from the ideal samplers: a geometric stream of > 1000 zero
bits is cut (probability < 2^-1000); with probability ≤ 2^-140 per call more
Box–Muller pairs need exponent bits beyond the first 12 than :func:`_slots`
provides (per chunk of :data:`NORMAL_CHUNK` normals; they stay at |z| ≤ 4.25);
the ziggurat's tables are float64 roundings of its exact strip edges (a body
value within one 2^-52 grid step of r, probability ≤ 2^-60, is counted as tail and
redrawn); all far below 1e-30 in effect, so nothing is added to the ledger's δ.
Each draw is float64, rounded once to the requested dtype; the Privatizer adds
it to the clipped sum in float64 and rounds the noisy sum once to the parameter
dtype. Reproducible CPU values depend only on dpopt's own ziggurat tables,
SFC64 and the C library's ``log`` (for the tail draws; not on numpy: until 2026-12-07 the tails used
numpy's vectorised log, which differs from glibc's in the last bit for ≈ 0.35 % of arguments on an
AVX-512 CPU, so the values depended on numpy's build and the CPU).

Floating-point attacks (Mironov 2012; Jin et al. 2022, arXiv 2112.05307,
"Are we there yet? Timing and floating-point attacks on differential
privacy systems") are NOT closed: the noise takes finitely many float64
values, so which outputs are possible still depends, in the lowest bits, on
the data; a 52-bit noise rounded with the sum blurs the bits an attacker reads
but dpopt gives no proof, and no protection against timing side channels
(a discrete Gaussian would be the sound fix).

**No replayable copies.** A secret or secure source never serialises its
generator: ``pickle``, ``copy.copy``/``deepcopy`` and ``torch.save`` carry no
generator state, and the copy re-seeds from OS entropy on its first draw (a
copy is still usable: users deep-copy optimizers for EMA/SWA); a forked child
re-seeds too (``os.register_at_fork``). Reproducible sources keep their state.

**When the noise is computed (issue 23).** A large CPU draw can be started before it is needed
(:meth:`NoiseSource.start_normal`, a :class:`CpuNormalDraw`): its chunk states are taken from the
source at once (the stream order is that of a draw made there), its chunks are computed in the
source's worker threads (the compiled sampler releases the GIL: they run in parallel). The Privatizer
starts the step's draw when the step begins, so that it overlaps the per-sample work, and its one
noise seam (``Privatizer._draw``) takes the values at the release. The values are bit-identical to
a :meth:`NoiseSource.normal` call; a draw is never pickled or copied, and one started before a fork
is refused in the child.

**How an early draw shares the cores (issue 34).** Its chunk bodies are one compiled job
(``ziggurat_fill_chunks``): each thread that runs it claims chunks through one atomic counter and
fills them without the GIL until none is left. With ``t`` torch threads, ``t − 1`` workers start it
when the draw starts (one runnable thread fewer beside the step's own ``t`` torch threads: at t = 2,
one worker gave a faster MLP step than two), and :meth:`CpuNormalDraw.consume` runs it too, so the
consumer computes whatever no worker has started instead of waiting for it. The workers hold the GIL
only to start and to finish (not once per chunk; one task replaces a future per chunk). A chunk's
tails (≈ 34 values) are drawn in the same compiled pass, right after its body, so the consumer only
waits for the last chunks (until 2026-12-07 the consumer drew them all in one numpy pass: 0.3 ms of an
8 ms MLP step on the main thread). Only when and where a chunk
is computed changes, never its values (docs/performance.md, "MLP: the noise draw beside torch's threads").

**Memory (issue 43).** Every chunk of :data:`NORMAL_CHUNK` normals of a CPU draw is
self-contained (its own generator state), so a draw can also be *streamed*
(``start_normal(n, stream=True)``): the chunks are computed at the release, each in a
1 MiB scratch buffer of its worker thread, and handed to the caller, who adds them to the clipped
sum and rounds in place — the Privatizer's release of a model larger than its early-draw limit,
which never holds the noise of all parameters at once.

Only the :class:`~dpopt.privatizer.Privatizer` and the
:class:`~dpopt.sampling.PoissonSampler` draw from a :class:`NoiseSource`.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from functools import lru_cache
from typing import Callable, Optional, Union, cast

import numpy as np
import torch
from torch import Tensor

from .errors import ConfigError
from .kernels import native
from .ziggurat import SFC_DISCARD, SFC_STATE_BYTES, ZIGGURAT_R, sfc64_seed_state, ziggurat_body, ziggurat_tables

__all__ = [
    "CUT_RADIUS",
    "MIN_NOISE_MULTIPLIER",
    "NOISE_MODES",
    "ZIGGURAT_R",
    "CpuNormalDraw",
    "NoiseSource",
    "check_tail_reach",
    "gaussian_from_words",
    "make_noise_source",
    "ziggurat_normals",
]

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
    slots = state[at : at + width * _MT_WORDS].view(_MT_WORDS, width)
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
    return (mantissa + 1.0) * (2.0**-_BITS)  # k ∈ [0, 2^53) → (k+1)/2^53 ∈ (0, 1]


def _os_words(n: int) -> Tensor:
    """``n`` int64 words of 64 random bits each from :func:`os.urandom` (CPU tensor)."""
    if n == 0:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64)


@lru_cache(maxsize=1)
def _aes_ctr() -> Optional[Callable[[bytes], object]]:
    """``key -> AES-256-CTR encryptor`` (counter block 0) from the ``cryptography`` package, or None
    when it is not installed (secure noise then reads every word from :func:`os.urandom`)."""
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    except ImportError:
        return None
    return lambda key: Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()


def _secure_words(n: int) -> Tensor:
    """``n`` int64 words of 64 random bits from a cryptographically secure generator (CPU tensor).

    The AES-256-CTR keystream under a fresh 256-bit key from :func:`os.urandom` per call (the
    construction of NIST SP 800-90A's CTR_DRBG: telling the words from random, or predicting any
    of them from the others, is breaking AES-256), ≈ 5× faster than reading them all from the OS;
    :func:`os.urandom` itself when the ``cryptography`` package is not installed.
    """
    aes = _aes_ctr()
    if n == 0 or aes is None:
        return _os_words(n)
    buf = bytearray(8 * n + 15)  # update_into wants room for one more block
    aes(os.urandom(32)).update_into(bytes(8 * n), buf)  # type: ignore[attr-defined]
    return torch.frombuffer(buf, dtype=torch.int64, count=n)


def _random_words(shape, generator: torch.Generator, device) -> Tensor:
    """int64 words of 64 random bits each (the full signed range) from ``generator`` on ``device``."""
    return torch.empty(shape, dtype=torch.int64, device=device).random_(-(2**63), None, generator=generator)


# -- the Gaussian sampler: Box–Muller on uniforms with the full float64 exponent range --------------
#
# A pair of int64 words (a, b) gives two normals z = R·(cos φ, sin φ):
#   φ = 2π·t, t = 1.f with f the low 52 bits of a (t ∈ [1, 2): cos/sin have period 1 in t);
#   u = m·2^-(k+1), m = 1.g with g the low 52 bits of b, k ~ Geometric(1/2) (P(k = j) = 2^-(j+1)),
#   so u is uniform on (0, 1) with a 52-bit mantissa at EVERY scale (not a fixed-point 2^-53 grid);
#   R = √(−2 ln u).
# k: the top 12 bits of b are the first 12 bits of a geometric bit stream (the exponent of
# 0.β₁…β₁₂1 in float64 is −(k+1) for k leading zeros, k ≤ 12). The pairs whose 12 bits are all zero
# (probability 2^-12) continue the stream with _SLOT_WORDS more words each (k += K, K geometric again,
# memoryless): R² += 2K·ln 2. k stops at _K_MAX (u ≥ 2^-1022, a normal float64), so
#   |z| ≤ R ≤ CUT_RADIUS = √(2·1022·ln 2) = 37.64,
# and only a stream of > 1000 zero bits (probability 2^-1000) is cut there.
_M52 = (1 << 52) - 1
_ONE = 1023 << 52  # the bits of float64 1.0
_EXP = 0x7FF << 52  # the exponent field
_STAGE_BITS = 12  # first geometric stage: the top 12 bits of b
_STAGE_PROBE = _ONE | (1 << (51 - _STAGE_BITS))  # 1.0 with a stop bit just below the 12 stage bits
_STAGE_CAP = (1022 - _STAGE_BITS) << 52  # the exponent field of 2^-(12+1): all 12 stage bits zero
_K_MAX = 1021  # u ≥ 2^-(K_MAX+1) = 2^-1022, the smallest normal float64
_SLOT_WORDS = 20  # 20·52 = 1040 ≥ K_MAX − 12 more bits of the stream per continued pair
_OVERFLOW_LOG2 = -140  # P(more pairs to continue than slots drawn) ≤ 2^-140 per call
BLOCK_PAIRS = 1 << 15  # pairs per block of the output layout on CPU (32,768 pairs, 65,536 normals)

#: The sampler's largest possible |z| (its cut radius r_max): √(2·1022·ln 2) ≈ 37.64, in every
#: mode and on every device. P(|Z| > CUT_RADIUS − 1/σ) < 1e-160 for every σ ≥ 0.1.
CUT_RADIUS = math.sqrt(2.0 * (_K_MAX + 1) * math.log(2.0))


def _pairs_block(a: Tensor, b: Tensor, cont: Tensor, s1: Tensor, s2: Tensor) -> None:
    """Box–Muller on one block of ``p`` word pairs (module comment above), in place.

    Args:
        a, b: int64 ``[p]`` random words; on return their storage holds the float64 normals
            R·cos φ (``a``) and R·sin φ (``b``).
        cont: bool ``[p]``: the pairs whose first 12 stream bits were all zero (to be continued).
        s1, s2: float64 and int64 scratch of at least ``p`` elements (reused across blocks: the
            block stays in cache and no fresh memory is touched).
    """
    p = a.numel()
    s1, s2 = s1[:p], s2[:p]
    phi = a.bitwise_and_(_M52).bitwise_or_(_ONE).view(torch.float64).mul_(2.0 * math.pi)
    torch.sin(phi, out=s1)
    torch.cos(phi, out=phi)
    torch.bitwise_right_shift(b, 64 - 52, out=s2)  # b's top 12 bits → bits 51..40 (the stage bits)
    v = s2.bitwise_and_(_M52).bitwise_or_(_STAGE_PROBE).view(torch.float64).sub_(1.0)  # 0.β₁…β₁₂1…
    e = v.view(torch.int64).bitwise_and_(_EXP)  # exponent field: 1022 − k
    torch.eq(e, _STAGE_CAP, out=cont)
    u = e.bitwise_or_(b.bitwise_and_(_M52)).view(torch.float64)  # m·2^-(k+1)
    radius = torch.log(u, out=b.view(torch.float64)).mul_(-2.0).sqrt_()
    phi.mul_(radius)
    radius.mul_(s1)


def _blocks(words: Tensor, cont: Tensor, lo: int, hi: int, block_pairs: int) -> None:
    """:func:`_pairs_block` on pairs ``lo … hi`` (whole blocks, ``lo`` a block start) of the flat
    word layout: block i holds its a-words then its b-words from word ``2·i·block_pairs``."""
    size = min(block_pairs, hi - lo)
    s1 = torch.empty(size, dtype=torch.float64, device=words.device)
    s2 = torch.empty(size, dtype=torch.int64, device=words.device)
    for start in range(lo, hi, block_pairs):
        p = min(hi, start + block_pairs) - start
        _pairs_block(
            words[2 * start : 2 * start + p], words[2 * start + p : 2 * start + 2 * p], cont[start : start + p], s1, s2
        )


def _stream_tail(slot_words: Tensor) -> Tensor:
    """Geometric(1/2) counts from ``[M, _SLOT_WORDS]`` random words: the number of leading zero bits
    of each row's stream of 52-bit groups, capped at ``_K_MAX − 12`` (int64 ``[M]``)."""
    v = slot_words.bitwise_and(_M52).bitwise_or_(_ONE).view(torch.float64).sub_(1.0)  # 0.g₁…g₅₂
    field = v.view(torch.int64).bitwise_right_shift_(52)  # 1022 − zeros, or 0 when all 52 bits are zero
    zeros = torch.where(field == 0, torch.full_like(field, 52), 1022 - field)
    alive = torch.cumprod((zeros == 52).to(torch.int64), dim=1)  # all groups so far were zero
    alive = torch.cat([torch.ones_like(alive[:, :1]), alive[:, :-1]], dim=1)
    return (zeros * alive).sum(dim=1).clamp_(max=_K_MAX - _STAGE_BITS)


def _flag_buffer(pairs: int, device) -> Tensor:
    """A bool ``[pairs]`` view of a buffer padded with False to whole int64 words (:func:`_first_flagged`)."""
    buf = torch.empty(-(-pairs // 8) * 8, dtype=torch.bool, device=device)
    buf[pairs:] = False
    return buf[:pairs]


def _first_flagged(cont: Tensor, m: int) -> Tensor:
    """Indices of the first ``m`` True entries of ``cont`` in order, padded with ``len(cont)``.

    Scans ``cont`` 8 flags at a time (its storage read as int64 words, padded with False by
    :func:`_flag_buffer`), then the 8 flags of each of the first ``m`` non-zero words: the first
    ``m`` flags lie in those words. ``torch.nonzero_static`` keeps it free of host syncs on CUDA.
    """
    pairs = cont.numel()
    padded = -(-pairs // 8) * 8
    words = torch.as_strided(cont, (padded,), (1,)).view(torch.int64)
    hit = torch.nonzero_static(words, size=m, fill_value=words.numel())[:, 0]
    cand = (hit[:, None] * 8 + torch.arange(8, device=cont.device)).reshape(-1)
    inside = cand < pairs
    flag = torch.as_strided(cont, (padded,), (1,))[cand.clamp(max=padded - 1)] & inside
    sel = torch.nonzero_static(flag, size=m, fill_value=cand.numel())[:, 0]
    return torch.where(sel < cand.numel(), cand[sel.clamp(max=cand.numel() - 1)], pairs)


def _continue_stream(flat: Tensor, cont: Tensor, slot_words: Tensor, block_pairs: int) -> None:
    """Give every pair flagged in ``cont`` its further exponent bits (in place, no host sync).

    Args:
        flat: float64 output of all blocks (block ``i`` at ``[2·i·block_pairs, …)``, cos half first).
        cont: bool ``[P]`` from :func:`_pairs_block` for all ``P`` pairs.
        slot_words: int64 ``[M, _SLOT_WORDS]``; M = :func:`_slots` (P) rows: the first M flagged
            pairs (in index order) get one row each. More than M flagged pairs (probability
            ≤ 2^-140) leaves the later ones at k = 12 (|z| ≤ 4.25).
    """
    pairs, m = cont.numel(), slot_words.shape[0]
    if pairs == 0 or m == 0:
        return
    if cont.device.type == "cpu" and not bool(cont.any()):  # nothing to continue (no host sync on CPU;
        return  # on CUDA the no-op runs, sync-free, rather than wait for the answer)
    idx = _first_flagged(cont, m)
    valid = idx < pairs
    idx = torch.where(valid, idx, torch.zeros_like(idx))
    blk, j = idx // block_pairs, idx % block_pairs
    in_block = torch.clamp(pairs - blk * block_pairs, max=block_pairs)
    cos_at = blk * (2 * block_pairs) + j
    at = torch.cat([cos_at, cos_at + in_block])
    z = flat[at]
    old = z[:m] ** 2 + z[m:] ** 2  # R² = −2 ln u of the first stage
    extra = _stream_tail(slot_words).to(torch.float64) * (2.0 * math.log(2.0))
    ratio = torch.where(valid, torch.sqrt((old + extra) / old), torch.ones_like(old))
    flat.index_put_((at,), z * (torch.cat([ratio, ratio]) - 1.0), accumulate=True)  # + 0 at unused slots


def _finish(flat: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """The first ``shape.numel()`` values of ``flat`` (float64) as ``shape``, rounded once to ``dtype``;
    never a view that keeps the unused last draw of an odd count."""
    n = shape.numel()
    out = flat[:n].view(shape)
    if dtype != torch.float64:
        return out.to(dtype)
    return out.clone() if n != flat.numel() else out


@lru_cache(maxsize=256)
def _slots(pairs: int) -> int:
    """Rows of continuation words for ``pairs`` pairs: the smallest M with P(N > M) ≤ 2^-140 for
    N ~ Binomial(pairs, 2^-12), by the Chernoff bound P(N ≥ M) ≤ e^-λ (eλ/M)^M, λ = pairs·2^-12."""
    if pairs <= 0:
        return 0
    lam = pairs * 2.0**-_STAGE_BITS
    bound = _OVERFLOW_LOG2 * math.log(2.0)

    def ok(m: int) -> bool:
        return m >= pairs or (m > lam and -lam + m * (1.0 + math.log(lam) - math.log(m)) <= bound)

    lo, hi = 1, pairs
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def gaussian_from_words(words: Tensor, slot_words: Tensor, block_pairs: Optional[int] = None) -> Tensor:
    """Standard normals from random words — the sampler of every mode, a pure function (white-box tests).

    Args:
        words: int64, ``2P`` words (any shape, contiguous), consumed: block by block, the block's
            ``P_b`` angle words then its ``P_b`` radius words (one block: a ``[2, P]`` tensor).
        slot_words: int64 ``[_slots(P), _SLOT_WORDS]`` continuation words.
        block_pairs: pairs per block (default: all P in one block).

    Returns:
        float64 ``[2P]`` in the words' own storage: block by block, the ``P_b`` normals R·cos φ
        then the ``P_b`` normals R·sin φ of the same pairs. Every |value| ≤ :data:`CUT_RADIUS`.
    """
    flat = words.reshape(-1)
    pairs = flat.numel() // 2
    bp = block_pairs or max(pairs, 1)
    cont = _flag_buffer(pairs, words.device)
    _blocks(flat, cont, 0, pairs, bp)
    out = flat.view(torch.float64)
    _continue_stream(out, cont, slot_words, bp)
    return out


# -- the CPU sampler: a compiled float64 ziggurat on SFC64 words, its tail redrawn exactly ------------
#
# The body is Marsaglia & Tsang (2000)'s ziggurat with 256 strips (dpopt.ziggurat: one 64-bit SFC64
# word per candidate, compiled C, GIL released). A value has |z| >= r = ZIGGURAT_R exactly when it
# comes from the base strip's tail branch (every other branch returns |u·x_i| < r); each such position
# is filled, with its sign, by an independent draw of the exact tail law Z | Z >= r (``fill_tails`` of
# dpopt.kernels, C: Marsaglia 1964 on uniforms with the full float64 exponent range; its numpy statement,
# the tests' oracle, is tests/core/tail_oracle.py) from the same stream where the body stopped: the mixture is again N(0, 1) (the branch's probability is P(|Z| >= r) by
# construction), with a tail to _TAIL_RADIUS = √(r² + 2·1012·ln 2) ≈ 37.63 ≤ CUT_RADIUS (numpy's own
# ziggurat tail stops at r + 36.7/r ≈ 13.7 < 11.5 + 1/σ for σ < 0.45). The tail is 2.6e-4 of the values.
_TAIL_CAP = 1024  # tail positions an early draw records per chunk (≈ 34 expected; more: the chunk is redrawn)
_TAIL_WORDS = 16  # 1024 bits of the geometric stream of a tail uniform's exponent (TAIL_WORDS in _native.c)
_TAIL_K_MAX = 1011  # exponent cap of a tail uniform: √(r² + 2·(K+1)·ln 2) ≤ CUT_RADIUS (TAIL_K_MAX in _native.c)
_LN2 = math.log(2.0)


def ziggurat_normals(state: bytes, out: np.ndarray) -> np.ndarray:
    """Fill float64 ``out`` (1-D, contiguous) with standard normals from one SFC64 stream — the CPU
    sampler of secret and reproducible noise (module comment above), a pure function of ``state``.

    The body comes from :func:`dpopt.ziggurat.ziggurat_body`; its tail positions are filled, with
    their signs, by the compiled exact tail law (``fill_tails`` of :mod:`dpopt.kernels`: Marsaglia 1964,
    the comment above ``tail_draws`` in ``_native.c``) from the same stream where the body stopped.

    Args:
        state: 24 bytes, the stream's SFC64 state (:func:`~dpopt.ziggurat.sfc64_seed_state`).
        out: float64 numpy array, overwritten; the same values whatever thread runs this.

    Returns:
        ``out``. Every |value| ≤ _TAIL_RADIUS < :data:`CUT_RADIUS`.

    Raises:
        ValueError: ``state`` is not 24 bytes; ``out`` is not 1-D contiguous float64.
    """
    words = sfc64_seed_state(state)
    try:
        idx = ziggurat_body(out, words)  # words now hold the stream's state after the body
        if idx.size:
            native.fill_tails(out, words, idx, ZIGGURAT_R)
    finally:
        words[:] = 0  # the stream's state is not kept past its use, nor past an error
    return out


_TAIL_RADIUS = math.sqrt(ZIGGURAT_R * ZIGGURAT_R + 2.0 * (_TAIL_K_MAX + 1) * _LN2)  # ≈ 37.63
_REACH_MARGIN = 11.5  # std the sampler must reach beyond the shift 1/σ: P(Z > 11.5) = 6.4e-31

#: The smallest noise multiplier (noise std / L2 sensitivity) the samplers serve: 1 / (r_max − 11.5)
#: ≈ 0.0383, r_max = min(_TAIL_RADIUS, CUT_RADIUS) = 37.63. Below it an output the example makes likely
#: would be impossible without it with probability P(Z > r_max − 1/σ) > 6.4e-31 per inclusion (at
#: σ = 0.01 the shift, 100 std, is beyond r_max: the two output sets are disjoint, δ = 1), a δ no
#: accountant charges: :func:`check_tail_reach` refuses such a σ.
MIN_NOISE_MULTIPLIER = 1.0 / (min(_TAIL_RADIUS, CUT_RADIUS) - _REACH_MARGIN)


def check_tail_reach(noise_multiplier: float, name: str = "noise_multiplier", per: str = "") -> None:
    """Refuse a noise multiplier σ in (0, :data:`MIN_NOISE_MULTIPLIER`): the samplers' largest |z|
    (37.63) must be ≥ 11.5 + 1/σ (module docstring; Mironov 2012 on bounded samplers). σ = 0 (no
    noise, ε = ∞, recorded as such) passes.

    Args:
        noise_multiplier: the σ the tail must serve (noise std over the L2 sensitivity of the release).
        name: the argument to change, for the message and the :class:`~dpopt.errors.ConfigError`.
        per: how σ was derived from ``name``, for the message (e.g. ``" / sensitivity 2.26"``).

    Raises:
        ConfigError: 0 < σ < MIN_NOISE_MULTIPLIER.
    """
    sigma = float(noise_multiplier)
    if 0.0 < sigma < MIN_NOISE_MULTIPLIER:
        raise ConfigError(
            f"{name}{per} = {sigma:.4g} is below {MIN_NOISE_MULTIPLIER:.4f}: the Gaussian sampler reaches "
            f"|z| <= {min(_TAIL_RADIUS, CUT_RADIUS):.2f}, so at this sigma some outputs would be impossible "
            "without the example (a truncation delta no accountant charges); raise it (epsilon at this sigma "
            "is in the hundreds or more anyway), or use 0 for a non-private run",
            name,
        )


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

    The state of ``"secret"`` mode comes from OS entropy and is never
    written anywhere: each CPU normal draw's SFC64 chunk states (from
    :func:`os.urandom`, held by the draw until its chunks are computed), the
    whole Mersenne Twister state of the CPU uniforms, a 63-bit Philox seed on
    CUDA (module docstring). CUDA tensors get their own generator on their
    device.
    """

    def __init__(self, mode: str = "secret", seed: Optional[int] = None, generator: Optional[torch.Generator] = None):
        if mode not in NOISE_MODES:
            raise ValueError(f"noise mode must be one of {NOISE_MODES}, got {mode!r}")
        given = seed is not None or generator is not None
        if mode == "reproducible" and not given:
            raise ValueError("reproducible noise needs a seed (or a torch.Generator)")
        if mode != "reproducible" and given:
            raise ValueError(
                f"a seed or generator makes the noise reproducible; {mode!r} noise takes "
                "neither (use mode='reproducible' for research reruns)"
            )
        if seed is not None and generator is not None:
            raise ValueError("give a seed or a generator, not both")
        self.mode = mode
        self._seed = seed
        self._generators: dict[str, torch.Generator] = {}
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_threads = 0
        self._pool_pid = 0
        self._epoch = 0  # bumped by _forget (fork): a CpuNormalDraw of an older epoch is never consumed
        if generator is not None:
            self._generators[str(generator.device)] = generator
        _LIVE.add(self)

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
                seed = int(torch.randint(0, 2**62, (), generator=next(iter(self._generators.values()))))
            gen = self._generators[key] = torch.Generator(device=key).manual_seed(int(seed))
        return gen

    def normal(self, shape, dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu") -> Tensor:
        """Standard normal tensor of ``shape`` (std 1; the caller scales it), every |z| ≤ :data:`CUT_RADIUS`.

        Secret and reproducible noise on CPU: :func:`ziggurat_normals` (a compiled float64 ziggurat
        on SFC64, its tail redrawn exactly), chunk by chunk — chunk i (:data:`NORMAL_CHUNK` normals)
        from its own SFC64 state, drawn for it when the draw starts (secret: 24 bytes of
        :func:`os.urandom`; reproducible: from this source's torch generator), on up to
        ``torch.get_num_threads()`` threads. Chunk i always gets the i-th state, so the values do
        not depend on the thread count (reproducible mode gives the same tensor on any machine, up to
        the platform's ``exp`` in the ziggurat's rare wedge test). Secure noise, and every mode on CUDA: :func:`gaussian_from_words`
        (float64 Box–Muller on uniforms with a 52-bit mantissa at every scale) on words from the OS
        CSPRNG (secure) or this source's generator on ``device``. The float64 result is rounded once
        to ``dtype``.

        Raises:
            ValueError: ``dtype`` is not a floating-point dtype.
        """
        if not dtype.is_floating_point:
            raise ValueError(f"normal noise needs a floating-point dtype, got {dtype}")
        shape = torch.Size(shape)
        n = shape.numel()
        pairs = -(-n // 2)
        dev = torch.device(device)
        block = BLOCK_PAIRS if dev.type == "cpu" else None
        if self.mode == "secure":
            words = _secure_words(2 * pairs).to(dev)
            slot_words = _secure_words(_slots(pairs) * _SLOT_WORDS).view(-1, _SLOT_WORDS).to(dev)
        elif dev.type == "cpu":
            return CpuNormalDraw(self, n).values(shape, dtype)
        else:
            gen = self._generator(dev)
            words = _random_words(2 * pairs, gen, dev)
            slot_words = _random_words((_slots(pairs), _SLOT_WORDS), gen, dev)
        flat = gaussian_from_words(words, slot_words, block)
        return _finish(flat, shape, dtype)

    def start_normal(self, n: int, stream: bool = False, defer: Optional[bool] = None) -> "CpuNormalDraw":
        """Start drawing ``n`` standard normals on the CPU; the chunks are computed in the background.

        The same values as ``normal((n,), dtype=torch.float64)``: chunk i of ``NORMAL_CHUNK``
        normals comes from its own SFC64 stream (:func:`ziggurat_normals`) whose state is drawn NOW
        (secret: from :func:`os.urandom`; reproducible: from this source's generator, so the order
        of draws from this source — the stream of reproducible mode — is that of a :meth:`normal`
        call made here). With more than one torch
        thread the chunks run in this source's worker threads (the Privatizer starts the step's draw
        when the step begins and consumes it at the release); with one thread they are computed
        here, now. ``defer`` says when the workers start: False — now, while the caller goes on
        (overlapping the per-sample work); True — at :meth:`CpuNormalDraw.start` or, at the latest,
        at :meth:`CpuNormalDraw.consume`, beside the consumer; None (default) — now only where a core
        is spare beside torch's threads (:func:`spare_core`), else deferred. Only the time of the
        computation depends on it, never a value.

        Secure mode draws its words from the OS per call: its draw is computed here, now, in one
        piece (:meth:`normal`), and wrapped in the same handle.

        ``stream=True``: nothing is computed now but the chunk states (no buffer of ``n`` values):
        :meth:`CpuNormalDraw.consume` computes the chunks one by one into per-worker scratch and
        hands each to its ``fn`` — the same values, in O(NORMAL_CHUNK) memory per worker (secure
        mode: each chunk's words from the OS when it is computed).

        Raises:
            ValueError: ``n`` < 0.
        """
        n = int(n)
        if n < 0:
            raise ValueError(f"the number of normals must be >= 0, got {n}")
        if self.mode == "secure" and (n <= NORMAL_CHUNK or not stream):
            return CpuNormalDraw.ready(self, self.normal((n,), dtype=torch.float64))
        return CpuNormalDraw(self, n, stream=stream, defer=defer)

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

    def _forget(self) -> None:
        """Drop the generators of a non-reproducible source: the next draw re-seeds from OS entropy."""
        if self.mode != "reproducible":
            self._generators = {}
        self._pool, self._pool_threads, self._pool_pid = None, 0, 0
        self._epoch += 1  # draws started before (a forked child's copies of them) are never used

    def __getstate__(self) -> dict:
        """What a pickle, ``copy.copy``/``deepcopy`` or ``torch.save`` carries: never threads, and
        never the generator state of secret noise (a copy re-seeds from OS entropy on its first draw,
        so it cannot replay the original's noise). Reproducible sources keep their generators."""
        state = dict(self.__dict__)
        state["_pool"], state["_pool_threads"], state["_pool_pid"] = None, 0, 0
        if self.mode != "reproducible":
            state["_generators"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.mode != "reproducible":
            self._generators = {}
        _LIVE.add(self)

    def uniform(self, n: int, device: Union[str, torch.device] = "cpu") -> Tensor:
        """``n`` float64 uniforms (53 random bits; compare with q in float64 so small q are exact)."""
        if self.mode == "secure":
            return _os_uniform(int(n)).to(device) - 2.0**-_BITS  # (0, 1] → [0, 1)
        return torch.rand(int(n), generator=self._generator(device), dtype=torch.float64, device=device)

    def state_dict(self) -> dict:
        """``{device: generator state}`` of a REPRODUCIBLE source (for checkpoints).

        Raises:
            ValueError: for secret or secure noise, whose state is never written anywhere.
        """
        if self.mode != "reproducible":
            raise ValueError(
                f"the state of {self.mode!r} noise is never saved (it would let anyone replay the "
                "noise); only reproducible noise has a saved state"
            )
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


class CpuNormalDraw:
    """A draw of ``n`` standard normals on the CPU (float64), started by :meth:`NoiseSource.start_normal`.

    Consumed once, by :meth:`consume` (or :meth:`values`): the values are bit-identical to those
    :meth:`NoiseSource.normal` would have returned (before rounding) at the point of the stream
    where the draw was started. Chunk ``c`` holds the normals ``[c·NORMAL_CHUNK, (c+1)·NORMAL_CHUNK)``
    and is self-contained: :func:`ziggurat_normals` on its own 24-byte SFC64 state, drawn for it
    when the draw starts (secret: :func:`os.urandom`; reproducible: the source's generator). So a
    chunk can be computed whenever, on any thread, and the values never depend on the thread count
    or on when they are computed. The compiled sampler releases the GIL: the chunks run in parallel.

    Two ways to compute (the same values):

    * ``stream=False`` (default): the chunks are computed by ``threads − 1`` of the source's worker
      threads, from when the draw starts where a core is spare beside torch's threads (``defer``,
      :meth:`NoiseSource.start_normal`), else from :meth:`start` or :meth:`consume` (which wakes only as many
      as there are unclaimed chunks beyond its own: :meth:`_helpers`), the consumer
      taking those still unclaimed when it needs them (at once with one torch thread), into one
      float64 buffer of all ``n`` values — the Privatizer's early draw; each chunk's body by
      the compiled job (``ziggurat_fill_chunks``: the same kernels as :func:`ziggurat_normals`,
      its tail positions filled in the same pass; a chunk with more than ``_TAIL_CAP`` of them, never
      seen, is computed again by :func:`ziggurat_normals` at :meth:`consume`); :meth:`pause`
      stops the workers' claims between chunks and :meth:`start` (or :meth:`consume`) resumes them
      (:mod:`dpopt.core_loan` lends a core to one worker between a step's forward and its large GEMMs);
    * ``stream=True``: nothing but the chunk states is drawn at start; :meth:`consume` computes
      each chunk into a chunk-sized scratch buffer of its worker and hands it to ``fn`` at once —
      memory O(NORMAL_CHUNK · threads), never O(n) (issue 43: the release of a large model).
      Secure noise is always streamed: each chunk's words come from the OS when it is computed.

    A draw is never copied or pickled (it holds secret noise: a copy would replay it), and one
    started before a fork is refused in the child (the source's epoch, :meth:`NoiseSource._forget`).
    """

    def __init__(
        self,
        source: "NoiseSource",
        n: int,
        values: Optional[Tensor] = None,
        stream: bool = False,
        defer: Optional[bool] = None,
    ):
        self.n = int(n)
        self.stream = bool(stream) and values is None
        self._source, self._epoch, self._used = source, source._epoch, False
        self._futures: list = []
        self._values: Optional[Tensor] = None
        self._states: Optional[list[bytes]] = None
        self._job: Optional[tuple] = None  # an early draw's arguments of the compiled sampler (_bodies)
        self._deferred = False  # an early draw whose workers wait for start() (or consume)
        if values is not None:  # already computed (secure mode): one chunk
            self._values, self._k = values, 1
            return
        self._k = k = -(-self.n // NORMAL_CHUNK)
        if source.mode == "secure":  # streamed only: each chunk's words come from the OS when it is computed
            self.stream = True
            return
        if source.mode == "reproducible":
            gen = source._generator("cpu")
            raw = torch.randint(0, 2**32, (k, 6), generator=gen, dtype=torch.int64).to(torch.int32).numpy().tobytes()
        else:
            raw = os.urandom(SFC_STATE_BYTES * k)
        self._states = [raw[SFC_STATE_BYTES * i : SFC_STATE_BYTES * (i + 1)] for i in range(k)]
        if self.stream:
            return
        self._values = torch.empty(self.n, dtype=torch.float64)
        # the compiled sampler's job: each chunk's SFC64 state [a, b, c, counter 1] (advanced in place to where the
        # chunk's body ends: its tail draws continue there), the shared claim counter, the tail-branch positions
        words = np.ones((k, 4), dtype=np.uint64)
        words[:, :3] = np.frombuffer(raw, dtype="<u8").reshape(k, 3)
        # (at most _TAIL_CAP per chunk: a buffer of n positions, 8 bytes per normal, made glibc return and re-fault
        # the heap's top pages every step: ≈ 2 ms more CPU per MLP step, measured)
        self._words, self._tail_count = words, np.zeros(k, np.int64)
        self._tail_idx = np.empty((k, _TAIL_CAP), np.int64)
        kt, wt, ft, _ = ziggurat_tables()
        counter = np.zeros(2, np.int64)  # [next unclaimed chunk, pause flag] (ziggurat_fill_chunks)
        out = self._values.numpy()
        self._job = (
            out,
            words,
            counter,
            NORMAL_CHUNK,
            SFC_DISCARD,
            kt,
            wt,
            ft,
            self._tail_idx,
            _TAIL_CAP,
            self._tail_count,
            ZIGGURAT_R,
        )
        pool = source._thread_pool() if k > 1 else None
        if pool is None:
            self._bodies()
            return
        # threads − 1 workers, one runnable thread fewer beside the caller's own torch threads; the consumer claims
        # what is left when it needs the values. They start now only where a core is spare beside torch's threads:
        # with as many torch threads as cores a worker running during the step's GEMMs takes a core from one of
        # torch's threads, and the whole OpenMP region waits for that thread (MLP, 2 threads on 2 cores: the
        # forward 1.2-1.9 ms slower for a 1.5 ms draw; docs/performance.md, "MLP: when the noise draw starts")
        self._deferred = True
        if not (spare_core(source._pool_threads) if defer is None else not defer):
            return
        self.start()

    def start(self, workers: Optional[int] = None) -> None:
        """Start (or, after :meth:`pause`, resume) the workers of a deferred early draw: ``workers`` of the
        source's pool threads (default ``threads − 1``; 0: none, the draw only resumed for the consumer's own
        claims), each running :meth:`_bodies`; a no-op for any other
        draw, once started, or once consumed (:meth:`consume` calls it with :meth:`_helpers` workers where the draw
        waits). Only when the chunks are
        computed moves: chunk i is computed from its own SFC64 state, drawn when the draw was made, so the
        values never depend on it."""
        if not self.waiting:
            return
        self._deferred = False
        assert self._job is not None
        self._job[2][1] = 0  # a paused draw's workers claim again
        if workers is not None and int(workers) <= 0:
            return
        pool = self._source._thread_pool()
        if pool is None:
            return
        count = max(1, self._source._pool_threads - 1) if workers is None else int(workers)
        self._futures += [pool.submit(self._bodies) for _ in range(min(count, self._k))]

    def _helpers(self) -> int:
        """Workers worth waking for the consumer of a deferred or paused early draw: one per unclaimed chunk
        beyond the one the consumer claims itself, at most ``threads − 1``. A worker woken for nothing costs the
        consumer its wake-up (≈ 0.1 ms here) when it waits for it: the draw a loan left with one small chunk
        (docs/performance.md, "MLP: the consumer's helpers"). The count read may be stale (the workers still
        claim): it sets how many threads help, never a value."""
        assert self._job is not None
        left = self._k - min(self._k, int(self._job[2][0]))
        return max(0, min(self._source._pool_threads - 1, left - 1))

    @property
    def waiting(self) -> bool:
        """An early draw (not streamed, of more than one chunk) whose workers have not started, or were
        paused, and that is not consumed yet: :meth:`start` would start them."""
        return self._deferred and not self._used and self._job is not None

    def pause(self) -> None:
        """Stop the workers of a started early draw from claiming further chunks (each finishes the chunk it
        is computing); :meth:`start` or :meth:`consume` resumes. A no-op for any other draw. Only when the
        chunks are computed moves, never their values (:meth:`start`)."""
        if self._deferred or self._used or self._job is None or not self._futures:
            return
        self._job[2][1] = 1  # read by ziggurat_fill_chunks before each claim
        self._deferred = True

    def _bodies(self) -> int:
        """Fill the bodies of the chunks no thread has claimed yet (the compiled sampler, GIL released); the
        number of chunks this call filled (0 once the job is finished)."""
        job = self._job
        return 0 if job is None else native.ziggurat_fill_chunks(*job)

    def _finish_tails(self) -> None:
        """The chunks with more tail-branch positions than the compiled job records (``_TAIL_CAP``; it fills the
        tails of every other chunk as it goes) computed again, whole, by :func:`ziggurat_normals` from their states:
        the same values. Then the chunk states are dropped."""
        buf = self._values
        assert buf is not None and self._states is not None
        out = buf.numpy()
        for i in np.flatnonzero(self._tail_count > _TAIL_CAP).tolist():  # ≈ 34 expected of 1024: never, nearly
            lo, hi = self._bounds(i)
            ziggurat_normals(self._states[i], out[lo:hi])
        self._drop_job()

    def _finish_job(self, futures: list) -> None:
        """The compiled job finished: this thread claims the chunks no worker has started, the workers (``futures``)
        that have not started are cancelled and the others waited for, their first failure raised (no chunk is
        still running when an error reaches the caller), then :meth:`_finish_tails`."""
        try:
            self._bodies()
        finally:  # a worker that has not started finds nothing left: it is not waited for
            futures = [fut for fut in futures if not fut.cancel()]
            wait(futures)
        _wait_all(futures)
        self._finish_tails()

    def _drop_job(self) -> None:
        """The compiled job's chunk states (where each body stopped) wiped and the job dropped: after its use, or
        after a failure (no worker runs it any more)."""
        self._words[:] = 0
        self._job = None
        self._tail_idx, self._tail_count = np.empty((0, 0), np.int64), np.empty(0, np.int64)

    @classmethod
    def ready(cls, source: "NoiseSource", values: Tensor) -> "CpuNormalDraw":
        """A draw whose float64 ``values`` ``[n]`` are already computed."""
        return cls(source, values.numel(), values)

    def _bounds(self, i: int) -> tuple[int, int]:
        """Normals ``[lo, hi)`` of chunk ``i``."""
        return i * NORMAL_CHUNK, min(self.n, (i + 1) * NORMAL_CHUNK)

    def _fill(self, i: int, buf: Tensor, own_place: bool = True) -> Tensor:
        """Chunk ``i``'s float64 normals, computed in ``buf`` (float64: at the chunk's own place in
        the whole draw, or at offset 0 of a chunk-sized scratch buffer when ``own_place`` is
        False); returns the chunk's values (a view)."""
        lo, hi = self._bounds(i)
        if self._states is None:  # secure: the OS CSPRNG's words, the one-piece sampler
            return self._source.normal((hi - lo,), dtype=torch.float64)
        mine = buf[lo:hi] if own_place else buf[: hi - lo]
        ziggurat_normals(self._states[i], mine.numpy())
        return mine

    @property
    def usable(self) -> bool:
        """Not consumed yet, and started in this process's current epoch of the source (not before a fork)."""
        return not self._used and self._epoch == self._source._epoch

    def consume(self, fn: Optional[Callable[[int, int, Tensor], None]] = None) -> Optional[Tensor]:
        """Finish the draw; ``fn(lo, hi, values)`` is called once per chunk with its float64 normals
        ``[lo, hi)`` (a view; ``fn`` may change it in place), in the worker threads when there are
        any (the calls may run concurrently: each touches only its own range). Returns the float64
        storage (at least ``n`` values; its first ``n`` are the normals, unless ``fn`` changed them),
        or None for a streamed draw (whose values exist only inside ``fn``'s calls).

        Raises:
            RuntimeError: the draw was consumed already, or started before a fork.
            ValueError: a streamed draw consumed without ``fn``.
        """
        if not self.usable:
            raise RuntimeError("a noise draw is consumed once, in the process (and source epoch) that started it")
        if self.stream and fn is None:
            raise ValueError("a streamed draw hands its values to fn chunk by chunk; pass fn")
        if self.waiting:  # a deferred or paused early draw: workers join this thread's claims where chunks are left
            self.start(workers=self._helpers())
        self._used = True
        futures, self._futures = self._futures, []
        # workers run only an early draw's job (start asserts it; the job is dropped only here): none to wait for
        # otherwise, and none may still be filling values that are about to be read
        assert self._job is not None or not futures
        flat = self._values
        if self._job is not None:  # an early draw's compiled chunks: this thread takes those no worker has started
            try:
                self._finish_job(futures)
            except BaseException:
                self._drop_job()  # a failed draw keeps no chunk state either (it is never consumed again)
                self._states = []
                raise
        if flat is not None and self._states is None:  # ready-made values
            if fn is not None:
                fn(0, self.n, flat[: self.n])
            return flat
        if flat is not None and fn is None:  # computed, and nothing to hand over: no task per chunk to wait for
            self._states = []  # the chunk generators' secret states are not kept past their use
            return flat
        scratch: dict[int, Tensor] = {}  # per worker thread: one chunk of float64 values, reused

        def finish(i: int) -> None:
            lo = i * NORMAL_CHUNK
            hi = min(self.n, lo + NORMAL_CHUNK)
            if flat is not None:
                z = flat[lo:hi]
            else:
                key = threading.get_ident()
                buf = scratch.get(key)
                if buf is None:
                    buf = scratch[key] = torch.empty(NORMAL_CHUNK, dtype=torch.float64)
                z = self._fill(i, buf, own_place=False)
            if fn is not None:
                fn(lo, hi, z)

        pool = self._source._thread_pool()
        if pool is None or self._k == 1:
            for i in range(self._k):
                finish(i)
        else:
            _wait_all([pool.submit(finish, i) for i in range(self._k)])
        if self._states is not None:
            self._states = []  # the chunk generators' secret states are not kept past their use
        return flat

    def values(self, shape=None, dtype: torch.dtype = torch.float64) -> Tensor:
        """The normals as ``shape`` (default ``[n]``), rounded once to ``dtype``; a fresh tensor
        (never a view that keeps the unused last value of an odd count).

        Raises:
            RuntimeError: as :meth:`consume`. ValueError: ``shape`` does not hold ``n`` values.
        """
        shape = torch.Size((self.n,) if shape is None else shape)
        if shape.numel() != self.n:
            raise ValueError(f"shape {tuple(shape)} does not hold the {self.n} normals drawn")
        if dtype == torch.float64 and self._values is not None and self._values.numel() == self.n:
            return cast(Tensor, self.consume()).view(shape)  # the storage holds exactly the n values
        out = torch.empty(self.n, dtype=dtype)

        def copy(lo: int, hi: int, z: Tensor) -> None:
            out[lo:hi].copy_(z)

        self.consume(copy)
        return out.view(shape)

    def __reduce__(self):
        raise TypeError("a noise draw in progress is never copied or pickled (a copy would replay its noise)")


def spare_core(threads: int) -> bool:
    """Whether this process may run on more CPUs than ``threads`` (``os.sched_getaffinity``, else
    ``os.cpu_count()``): where it may not, an early noise draw's workers wait for the consumer
    (:class:`CpuNormalDraw`, ``defer=None``)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return cpus > threads


def _wait_all(futures: list) -> None:
    """Wait until every chunk's future has finished, then raise the first failure (if any): no chunk of a
    failed draw is still running (writing values, or calling ``fn``) once the error reaches the caller."""
    wait(futures)
    for fut in futures:
        fut.result()


_LIVE: "weakref.WeakSet[NoiseSource]" = weakref.WeakSet()  # every source, for the fork handler


def _reseed_after_fork() -> None:
    """In a forked child: every secret source forgets its generator (the parent's state) and
    re-seeds from OS entropy on its next draw; no source keeps the parent's threads."""
    for src in list(_LIVE):
        src._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reseed_after_fork)


def make_noise_source(
    noise: Optional[NoiseSource] = None, generator: Optional[torch.Generator] = None, secure_mode: bool = False
) -> NoiseSource:
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
