"""The fast per-sample source and dpopt's own-loop door to the capture (``dpopt train``).

The capture itself — forward hooks, tapped forwards, bare-parameter taps,
the per-call layout test and the first-batch check — is
:mod:`dpopt.engine.capture`, the one mechanism shared with ``PrivacyEngine``
(:mod:`dpopt.engine.hooks`); this module holds the source both doors build
(:class:`FastPerSampleGrads`) and :class:`PerSampleEngine`, which runs the
forward and backward itself.

One forward and one backward pass of the batch per evaluation point: the
recorder records each call's input ``a`` and output of the layers that have
a fast rule; ``torch.autograd.grad`` of the per-example losses (weighted by the
point's coefficient) w.r.t. those outputs gives ``e`` = ∂(coef·ℓ_i)/∂output_i
for every example at once (examples are independent: verified below; BatchNorm
is refused by :func:`~dpopt.models.check_model`). No parameter gradient is formed in that
backward pass — the weight gradients, which the non-private step pays for,
are replaced by the clipped sum Eᵀ diag(c) A computed later.

Which layers have a fast rule, and how each builds its blocks, is registered
per layer type in :mod:`dpopt.engine.rules` (Linear, Conv2d with groups = 1,
Embedding without ``max_norm``/``scale_grad_by_freq``, LayerNorm, GroupNorm;
exact module types: subclasses fall back, since they may change ``forward``).

Every other trainable parameter — of another layer type, shared between two
modules, used outside its module's ``forward``, or of a layer whose dim 0 is
not the example axis — is computed by the per-example reference path
(:func:`~dpopt.engine.reference.per_sample_gradient_tensors`: ``torch.func`` vmap,
or an exact single-example loop) for that parameter only.

"One example per row of dim 0" is verified, not assumed:

* every batch, each recorded call of a fast layer must have the batch size as
  dim 0 of its input and output (a ``[1, T]`` broadcast position id, a
  ``[T, B, D]`` sequence-first tensor or a ``reshape(B*T, D)`` fails this),
  else the layer moves to the reference path with a warning;
* on the first batch in each signature (train/eval flags, the modules'
  non-parameter state, the batch-size class: :func:`~dpopt.engine.check.signature`;
  any change re-runs it), in that mode, at two batch
  sizes that differ from every dimension of the model's parameters, buffers
  and module inputs/outputs, the fast per-example squared norms and a
  weighted sum are compared with an exact loop of single-example autograd on
  a few examples, the batched pass's dropout masks replayed per example
  (which catches a forward that mixes examples — also one that mixes only in
  train mode — and parameters used outside their module); the reference path
  itself is first checked (vmap against the loop). The check is
  :meth:`dpopt.engine.capture.Recorder.check`, shared with the hook path; see
  :meth:`PerSampleEngine._verify`.

A forward that mixes examples is thus given its per-example definition — each
example alone — by the reference path. Inputs with the examples along another
axis (``batch_dim`` ≠ 0) use the reference path for every parameter.

DiSK evaluation points (Σ_k coef_k ∇ℓ(θ + offset_k; x_i)) are supported
exactly: each point is one more forward/backward, and its calls are
concatenated with the others along the position axis t of the factored form
(g_i = Σ_{k,t} coef_k e^k_it a^k_itᵀ), so multi-point norms use the Gram or
direct form.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from .. import core_loan
from ..kernels import native, numpy_readable
from ..models import check_model
from ..types import ClipGeometry, EvaluationPoint
from . import hf_rules  # noqa: F401 — puts the transformers layers' rules in rules.LAZY_RULES
from .capture import (  # noqa: F401
    Call,
    OutputLayout,
    Plan,
    Recorder,
    check_cache_bytes,
    check_views,
    demotion_warning,
    expand_broadcast,
    no_autocast,
    public_shape,
)
from .check import (
    ModeCheck,
    RandomReplay,
    Unreplayable,
    alone_failed,
    free_sizes,
    layer_of,
    layer_scales,
    mode_signature,
    model_dims,
    rtol,
    signature,
    sq_norm64,
)
from .compiled import CompiledCapture, compile_backend, refusal
from .inputs import LossFn, buffers_unchanged, check_inputs, example_loss, preserved_state
from .layers import (
    DirectBlock,
    FactoredBlock,
    LinearPart,
    check_norm_form,
    compute_dtype,
    constant_sq_norms,
    plan_caches,
    unscaled,
)
from .recompute import hf_checkpointing_off, non_reentrant, shifted_refused
from .reference import _LOOP_MODELS, ExampleFailed, per_sample_gradient_tensors, use_loop
from .row_losses import recognised_row_losses
from .row_norms import round_up_sq_norms, rounding_gamma

_no_autocast = no_autocast

__all__ = ["FastPerSampleGrads", "PerSampleEngine", "fast_per_sample_gradients", "get_engine"]


# --------------------------------------------------------------------------- the source
class FastPerSampleGrads:
    """Per-sample source in factored form (private): same interface as :class:`~dpopt.engine.reference.PerSampleGrads`.

    Built by :class:`PerSampleEngine`; holds, per layer, what is needed to
    compute per-sample norms and clipped sums without materialising ``[B, d]``.

    Attributes:
        batch_size: B (private). num_params: number of trainable parameters.
        nonfinite: number of examples with a non-finite per-sample norm in the
            geometry of the last :meth:`sq_norms` call (private diagnostic);
            those examples are treated as having a zero gradient, exactly like
            the reference path (their w_i = −shift/scale, clipped as usual).
        params: tuple of the trainable parameters (the ``nn.Parameter``
            objects) in this source's order; None if not given.
        points: tuple of the :class:`~dpopt.types.EvaluationPoint`
            objects the gradients were evaluated at; None if not given.

    Norms, clip factors and sums are computed outside autocast, in
    :func:`~dpopt.engine.layers.compute_dtype` of the parameters' dtype
    (bf16 autocast or bf16 weights: from the bf16 activations cast to float32;
    the clipping bound ‖c_i g_i‖ ≤ C then holds to float32 rounding of the norm,
    as with float32 weights — docs/architecture.md, "Mixed precision").

    The Privatizer calls :meth:`sq_norms` then :meth:`weighted_sum` with the
    same geometry; a factored layer may keep per-sample gradients between the
    two calls (within its :class:`~dpopt.engine.layers.Budget`).
    """

    def __init__(
        self,
        blocks: Sequence,
        shapes: Sequence[torch.Size],
        batch_size: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        params: Optional[Sequence[Tensor]] = None,
        points: Optional[Sequence[EvaluationPoint]] = None,
    ):
        self.blocks = list(blocks)
        self.params = None if params is None else tuple(params)
        self.points = None if points is None else tuple(points)
        self.shapes = [torch.Size(s) for s in shapes]
        self.batch_size = int(batch_size)
        self.dtype, self.device = compute_dtype(dtype), device  # norms, factors and sums: float32 for bf16
        covered = sorted(i for blk in self.blocks for i in blk.index)
        if covered != list(range(len(self.shapes))):  # an engine invariant (tied parameters: engine.tied)
            twice = sorted({i for i in covered if covered.count(i) > 1})
            missing = sorted(set(range(len(self.shapes))) - set(covered))
            raise ValueError(
                f"internal error: per-sample blocks cover trainable parameters {twice} more than once "
                f"and miss {missing} (indices in named_parameters order of the trainable ones)"
            )
        self._bad: Optional[Tensor] = None  # [B] bool: examples with a non-finite norm (set by the norms)
        self._nbad = 0  # how many (counted where _bad is set: read without another reduction)
        self._freed = False
        self._caches_planned = False

    @property
    def num_params(self) -> int:
        return len(self.shapes)

    @property
    def nonfinite(self) -> int:
        if self._bad is None:
            self.sq_norms(ClipGeometry(), [0] * self.num_params, 1)
        return self._nbad

    def _check(self) -> None:
        if self._freed:
            raise RuntimeError(
                "this per-sample source was freed (sources from an iterator are valid "
                "until the next one is requested); consume them one at a time"
            )

    @staticmethod
    def _geo(geometry: ClipGeometry, i: int):
        m = geometry.shift[i] if geometry.shift is not None else None
        b = geometry.scale[i] if geometry.scale is not None else None
        return m, b

    def sq_norms(self, geometry: ClipGeometry, groups: Sequence[int], num_groups: int) -> Tensor:
        """Squared norms ‖w_i‖² per clipping group, w_i = (g_i − shift)/scale.

        Args:
            geometry: per-parameter shift/scale tensors (param-shaped) or None.
            groups: group index of each parameter (length ``num_params``).
            num_groups: G.

        Returns:
            ``[B, G]`` tensor. Examples with any non-finite per-parameter norm
            get the norm of a zero gradient, ‖shift/scale‖² (reference semantics).
        """
        self._check()
        with _no_autocast(self.device):
            sq = self._sq_norms(geometry, groups, num_groups)
        # a loaned core's draw worker ends its chunk during the clip factors and small sums, not beside the large
        # GEMMs (dpopt.core_loan; measured: 3-6 % less wall time on the MNIST MLP than pausing at the GEMMs)
        core_loan.wind_down()
        return sq

    def _plan_caches(self, geometry: ClipGeometry) -> None:
        """On the first norms: which factored layers cache their per-example gradients (:func:`~dpopt.engine.layers.plan_caches`)."""
        self._caches_planned = True
        by_budget: dict[int, list[FactoredBlock]] = {}
        for blk in map(unscaled, self.blocks):
            if isinstance(blk, FactoredBlock):
                by_budget.setdefault(id(blk.budget), []).append(blk)
        for fac in by_budget.values():
            flat = [self._geo(geometry, blk.index[0]) == (None, None) for blk in fac]
            plan_caches(fac, flat, fac[0].budget)

    def _param_sq_norms(self, geometry: ClipGeometry) -> list[Optional[Tensor]]:
        """Each parameter's ``[B]`` squared norms from its block, in parameter order (the caches planned first)."""
        if not self._caches_planned:
            self._plan_caches(geometry)
        per_param: list[Optional[Tensor]] = [None] * self.num_params
        for blk in self.blocks:
            for i, v in zip(blk.index, blk.sq_norms([self._geo(geometry, i) for i in blk.index])):
                per_param[i] = v
        return per_param

    def _sq_norms(self, geometry: ClipGeometry, groups: Sequence[int], num_groups: int) -> Tensor:
        per_param = self._param_sq_norms(geometry)
        # The group totals are summed in float64 (each term exact there) and rounded UP into the compute
        # dtype (round_up_sq_norms: ≥ the float64 sum's exact value after its ≤ P − 1 roundings): a total is
        # never below the exact sum of its terms, each never below its parameter's exact norm, so the
        # Privatizer's factor (clip_factors) keeps the clipped norm ≤ C. Cost: [B, G] float64.
        terms = max(1, len(per_param))
        if _c_totals(per_param, self.batch_size, self.dtype):
            # the same float64 totals, margin and rounding up in one C pass (sq_group_totals, _native.c:
            # bit-identical to the torch code below, without its ≈ 15 small ops)
            out32 = torch.empty(self.batch_size, num_groups, dtype=torch.float32)
            total = torch.empty(self.batch_size, num_groups, dtype=torch.float64)
            factor = 1.0 + 2.0 * rounding_gamma(terms + 1)
            pieces = [v.numpy() for v in per_param]  # type: ignore[union-attr]
            if native.sq_group_totals(out32.numpy(), pieces, [int(k) for k in groups], factor, total.numpy()):
                self._bad, self._nbad = torch.zeros(self.batch_size, dtype=torch.bool, device=self.device), 0
                return out32
            return self._nonfinite_sq_norms(geometry, groups, per_param, total, terms)
        # each group's total from 0 by in-place float64 adds in parameter order (the values of ``out[:, k] += v``
        # on a [B, G] buffer, without its per-term indexing), stacked (one group: a view)
        totals = [torch.zeros(self.batch_size, dtype=torch.float64, device=self.device) for _ in range(num_groups)]
        for v, k in zip(per_param, groups):
            totals[k].add_(v)  # type: ignore[arg-type]
        out = totals[0].unsqueeze(1) if num_groups == 1 else torch.stack(totals, 1)
        # The non-finite check reads the totals: the norms are ≥ 0 or nan/inf, and an inf or nan term makes
        # its group's float sum inf or nan, so all-finite totals mean all-finite norms (the common case: one
        # reduction). Otherwise the norms are read one by one, as always.
        if bool(torch.isfinite(out).all()):
            self._bad, self._nbad = torch.zeros(self.batch_size, dtype=torch.bool, device=self.device), 0
            return round_up_sq_norms(out, terms, self.dtype)
        return self._nonfinite_sq_norms(geometry, groups, per_param, out, terms)

    def _nonfinite_sq_norms(
        self, geometry: ClipGeometry, groups: Sequence[int], per_param: list, out: Tensor, terms: int
    ) -> Tensor:
        """:meth:`_sq_norms` when a group total ``out`` (``[B, G]`` float64) is not finite: the norms read one by
        one (:attr:`_bad`: the examples with a non-finite one), theirs replaced by the zero gradient's."""
        bad = torch.zeros(self.batch_size, dtype=torch.bool, device=self.device)
        for v in per_param:
            bad |= ~torch.isfinite(v)
        self._bad, self._nbad = bad, int(bad.sum())
        if not self._nbad:
            return round_up_sq_norms(out, terms, self.dtype)
        out.zero_()
        for i, (v, k) in enumerate(zip(per_param, groups)):
            m, b = self._geo(geometry, i)
            zero_sq = constant_sq_norms(m, b, 1, self.dtype).reshape(())  # ‖(0 − m)/b‖², rounded up
            out[:, k] += torch.where(bad, zero_sq, v)
        return round_up_sq_norms(out, terms, self.dtype)

    def weighted_sum(self, weights: Tensor, geometry: ClipGeometry, groups: Sequence[int]) -> list[Tensor]:
        """Σ_i weights[i, group(p)] · w_i(p) for every parameter p (param-shaped).

        Computed as (Σ_i c_i g_i − (Σ_i c_i)·shift)/scale with Σ_i c_i g_i from
        the factored form (non-finite examples contribute g_i = 0).
        """
        self._check()
        with _no_autocast(self.device):
            return self._weighted_sum(weights, geometry, groups)

    def _weighted_sum(self, weights: Tensor, geometry: ClipGeometry, groups: Sequence[int]) -> list[Tensor]:
        if self._bad is None:
            _ = self.nonfinite
        bad = self._bad if self._nbad else None
        coefs = [weights[:, k].to(self.dtype) for k in groups]
        masked = [torch.where(bad, torch.zeros((), dtype=c.dtype), c) if bad is not None else c for c in coefs]
        out: list[Optional[Tensor]] = [None] * self.num_params
        blocks, lent = _lent_order(self.blocks) if core_loan.lent() else (self.blocks, 0)
        for j, blk in enumerate(blocks):
            if j == lent:  # the large sums' GEMMs use every torch thread: the loan ends here
                core_loan.reclaim()
            sums = blk.grad_sums([masked[i] for i in blk.index], bad)
            for i, s in zip(blk.index, sums):
                out[i] = s
        core_loan.reclaim()
        result = []
        for i, s in enumerate(out):  # s is a fresh tensor owned here: update in place
            m, b = self._geo(geometry, i)
            if m is not None:
                s.sub_(m, alpha=float(coefs[i].sum()))  # type: ignore[union-attr]
            if b is not None:
                s.div_(b)  # type: ignore[union-attr]
            result.append(s)
        return result  # type: ignore[return-value]

    def free(self) -> None:
        """Drop the stored activations and caches (the source cannot be used afterwards)."""
        for blk in self.blocks:
            blk.free()
        self._freed = True

    def forms(self) -> dict[int, str]:
        """Parameter index → form used by the last :meth:`sq_norms` for factored weights."""
        return {blk.index[0]: blk.form for blk in map(unscaled, self.blocks) if isinstance(blk, FactoredBlock)}  # type: ignore[misc]


def _sum_macs(blk) -> Optional[int]:
    """Multiply-adds of a block's weighted sums: Σ B·T·p·q over a linear layer's calls (uncached), the
    per-example gradients' size for a :class:`~dpopt.engine.layers.DirectBlock`; None for any other block
    (not known to be small)."""
    blk = unscaled(blk)
    if type(blk) is DirectBlock:
        return sum(int(g.numel()) for g in blk.grads)
    if type(blk) is FactoredBlock and blk._cache is None and all(type(pt) is LinearPart for pt in blk.parts):
        return sum(int(pt.a.numel()) * int(pt.e.shape[-1]) for pt in blk.parts)
    return None


def _lent_order(blocks: Sequence) -> tuple[list, int]:
    """While a core is lent to the step's noise draw (:mod:`dpopt.core_loan`): the blocks whose weighted sums
    have at most :data:`~dpopt.core_loan.LENT_SUM_MACS` multiply-adds first (at two torch threads each small op
    waits ≈ 0.1 ms for torch's second thread), then the others in their order; and how many come first (the
    loan ends before the rest). The order of the sums changes no value."""
    small = [w is not None and w <= core_loan.LENT_SUM_MACS for w in map(_sum_macs, blocks)]
    first = [b for b, k in zip(blocks, small) if k]
    return first + [b for b, k in zip(blocks, small) if not k], len(first)


def _c_totals(per_param: Sequence[Optional[Tensor]], batch_size: int, dtype: torch.dtype) -> bool:
    """The group totals can go through the C pass (``sq_group_totals``): float32 norms, every one a plain
    contiguous ``[B]`` float32 CPU tensor that autograd does not record, B > 0."""
    if dtype != torch.float32 or batch_size == 0:
        return False
    return all(numpy_readable(v, torch.float32) and v.shape == (batch_size,) for v in per_param)


# --------------------------------------------------------------------------- capture
def _per_example_losses(loss_fn: LossFn, out: Tensor, y: Tensor) -> Tensor:
    """ℓ_r = loss_fn(out[r:r+1], y[r:r+1]) for all rows r, shape ``[n]``.

    One batched call for a recognised loss (:func:`~dpopt.engine.row_losses.recognised_row_losses`:
    ``cross_entropy`` / ``mse_loss`` as torch defines them), else vmap of the single-row call (the loop
    if vmap fails).
    """
    batched = recognised_row_losses(loss_fn, out, y)
    if batched is not None:
        return batched

    def one(o: Tensor, t: Tensor) -> Tensor:
        return example_loss(loss_fn(o.unsqueeze(0), t.unsqueeze(0)))

    try:
        return vmap(one)(out, y)
    except Exception:  # noqa: BLE001 — a loss vmap cannot batch: exact, slower loop
        return torch.stack([one(out[i], y[i]) for i in range(out.shape[0])])


def backward_macs(calls: Sequence[Call]) -> Optional[int]:
    """Multiply-adds of the recorded layers' input gradients in the backward to their outputs, when every
    recorded call is a layer mapping rows to rows (input ``[n, p]``, output ``[n, q]``: T = 1); None
    otherwise (not known to be small).

    Σ n·p·q over the recorded layers whose input needs a gradient: exact for a linear layer's input gradient,
    an upper bound for an elementwise one; a frozen (unrecorded) layer between trainable ones is not counted.
    What :func:`dpopt.core_loan.lend` compares with the noise draw's size.
    """
    total = 0
    for c in calls:
        inp, out = c.inp, c.out
        if inp is None or out is None or inp.dim() != 2 or out.dim() != 2:
            return None
        if inp.requires_grad:
            total += int(inp.shape[0]) * int(inp.shape[1]) * int(out.shape[1])
    return total


# --------------------------------------------------------------------------- the engine
class PerSampleEngine:
    """Plans a model once, then builds :class:`FastPerSampleGrads` for batches (dpopt's own loop).

    The capture is :mod:`dpopt.engine.capture` (shared with ``PrivacyEngine``'s
    :class:`~dpopt.engine.hooks.HookCapture`): this door runs the forward
    with the :class:`~dpopt.engine.capture.Recorder` attached, then
    differentiates the coefficient-weighted per-example losses w.r.t. the
    recorded layer outputs (no parameter gradient is formed).

    Args:
        model: the module (trainable parameters in ``named_parameters`` order,
            which is the optimizer's order in :mod:`dpopt.train`).
        loss_fn: ``loss_fn(out_r, target[1, ...]) -> scalar`` (see :mod:`dpopt.engine.reference`).
        verify: on the first non-empty batch of each train/eval mode signature,
            check that every layer with a fast rule keeps the examples along
            dim 0 and that its per-example squared norms and weighted sums equal
            those of single-example autograd (:meth:`_verify`); layers/parameters
            that do not move to the per-example ``torch.func`` path, with a warning.
        chunk_bytes, cache_bytes: the :class:`~dpopt.engine.layers.Budget` of
            each source (bytes); ``cache_bytes=None`` (default) derives the cache
            from the model and batch (:meth:`~dpopt.engine.capture.Plan.budget`),
            an int overrides it (0: never cache per-example gradients).
        norm_form: None (default): each factored layer's norm form from the cost model; ``"gram"``,
            ``"chol"`` or ``"direct"``: that form wherever it applies
            (:attr:`~dpopt.engine.layers.Budget.norm_form`; tests and measurements).
        rows_per_example: K ≥ 1. Rows ``i·K … i·K + K − 1`` of ``x`` and ``y``
            are K views (augmentations) of example i; its per-example gradient
            is the mean over its views, g_i = (1/K) Σ_v ∇ℓ(x_{iK+v}, y_{iK+v})
            (augmentation multiplicity, De et al. 2022), exact for every rule
            (:mod:`dpopt.engine.capture`). Sources have B = n/K examples;
            ``physical_batch_size`` of :meth:`iterate` counts examples (each
            chunk holds its examples' K rows: views are never split).
        compile: ``True`` (backend ``"inductor"``), a backend name in
            :data:`~dpopt.engine.compiled.COMPILE_BACKENDS`, or False: run the
            forward and the backward of the capture as one ``torch.compile``
            graph with taps on the planned layers (:mod:`dpopt.engine.compiled`).
            The first-batch check then runs on the compiled path (and again on
            a batch whose call compiled a new graph), and anything it finds
            refuses instead of moving to the per-example path. Needs ``verify``.

    Attributes:
        plan: the :class:`~dpopt.engine.capture.Plan`. fast_names,
        fallback_names: which trainable parameters use which path.

    Every batch (verified or not), each recorded layer call must have the
    rows as dim 0 of its input and output, else that layer is moved to the
    per-example path (with a warning) before any norm is computed.

    Raises:
        ValueError: ``rows_per_example`` < 1.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        verify: bool = True,
        chunk_bytes: int = 16 << 20,
        cache_bytes: Optional[int] = None,
        rows_per_example: int = 1,
        compile: object = False,
        norm_form: Optional[str] = None,
    ):
        if int(rows_per_example) != rows_per_example or rows_per_example < 1:
            raise ValueError(f"rows_per_example must be an integer >= 1, got {rows_per_example!r}")
        backend = compile_backend(compile)
        if backend is not None and not verify:
            raise refusal("verify=False would release the compiled capture's results unchecked")
        self.plan = Plan(model, chunk_bytes, cache_bytes, norm_form=norm_form)
        self.loss_fn = loss_fn
        self.views = int(rows_per_example)
        self._rec = Recorder(self.plan, tensor_hooks=False, guard_buffers=False)
        self._buffers: dict = {}  # the last buffer snapshot (inputs.snapshot_buffers), reused while unchanged
        self._modes = ModeCheck(verify)  # the train/eval mode signatures checked so far
        self._compiled = CompiledCapture(self.plan, backend) if backend is not None else None

    def close(self) -> None:
        """Remove what this engine left on the model (the compiled capture's hooks)."""
        if self._compiled is not None:
            self._compiled.detach()

    # -- the plan (engine.capture.Plan) ------------------------------------------------
    names = property(lambda self: self.plan.names)
    params = property(lambda self: self.plan.params)
    modules = property(lambda self: self.plan.modules)
    bare = property(lambda self: self.plan.bare)
    fallback = property(lambda self: self.plan.fallback)
    dtype = property(lambda self: self.plan.dtype)
    device = property(lambda self: self.plan.device)
    chunk_bytes = property(lambda self: self.plan.chunk_bytes)

    @property
    def cache_bytes(self) -> Optional[int]:
        """The cache override in bytes (None: derived per batch from the model and batch)."""
        return self.plan.cache_bytes

    @cache_bytes.setter
    def cache_bytes(self, value: Optional[int]) -> None:
        self.plan.cache_bytes = check_cache_bytes(value)

    @property
    def norm_form(self) -> Optional[str]:
        """The forced norm form of the factored layers (None: the cost model chooses per layer)."""
        return self.plan.norm_form

    @norm_form.setter
    def norm_form(self, value: Optional[str]) -> None:
        self.plan.norm_form = check_norm_form(value)

    model = property(lambda self: self.plan.model)

    def _fast_indices(self) -> list[int]:
        return self.plan.fast_indices()

    fast_names = property(lambda self: self.plan.fast_names)
    fallback_names = property(lambda self: self.plan.fallback_names)

    def matches(self, model: nn.Module) -> bool:
        """True if ``model`` still has the trainable parameters this plan was made for."""
        return self.plan.matches(model)

    # -- capture --------------------------------------------------------------------
    def _run(self, args: tuple, kwargs: dict, loss_of, offset=None, lend: bool = False) -> tuple[list[Call], dict]:
        """One forward (at θ + offset) with the recorder attached, then the output gradients of ``loss_of(out)``.

        ``loss_of(out) -> (loss, grad_outputs)``. With ``lend`` (the step's capture, not the first-batch
        check), once the forward is done the step's noise draw may be lent a core for the losses and the
        backward (:func:`dpopt.core_loan.lend`, on :func:`backward_macs`). A recorded tensor that a
        later in-place op modified is recorded from a copy and the pass
        redone; a bare parameter used otherwise than recognised moves to the
        per-example path and the pass is redone.
        """
        if self._compiled is not None:  # the compiled forward/backward (engine.compiled)
            if kwargs or len(args) != 1:
                raise refusal("the compiled capture takes the model's input as one positional tensor")
            # a batch of < 2 rows runs eagerly: dynamo would specialise its size, and inductor writes the
            # kernels of a graph to its on-disk code cache with static sizes as literals (a batch's size is private)
            if int(args[0].shape[0]) >= 2:
                return self._compiled.run(args[0], loss_of, offset), {}
        rec, model = self._rec, self.model
        if lend:  # a forward's GEMMs use every torch thread: an earlier point's loan ends here (DiSK: K points)
            core_loan.reclaim()
        for _attempt in range(3):
            rec.replayed = False
            rec.attach()
            try:
                with torch.enable_grad():
                    if offset is None:
                        out = model(*args, **kwargs)
                    else:
                        shifted = {k: p + o for k, p, o in zip(self.names, self.params, offset)}
                        out = functional_call(model, shifted, args, kwargs)
                    calls, other = rec.take()
                    if other:  # not a recognised broadcast (engine.bare): the per-example path, then redo
                        self._demote_bare(other)
                        continue
                    ins, outs = rec.modified(calls)
                    if ins or outs:  # a later in-place op changed what we recorded: clone it, redo
                        rec.clone_in |= ins
                        rec.clone_out |= outs
                        continue
                    rec.release_outputs(calls)  # the outputs' values are not needed: autograd frees what it can
                    if lend and not self.fallback:  # (the fallback's torch.func pass is no small work)
                        core_loan.lend(backward_macs(calls))
                    loss, grad_outputs = loss_of(out)
                    del out  # the root output (logits [B, T, V]): the loss's graph keeps what it needs
                    rec.fill(calls, loss, grad_outputs)
                    if offset is not None and rec.replayed:  # recomputed at θ, not at θ + offset
                        raise shifted_refused()
            finally:
                rec.detach()
            return calls, other
        raise RuntimeError("in-place modifications of layer inputs/outputs could not be worked around")

    def _capture(self, x: Tensor, y: Tensor, point: EvaluationPoint) -> list[Call]:
        """Calls of one forward/backward at θ + offset, with e = (coef/K)·∂ℓ_r/∂out_r (None if unused).

        Raises:
            OutputLayout: the model's output is not a tensor ``[n, ...]``.
        """
        n = int(y.shape[0])

        def loss_of(out):
            if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != n:
                raise OutputLayout(tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__)
            losses = _per_example_losses(self.loss_fn, out, y)
            return losses, torch.full_like(losses, float(point.coef) / self.views)

        return self._run((x,), {}, loss_of, point.offset, lend=True)[0]

    # -- demotions (this door's policy: the exact per-example path) -------------------
    def _demote(self, indices: Sequence[int]) -> None:
        """Move parameters to the per-example (torch.func) path; with ``compile``: refuse (nothing unchecked)."""
        if self._compiled is not None:
            raise refusal(
                f"the first-batch check found the compiled capture of {[self.names[i] for i in indices]} "
                "different from single-example eager autograd, or their layer does not keep the examples "
                "along dim 0 (see the warning above)"
            )
        self.plan.demote(indices)

    def _demote_bare(self, others: dict) -> None:
        for i, (m, op) in others.items():
            warnings.warn(
                f"parameter {self.names[i]!r} is used by {op} in the forward of "
                f"{self.plan.name_of(m)!r} ({type(m).__name__}); a bare parameter is captured "
                "per example only as P.expand(B, ...) or X + P (broadcast over the batch), so it uses the "
                "exact per-example torch.func path",
                RuntimeWarning,
                stacklevel=5,
            )
        self._demote(list(others))

    def _demote_layers(self, bad: dict) -> None:
        for m, (ins, outs) in bad.items():
            warnings.warn(demotion_warning(self.plan, m, ins, outs), RuntimeWarning, stacklevel=4)
            self._demote(list(self.modules.get(m, {}).values()))

    def _demote_all(self, shape) -> None:
        if self.modules:
            warnings.warn(
                f"the model's output ({public_shape(shape)}) does not have the examples along dim 0; all its "
                "parameters use the per-example torch.func path",
                RuntimeWarning,
                stacklevel=4,
            )
            self._demote([i for own in self.modules.values() for i in own.values()])

    def _demote_mixing(self, indices: list, why: str) -> None:
        warnings.warn(
            f"fast per-sample rules do not reproduce the per-example gradients of "
            f"{[self.names[i] for i in indices]} ({why}); they use the exact per-example path from now "
            "on, where each example's gradient is computed with the model seeing that example alone: a "
            "layer that mixes examples then behaves per example, not per batch, in the private "
            "gradients",
            RuntimeWarning,
            stacklevel=5,
        )
        self._demote(indices)

    # -- verification (dpopt.engine.capture.Recorder.check) ----------------------------
    @property
    def verified(self) -> bool:
        """True if the model's current train/eval mode (of every submodule) has been checked (or ``verify=False``)."""
        return not self._modes.needed(mode_signature(self.model)) and (
            not self._modes.enabled or self._modes.checked_size(signature(self.model, 0)) > 0
        )

    def _verify(self, x: Tensor, y: Tensor, key=None) -> None:
        """Once per mode signature: does every fast rule give the per-example gradients? Demote those that do not.

        In the model's own mode (the mode of the release: train mode with its
        real behaviour), on ≤ 8 distinct examples whose rows all have a finite
        loss (tiled when fewer), at two row counts that differ from every
        dimension in the model (so that dim 0 can only have that size if it
        is the example axis):

        1. the per-example path itself: vmap (each example its own random
           draws) against an exact loop of single-example autograd on two
           rows given vmap's draws (the loop is used from then on if
           they differ; a model the loop cannot run is refused);
        2. the shared check (:meth:`~dpopt.engine.capture.Recorder.check`):
           every recorded call must keep the rows along dim 0, and per
           parameter the per-example squared norms and a random weighted sum
           must equal those of single-example autograd, with the batched
           pass's random draws (dropout masks) replayed per example.

        A parameter that fails moves to the per-example path for good. If
        fewer than two examples have a finite loss, the check is postponed.
        ``key``: the :func:`~dpopt.engine.check.signature` this check vouches
        for (modes, module state, size class); a batch larger than the two
        small sizes is also checked at a size ≥ its own (the first 8
        examples compared).
        """
        sig = mode_signature(self.model) if key is None else key
        k = self.views
        with torch.no_grad():
            out = self.model(x)
            if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != y.shape[0]:
                self._demote_all(tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__)
                self._modes.done(sig)
                return
            finite = torch.isfinite(_per_example_losses(self.loss_fn, out, y)) & torch.isfinite(
                out.reshape(out.shape[0], -1)
            ).all(1)
            del out  # the batch's outputs (logits [B, T, V]) were alive through the whole check
        keep = torch.nonzero(finite.reshape(-1, k).all(1)).flatten()[:8]
        if keep.numel() < 2:  # one example tiled up cannot reveal a forward that mixes examples: wait
            return
        views = torch.arange(k, device=keep.device)
        sel = (keep.unsqueeze(1) * k + views).flatten()
        xs, ys = x[sel], y[sel]
        self._modes.done(sig)
        self._verify_reference(xs, ys)
        dims = model_dims(self.model, (xs,))
        sizes = free_sizes(dims, multiple=k)
        if y.shape[0] > sizes[-1]:  # and at this batch's size or above (a forward may mix only in large batches)
            sizes += free_sizes(dims, k=1, multiple=k, at_least=int(y.shape[0]))
        for n in sizes:
            if not self._fast_indices():
                break
            ex = torch.arange(n // k, device=keep.device) % keep.numel()
            rows = (ex.unsqueeze(1) * k + views).flatten()
            self._verify_at(xs[rows], ys[rows])

    def _verify_reference(self, xs: Tensor, ys: Tensor) -> None:
        """torch.func.vmap's per-example gradients against the loop's on two examples (else: the loop).

        Compared a group of whole layers at a time (:func:`_layer_groups`: at
        most about the largest parameter's size per group, each layer whole
        for its tolerance scale), so the two ``[2, *shape]`` references
        exist for one group at a time, never for the whole model (issue 43).
        """
        model, k = self.model, min(2, int(ys.shape[0]))
        if model in _LOOP_MODELS or not self.params:
            return
        tol = rtol(self.dtype, self.device)
        off: list[str] = []
        for group in _layer_groups(self.names, [p.numel() for p in self.params]):
            names = [self.names[i] for i in group]
            replay = RandomReplay(model)  # vmap's per-example draws given to the loop: the same masks on both sides
            try:
                with replay.recording():
                    v = per_sample_gradient_tensors(model, self.loss_fn, xs[:k], ys[:k], names=names, method="vmap")
            except Exception:  # noqa: BLE001 — vmap cannot batch it: the "auto" path uses the loop anyway
                return
            try:
                with replay.replaying(k):
                    loop = per_sample_gradient_tensors(model, self.loss_fn, xs[:k], ys[:k], names=names, method="loop")
            except Unreplayable as err:
                use_loop(model, f"its random draws under torch.func.vmap cannot be checked against the loop ({err})")
                return
            except ExampleFailed as err:  # the exact path cannot run it: refuse
                raise alone_failed(err.__cause__ or err) from err  # type: ignore[arg-type]
            scale = layer_scales(dict(enumerate(loop)), names)  # relative to the layer: exact zeros agree
            off += [
                n
                for j, (n, a, b) in enumerate(zip(names, v, loop))
                if not sum(sq_norm64(a_e - b_e) for a_e, b_e in zip(a, b)) ** 0.5
                <= tol * float(scale[j].sum().sqrt()) + 1e-30
            ]
            del v, loop
        if off:
            use_loop(model, f"torch.func.vmap disagreed with single-example autograd on {off}")

    def _run_check(self, args, kwargs, loss_of):
        return self._run(args, kwargs, lambda out: (loss_of(out), None))

    def _verify_at(self, xb: Tensor, yb: Tensor) -> None:
        n = int(yb.shape[0])

        def row_loss(out, sl: slice) -> Tensor:  # the real per-row losses: the outputs' values are tested too
            if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != sl.stop - sl.start:
                raise OutputLayout(tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__)
            return _per_example_losses(self.loss_fn, out, yb[sl])

        for _attempt in range(len(self.modules) + 1):
            try:
                bad, off = self._rec.check((xb,), {}, n, self.views, self._run_check, row_loss=row_loss, compare=8)
            except OutputLayout as err:
                self._demote_all(err.args[0])
                return
            except Unreplayable as err:
                self._demote_mixing(self._fast_indices(), str(err))
                return
            if bad:  # this size shows a layer whose dim 0 is not the example axis: demote, check the rest
                self._demote_layers(bad)
                if not self._fast_indices():
                    return
                continue
            if off:
                self._demote_mixing(
                    off,
                    "the forward mixes examples in this mode (e.g. batch statistics under "
                    "model.train()), or a parameter is used outside its module's forward",
                )
            return

    # -- public ------------------------------------------------------------------------
    def compute(
        self, x: Tensor, y: Tensor, points: Optional[Sequence[EvaluationPoint]] = None, batch_dim: int = 0
    ) -> FastPerSampleGrads:
        """Per-sample source for the examples of ``x`` (rows along ``batch_dim``) and ``y [n, ...]`` (n may be 0).

        Args:
            points: evaluation points (DiSK); default one point at θ with coef 1.
            batch_dim: x's row axis. The fast rules need it to be 0; for
                any other axis every parameter uses the per-example path.

        Returns:
            :class:`FastPerSampleGrads` of B = n / ``rows_per_example``
            examples, with one block per layer rule plus one
            :class:`~dpopt.engine.layers.DirectBlock` for the fallback parameters;
            ``params`` = the trainable parameters, ``points`` = the points given.

        Raises:
            ValueError: invalid inputs (:func:`~dpopt.engine.inputs.check_inputs`),
                n not a multiple of ``rows_per_example``, a model the
                per-example path cannot run on one example, or a forward pass
                that changes a buffer (:func:`~dpopt.engine.inputs.buffers_unchanged`).
        """
        # HF gradient checkpointing (engine.recompute): in the non-reentrant form (the reentrant one refuses
        # torch.autograd.grad), and off where functional_call binds other parameters (fallback, shifted points)
        shifted = any(p.offset is not None for p in points or ())
        hf = hf_checkpointing_off(self.model) if shifted or self.fallback else non_reentrant(self.model)
        with buffers_unchanged(self.model, reuse=self._buffers) as self._buffers, hf:  # buffer copies kept
            return self._compute(x, y, points, batch_dim)

    def _reference(self, x, y, pts, names=None, batch_dim: int = 0) -> list[Tensor]:
        """The per-example path's gradients of ``names``, averaged over each example's rows."""
        k = self.views
        grads = per_sample_gradient_tensors(self.model, self.loss_fn, x, y, pts, names=names, batch_dim=batch_dim)
        return grads if k == 1 else [g.reshape(g.shape[0] // k, k, *g.shape[1:]).mean(1) for g in grads]

    def _compute(
        self, x: Tensor, y: Tensor, points: Optional[Sequence[EvaluationPoint]], batch_dim: int
    ) -> FastPerSampleGrads:
        bd = check_inputs(x, y, batch_dim)
        pts = tuple(points) if points else (EvaluationPoint(1.0),)
        n = int(y.shape[0])
        b = check_views(n, self.views)
        if n == 0:
            blocks = [DirectBlock(list(range(len(self.params))), [p.new_zeros((0, *p.shape)) for p in self.params])]
            return self._source(blocks, 0, pts)
        if bd != 0:
            grads = self._reference(x, y, pts, batch_dim=bd)
            return self._source([DirectBlock(list(range(len(self.params))), grads)], b, pts)
        key = signature(self.model, b) if self._modes.enabled else None  # modes, module state, size class
        if key is not None and self._modes.needed(key):
            with preserved_state(self.model):  # the check's extra passes leave no buffer value or RNG draw behind
                self._verify(x, y, key)
        compiles = self._compiled.compiles if self._compiled is not None else 0
        try:
            calls = [c for pt in pts for c in self._capture(x, y, pt)]
        except OutputLayout as err:
            self._demote_all(err.args[0])
            return self._compute(x, y, pts, batch_dim)
        bad = self._rec.layout(calls, n)
        if bad:  # this batch size shows a layer whose dim 0 is not the example axis: demote, redo
            self._demote_layers(bad)
            return self._compute(x, y, pts, batch_dim)
        if self._compiled is not None and self._compiled.compiles > compiles and self._modes.enabled:
            with preserved_state(self.model):  # a graph no check has run: check it at this batch's size
                self._verify_at(x, y)
        with no_autocast(self.device):
            blocks = self.plan.blocks([(c, c.grads[0]) for c in calls if c.fast], n, None, self.views)
        if self.fallback:
            blocks.append(DirectBlock(self.fallback, self._reference(x, y, pts, self.fallback_names)))
        return self._source(blocks, b, pts)

    def _source(self, blocks: list, b: int, pts: tuple) -> FastPerSampleGrads:
        return FastPerSampleGrads(
            blocks, [p.shape for p in self.params], b, self.dtype, self.device, params=tuple(self.params), points=pts
        )

    def iterate(
        self,
        x: Tensor,
        y: Tensor,
        physical_batch_size: Optional[int] = None,
        points: Optional[Sequence[EvaluationPoint]] = None,
        batch_dim: int = 0,
    ) -> Iterator[FastPerSampleGrads]:
        """Yield sources for chunks of at most ``physical_batch_size`` examples, lazily.

        Each source is freed when the next one is requested, so at most one
        chunk's activations live at a time. An empty batch yields one empty
        source. Chunks are cut along ``batch_dim`` of x and dim 0 of y, at
        example boundaries (a chunk of P examples holds their P·K rows).

        Raises:
            ValueError: ``physical_batch_size`` ≤ 0, invalid inputs
                (:func:`~dpopt.engine.inputs.check_inputs`), or a row count that
                is not a multiple of ``rows_per_example``.
        """
        if physical_batch_size is not None and physical_batch_size <= 0:
            raise ValueError(f"physical_batch_size must be > 0, got {physical_batch_size}")
        bd = check_inputs(x, y, batch_dim)
        check_views(int(y.shape[0]), self.views)
        return self._chunks(x, y, physical_batch_size, points, bd)

    def _chunks(
        self,
        x: Tensor,
        y: Tensor,
        physical_batch_size: Optional[int],
        points: Optional[Sequence[EvaluationPoint]],
        bd: int,
    ) -> Iterator[FastPerSampleGrads]:
        n = int(y.shape[0])
        size = physical_batch_size * self.views if physical_batch_size else max(n, 1)
        if n == 0:
            yield self.compute(x, y, points, bd)
            return
        prev = None
        for s in range(0, n, size):
            if prev is not None:
                prev.free()
                prev = None
            m = min(size, n - s)
            src = self.compute(x.narrow(bd, s, m), y[s : s + m], points, bd)
            prev = src
            yield src
        if prev is not None:
            prev.free()


_ENGINES: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def get_engine(
    model: nn.Module, loss_fn: LossFn, rows_per_example: int = 1, compile: object = False
) -> PerSampleEngine:
    """The cached :class:`PerSampleEngine` of ``(model, loss_fn, rows_per_example, compile)`` (re-planned if the
    params changed; ``compile``: :class:`PerSampleEngine`'s).

    Raises:
        ValueError: a layer refused by :func:`~dpopt.models.check_model`, ``rows_per_example`` < 1, a model
            the compiled capture refuses (:class:`~dpopt.engine.compiled.CompiledCapture`).
    """
    per_loss = _ENGINES.setdefault(model, {})
    backend = compile_backend(compile)
    key = loss_fn if rows_per_example == 1 and backend is None else (loss_fn, int(rows_per_example), backend)
    eng = per_loss.get(key)
    if eng is None or not eng.matches(model):
        check_model(model)  # BatchNorm mixes examples: refuse before planning
        if eng is not None:
            eng.close()
        eng = per_loss[key] = PerSampleEngine(model, loss_fn, rows_per_example=rows_per_example, compile=backend)
    return eng


def fast_per_sample_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    x: Tensor,
    y: Tensor,
    points: Optional[Sequence[EvaluationPoint]] = None,
    batch_dim: int = 0,
    rows_per_example: int = 1,
) -> FastPerSampleGrads:
    """Fast counterpart of :func:`dpopt.engine.reference.per_sample_gradients` (same arguments).

    Returns a :class:`FastPerSampleGrads` whose ``sq_norms``/``weighted_sum``
    equal those of the reference :class:`~dpopt.engine.reference.PerSampleGrads` to
    float tolerance.
    """
    return get_engine(model, loss_fn, rows_per_example).compute(x, y, points, batch_dim)


def _layer_groups(names: Sequence[str], sizes: Sequence[int]) -> list[list[int]]:
    """Parameter indices in groups of whole layers (:func:`~dpopt.engine.check.layer_of`), each group's
    elements at most the largest parameter's (a layer larger than that alone), in parameter order."""
    layers: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        layers.setdefault(layer_of(n), []).append(i)
    budget = max(sizes, default=0)
    groups: list[list[int]] = []
    total = 0
    for idx in layers.values():
        size = sum(sizes[i] for i in idx)
        if groups and total + size <= budget:
            groups[-1] += idx
            total += size
        else:
            groups.append(list(idx))
            total = size
    return groups
