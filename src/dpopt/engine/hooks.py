"""Per-sample gradients captured from the user's own forward and backward pass (``PrivacyEngine``).

In Opacus-style training the loop is the user's: ``loss = crit(model(x), y);
loss.backward(); opt.step()``. The engine never sees the loss, so per-sample
gradients come from the backward pass itself:

* a forward hook on every layer that owns a trainable parameter records the
  call's inputs and output, and a tensor hook on the output records the
  gradient of the loss w.r.t. that output when ``backward()`` reaches it;
* with ``loss_reduction="mean"`` the loss is (1/B) Σ_i ℓ_i, so the gradient of
  ℓ_i w.r.t. example i's output is ``e_i = B · grad_output_i`` (B is the
  realised batch size: private, used here and passed to the Privatizer inside
  the source, nowhere else); with ``"sum"``, ``e_i = grad_output_i``;
* layers with a fast rule (:mod:`dpopt.engine.rules`: Linear, Conv2d,
  Embedding, LayerNorm, GroupNorm) build their blocks from ``(input, e)``
  exactly as the fast engine does (:class:`~dpopt.engine.fast.FastPerSampleGrads`);
* the parameters of any other layer get ``g_i = vjp(layer forward at x_i)(e_i)``:
  ``torch.func.vmap`` of a ``vjp`` of that module's forward over (recorded
  input, recorded output gradient), or an exact loop of single-example
  autograd calls where vmap cannot batch the layer.

What the functional engine verifies is verified here too (DESIGN.md, "one
example per row, verified"):

* statically, :func:`dpopt.models.check_model` (BatchNorm, tracked running
  statistics, ``max_norm`` / sparse embeddings are refused);
* every forward pass, no buffer may change (:func:`~dpopt.engine.inputs.buffers_unchanged`);
* every step, each recorded call must have the realised batch size B as dim 0
  of its input and of its output (else ``ValueError`` naming the layer: there is
  no loss to fall back on);
* on the first batch of ≥ 2 examples in each train/eval mode signature (a
  change of ``model.training`` of any submodule re-runs it), in the mode of
  that forward pass, at two batch sizes that differ from every dimension of
  the model, the hook path's per-example squared norms and a random weighted
  sum must equal those of an exact loop of single-example autograd calls,
  for a random linear loss Σ_i ⟨r_i, out_i⟩, the batched pass's dropout masks
  replayed per example (which catches a forward that mixes examples — also
  one that mixes only in train mode — and a parameter used outside its
  module's forward); a disagreement refuses the model with a ``ValueError``
  naming the parameters. The check is :mod:`dpopt.engine.check`, shared with
  the fast engine.

What cannot be verified without the loss: that it is a mean (or sum) of
per-example losses of per-example outputs (``loss_reduction``), as in Opacus.

One forward and one backward of the model per optimizer step: the calls of
several forward passes that all received gradients cannot be told apart
(two views of the same examples, or different micro-batches?) and are refused.

:func:`grad_sample_source` adapts Opacus's ``p.grad_sample`` tensors
(``[B, *p.shape]``, per-example gradients of ℓ_i) into a per-sample source.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..models import check_model
from ..types import EvaluationPoint
from .check import (ModeCheck, RandomReplay, Unreplayable, alone_failed, disagreeing, free_sizes, in_modes,
                    mode_signature, model_dims, off_axis, rtol)
from .bare import tap_bare
from .fast import (FastPerSampleGrads, PerSampleEngine, _BareCall, _Call, _no_autocast, _trailing,
                   expand_broadcast)
from .hf_guards import in_backward, is_hf, recomputed, refuse_batch_loss, refuse_checkpointing
from .inputs import check_buffers, snapshot_buffers
from .layers import Budget, DirectBlock
from .reference import PerSampleGrads
from .rules import is_tapped, tap_forwards

__all__ = ["HookCapture", "grad_sample_source", "LOSS_REDUCTIONS"]

LOSS_REDUCTIONS = ("mean", "sum")


def _leaves(obj) -> list[Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, Tensor)]


class _Pass:
    """One forward pass of the root module: the realised batch size, the recorded inputs (private), the mode."""

    __slots__ = ("batch_size", "args", "kwargs", "modes")

    def __init__(self, batch_size: int, args, kwargs, modes: tuple):
        self.batch_size, self.args, self.kwargs, self.modes = batch_size, args, kwargs, modes


class _HookCall:
    """One recorded call of a hooked module: inputs, outputs, and the output gradients once backward ran."""

    __slots__ = ("module", "args", "kwargs", "outs", "grads", "fast", "pass_", "versions")

    def __init__(self, module, args, kwargs, outs, fast: Optional[_Call], pass_: Optional[_Pass]):
        self.module, self.args, self.kwargs, self.outs = module, args, kwargs, outs
        self.grads: list[Optional[Tensor]] = [None] * len(outs)
        self.fast, self.pass_ = fast, pass_
        self.versions = [t._version for t in _leaves((args, kwargs))]

    def store(self, k: int, grad: Tensor) -> None:
        self.grads[k] = grad if self.grads[k] is None else self.grads[k] + grad

    @property
    def used(self) -> list[int]:
        """Indices of the output tensors that received a gradient."""
        return [k for k, g in enumerate(self.grads) if g is not None]

    @property
    def has_grad(self) -> bool:
        return any(g is not None for g in self.grads)


class _Recording:
    def __init__(self):
        self.calls: list[_HookCall] = []
        self.current: Optional[_Pass] = None
        self.other: set = set()  # bare parameters used otherwise than recognised (engine.bare): their vjp


class HookCapture:
    """Record layer inputs and output gradients of a model's own forward/backward; build per-sample sources.

    Args:
        model: the module (its trainable parameters, in ``named_parameters``
            order, are the source's parameters). Checked by
            :func:`~dpopt.models.check_model`.
        loss_reduction: ``"mean"`` (the loss is the mean of the per-example
            losses over the realised batch) or ``"sum"``.
        verify: check the hook path against single-example autograd on the
            first non-empty batch (module docstring).
        chunk_bytes, cache_bytes: memory :class:`~dpopt.engine.layers.Budget` of each source.

    Raises:
        ValueError: a layer refused by ``check_model``, an unknown ``loss_reduction``,
            a model without trainable parameters.

    Use: build once (hooks are attached), run forward and backward as usual,
    then :meth:`collect` returns the step's :class:`~dpopt.engine.fast.FastPerSampleGrads`
    (private: hand it to the Privatizer only). :meth:`detach` removes the hooks.
    """

    def __init__(self, model: nn.Module, loss_reduction: str = "mean", verify: bool = True,
                 chunk_bytes: int = 16 << 20, cache_bytes: int = 256 << 20):
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        check_model(model)
        refuse_checkpointing(model)
        self.model = model
        self.loss_reduction = loss_reduction
        self.plan = PerSampleEngine(model, None, verify=False, chunk_bytes=chunk_bytes,  # type: ignore[arg-type]
                                    cache_bytes=cache_bytes)
        self.params, self.names = self.plan.params, self.plan.names
        if not self.params:
            raise ValueError("the model has no trainable parameter (requires_grad=True); nothing to privatize")
        index = {id(p): i for i, p in enumerate(self.params)}
        fallback = set(self.plan.fallback)
        # module -> {attribute: parameter index} of the parameters computed by a vjp of that module's forward
        self.vjp: dict[nn.Module, dict[str, int]] = {}
        for m in model.modules():
            own = {a: index[id(p)] for a, p in m._parameters.items()
                   if p is not None and id(p) in index and index[id(p)] in fallback}
            if own:
                self.vjp[m] = own
        self._names = {id(m): n or "<root>" for n, m in model.named_modules()}
        self._rec = _Recording()
        self._recording = True
        self._buffers: dict = {}  # the last root forward's buffer snapshot (checked when it ends; reused)
        self._modes = ModeCheck(verify)  # the train/eval mode signatures checked so far
        self._handles: list = []
        self._attach()

    # -- hooks ------------------------------------------------------------------------
    def _attach(self) -> None:
        m = self.model
        self._handles.append(m.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        for mod in m.modules():  # transformers/peft models: their batch-token-mean .loss is refused
            if is_hf(mod) and hasattr(mod, "config"):
                self._handles.append(mod.register_forward_pre_hook(self._hf_pre, with_kwargs=True))
        for mod in set(self.plan.modules) | set(self.vjp) | set(self.plan.bare):
            self._handles.append(mod.register_forward_hook(self._layer, with_kwargs=True))
        # ViT's class token (engine.bare); a use not recognised falls back to the vjp of its owner's call
        self._handles += tap_bare(self.plan.bare, self._tap_size, self._bare_use,
                                  lambda m, i, op: self._rec.other.add(i))
        # after the layer hooks: the root may itself be a layer, recorded before its pass ends
        self._handles.append(m.register_forward_hook(self._root_post, with_kwargs=True))
        self._untap = tap_forwards(m, self._tap)  # MHA/LSTM/...: their inner linear maps (rules.Rule.forward)

    def detach(self) -> None:
        """Remove every hook this capture attached (the model is left as it was given)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        getattr(self, "_untap", lambda: None)()
        self._untap = lambda: None
        self._rec = _Recording()

    def _root_pre(self, module, args, kwargs):
        if not self._recording:
            return None
        leaves = _leaves((args, kwargs))
        b = int(leaves[0].shape[0]) if leaves and leaves[0].dim() > 0 else -1
        self._rec.current = _Pass(b, args, kwargs, mode_signature(module))
        self._buffers = snapshot_buffers(module, reuse=self._buffers)
        return None

    def _tap_size(self) -> int:
        cur = self._rec.current
        return cur.batch_size if self._recording and cur is not None else -1

    def _bare_use(self, module, index: int, r: Tensor) -> None:
        """A recognised use R [B, ...] of a bare parameter: its output gradient is recorded like a layer's."""
        call = _HookCall(module, (), {}, [r], _BareCall(module, r, index), self._rec.current)
        r.register_hook(partial(call.store, 0))
        self._rec.calls.append(call)

    def _hf_pre(self, module, args, kwargs):
        if self._recording and torch.is_grad_enabled():
            refuse_batch_loss(module, kwargs)
            if module.training:
                refuse_checkpointing(module)
        return None

    def _root_post(self, module, args, kwargs, out):
        if not self._recording:
            return None
        self._rec.current = None
        check_buffers(module, self._buffers)  # restores them before raising: nothing private stays in the model
        return None

    def _tap(self, module, a: Tensor, o: Tensor, tag) -> None:
        """A linear map inside a tapped layer's forward: recorded like a call of ``module`` (input a, output o)."""
        if not self._recording or module not in self.plan.modules or not o.requires_grad:
            return
        if in_backward():
            raise recomputed(self._names.get(id(module), "?"), module)
        call = _HookCall(module, (a,), {}, [o], _Call(module, a, o, tag), self._rec.current)
        o.register_hook(partial(call.store, 0))
        self._rec.calls.append(call)

    def _layer(self, module, args, kwargs, out):
        if not self._recording or not torch.is_grad_enabled():
            return None
        tapped = module in self.plan.modules and is_tapped(module)
        if tapped and module not in self.vjp:  # its maps were recorded by its tapped forward (_tap)
            return None
        if in_backward():
            raise recomputed(self._names.get(id(module), "?"), module)
        outs = _leaves(out)
        if not any(t.requires_grad for t in outs):
            return None
        fast, fast_out = None, out
        if module in self.plan.modules and not tapped:
            inp = args[0] if args else next(iter(kwargs.values()), None)
            if not isinstance(out, Tensor) or not isinstance(inp, Tensor):
                raise ValueError(f"layer {self._names.get(id(module), '?')!r} ({type(module).__name__}) was called "
                                 "without a tensor input or output; the hook engine cannot record it")
            b = self._rec.current.batch_size if self._rec.current is not None else -1
            inp, wide = expand_broadcast(module, inp, out, b)  # [1, T] position ids: per example
            if wide is not out:
                out = wide
                outs = [out]
            fast = _Call(module, inp, out)
        call = _HookCall(module, args, kwargs, outs, fast, self._rec.current)
        for k, t in enumerate(outs):
            if t.requires_grad:
                t.register_hook(partial(call.store, k))
        self._rec.calls.append(call)
        return out if fast is not None and out is not fast_out else None

    # -- step -------------------------------------------------------------------------
    def discard_completed(self) -> None:
        """Forget calls whose gradients have arrived (``zero_grad``); pending forwards are kept."""
        self._rec.calls = [c for c in self._rec.calls if not c.has_grad]

    def reset(self) -> None:
        """Forget every recorded call."""
        self._rec.calls = []

    def has_gradients(self) -> bool:
        """Has a recorded layer output received a gradient since the last step (a backward pass ran)?

        True also after the backward of an EMPTY batch (its zero-length
        gradients arrive like any other), so the answer depends on the loop,
        never on the data.
        """
        return any(c.has_grad for c in self._rec.calls)

    def collect(self) -> FastPerSampleGrads:
        """The per-sample source of the forward/backward pass since the last step (then forgotten).

        An empty source (B = 0) when no recorded output received a gradient
        (an empty Poisson batch, or a step without backward: warned).

        Raises:
            ValueError: calls from several forward passes received gradients; a
                layer called outside the model's forward; a layer whose input or
                output does not have the batch size as dim 0; a recorded input
                modified in place; or (first batch) the hook path disagrees with
                single-example autograd.
        """
        rec, self._rec = self._rec, _Recording()
        done = [c for c in rec.calls if c.has_grad]
        if not done and any(c.pass_ is not None for c in rec.calls):  # never conditioned on the batch size
            warnings.warn("optimizer.step() after a forward pass but without loss.backward(): this step releases "
                          "pure noise (and is charged)", RuntimeWarning, stacklevel=3)
        passes = {id(c.pass_): c.pass_ for c in done}
        if None in passes.values():
            names = sorted({self._names.get(id(c.module), "?") for c in done if c.pass_ is None})
            raise ValueError(f"layers {names} were called outside the model's forward (not as part of "
                             "model(...)); call the model that was made private")
        if len(passes) > 1:
            raise ValueError(f"{len(passes)} forward passes of the model received gradients since the last "
                             "optimizer step; the hook engine supports one forward and one backward per step "
                             "(it cannot tell two views of the same examples from different examples). "
                             "Concatenate the inputs into one forward pass, or step after each backward")
        if not done:
            return self._empty()
        p = next(iter(passes.values()))
        if self._modes.needed(p.modes) and p.batch_size > 1:  # one example tiled up cannot reveal mixing: wait
            self._verify(p)
        return self._build(done, p.batch_size, self.loss_reduction, rec.other)

    def _empty(self) -> FastPerSampleGrads:
        blocks = [DirectBlock(list(range(len(self.params))), [q.new_zeros((0, *q.shape)) for q in self.params])]
        return self._source(blocks, 0)

    def _source(self, blocks: list, b: int) -> FastPerSampleGrads:
        return FastPerSampleGrads(blocks, [q.shape for q in self.params], b, self.plan.dtype, self.plan.device,
                                  params=tuple(self.params), points=(EvaluationPoint(1.0),))

    def _check_layout(self, calls: list[_HookCall], b: int) -> None:
        for c in calls:
            ins = c.fast.inp if c.fast is not None else None
            bad_in = ins is not None and off_axis(ins, b)
            if c.fast is None and all(off_axis(t, b) for t in _leaves((c.args, c.kwargs))):
                bad_in = True
            bad_out = any(off_axis(c.outs[k], b) for k in c.used)
            if bad_in or bad_out:
                shapes = [_trailing(tuple(t.shape)) for t in _leaves((c.args, c.kwargs))]
                raise ValueError(
                    f"layer {self._names.get(id(c.module), '?')!r} ({type(c.module).__name__}) does not keep the "
                    f"examples along dim 0 (inputs {shapes}, outputs {[_trailing(tuple(t.shape)) for t in c.outs]}, "
                    "dim 0 not shown: it is the private batch's size); the hook engine of PrivacyEngine needs every layer that owns a trainable "
                    "parameter to take and return tensors with the examples along dim 0 (batch_first=True, "
                    "position ids expanded to [B, T], no reshape(B*T, ...)). Otherwise train with dpopt's own "
                    "loop (dpopt.iter_per_sample_sources with batch_dim=...), which computes each example alone")
            if [t._version for t in _leaves((c.args, c.kwargs))] != c.versions:
                raise ValueError(f"an input of layer {self._names.get(id(c.module), '?')!r} was modified in place "
                                 "after the layer used it; per-sample gradients would be computed from the "
                                 "modified values. Avoid in-place operations on layer inputs (e.g. inplace=True)")

    def _build(self, calls: list[_HookCall], b: int, reduction: str, other: frozenset = frozenset()
               ) -> FastPerSampleGrads:
        if b == 0:
            return self._empty()
        self._check_layout(calls, b)
        scale = float(b) if reduction == "mean" else 1.0  # B·grad_output: the gradient of ℓ_i (private B)

        def es(c: _HookCall) -> list[Tensor]:  # gradients of the used outputs
            return [c.grads[k] * scale for k in c.used]

        # bare parameters with a use the taps do not recognise: the vjp of their owner's call instead
        bare_vjp = {m: {a: i for a, i in own.items() if i in other} for m, own in self.plan.bare.items()}
        bare_vjp = {m: own for m, own in bare_vjp.items() if own}
        captured = [(c.fast, es(c)[0]) for c in calls if c.fast is not None
                    and not (isinstance(c.fast, _BareCall) and c.fast.index in other)]
        with _no_autocast(self.plan.device):
            blocks = self.plan._blocks(captured, b, Budget(self.plan.chunk_bytes, self.plan.cache_bytes))
        if bare_vjp:  # drop their (zero) tap blocks
            blocks = [blk for blk in blocks if not (isinstance(blk, DirectBlock) and set(blk.index) <= set(other))]
        vjps = {**self.vjp, **bare_vjp}
        fallback = sorted({i for own in vjps.values() for i in own.values()})  # a tied one: once, uses summed
        if fallback:
            grads: dict[int, Tensor] = {i: self.params[i].new_zeros((b, *self.params[i].shape)) for i in fallback}
            for c in calls:
                if isinstance(c.fast, _BareCall):
                    continue
                own = vjps.get(c.module) if c.fast is None else self.vjp.get(c.module)
                if own:
                    for i, g in zip(own.values(), self._vjp(c, own, es(c), b)):
                        grads[i] = grads[i] + g.to(grads[i].dtype)
            blocks.append(DirectBlock(fallback, [grads[i] for i in fallback]))
        return self._source(blocks, b)

    def _vjp(self, c: _HookCall, own: dict[str, int], es: list[Tensor], b: int) -> list[Tensor]:
        """Per-example gradients [B, *shape] of ``own`` parameters of one call: vjp of the module at each example."""
        m, attrs = c.module, list(own)
        primals = tuple(self.params[i].detach() for i in own.values())
        flat, spec = tree_flatten((c.args, c.kwargs))
        batched = [isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == b for t in flat]
        data = [t.detach() if isinstance(t, Tensor) else t for t in flat]

        def call_at(ps, xs: list):
            leaves, j = [], 0
            for t, bt in zip(data, batched):
                if bt:
                    leaves.append(xs[j])
                    j += 1
                else:
                    leaves.append(t)
            args, kwargs = tree_unflatten(leaves, spec)
            outs = _leaves(functional_call(m, dict(zip(attrs, ps)), tuple(args), kwargs))
            return tuple(outs[k] for k in used)

        used = c.used

        xs = [t for t, bt in zip(data, batched) if bt]
        es = [e.detach() for e in es]
        self._recording = False
        try:
            def one(xs_i, es_i):
                _, pull = vjp(lambda *ps: call_at(ps, [x.unsqueeze(0) for x in xs_i]), *primals)
                return pull(tuple(e.unsqueeze(0) for e in es_i))

            try:
                return list(vmap(one)(xs, es))
            except Exception:  # noqa: BLE001 — a layer vmap cannot batch: exact single-example loop
                rows = []
                for i in range(b):
                    ps = [q.detach().requires_grad_(True) for q in primals]
                    with torch.enable_grad():
                        outs = call_at(ps, [x[i:i + 1] for x in xs])
                        pairs = [(o, e[i:i + 1]) for o, e in zip(outs, es) if o.requires_grad]
                        gs = torch.autograd.grad([o for o, _ in pairs], ps, [e for _, e in pairs],
                                                 allow_unused=True)
                    rows.append([torch.zeros_like(q) if g is None else g for q, g in zip(primals, gs)])
                return [torch.stack([r[k] for r in rows]) for k in range(len(primals))]
        finally:
            self._recording = True

    # -- verification (first non-empty batch) ----------------------------------------
    def _batched(self, p: _Pass):
        flat, spec = tree_flatten((p.args, p.kwargs))
        return flat, spec, [isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == p.batch_size for t in flat]

    def _select(self, p: _Pass, sel: Tensor):
        flat, spec, batched = self._batched(p)
        leaves = [t.detach()[sel.to(t.device)] if bt else t for t, bt in zip(flat, batched)]
        return tree_unflatten(leaves, spec)

    @property
    def verified(self) -> bool:
        """True if the model's current train/eval mode (of every submodule) has been checked (or ``verify=False``)."""
        return not self._modes.needed(mode_signature(self.model))

    def _verify(self, p: _Pass) -> None:
        """Hook path vs. an exact loop of single-example autograd, for a random linear loss (module docstring).

        Runs in the mode of the pass ``p`` (the mode of the release), with the
        batched pass's random draws replayed per example
        (:mod:`dpopt.engine.check`); once per mode signature.
        """
        k = min(p.batch_size, 8)
        with in_modes(self.model, p.modes):
            self._recording = False
            try:
                args, kwargs = self._select(p, torch.arange(k))  # k ≥ 2: a mode may need several examples
                dims = model_dims(self.model, args, kwargs)
            finally:
                self._recording = True
            for b in free_sizes(dims):
                sel = torch.arange(b) % k
                self._verify_at(self._select(p, sel), b)
        self._modes.done(p.modes)

    def _verify_at(self, inputs, b: int) -> None:
        args, kwargs = inputs
        gen = torch.Generator().manual_seed(0)  # not private: a test direction for the check only
        saved, self._rec = self._rec, _Recording()
        replay = RandomReplay(self.model)
        try:
            with replay.recording(), torch.enable_grad():
                out = _leaves(self.model(*args, **kwargs))
                if not out or any(o.dim() == 0 or o.shape[0] != b for o in out):
                    raise ValueError(f"the model's output {[tuple(o.shape) for o in out]} does not have the "
                                     f"examples along dim 0 (batch of {b}); the hook engine needs [B, ...] outputs")
                rs = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o) for o in out]
                loss = sum((o * r).sum() for o, r in zip(out, rs) if o.is_floating_point())
                torch.autograd.grad(loss, self.params, allow_unused=True)
            rec = self._rec
        finally:
            self._rec = saved
        src = self._build([c for c in rec.calls if c.has_grad], b, "sum", rec.other)
        try:
            with replay.replaying(b):
                ref = self._loop_reference(args, kwargs, rs, b)
        except Unreplayable as err:
            src.free()
            raise ValueError(f"{err}; the hook engine of PrivacyEngine cannot check this model against "
                             "single-example autograd in the mode it trains in. Use dpopt's own loop "
                             "(dpopt.iter_per_sample_sources), which computes each example alone") from None
        c = torch.rand(b, generator=gen, dtype=torch.float64).to(self.plan.device)
        tol = rtol(self.plan.dtype, self.plan.device)  # outside _no_autocast: autocast's dtype sets the tolerance
        with _no_autocast(self.plan.device):
            off = disagreeing(src.blocks, dict(enumerate(ref)), c, [q.dtype for q in self.params], tol, self.names)
        src.free()
        if off:
            mode = "train" if self.model.training else "eval"
            raise ValueError(f"per-sample gradients of {sorted(self.names[i] for i in off)} captured from the "
                             f"backward pass do not match single-example autograd in the mode the model trains in "
                             f"(model.{mode}()): the forward mixes examples (e.g. batch statistics under "
                             "model.train(), as in `if self.training: h = h - h.mean(0)`), or a parameter is used "
                             "outside its module's forward (e.g. F.linear(x, self.fc.weight) in a parent module). "
                             "The hook engine of PrivacyEngine cannot train this model privately; use dpopt's own "
                             "loop (dpopt.iter_per_sample_sources), which computes each example alone (a mixing "
                             "layer then behaves per example, not per batch)")

    def _loop_reference(self, args, kwargs, rs: list[Tensor], b: int) -> list[Tensor]:
        """Exact per-example gradients [b, *shape] of Σ⟨r_i, out_i⟩, one example at a time (the caller's mode)."""
        flat, spec = tree_flatten((args, kwargs))
        batched = [isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == b for t in flat]
        rows = []
        self._recording = False
        try:
            with torch.enable_grad():
                for i in range(b):
                    a_i, kw_i = tree_unflatten([t[i:i + 1] if bt else t for t, bt in zip(flat, batched)], spec)
                    try:
                        out = _leaves(self.model(*a_i, **kw_i))
                    except Unreplayable:
                        raise
                    except Exception as err:  # noqa: BLE001 — the user's model on one example: refuse, say why
                        raise alone_failed(err) from err
                    loss = sum((o * r[i:i + 1]).sum() for o, r in zip(out, rs) if o.is_floating_point())
                    gs = torch.autograd.grad(loss, self.params, allow_unused=True)
                    rows.append([torch.zeros_like(q) if g is None else g for q, g in zip(self.params, gs)])
        finally:
            self._recording = True
        return [torch.stack([r[k] for r in rows]) for k in range(len(self.params))]


def grad_sample_source(params: Sequence[Tensor]) -> Optional[PerSampleGrads]:
    """A per-sample source from Opacus-style ``p.grad_sample`` tensors, or None where none is set.

    Args:
        params: the trainable parameters; each may carry ``p.grad_sample`` of
            shape ``[B, *p.shape]``: the per-example gradients of ℓ_i (Opacus's
            ``GradSampleModule`` convention: already multiplied by B for a mean loss).

    Returns:
        :class:`~dpopt.engine.reference.PerSampleGrads` over ``params`` (private), or
        None if no parameter has a ``grad_sample``.

    Raises:
        ValueError: only some parameters have one, or shapes/batch sizes differ.
    """
    have = [getattr(p, "grad_sample", None) is not None for p in params]
    if not any(have):
        return None
    if not all(have):
        missing = [tuple(p.shape) for p, h in zip(params, have) if not h]
        raise ValueError(f"p.grad_sample is set on some trainable parameters but not on those of shapes {missing}; "
                         "every trainable parameter needs its per-sample gradients")
    grads = []
    for p in params:
        g = p.grad_sample
        if isinstance(g, (list, tuple)):  # Opacus keeps a list when a layer was called several times
            g = sum(g)
        if g.dim() != p.dim() + 1 or tuple(g.shape[1:]) != tuple(p.shape):
            raise ValueError(f"p.grad_sample must have shape [B, *p.shape]; got {tuple(g.shape)} for a parameter "
                             f"of shape {tuple(p.shape)}")
        grads.append(g.detach())
    if len({int(g.shape[0]) for g in grads}) != 1:
        raise ValueError("p.grad_sample tensors have different batch sizes")
    return PerSampleGrads(grads, params=tuple(params))
