"""The fast per-sample source and the engine that captures layer inputs/output-gradients.

One forward and one backward pass of the batch per evaluation point: forward
hooks on the layers that have a fast rule record each call's input ``a`` and
output; ``torch.autograd.grad`` of the per-example losses (weighted by the
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
* on the first batch in each train/eval mode signature (a change of
  ``model.training`` of any submodule re-runs it), in that mode, at two batch
  sizes that differ from every dimension of the model's parameters, buffers
  and module inputs/outputs, the fast per-example squared norms and a
  weighted sum are compared with an exact loop of single-example autograd on
  a few examples, the batched pass's dropout masks replayed per example
  (which catches a forward that mixes examples — also one that mixes only in
  train mode — and parameters used outside their module); the reference path
  itself is first checked (vmap against the loop). The check is
  :mod:`dpopt.engine.check`, shared with the hook path; see
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

from ..models import check_model
from ..types import ClipGeometry, EvaluationPoint
from .check import (ModeCheck, RandomReplay, Unreplayable, alone_failed, disagreeing, free_sizes, layer_scales,
                    mode_signature,
                    model_dims, off_axis, rtol)
from .bare import bare_candidates, reduce_to, tap_bare
from . import hf_rules  # noqa: F401 — puts the transformers layers' rules in rules.LAZY_RULES
from .hf_guards import in_backward, recomputed, refuse_checkpointing
from .inputs import LossFn, buffers_unchanged, check_inputs, example_loss
from .layers import Budget, DirectBlock, FactoredBlock
from .reference import _LOOP_MODELS, ExampleFailed, per_sample_gradient_tensors, use_loop
from .rules import RULES, LayerCalls, is_tapped, rule_for, tap_forwards
from .tied import merge_shared

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

    Norms and sums are computed outside autocast, in the parameters' dtype.

    The Privatizer calls :meth:`sq_norms` then :meth:`weighted_sum` with the
    same geometry; a factored layer may keep per-sample gradients between the
    two calls (within its :class:`~dpopt.engine.layers.Budget`).
    """

    def __init__(self, blocks: Sequence, shapes: Sequence[torch.Size], batch_size: int,
                 dtype: torch.dtype, device: torch.device, *, params: Optional[Sequence[Tensor]] = None,
                 points: Optional[Sequence[EvaluationPoint]] = None):
        self.blocks = list(blocks)
        self.params = None if params is None else tuple(params)
        self.points = None if points is None else tuple(points)
        self.shapes = [torch.Size(s) for s in shapes]
        self.batch_size = int(batch_size)
        self.dtype, self.device = dtype, device
        covered = sorted(i for blk in self.blocks for i in blk.index)
        if covered != list(range(len(self.shapes))):  # an engine invariant (tied parameters: engine.tied)
            twice = sorted({i for i in covered if covered.count(i) > 1})
            missing = sorted(set(range(len(self.shapes))) - set(covered))
            raise ValueError(f"internal error: per-sample blocks cover trainable parameters {twice} more than once "
                             f"and miss {missing} (indices in named_parameters order of the trainable ones)")
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
        with _no_autocast(self.device):
            return self._sq_norms(geometry, groups, num_groups)

    def _sq_norms(self, geometry: ClipGeometry, groups: Sequence[int], num_groups: int) -> Tensor:
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
        with _no_autocast(self.device):
            return self._weighted_sum(weights, geometry, groups)

    def _weighted_sum(self, weights: Tensor, geometry: ClipGeometry, groups: Sequence[int]) -> list[Tensor]:
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


# --------------------------------------------------------------------------- capture
def _per_example_losses(loss_fn: LossFn, out: Tensor, y: Tensor) -> Tensor:
    """ℓ_i = loss_fn(out[i:i+1], y[i:i+1]) for all i, shape ``[B]`` (vmap; loop if vmap fails)."""
    def one(o: Tensor, t: Tensor) -> Tensor:
        return example_loss(loss_fn(o.unsqueeze(0), t.unsqueeze(0)))

    try:
        return vmap(one)(out, y)
    except Exception:  # noqa: BLE001 — a loss vmap cannot batch: exact, slower loop
        return torch.stack([one(out[i], y[i]) for i in range(out.shape[0])])


class _Call:
    """One recorded call of a planned module: its input, output and (norm layers) saved statistics."""

    __slots__ = ("module", "inp", "out", "in_version", "out_version", "stats", "tag")

    def __init__(self, module, inp, out, tag=None):
        self.module, self.inp, self.out, self.tag = module, inp, out, tag  # tag: of a tapped forward's map
        self.in_version, self.out_version = inp._version, out._version
        self.stats = None
        gf = getattr(out, "grad_fn", None)
        # mean and 1/std that autograd saved for the norm layer's backward (avoids recomputing them)
        if type(gf).__name__ in ("NativeGroupNormBackward0", "NativeLayerNormBackward0"):
            try:
                self.stats = (gf._saved_result1, gf._saved_result2)
            except AttributeError:  # pragma: no cover - other torch versions
                self.stats = None


def expand_broadcast(module: nn.Module, inp, out, b: int):
    """A call shared by the batch made per example: an ``nn.Embedding`` of ``[1, ...]`` ids → ``[b, ...]``.

    HF GPT-2/BERT look up position ids of shape ``[1, T]`` and add the
    ``[1, T, D]`` result to the ``[B, T, D]`` token embeddings: autograd sums
    that output's gradient over the batch, so the per-example gradient of the
    position table is lost there. Returning the output expanded to
    ``[b, T, D]`` (a view: the same values, the same broadcast sum) makes its
    gradient per example, ``[b, T, D]``, exact; the ids are expanded alike.
    Anything else is returned unchanged (and checked by the layout test).

    Args:
        module: the called layer; inp: its first input; out: its output; b: the batch size.

    Returns:
        ``(inp, out)``, expanded or as given.
    """
    if (b > 1 and type(module) is nn.Embedding and isinstance(inp, Tensor) and isinstance(out, Tensor)
            and inp.dim() >= 1 and inp.shape[0] == 1 and out.dim() == inp.dim() + 1 and out.shape[0] == 1):
        return inp.expand(b, *inp.shape[1:]), out.expand(b, *out.shape[1:])
    return inp, out


class _BareCall(_Call):
    """A recognised use of a bare parameter (engine.bare): R = broadcast(P) ``[B, ...]`` and P's index."""

    __slots__ = ("index",)

    def __init__(self, module, r: Tensor, index: int):
        super().__init__(module, r, r)
        self.index = int(index)


# --------------------------------------------------------------------------- messages
def _trailing(shape) -> str:
    """A shape without its dim 0 (``(…, 4, 16)``): dim 0 of a private batch is its realised size."""
    if not isinstance(shape, tuple):
        return str(shape)
    return "(…" + "".join(f", {d}" for d in shape[1:]) + ")"


class _OutputLayout(Exception):
    """The model's output does not have the examples along dim 0."""


def _no_autocast(device: torch.device):
    """The engine's own norm/sum math runs exactly, in the parameters' dtype, outside autocast."""
    return torch.autocast(device_type=device.type, enabled=False)


# --------------------------------------------------------------------------- the engine
class PerSampleEngine:
    """Plans a model once, then builds :class:`FastPerSampleGrads` for batches.

    Args:
        model: the module (trainable parameters in ``named_parameters`` order,
            which is the optimizer's order in :mod:`dpopt.train`).
        loss_fn: ``loss_fn(out_i, target[1, ...]) -> scalar`` (see :mod:`dpopt.engine.reference`).
        verify: on the first non-empty batch, check that every layer with a
            fast rule keeps the examples along dim 0 and that its per-example
            squared norms and weighted sums equal those of the per-example
            ``torch.func`` path (:meth:`_verify`); layers/parameters that do not
            move to that path, with a warning.
        chunk_bytes, cache_bytes: the :class:`~dpopt.engine.layers.Budget` of
            each source (bytes).

    Attributes:
        fast_names, fallback_names: which trainable parameters use which path.

    Every batch (verified or not), each recorded layer call must have the
    batch size as dim 0 of its input and output, else that layer is moved to
    the per-example path (with a warning) before any norm is computed.
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
        self._module_names = {id(m): n or "<root>" for n, m in model.named_modules()}  # ids: no strong refs
        index = {id(p): i for i, p in enumerate(self.params)}
        # a parameter is on the fast path if EVERY module that owns it has a rule; a tied parameter
        # (several owners) then gets one block per use, summed with its cross terms (engine.tied)
        ruled: dict[int, bool] = {}
        for m in model.modules():
            has_rule = rule_for(m) is not None
            for p in m._parameters.values():
                if p is not None:
                    ruled[id(p)] = ruled.get(id(p), True) and has_rule
        # module -> {param attribute name: param index} for params with a fast rule
        self.modules: dict[nn.Module, dict[str, int]] = {}
        for m in model.modules():
            if rule_for(m) is None:
                continue
            own = {}
            for attr, p in m._parameters.items():
                if p is not None and id(p) in index and ruled[id(p)]:
                    own[attr] = index[id(p)]
            if own:
                self.modules[m] = own
        # bare broadcast parameters (ViT's class token), captured where their owner's forward uses them
        self.bare: dict[nn.Module, dict[str, int]] = bare_candidates(model, index, lambda m: rule_for(m) is not None)
        covered = set(self._fast_indices())
        self.fallback = [i for i in range(len(self.params)) if i not in covered]
        self._clone_in: set = set()
        self._clone_out: set = set()
        self._buffers: dict = {}  # the last buffer snapshot (inputs.snapshot_buffers), reused while unchanged
        self._modes = ModeCheck(verify)  # the train/eval mode signatures checked so far
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.device = self.params[0].device if self.params else torch.device("cpu")

    def _fast_indices(self) -> list[int]:
        """Indices of the parameters on the fast path: of the layer rules and the bare-parameter taps."""
        return sorted({i for own in list(self.modules.values()) + list(self.bare.values()) for i in own.values()})

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
        """One forward/backward at θ + offset: [(call, e = coef·∂ℓ/∂out)], e None if unused.

        Raises:
            _OutputLayout: the model's output is not a tensor ``[B, ...]``.
        """
        b = int(y.shape[0])
        for _attempt in range(3):
            calls: list[_Call] = []

            def hook(module, args, kwargs, out):
                if in_backward():
                    raise recomputed(self._module_names.get(id(module), "?"), module)
                if is_tapped(module):  # its maps were recorded by its tapped forward (tap below)
                    return None
                inp = args[0] if args else next(iter(kwargs.values()))
                inp, out = expand_broadcast(module, inp, out, b)
                if module in self._clone_in:  # keep a copy a later in-place op cannot touch
                    inp = inp.clone()
                calls.append(_Call(module, inp, out))
                # downstream in-place ops then modify the clone, not the tensor we differentiate
                return out.clone() if module in self._clone_out else out

            def tap(module, a, o, tag):  # a linear map inside a tapped layer (rules.Rule.forward)
                if in_backward():
                    raise recomputed(self._module_names.get(id(module), "?"), module)
                if module in self.modules:
                    calls.append(_Call(module, a.clone() if module in self._clone_in else a, o, tag))

            handles = [m.register_forward_hook(hook, with_kwargs=True) for m in self.modules]
            others: dict = {}  # bare parameters used otherwise than recognised: index -> op
            handles += tap_bare(self.bare, lambda: b, lambda m, i, r: calls.append(_BareCall(m, r, i)),
                                lambda m, i, op: others.setdefault(i, (m, op)))
            untap = tap_forwards(self.model, tap)
            try:
                with torch.enable_grad():
                    if point.offset is None:
                        out = self.model(x)
                    else:
                        shifted = {k: p + o for k, p, o in zip(self.names, self.params, point.offset)}
                        out = functional_call(self.model, shifted, (x,))
                    if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != b:
                        raise _OutputLayout(tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__)
                    if others:  # not a recognised broadcast (engine.bare): the per-example path, then redo
                        self._demote_bare(others)
                        continue
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
                untap()
                for h in handles:
                    h.remove()
            return [(c, e) for c, e in zip(calls, es)]
        raise RuntimeError("in-place modifications of layer inputs/outputs could not be worked around")

    def _blocks(self, captured: list[tuple[_Call, Optional[Tensor]]], b: int, budget: Budget) -> list:
        """Blocks of the fast layers, in the parameters' dtype (activations from autocast are cast up)."""
        per_module: dict[nn.Module, list[tuple[Tensor, Tensor]]] = {m: [] for m in self.modules}
        stats: dict[nn.Module, list] = {m: [] for m in self.modules}
        tags: dict[nn.Module, list] = {m: [] for m in self.modules}
        bare: dict[int, list] = {i: [] for own in self.bare.values() for i in own.values()}
        for c, e in captured:
            if isinstance(c, _BareCall):
                if e is not None and c.index in bare:
                    bare[c.index].append(reduce_to(e.detach().to(self.params[c.index].dtype), tuple(c.out.shape),
                                                   tuple(self.params[c.index].shape)))
                continue
            if e is not None:
                dt = self.params[next(iter(self.modules[c.module].values()))].dtype
                a = c.inp.detach()
                a = a.to(dt) if a.is_floating_point() else a
                per_module[c.module].append((a, e.detach().to(dt)))
                stats[c.module].append(None if c.stats is None else tuple(t.detach().to(dt) for t in c.stats))
                tags[c.module].append(c.tag)
        blocks: list = []
        for m, own in self.modules.items():
            if per_module[m]:
                blocks.extend(self._module_blocks(m, own, per_module[m], stats[m], b, budget, tags[m]))
        covered = {i for blk in blocks for i in blk.index}  # a layer never called (or unused): zero gradients,
        idle = sorted({i for own in self.modules.values() for i in own.values()} - covered)  # once per parameter
        if idle:  # (a tied weight whose other use was called is covered there, without a zero [B, V, D])
            blocks.append(DirectBlock(idle, [self.params[i].new_zeros((b, *self.params[i].shape)) for i in idle]))
        for i, gs in bare.items():  # bare parameters: Σ over their recognised uses (engine.bare)
            blocks.append(DirectBlock([i], [sum(gs) if gs else self.params[i].new_zeros((b, *self.params[i].shape))]))
        return merge_shared(blocks, [p.shape for p in self.params], budget.chunk_bytes)

    def _module_blocks(self, m: nn.Module, own: dict, calls: list, stats: list, b: int, budget: Budget,
                       tags: Optional[list] = None) -> list:
        """The rule's blocks of one module from its recorded calls (never empty: see _blocks)."""
        layer = LayerCalls(m, dict(own), {a: self.params[i].shape for a, i in own.items()}, calls, stats, b, budget,
                           tags or [None] * len(calls))
        return RULES[type(m)].blocks(layer)  # planned only if rule_for(m) (see __init__)

    # -- the example axis -------------------------------------------------------------
    @staticmethod
    def _layout_violations(captured: list, b: int) -> dict:
        """Modules with a call whose input or output does not have size b along dim 0 → (in, out) shapes."""
        bad: dict = {}
        for c, _ in captured:
            if off_axis(c.inp, b) or off_axis(c.out, b):
                bad.setdefault(c.module, (tuple(c.inp.shape), tuple(c.out.shape)))
        return bad

    def _demote(self, indices: Sequence[int]) -> None:
        """Move parameters to the per-example (torch.func) path."""
        drop = set(indices)
        self.fallback = sorted(set(self.fallback) | drop)
        for m in list(self.bare):
            own = {a: i for a, i in self.bare[m].items() if i not in drop}
            if own:
                self.bare[m] = own
            else:
                del self.bare[m]
        for m in list(self.modules):
            own = {a: i for a, i in self.modules[m].items() if i not in drop}
            if own:
                self.modules[m] = own
            else:
                del self.modules[m]

    def _demote_bare(self, others: dict) -> None:
        for i, (m, op) in others.items():
            warnings.warn(f"parameter {self.names[i]!r} is used by {op} in the forward of "
                          f"{self._module_names.get(id(m), '?')!r} ({type(m).__name__}); a bare parameter is captured "
                          "per example only as P.expand(B, ...) or X + P (broadcast over the batch), so it uses the "
                          "exact per-example torch.func path", RuntimeWarning, stacklevel=5)
        self._demote(list(others))

    def _demote_layers(self, bad: dict) -> None:
        for m, (ins, outs) in bad.items():
            names = [self.names[i] for i in self.modules[m].values()]
            warnings.warn(
                f"layer {self._module_names.get(id(m), '?')!r} ({type(m).__name__}) does not keep the examples along "
                f"dim 0 (input {_trailing(ins)}, output {_trailing(outs)}); its parameters {names} use the "
                "per-example torch.func path. To keep it on the fast path give it tensors with the examples "
                "along dim 0 (batch_first=True, position ids expanded to [B, T], no reshape(B*T, ...)).",
                RuntimeWarning, stacklevel=4)
            self._demote(list(self.modules[m].values()))

    def _demote_all(self, shape) -> None:
        if self.modules:
            warnings.warn(f"the model's output ({_trailing(shape)}) does not have the examples along dim 0; all its "
                          "parameters use the per-example torch.func path", RuntimeWarning, stacklevel=4)
            self._demote([i for own in self.modules.values() for i in own.values()])

    # -- verification (dpopt.engine.check) --------------------------------------------
    @property
    def verified(self) -> bool:
        """True if the model's current train/eval mode (of every submodule) has been checked (or ``verify=False``)."""
        return not self._modes.needed(mode_signature(self.model))

    def _verify(self, x: Tensor, y: Tensor) -> None:
        """Once per mode signature: does every fast rule give the per-example gradients? Demote those that do not.

        In the model's own mode (the mode of the release: train mode with its
        real behaviour), on ≤ 8 distinct examples with a finite loss (tiled
        when fewer), at two batch sizes that differ from every dimension in
        the model (so that dim 0 can only have the batch size if it is the
        example axis):

        1. the per-example path itself: vmap (each example its own random
           draws) against an exact loop of single-example autograd on two
           examples given vmap's draws (the loop is used from then on if
           they differ; a model the loop cannot run is refused);
        2. every recorded call of a fast layer must have the batch size as
           dim 0 of its input and output, at both sizes;
        3. per parameter, the fast per-example squared norms and a random
           weighted sum must equal those of an exact loop of single-example
           autograd calls, with the batched pass's random draws (dropout
           masks) replayed per example (:class:`~dpopt.engine.check.RandomReplay`),
           within :func:`~dpopt.engine.check.rtol` of the gradient scale.

        A parameter that fails moves to the per-example path for good. If no
        example has a finite loss, the check is postponed to the next batch.
        """
        sig = mode_signature(self.model)
        refuse_checkpointing(self.model)  # (enabled after planning)
        with torch.no_grad():
            out = self.model(x)
            if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != y.shape[0]:
                self._demote_all(tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__)
                self._modes.done(sig)
                return
            finite = torch.isfinite(_per_example_losses(self.loss_fn, out, y))
        keep = torch.nonzero(finite).flatten()[:8]
        if keep.numel() < 2:  # one example tiled up cannot reveal a forward that mixes examples: wait
            return
        xs, ys = x[keep], y[keep]
        self._modes.done(sig)
        self._verify_reference(xs, ys)
        for b in free_sizes(model_dims(self.model, (xs,))):
            if not self._fast_indices():
                break
            sel = torch.arange(b, device=keep.device) % keep.numel()
            self._verify_at(xs[sel], ys[sel])

    def _verify_reference(self, xs: Tensor, ys: Tensor) -> None:
        model, k = self.model, min(2, int(ys.shape[0]))
        if model in _LOOP_MODELS or not self.params:
            return
        replay = RandomReplay(model)  # vmap's per-example draws given to the loop: the same masks on both sides
        try:
            with replay.recording():
                v = per_sample_gradient_tensors(model, self.loss_fn, xs[:k], ys[:k], method="vmap")
        except Exception:  # noqa: BLE001 — vmap cannot batch it: the "auto" path uses the loop anyway
            return
        try:
            with replay.replaying(k):
                loop = per_sample_gradient_tensors(model, self.loss_fn, xs[:k], ys[:k], method="loop")
        except Unreplayable as err:
            use_loop(model, f"its random draws under torch.func.vmap cannot be checked against the loop ({err})")
            return
        except ExampleFailed as err:  # the exact path cannot run it: refuse
            raise alone_failed(err.__cause__ or err) from err
        tol = rtol(self.dtype, self.device)
        scale = layer_scales(dict(enumerate(loop)), self.names)  # relative to the layer: exact zeros agree
        off = [n for i, (n, a, b) in enumerate(zip(self.names, v, loop))
               if not float((a - b).norm()) <= tol * float(scale[i].sum().sqrt()) + 1e-30]
        if off:
            use_loop(model, f"torch.func.vmap disagreed with single-example autograd on {off}")

    def _verify_at(self, xb: Tensor, yb: Tensor) -> None:
        b = int(yb.shape[0])
        replay = RandomReplay(self.model)
        try:
            with replay.recording():  # the last forward's random draws are the ones replayed below
                captured = self._capture(xb, yb, EvaluationPoint(1.0))
                bad = self._layout_violations(captured, b)
                if bad:
                    self._demote_layers(bad)
                    if not self._fast_indices():
                        return
                    captured = self._capture(xb, yb, EvaluationPoint(1.0))
            covered = self._fast_indices()
            with replay.replaying(b):
                ref = dict(zip(covered, per_sample_gradient_tensors(
                    self.model, self.loss_fn, xb, yb, names=[self.names[i] for i in covered], method="loop")))
        except _OutputLayout as err:
            self._demote_all(err.args[0])
            return
        except Unreplayable as err:
            self._demote_mixing(self._fast_indices(), str(err))
            return
        except ExampleFailed as err:  # the exact path cannot run it either: refuse
            raise alone_failed(err.__cause__ or err) from err
        c = torch.rand(b, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(self.device)
        tol = rtol(self.dtype, self.device)  # outside _no_autocast: autocast's dtype sets the tolerance
        with _no_autocast(self.device):
            off = disagreeing(self._blocks(captured, b, Budget(0, 0)), ref, c, [q.dtype for q in self.params], tol,
                              self.names)
        if off:
            self._demote_mixing(off, "the forward mixes examples in this mode (e.g. batch statistics under "
                                     "model.train()), or a parameter is used outside its module's forward")

    def _demote_mixing(self, indices: list, why: str) -> None:
        warnings.warn(f"fast per-sample rules do not reproduce the per-example gradients of "
                      f"{[self.names[i] for i in indices]} ({why}); they use the exact per-example path from now "
                      "on, where each example's gradient is computed with the model seeing that example alone: a "
                      "layer that mixes examples then behaves per example, not per batch, in the private "
                      "gradients", RuntimeWarning, stacklevel=5)
        self._demote(indices)

    # -- public ------------------------------------------------------------------------
    def compute(self, x: Tensor, y: Tensor, points: Optional[Sequence[EvaluationPoint]] = None,
                batch_dim: int = 0) -> FastPerSampleGrads:
        """Per-sample source for the B examples of ``x`` (along ``batch_dim``) and ``y [B, ...]`` (B may be 0).

        Args:
            points: evaluation points (DiSK); default one point at θ with coef 1.
            batch_dim: x's example axis. The fast rules need it to be 0; for
                any other axis every parameter uses the per-example path.

        Returns:
            :class:`FastPerSampleGrads` with one block per layer rule plus one
            :class:`~dpopt.engine.layers.DirectBlock` for the fallback parameters;
            ``params`` = the trainable parameters, ``points`` = the points given.

        Raises:
            ValueError: invalid inputs (:func:`~dpopt.engine.inputs.check_inputs`),
                a model the per-example path cannot run on one example, or a
                forward pass that changes a buffer
                (:func:`~dpopt.engine.inputs.buffers_unchanged`).
        """
        with buffers_unchanged(self.model, reuse=self._buffers) as self._buffers:  # copies kept between steps
            return self._compute(x, y, points, batch_dim)

    def _compute(self, x: Tensor, y: Tensor, points: Optional[Sequence[EvaluationPoint]],
                 batch_dim: int) -> FastPerSampleGrads:
        bd = check_inputs(x, y, batch_dim)
        pts = tuple(points) if points else (EvaluationPoint(1.0),)
        b = int(y.shape[0])
        if b == 0:
            blocks = [DirectBlock(list(range(len(self.params))), [p.new_zeros((0, *p.shape)) for p in self.params])]
            return self._source(blocks, 0, pts)
        if bd != 0:
            grads = per_sample_gradient_tensors(self.model, self.loss_fn, x, y, pts, batch_dim=bd)
            return self._source([DirectBlock(list(range(len(self.params))), grads)], b, pts)
        if not self.verified:
            self._verify(x, y)
        try:
            captured = [cap for pt in pts for cap in self._capture(x, y, pt)]
        except _OutputLayout as err:
            self._demote_all(err.args[0])
            return self.compute(x, y, pts)
        bad = self._layout_violations(captured, b)
        if bad:  # this batch size shows a layer whose dim 0 is not the example axis: demote, redo
            self._demote_layers(bad)
            return self.compute(x, y, pts)
        with _no_autocast(self.device):
            blocks = self._blocks(captured, b, Budget(self.chunk_bytes, self.cache_bytes))
        if self.fallback:
            grads = per_sample_gradient_tensors(self.model, self.loss_fn, x, y, pts,
                                                names=[self.names[i] for i in self.fallback])
            blocks.append(DirectBlock(self.fallback, grads))
        return self._source(blocks, b, pts)

    def _source(self, blocks: list, b: int, pts: tuple) -> FastPerSampleGrads:
        return FastPerSampleGrads(blocks, [p.shape for p in self.params], b, self.dtype, self.device,
                                  params=tuple(self.params), points=pts)

    def iterate(self, x: Tensor, y: Tensor, physical_batch_size: Optional[int] = None,
                points: Optional[Sequence[EvaluationPoint]] = None,
                batch_dim: int = 0) -> Iterator[FastPerSampleGrads]:
        """Yield sources for chunks of at most ``physical_batch_size`` examples, lazily.

        Each source is freed when the next one is requested, so at most one
        chunk's activations live at a time. An empty batch yields one empty
        source. Chunks are cut along ``batch_dim`` of x and dim 0 of y.

        Raises:
            ValueError: ``physical_batch_size`` ≤ 0, or invalid inputs
                (:func:`~dpopt.engine.inputs.check_inputs`).
        """
        if physical_batch_size is not None and physical_batch_size <= 0:
            raise ValueError(f"physical_batch_size must be > 0, got {physical_batch_size}")
        bd = check_inputs(x, y, batch_dim)
        return self._chunks(x, y, physical_batch_size, points, bd)

    def _chunks(self, x: Tensor, y: Tensor, physical_batch_size: Optional[int],
                points: Optional[Sequence[EvaluationPoint]], bd: int) -> Iterator[FastPerSampleGrads]:
        n = int(y.shape[0])
        size = physical_batch_size or max(n, 1)
        if n == 0:
            yield self.compute(x, y, points, bd)
            return
        prev = None
        for s in range(0, n, size):
            if prev is not None:
                prev.free()
                prev = None
            m = min(size, n - s)
            src = self.compute(x.narrow(bd, s, m), y[s:s + m], points, bd)
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
        refuse_checkpointing(model)
        eng = per_loss[loss_fn] = PerSampleEngine(model, loss_fn)
    return eng


def fast_per_sample_gradients(model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor,
                              points: Optional[Sequence[EvaluationPoint]] = None,
                              batch_dim: int = 0) -> FastPerSampleGrads:
    """Fast counterpart of :func:`dpopt.engine.reference.per_sample_gradients` (same arguments).

    Returns a :class:`FastPerSampleGrads` whose ``sq_norms``/``weighted_sum``
    equal those of the reference :class:`~dpopt.engine.reference.PerSampleGrads` to
    float tolerance.
    """
    return get_engine(model, loss_fn).compute(x, y, points, batch_dim)
