"""Per-layer math of the fast per-sample engine: norms and clipped sums without ``[B, d]`` tensors.

A *block* holds what one layer's parameters need after one forward/backward
pass of the batch — the layer inputs ``a`` and the back-propagated output
gradients ``e`` (Opacus calls them activations and backprops) — and answers,
per parameter:

* ``sq_norms(geos) -> [B]`` per parameter: ‖(g_i − m)/b‖² in the clip geometry
  (m = shift, b = scale, either may be ``None``);
* ``grad_sums(coefs, bad) -> param-shaped``: Σ_i c_i g_i over the examples
  that are not ``bad`` (raw gradient coordinates; the source maps into the
  geometry).

Linear-type weights (``nn.Linear``, ``nn.Conv2d`` through im2col) have the
per-sample gradient g_i = Σ_t e_it a_itᵀ (t runs over sequence/spatial
positions, layer calls and DiSK evaluation points), and :class:`FactoredBlock`
picks per layer the cheapest exact form:

* **T = 1** (no sequence dimension), closed forms with two matrix products
  (the AdaClip bilinear identity of issue 5; flat case: Goodfellow 2015)::

      ‖(g_i − m)/b‖² = Σ_jk e_ij² a_ik² S_jk − 2 Σ_jk e_ij a_ik M_jk + Σ_jk m_jk M_jk,
      S = 1/b²,  M = m/b²;

  in the flat geometry ‖g_i‖² = ‖e_i‖²‖a_i‖², with ‖e_i‖² and ‖a_i‖² summed in float64
  (:meth:`LinearPart.sq64`, one compiled row pass each) and the result rounded UP into the compute
  dtype (each parameter's never below the exact norm of the recorded rows; a group's total of several
  parameters is summed in float64 and rounded up too (:class:`~dpopt.engine.fast.FastPerSampleGrads`),
  and so is the hook door's scaling by B or 1/K (:class:`ScaledBlock`): the total is never below
  the exact one, and the Privatizer's factor is rounded down, :func:`dpopt.privatizer.clip_factors`);
  the layer's bias (‖e_i‖²) shares ‖e_i‖²;

* **ghost norm / Gram form** (Li et al. 2022, "Large language models can be
  strong differentially private learners", §4; flat geometry only)::

      ‖g_i‖² = Σ_{t,s} (a_it·a_is)(e_it·e_is),       cost B·T²·(p+q);

* **direct form** (book-keeping, Bu et al. 2023): materialise g_i in chunks of
  examples (bounded memory), cost B·T·p·q; the chunks are kept for the clipped
  sum when they fit the source's cache budget, which then costs B·p·q;

* **Cholesky form** (flat geometry only, :mod:`~dpopt.engine.chol_norm`): with
  N the narrow side (width n = min(p, q)) and W the wide one, K_i = N_i N_iᵀ =
  L_i L_iᵀ in float64 and ‖g_i‖² = ‖L_iᵀ W_i‖² with the product in float32 —
  B·T²·w float32 plus B·T²·n float64, the direct form's linear rounding.

Clipped sums of factored weights are Σ_i c_i g_i = Eᵀ diag(c) A (one matrix
product, or torch's convolution weight-gradient kernel for Conv2d).

Small parameters (biases, LayerNorm/GroupNorm affine parameters, and the
parameters of layers without a fast rule, computed by the ``torch.func``
reference path) are held as materialised per-sample gradients
(:class:`DirectBlock`); ``nn.Embedding`` keeps only the touched rows of each
example (:class:`SparseRowsBlock`).

Everything here is private data, used only through
:class:`~dpopt.engine.fast.FastPerSampleGrads` by the Privatizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .chol_norm import cholesky_sq_norms
from .row_norms import ROW_NORM_COLUMNS, round_up_sq_norms, rounding_gamma, row_sq_norms64, rows_sq64
from .shifted_norm import round_up, shifted_sq_norms

__all__ = [
    "Budget",
    "DirectBlock",
    "FactoredBlock",
    "LinearPart",
    "ConvPart",
    "SparseRowsBlock",
    "im2col",
    "conv_method",
    "CONV_METHODS",
    "IM2COL_FAN_IN_UP_TO",
    "cached_grad_sum",
    "constant_sq_norms",
    "GRAM_WITH_CACHE_BELOW",
    "GRAM_WITHOUT_CACHE_BELOW",
    "CONV_GRAM_THRESHOLDS",
    "CACHE_SHARE",
    "derived_cache_bytes",
    "form_costs",
    "chol_cost",
    "CHOL_GRAM64_PER_MAC",
    "CHOL_FACTOR_PER_MAC",
    "NORM_FORMS",
    "check_norm_form",
    "plan_caches",
    "row_sq_norms64",
    "ROW_NORM_COLUMNS",
    "compute_dtype",
]

Geo = tuple[Optional[Tensor], Optional[Tensor]]  # (shift m, scale b) of one parameter, or None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the engine computes per-example norms, clip factors and clipped sums in, for parameters of ``dtype``.

    float32 for the half-precision dtypes (bf16, fp16), else ``dtype`` itself (float32, float64). The one
    mechanism of mixed precision (docs/architecture.md, "Mixed precision"): the layer inputs ``a`` and
    output gradients ``e`` recorded in bf16 — under autocast or with bf16 weights alike — are cast to
    this dtype before any product (a factored layer per chunk of examples), so the clip bound
    ‖c_i g_i‖ ≤ C holds to float32 rounding of the norm (relative ≈ 1e-7·√terms), not bf16's 2⁻⁸; the
    release is rounded to the parameters' dtype once, after the noise (:class:`~dpopt.privatizer.Privatizer`).

    Raises:
        ValueError: ``dtype`` is not a floating dtype.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"per-example gradients need floating parameters, got {dtype}")
    return torch.promote_types(dtype, torch.float32)


@dataclass
class Budget:
    """Memory budget of one per-sample source (bytes, private-data scratch space).

    Attributes:
        chunk_bytes: largest temporary a direct-form chunk may allocate
            (per-sample gradients of a chunk of examples plus its im2col).
        cache_bytes: per-sample gradients kept between ``sq_norms`` and
            ``weighted_sum`` (all factored layers of the source together);
            the engine derives it from the model and batch
            (:func:`derived_cache_bytes`) unless the user gives one.
        used: bytes of cache in use.
        norm_form: None (default): each factored layer takes the cheapest exact
            form of its norms by the cost model (:meth:`FactoredBlock.cheapest_form`);
            one of :data:`NORM_FORMS`: that form wherever it applies
            (:meth:`FactoredBlock.forced_form`) — for tests and measurements, the
            results are the same up to each form's rounding.
    """

    chunk_bytes: int = 16 << 20
    cache_bytes: int = 0
    used: int = 0
    norm_form: Optional[str] = None

    def take(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` of cache; False (nothing reserved) if it does not fit."""
        if self.used + nbytes > self.cache_bytes:
            return False
        self.used += nbytes
        return True

    def give(self, nbytes: int) -> None:
        """Return ``nbytes`` of cache."""
        self.used = max(0, self.used - nbytes)


NORM_FORMS = ("gram", "chol", "direct")
"""The per-example norm forms of a factored layer that a source's :class:`Budget` may force (module docstring)."""


def check_norm_form(norm_form: Optional[str]) -> Optional[str]:
    """``norm_form`` if it is None (the cost model chooses) or one of :data:`NORM_FORMS`.

    Raises:
        ValueError: anything else (names the accepted values).
    """
    if norm_form is None or (isinstance(norm_form, str) and norm_form in NORM_FORMS):
        return norm_form
    raise ValueError(
        f"norm_form must be None (the cost model chooses per layer) or one of {NORM_FORMS}, got {norm_form!r}"
    )


CACHE_SHARE = 0.1
"""Share of the non-private step's memory that the cached per-example gradients may add (the issue-34
target: peak memory ≤ 1.1× non-private). See :func:`derived_cache_bytes`."""


def derived_cache_bytes(param_bytes: int, grad_bytes: int, activation_bytes: int, share: float = CACHE_SHARE) -> int:
    """The cache budget of a source derived from the model and batch: ``share`` × what the non-private step holds.

    The non-private step of the same batch holds at least the model's
    parameters, the ``.grad`` of its trainable ones and the inputs of its
    layers that autograd keeps for their weight gradients (the layer inputs
    ``a`` the capture records). The cache of per-example gradients kept
    between the norms and the clipped sum is allowed ``share`` of that sum,
    so that it alone adds at most ``share`` to the step's peak (the rest of
    the per-layer choice, :func:`plan_caches`, decides which layers use it).

    Args:
        param_bytes: bytes of every parameter of the model (trainable and frozen, each tensor once).
        grad_bytes: bytes of the trainable parameters (their ``.grad`` in the non-private step).
        activation_bytes: bytes of the distinct layer-input tensors recorded for this batch.
        share: the fraction (≥ 0).

    Returns:
        bytes (int, ≥ 0).

    Raises:
        ValueError: a negative argument.
    """
    if min(param_bytes, grad_bytes, activation_bytes) < 0 or not share >= 0:
        raise ValueError(
            f"derived_cache_bytes needs non-negative sizes and share, got {param_bytes}, {grad_bytes}, "
            f"{activation_bytes}, share={share}"
        )
    return int(share * (param_bytes + grad_bytes + activation_bytes))


def _rows(mask: Tensor, t: Tensor) -> Tensor:
    """Zero the rows (examples) of ``t`` where ``mask`` ([B] bool) is True."""
    return torch.where(mask.view(-1, *([1] * (t.dim() - 1))), torch.zeros((), dtype=t.dtype, device=t.device), t)


def _kept(bad: Tensor, *ts: Tensor) -> list[Tensor]:
    """The rows (examples, dim 0) of each of ``ts`` where ``bad`` ([B] bool) is False, in order.

    For a sum Σ_i c_i g_i that takes the flagged (non-finite) rows as 0: only the kept rows are copied,
    where :func:`_rows` made a full-size copy of each operand. The first-batch check asks for one
    example's gradient this way (every other row flagged): a copy of one row, not of the layer's whole
    output gradient (issue 34: the head's ``[B, T, V]``, 37 MiB at the GPT-2 shape's first-step peak).
    """
    keep = torch.nonzero(~bad).flatten()
    return [t.index_select(0, keep) for t in ts]


def constant_sq_norms(m: Optional[Tensor], b: Optional[Tensor], n: int, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``[n]`` squared norms of a zero per-example gradient (a block with no call or no example; an example
    flagged non-finite): its geometry norm is ‖(0 − m)/b‖² (0 without a shift), evaluated in float64 (÷,
    square: 2 roundings per coordinate, then the sum) and rounded UP into ``dtype`` (default m's)
    (:func:`~dpopt.engine.row_norms.round_up_sq_norms`), never below the exact value."""
    if m is None:
        return torch.zeros((), dtype=dtype).expand(n).clone()
    base = m.double() / b.double() if b is not None else m.double()
    const = round_up_sq_norms(base.square().sum(), base.numel() + 2, dtype or m.dtype)
    return const.expand(n).clone()


def cached_grad_sum(cache: Sequence[Tensor], c: Tensor, bad: Optional[Tensor]) -> Tensor:
    """Σ_i c_i g_i over cached per-example gradient chunks ``[b_k, q, p]`` (examples in order),
    rows flagged ``bad`` (non-finite) taken as 0. Returns ``[q, p]``."""
    total, s = None, 0
    for g in cache:
        t = s + g.shape[0]
        cc, gg = _kept(bad[s:t], c[s:t], g) if bad is not None else (c[s:t], g)
        part = torch.tensordot(cc.to(g.dtype), gg, dims=1)
        total = part if total is None else total + part
        s = t
    return total  # type: ignore[return-value]


def _geo_sq_norms(g: Tensor, shift: Optional[Tensor], scale: Optional[Tensor]) -> Tensor:
    """‖(g_i − shift)/scale‖² for materialised per-sample ``g`` of shape ``[b, *shape]`` → ``[b]``.

    Cancellation-free: g − shift is formed per coordinate (one rounding each)
    and the squares are accumulated in float64; the result is in :func:`compute_dtype` of g's dtype
    (float32 for bf16 g: a bf16 norm would move the clip bound by up to 2⁻⁹).
    """
    if shift is None and scale is None:
        w = g
    else:
        w = g - shift if shift is not None else g.clone()
        if scale is not None:
            w.div_(scale)
    flat = w.reshape(w.shape[0], math.prod(w.shape[1:]))
    return round_up_sq_norms(row_sq_norms64(flat), flat.shape[1] + 1, compute_dtype(g.dtype))


# --------------------------------------------------------------------------- direct (materialised)
class DirectBlock:
    """Parameters whose per-sample gradients are small enough to hold: ``[B, *p.shape]`` each.

    Args:
        index: trainable-parameter indices covered.
        grads: one per-sample gradient tensor per index, shape ``[B, *param.shape]``
            (already multiplied by the evaluation-point coefficients and summed
            over points/calls). Read only, never written in place: they may be views of the
            recorded output gradients (:func:`~dpopt.engine.rules.linear_bias_sums`).
        flat: optional, per index, None or a function returning that parameter's flat-geometry squared
            norms ``[B]`` (never below the exact ‖g_i‖²) computed from shared quantities: a T = 1 linear
            layer's bias reuses the ‖e_i‖² of its weight's closed form (:meth:`LinearPart.bias_sq_norms`).
            Other geometries (a shift or a scale) use ``grads``.

    Source: the definition (Abadi et al. 2016); used for biases, norm-layer
    affine parameters and the ``torch.func`` fallback.
    """

    def __init__(self, index: Sequence[int], grads: Sequence[Tensor], flat: Optional[Sequence] = None):
        self.index = tuple(index)
        self.grads = list(grads)
        self.flat = None if flat is None else list(flat)

    def sq_norms(self, geos: Sequence[Geo]) -> list[Tensor]:
        """‖(g_i − m)/b‖² per held parameter, ``[B]`` each; in the flat geometry from :attr:`flat` where given."""
        out = []
        for k, (g, (m, b)) in enumerate(zip(self.grads, geos)):
            f = self.flat[k] if self.flat is not None else None
            out.append(f() if f is not None and m is None and b is None else _geo_sq_norms(g, m, b))
        return out

    def grad_sums(self, coefs: Sequence[Tensor], bad: Optional[Tensor]) -> list[Tensor]:
        out = []
        for g, c in zip(self.grads, coefs):
            if bad is not None:
                c, g = _kept(bad, c, g)
            w = compute_dtype(g.dtype)  # bf16 per-example gradients (the fallback's): summed in float32
            out.append(torch.tensordot(c.to(w), g.to(w), dims=1))
        return out

    def free(self) -> None:
        self.grads, self.flat = [], None


class ScaledBlock:
    """The block of ``s · g_i`` from a block of ``g_i``: the hook door's output-gradient scale, folded in.

    Every block is linear in the output gradients ``e`` it was built from
    (g_i = J_iᵀ e_i), so the block of ``s·e`` has squared norms
    ‖(s·g_i − m)/b‖² = s²·‖(g_i − m/s)/b‖² and weighted sums
    Σ c_i (s·g_i) = Σ (s·c_i) g_i: computed here from the inner block on ``[B]``
    and ``[B, G]`` tensors, where scaling ``e`` itself copied every layer's
    ``[B, T, q]`` output gradient (on the GPT-2 head a 32 MiB copy per step;
    issue 34, docs/performance.md "The PrivacyEngine door's extra time").

    Args:
        inner: any block (``index``, ``sq_norms``, ``grad_sums``, ``free``).
        scale: s, a finite nonzero float (the door's B for a mean loss, 1/K for K views).

    Raises:
        ValueError: ``scale`` zero or not finite.
    """

    def __init__(self, inner, scale: float):
        s = float(scale)
        if s == 0.0 or not math.isfinite(s):
            raise ValueError(f"internal error: a block's scale must be finite and nonzero, got {scale!r}")
        self.inner, self.scale, self.index = inner, s, inner.index

    def sq_norms(self, geos: Sequence[Geo]) -> list[Tensor]:
        s = self.scale
        # m / s in float64: in m's own dtype the division rounds the shift (relative u: 2⁻⁸ for a bf16 m), and a
        # norm of an example near the shift then came out below the exact one (review of 2026-12-07: 0.965 of it
        # with a bf16 shift, 0.99992 with a float32 one); the inner block meets the float64 shift in float64
        inner = self.inner.sq_norms([(None if m is None else m.double() / s, b) for m, b in geos])
        # s²·v in float64 (two roundings: s·s and the product) rounded UP into v's dtype: never below s²
        # times the inner block's value (itself never below the exact norm), where a float32 product
        # rounded to nearest could be half an ulp below.
        return [round_up_sq_norms(v.double() * (s * s), 2, v.dtype) for v in inner]

    def grad_sums(self, coefs: Sequence[Tensor], bad: Optional[Tensor]) -> list[Tensor]:
        return self.inner.grad_sums([c * self.scale for c in coefs], bad)

    def free(self) -> None:
        self.inner.free()


def scaled_block(blk, scale: float):
    """``blk`` with its per-example gradients multiplied by ``scale`` (:class:`ScaledBlock`; a
    :class:`DirectBlock`'s held gradients are multiplied instead, one copy each, never in place: they may
    be views of the recorded output gradients). ``scale == 1``: ``blk`` itself."""
    if scale == 1:
        return blk
    if type(blk) is DirectBlock:  # (its shared flat norms are of the unscaled gradients: not carried over)
        return DirectBlock(blk.index, [g * scale for g in blk.grads])
    return ScaledBlock(blk, scale)


def unscaled(blk):
    """The block a :class:`ScaledBlock` wraps (its form and cache plan are the inner block's), else ``blk``."""
    return blk.inner if isinstance(blk, ScaledBlock) else blk


# --------------------------------------------------------------------------- factored (Linear, Conv2d)
class LinearPart:
    """One call of an ``nn.Linear`` (one evaluation point): inputs and output-gradients.

    Args:
        a: layer input ``[B, ..., p]``; e: gradient of the (coef-weighted)
            per-example losses w.r.t. the layer output, ``[B, ..., q]``; either
            may be bf16/fp16 (kept as recorded).
        dtype: the dtype of every product (:func:`compute_dtype`); None: that of
            ``a`` and ``e``'s promoted dtype. ``a`` and ``e`` are cast to it per
            chunk of examples (:meth:`at`, :meth:`et`, :meth:`grad_sum`), never
            whole: a float32 copy of every layer's bf16 activations is not held.
    """

    def __init__(self, a: Tensor, e: Tensor, dtype: Optional[torch.dtype] = None):
        b = a.shape[0]
        self.a = a.reshape(b, -1, a.shape[-1])  # [B, T, p]
        self.e = e.reshape(b, -1, e.shape[-1])  # [B, T, q]
        self.T = self.a.shape[1]
        self.dtype = compute_dtype(torch.promote_types(a.dtype, e.dtype)) if dtype is None else dtype
        self._sq64: dict[str, Tensor] = {}

    def sq64(self, side: str) -> Tensor:
        """T = 1: per-example ‖e_i‖² (``side="e"``) or ‖a_i‖² (``"a"``), ``[B]`` float64
        (:func:`~dpopt.engine.row_norms.rows_sq64` of the rows in :attr:`dtype`), computed once per part and
        shared by the weight's closed form and the bias (:meth:`bias_sq_norms`).

        Raises:
            ValueError: T ≠ 1 or ``side`` not ``"e"``/``"a"``.
        """
        if self.T != 1 or side not in ("e", "a"):
            raise ValueError(f"sq64 needs T = 1 and side 'e' or 'a' (T = {self.T}, side {side!r})")
        v = self._sq64.get(side)
        if v is None:
            x = self.e if side == "e" else self.a
            v = self._sq64[side] = rows_sq64(x[:, 0].to(self.dtype))
        return v

    def weight_sq_norms(self) -> Tensor:
        """T = 1, flat geometry: ‖e_i a_iᵀ‖² = ‖e_i‖²‖a_i‖² (Goodfellow 2015) in float64 from :meth:`sq64`,
        rounded up into :attr:`dtype` (:func:`~dpopt.engine.row_norms.round_up_sq_norms`: never below the
        exact value of the recorded rows), ``[B]``."""
        q, p = self.e.shape[-1], self.a.shape[-1]
        return round_up_sq_norms(self.sq64("e"), q + p + 1, self.dtype, times=self.sq64("a"))

    def bias_sq_norms(self) -> Tensor:
        """T = 1, flat geometry: the bias's per-example ‖e_i‖² (:meth:`sq64`, shared with the weight),
        rounded up into :attr:`dtype`, ``[B]``."""
        return round_up_sq_norms(self.sq64("e"), self.e.shape[-1], self.dtype)

    def at(self, s: int, t: int) -> Tensor:
        """Inputs of examples s..t−1 as ``[b, p, T]``, in :attr:`dtype`."""
        return self.a[s:t].transpose(1, 2).to(self.dtype)

    def et(self, s: int, t: int) -> Tensor:
        """Output gradients of examples s..t−1 as ``[b, q, T]``, in :attr:`dtype`."""
        return self.e[s:t].transpose(1, 2).to(self.dtype)

    def grad_sum(self, c: Tensor, bad: Optional[Tensor], chunk_bytes: int = 16 << 20) -> Tensor:
        """Σ_i c_i Σ_t e_it a_itᵀ, shape ``[q, p]``, in :attr:`dtype`: one GEMM, or (inputs in another
        dtype) one per chunk of examples of at most ``chunk_bytes`` of cast inputs, accumulated in :attr:`dtype`."""
        a, e = self.a, self.e
        if bad is not None:
            c, a, e = _kept(bad, c, a, e)
        c = c.to(self.dtype)
        if a.dtype == self.dtype and e.dtype == self.dtype:
            return _weighted_outer(a, e, c)
        empty = a.new_zeros(e.shape[-1], a.shape[-1], dtype=self.dtype)
        return _sum_in_chunks(a, e, c, self.dtype, chunk_bytes, _weighted_outer, empty)


def _sum_in_chunks(x: Tensor, e: Tensor, c: Tensor, dtype: torch.dtype, chunk_bytes: int, fn, empty: Tensor) -> Tensor:
    """Σ over chunks of rows of ``fn(x_rows.to(dtype), e_rows.to(dtype), c_rows)``, accumulated in ``dtype``.

    The inputs (bf16/fp16 as recorded) are cast per chunk of at most ``chunk_bytes`` of cast rows, never
    whole: the clipped sum of a half-precision layer is computed in float32 without a float32 copy of all
    its rows. ``empty``: the result for zero rows.
    """
    per = (x[:1].numel() + e[:1].numel()) * torch.finfo(dtype).bits // 8
    step = max(1, chunk_bytes // max(1, per))
    total = None
    for s in range(0, x.shape[0], step):
        part = fn(x[s : s + step].to(dtype), e[s : s + step].to(dtype), c[s : s + step])
        total = part if total is None else total.add_(part)
    return empty if total is None else total


def _weighted_outer(a: Tensor, e: Tensor, c: Tensor) -> Tensor:
    """Σ_i c_i Σ_t e_it a_itᵀ of ``a [b, T, p]``, ``e [b, T, q]``, ``c [b]`` (one dtype) → ``[q, p]`` (one GEMM)."""
    q, p = e.shape[-1], a.shape[-1]
    if p <= q:  # scale the smaller operand
        return e.reshape(-1, q).t() @ (a * c.view(-1, 1, 1)).reshape(-1, p)
    return (e * c.view(-1, 1, 1)).reshape(-1, q).t() @ a.reshape(-1, p)


def im2col(x: Tensor, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int]) -> Tensor:
    """Patches of an already padded ``x [b, C, H, W]`` as ``[b, C·kh·kw, Ho·Wo]``.

    Row order (C, kh, kw) matches ``weight.view(out_channels, -1)`` of ``nn.Conv2d``.
    Built from a strided view and one copy (faster than ``F.unfold`` on CPU,
    measured in docs/performance.md).
    """
    b, c, h, w = x.shape
    kh, kw = kernel
    sh, sw = stride
    dh, dw = dilation
    ho = (h - dh * (kh - 1) - 1) // sh + 1
    wo = (w - dw * (kw - 1) - 1) // sw + 1
    s0, s1, s2, s3 = x.stride()
    view = x.as_strided((b, c, kh, kw, ho, wo), (s0, s1, dh * s2, dw * s3, sh * s2, sw * s3))
    return view.reshape(b, c * kh * kw, ho * wo)


class ConvPart:
    """One call of an ``nn.Conv2d`` (groups = 1) at one evaluation point, optionally with K views per example.

    Args:
        module: the Conv2d (its kernel/stride/padding/dilation are read).
        x: layer input ``[B·K, C, H, W]``; e: output gradient ``[B·K, q, Ho, Wo]``.
        views: K ≥ 1 (``rows_per_example``): rows i·K … i·K + K − 1 are example i's
            views, which are K more groups of positions of that example,
            g_i = Σ_v Σ_t e_ivt a_ivtᵀ.
        dtype: the dtype of every product (:func:`compute_dtype`; None: of ``x`` and ``e``);
            ``x`` and ``e`` (bf16 ones kept as recorded) are cast to it per chunk of examples.

    ``T`` counts the positions of one example: K·Ho·Wo.
    """

    def __init__(self, module, x: Tensor, e: Tensor, views: int = 1, dtype: Optional[torch.dtype] = None):
        self.dtype = compute_dtype(torch.promote_types(x.dtype, e.dtype)) if dtype is None else dtype
        self.kernel, self.stride, self.dilation = module.kernel_size, module.stride, module.dilation
        self.weight_shape = tuple(module.weight.shape)
        self.p = math.prod(self.weight_shape[1:])
        self.views = int(views)
        if module.padding_mode == "zeros" and not isinstance(module.padding, str):
            self.x, self.padding, self.pad, self.mode = x, tuple(module.padding), None, None
        else:  # 'same'/'valid' strings, reflect/replicate/circular: pad explicitly like Conv2d does
            self.x, self.padding = x, (0, 0)
            self.pad = tuple(module._reversed_padding_repeated_twice)
            self.mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        self.e = e
        self.T = self.views * e.shape[2] * e.shape[3]

    def _padded(self, x: Tensor) -> Tensor:
        if self.pad is not None:
            return F.pad(x, self.pad, mode=self.mode)  # type: ignore[arg-type]
        ph, pw = self.padding
        return F.pad(x, (pw, pw, ph, ph)) if (ph or pw) else x

    def _merge(self, t: Tensor) -> Tensor:
        """Rows ``[b·K, d, T0]`` → ``[b, d, K·T0]`` (each example's views as more positions)."""
        k = self.views
        if k == 1:
            return t
        n, d, t0 = t.shape
        return t.reshape(n // k, k, d, t0).transpose(1, 2).reshape(n // k, d, k * t0)

    def at(self, s: int, t: int) -> Tensor:
        """Patches of examples s..t−1, ``[b, C·kh·kw, T]``."""
        k = self.views
        x = self.x[s * k : t * k].to(self.dtype)
        return self._merge(im2col(self._padded(x), self.kernel, self.stride, self.dilation))

    def et(self, s: int, t: int) -> Tensor:
        """Output gradients of examples s..t−1, ``[b, q, T]``."""
        k = self.views
        return self._merge(self.e[s * k : t * k].to(self.dtype).flatten(2))

    def _input(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        if self.pad is not None:
            return F.pad(x, self.pad, mode=self.mode), (0, 0)  # type: ignore[arg-type]
        return x, self.padding

    def per_sample(self, s: int, t: int, method: str) -> Tensor:
        """Per-sample weight gradients of examples s..t−1 (summed over their views), ``[b, q, C·kh·kw]``.

        ``"im2col"``: patches (strided copy) then one batched GEMM;
        ``"grouped"``: torch's convolution weight-gradient kernel with the examples
        folded into groups and the views as that kernel's batch, which it sums
        (Rochette et al. 2019, "Efficient per-example gradient computations in
        convolutional neural networks").
        """
        k = self.views
        x, e = self.x[s * k : t * k].to(self.dtype), self.e[s * k : t * k].to(self.dtype)
        if method == "im2col":  # per row, then the sum over each example's K rows (no transposed copies)
            a = im2col(self._padded(x), self.kernel, self.stride, self.dilation)
            g = torch.bmm(e.flatten(2), a.transpose(1, 2))
            return g if k == 1 else g.reshape(t - s, k, *g.shape[1:]).sum(1)
        x, padding = self._input(x)
        b, cin, q = x.shape[0] // k, x.shape[1], e.shape[1]
        if k > 1:  # [b·K, ...] example-major → [K, b·C, ...]: view v of every example is one batch row
            x = x.reshape(b, k, *x.shape[1:]).transpose(0, 1)
            e = e.reshape(b, k, *e.shape[1:]).transpose(0, 1)
        w = e.new_empty(1).expand(b * q, cin, *self.kernel)
        gw = torch.ops.aten.convolution_backward(
            e.reshape(k, b * q, *e.shape[-2:]),
            x.reshape(k, b * cin, *x.shape[-2:]),
            w,
            None,
            list(self.stride),
            list(padding),
            list(self.dilation),
            False,
            [0, 0],
            b,
            [False, True, False],
        )[1]
        return gw.reshape(b, q, -1)

    def grad_sum(self, c: Tensor, bad: Optional[Tensor], chunk_bytes: int = 16 << 20) -> Tensor:
        """Σ_i c_i g_i via torch's convolution weight-gradient kernel; shape ``[q, C·kh·kw]``, in :attr:`dtype`.

        ``c``, ``bad``: per example ``[B]`` (each applies to all K rows of its example). Inputs in
        another dtype: one kernel call per chunk of rows of at most ``chunk_bytes`` of cast inputs,
        the parts accumulated in :attr:`dtype`.
        """
        x, e = self.x, self.e
        if self.views > 1:
            c = c.repeat_interleave(self.views)
            bad = None if bad is None else bad.repeat_interleave(self.views)
        if bad is not None:
            x, e = _rows(bad, x), _rows(bad, e)
        c = c.to(self.dtype)
        if x.dtype == self.dtype and e.dtype == self.dtype:
            return self._weight_grad(x, e, c)
        empty = x.new_zeros(self.weight_shape[0], self.p, dtype=self.dtype)
        return _sum_in_chunks(x, e, c, self.dtype, chunk_bytes, self._weight_grad, empty)

    def _weight_grad(self, x: Tensor, e: Tensor, c: Tensor) -> Tensor:
        """Σ_r c_r (weight gradient of row r) of rows ``x``, ``e``, ``c`` (one dtype), ``[q, C·kh·kw]``."""
        e = e * c.view(-1, 1, 1, 1)
        if self.pad is not None:
            x, padding = F.pad(x, self.pad, mode=self.mode), (0, 0)  # type: ignore[arg-type]
        else:
            padding = self.padding
        w = e.new_empty(1).expand(self.weight_shape)
        gw = torch.ops.aten.convolution_backward(
            e, x, w, None, list(self.stride), list(padding), list(self.dilation), False, [0, 0], 1, [False, True, False]
        )[1]
        return gw.reshape(self.weight_shape[0], -1)


GRAM_WITH_CACHE_BELOW = 0.55
"""Below this r = T(p+q)/(pq) the Gram norm of a Linear layer (float64, then one GEMM for the clipped sum) is
faster than the cached direct form (materialised g_i, then a pass over ``[B, q, p]`` for the clipped sum).
Measured on this project's CPU since 2026-12-06, a 2-vCPU Intel Xeon (CPU time, float32, one thread,
``benchmarks/norm_forms.py``, docs/performance.md, "The form choice on this CPU"): on the GPT-2/BERT layers
(B 8, T 128, p, q 256–8192) Gram costs 0.95 of the cached form at r = 0.52, 1.09–1.17 at r 0.62–0.67,
1.35–1.41 at r = 1. (On the former 2-vCPU AMD EPYC it was 1/3: :data:`CONV_GRAM_THRESHOLDS`.)"""

GRAM_WITHOUT_CACHE_BELOW = 0.735
"""Below this r the Gram norm of a Linear layer is faster than the direct form whose per-sample gradients are
not kept (the norms from materialised chunks, then the clipped sum as one more GEMM Eᵀ diag(c) A). Measured
as :data:`GRAM_WITH_CACHE_BELOW`: Gram 0.87–0.92 of the recomputed direct form at r 0.62–0.67 (qkv, fc,
fc2), 1.1 at r = 1 (proj). (On the former AMD CPU: 0.57.)"""

CONV_GRAM_THRESHOLDS = (1 / 3, 0.57)
"""``(GRAM_WITH_CACHE_BELOW, GRAM_WITHOUT_CACHE_BELOW)`` of a Conv2d layer: the former anchoring (Linear
layers, 2-vCPU AMD EPYC, docs/performance.md "Gram or direct"), kept for convolutions, whose Gram form
was not re-measured on the Intel Xeon. With :func:`form_costs`' affine costs they give exactly the choices
and the cache order of the earlier model (Gram 3·r, recomputed direct 1.71), scaled by 0.585."""


CHOL_GRAM64_PER_MAC = 1.7
"""Time of one float64 multiply-add of a Gram matrix ``[T, n]·[n, T]`` over one of the direct form's float32
``bmm`` (norms only, one thread, the GPT-2/BERT layer shapes: 1.6–1.9, docs/performance.md, "Transformer
steps: profile and floor")."""

CHOL_FACTOR_PER_MAC = 5.0
"""Time of the Cholesky factorisation of a ``[T, T]`` matrix (float64, T³/3 multiply-adds, one LAPACK call per
example) and the per-block overheads, per T³/3 float32 multiply-adds of the direct form: fitted to the
``transformer_floor.py`` run of 2026-12-06 14:30 (the fc/fc2 shapes even with the direct form, 0.97–1.05)."""


def chol_cost(t: int, p: int, q: int) -> float:
    """Time of the Cholesky form's norms (:mod:`~dpopt.engine.chol_norm`) over the direct form's norms.

    With n = min(p, q), w = max(p, q): the float32 product T²·w (relative T/n), the float64 Gram of the
    narrow side T²·n (relative :data:`CHOL_GRAM64_PER_MAC`·T/w) and the factorisation T³/3
    (relative :data:`CHOL_FACTOR_PER_MAC`·T²/(n·w)). Measured (CPU time, one thread, B 8, T 128,
    ``benchmarks/transformer_floor.py``, docs/performance.md, "The Cholesky form"): 0.61 of the direct form
    on the GPT-2 head (p 256, q 8192; model 0.57), 0.85–1.17 on fc/fc2 (256 ↔ 1024, median ≈ 1.03; model
    1.03), 1.2 on qkv (256 → 768; model 1.2), 1.9 on proj (256 → 256; model 2.6).
    """
    n, w = min(p, q), max(p, q)
    return t / n + CHOL_GRAM64_PER_MAC * t / w + CHOL_FACTOR_PER_MAC * t * t / (n * w)


def form_costs(
    ratio: float,
    flat: bool,
    chol: float = math.inf,
    thresholds: tuple[float, float] = (GRAM_WITH_CACHE_BELOW, GRAM_WITHOUT_CACHE_BELOW),
) -> tuple[float, float]:
    """Time of a factored layer's norms + clipped sum, ``(with its per-example gradients cached, without)``.

    In units of the cached direct form (B·T·p·q multiply-adds, then a pass over
    ``[B, q, p]``); ``ratio`` = r = T(p+q)/(pq). With ``thresholds`` =
    (r₁, r₂) (:data:`GRAM_WITH_CACHE_BELOW`, :data:`GRAM_WITHOUT_CACHE_BELOW` for a
    Linear layer, :data:`CONV_GRAM_THRESHOLDS` for a convolution), the clipped sum
    as one GEMM costs s = 1 − r₁/r₂ (B·T·p·q multiply-adds, where the cache's pass
    is ≈ free) and the norms' float64 Gram matrices r/r₂ (B·T²·(p+q)
    multiply-adds): the direct form with the sum recomputed costs 1 + s, the Gram
    form s + r/r₂ (so Gram is cheaper below r₁ with the cache, below r₂
    without), the Cholesky form ``chol`` (its norms relative to the direct
    form's, :func:`chol_cost`) + s. Each side takes its cheapest form, Gram and
    Cholesky only in the flat geometry. Anchored on the two measured thresholds
    (docs/performance.md, "The form choice on this CPU").

    Raises:
        ValueError: if the thresholds are not 0 < r₁ ≤ r₂.
    """
    costs = _form_cost_table(ratio, chol, thresholds)
    gram, chol_total = (costs["gram"], costs["chol"]) if flat else (math.inf, math.inf)
    return min(costs["direct cached"], gram, chol_total), min(costs["direct"], gram, chol_total)


def _form_cost_table(ratio: float, chol: float, thresholds: tuple[float, float]) -> dict[str, float]:
    """:func:`form_costs`' cost of each form in the flat geometry, with s = 1 − r₁/r₂ (the clipped sum as one
    GEMM): ``direct cached`` 1, ``direct`` (the sum recomputed) 1 + s, ``gram`` s + r/r₂, ``chol`` ``chol`` + s."""
    below_cached, below_uncached = thresholds
    if not 0 < below_cached <= below_uncached:
        raise ValueError(f"form_costs needs thresholds 0 < r1 <= r2, got {thresholds}")
    gemm = 1.0 - below_cached / below_uncached
    return {"direct cached": 1.0, "direct": 1.0 + gemm, "gram": gemm + ratio / below_uncached, "chol": chol + gemm}


def plan_caches(blocks: Sequence["FactoredBlock"], flat: Sequence[bool], budget: "Budget") -> list[bool]:
    """Which factored layers keep their per-example gradients between norms and sum, within ``budget``.

    Each candidate layer (T > 1: the closed forms need no cache) would hold
    ``B·q·p`` elements and saves (uncached − cached) × B·T·p·q of time
    (:func:`form_costs`). Layers are taken greedily by time saved per byte
    (∝ T × the cost difference), largest first, each one that still fits
    ``budget.cache_bytes − budget.used``; a layer that saves nothing is never
    cached. The chosen bytes are reserved in ``budget`` and each block's
    ``cache_ok`` is set (its :meth:`FactoredBlock.sq_norms` then follows it).

    Args:
        blocks: the source's factored blocks; flat: per block, True if its
            clip geometry has neither shift nor scale (Gram applies).
        budget: the source's :class:`Budget` (``used`` grows by the bytes chosen).

    Returns:
        per block, True if it caches.

    Source: the choice of Bu et al. 2023 (arXiv 2210.00038, book-keeping:
    ghost norm or per-example gradients, whichever is cheaper per layer) with
    a memory budget as the constraint. A form forced by the budget
    (:attr:`Budget.norm_form`) replaces the cost model where it applies.
    """
    if len(flat) != len(blocks):
        raise ValueError(f"plan_caches needs one flatness flag per block, got {len(flat)} for {len(blocks)}")
    gains = []
    for k, (blk, fl) in enumerate(zip(blocks, flat)):
        blk.cache_ok = False
        if blk.closed_form() or not blk.parts or blk.B == 0:
            continue
        forced = blk.forced_form(fl)
        if forced in ("gram", "chol"):  # forced norms without per-example gradients: nothing to keep
            continue
        if forced == "direct":
            cached, uncached = form_costs(blk.ratio(), False, thresholds=blk.gram_thresholds())
        else:
            cached, uncached = form_costs(blk.ratio(), fl, blk.chol_cost(), blk.gram_thresholds())
        if uncached > cached:
            gains.append(((uncached - cached) * blk.T / blk.itemsize(), k))
    for _gain, k in sorted(gains, key=lambda g: (-g[0], g[1])):
        blocks[k].cache_ok = budget.take(blocks[k].cache_nbytes())
    return [bool(blk.cache_ok) for blk in blocks]


CONV_METHODS = ("im2col", "grouped")
IM2COL_FAN_IN_UP_TO = 64
"""The per-sample conv kernel by layer shape (:func:`conv_method`): im2col when C_in·kh·kw is at most
this, torch's grouped weight-gradient kernel above. Measured (float32, one thread, 8 examples, K 1 and
4; ``docs/performance.md``, "Per-sample conv kernel"): im2col 1.5–3× faster at C_in·kh·kw = 27
(3-channel inputs), grouped 1.4–3.6× faster at 144–2304; 1×1 convs with 16–64 input channels within
±15%."""


def conv_method(part: "ConvPart") -> str:
    """The per-sample kernel of this conv layer: ``"im2col"`` if C_in·kh·kw ≤ :data:`IM2COL_FAN_IN_UP_TO`, else ``"grouped"``.

    Both kernels are exact and round differently; the choice depends on the
    layer's shape only (never on a timing), so that a run with
    reproducible noise is bit-identical when repeated on the same machine.
    """
    fan_in = part.weight_shape[1] * part.kernel[0] * part.kernel[1]
    return "im2col" if fan_in <= IM2COL_FAN_IN_UP_TO else "grouped"


class FactoredBlock:
    """The weight of a Linear/Conv2d layer: g_i = Σ_t e_it a_itᵀ, never materialised for all i at once.

    Args:
        index: the weight's trainable-parameter index.
        shape: the weight's shape (``[q, p]`` or ``[q, C, kh, kw]``).
        parts: :class:`LinearPart`/:class:`ConvPart` list (calls × evaluation
            points); their positions concatenate along t.
        budget: the source's :class:`Budget`.
        batch_size: B.

    Form chosen per layer and geometry (module docstring): T = 1 closed
    forms; otherwise, with r = T·(p+q)/(p·q) (Gram's B·T²·(p+q) operations over
    the direct form's B·T·p·q), in flat geometry the cheapest of Gram, Cholesky
    and the direct form by :func:`form_costs` (Gram when r <
    :data:`GRAM_WITH_CACHE_BELOW`, or when r < :data:`GRAM_WITHOUT_CACHE_BELOW`
    and the per-sample gradients are not cached, unless :func:`chol_cost` is
    lower); else the direct form, its
    chunks cached for the clipped sum when :func:`plan_caches` chose this
    layer (``cache_ok``; a block used alone reserves from its budget on first
    use), its sum recomputed as one GEMM otherwise. A form forced by the
    budget (:attr:`Budget.norm_form`, :meth:`forced_form`) replaces this choice
    where it applies.
    """

    def __init__(self, index: int, shape: Sequence[int], parts: Sequence, budget: Budget, batch_size: int):
        self.index = (index,)
        self.shape = tuple(shape)
        self.q = self.shape[0]
        self.p = int(math.prod(self.shape[1:]))
        self.parts = list(parts)
        self.budget = budget
        self.B = batch_size
        self.T = sum(pt.T for pt in self.parts)
        self._cache: Optional[list[Tensor]] = None  # per-sample grads [b, q, p] per chunk
        self._cache_bytes = 0
        self.form: Optional[str] = None  # last form used (for tests and the docs)
        self.cache_ok: Optional[bool] = None  # set by plan_caches; None: reserve from the budget on first use

    def ratio(self) -> float:
        """r = T(p+q)/(pq): the Gram form's work over the direct form's."""
        return self.T * (self.p + self.q) / (self.p * self.q)

    def chol_cost(self) -> float:
        """The Cholesky form's norms over the direct form's (:func:`chol_cost`); inf for a conv layer."""
        if any(not isinstance(pt, LinearPart) for pt in self.parts):
            return math.inf
        return chol_cost(self.T, self.p, self.q)

    def gram_thresholds(self) -> tuple[float, float]:
        """(:data:`GRAM_WITH_CACHE_BELOW`, :data:`GRAM_WITHOUT_CACHE_BELOW`) for a layer of Linear calls,
        :data:`CONV_GRAM_THRESHOLDS` for one with a convolution (the anchoring :func:`form_costs` reads)."""
        if any(not isinstance(pt, LinearPart) for pt in self.parts):
            return CONV_GRAM_THRESHOLDS
        return GRAM_WITH_CACHE_BELOW, GRAM_WITHOUT_CACHE_BELOW

    def forced_form(self, flat: bool) -> Optional[str]:
        """The form :attr:`Budget.norm_form` forces on this layer, or None (the cost model chooses).

        A forced form applies where it is exact: ``"direct"`` always; ``"gram"`` in the flat clip
        geometry; ``"chol"`` in the flat geometry of a layer made of Linear calls (finite
        :meth:`chol_cost`). Elsewhere (and for the T = 1 closed forms, which :meth:`sq_norms` takes
        first) the cost model's choice stands.
        """
        forced = self.budget.norm_form
        if forced is None or forced == "direct":
            return forced
        if not flat or (forced == "chol" and not math.isfinite(self.chol_cost())):
            return None
        return forced

    def cheapest_form(self, flat: bool, cached: bool) -> str:
        """``"gram"``, ``"chol"`` or ``"direct"``: the cheapest form in the clip geometry (:func:`form_costs`) when the
        per-example gradients are kept (``cached``) or not; the forced form (:meth:`forced_form`) if there is one."""
        forced = self.forced_form(flat)
        if forced is not None:
            return forced
        if not flat:
            return "direct"
        costs = _form_cost_table(self.ratio(), self.chol_cost(), self.gram_thresholds())
        costs["direct"] = costs["direct cached"] if cached else costs["direct"]
        return min(("direct", "gram", "chol"), key=lambda k: costs[k])

    def closed_form(self) -> bool:
        """True if the norms take the T = 1 closed forms (no per-example gradient, no cache)."""
        return self.T == 1 and len(self.parts) == 1 and isinstance(self.parts[0], LinearPart)

    def itemsize(self) -> int:
        return torch.finfo(self._dtype()).bits // 8

    def cache_nbytes(self) -> int:
        """Bytes of this layer's per-example gradients ``[B, q, p]`` (what caching them holds)."""
        return self.B * self.q * self.p * self.itemsize()

    # -- helpers -----------------------------------------------------------
    def _dtype(self) -> torch.dtype:
        """The dtype of the products, norms and sums (:func:`compute_dtype` of the recorded tensors)."""
        return self.parts[0].dtype

    def _cat(self, fn: str, s: int, t: int) -> Tensor:
        xs = [getattr(pt, fn)(s, t) for pt in self.parts]
        return xs[0] if len(xs) == 1 else torch.cat(xs, dim=2)

    def _chunk_rows(self) -> int:
        per = (self.q * self.p * 2 + (self.p + self.q) * self.T) * torch.finfo(self._dtype()).bits // 8
        return max(1, min(self.B, self.budget.chunk_bytes // max(per, 1)))

    def _drop_cache(self) -> None:
        if self._cache is not None:
            self.budget.give(self._cache_bytes)
        self._cache, self._cache_bytes = None, 0

    # -- norms ---------------------------------------------------------------
    def sq_norms(self, geos: Sequence[Geo]) -> list[Tensor]:
        m, b = geos[0]
        m = None if m is None else m.reshape(self.q, self.p)
        b = None if b is None else b.reshape(self.q, self.p)
        if not self.parts or self.B == 0:
            self.form = "empty"
            return [constant_sq_norms(m, b, self.B)]
        if self.closed_form():
            self.form = "closed"
            return [self._closed(m, b)]
        nbytes = self.cache_nbytes()
        if self._cache is not None:
            keep = True  # reuse the cached per-sample gradients
        else:
            flat = m is None and b is None
            form = self.cheapest_form(flat, cached=True)  # cheaper than even the cached direct form: no cache
            if form == "direct":
                keep = self.budget.take(nbytes) if self.cache_ok is None else self.cache_ok
                form = "direct" if keep else self.cheapest_form(flat, cached=False)
            if form != "direct":
                self.form = form
                return [self._gram() if form == "gram" else self._chol()]
        self.form = "direct"
        return [self._direct(m, b, keep, nbytes)]

    def _closed(self, m: Optional[Tensor], b: Optional[Tensor]) -> Tensor:
        pt = self.parts[0]
        if m is None and b is None:  # Goodfellow 2015: ‖e aᵀ‖² = ‖e‖²‖a‖², float64, ‖e‖² shared with the bias
            return pt.weight_sq_norms()
        a, e = pt.a[:, 0].to(pt.dtype), pt.e[:, 0].to(pt.dtype)  # [B, p], [B, q]
        if m is None:  # scale only: Σ_jk e_j² a_k² / b_jk², float64, rounded up (never below the exact value)
            return _scaled_closed_sq_norms(e, a, b, pt.dtype)  # type: ignore[arg-type]
        # With a shift the expanded form quad − 2·lin + const can cancel catastrophically; an
        # underestimated norm would let a clipped example exceed the bound. shifted_sq_norms
        # evaluates it in float32 with a rigorous error bound, returns an upper bound, and
        # recomputes in float64 the rows at risk. A geometry in another dtype than the compute dtype (a bf16 model's
        # AdaClip / DP-MacAdam state, a float64 one) is met in the wider of the two: bf16 → float32 is exact, and a
        # float64 geometry is not rounded; the norms come back rounded up into the compute dtype.
        dt = torch.promote_types(pt.dtype, m.dtype if b is None else torch.promote_types(m.dtype, b.dtype))
        if dt == pt.dtype:
            return shifted_sq_norms(e, a, m.to(dt), None if b is None else b.to(dt))[0]
        wide = shifted_sq_norms(e.to(dt), a.to(dt), m.to(dt), None if b is None else b.to(dt))[0]
        return round_up(wide.double(), pt.dtype)

    def _gram(self) -> Tensor:
        """‖g_i‖² = Σ_{t,s} (a_it·a_is)(e_it·e_is), evaluated in float64.

        The terms have mixed signs, so the sum can cancel: in float32 its error is
        ≈ 6e-8·(Σ_t ‖a_it‖‖e_it‖)², which can exceed a small true ‖g_i‖² and
        underestimate it (an unclipped example above C). float64 makes that error
        ≈ 1e-16 of the same scale.
        """
        out = []
        step = max(
            1, min(self.B, self.budget.chunk_bytes // max(1, (2 * self.T * self.T + (self.p + self.q) * self.T) * 8))
        )
        for s in range(0, self.B, step):
            t = min(self.B, s + step)
            at = self._cat("at", s, t).double()  # [b, p, T]
            et = self._cat("et", s, t).double()  # [b, q, T]
            ga = torch.bmm(at.transpose(1, 2), at)
            ge = torch.bmm(et.transpose(1, 2), et)
            out.append((ga * ge).sum((1, 2)))
        # rounded up, not to nearest (the float64 cancellation, ≈ 1e-16 of (Σ_t ‖a_it‖‖e_it‖)², stays documented)
        return round_up_sq_norms(torch.cat(out).clamp_min_(0.0), self.p + self.q + 2, self._dtype())

    def _chol(self) -> Tensor:
        """‖g_i‖² by the Cholesky form (:func:`~dpopt.engine.chol_norm.cholesky_sq_norms`), in chunks of examples.

        The narrow side's ``[T, T]`` float64 Gram matrix and factor, and the ``[w, T]`` float32
        products, of at most ``budget.chunk_bytes`` per chunk.
        """
        narrow, wide = ("at", "et") if self.p <= self.q else ("et", "at")  # [b, width, T] views
        n, w = min(self.p, self.q), max(self.p, self.q)
        per = (3 * self.T * self.T + n * self.T) * 8 + 2 * w * self.T * torch.finfo(self._dtype()).bits // 8
        step = max(1, min(self.B, self.budget.chunk_bytes // max(1, per)))
        out = []
        for s in range(0, self.B, step):
            t = min(self.B, s + step)
            out.append(
                cholesky_sq_norms(self._cat(narrow, s, t).transpose(1, 2), self._cat(wide, s, t).transpose(1, 2))
            )
        # rounded up, not to nearest (the form's own under-estimate ≤ γ_T relative stays documented, chol_norm.py)
        return round_up_sq_norms(torch.cat(out), 1, self._dtype())

    def _direct(self, m: Optional[Tensor], b: Optional[Tensor], keep: bool, nbytes: int) -> Tensor:
        out = []
        if self._cache is not None:
            for g in self._cache:
                out.append(_geo_sq_norms(g, m, b))
            return torch.cat(out)
        cache = [] if keep else None  # type: ignore[var-annotated]
        step = self._chunk_rows()
        single_conv = len(self.parts) == 1 and isinstance(self.parts[0], ConvPart)
        method = conv_method(self.parts[0]) if single_conv else "im2col"
        for s in range(0, self.B, step):
            t = min(self.B, s + step)
            if single_conv:
                g = self.parts[0].per_sample(s, t, method)
            else:
                g = torch.bmm(self._cat("et", s, t), self._cat("at", s, t).transpose(1, 2))  # [b, q, p]
            out.append(_geo_sq_norms(g, m, b))
            if cache is not None:
                cache.append(g)
        if cache is not None:
            self._cache, self._cache_bytes = cache, nbytes
        return torch.cat(out)

    # -- clipped sum -------------------------------------------------------------
    def grad_sums(self, coefs: Sequence[Tensor], bad: Optional[Tensor]) -> list[Tensor]:
        c = coefs[0]
        if not self.parts or self.B == 0:
            return [torch.zeros(self.shape, dtype=c.dtype, device=c.device)]
        if self._cache is not None:
            return [cached_grad_sum(self._cache, c, bad).reshape(self.shape)]
        total = None
        for pt in self.parts:
            part = pt.grad_sum(c, bad, self.budget.chunk_bytes)
            total = part if total is None else total + part
        return [total.reshape(self.shape)]  # type: ignore[union-attr]

    def free(self) -> None:
        self._drop_cache()
        self.parts = []


def _scaled_closed_sq_norms(e: Tensor, a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """T = 1 Linear weight in a scale-only geometry: ‖(e_i a_iᵀ)/b‖² = Σ_jk e_ij² a_ik² / b_jk², ``[B]``.

    Args:
        e: ``[B, q]``, a: ``[B, p]`` (the recorded rows in the compute dtype), b: ``[q, p]`` the scale.
        dtype: the compute dtype of the result.

    Evaluated in float64 as ((e²) @ (1/b²)) · a² summed over k: per term ≤ 3 roundings (1/b², the
    products; the squares of float32 values are exact in float64, of float64 ones one more), q − 1 and
    p − 1 additions of non-negative terms: relative error ≤ γ_{p+q+3}, covered by
    :func:`~dpopt.engine.row_norms.round_up_sq_norms`, which returns it rounded UP into ``dtype`` (the
    former float32 evaluation rounded to nearest at every step, and could underflow: below the exact
    value by more than the fast source's round-up covers). Cost: one ``[B, q] @ [q, p]`` product in float64.
    """
    q, p = e.shape[-1], a.shape[-1]
    inv = b.double().square().reciprocal()  # [q, p]
    v = ((e.double().square() @ inv) * a.double().square()).sum(1)
    return round_up_sq_norms(v, p + q + 3, dtype)


def _difference_up(total: Tensor, total_terms: int, part: Tensor, part_terms: int) -> Tensor:
    """An upper bound, float64 and ≥ 0, of the exact X − Y for sums of non-negative terms computed in float64:
    ``total`` = X̂ (≤ ``total_terms`` roundings per term: |X̂ − X| ≤ γ·X) and ``part`` = Ŷ (``part_terms``).

    X ≤ X̂/(1 − γ_n) ≤ X̂·(1 + (n + 3)u)·(1 − u) (1 + (n + 4)u itself rounded to nearest; the product's own rounding included; the second-order terms
    hold for (2n² + n + 2)·u ≤ 1, i.e. n ≤ 6·10⁷, above which 1 + 2γ_{n+1} is used) and likewise
    Y ≥ Ŷ·(1 − (n + 4)u); their difference, rounded once, is multiplied by 1 + 4u (≥ the exact difference after
    both roundings) and clamped at 0. The subtraction can cancel (Y ≈ X): a relative bound of the result would
    not hold; this one does, at an absolute cost ≈ (n_X + n_Y)·u·X̂ (the pessimism of an example near the shift).
    """

    def up(n: int) -> float:
        return (n + 4) * 2.0**-53 if (2 * n * n + n + 2) * 2.0**-53 <= 1.0 else 2.0 * rounding_gamma(n + 1)

    hi = total * (1.0 + up(total_terms))
    lo = part * (1.0 - up(part_terms))
    return ((hi - lo) * (1.0 + 4.0 * 2.0**-53)).clamp_min_(0.0)


# --------------------------------------------------------------------------- embedding
class SparseRowsBlock:
    """``nn.Embedding`` weight ``[V, D]``: each example's gradient lives on the rows it looked up.

    Args:
        index: the weight's parameter index; num_embeddings: V.
        parts: ``(idx [B, ...] int, e [B, ..., D])`` per call/point;
            ``padding_idx`` rows get no gradient (as in ``F.embedding``).

    Per example i and touched row v: r_iv = Σ_{t: idx_it = v} e_it (built once
    with ``torch.unique`` + ``index_add_``, O(B·T·D)). In the geometry (m, b)::

        ‖(g_i − m)/b‖² = Σ_v ‖m_v/b_v‖² + Σ_{v touched by i} (‖(r_iv − m_v)/b_v‖² − ‖m_v/b_v‖²)

    and Σ_i c_i g_i scatters c_i r_iv into row v (Opacus' embedding rule in
    sparse form).
    """

    def __init__(self, index: int, num_embeddings: int, padding_idx: Optional[int], parts, batch_size: int):
        self.index = (index,)
        self.V = int(num_embeddings)
        self.B = batch_size
        idx = torch.cat([i.reshape(batch_size, -1) for i, _ in parts], dim=1)  # [B, T]
        e = torch.cat([g.reshape(batch_size, -1, g.shape[-1]) for _, g in parts], dim=1)  # [B, T, D]
        self.D = e.shape[-1]
        if padding_idx is not None:
            e = torch.where((idx == padding_idx).unsqueeze(-1), torch.zeros((), dtype=e.dtype), e)
        ex = torch.arange(batch_size, device=idx.device).view(-1, 1).expand_as(idx)
        keys = (ex * self.V + idx).reshape(-1)
        uniq, inv = torch.unique(keys, return_inverse=True)
        self.rows = e.new_zeros(uniq.numel(), self.D).index_add_(0, inv, e.reshape(-1, self.D))
        self.row_ex = uniq // self.V
        self.row_tok = uniq % self.V

    def sq_norms(self, geos: Sequence[Geo]) -> list[Tensor]:
        """Per-example ‖(g_i − m)/b‖², ``[B]``, in the rows' dtype.

        With a shift the sum Σ_v ‖m_v/b_v‖² + Σ_touched (‖(r−m)/b‖² − ‖m/b‖²)
        cancels when ‖m‖ ≫ ‖g_i − m‖ (float32 once returned 0 for a norm of
        5·C); it is evaluated in float64 as Σ_touched ‖(r−m)/b‖² +
        (Σ_v ‖m_v/b_v‖² − Σ_touched ‖m_v/b_v‖²), the bracket clamped at 0.
        """
        m, b = geos[0]
        dtype = self.rows.dtype
        # float64 roundings per example: ≤ 3 per coordinate (− m, ÷ b, square), D − 1 per row's sum, and one
        # addition per touched row (at most min(V, all rows) of them): a sum of non-negative terms, relative
        # error ≤ γ_{D + R + 2} (Higham 2002, §3.1), rounded up into the dtype (round_up_sq_norms), never to nearest
        terms = self.D + min(self.V, int(self.rows.shape[0])) + 2
        if m is None and b is None:
            out = self.rows.new_zeros(self.B, dtype=torch.float64)
            sq = self.rows.double().square().sum(1)
            return [round_up_sq_norms(out.index_add_(0, self.row_ex, sq), terms, dtype)]
        rows = self.rows.double()
        w = rows if m is None else rows - m.double()[self.row_tok]
        if b is not None:
            w = w / b.double()[self.row_tok]
        touched = self.rows.new_zeros(self.B, dtype=torch.float64).index_add_(0, self.row_ex, w.square().sum(1))
        if m is None:
            return [round_up_sq_norms(touched, terms, dtype)]
        base = m.double() if b is None else m.double() / b.double()  # [V, D]: w of an untouched row
        base_row = base.square().sum(1)
        all_rows = base_row.sum()
        mine = self.rows.new_zeros(self.B, dtype=torch.float64).index_add_(0, self.row_ex, base_row[self.row_tok])
        if dtype == torch.float64:  # a float64 engine's norms: the float64 evaluation (as round_up_sq_norms)
            untouched = (all_rows - mine).clamp_min_(0.0)
        else:  # Σ_all − Σ_touched can cancel: bounded absolutely, not relatively
            untouched = _difference_up(all_rows, self.D + self.V + 1, mine, terms)
        return [round_up_sq_norms(touched + untouched, terms + 1, dtype)]

    def grad_sums(self, coefs: Sequence[Tensor], bad: Optional[Tensor]) -> list[Tensor]:
        c = coefs[0].to(self.rows.dtype)
        rows = self.rows
        if bad is not None:
            c = torch.where(bad, torch.zeros((), dtype=c.dtype), c)
            rows = _rows(bad[self.row_ex], rows)
        out = rows.new_zeros(self.V, self.D)
        return [out.index_add_(0, self.row_tok, rows * c[self.row_ex].unsqueeze(1))]

    def free(self) -> None:
        self.rows = self.rows[:0]


# --------------------------------------------------------------------------- norm layers
def group_norm_grads(
    x: Tensor, e: Tensor, num_groups: int, eps: float, stats: Optional[tuple[Tensor, Tensor]] = None, views: int = 1
) -> tuple[Tensor, Tensor]:
    """Per-sample GroupNorm affine gradients ``(dweight [B, C], dbias [B, C])``.

    With x̂ = (x − μ_g)·r_g (μ_g, r_g = 1/√(var_g + ε) per example and group,
    biased variance as in ``F.group_norm``): dweight_c = Σ_pos x̂·e =
    r_g (Σ_pos x e − μ_g Σ_pos e); dbias_c = Σ_pos e (Wu & He 2018, eq. 1).

    Args:
        x: input ``[B, C, *]``; e: output gradient, same shape.
        stats: ``(μ [B, G], r [B, G])`` saved by the forward pass, if available
            (otherwise recomputed with ``torch.var_mean``).
        views: K ≥ 1: ``x``, ``e`` are ``[B, K, C, *]`` (stats ``[B, K, G]``), K views
            of each example; its gradient is the sum over its views (each view
            normalised by its own statistics).

    Returns ``[B, C]`` each.
    """
    if views > 1:
        st = None if stats is None else tuple(t.flatten(0, 1) for t in stats)
        dw, se = group_norm_grads(x.flatten(0, 1), e.flatten(0, 1), num_groups, eps, st)  # type: ignore[arg-type]
        return dw.reshape(-1, views, dw.shape[1]).sum(1), se.reshape(-1, views, se.shape[1]).sum(1)
    b, c = x.shape[:2]
    if stats is not None:
        mean, rstd = (t.reshape(b, num_groups) for t in stats)
    else:
        var, mean = torch.var_mean(x.reshape(b, num_groups, -1), dim=2, unbiased=False)
        rstd = (var + eps).rsqrt()
    if _fused_group_norm_ok(x, e, mean, rstd):
        return _group_norm_grads_fused(x, e, num_groups, mean, rstd)
    per = c // num_groups
    xe = torch.linalg.vecdot(x.reshape(b, c, -1), e.reshape(b, c, -1), dim=2)  # Σ_pos x e (2× einsum's speed on CPU)
    se = e.reshape(b, c, -1).sum(2)
    dw = rstd.repeat_interleave(per, dim=1) * (xe - mean.repeat_interleave(per, dim=1) * se)
    return dw, se


def _fused_group_norm_ok(x: Tensor, e: Tensor, mean: Tensor, rstd: Tensor) -> bool:
    """True if :func:`_group_norm_grads_fused` applies: one float32/float64 dtype for all four, on the CPU, no
    empty batch (elsewhere the two-pass formula of :func:`group_norm_grads` runs, as before)."""
    dt = x.dtype
    return (
        dt in (torch.float32, torch.float64)
        and e.dtype == dt
        and mean.dtype == dt
        and rstd.dtype == dt
        and x.device.type == "cpu"
        and x.numel() > 0
        and e.shape == x.shape
    )


def _group_norm_grads_fused(x: Tensor, e: Tensor, num_groups: int, mean: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`group_norm_grads` by torch's GroupNorm backward kernel with the batch folded into the channels.

    ``x``, ``e`` ``[B, C, *]`` seen as one example of B·C channels in B·G groups (group k is example
    k // G, group k % G: the same memory), ``mean``, ``rstd`` ``[B, G]`` as ``[1, B·G]``. The kernel's
    weight and bias gradients of that one example are then, per channel (b, c),
    (Σ_pos x e − μ Σ_pos e)·r and Σ_pos e: the per-example gradients of :func:`group_norm_grads`'s
    formula, from one fused pass over ``x`` and ``e`` (its sums in the input dtype, like the two-pass
    formula's; only the order of the additions differs). The grad-input half is not computed
    (``output_mask``). Measured in docs/performance.md ("CNN5: profile and floor"): 3.6–4× faster on
    CNN5's GroupNorm shapes, one thread. The kernel reads its buffers as contiguous memory, so every
    reshaped operand is made contiguous (a copy only for strided inputs: sliced, cropped, broadcast).
    Returns ``(dweight [B, C], dbias [B, C])``.
    """
    b, c = x.shape[:2]
    hw = x[0, 0].numel() if x.dim() > 2 else 1
    n = b * c
    _, dw, db = torch.ops.aten.native_group_norm_backward(
        e.reshape(1, n, hw).contiguous(),  # contiguous: the kernel ignores strides (docstring)
        x.reshape(1, n, hw).contiguous(),
        mean.reshape(1, b * num_groups).contiguous(),
        rstd.reshape(1, b * num_groups).contiguous(),
        x.new_ones(n),  # unused by the weight/bias halves; the kernel asks for a defined weight
        1,
        n,
        hw,
        b * num_groups,
        [False, True, True],
    )
    return dw.view(b, c), db.view(b, c)


def layer_norm_grads(
    x: Tensor, e: Tensor, normalized_shape: Sequence[int], eps: float, stats: Optional[tuple[Tensor, Tensor]] = None
) -> tuple[Tensor, Tensor]:
    """Per-sample LayerNorm affine gradients, each ``[B, *normalized_shape]``.

    dweight = Σ_pos x̂ ⊙ e, dbias = Σ_pos e over the non-normalised,
    non-batch positions (Ba et al. 2016); x̂ = (x − μ)·r from the forward
    pass's saved ``stats = (μ, r)`` (shape ``[*lead, 1...]``) or recomputed.
    """
    if stats is not None:
        mean, rstd = stats
        xhat = (x - mean) * rstd
    else:
        xhat = F.layer_norm(x, tuple(normalized_shape), eps=eps)
    dims = tuple(range(1, x.dim() - len(normalized_shape)))
    dw = (xhat * e).sum(dims) if dims else xhat * e
    db = e.sum(dims) if dims else e.clone()
    return dw, db


def rms_norm_grads(
    x: Tensor, e: Tensor, normalized_shape: Sequence[int], eps: Optional[float], upcast: bool = False
) -> Tensor:
    """Per-sample RMSNorm weight gradients ``[B, *normalized_shape]``: Σ_pos x̂ ⊙ e.

    x̂ = x / √(mean(x²) + ε) over the normalised dims (Zhang & Sennrich 2019),
    ε = ``torch.finfo(x.dtype).eps`` when None (as ``nn.RMSNorm``).
    ``upcast``: x̂ computed in float32 and cast back to x's dtype, as
    ``LlamaRMSNorm`` does (the same roundings as the layer's forward).
    """
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    h = x.to(torch.float32) if upcast else x
    if eps is None:
        eps = torch.finfo(h.dtype).eps
    xhat = (h * torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + eps)).to(x.dtype)
    lead = tuple(range(1, x.dim() - len(normalized_shape)))
    return (xhat * e).sum(lead) if lead else xhat * e
