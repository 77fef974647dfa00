"""The Privatizer: the only code in dpopt that touches per-sample data.

Per logical step (Abadi et al. 2016, Algorithm 1; AdaClip: Pichapati et al.
2019, eqs. (6)-(7) of DP-MacAdam (arXiv:2606.05435))::

    w_i   = (g_i − shift) / scale                  # ClipGeometry; identity for DP-SGD
    w̄_i   = w_i · min(1, C / ‖w_i‖)                 # flat; per group k for per-layer
    w̃     = (Σ_i w̄_i + N(0, σ² S² I)) / B̄           # S = C, or √(Σ_k C_k²)
    g̃     = scale ⊙ w̃ + shift                        # released, param-shaped

B̄ is the PUBLIC expected batch size (never the realised one); an empty batch
releases pure noise and is charged like any other step. With quantile clipping
(Andrew et al. 2021, Alg. 1) the Privatizer also releases the centred clipped
count b̃ = (Σ_i (1[‖g_i‖ ≤ C_t] − ½) + N(0, σ_b²)) / B̄ + ½ and sets
C_{t+1} = C_t · exp(−η_C (clamp(b̃, 0, 1) − γ)); both Gaussians are recorded as ONE
composed event of the step.

Everything that leaves this module is a :class:`Release` (public) or a ledger
entry. Per-sample gradients, norms, the realised batch size and the true
count stay here.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import numbers
import warnings
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Callable, Iterable, Optional, Sequence, Union, cast

import torch
from dp_accounting import dp_event
from torch import Tensor

from . import core_loan
from .accounting.events import check_noise_multiplier, check_sample_rate, poisson_composed_step
from .accounting.ledger import LedgerEntry, PrivacyLedger, longest_record
from .correlated_noise import CorrelatedNoise
from .errors import ConfigError, LedgerWriteError
from .kernels import native, numpy_readable
from .noise import CpuNormalDraw, NoiseSource, check_tail_reach, make_noise_source
from .types import ClipGeometry, PerSampleSource

__all__ = [
    "Release",
    "QuantileClipping",
    "Privatizer",
    "EARLY_DRAW_MAX",
    "RELEASE_SPLIT_MIN",
    "add_and_round",
    "clip_factors",
]

#: Relative margin of :func:`clip_factors`' float64 evaluation: 8 units of float64 roundoff, more than the
#: ≤ 3 roundings (√, + γ, ÷) and the margin's own product can move the quotient (module docstring there).
_FACTOR_MARGIN = 1.0 - 8.0 * 2.0**-53


def clip_factors(
    sq: Tensor, bounds: Union[Tensor, Sequence[float], float], gamma: float = 0.0, cap: bool = True
) -> Tensor:
    """Clip factors min(1, C_k/(√sq_i,k + γ)) ``[B, G]``, never above the exact real quotient.

    Args:
        sq: ``[B, G]`` squared norms in the source's compute dtype (float64, float32, bf16, fp16), on any
            device, each never below the exact squared norm ‖w‖² of what the source sums (negative values
            read as 0).
        bounds: the bounds C_k ≥ 0 (each a Python float's exact value, float64): a sequence of ``G`` floats
            (or one float), or a tensor of shape ``[G]`` (or broadcastable against ``[B, G]``) on any device,
            moved to ``sq``'s device and converted to float64 here. Floats cost no device synchronisation
            (their float64 tensors and exact squares are cached per bounds and device); a tensor on an
            accelerator is read back to the host once per call where the exact comparison needs its values
            (``cap`` and γ = 0).
        gamma: γ ≥ 0 added to the norm (AUTO-S, :mod:`dpopt.auto_clipping`); 0 for min(1, C/‖w‖).
        cap: take min(1, ·) (clipping); False for AUTO-S's uncapped C/(‖w‖ + γ).

    Returns:
        ``[B, G]`` in ``sq``'s dtype, on ``sq``'s device, f ≤ min(1, C/(‖w‖ + γ)) (without ``cap``:
        f ≤ C/(‖w‖ + γ)) for the exact ‖w‖: so f·‖w‖ ≤ C holds in real arithmetic, the bound the sensitivity is
        computed from. With ``cap`` and γ = 0, S ≤ C² (compared exactly: the largest float64 ≤ C², from
        :class:`fractions.Fraction`, cached per bounds) gives exactly 1, so an example at the bound is
        not scaled; a zero norm gets 1 (without ``cap`` and γ = 0: C/10⁻³⁰⁰, rounded down into the dtype).

    The quotient is evaluated in float64 from the exact float64 values of ``sq`` and C (√, + γ and ÷:
    three correctly rounded operations, ≤ (1 + u)/(1 − u)² above the real quotient, u = 2⁻⁵³), times
    1 − 8u (:data:`_FACTOR_MARGIN`; with its own rounding the product is below the real quotient), then
    rounded DOWN into ``sq``'s dtype (:func:`_round_down`; a cast would round
    to nearest, up to half an ulp above). With √sq ≥ ‖w‖ this gives f ≤ C/(‖w‖ + γ); the factor is at
    most one ulp of the dtype below the correctly rounded quotient of the given ``sq`` (plus the 8u
    margin), so the only pessimism is the source's own rounding up of ``sq`` (Higham 2002, *Accuracy
    and Stability of Numerical Algorithms*, §2.2: each IEEE operation is exact times (1 + δ), |δ| ≤ u).
    That relative bound holds for NORMAL float64 results only: where the float64 factor is below 2⁻¹⁰²²
    (subnormal; the ÷ and × then round with an absolute error up to 2⁻¹⁰⁷⁵, relatively unbounded), it is
    flushed to 0 (:func:`_flush_subnormal`): 0 is below every real quotient, and a factor under 2.2·10⁻³⁰⁸
    is 0 for every practical purpose (C/‖w‖ that small means a norm ~10³⁰⁸ times C); in float32/bf16/fp16
    such a value rounds down to 0 anyway. Cost: elementwise on ``[B, G]``; on the CPU, for a float32 ``sq``
    with float bounds, ``cap`` and γ = 0, one C pass (``clip_factors32`` in ``src/dpopt/_native.c``: the same
    float64 operations in the same order, IEEE √ and ÷, so the same bits as the torch expression; issue 34,
    docs/performance.md "MLP: the norms' small ops in C").
    """
    if isinstance(bounds, Tensor):
        shape: tuple = tuple(bounds.shape)
        b64 = bounds.detach().to(device=sq.device, dtype=torch.float64)
        values: Optional[tuple] = None
    else:
        seq = [bounds] if isinstance(bounds, (float, int, numbers.Real)) else bounds
        values = tuple(float(c) for c in seq)
        shape = (len(values),)
        b64 = _bounds64(values, sq.device)
    if not gamma and cap and values is not None and _c_factors(sq, len(values)):
        # the same float64 quotient, margin, flush, rounding down and exact comparison in one C pass
        # (clip_factors32, src/dpopt/_native.c: bit-identical to the torch code below, without its ≈ 12 small
        # ops; with two torch threads, torch's float64 sqrt of [B, G] alone cost ≈ 90 µs here)
        out = torch.empty(sq.shape, dtype=torch.float32)
        native.clip_factors32(
            out.numpy(),
            sq.numpy(),
            b64.numpy(),  # the bounds' float64 [G] (CPU: sq's device)
            _squares_down(values, sq.device).numpy(),
            _FACTOR_MARGIN,
        )
        return out
    sq64 = sq.double()
    if gamma or not cap:
        norms = sq64.clamp_min(0).sqrt()
        if gamma:
            norms = norms + float(gamma)
        f = _round_down(_flush_subnormal(b64 / norms.clamp_min(1e-300) * _FACTOR_MARGIN), sq.dtype)
        return f.clamp(max=1.0) if cap else f
    # min(1, C/√S): S ≤ C² (compared exactly; a negative S reads as 0) is exactly 1, not the margin's ulp below;
    # elsewhere C/√S < 1 and f is below it, so no cap is needed. nan stays nan, S = inf gives 0.
    if values is None and b64.device.type == "meta":  # no values to compare (shapes only: meta tensors)
        c2 = b64.square()
    else:
        if values is None:  # a tensor's values (a CPU tensor: no synchronisation)
            values = tuple(cast(Tensor, bounds).detach().double().reshape(-1).tolist())
        c2 = _squares_down(values, sq64.device).reshape(shape)
    f = _round_down(_flush_subnormal(b64 / sq64.sqrt() * _FACTOR_MARGIN), sq.dtype)
    return f.masked_fill_(sq64 <= c2, 1.0)


def _c_factors(sq: Tensor, groups: int) -> bool:
    """:func:`clip_factors` can take the C pass (``clip_factors32``): ``sq`` a plain contiguous float32 CPU
    ``[B, G]`` tensor (G = ``groups``, the bounds' count) that autograd does not record."""
    return numpy_readable(sq, torch.float32) and sq.dim() == 2 and sq.shape[1] == groups


#: The smallest normal float64, 2⁻¹⁰²²: below it a float64 result is subnormal (:func:`_flush_subnormal`).
_FLOAT64_TINY = 2.0**-1022


def _flush_subnormal(x: Tensor) -> Tensor:
    """float64 ``x`` with every value below 2⁻¹⁰²² (subnormal, or negative) set to 0, in place; nan stays nan.

    For :func:`clip_factors` (values ≥ 0): the relative error bound of its float64 evaluation (1 − 8u margin)
    holds for normal results only; a subnormal quotient can be rounded up by as much as 2⁻¹⁰⁷⁵ absolutely,
    far above the margin, so it is replaced by 0, which is below the real quotient. Stepping one ulp toward 0
    (``torch.nextafter``) would not always cover the two roundings (÷ and × margin, each up to half an ulp);
    0 always does, and such a factor (< 2.2·10⁻³⁰⁸) is 0 for every practical purpose.
    """
    return x.masked_fill_(x < _FLOAT64_TINY, 0.0)


def _round_down(x: Tensor, dtype: torch.dtype) -> Tensor:
    """float64 ``x`` in ``dtype``, rounded toward −∞ (a cast rounds to nearest: up to half an ulp above).

    The mirror of :func:`dpopt.engine.shifted_norm.round_up` (kept here: the privacy boundary imports no
    engine). nan stays nan, ±inf stay ±inf; a finite value above ``dtype``'s largest rounds to that
    largest value, not to +inf. float64: ``x`` itself.
    """
    if dtype == torch.float64:
        return x
    down = x.to(dtype)
    return torch.where(down.double() > x, torch.nextafter(down, torch.full_like(down, float("-inf"))), down)


@lru_cache(maxsize=16)
def _bounds64(bounds: tuple, device: torch.device) -> Tensor:
    """The bounds C_k as a float64 ``[G]`` tensor on ``device`` (each float's exact value), cached per bounds and
    device (read only): a step with the same bounds copies nothing to the device, so nothing waits for it."""
    return torch.tensor(bounds, dtype=torch.float64, device=device)


@lru_cache(maxsize=16)
def _squares_down(bounds: tuple, device: torch.device) -> Tensor:
    """The largest float64 ≤ C² for each C (exact, :class:`fractions.Fraction`), float64 ``[G]`` on ``device``:
    S ≤ that ⟺ S ≤ C² for a float S. A bound that is inf or nan gives itself, one whose C² overflows +inf.
    Cached per bounds (read only)."""
    out = []
    for c in bounds:
        if not math.isfinite(c):
            out.append(c)
            continue
        exact = Fraction(c) ** 2
        try:
            f = float(exact)  # correctly rounded (to nearest)
        except OverflowError:  # C² above float64's largest: every float S is below it
            out.append(math.inf)
            continue
        out.append(math.nextafter(f, -math.inf) if Fraction(f) > exact else f)
    return torch.tensor(out, dtype=torch.float64, device=device)


#: The largest gradient-noise draw (normals) computed early, at ``begin()``, into a float64 buffer
#: (32 MiB); a larger model's noise is drawn chunk by chunk at the release and added in place, so
#: that no buffer of all parameters' noise ever exists (issue 43: bytes per block, not per parameter).
EARLY_DRAW_MAX = 1 << 22

_NUMPY_FLOATS = (torch.float32, torch.float64)


#: A parameter's release is split over the noise source's worker threads from this many elements on (below,
#: handing a piece to a thread costs more than it saves); each piece is elementwise, so the values never
#: depend on the number of threads.
RELEASE_SPLIT_MIN = 1 << 17


def add_and_round(
    z: Tensor,
    s: Tensor,
    dtype: torch.dtype,
    into_sum: bool = True,
    scale: float = 1.0,
    divisor: Optional[float] = None,
    pool: Optional[ThreadPoolExecutor] = None,
    workers: Optional[int] = None,
) -> Tensor:
    """``round_dtype(s + scale·z)``: the noisy sum of one parameter, added in float64 and rounded ONCE to
    ``dtype``; with ``divisor``, that rounded sum then divided by ``divisor`` as torch's ``div_`` does it: for
    float32/float64 (the compiled pass) the divisor rounded to ``dtype`` and one correctly rounded division; for
    bf16/fp16 (torch's own ``div_``) the division in float32 with the divisor kept in float32, rounded once to
    ``dtype``.

    Args:
        z: the parameter's float64 noise (param-shaped; σS·z, or z with ``scale`` = σS). May be overwritten
            (the torch fallback adds into it).
        s: the parameter's clipped sum (param-shaped; the Privatizer's own fresh tensor, as
            :meth:`Privatizer._add_noise` requires; float32, float64, or float32 for bf16/fp16 parameters).
        dtype: the released dtype (the parameter's).
        into_sum: the result may overwrite ``s`` (False: ``s`` is left as it is, for a release that
            may still fail and be retried from the same sums).
        scale: the factor of ``z`` (float64; 1.0: ``z`` is already σS·z).
        divisor: if given, B̄: the result is ``round_dtype(s + scale·z) / divisor`` in ``dtype``.
        pool: a ``concurrent.futures.ThreadPoolExecutor`` (the noise source's worker threads): a parameter of at
            least :data:`RELEASE_SPLIT_MIN` elements is split in contiguous pieces, the first computed by the
            calling thread, the others by the pool (or by the calling thread, where no worker has started
            them when it is done with its own; values independent of it). Threads only: each piece writes
            into views of ``s``/``out``, which a process pool would pickle and write in another process, leaving
            the result without its noise.
        workers: at most this many pieces (default ``torch.get_num_threads()``, the number of threads the
            noise source's pool is built with); ignored without ``pool``.

    Returns:
        The rounded noisy sum, param-shaped, in ``dtype``: ``s``'s own storage when ``into_sum`` and ``s``
        is a contiguous CPU tensor of ``dtype``, else a new tensor.

    The values are bit for bit those of ``z.mul_(scale).add_(s).to(dtype)`` (then ``.div_(divisor)``):
    each element of ``s`` is exact in float64, the float64 product and sum round once each (no fused
    multiply-add), the cast rounds once (to nearest, ties to even), all elementwise
    (``tests/core/test_add_and_round.py``, ``tests/core/test_release_kernel.py``). On the CPU, for
    float32/float64 sums and releases, this is one compiled pass (``release`` of :mod:`dpopt.kernels`, C, GIL
    released) that reads ``s`` and ``z`` once and writes the result into ``s`` itself: the product, the add, the cast
    and the division as torch/numpy passes over a whole large parameter cost ≈ 3× as much here
    (docs/performance.md, "MLP: dp-sgd's cost above its floor"). bf16/fp16 releases and other devices
    keep the torch expression.

    Raises:
        TypeError: ``pool`` is not a ``concurrent.futures.ThreadPoolExecutor``.
    """
    if pool is not None and not isinstance(pool, ThreadPoolExecutor):
        raise TypeError(
            f"add_and_round(pool=...) takes a concurrent.futures.ThreadPoolExecutor (the pieces write into views "
            f"of the sum in this process), or None for one pass in the calling thread; got {type(pool).__name__}"
        )
    if (
        z.device.type != "cpu"
        or s.device.type != "cpu"
        or z.dtype != torch.float64
        or s.dtype not in _NUMPY_FLOATS
        or dtype not in _NUMPY_FLOATS
        or not (z.is_contiguous() and s.is_contiguous())
        or z.shape != s.shape
        or s.requires_grad
        or z.requires_grad
    ):
        out = (z.mul_(scale) if scale != 1.0 else z).add_(s).to(dtype)
        return out if divisor is None else out.div_(divisor)
    out = s if s.dtype == dtype and into_sum else torch.empty(s.shape, dtype=dtype)
    n = s.numel()
    if n == 0:
        return out
    o, sn, zn = out.numpy().reshape(-1), s.numpy().reshape(-1), z.numpy().reshape(-1)
    d = float(o.dtype.type(1.0 if divisor is None else divisor))  # rounded to dtype, as torch's div_ does
    most = torch.get_num_threads() if workers is None else int(workers)
    pieces = 1 if pool is None else max(1, min(most, n // RELEASE_SPLIT_MIN))
    cuts = [n * k // max(pieces, 1) for k in range(max(pieces, 1) + 1)]
    # the C pass (dpopt/_native.c): into s itself where out is s (the same elements), else into out
    calls = [(o[lo:hi], sn[lo:hi], zn[lo:hi], float(scale), d, divisor is not None) for lo, hi in zip(cuts, cuts[1:])]
    if pieces <= 1:
        native.release(*calls[0])
        return out
    assert pool is not None
    futures = [pool.submit(native.release, *args) for args in calls[1:]]
    try:
        native.release(*calls[0])  # the calling thread's own piece (one hand-over fewer)
        for fut, args in zip(futures, calls[1:]):
            if fut.cancel():  # a piece no worker has started yet: computed here instead of waited for
                native.release(*args)
    finally:
        futures = [fut for fut in futures if not fut.cancelled()]
        wait(futures)
    for fut in futures:  # every piece has finished before an error (if any) reaches the caller
        fut.result()
    return out


def _extent(t: object) -> Optional[tuple[tuple[str, int], int, int]]:
    """``(device key, first byte, one past the last byte)`` of the memory ``t``'s elements lie in (device key:
    ``(device.type, device.index)``, index −1 where the device has none), or None where there is none to compare
    (not a tensor; no elements; no storage: meta, fake or wrapper-subclass tensors).

    For a contiguous tensor this is exactly its elements' bytes; for a strided one, the span from its
    first to its last element (torch strides are never negative), which also covers the gaps between its
    elements: :func:`_first_overlap` confirms an overlap of such a span element by element
    (:func:`_strided_overlap`).
    """
    if not isinstance(t, Tensor):
        return None
    try:
        start = t.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    if start == 0 or t.is_meta or t.numel() == 0:
        return None
    key = (t.device.type, -1 if t.device.index is None else t.device.index)
    if t.is_contiguous():
        return key, start, start + t.nbytes
    last = sum((k - 1) * st for k, st in zip(t.shape, t.stride()))
    return key, start, start + (last + 1) * t.element_size()


#: The most elements (of each tensor) :func:`_strided_overlap` enumerates; above it, an overlap of spans where
#: one tensor is strided is refused as undetermined.
STRIDED_OVERLAP_MAX = 1 << 20


def _element_offsets(t: Tensor) -> Tensor:
    """int64 ``[numel]``: each element's offset from ``t``'s first, in elements (from its shape and strides
    alone; no data read, on the CPU whatever ``t``'s device)."""
    off = torch.zeros((), dtype=torch.int64)
    for k, st in zip(t.shape, t.stride()):
        off = off.unsqueeze(-1) + torch.arange(k, dtype=torch.int64) * st
    return off.reshape(-1)


def _strided_overlap(a: Tensor, b: Tensor) -> Optional[bool]:
    """Whether some byte of an element of ``a`` is a byte of an element of ``b`` (both on one device, their
    spans overlapping): their elements' addresses (data pointer + strides) enumerated and intersected; None
    (undetermined) where either has more than :data:`STRIDED_OVERLAP_MAX` elements."""
    if a.numel() > STRIDED_OVERLAP_MAX or b.numel() > STRIDED_OVERLAP_MAX:
        return None
    origin = min(a.data_ptr(), b.data_ptr())
    sa, sb = a.element_size(), b.element_size()
    da, db = a.data_ptr() - origin, b.data_ptr() - origin
    if sa == sb and (da - db) % sa == 0:  # one grid of elements: compare element indices
        ia, ib = da // sa + _element_offsets(a), db // sb + _element_offsets(b)
    else:  # compare bytes
        if a.numel() * sa > STRIDED_OVERLAP_MAX or b.numel() * sb > STRIDED_OVERLAP_MAX:
            return None
        ia = (da + _element_offsets(a) * sa).unsqueeze(-1).add(torch.arange(sa)).reshape(-1)
        ib = (db + _element_offsets(b) * sb).unsqueeze(-1).add(torch.arange(sb)).reshape(-1)
    return bool(torch.isin(ia, ib).any())


def _broadcast(t: Tensor) -> bool:
    """Whether ``t`` has a zero stride over a dimension of two or more (an ``expand``): several of its elements
    are one memory location, and torch refuses every in-place write into it (the release, an all-reduce)."""
    return any(st == 0 and k > 1 for k, st in zip(t.shape, t.stride()))


def _first_overlap(fresh: Sequence[object], others: Sequence[object]) -> Optional[tuple[int, int, bool]]:
    """A pair ``(i, j, exact)`` of tensors whose memory overlaps (:func:`_extent`), at least one from ``fresh``:
    indices into ``fresh + others``, the one that starts first (or was listed first) as ``i``; None if no
    such pair. ``exact`` is False where the overlap could not be decided: two spans overlap, one of them
    strided, and there are too many elements to compare (:func:`_strided_overlap`).

    One sort and one sweep over the spans (O(n log n) where spans overlap rarely), each new span compared
    with the still-open ones; no tensor data is read. Contiguous spans that overlap share bytes; where
    either is strided (a column slice of a matrix, an expanded scalar) the elements themselves are compared,
    so disjoint strided views of one buffer (weight and bias sums as column slices of one product) pass.
    Two ``fresh`` tensors that are both broadcast (:func:`_broadcast`: the same expanded zero returned for two
    unused parameters) pass too: nothing can write into either (the release rounds such a sum into a new
    tensor), and within one call neither can have been refilled. Every tensor compared must be alive (its
    memory is then not reused).
    """
    tensors = list(itertools.chain(fresh, others))
    by_device: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for k, t in enumerate(tensors):
        ext = _extent(t)
        if ext is not None:
            by_device.setdefault(ext[0], []).append((ext[1], k, ext[2]))
    mine = len(fresh)
    for spans in by_device.values():
        spans.sort()
        open_all: list[tuple[int, int]] = []  # (end, index) heaps of the spans still open: all / fresh ones
        open_mine: list[tuple[int, int]] = []
        for start, k, end in spans:
            for heap in (open_all, open_mine):
                while heap and heap[0][0] <= start:
                    heapq.heappop(heap)
            for _, j in sorted(open_all if k < mine else open_mine, key=lambda e: e[1]):
                a, b = cast(Tensor, tensors[j]), cast(Tensor, tensors[k])
                if j < mine and k < mine and _broadcast(a) and _broadcast(b):
                    continue  # two sums of one call that nothing can write into (a shared expanded zero)
                if a.is_contiguous() and b.is_contiguous():
                    return j, k, True
                shared = _strided_overlap(a, b)
                if shared is None:
                    return j, k, False
                if shared:
                    return j, k, True
            heapq.heappush(open_all, (end, k))
            if k < mine:
                heapq.heappush(open_mine, (end, k))
    return None


def _track(refs: dict[int, tuple[int, bool, weakref.ref]], i: int, base: bool, t: Tensor) -> None:
    """Keep a weak reference to ``t`` in ``refs`` (keyed by ``id``: one entry per live tensor; an entry whose
    tensor died and whose id was reused is replaced)."""
    old = refs.get(id(t))
    if old is None or old[2]() is not t:
        refs[id(t)] = (i, base, weakref.ref(t))


def _prune(refs: dict[int, tuple[int, bool, weakref.ref]]) -> None:
    """Drop the entries of ``refs`` whose tensor is gone."""
    for key in [key for key, (_, _, ref) in refs.items() if ref() is None]:
        del refs[key]


@dataclass(frozen=True)
class Release:
    """A public, privatized gradient and what is needed to post-process it.

    Attributes:
        grads: privatized gradient g̃, one tensor per parameter (param-shaped).
        noise_std: per-parameter noise std of g̃ in these coordinates
            (σ·S/B̄ times ``scale``): 0-d or param-shaped tensors.
        geometry: the clip geometry used for this step.
        step: 0-based index of the logical step.
        event: the DpEvent recorded in the ledger for this step.
        noise_multiplier: σ of the gradient Gaussian; expected_batch_size: B̄.
        max_grad_norm: the clip bound(s) actually applied (public; adaptive
            bounds are themselves released values).
    """

    grads: tuple[Tensor, ...]
    noise_std: tuple[Tensor, ...]
    geometry: ClipGeometry
    step: int
    event: dp_event.DpEvent
    noise_multiplier: float
    expected_batch_size: float
    max_grad_norm: tuple[float, ...]


@dataclass
class QuantileClipping:
    """Quantile adaptive clipping (Andrew et al. 2021) — config and released state.

    Args:
        count_noise_multiplier: multiplier of the count Gaussian relative to
            the centred count's sensitivity ½, i.e. 2σ_b (σ_b = its std).
        target_quantile: γ, the fraction of unclipped examples aimed at (0.5).
        quantile_lr: η_C of the geometric update (0.2).
        initial_clip: C_0 (defaults to the Privatizer's ``max_grad_norm``).

    Raises:
        ValueError: for a multiplier ≤ 0, γ outside (0, 1) or η_C < 0.
    """

    count_noise_multiplier: float
    target_quantile: float = 0.5
    quantile_lr: float = 0.2
    initial_clip: Optional[float] = None

    def __post_init__(self) -> None:
        self.count_noise_multiplier = check_noise_multiplier(self.count_noise_multiplier, "count_noise_multiplier")
        if self.count_noise_multiplier == 0:
            raise ValueError("count_noise_multiplier must be > 0: the clipped count is a release")
        if not 0.0 < float(self.target_quantile) < 1.0:
            raise ValueError(f"target_quantile must be in (0, 1), got {self.target_quantile}")
        if float(self.quantile_lr) < 0:
            raise ValueError(f"quantile_lr must be >= 0, got {self.quantile_lr}")


def _checked_mechanism(
    mechanism: Optional[CorrelatedNoise], noise_multiplier: float, quantile: Optional[QuantileClipping]
) -> Optional[CorrelatedNoise]:
    """The Privatizer's noise mechanism, or a ConfigError for combinations with no valid accounting."""
    if mechanism is None:
        return None
    if not isinstance(mechanism, CorrelatedNoise):
        raise TypeError(f"mechanism must be a dpopt.correlated_noise.CorrelatedNoise, got {type(mechanism).__name__}")
    if quantile is not None:
        raise ConfigError(
            "correlated noise with quantile (adaptive) clipping is not supported: the noise scale changes with "
            "the released bound, which the matrix-factorization accounting does not cover; use a fixed "
            "max_grad_norm",
            "noise_mechanism",
            "clipping",
        )
    if abs(mechanism.noise_multiplier - noise_multiplier) > 1e-12 * max(1.0, noise_multiplier):
        raise ValueError(
            f"the mechanism was built for noise_multiplier {mechanism.noise_multiplier}, the Privatizer has "
            f"{noise_multiplier}: build it with the same sigma"
        )
    return mechanism


def _write_failed(step: int, correlated: bool, err: OSError) -> tuple[str, str]:
    """(what happened, what to do in a loop that calls ``step()``) of a release whose ledger entry could not be
    written (:class:`~dpopt.errors.LedgerWriteError`'s ``message`` and ``advice``)."""
    what = (
        f"the privacy ledger write of release {step + 1} (1-based) failed: {type(err).__name__}: {err}. Nothing "
        "was released: the parameters are not updated, no noise drawn for it is ever used, and the ledger holds "
        "only the releases made before it, as its journal on disk does."
    )
    if correlated:
        what += (
            " The correlated noise stream did not advance (nothing was drawn from it): release "
            f"{step + 1} is still the next one."
        )
    stream = (
        " Once the cause is fixed, either run the forward and backward "
        "pass of this batch again and call step(), or go on with the loop (make_private's loader releases "
        "this cyclic batch as pure noise, freshly drawn, when the loop takes the next batch or ends its pass). "
        "A correlated-noise run cannot resume from a checkpoint: go on in this process, or start a new run "
        "(docs/correlated-noise.md)."
        if correlated
        else f" Once the cause is fixed, run a forward and backward pass again and call step() (it makes release "
        f"{step + 1}, with fresh noise; this batch may be stepped again), or stop and resume from the last "
        "checkpoint (its ledger and the journal hold every release made)."
    )
    advice = (
        "This step's per-sample gradients were dropped with it, so a step() without a new backward pass cannot "
        "retry it. Free space on the journal's disk or make its file writable." + stream
    )
    return what, advice


class Privatizer:
    """Clip, sum, noise and release per-sample gradients; record every release.

    Args:
        noise_multiplier: σ of the gradient release (noise std = σ × sensitivity).
        max_grad_norm: flat clip bound C (in w-space when a geometry is used),
            or a sequence of per-group bounds C_k for per-layer clipping.
        expected_batch_size: B̄ = q·N, the public denominator.
        sample_rate: Poisson sampling rate q (public), recorded in each event.
        ledger: where every release is recorded (a new one if omitted).
        groups: for per-layer clipping, the group index of each parameter
            (``len(groups)`` = number of parameters; values in range(len(C_k))).
        quantile: a :class:`QuantileClipping` to adapt a flat C every step.
        noise: the :class:`~dpopt.noise.NoiseSource` of every Gaussian drawn
            (default: a secret one, seeded from OS entropy and never written).
        generator: a seeded ``torch.Generator`` — makes the noise
            REPRODUCIBLE (research reruns only; the ledger records it and
            ``dpopt check`` fails it).
        secure_mode: draw the noise from the OS CSPRNG (:mod:`dpopt.noise`).
        reduce: data-parallel training only (:mod:`dpopt.distributed`): a
            callable ``reduce(sums, count, draw) -> (noisy_sums, noisy_count)``
            called once per step between the local clipped sums and the
            release. ``sums`` are this process's clipped sums (w-space),
            ``count`` its centred clipped count (None without quantile
            clipping), ``draw()`` draws the step's noise from this Privatizer's
            source in the single-process order (gradient noise per parameter,
            already × σS, then the count noise, already × σ_b). It must return
            the noisy totals over all processes, identical everywhere, with
            the noise drawn ONCE (e.g. by rank 0) — never once per process.
            None (default): the local sums are the totals and the noise is
            added here, as always. A hook whose ``correlates_own_noise``
            attribute is true (FSDP, :class:`dpopt.fsdp.ShardedRelease`) gets,
            with a correlated-noise ``mechanism``, the FRESH σS·z from
            ``draw()`` (float64, neither correlated nor rounded) and applies
            the mechanism itself to the coordinates it adds noise to (each
            rank the stream of its own shard). A hook with an
            ``any_rank(flag: bool) -> bool`` method (a collective: True on every
            rank if ``flag`` is True on any; both of dpopt's hooks have one) is
            asked before each release whether any rank failed to record its
            ledger entry, so that no rank releases and none waits in the
            reduce, unless its ``agree_records`` attribute is False (a caller
            whose records never write, as ``dpopt train``'s); a hook without
            it gets no such agreement (a failed write on one rank then leaves
            the others waiting in ``reduce``).
        mechanism: a :class:`~dpopt.correlated_noise.CorrelatedNoise` (DP
            matrix factorization): the step's fresh σS·z becomes the correlated
            noise (C⁻¹z)_t before it is added; the ledger records the
            mechanism in its header and each release's share of its Gaussian.
            None (default): independent noise.

    Raises:
        ValueError: invalid σ, q, B̄, bounds or group indices (messages say
            which value to change); more than one of ``noise``,
            ``generator``, ``secure_mode``; a ConfigError for 0 < σ (σ/Δ with
            a mechanism, or the count's multiplier) < 0.0383, which the
            sampler's tail cannot serve (:func:`dpopt.noise.check_tail_reach`;
            :meth:`release` checks σ again, as it is settable).

    The ledger's header records the noise mode (``ledger.mark_noise``).
    """

    def __init__(
        self,
        noise_multiplier: float,
        max_grad_norm: Union[float, Sequence[float]],
        expected_batch_size: float,
        sample_rate: float,
        ledger: Optional[PrivacyLedger] = None,
        groups: Optional[Sequence[int]] = None,
        quantile: Optional[QuantileClipping] = None,
        generator: Optional[torch.Generator] = None,
        secure_mode: bool = False,
        noise: Optional[NoiseSource] = None,
        reduce: Optional[Callable] = None,
        mechanism: Optional[CorrelatedNoise] = None,
    ):
        self.reduce = reduce
        self.noise_multiplier = check_noise_multiplier(noise_multiplier)
        self.sample_rate = check_sample_rate(sample_rate)
        self.expected_batch_size = float(expected_batch_size)
        if not self.expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size}")
        scalar = isinstance(max_grad_norm, numbers.Real) or getattr(max_grad_norm, "ndim", None) == 0
        try:
            bounds = [float(c) for c in ([max_grad_norm] if scalar else list(max_grad_norm))]  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(
                f"max_grad_norm must be a number or a list of per-group numbers, got {max_grad_norm!r}"
            ) from None
        if not bounds or any(not (c > 0) or math.isnan(c) for c in bounds):
            raise ValueError(f"max_grad_norm must be > 0 (per group), got {max_grad_norm!r}")
        if self.noise_multiplier > 0 and not all(math.isfinite(c) for c in bounds):
            raise ConfigError(
                f"max_grad_norm must be finite when noise_multiplier > 0 (the noise std is "
                f"noise_multiplier × max_grad_norm), got {max_grad_norm!r}; an infinite bound "
                "is only meaningful with noise_multiplier = 0 (non-private reference runs)",
                "max_grad_norm",
                "noise_multiplier",
            )
        self.bounds = bounds
        self.groups = None if groups is None else [int(g) for g in groups]
        if self.groups is not None and (min(self.groups) < 0 or max(self.groups) >= len(bounds)):
            raise ValueError(f"group indices must lie in range({len(bounds)}) (one bound per group)")
        if self.groups is None and len(bounds) > 1:
            raise ValueError("per-group bounds need `groups` (the group index of each parameter)")
        if quantile is not None and len(bounds) > 1:
            raise ValueError("quantile clipping adapts one flat bound; use a single max_grad_norm")
        self.quantile = quantile
        self.mechanism = _checked_mechanism(mechanism, self.noise_multiplier, quantile)
        self.check_reach(self.noise_multiplier)
        if quantile is not None:
            check_tail_reach(quantile.count_noise_multiplier, "count_noise_multiplier")
        if quantile is not None:
            self.bounds = [float(quantile.initial_clip or bounds[0])]
        self.clip_history: list[float] = []  # released: the bound applied at each step (quantile)
        self.ledger = ledger if ledger is not None else PrivacyLedger()
        self.noise = make_noise_source(noise, generator, secure_mode)
        self.ledger.mark_noise(self.noise.mode)
        if self.mechanism is not None:
            if len(self.ledger) or self.ledger.mechanism is not None:
                raise ConfigError(
                    "correlated noise is accounted as ONE mechanism over the whole ledger: it needs a fresh "
                    f"ledger, but this one already holds {len(self.ledger)} releases"
                    + (" and a mechanism" if self.ledger.mechanism is not None else "")
                    + " (use a new PrivacyEngine / ledger)",
                    "noise_mechanism",
                )
            self.ledger.mechanism = self.mechanism.record()
            self.ledger.sampling = self.mechanism.sampling
        self.steps = 0
        self.reads = 0  # private statistics computed (gradient sums, counts)
        self.releases = 0  # noisy Gaussians released (and recorded)
        # PRIVATE diagnostic, kept in memory only (never written or printed by dpopt): steps in which
        # some example's per-sample gradient was non-finite (zeroed before clipping). Its value depends
        # on single examples without noise: publishing it is a membership test.
        self.nonfinite_steps = 0
        self._expect = 0  # normals the last CPU release drew (what begin() pre-draws for the next step)
        # id -> (index, is its _base, weakref) of the still-live sums weighted_sum returned in the previous step
        # and this one (one entry per tensor; dead ones pruned at each check and at begin(): _check_fresh)
        self._issued: deque[dict[int, tuple[int, bool, weakref.ref]]] = deque([{}], maxlen=2)
        self._reset()

    # -- public, derived ----------------------------------------------------
    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped sum: C, or √(Σ_k C_k²) for per-group bounds."""
        return float(math.sqrt(sum(c * c for c in self.bounds)))

    @property
    def max_grad_norm(self) -> float:
        """The current flat bound (adapted by quantile clipping), or the total bound."""
        return self.bounds[0] if len(self.bounds) == 1 else self.sensitivity

    def step_event(self) -> dp_event.DpEvent:
        """The DpEvent one step of this Privatizer records (built in accounting.events; with correlated
        noise, the next release's share of the mechanism's one Gaussian, :mod:`dpopt.correlated_noise`)."""
        if self.mechanism is not None:
            return self.mechanism.step_event(self.steps)
        sigmas = [self.noise_multiplier]
        if self.quantile is not None:
            sigmas.append(self.quantile.count_noise_multiplier)
        return poisson_composed_step(sigmas, self.sample_rate)

    # -- one logical step ---------------------------------------------------
    def _reset(self) -> None:
        """End the open step (released, or discarded: nothing released). A discarded step whose entry was
        written ahead (:meth:`release` raised after it) keeps its index used: the ledger charges it."""
        if getattr(self, "_entry", None) is not None:
            self.steps += 1
        self._entry: Optional[LedgerEntry] = None  # this step's entry, once written (write-ahead)
        self._entry_meta: dict = {}  # the settings it was written with (a retried release must match them)
        self._geometry: Optional[ClipGeometry] = None
        self._sum: Optional[list[Tensor]] = None
        self._dtypes: Optional[list[torch.dtype]] = None  # the release's dtype per parameter (_released_dtypes)
        self._count = 0.0
        self._nonfinite = False
        self._read: set[str] = set()  # private statistics computed this step (counted where read)
        self._pending: Optional[CpuNormalDraw] = None  # this step's CPU noise draw, started early
        self._divided = False  # _add_noise returned its totals already ÷ B̄ (add_and_round's divisor)

    def __getstate__(self) -> dict:
        """Copies and pickles never carry a noise draw in progress (a copy would replay it)."""
        state = dict(self.__dict__)
        state["_pending"] = None
        state.pop("_unapplied", None)
        state["_issued"] = deque([{}], maxlen=2)  # weak references: not picklable, and the copy's own sums differ
        return state

    def check_reach(self, noise_multiplier: float) -> None:
        """Refuse a gradient σ the Gaussian sampler's tail cannot serve (:func:`dpopt.noise.check_tail_reach`):
        σ, or σ/Δ with a correlated-noise mechanism (the Gaussian mechanism on C·x has sensitivity Δ·C).

        Raises:
            ConfigError: 0 < σ (/Δ) < :data:`dpopt.noise.MIN_NOISE_MULTIPLIER`.
        """
        if self.mechanism is None:
            check_tail_reach(noise_multiplier)
        else:
            delta = self.mechanism.sensitivity
            check_tail_reach(noise_multiplier / delta, per=f" / sensitivity {delta:.4g}")

    def begin(self, geometry: Optional[ClipGeometry] = None) -> None:
        """Start a logical step in the given clip geometry (identity if None)."""
        if self._geometry is not None:
            raise RuntimeError("begin() called twice without release(); one release per step")
        self._geometry = geometry or ClipGeometry()
        issued = self._issued_refs()  # weak references to this step's sums (the previous step's stay: maxlen 2)
        _prune(issued[-1])
        issued.append({})
        if self._expect and self.noise.mode != "reproducible":  # a secret draw may start before the release
            self._prefetch(self._expect)

    def _prefetch(self, numel: int) -> None:
        """Start this step's gradient noise draw (CPU) now: its chunks are computed in the noise
        source's worker threads — while the per-sample work goes on where a core is spare beside
        torch's threads, else beside the consumer (:meth:`dpopt.noise.NoiseSource.start_normal`'s
        ``defer``) — and :meth:`release` consumes it.

        Only the time of the draw moves, never its values: the draw takes its words from the noise
        source here, so this is done only where nothing else can draw from that source before the
        release — in :meth:`privatize` (one call from begin to release), or for secret and secure
        noise, whose stream order no one can replay anyway. A draw that is not consumed (the step
        failed, or the release needs another size) is dropped, never reused.
        """
        if 0 < numel <= EARLY_DRAW_MAX and self.noise_multiplier > 0 and self.reduce is None and self._pending is None:
            self._pending = self.noise.start_normal(numel)

    def _loanable(self, params_like: Optional[Sequence[Tensor]]) -> Optional[CpuNormalDraw]:
        """The early draw a core may be lent to (:mod:`dpopt.core_loan`): this step's, of the parameters' size
        (a draw made at :meth:`begin` for the previous step's size, which the release will drop, is not)."""
        draw = self._pending
        if draw is None or (params_like is not None and draw.n != sum(p.numel() for p in params_like)):
            return None
        return draw

    def accumulate(self, source: PerSampleSource) -> None:
        """Clip and add one micro-batch of per-sample gradients.

        ``source`` is a :class:`~dpopt.types.PerSampleSource`: this reads its
        ``num_params``, ``sq_norms(geometry, groups, G) -> [B, G]``,
        ``weighted_sum(weights[B, G], geometry, groups) -> list[Tensor]`` and
        (if present) ``nonfinite``
        (e.g. :class:`~dpopt.engine.reference.PerSampleGrads`).

        Raises:
            RuntimeError: no :meth:`begin` before it.
            ValueError: ``weighted_sum`` returned tensors that are not fresh (:meth:`_check_fresh`); the step
                is discarded, nothing of it released or recorded, and :meth:`begin` starts the next.
        """
        if self._geometry is None:
            raise RuntimeError("call begin() before accumulate()")
        groups = self.groups if self.groups is not None else [0] * source.num_params
        sq = source.sq_norms(self._geometry, groups, len(self.bounds))
        values = tuple(float(c) for c in self.bounds)  # C_k exactly (Python floats: no device copy or read-back)
        weights = self._clip_weights(sq, values)
        if self.quantile is not None:
            # the clip decision's own comparison (clip_factors): S ≤ C² exactly ⟺ S ≤ the largest float64 ≤ C²
            # (a √S rounded to nearest could read an example just above C as unclipped, or the reverse)
            c2 = _squares_down(values[:1], sq.device)[0]
            self._count += float(((sq[:, 0].double() <= c2).double() - 0.5).sum())
            self._read.add("clipped_count")
        part = source.weighted_sum(weights, self._geometry, groups)
        try:
            self._check_fresh(part, source)
        except ValueError:
            self._reset()  # the step is discarded (nothing released or recorded): begin() starts the next
            raise
        self._dtypes = self._dtypes or _released_dtypes(source, part)
        self._read.add("gradient_sum")
        self._sum = part if self._sum is None else [a + b for a, b in zip(self._sum, part)]
        self._nonfinite |= bool(getattr(source, "nonfinite", 0))

    def _issued_refs(self) -> deque:
        """The weak references :meth:`_check_fresh` keeps (a Privatizer pickled before they existed gets new)."""
        issued = self.__dict__.get("_issued")
        if issued is None:
            issued = self.__dict__["_issued"] = deque([{}], maxlen=2)
        return issued

    def _check_fresh(self, part: Sequence[Tensor], source: PerSampleSource) -> None:
        """Refuse sums from ``weighted_sum`` that share memory with each other, with a tensor the source
        returned earlier in this step or the previous one that is still alive, or with one of the source's
        ``params`` or their ``.grad``.

        The release adds the noise into the sums in place and hands them out as the released gradient
        (:func:`add_and_round`, :meth:`_add_noise`), so a sum must be a fresh tensor the Privatizer owns
        (:class:`~dpopt.types.PerSampleSource`): a buffer the source keeps and fills again turns an
        earlier release into the next step's clipped sum WITHOUT noise (and a buffer returned for two
        micro-batches of one step would count the second twice: sensitivity 2C), a tensor returned for two
        parameters would get both noises, a parameter would be overwritten. This check runs AFTER
        ``weighted_sum`` returned: a source that refilled a kept buffer has already overwritten the previous
        step's release (the released gradient, and ``p.grad`` where it was written there) with a noiseless
        clipped sum; the refusal stops this step, and those earlier gradients must be discarded. The test
        compares byte ranges of live tensors (:func:`_first_overlap`; weak references to the earlier sums and
        their ``_base``, one per tensor, so nothing is kept alive; the dead ones are dropped at each check and
        at :meth:`begin`, so the check costs O(live sums + params) per micro-batch, not O(micro-batches)):
        exact for contiguous tensors, the ones the release writes into, and for strided ones by their
        elements (:func:`_first_overlap`).

        Raises:
            ValueError: a sum overlaps one of those tensors (nothing of the step is released;
                :meth:`accumulate` discards the step).
        """
        issued = self._issued_refs()
        labels: list[tuple] = []  # of ``others``: what the message names them by (formatted only there)
        others: list[Tensor] = []
        for step, refs in zip(("the previous step", "this step")[-len(issued) :], issued):
            _prune(refs)
            for i, base, ref in refs.values():
                t = ref()
                if t is not None:  # (alive when pruned; a tensor dying since is simply not compared)
                    others.append(t)
                    labels.append((i, base, step))
        for i, p in enumerate(getattr(source, "params", None) or ()):
            others.append(p)
            labels.append((i, ""))
            if isinstance(p, Tensor) and p.grad is not None:
                others.append(p.grad)
                labels.append((i, ".grad"))
        pair = _first_overlap(part, others)
        if pair is not None:
            names = [f"weighted_sum()[{i}]" for i in range(len(part))] + [
                f"params[{x[0]}]{x[1]}"
                if len(x) == 2
                else f"weighted_sum()[{x[0]}]{' (its base)' * x[1]} (returned in {x[2]})"
                for x in labels
            ]
            if not pair[2]:
                raise ValueError(
                    f"{type(source).__name__}.weighted_sum returned a strided tensor whose span overlaps another's "
                    f"({names[pair[0]]} and {names[pair[1]]}) and that is too large to compare element by element: "
                    "strided sums sharing a buffer are refused; return a fresh contiguous tensor per parameter "
                    "(t.contiguous() of a slice of a fresh buffer, or t.clone()) — see dpopt.types.PerSampleSource"
                )
            raise ValueError(
                f"{type(source).__name__}.weighted_sum returned a tensor that shares memory with another "
                f"({names[pair[0]]} and {names[pair[1]]}): the release adds the noise into the sums in place and "
                "hands them out as the released gradient, so weighted_sum must return a fresh tensor per "
                "parameter (not a buffer it keeps or fills again, not one tensor twice, not a parameter or its "
                ".grad); return copies (t.clone()) — see dpopt.types.PerSampleSource. If it refilled a buffer "
                "returned in the previous step, that step's released gradient (its Release and any p.grad "
                "written from it) now holds a clipped sum WITHOUT noise: discard it, do not apply or publish it"
            )
        mine = issued[-1]
        for i, t in enumerate(part):
            if isinstance(t, Tensor):
                _track(mine, i, False, t)
                if t._base is not None:
                    _track(mine, i, True, t._base)

    def _clip_weights(self, sq: Tensor, bounds: Union[Tensor, Sequence[float]]) -> Tensor:
        """Per-example, per-group weights ``[B, G]`` of the clipped sum: min(1, C_k/‖w_i,k‖), rounded down.

        Args:
            sq: ``[B, G]`` squared norms from the source's ``sq_norms`` (its compute dtype), each never
                below the exact ‖w_i,k‖² (:class:`~dpopt.types.PerSampleSource`).
            bounds: the bounds C_k exactly as the sensitivity uses them: :meth:`accumulate` passes ``G`` Python
                floats (no device value is read back); a tensor ``[G]`` works too (:func:`clip_factors`).

        Returns:
            ``[B, G]`` in ``sq``'s dtype (:func:`clip_factors`): weight·‖w_i,k‖ ≤ C_k holds for the exact
            real norm, whatever the rounding of the square root and the division.

        The one place the clip rule lives; a subclass that changes it (automatic clipping,
        :class:`dpopt.auto_clipping.AutoClipPrivatizer`) must keep every weighted example's
        norm ≤ C_k, the bound the sensitivity is computed from (use :func:`clip_factors` with ``bounds``).
        """
        return clip_factors(sq, bounds)

    def _clip_meta(self) -> dict:
        """Public facts of the clip rule recorded with every release (none for min(1, C/‖w‖))."""
        return {}

    @torch.no_grad()  # a release is public data: it never carries autograd history, whatever its sums were
    def release(self, params_like: Optional[Sequence[Tensor]] = None) -> Release:
        """Add noise, divide by B̄, map back, record the step; return the Release.

        ``params_like`` gives shapes when no micro-batch was accumulated, and the dtype of each released
        gradient (without it: the sources' parameters', :meth:`_release_dtypes`): the sums (float32 for
        bf16/fp16 parameters, :func:`~dpopt.engine.layers.compute_dtype`) plus the float64 noise are
        rounded ONCE to the parameter's dtype, after the noise (post-processing of the noisy release;
        then ÷ B̄ in that dtype, as for any dtype: per coordinate ≤ 2u + u² relative, u = 2⁻⁸ for bf16 —
        docs/architecture.md, "Mixed precision"). The data-parallel ``reduce`` hook all-reduces in the
        sums' dtype; its totals are rounded to the parameters' dtype after it.

        The ledger is write-ahead: the step's entry is recorded (and, with an autoflushed journal,
        written: :meth:`~dpopt.accounting.ledger.PrivacyLedger.record`) BEFORE any noise is drawn —
        with quantile clipping, whose entry holds the noisy count, after drawing but before anything
        (the next bound, the Release) leaves this method. A write that fails releases nothing: the
        ledger, the clip bound and a correlated-noise stream are as before (nothing was drawn from
        the stream; quantile clipping's draw is discarded, never used again), and the step stays
        open: ``release()`` again retries it, with fresh noise; ``_reset()`` (the optimizers, on
        any failed release) discards it.

        A release that raises after its entry was written (drawing the noise) keeps that entry for
        the open step: a retried ``release()`` does not record it twice, and a step discarded
        instead keeps its index used (the ledger charges it: ε over-counts, never under-counts).

        Raises:
            LedgerWriteError: the entry could not be written (:class:`dpopt.errors.LedgerWriteError`:
                its cause, that nothing was released, what to do).
            RuntimeError: no ``begin()``; nothing accumulated and no ``params_like``; a correlated-noise
                step past the horizon, or a stream that is not at this release (checked before the entry
                is written).
        """
        if self._geometry is None:
            raise RuntimeError("call begin() before release()")
        self.check_reach(self.noise_multiplier)  # σ is settable (schedulers): checked before anything is drawn
        if self._sum is None:
            if params_like is None:
                raise RuntimeError("nothing accumulated: pass params_like for an empty step")
            self._sum = [torch.zeros_like(p) for p in params_like]  # the sums over zero examples
            self._read.update(["gradient_sum"] + (["clipped_count"] if self.quantile is not None else []))
        geo, bbar, sens = self._geometry, self.expected_batch_size, self.sensitivity
        std = self.noise_multiplier * sens
        marginal = 1.0 if self.mechanism is None else self.mechanism.marginal_std(self.steps)  # std of (C⁻¹z)_t
        count = self._count if self.quantile is not None else None
        meta = {
            "max_grad_norm": list(self.bounds),
            "sensitivity": sens,
            "noise_multiplier": self.noise_multiplier,
            "noise_std": std,
            "geometry": "identity" if geo.is_identity else "shift-scale",
            **self._clip_meta(),
        }
        if self.mechanism is not None:
            self.mechanism.check_position(self.steps, self.reduce is None)  # refused before it is charged
            meta.update(mechanism=self.mechanism.kind, mechanism_sensitivity=float(self.mechanism.prefix[self.steps]))
        if self.quantile is None and self._entry is None:  # write-ahead: on record before any noise is drawn
            self._entry_meta = dict(meta)
            self._entry = self._agreed_record(meta, released=1)
        elif self._entry is not None and meta != self._entry_meta:  # a retry must be the release on record
            raise RuntimeError(
                f"release {self.steps + 1} (1-based) is on record with {self._entry_meta}, but its retry would "
                f"release with {meta} (sigma or the clip bound changed since): discard the step (_reset(); it "
                "stays charged) or set them back"
            )
        elif self._entry is not None:  # a retry whose entry is on record here: still agreed with the other ranks
            self._agreed_record(meta, released=1, record=False)
        dtypes = self._release_dtypes(params_like)
        self._divided = False
        totals, noisy_count = self._noisy_totals(std, count, dtypes)
        divided, self._divided = self._divided, False  # _add_noise divided by B̄ in its pass (add_and_round)
        grads, noise_std = [], []
        for i, s in enumerate(self._sum):
            g = totals[i].to(dtypes[i])  # a no-op but after the reduce hook
            if not divided:
                g = g.div_(bbar)  # the totals are fresh buffers owned here
            coord_std = torch.tensor(std * marginal / bbar, dtype=g.dtype, device=s.device)
            if geo.scale is not None:
                g.mul_(geo.scale[i])
                coord_std = coord_std * geo.scale[i]
            if geo.shift is not None:
                g.add_(geo.shift[i])
            grads.append(g)
            noise_std.append(coord_std)
        if self.quantile is not None:  # the entry holds the noisy count: recorded before the next bound is used
            bounds, history = list(self.bounds), len(self.clip_history)
            meta.update(self._release_count(cast(float, noisy_count)))
            try:
                self._entry = self._agreed_record(meta, released=2)
            except BaseException:  # nothing released: the bound is not adapted from an unrecorded count
                self.bounds, self.clip_history[history:] = bounds, []
                raise
        entry, self._entry = cast(LedgerEntry, self._entry), None
        release = Release(
            tuple(grads),
            tuple(noise_std),
            geo,
            self.steps,
            entry.event,
            self.noise_multiplier,
            bbar,
            tuple(cast(Sequence[float], meta["max_grad_norm"])),
        )
        self.nonfinite_steps += int(self._nonfinite)
        self.steps += 1
        self._reset()
        return release

    def _noisy_totals(
        self, std: float, count: Optional[float], dtypes: Sequence[torch.dtype]
    ) -> tuple[list[Tensor], Optional[float]]:
        """The noisy sums (param-shaped, fresh buffers) and the noisy centred count (quantile; else None)."""
        assert self._sum is not None  # inside a step
        if self.reduce is not None:  # data parallel: the noisy totals over every process
            own = self.mechanism is not None and bool(getattr(self.reduce, "correlates_own_noise", False))
            return self.reduce(  # own: the hook streams the noise of the coordinates it owns (FSDP)
                list(self._sum), count, lambda: self._draw(std, rounded=not own, correlated=not own)
            )
        totals, count_noise = self._add_noise(std, dtypes)  # s + σS·z in float64, rounded ONCE to the param's dtype
        return totals, None if count is None else count + cast(float, count_noise)  # quantile: drawn

    def _record(self, meta: dict, released: int) -> LedgerEntry:
        """Record this step's entry in the ledger (``meta`` + its read count and ``released``, the number of
        Gaussians released: 1, 2 with quantile clipping's count) and count it.

        Raises:
            LedgerWriteError: the ledger's journal write failed (the ledger is as before; nothing counted).
        """
        meta.update(reads=len(self._read), releases=released)
        try:
            entry = self.ledger.record(self.steps, self.step_event(), **meta)
        except OSError as err:
            what, advice = _write_failed(self.steps, self.mechanism is not None, err)
            raise LedgerWriteError(what, err, advice) from err
        self.reads += len(self._read)
        self.releases += released
        return entry

    def _agreed_record(self, meta: dict, released: int, record: bool = True) -> LedgerEntry:
        """:meth:`_record`, agreed over the data-parallel ranks (a ``reduce`` hook with ``any_rank``: one
        all-reduce of one number) before anything is drawn, summed or released: a write that failed on ONE
        rank (usually rank 0, the one with a journal) stops the release on EVERY rank, none left waiting in
        the reduce. A rank whose own record succeeded takes its entry back
        (``PrivacyLedger._withdraw_last``: it was in memory only), so every
        rank's ledger, counters and step index stay as before; an entry already in that rank's own journal
        is kept as the open step's (a retried ``release()`` does not record it again).

        ``record=False``: a retry whose entry is already this rank's (``self._entry``): agreed only.

        Raises:
            LedgerWriteError: this rank's write failed (its own), or another rank's did.
        """
        entry, failed = self._entry, None
        try:
            if record:
                entry = self._record(meta, released)
        except BaseException as err:  # any failure (not only a full disk): agreed, so no other rank waits in the reduce
            failed = err
        agree = getattr(self.reduce, "any_rank", None) if getattr(self.reduce, "agree_records", True) else None
        if agree is not None and agree(failed is not None) and failed is None:
            if record and self.ledger._withdraw_last():
                self.reads -= int(meta["reads"])
                self.releases -= released
            elif (
                record and released == 1
            ):  # in this rank's own journal: the open step's entry (a retry skips the record)
                self._entry = entry
            raise LedgerWriteError(
                f"release {self.steps + 1} (1-based) was not made on any data-parallel rank: another rank could "
                "not write its ledger entry (its error says why: disk full, ...). "
                + ("No noise was drawn and " if released == 1 else "The step's noisy count is discarded and ")
                + "nothing was released: the parameters are unchanged on every rank.",
                advice="Free the space that rank writes to, then take the step again on every rank, or stop the run",
            )
        if failed is not None:
            raise failed
        return cast(LedgerEntry, entry)

    def _draw(
        self, std: float, rounded: bool = False, correlated: bool = True, scaled: bool = True
    ) -> tuple[list[Tensor], Optional[float]]:
        """The step's noise, the one place it is drawn: σS·z per parameter (zeros, nothing drawn,
        when σS = 0), then the count's σ_b·z (quantile clipping; None otherwise).

        ``scaled=False`` (:meth:`_add_noise`, for σS > 0 without a correlated mechanism): z itself, float64,
        which the caller multiplies by σS inside its one pass (:func:`add_and_round`'s ``scale``; the same
        float64 product). The multiplier this call did NOT apply (σS for ``scaled=False``, else 1) is left in
        ``self._unapplied``, and :meth:`_add_noise` scales by that, never by what it asked for: a wrapper of
        this seam that drops the keyword gets σS·z and a pass scaled by 1 (the same bits), not σS²·z. Everything
        a wrapper does to the returned tensors (the audit's mutants: ×0.5, ÷ B̄, bf16) reaches the released
        noise scaled by σS the same way.

        The gradient noise is ONE float64 draw per device (z from
        :meth:`~dpopt.noise.NoiseSource.normal`, in parameter order, scaled in float64) split
        into per-parameter views, so that :meth:`release` adds it to the clipped sum in float64
        and rounds the noisy sum once to the parameter dtype. ``rounded=True`` (the data-parallel ``reduce`` hook, whose
        all-reduce works in the sums' dtype) rounds σS·z to each sum's dtype instead. ``correlated=False``
        (a ``reduce`` hook that streams the correlated noise of its own coordinates, FSDP) returns the fresh
        σS·z without applying the mechanism.
        """
        assert self._sum is not None  # inside a step (begin() ran)
        grad_noise: list[Optional[Tensor]] = [None] * len(self._sum)
        by_device: dict[torch.device, list[int]] = {}
        for i, s in enumerate(self._sum):
            by_device.setdefault(s.device, []).append(i)
        applied = scaled or rounded or (self.mechanism is not None and correlated) or not std > 0
        self._unapplied = 1.0 if applied else std  # what the caller must still multiply by (_add_noise)
        for device, idx in by_device.items():  # one draw per device (in parameter order), split per parameter
            if std > 0:
                flat = self._normals(sum(self._sum[i].numel() for i in idx), device)
                if applied:
                    flat = flat.mul_(std)
                if self.mechanism is not None and correlated:  # (C⁻¹ σS·z)_t, streamed (dpopt.correlated_noise)
                    flat = self.mechanism.correlate(flat, self.steps, str(device))
                for i, z in zip(idx, flat.split([self._sum[i].numel() for i in idx])):
                    s = self._sum[i]
                    grad_noise[i] = z.to(s.dtype).view(s.shape) if rounded else z.view(s.shape)
            else:
                for i in idx:
                    s = self._sum[i]
                    grad_noise[i] = torch.zeros_like(s, dtype=s.dtype if rounded else torch.float64)
        return cast(list[Tensor], grad_noise), self._count_noise()  # every entry set above

    def _release_dtypes(self, params_like: Optional[Sequence[Tensor]]) -> list[torch.dtype]:
        """The dtype each released gradient is rounded to: ``params_like``'s, else the sources' (:func:`_released_dtypes`)."""
        assert self._sum is not None  # inside release()
        if params_like is not None:
            return [p.dtype for p in params_like]
        return self._dtypes if self._dtypes is not None else [s.dtype for s in self._sum]

    def _add_noise(self, std: float, dtypes: Sequence[torch.dtype]) -> tuple[list[Tensor], Optional[float]]:
        """The noisy sums ``round_dtype(s + σS·z)`` (z in float64, the sum of both in float64, rounded
        once to ``dtypes[i]``, the parameter's: bf16 for a float32 sum of bf16 parameters) and the count's
        noise (:meth:`_count_noise`, drawn after the gradient noise).

        Up to :data:`EARLY_DRAW_MAX` parameters (or off the CPU, or σS = 0, or correlated noise, whose
        stream correlates whole draws): :meth:`_draw`'s float64
        noise — the one noise seam the audit's mutants wrap; z unscaled when there is no correlated
        mechanism — multiplied by σS, added, rounded once and divided by B̄ in one compiled pass per
        parameter (:func:`add_and_round`; the totals come back already ÷ B̄, which :meth:`release`
        reads from ``self._divided``). A larger model on
        the CPU streams its draw (issue 43): the noise is added where the sums are, chunk by chunk as
        :class:`~dpopt.noise.CpuNormalDraw` hands the chunks over (in the noise workers), and each
        chunk is rounded into the sum's own storage, so no buffer of all parameters' noise (nor a
        second copy of the sums) ever exists (a sum in another dtype than its parameter's is rounded
        into a new buffer of the parameter's dtype); the values are bit for bit those of :meth:`_draw`'s
        path (``tests/core/test_noise_stream.py``). The sums are the Privatizer's own (fresh tensors
        from ``weighted_sum`` or its additions).
        """
        assert self._sum is not None  # inside a step (begin() ran)
        sizes = [s.numel() for s in self._sum]
        n = sum(sizes)
        streamed = std > 0 and n > EARLY_DRAW_MAX and self.mechanism is None  # σS may be nan (0·∞)
        # the noisy sums may overwrite the clipped sums unless the release can still fail after the add (quantile
        # clipping records its entry, with the noisy count, after it): a retry must start from the clipped sums
        into_sum = self.quantile is None
        if not streamed or any(s.device.type != "cpu" for s in self._sum):  # correlated noise: _draw's stream
            unscaled = std > 0 and self.mechanism is None  # σS·z formed in add_and_round's one pass
            self.__dict__.pop("_unapplied", None)
            noise, count_noise = self._draw(std, scaled=False) if unscaled else self._draw(std)
            scale = self.__dict__.pop("_unapplied", None)  # what _draw did NOT apply (a wrapper may drop scaled=)
            if scale is None:
                raise RuntimeError(
                    "Privatizer._draw was replaced by a function that does not call the original: the noise "
                    "scale it applied is unknown; a wrapper of the noise seam must call Privatizer._draw"
                )
            pool = getattr(self.noise, "_thread_pool", None)
            pool = pool() if pool is not None else None
            workers = getattr(self.noise, "_pool_threads", None) or None  # the size that pool was built with
            bbar, self._divided = self.expected_batch_size, True  # ÷ B̄ done here, after the one rounding
            totals = [
                add_and_round(z, s, dt, into_sum, scale=scale, divisor=bbar, pool=pool, workers=workers)
                for z, s, dt in zip(noise, self._sum, dtypes)
            ]
            return totals, count_noise
        sums = [s.detach() if s.is_contiguous() else s.detach().contiguous() for s in self._sum]
        outs = [
            s if s.dtype == dt and into_sum else torch.empty(s.shape, dtype=dt, device=s.device)
            for s, dt in zip(sums, dtypes)
        ]
        starts = list(itertools.accumulate([0] + sizes))
        flats = [s.view(-1) for s in sums]
        flat_outs = [o.view(-1) for o in outs]
        draw, self._pending = self._pending, None
        self._expect = n
        if draw is None or draw.n != n or not draw.usable:
            draw = self.noise.start_normal(n, stream=True)

        def add(lo: int, hi: int, z: Tensor) -> None:  # z: the float64 normals [lo, hi) of the draw
            i = bisect.bisect_right(starts, lo) - 1
            while i < len(sums) and starts[i] < hi:
                a, b = max(lo, starts[i]), min(hi, starts[i + 1])
                if b > a:
                    part = z[a - lo : b - lo].mul_(std).add_(flats[i][a - starts[i] : b - starts[i]])
                    flat_outs[i][a - starts[i] : b - starts[i]].copy_(part)  # the one rounding
                i += 1

        draw.consume(add)
        return outs, self._count_noise()

    def _count_noise(self) -> Optional[float]:
        """σ_b·z of the clipped count (quantile clipping; drawn after the gradient noise), else None."""
        if self.quantile is None:
            return None
        return float(self.noise.normal((), dtype=torch.float64)) * (0.5 * self.quantile.count_noise_multiplier)

    def _normals(self, n: int, device: torch.device) -> Tensor:
        """``n`` float64 standard normals for the gradient noise on ``device``: on the CPU the draw
        :meth:`_prefetch` started at :meth:`begin` when it has this size (its values are those a
        draw made here would have; it was computed in the noise workers while the per-sample work
        ran), else a draw made now. A started draw of another size is dropped, never reused."""
        if device.type != "cpu":
            return self.noise.normal((n,), dtype=torch.float64, device=device)
        draw, self._pending = self._pending, None
        self._expect = n
        if draw is None or draw.n != n or not draw.usable:
            draw = self.noise.start_normal(n)
        return draw.values()

    def _release_count(self, noisy_count: float) -> dict:
        """Noisy centred count (the noise already in it, :meth:`_draw`) → next clip bound
        (Andrew et al. 2021, Alg. 1)."""
        q = self.quantile
        assert q is not None  # called for quantile clipping only
        count_std = 0.5 * q.count_noise_multiplier
        frac = min(1.0, max(0.0, noisy_count / self.expected_batch_size + 0.5))
        applied = self.bounds[0]
        self.bounds = [applied * math.exp(-q.quantile_lr * (frac - q.target_quantile))]
        self.clip_history.append(applied)
        return {
            "count_noise_multiplier": q.count_noise_multiplier,
            "count_noise_std": count_std,
            "count_sensitivity": 0.5,
            "released_fraction": frac,
        }

    # -- checkpoints --------------------------------------------------------
    def state_dict(self, *, include_ledger: bool = True) -> dict:
        """The Privatizer's public state, for a checkpoint.

        Contains the step counter, the read/release counters, the current clip
        bound(s) and the released ``clip_history`` (quantile clipping), the
        ledger's length (and, with ``include_ledger``, the ledger itself) —
        never per-sample data or the private ``nonfinite_steps`` diagnostic.
        The state of the noise generator is included ONLY for reproducible
        noise (a secret generator's state is never written anywhere: a
        restored secret Privatizer keeps drawing from its own, freshly
        OS-seeded generator).
        """
        state = {
            "version": 1,
            "steps": self.steps,
            "reads": self.reads,
            "releases": self.releases,
            "bounds": list(self.bounds),
            "clip_history": list(self.clip_history),
            "quantile": self.quantile is not None,
            "ledger_length": len(self.ledger),
            "noise_mode": self.noise.mode,
        }
        if self.noise.mode == "reproducible":
            state["noise_state"] = self.noise.state_dict()
        if include_ledger:
            state["ledger"] = self.ledger.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; the ledger never loses a release (DESIGN.md "The ledger travels").

        A state WITH its ledger: this Privatizer's ledger becomes, in place,
        the longer of the two records — the state's, or this ledger when it
        already holds the state's releases and more (loading an older state of
        the same run; warned: the releases after it stay charged). A state
        WITHOUT its ledger (``state_dict(include_ledger=False)``) is accepted
        only if this ledger already holds at least the ``ledger_length``
        releases the state was saved after (the ledger restored separately,
        e.g. from a journal).

        Raises:
            ValueError: a state of another clipping configuration (number of
                bounds, quantile or not), a step in progress; a ledger of
                another run or another branch of this one
                (:func:`~dpopt.accounting.ledger.longest_record`); a state
                without its ledger whose releases this ledger does not hold.
        """
        if self._geometry is not None:
            raise ValueError("cannot load a state in the middle of a step (begin() without release())")
        if self.mechanism is not None and int(state.get("steps", 0)) > 0:
            raise ValueError(
                "resuming a correlated-noise (DP matrix factorization) run is refused: the noise stream's state "
                "is as secret as the noise and is never saved, and restarting the stream would not be the "
                "mechanism the run is accounted for; start a new run (docs/correlated-noise.md)"
            )
        if int(state.get("version", -1)) != 1:
            raise ValueError(f"unsupported Privatizer state version {state.get('version')!r}")
        bounds = [float(c) for c in state["bounds"]]
        if len(bounds) != len(self.bounds) or bool(state["quantile"]) != (self.quantile is not None):
            raise ValueError(
                "this state is of a Privatizer with other clipping (number of bounds or quantile clipping differ)"
            )
        if "ledger" in state:
            saved = PrivacyLedger.from_dict(state["ledger"]) if isinstance(state["ledger"], dict) else state["ledger"]
            name, _ = longest_record({"saved": saved, "current": self.ledger})
            if name == "current" and len(self.ledger) > len(saved):
                warnings.warn(
                    f"loaded a Privatizer state saved after {len(saved)} releases into a ledger that "
                    f"already holds {len(self.ledger)} of the same run: the "
                    f"{len(self.ledger) - len(saved)} releases made after that state stay charged",
                    UserWarning,
                    stacklevel=2,
                )
            else:
                self.ledger.load_state_dict(saved)
            self.ledger.mark_noise(self.noise.mode)
        elif len(self.ledger) < int(state.get("ledger_length", 0)):
            raise ValueError(
                f"this Privatizer state was saved after {int(state['ledger_length'])} releases but "
                f"carries no ledger, and this Privatizer's ledger holds only {len(self.ledger)}: "
                "loading it would forget releases. Save it with state_dict(include_ledger=True) "
                "(the default), or restore the run's ledger (e.g. from its journal) first"
            )
        self.steps, self.reads, self.releases = int(state["steps"]), int(state["reads"]), int(state["releases"])
        self.bounds = bounds
        self.clip_history = [float(c) for c in state["clip_history"]]
        if self.noise.mode == "reproducible" and "noise_state" in state:
            self.noise.load_state_dict(state["noise_state"])

    def privatize(
        self,
        sources: Union[PerSampleSource, Iterable[PerSampleSource]],
        geometry: Optional[ClipGeometry] = None,
        params_like: Optional[Sequence[Tensor]] = None,
    ) -> Release:
        """One logical step: ``begin(geometry)``, accumulate every micro-batch, ``release()``.

        If reading a micro-batch raises, the partial sums are discarded and
        nothing is released or recorded (the exception propagates). If the
        release raises (a failed ledger write, a failed noise draw), the step
        stays open as :meth:`release` leaves it: ``release()`` retries it,
        ``_reset()`` discards it (:class:`~dpopt.optim.DPOptimizer` does).
        """
        self.begin(geometry)
        if params_like is not None and self._pending is None and all(p.device.type == "cpu" for p in params_like):
            self._prefetch(sum(p.numel() for p in params_like))  # nothing else draws before the release
        if hasattr(source_list := sources, "sq_norms"):
            source_list = [cast(PerSampleSource, sources)]
        try:
            with core_loan.step_loan(self._loanable(params_like)):  # the engine may lend the draw a core
                for src in source_list:
                    self.accumulate(src)
        except BaseException:
            self._reset()  # nothing released or recorded: the step did not happen
            raise
        return self.release(params_like)


def _released_dtypes(source: PerSampleSource, sums: Sequence[Tensor]) -> list[torch.dtype]:
    """The dtype each released gradient of ``source`` is rounded to (once, after the noise): its parameters'
    (``params``, when it gives them), else its per-example gradients' (``grads``, the reference source's),
    else the sums' own. The sums themselves are float32 for bf16/fp16 parameters
    (:func:`~dpopt.engine.layers.compute_dtype`), so the release's dtype cannot be read off them."""
    params = getattr(source, "params", None)
    if params is not None and len(params) == len(sums):
        return [p.dtype for p in params]
    grads = getattr(source, "grads", None)
    if isinstance(grads, (list, tuple)) and len(grads) == len(sums) and all(isinstance(g, Tensor) for g in grads):
        return [g.dtype for g in grads]
    return [s.dtype for s in sums]
