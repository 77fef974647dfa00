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
* a layer whose call does not keep the examples along dim 0 (tokens
  flattened to ``[B·T, H]``, routed experts, windows, shared position
  tables, parametrizations) is captured through the nearest enclosing call
  that does (:mod:`dpopt.engine.lift`), by that call's vjp below;
* the parameters of any other layer get ``g_i = vjp(layer forward at x_i)(e_i)``:
  ``torch.func.vmap`` of a ``vjp`` of that module's forward over (recorded
  input, recorded output gradient), or an exact loop of single-example
  autograd calls where vmap cannot batch the layer.

The recorder, the per-call layout test, the blocks and the first-batch check
are :mod:`dpopt.engine.capture`'s, the same as ``dpopt train``'s
(:class:`~dpopt.engine.fast.PerSampleEngine`); this module is the door's
policy. What the functional engine verifies is verified here too (DESIGN.md,
"one example per row, verified"):

* statically, :func:`dpopt.models.check_model` (BatchNorm, tracked running
  statistics, ``max_norm`` / sparse embeddings are refused);
* every forward pass, and the backward before each step, no buffer may
  change, compared by value (:func:`~dpopt.engine.inputs.changed_buffers`:
  writes through ``buf.data`` and from backward hooks count);
* every step, each recorded call must have the realised batch size B as dim 0
  of its input and of its output (else ``ValueError`` naming the layer: there is
  no loss to fall back on);
* on the first batch of ≥ 2 examples in each signature (train/eval flags,
  the modules' non-parameter state, the batch-size class:
  :func:`~dpopt.engine.check.signature`; any change re-runs it, and the
  loader's examples are also collated alone: :mod:`dpopt.engine.collate_check`), in the mode of
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
Nothing of a step outlives it: the calls are forgotten at ``step()``, and a
forward pass that no backward reached before the next forward pass began (an
evaluation with gradients enabled, a discarded loss) is dropped then, with
its activations (warned once; a backward that reaches it later is refused).
K views of each example go into ONE forward pass instead, as K consecutive
rows (``rows_per_example=K``, augmentation multiplicity): example i's
gradient is then the mean over its rows i·K … i·K + K − 1, and a
``"mean"`` loss is the mean over the B·K rows (each row's ℓ weighted by 1/(B·K)).

:func:`grad_sample_source` adapts Opacus's ``p.grad_sample`` tensors
(``[B, *p.shape]``, per-example gradients of ℓ_i) into a per-sample source.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional, Sequence, cast

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..models import check_model
from ..types import EvaluationPoint
from .capture import Call, OutputLayout, OutputStub, Pass, Plan, Recorder, check_views, leaves, public_shape
from .check import ModeCheck, Unreplayable, free_sizes, in_modes, mode_signature, model_dims, signature
from .collate_check import CollateProbe, check_collate
from .compiled import CompiledForward, compile_backend, refusal
from .fast import FastPerSampleGrads
from .hf_labels import LabelsLoss, strip_labels
from .inputs import preserved_state
from .layers import DirectBlock
from .reference import PerSampleGrads

__all__ = ["HookCapture", "grad_sample_source", "LOSS_REDUCTIONS"]

LOSS_REDUCTIONS = ("mean", "sum")
#: Batches (of ≥ 2 examples) the collate check is tried on, per signature, until one gives a verdict: a batch
#: whose examples all have the batch's longest length shows no padding difference (no verdict).
COLLATE_TRIES = 16

_Pass = Pass  # the recorded forward pass (engine.capture)

#: The note an exception raised in the first-batch check carries (:func:`_check_noted`): the model's own error
#: surfaces from ``optimizer.step()``, in passes the user never wrote.
CHECK_NOTE = (
    "raised in PrivacyEngine's first-batch check (run by optimizer.step()): extra passes of the model on rows "
    "of this batch's first examples, up to the batch's size, compared with single-example autograd. Nothing was "
    "released or recorded; fix the cause and repeat the step (zero_grad, forward, backward, step)"
)


@contextlib.contextmanager
def _check_noted():
    """Context: an exception raised inside it gets :data:`CHECK_NOTE` (Python 3.11+ ``add_note``)."""
    try:
        yield
    except Exception as err:
        if hasattr(err, "add_note") and CHECK_NOTE not in getattr(err, "__notes__", ()):
            err.add_note(CHECK_NOTE)
        raise


def refuse_second_capture(model: nn.Module) -> None:
    """Refuse a model that already carries a capture's hooks (an earlier ``make_private`` / DP trainer).

    Two captures on one model would both record every forward's private layer inputs: the earlier
    one keeps them (memory, and private tensors held by an object the user no longer steps) and
    its checks see passes that are not its own. Detected from the forward hooks of every module (a
    :class:`~dpopt.engine.capture.Recorder`'s bound method), so a submodule or a parent of a private
    model and a deep copy that kept the hooks are refused too; :func:`dpopt.averaging.unhooked_copy` or ``engine.detach()`` clears them.

    Raises:
        ValueError: with what to change.
    """
    hooks = [h for m in model.modules() for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values()]
    if any(isinstance(getattr(h, "__self__", None), Recorder) for h in hooks):
        raise ValueError(
            "this model (or a module in it, or one it is part of) still carries the hooks of an earlier "
            "PrivacyEngine.make_private / DP trainer "
            "(or is a deep copy of such a model): call that engine's detach() (a trainer's "
            "trainer.engine.detach()) before making it private again, or copy it with "
            "dpopt.averaging.unhooked_copy"
        )


class HookCapture:
    """Record layer inputs and output gradients of a model's own forward/backward; build per-sample sources.

    Args:
        model: the module (its trainable parameters, in ``named_parameters``
            order, are the source's parameters). Checked by
            :func:`~dpopt.models.check_model`.
        loss_reduction: ``"mean"`` (the loss is the mean of the per-row
            losses over the realised batch) or ``"sum"``.
        verify: check the hook path against single-example autograd on the
            first batch of ≥ 2 examples in each mode (module docstring).
        chunk_bytes, cache_bytes: memory :class:`~dpopt.engine.layers.Budget` of each source;
            ``cache_bytes=None`` (default): derived from the model and batch
            (:meth:`~dpopt.engine.capture.Plan.budget`), an int: that many bytes.
        norm_form: None (default): each factored layer's norm form from the cost model; ``"gram"``,
            ``"chol"`` or ``"direct"``: that form wherever it applies
            (:attr:`~dpopt.engine.layers.Budget.norm_form`; tests and measurements).
        rows_per_example: K ≥ 1: rows ``i·K … i·K + K − 1`` of each forward
            pass are K views of example i (``PrivacyEngine``'s augmentation
            multiplicity); its gradient is the mean over them, and the source
            has B = rows / K examples. With ``"mean"`` the loss is the mean
            over all B·K rows: e = B · grad_output (B examples, not B·K rows).

    Raises:
        ValueError: a layer refused by ``check_model``, an unknown ``loss_reduction``,
            a model without trainable parameters, ``rows_per_example`` < 1, a model that
            still carries another capture's hooks (:func:`refuse_second_capture`).

    Use: build once (hooks are attached), run forward and backward as usual,
    then :meth:`collect` returns the step's :class:`~dpopt.engine.fast.FastPerSampleGrads`
    (private: hand it to the Privatizer only). :meth:`detach` removes the hooks.
    """

    checks_collate = True  # make_private may give it the loader's CollateProbe (engine.collate_check)
    #: collect(defer_check=True) may leave the first-batch check's largest pass to finish_check (the optimizer's)
    defers_check = True
    #: capture layers whose rows are not examples through an enclosing call (engine.lift)
    lifts_layers = True
    #: False: the user's backward skips the weight-gradient products of the rule layers and forms no ``p.grad``
    #: for their parameters (``Recorder(param_grads=False)``): ``step()`` drops the backward's ``p.grad`` unread
    #: and sets the release, so that product was computed for nothing (issue 34). The compiled door detaches the
    #: parameters in its graph itself; FSDP keeps them (its own gradient machinery runs on the unsharded ones).
    forms_param_grads = False

    def __init__(
        self,
        model: nn.Module,
        loss_reduction: str = "mean",
        verify: bool = True,
        chunk_bytes: int = 16 << 20,
        cache_bytes: Optional[int] = None,
        rows_per_example: int = 1,
        compile: object = False,
        norm_form: Optional[str] = None,
    ):
        backend = compile_backend(compile)
        if backend is not None and not verify:
            raise refusal("verify=False would release the compiled capture's results unchecked")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        if int(rows_per_example) != rows_per_example or rows_per_example < 1:
            raise ValueError(f"rows_per_example must be an integer >= 1, got {rows_per_example!r}")
        check_model(model)
        refuse_second_capture(model)
        self.model = model
        self.loss_reduction = loss_reduction
        self.views = int(rows_per_example)
        self.plan = Plan(model, chunk_bytes, cache_bytes, weak=False, norm_form=norm_form)
        self.params, self.names = self.plan.params, self.plan.names
        if not self.params:
            raise ValueError("the model has no trainable parameter (requires_grad=True); nothing to privatize")
        # module -> {attribute: parameter index} of the parameters computed by a vjp of that module's forward
        self.vjp: dict[nn.Module, dict[str, int]] = self.plan.vjp_owners()
        self._names = self.plan.module_names
        self._modes = ModeCheck(verify)  # the train/eval mode signatures checked so far
        self._rec = Recorder(
            self.plan,
            self.vjp,
            tensor_hooks=True,
            guard_buffers=True,
            hook_bare_owners=True,
            lift=self.lifts_layers,
            param_grads=self.forms_param_grads or backend is not None,
        ).attach()
        self._rec.labels_loss = LabelsLoss(loss_reduction)  # HF's labels= loss per example (engine.hf_labels)
        # the loader's collate_fn wrapper (engine.collate_check; set by make_private): examples collated alone
        self.collate_probe: Optional[CollateProbe] = None
        # batches left in which the collate check may still find an example whose padding differs: a
        # batch of equal-length examples gives no verdict, so the check is tried again on later batches
        self._collate_tries = COLLATE_TRIES
        # compile=: the model's forward runs the compiled capture (engine.compiled.CompiledForward); graphs
        # compiled up to the last first-batch check (a later graph is checked on its first pass)
        self._door: Optional[CompiledForward] = None
        self._vouched = 0
        self._compile = compile
        # a compiled door's first-batch refusal: the model was given back, every later collect raises it again
        self._refused: Optional[str] = None
        if backend is not None:
            try:
                self._door = CompiledForward(self._rec, backend, self.vjp)
            except ValueError:
                self._rec.detach()
                raise
        # the first-batch check's passes collect(defer_check=True) left to finish_check: (inputs, rows, compare,
        # modes), and the signature they vouch for
        self._deferred: list = []
        self._deferred_key: Optional[tuple] = None
        self.detached = False  # detach() removed the hooks (PrivacyEngine.detach): nothing is captured any more

    def _quiet(self, flag: bool) -> None:
        self._rec.active = not flag

    def _name(self, module: nn.Module) -> str:
        return self._names.get(id(module), "?")

    def detach(self) -> None:
        """Remove every hook this capture attached (the model is left as it was given); sets ``detached``."""
        if self._door is not None:
            self._door.detach()
        self._rec.detach()
        self.detached = True

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
        never on the data; and after a forward pass with a layer only the root
        encloses off the examples' axis (recorded nowhere: :meth:`collect` refuses
        it, naming the layer, rather than the step saying that no backward ran).

        Raises:
            ValueError: the compiled door was refused by a first-batch check (the model was given back).
        """
        if self._refused is not None:
            raise ValueError(self._refused)
        return any(c.has_grad for c in self._rec.calls) or self._rec.late_gradients() or bool(self._rec.unresolved)

    def collect(self, defer_check: bool = False) -> FastPerSampleGrads:
        """The per-sample source of the forward/backward pass since the last step (then forgotten).

        ``defer_check``: the first-batch check's pass at this batch's size is
        left to :meth:`finish_check` (the caller frees the source first).

        An empty source (B = 0) when no recorded output received a gradient
        (an empty Poisson batch, or a step without backward: warned).

        Raises:
            ValueError: calls from several forward passes received gradients; a
                layer called outside the model's forward; a layer whose input or
                output does not have the batch size as dim 0; a recorded input
                modified in place; a row count that is not a multiple of
                ``rows_per_example``; or (first batch) the hook path disagrees
                with single-example autograd.
        """
        if self._refused is not None:
            raise ValueError(self._refused)
        late = self._rec.dropped_received()  # passes dropped as unused (a later pass began) that got gradients
        calls, other = self._rec.take()
        for m, (ins, outs) in self._rec.take_unresolved().items():  # a layer only the root encloses
            raise self._layout_error(m, ins, outs)
        self._rec.recheck_buffers()  # by value, after the backward: a backward hook's write is refused too
        done = [c for c in calls if c.has_grad]
        if not done and any(c.pass_ is not None for c in calls):  # never conditioned on the batch size
            warnings.warn(
                "optimizer.step() after a forward pass but without loss.backward(): this step releases "
                "pure noise (and is charged)",
                RuntimeWarning,
                stacklevel=3,
            )
        passes = {id(c.pass_): c.pass_ for c in done}
        if None in passes.values():
            names = sorted({self._name(c.module) for c in done if c.pass_ is None})
            raise ValueError(
                f"layers {names} were called outside the model's forward (not as part of "
                "model(...)); call the model that was made private"
            )
        if len(passes) + late > 1:
            raise ValueError(
                f"{len(passes) + late} forward passes of the model received gradients since the last "
                "optimizer step; the hook engine supports one forward and one backward per step "
                "(it cannot tell two views of the same examples from different examples). "
                "Concatenate the inputs into one forward pass (K views of each example as K "
                "consecutive rows: rows_per_example=K), or step after each backward"
            )
        if late:
            raise ValueError(
                "a forward pass received its gradients after another forward pass had started (its "
                "recorded activations were dropped then, as unused); the hook engine supports one "
                "forward and one backward per step: run loss.backward() before the next forward pass "
                "(and evaluate under torch.no_grad())"
            )
        if not done:
            return self._empty()
        p = next(iter(passes.values()))
        check_views(p.batch_size, self.views)
        # one example tiled up cannot reveal mixing: wait for two
        key = signature(self.model, p.batch_size // self.views, p.modes, p.state)  # modes, module state, size class
        fresh = self._door is not None and self._door.compiles > self._vouched  # a graph no check has run
        needed = (self._modes.needed(key) or fresh) and p.batch_size >= 2 * self.views
        if needed:
            self._collate_tries = COLLATE_TRIES  # a new signature: the collate check gives its verdict again
        probe = self.collate_probe if self._collate_tries > 0 and p.batch_size >= 2 * self.views else None
        if needed or probe is not None:
            with preserved_state(self.model):  # the check's extra passes leave no buffer value or RNG draw behind
                if probe is not None:  # before the signature is marked checked: examples collated alone
                    verdict = check_collate(
                        self.model,
                        p.args,
                        strip_labels(self.model, p.kwargs),
                        p.batch_size,
                        probe,
                        self.params,
                        p.modes,
                        self._quiet,
                    )
                    self._collate_tries = 0 if verdict else self._collate_tries - 1
                if needed:
                    with self._compiled_refusal(), _check_noted():
                        self._verify(p, key, defer=defer_check)
                    if self._door is not None:
                        self._vouched = self._door.compiles
        try:
            if self._rec.stale(done):
                done, other = self._again(p, done, other)
            p.out_grads = None  # the root outputs' gradients (kept for _again): the calls hold what is still needed
            return self._build(done, p.batch_size, self.loss_reduction, other)
        except BaseException:
            self.cancel_check()  # no step: the deferred passes' private rows go with it
            raise

    def _again(self, p: Pass, done: list[Call], other: dict) -> tuple[list[Call], dict]:
        """The pass ``p`` run again with its root outputs' gradients, after the check changed how it is captured.

        The first-batch check may decide (at its verification sizes) to
        compute some parameters through an enclosing call (:mod:`dpopt.engine.lift`)
        whose call the user's pass did not record. The same inputs are run
        forward again and the gradients the user's backward delivered at the
        model's outputs are propagated back (no parameter's ``.grad`` is
        touched; buffers and random generators are restored). A pass whose
        outputs' gradients were not all recorded is refused
        (:meth:`~dpopt.engine.capture.Recorder.build`: repeat the step).
        """
        grads = p.out_grads
        if grads is None or not any(g is not None for g in grads):
            return done, other
        with preserved_state(self.model), torch.enable_grad():
            outs = [t for t in leaves(self.model(*p.args, **p.kwargs)) if t.requires_grad]
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
            torch.autograd.grad([o for o, _ in pairs], self.params, [g for _, g in pairs], allow_unused=True)
        calls, again = self._rec.take()
        return [c for c in calls if c.has_grad], again

    def _empty(self) -> FastPerSampleGrads:
        blocks = [DirectBlock(list(range(len(self.params))), [q.new_zeros((0, *q.shape)) for q in self.params])]
        return self._source(blocks, 0)

    def _source(self, blocks: list, b: int) -> FastPerSampleGrads:
        return FastPerSampleGrads(
            blocks,
            [q.shape for q in self.params],
            b,
            self.plan.dtype,
            self.plan.device,
            params=tuple(self.params),
            points=(EvaluationPoint(1.0),),
        )

    def _layout_error(self, module: nn.Module, ins, outs) -> ValueError:
        return ValueError(
            f"layer {self._name(module)!r} ({type(module).__name__}) does not keep the examples along dim 0 "
            f"(inputs {[public_shape(s) for s in ins]}, outputs {[public_shape(s) for s in outs]}; sizes not "
            "shown: they carry the private batch's size); the hook engine of PrivacyEngine needs every layer that owns a "
            "trainable parameter to take and return tensors with the examples along dim 0 (batch_first=True, "
            "position ids expanded to [B, T], no reshape(B*T, ...)). Otherwise train with dpopt's own loop "
            "(dpopt.iter_per_sample_sources with batch_dim=...), which computes each example alone"
        )

    def _check_layout(self, calls: list[Call], rows: int) -> None:
        bad = self._rec.layout(calls, rows)
        for m, (ins, outs) in bad.items():
            raise self._layout_error(m, ins, outs)
        for c in self._rec.inputs_modified(calls):
            raise ValueError(
                f"an input of layer {self._name(c.module)!r} was modified in place "
                "after the layer used it; per-sample gradients would be computed from the "
                "modified values. Avoid in-place operations on layer inputs (e.g. inplace=True)"
            )

    def _build(self, calls: list[Call], rows: int, reduction: str, other: Optional[dict] = None) -> FastPerSampleGrads:
        if rows == 0:
            return self._empty()
        b = check_views(rows, self.views)
        self._check_layout(calls, rows)
        # e of a row = (1/K) ∂ℓ_r/∂out: "mean" (loss = Σ_r ℓ_r / (B·K)) → B·grad_output; "sum" → grad_output / K
        scale = float(b) if reduction == "mean" else 1.0 / self.views
        return self._source(self._rec.build(calls, rows, scale, self.views, other), b)

    # -- verification (first batch of each mode: engine.capture.Recorder.check) --------
    def _batched(self, p: Pass):
        flat, spec = tree_flatten((p.args, strip_labels(self.model, p.kwargs)))  # the check: no .loss scalar
        return flat, spec, [isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == p.batch_size for t in flat]

    def _select(self, p: Pass, sel: Tensor):
        flat, spec, batched = self._batched(p)
        leaves_ = [t.detach()[sel.to(t.device)] if bt else t for t, bt in zip(flat, batched)]
        return tree_unflatten(leaves_, spec)

    @property
    def verified(self) -> bool:
        """True if the model's current train/eval mode and module state were checked (any size class; or ``verify=False``)."""
        return not self._modes.needed(mode_signature(self.model)) and (
            not self._modes.enabled or self._modes.checked_size(signature(self.model, 0)) > 0
        )

    @contextlib.contextmanager
    def _compiled_refusal(self):
        """Context: a first-batch check that refuses the compiled door detaches it (the model gets its
        forward back, every hook is removed) and says so; every later step raises the same refusal."""
        try:
            yield
        except ValueError as err:
            if self._door is None:
                raise
            self._refused = (
                f"with compile={self._compile!r}: {err}; the model's forward and hooks were restored: train this "
                "model without compile= (call make_private again with compile=False)"
            )
            self.detach()
            raise ValueError(self._refused) from None

    def _verify(self, p: Pass, key=None, defer: bool = False) -> None:
        """Hook path vs. an exact loop of single-example autograd, for a random linear loss (module docstring).

        Runs in the mode of the pass ``p`` (the mode of the release), with the
        batched pass's random draws replayed per example
        (:mod:`dpopt.engine.check`); once per mode signature.

        ``defer``: the pass at this batch's size or above (a batched pass as
        large as the user's) is left to :meth:`finish_check`, which the
        optimizer runs once this step's records are consumed and freed and
        before anything is released — beside the records it doubled the
        first step's activations (issue 34: peak memory). The small sizes run
        here (they decide what :meth:`_again` may have to redo).
        """
        k, views = self._check_examples(p), self.views
        offsets = torch.arange(views)
        self._deferred, self._deferred_key = [], None  # a step that raised before finish_check: its passes again
        with in_modes(self.model, p.modes):
            self._rec.active = False
            try:
                args, kwargs = self._select(p, torch.arange(k * views))  # k ≥ 2: a mode may need several examples
                dims = model_dims(self.model, args, kwargs)
            finally:
                self._rec.active = True
            sizes = free_sizes(dims, multiple=views)
            small = len(sizes)
            largest = self._check_rows(p)
            if largest > sizes[-1]:  # and at this batch's size or above (a forward may mix only in large batches)
                sizes += free_sizes(dims, k=1, multiple=views, at_least=largest)
            compare = k if self.compare_subset else None
            for j, n in enumerate(sizes):
                rows = ((torch.arange(n // views) % k).unsqueeze(1) * views + offsets).flatten()
                if defer and j >= small:  # its inputs only (n rows of the first k examples), run after the step
                    self._deferred.append((self._select(p, rows), n, compare, p.modes))
                    continue
                self._verify_at(self._select(p, rows), n, compare=compare)
        if self._deferred:
            self._deferred_key = p.modes if key is None else key
        else:
            self._modes.done(p.modes if key is None else key)

    def cancel_check(self) -> None:
        """Forget the passes :meth:`collect` deferred (``defer_check=True``) for a step that failed before
        :meth:`finish_check`: their inputs are rows of that step's private batch, which must not outlive it
        (a ``copy.deepcopy`` would carry them). The signature stays unchecked: its next batch is checked."""
        self._deferred, self._deferred_key = [], None

    def finish_check(self) -> None:
        """Run the first-batch check's passes :meth:`collect` deferred (``defer_check=True``); then mark it done.

        Call it after the step's source was consumed and freed and before
        the release: it raises as :meth:`collect` would (nothing may be
        released then). Nothing to do when nothing was deferred.

        Raises:
            ValueError: the check refused the model at this batch's size; or it
                had to compute some parameters through an enclosing call
                (:mod:`dpopt.engine.lift`), which the step's pass, already
                freed, was not captured with: repeat the step.
        """
        todo, self._deferred = self._deferred, []
        key, self._deferred_key = self._deferred_key, None
        if not todo:
            return
        lifts = self._rec.lifts
        before = set(lifts.lifted) if lifts is not None else set()
        with preserved_state(self.model), self._compiled_refusal():
            for inputs, n, compare, modes in todo:
                with in_modes(self.model, modes):
                    with _check_noted():
                        self._verify_at(inputs, n, compare=compare)
        if lifts is not None and set(lifts.lifted) != before:
            raise ValueError(
                "the first-batch check at this batch's size moved some parameters to their enclosing "
                "layer's capture (engine.lift) after this step's pass was consumed; nothing was released: "
                "repeat this step (zero the gradients and run the forward and backward again)"
            )
        self._modes.done(cast(tuple, key))

    #: The check compares the rows of its first k ≤ 8 examples only; FSDP compares every row, so that every
    #: rank runs the same single-example passes (the same collectives).
    compare_subset = True

    def _check_examples(self, p: Pass) -> int:
        """k: the batch's examples the check's passes are built from (at most 8)."""
        return min(p.batch_size // self.views, 8)

    def _check_rows(self, p: Pass) -> int:
        """The batch size the check must also cover: this pass's rows."""
        return p.batch_size

    def _run_check(self, args, kwargs, loss_of):
        """The check's batched pass: the model's forward, the gradients through the tensor hooks."""
        with torch.enable_grad():
            out = self.model(*args, **kwargs)
            loss = loss_of(out)
            if self._door is not None:  # compiled: the parameters are detached in the graph, the taps are not
                taps = [t for c in self._rec.calls for t in c.outs if t.requires_grad]
                # a kept output is an OutputStub (capture.py): its graph edge stands for the tensor
                taps = [t.edge if isinstance(t, OutputStub) else t for t in taps]
                torch.autograd.grad(loss, taps, allow_unused=True)  # fills the tensor hooks on the taps
            else:
                self._rec.backward_only(loss, self.params)  # fills the tensor hooks (through reentrant checkpoints)
        calls, other = self._rec.take()
        self._check_layout([c for c in calls if c.has_grad], int(leaves((args, kwargs))[0].shape[0]))
        return [c for c in calls if c.has_grad], other

    def _verify_at(self, inputs, n: int, compare: Optional[int] = None) -> None:
        args, kwargs = inputs
        try:
            bad, off = self._rec.check(
                args, kwargs, n, self.views, self._run_check, params=self.params, compare=compare
            )
            while off and not bad and self._rec.escalate(off):  # a parameter used outside its calls: one level up
                bad, off = self._rec.check(
                    args, kwargs, n, self.views, self._run_check, params=self.params, compare=compare
                )
        except OutputLayout as err:
            raise ValueError(
                f"the model's output {err.args[0]} does not have the examples along dim 0 (batch of "
                f"{n}); the hook engine needs [B, ...] outputs"
            ) from None
        except Unreplayable as err:
            if self._door is not None:  # eager (compile=False) replays the draws: dpopt's loop is not needed
                raise ValueError(
                    f"{err}: random operations (dropout in train mode) draw inside the compiled graph, where "
                    "the check cannot replay them per example"
                ) from None
            raise ValueError(
                f"{err}; the hook engine of PrivacyEngine cannot check this model against "
                "single-example autograd in the mode it trains in. Use dpopt's own loop "
                "(dpopt.iter_per_sample_sources), which computes each example alone"
            ) from None
        for m, (ins, outs) in bad.items():
            raise self._layout_error(m, ins, outs)
        if off:
            mode = "train" if self.model.training else "eval"
            since = (
                "This model passed an earlier check, so something changed since then: a module hook added or "
                "replaced (a forward, forward pre- or backward hook, also a process-wide one; docs/pitfalls.md, "
                "item 29), a module attribute switched, the train/eval mode, or a batch of a larger size class. "
                "Nothing was released for this step; remove or undo the change (a hook: handle.remove()) and training "
                "goes on (a state checked before is accepted again). Otherwise: "
                if self._modes.any_done
                else ""
            )
            raise ValueError(
                f"{since}per-sample gradients of {sorted(self.names[i] for i in off)} captured from the "
                f"backward pass do not match single-example autograd in the mode the model trains in "
                f"(model.{mode}()): the forward mixes examples (e.g. batch statistics under "
                "model.train(), as in `if self.training: h = h - h.mean(0)`), or a parameter is used "
                "outside its module's forward (e.g. F.linear(x, self.fc.weight) in a parent module). "
                "The hook engine of PrivacyEngine cannot train this model privately; use dpopt's own "
                "loop (dpopt.iter_per_sample_sources), which computes each example alone (a mixing "
                "layer then behaves per example, not per batch)"
            )


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
        raise ValueError(
            f"p.grad_sample is set on some trainable parameters but not on those of shapes {missing}; "
            "every trainable parameter needs its per-sample gradients"
        )
    grads = []
    for p in params:
        g = p.grad_sample  # type: ignore[attr-defined]
        if isinstance(g, (list, tuple)):  # Opacus keeps a list when a layer was called several times
            g = sum(g)
        if g.dim() != p.dim() + 1 or tuple(g.shape[1:]) != tuple(p.shape):
            raise ValueError(
                f"p.grad_sample must have shape [B, *p.shape]; got {tuple(g.shape)} for a parameter "
                f"of shape {tuple(p.shape)}"
            )
        grads.append(g.detach())
    if len({int(g.shape[0]) for g in grads}) != 1:
        raise ValueError("p.grad_sample tensors have different batch sizes")
    return PerSampleGrads(grads, params=tuple(params))
