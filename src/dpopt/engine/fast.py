"""The fast per-sample source and the engine that captures layer inputs/output-gradients.

One forward and one backward pass of the batch per evaluation point: forward
hooks on the layers that have a fast rule record each call's input ``a`` and
output; ``torch.autograd.grad`` of the per-example losses (weighted by the
point's coefficient) w.r.t. those outputs gives ``e`` = ∂(coef·ℓ_i)/∂output_i
for every example at once (examples are independent: BatchNorm is refused by
:func:`~dpopt.models.check_model`). No parameter gradient is formed in that
backward pass — the weight gradients, which the non-private step pays for,
are replaced by the clipped sum Eᵀ diag(c) A computed later.

Rules (exact module types; subclasses fall back, since they may change ``forward``):

============  ===========================================  ==================
module        weight                                       other parameters
============  ===========================================  ==================
Linear        :class:`~.layers.FactoredBlock` (any ``...``)  bias: direct Σ_t e
Conv2d        FactoredBlock via im2col (groups = 1, any      bias: direct
              stride/dilation/padding/padding_mode)
Embedding     :class:`~.layers.SparseRowsBlock`              —
              (no ``max_norm``/``scale_grad_by_freq``)
LayerNorm     direct (x̂ ⊙ e summed)                          bias: direct
GroupNorm     direct (closed form from group stats)           bias: direct
============  ===========================================  ==================

Every other trainable parameter — of another layer type, shared between two
modules, or used outside its module's ``forward`` (detected once per model by
comparing Σ_i g_i with autograd's batch gradient on a few examples) — is
computed by the ``torch.func`` reference path for that parameter only.

DiSK evaluation points (Σ_k coef_k ∇ℓ(θ + offset_k; x_i)) are supported
exactly: each point is one more forward/backward, and its calls are
concatenated with the others along the position axis t of the factored form
(g_i = Σ_{k,t} coef_k e^k_it a^k_itᵀ), so multi-point norms use the Gram or
direct form.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from ..models import check_model
from ..per_sample import per_sample_gradient_tensors
from ..transforms.base import ClipGeometry, EvaluationPoint
from .layers import (Budget, ConvPart, DirectBlock, FactoredBlock, LinearPart, SparseRowsBlock,
                     group_norm_grads, layer_norm_grads)

__all__ = ["FastPerSampleGrads", "PerSampleEngine", "fast_per_sample_gradients", "get_engine"]

LossFn = Callable[[Tensor, Tensor], Tensor]


# --------------------------------------------------------------------------- the source
class FastPerSampleGrads:
    """Per-sample source in factored form (private): same interface as :class:`~dpopt.per_sample.PerSampleGrads`.

    Built by :class:`PerSampleEngine`; holds, per layer, what is needed to
    compute per-sample norms and clipped sums without materialising ``[B, d]``.

    Attributes:
        batch_size: B (private). num_params: number of trainable parameters.
        nonfinite: number of examples with a non-finite per-sample norm in the
            geometry of the last :meth:`sq_norms` call (private diagnostic);
            those examples are treated as having a zero gradient, exactly like
            the reference path (their w_i = −shift/scale, clipped as usual).

    The Privatizer calls :meth:`sq_norms` then :meth:`weighted_sum` with the
    same geometry; a factored layer may keep per-sample gradients between the
    two calls (within its :class:`~dpopt.engine.layers.Budget`).
    """

    def __init__(self, blocks: Sequence, shapes: Sequence[torch.Size], batch_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.blocks = list(blocks)
        self.shapes = [torch.Size(s) for s in shapes]
        self.batch_size = int(batch_size)
        self.dtype, self.device = dtype, device
        covered = sorted(i for blk in self.blocks for i in blk.index)
        if covered != list(range(len(self.shapes))):
            raise ValueError("blocks must cover every trainable parameter exactly once")
        self._bad: Optional[Tensor] = None
        self._freed = False

    @property
    def num_params(self) -> int:
        return len(self.shapes)

    @property
    def nonfinite(self) -> int:
        if self._bad is None:
            self.sq_norms(ClipGeometry(), [0] * self.num_params, 1)
        return int(self._bad.sum())  # type: ignore[union-attr]

    def _check(self) -> None:
        if self._freed:
            raise RuntimeError("this per-sample source was freed (sources from an iterator are valid "
                               "until the next one is requested); consume them one at a time")

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
        per_param: list[Optional[Tensor]] = [None] * self.num_params
        for blk in self.blocks:
            for i, v in zip(blk.index, blk.sq_norms([self._geo(geometry, i) for i in blk.index])):
                per_param[i] = v
        bad = torch.zeros(self.batch_size, dtype=torch.bool, device=self.device)
        for v in per_param:
            bad |= ~torch.isfinite(v)  # type: ignore[arg-type]
        self._bad = bad
        out = torch.zeros(self.batch_size, num_groups, dtype=self.dtype, device=self.device)
        any_bad = bool(bad.any())
        for i, (v, k) in enumerate(zip(per_param, groups)):
            if any_bad:
                m, b = self._geo(geometry, i)
                zero = ((m / b) if (m is not None and b is not None) else m)
                zero_sq = zero.square().sum() if zero is not None else torch.zeros((), dtype=self.dtype)
                v = torch.where(bad, zero_sq.to(self.dtype), v)  # type: ignore[arg-type]
            out[:, k] += v  # type: ignore[operator]
        return out

    def weighted_sum(self, weights: Tensor, geometry: ClipGeometry, groups: Sequence[int]) -> list[Tensor]:
        """Σ_i weights[i, group(p)] · w_i(p) for every parameter p (param-shaped).

        Computed as (Σ_i c_i g_i − (Σ_i c_i)·shift)/scale with Σ_i c_i g_i from
        the factored form (non-finite examples contribute g_i = 0).
        """
        self._check()
        if self._bad is None:
            _ = self.nonfinite
        bad = self._bad if bool(self._bad.any()) else None  # type: ignore[union-attr]
        coefs = [weights[:, k].to(self.dtype) for k in groups]
        masked = [torch.where(bad, torch.zeros((), dtype=c.dtype), c) if bad is not None else c
                  for c in coefs]
        out: list[Optional[Tensor]] = [None] * self.num_params
        for blk in self.blocks:
            sums = blk.grad_sums([masked[i] for i in blk.index], bad)
            for i, s in zip(blk.index, sums):
                out[i] = s
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
        return {blk.index[0]: blk.form for blk in self.blocks if isinstance(blk, FactoredBlock)}


# --------------------------------------------------------------------------- rules
_SUPPORTED = (nn.Linear, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.GroupNorm)


def _rule_ok(module: nn.Module) -> bool:
    t = type(module)
    if t not in _SUPPORTED:
        return False
    if t is nn.Conv2d:
        return module.groups == 1
    if t is nn.Embedding:
        return module.max_norm is None and not module.scale_grad_by_freq
    return True


def _per_example_losses(loss_fn: LossFn, out: Tensor, y: Tensor) -> Tensor:
    """ℓ_i = loss_fn(out[i:i+1], y[i:i+1]) for all i, shape ``[B]`` (vmap; loop if vmap fails)."""
    def one(o: Tensor, t: Tensor) -> Tensor:
        return loss_fn(o.unsqueeze(0), t.unsqueeze(0))

    try:
        return vmap(one)(out, y)
    except Exception:  # noqa: BLE001 — a loss vmap cannot batch: exact, slower loop
        return torch.stack([one(out[i], y[i]) for i in range(out.shape[0])])


class _Call:
    """One recorded call of a planned module: its input, output and (norm layers) saved statistics."""

    __slots__ = ("module", "inp", "out", "in_version", "out_version", "stats")

    def __init__(self, module, inp, out):
        self.module, self.inp, self.out = module, inp, out
        self.in_version, self.out_version = inp._version, out._version
        self.stats = None
        gf = getattr(out, "grad_fn", None)
        # mean and 1/std that autograd saved for the norm layer's backward (avoids recomputing them)
        if type(gf).__name__ in ("NativeGroupNormBackward0", "NativeLayerNormBackward0"):
            try:
                self.stats = (gf._saved_result1, gf._saved_result2)
            except AttributeError:  # pragma: no cover - other torch versions
                self.stats = None


# --------------------------------------------------------------------------- the engine
class PerSampleEngine:
    """Plans a model once, then builds :class:`FastPerSampleGrads` for batches.

    Args:
        model: the module (trainable parameters in ``named_parameters`` order,
            which is the optimizer's order in :mod:`dpopt.train`).
        loss_fn: ``loss_fn(logits[1, ...], target[1, ...]) -> scalar``.
        verify: once per model, check on ≤ 8 examples that the fast rules
            reproduce autograd's batch gradient; parameters that do not (e.g.
            used outside their module's ``forward``) move to the reference path,
            with a warning.
        chunk_bytes, cache_bytes: the :class:`~dpopt.engine.layers.Budget` of
            each source (bytes).

    Attributes:
        fast_names, fallback_names: which trainable parameters use which path.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, verify: bool = True,
                 chunk_bytes: int = 16 << 20, cache_bytes: int = 256 << 20):
        self._model = weakref.ref(model)  # the engine cache is keyed weakly by the model
        self.loss_fn = loss_fn
        self.chunk_bytes, self.cache_bytes = int(chunk_bytes), int(cache_bytes)
        named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
        self.names = [k for k, _ in named]
        self.params = [p for _, p in named]
        self._key = tuple(id(p) for p in self.params)
        index = {id(p): i for i, p in enumerate(self.params)}
        owners: dict[int, int] = {}
        for m in model.modules():
            for p in m._parameters.values():
                if p is not None:
                    owners[id(p)] = owners.get(id(p), 0) + 1
        # module -> {param attribute name: param index} for params with a fast rule
        self.modules: dict[nn.Module, dict[str, int]] = {}
        for m in model.modules():
            if not _rule_ok(m):
                continue
            own = {}
            for attr, p in m._parameters.items():
                if p is not None and id(p) in index and owners[id(p)] == 1:
                    own[attr] = index[id(p)]
            if own:
                self.modules[m] = own
        covered = {i for own in self.modules.values() for i in own.values()}
        self.fallback = [i for i in range(len(self.params)) if i not in covered]
        self._clone_in: set = set()
        self._clone_out: set = set()
        self.verified = not verify
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.device = self.params[0].device if self.params else torch.device("cpu")

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this PerSampleEngine no longer exists")
        return model

    @property
    def fast_names(self) -> list[str]:
        fb = set(self.fallback)
        return [n for i, n in enumerate(self.names) if i not in fb]

    @property
    def fallback_names(self) -> list[str]:
        return [self.names[i] for i in self.fallback]

    def matches(self, model: nn.Module) -> bool:
        """True if ``model`` still has the trainable parameters this plan was made for."""
        return model is self._model() and tuple(
            id(p) for p in model.parameters() if p.requires_grad) == self._key

    # -- capture --------------------------------------------------------------------
    def _capture(self, x: Tensor, y: Tensor, point: EvaluationPoint) -> list[tuple[_Call, Optional[Tensor]]]:
        """One forward/backward at θ + offset: [(call, e = coef·∂ℓ/∂out)], e None if unused."""
        for _attempt in range(3):
            calls: list[_Call] = []

            def hook(module, args, kwargs, out):
                inp = args[0] if args else next(iter(kwargs.values()))
                if module in self._clone_in:  # keep a copy a later in-place op cannot touch
                    inp = inp.clone()
                calls.append(_Call(module, inp, out))
                # downstream in-place ops then modify the clone, not the tensor we differentiate
                return out.clone() if module in self._clone_out else out

            handles = [m.register_forward_hook(hook, with_kwargs=True) for m in self.modules]
            try:
                with torch.enable_grad():
                    if point.offset is None:
                        out = self.model(x)
                    else:
                        shifted = {k: p + o for k, p, o in zip(self.names, self.params, point.offset)}
                        out = functional_call(self.model, shifted, (x,))
                    losses = _per_example_losses(self.loss_fn, out, y)
                    retry = False
                    for c in calls:  # a later in-place op changed what we recorded: clone it
                        if c.out._version != c.out_version:
                            self._clone_out.add(c.module)
                            retry = True
                        if c.inp._version != c.in_version:
                            self._clone_in.add(c.module)
                            retry = True
                    if retry:
                        continue
                    if not calls:
                        return []
                    es = torch.autograd.grad(losses, [c.out for c in calls],
                                             grad_outputs=torch.full_like(losses, float(point.coef)),
                                             allow_unused=True)
            finally:
                for h in handles:
                    h.remove()
            return [(c, e) for c, e in zip(calls, es)]
        raise RuntimeError("in-place modifications of layer inputs/outputs could not be worked around")

    def _blocks(self, captured: list[tuple[_Call, Optional[Tensor]]], b: int, budget: Budget) -> list:
        per_module: dict[nn.Module, list[tuple[Tensor, Tensor]]] = {m: [] for m in self.modules}
        stats: dict[nn.Module, list] = {m: [] for m in self.modules}
        for c, e in captured:
            if e is not None:
                per_module[c.module].append((c.inp.detach(), e.detach()))
                stats[c.module].append(None if c.stats is None else tuple(t.detach() for t in c.stats))
        blocks: list = []
        for m, own in self.modules.items():
            calls = per_module[m]
            idx_w, idx_b = own.get("weight"), own.get("bias")
            shapes = {a: self.params[i].shape for a, i in own.items()}
            if not calls:  # never called (or unused): zero per-sample gradients
                blocks.append(DirectBlock(list(own.values()),
                                          [self.params[i].new_zeros((b, *self.params[i].shape))
                                           for i in own.values()]))
                continue
            t = type(m)
            if t is nn.Linear:
                if idx_w is not None:
                    blocks.append(FactoredBlock(idx_w, shapes["weight"], [LinearPart(a, e) for a, e in calls],
                                                budget, b))
                if idx_b is not None:
                    blocks.append(DirectBlock([idx_b], [sum(e.reshape(b, -1, e.shape[-1]).sum(1)
                                                            for _, e in calls)]))
            elif t is nn.Conv2d:
                if idx_w is not None:
                    blocks.append(FactoredBlock(idx_w, shapes["weight"], [ConvPart(m, a, e) for a, e in calls],
                                                budget, b))
                if idx_b is not None:
                    blocks.append(DirectBlock([idx_b], [sum(e.sum((2, 3)) for _, e in calls)]))
            elif t is nn.Embedding:
                blocks.append(SparseRowsBlock(idx_w, m.num_embeddings, m.padding_idx, calls, b))
            else:
                if t is nn.GroupNorm:
                    grads = [group_norm_grads(a, e, m.num_groups, m.eps, st)
                             for (a, e), st in zip(calls, stats[m])]
                else:
                    grads = [layer_norm_grads(a, e, m.normalized_shape, m.eps, st)
                             for (a, e), st in zip(calls, stats[m])]
                dw = sum(g[0] for g in grads)
                db = sum(g[1] for g in grads)
                if idx_w is not None:
                    blocks.append(DirectBlock([idx_w], [dw]))
                if idx_b is not None:
                    blocks.append(DirectBlock([idx_b], [db]))
        return blocks

    # -- verification -------------------------------------------------------------
    def _verify(self, x: Tensor, y: Tensor) -> None:
        """Once per model: do the fast rules reproduce autograd's Σ_i g_i? Demote those that do not.

        Uses ≤ 8 examples with a finite loss; if their batch gradient is not
        finite either, the check is postponed to the next batch.
        """
        covered = [i for i in range(len(self.params)) if i not in set(self.fallback)]
        if not covered:
            self.verified = True
            return
        with torch.no_grad():
            finite = torch.isfinite(_per_example_losses(self.loss_fn, self.model(x), y))
        keep = torch.nonzero(finite).flatten()[:8]
        if keep.numel() == 0:
            return
        xs, ys = x[keep], y[keep]
        n = int(keep.numel())
        with torch.enable_grad():
            ref = torch.autograd.grad(_per_example_losses(self.loss_fn, self.model(xs), ys).sum(),
                                      [self.params[i] for i in covered], allow_unused=True)
        ref = [torch.zeros_like(self.params[i]) if r is None else r for i, r in zip(covered, ref)]
        if not all(bool(torch.isfinite(r).all()) for r in ref):
            return
        self.verified = True
        blocks = self._blocks(self._capture(xs, ys, EvaluationPoint(1.0)), n, Budget(0, 0))
        ones = torch.ones(n, dtype=self.dtype, device=self.device)
        fast: dict[int, Tensor] = {}
        for blk in blocks:
            for i, s in zip(blk.index, blk.grad_sums([ones] * len(blk.index), None)):
                fast[i] = s
        bad = []
        for i, r in zip(covered, ref):
            err = float((fast[i] - r).norm())
            if not math.isfinite(err) or err > 1e-3 * float(r.norm()) + 1e-6 * math.sqrt(r.numel()):
                bad.append(i)
        if bad:
            names = [self.names[i] for i in bad]
            warnings.warn(f"fast per-sample rules do not reproduce the gradient of {names} (parameter used "
                          "outside its module's forward?); using the torch.func reference path for them",
                          RuntimeWarning, stacklevel=3)
            self.fallback = sorted(set(self.fallback) | set(bad))
            for m in list(self.modules):
                own = {a: i for a, i in self.modules[m].items() if i not in set(bad)}
                if own:
                    self.modules[m] = own
                else:
                    del self.modules[m]

    # -- public ------------------------------------------------------------------------
    def compute(self, x: Tensor, y: Tensor, points: Optional[Sequence[EvaluationPoint]] = None
                ) -> FastPerSampleGrads:
        """Per-sample source for the examples ``x [B, ...]``, ``y [B, ...]`` (B may be 0).

        Args:
            points: evaluation points (DiSK); default one point at θ with coef 1.

        Returns:
            :class:`FastPerSampleGrads` with one block per layer rule plus one
            :class:`~dpopt.engine.layers.DirectBlock` for the fallback parameters.
        """
        points = list(points) if points else [EvaluationPoint(1.0)]
        b = int(x.shape[0])
        shapes = [p.shape for p in self.params]
        if b == 0:
            blocks = [DirectBlock(list(range(len(self.params))),
                                  [p.new_zeros((0, *p.shape)) for p in self.params])]
            return FastPerSampleGrads(blocks, shapes, 0, self.dtype, self.device)
        if not self.verified:
            self._verify(x, y)
        budget = Budget(self.chunk_bytes, self.cache_bytes)
        captured = []
        for pt in points:
            captured.extend(self._capture(x, y, pt))
        blocks = self._blocks(captured, b, budget)
        if self.fallback:
            grads = per_sample_gradient_tensors(self.model, self.loss_fn, x, y, points,
                                                names=[self.names[i] for i in self.fallback])
            blocks.append(DirectBlock(self.fallback, grads))
        return FastPerSampleGrads(blocks, shapes, b, self.dtype, self.device)

    def iterate(self, x: Tensor, y: Tensor, physical_batch_size: Optional[int] = None,
                points: Optional[Sequence[EvaluationPoint]] = None) -> Iterator[FastPerSampleGrads]:
        """Yield sources for chunks of at most ``physical_batch_size`` examples, lazily.

        Each source is freed when the next one is requested, so at most one
        chunk's activations live at a time. An empty batch yields one empty source.

        Raises:
            ValueError: ``physical_batch_size`` ≤ 0.
        """
        if physical_batch_size is not None and physical_batch_size <= 0:
            raise ValueError(f"physical_batch_size must be > 0, got {physical_batch_size}")
        return self._chunks(x, y, physical_batch_size, points)

    def _chunks(self, x: Tensor, y: Tensor, physical_batch_size: Optional[int],
                points: Optional[Sequence[EvaluationPoint]]) -> Iterator[FastPerSampleGrads]:
        n = int(x.shape[0])
        size = physical_batch_size or max(n, 1)
        if n == 0:
            yield self.compute(x, y, points)
            return
        prev = None
        for s in range(0, n, size):
            if prev is not None:
                prev.free()
                prev = None
            src = self.compute(x[s:s + size], y[s:s + size], points)
            prev = src
            yield src
        if prev is not None:
            prev.free()


_ENGINES: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def get_engine(model: nn.Module, loss_fn: LossFn) -> PerSampleEngine:
    """The cached :class:`PerSampleEngine` of ``(model, loss_fn)`` (re-planned if the params changed)."""
    per_loss = _ENGINES.setdefault(model, {})
    eng = per_loss.get(loss_fn)
    if eng is None or not eng.matches(model):
        check_model(model)  # BatchNorm mixes examples: refuse before planning
        eng = per_loss[loss_fn] = PerSampleEngine(model, loss_fn)
    return eng


def fast_per_sample_gradients(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor,
                              points: Optional[Sequence[EvaluationPoint]] = None) -> FastPerSampleGrads:
    """Fast counterpart of :func:`dpopt.per_sample.per_sample_gradients` (same arguments).

    Returns a :class:`FastPerSampleGrads` whose ``sq_norms``/``weighted_sum``
    equal those of the reference :class:`~dpopt.per_sample.PerSampleGrads` to
    float tolerance.
    """
    return get_engine(model, loss_fn).compute(x, y, points)
