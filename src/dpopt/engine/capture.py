"""The one per-sample capture mechanism of both front doors: plan, recorder, per-call checks, blocks, the check.

``dpopt train`` / :func:`dpopt.engine.iter_per_sample_sources`
(:class:`~dpopt.engine.fast.PerSampleEngine`: dpopt runs the forward and the
backward of per-example losses) and ``PrivacyEngine``
(:class:`~dpopt.engine.hooks.HookCapture`: the user's forward and backward)
record layer inputs and output gradients with the same :class:`Recorder`,
check every call's layout the same way (:meth:`Recorder.layout`), build the
blocks with the same rules (:mod:`dpopt.engine.rules`, the one place a
layer type is added) and run the same first-batch check against
single-example autograd (:meth:`Recorder.check`, the comparison itself in
:mod:`dpopt.engine.check`). What differs per door is only the policy:

* how the output gradients arrive — the engine differentiates its own
  per-example losses w.r.t. the recorded outputs (``tensor_hooks=False``);
  the hook door registers tensor hooks and lets the user's backward fill them;
* what a failed check does — the engine moves the parameters to the exact
  per-example path (each example computed alone); the hook door, which
  cannot recompute an example alone, refuses;
* the parameters without a rule — the engine's exact ``torch.func`` path over
  the whole model; the hook door's vjp of the owning module's recorded call
  (:meth:`Recorder.vjp_blocks`).

**Example identity across views** (``rows_per_example = K``): rows
``i·K … i·K + K − 1`` of a batch of ``n = B·K`` rows are K views (augmentations)
of example i, whose gradient is the MEAN over its views,
g_i = (1/K) Σ_v ∇ℓ(x_{iK+v}) (De et al. 2022, "augmentation multiplicity",
arXiv 2204.13650, §3.1). The doors scale the output gradients so that each
row's ``e`` is 1/K of its view's gradient (the engine: coefficient/K; the hook
door with a mean loss over the n rows: ``e = B·grad_output``, B examples, not
n rows) and :meth:`Plan.blocks` sums the K rows of each example exactly, for
every rule: a rule registered with ``views="merge"`` (Linear, Embedding,
LayerNorm, RMSNorm, recurrent cells, HF Conv1D: rules that sum over
positions) receives ``[B, K, ...]`` tensors (the K views become K more
positions of one example), any other rule receives K calls of ``[B, ...]``
(view v of every example; rules sum over calls). The first-batch check
compares with the per-row single-example autograd gradients averaged over
each example's K rows.
"""

from __future__ import annotations

import numbers
import warnings
import weakref
from functools import partial
from typing import Callable, Iterator, Optional, Sequence, cast

import torch
from torch import Tensor, nn
from torch._C._functorch import peek_interpreter_stack
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..allocator import release_free_heap
from .aliases import alias_names, owned
from .bare import bare_candidates, reduce_to, tap_bare
from .check import (
    RTOL,
    RandomReplay,
    Unreplayable,
    alone_failed,
    disagreeing,
    disagreeing_rows,
    finite_sq_norm64,
    in_float64,
    mode_signature,
    module_state,
    off_axis,
    rtol,
    sq_dist64,
)
from .hf_guards import is_hf, refuse_batch_loss
from .hf_labels import LabelsLoss
from .inputs import check_buffers, guarded_buffers, preserved_state, snapshot_buffers
from .layers import Budget, DirectBlock, check_norm_form, compute_dtype, derived_cache_bytes, scaled_block
from .lift import Lifts, on_axis
from .recompute import REPLAY, param_grads, recomputation, reentrant_refused, saved_tensors_hooked
from .rules import RULES, LayerCalls, rule_for, tap_forwards
from .tied import merge_shared

__all__ = [
    "Plan",
    "Call",
    "Pass",
    "Recorder",
    "OutputLayout",
    "expand_broadcast",
    "no_autocast",
    "public_shape",
    "check_views",
]


def leaves(obj) -> list[Tensor]:
    """The tensors of a pytree (args/kwargs/outputs), in ``tree_flatten``'s order.

    The common structures — a plain tensor, plain tuples/lists of them, empty dicts (``(args, {})``), non-tensor
    scalars — are walked here (torch's pytree costs ≈ 10 µs per call, several calls per layer and step);
    anything else (a dict with entries, a namedtuple, a tensor subclass, another registered node) goes
    through ``tree_flatten``.
    """
    out: list[Tensor] = []
    return out if _plain_leaves(obj, out) else [t for t in tree_flatten(obj)[0] if isinstance(t, Tensor)]


_PLAIN_TENSORS = (Tensor, nn.Parameter)
_PLAIN_SCALARS = (type(None), bool, int, float, str)


def _plain_leaves(obj, out: list) -> bool:
    """Append ``obj``'s tensors to ``out`` where it is built only of plain tensors, plain tuples/lists, empty
    dicts and scalars (what ``tree_flatten`` flattens in this order); False (``out`` then unusable) otherwise."""
    kind = type(obj)
    if kind in _PLAIN_TENSORS:
        out.append(obj)
        return True
    if kind is tuple or kind is list:
        return all(_plain_leaves(x, out) for x in obj)
    if kind is dict:
        return not obj
    return kind in _PLAIN_SCALARS


def public_shape(shape) -> str:
    """What an error or warning may print of a tensor's shape: its number of dimensions only (``3-dim``).

    The messages that print shapes are about layers that do NOT keep the examples along dim 0, so the
    realised (private, under Poisson sampling) batch size may sit in any dimension: ``[T, B, D]`` shows B at
    dim 1, ``[B*T, D]`` folds it into dim 0. No dimension is printed.
    """
    if not isinstance(shape, tuple):
        return "a non-tensor"
    return f"{len(shape)}-dim"


def no_autocast(device: torch.device):
    """The engine's own norm/sum math runs exactly, in the parameters' dtype, outside autocast."""
    return torch.autocast(device_type=device.type, enabled=False)


class OutputLayout(Exception):
    """The model's output does not have the rows along dim 0 (``args[0]``: its shape or type)."""


def check_views(rows: int, k: int) -> int:
    """The number of examples B of ``rows`` rows with ``k`` views each.

    Raises:
        ValueError: ``k`` < 1, or ``rows`` is not a multiple of ``k``.
    """
    if k < 1:
        raise ValueError(f"rows_per_example must be >= 1, got {k}")
    if rows % k:
        raise ValueError(
            f"the batch's rows are not a multiple of K={k} views per example "  # no count: private
            "(augmentation_multiplicity / rows_per_example): rows i*K..i*K+K-1 must be the K views of "
            "example i. Repeat each example K times, augmenting each copy "
            "(dpopt.augment.repeat_views(x, K, fn), labels repeat_interleave(K)), or let "
            "make_private(..., augmentation=...) build the views in the data loader"
        )
    return rows // k


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
        module: the called layer; inp: its first input; out: its output; b: the rows of the pass.

    Returns:
        ``(inp, out)``, expanded or as given.
    """
    if (
        b > 1
        and type(module) is nn.Embedding
        and isinstance(inp, Tensor)
        and isinstance(out, Tensor)
        and inp.dim() >= 1
        and inp.shape[0] == 1
        and out.dim() == inp.dim() + 1
        and out.shape[0] == 1
    ):
        return inp.expand(b, *inp.shape[1:]), out.expand(b, *out.shape[1:])
    return inp, out


# --------------------------------------------------------------------------- records
class GradSlots(list):
    """The output gradients of one :class:`Call` (a list, with a ``sink`` for a dropped call).

    The tensor hook of a recorded output holds THIS list, never the
    :class:`Call`: the call holds the output, whose autograd node holds the
    hook; a hook that reached the call (``partial(call.store, k)``) would be a
    cycle through autograd's C++ side, which Python's ``gc`` never frees
    (every step's activations kept for ever). A dropped call's slots only
    note a late gradient (:meth:`Recorder.drop_unused`).
    """

    __slots__ = ("sink",)

    def __init__(self, grads=()):
        super().__init__(grads)
        self.sink = None  # (set, key) once its call was dropped unused: a late gradient is noted there


def store_grad(grads: list, k: int, grad: Tensor) -> None:
    """The tensor hook of output ``k``: add ``grad`` into ``grads[k]`` (holds the slots only, not the call)."""
    sink = getattr(grads, "sink", None)
    if sink is not None:  # its call was dropped (Recorder.drop_unused): only note that the gradient came
        sink[0].add(sink[1])
        return
    grads[k] = grad if grads[k] is None else grads[k] + grad


def _enter_backward(cell: list, pass_, grad_outputs) -> None:
    """Node pre-hook of a root output: the backward of ``pass_`` runs (a reentrant recomputation's pass)."""
    cell[0] = pass_


def _note_late(late: set, key, grad_outputs) -> None:
    """Node pre-hook of a dropped call's output (:meth:`Recorder.drop_unused`): its backward came late."""
    late.add(key)


class Pass:
    """One forward pass of the root module: its rows (private), the inputs (private), the mode signature."""

    __slots__ = ("batch_size", "args", "kwargs", "modes", "state", "unresolved", "serial", "out_grads")

    def __init__(self, batch_size: int, args, kwargs, modes, state=None):
        self.batch_size, self.args, self.kwargs, self.modes = batch_size, args, kwargs, modes
        self.state = state  # engine.check.module_state at the forward (the check's signature)
        self.unresolved: dict = {}  # engine.lift: off-axis layers no enclosing call could take (refused)
        self.serial = 0  # the Recorder's count of root passes (engine.lift: which lifts a pass has seen)
        self.out_grads: Optional[GradSlots] = None  # engine.lift: the root outputs' gradients (to run it again)


class OutputStub:
    """What the hook door keeps of a layer's output once its tensor hooks are on it: shape, node, version.

    The output's values are never read (the rules use the input and the
    output gradient); holding the tensor kept every output autograd itself
    frees after the forward (both doors: the engine's :meth:`Recorder.fill`
    differentiates w.r.t. the output's graph edge) — a linear layer's output feeding an add, the
    logits ``[B, T, V]`` feeding a log-softmax — alive until the step
    (issue 34: ≈ 68 MiB on the GPT-2 shape). The tensor hooks live on the
    graph's node, so the gradient still arrives when the tensor is gone.
    """

    __slots__ = ("shape", "grad_fn", "requires_grad", "_version", "edge")

    def __init__(self, t: Tensor):
        self.shape, self.grad_fn, self.requires_grad, self._version = t.shape, t.grad_fn, t.requires_grad, t._version
        # the engine door differentiates w.r.t. the output: the graph edge stands for the tensor (Recorder.fill)
        self.edge = get_gradient_edge(t) if t.requires_grad else None

    def dim(self) -> int:
        return len(self.shape)


class Call:
    """One recorded call: a planned layer's (input ``inp``, output ``out``), or a vjp call's (args, kwargs, outs).

    Attributes:
        module: the layer. inp, out: for a layer with a rule (or a tapped
            map, ``tag``; or a bare parameter's broadcast R, ``index``), the
            recorded input and output; None for a call kept only for its vjp.
        args, kwargs, outs: the call's inputs and output tensors (vjp calls).
        grads: one output gradient per ``outs`` entry once backward reached it.
        stats: ``(mean, rstd)`` autograd saved for a norm layer's backward.
        pass_: the :class:`Pass` the call belongs to (None: outside the root's forward).
    """

    __slots__ = (
        "module",
        "inp",
        "out",
        "args",
        "kwargs",
        "outs",
        "grads",
        "tag",
        "stats",
        "index",
        "pass_",
        "in_version",
        "out_version",
        "versions",
    )

    def __init__(self, module, inp, out, args, kwargs, outs, pass_, tag=None, index=None, versions: bool = True):
        self.module, self.inp, self.out, self.tag, self.index = module, inp, out, tag, index
        self.args, self.kwargs, self.outs, self.pass_ = args, kwargs, outs, pass_
        self.grads: list[Optional[Tensor]] = GradSlots([None] * len(outs))
        self.in_version = inp._version if inp is not None else 0
        self.out_version = out._version if out is not None else 0
        self.versions = [t._version for t in leaves((args, kwargs))] if versions else None
        self.stats = None
        gf = None if saved_tensors_hooked() else getattr(out, "grad_fn", None)  # a checkpoint's: would recompute
        # mean and 1/std that autograd saved for the norm layer's backward (avoids recomputing them)
        if type(gf).__name__ in ("NativeGroupNormBackward0", "NativeLayerNormBackward0"):
            try:
                self.stats = (gf._saved_result1, gf._saved_result2)  # type: ignore[union-attr]
            except AttributeError:  # pragma: no cover - other torch versions
                self.stats = None

    @property
    def fast(self) -> bool:
        """True for a call a rule (or a bare-parameter tap) consumes."""
        return self.inp is not None

    def store(self, k: int, grad: Tensor) -> None:
        self.grads[k] = grad if self.grads[k] is None else self.grads[k] + grad  # type: ignore[operator]

    @property
    def used(self) -> list[int]:
        """Indices of the output tensors that received a gradient."""
        return [k for k, g in enumerate(self.grads) if g is not None]

    @property
    def has_grad(self) -> bool:
        return any(g is not None for g in self.grads)


# --------------------------------------------------------------------------- the plan
def check_cache_bytes(cache_bytes: Optional[int]) -> Optional[int]:
    """``cache_bytes`` as an int (or None: derived per batch); a clear error for anything else.

    Raises:
        ValueError: not None and not an integer ≥ 0.
    """
    if cache_bytes is None:
        return None
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, numbers.Integral) or cache_bytes < 0:
        raise ValueError(
            f"cache_bytes must be None (derived from the model and batch) or an integer number of bytes >= 0, "
            f"got {cache_bytes!r}"
        )
    return int(cache_bytes)


class Plan:
    """Which trainable parameter is computed how; builds the blocks of the rule-covered ones.

    Args:
        model: the module (held weakly); trainable parameters in
            ``named_parameters`` order are the sources' parameters.
        chunk_bytes, cache_bytes: the :class:`~dpopt.engine.layers.Budget` of each source;
            ``cache_bytes=None`` (default): derived per batch from the model and
            the recorded activations (:meth:`budget`), an int: that many bytes.
        norm_form: None (default): each factored layer's norm form from the cost model; one of
            :data:`~dpopt.engine.layers.NORM_FORMS`: that form wherever it applies
            (:attr:`~dpopt.engine.layers.Budget.norm_form`).
        weak: hold the model weakly (the engine cache is keyed weakly by the
            model); False (the hook door): strongly, so that a ``deepcopy`` of
            the model with its hooks gives a plan of the copy.

    Attributes:
        names, params: the trainable parameters. modules: module →
        {attribute: index} of the parameters a rule covers (a tied parameter:
        every owner has a rule). bare: bare broadcast parameters
        (:mod:`dpopt.engine.bare`). fallback: indices of the others.
        tapped: modules whose rule has a tapped forward. dtype, device.
    """

    def __init__(
        self,
        model: nn.Module,
        chunk_bytes: int = 16 << 20,
        cache_bytes: Optional[int] = None,
        weak: bool = True,
        norm_form: Optional[str] = None,
    ):
        self._strong = None if weak else model
        self._model = weakref.ref(model)
        self.chunk_bytes = int(chunk_bytes)
        self.cache_bytes = check_cache_bytes(cache_bytes)
        self.norm_form = check_norm_form(norm_form)
        named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
        self.names = [k for k, _ in named]
        self.params = [p for _, p in named]
        self._key = tuple(id(p) for p in self.params)
        self.module_names = {id(m): n or "<root>" for n, m in model.named_modules()}  # ids: no strong refs
        index = {id(p): i for i, p in enumerate(self.params)}
        rules = {m: rule_for(m) for m in model.modules()}
        self._aliases = alias_names(model)  # a child's parameter registered again on its parent (engine.aliases)
        # a parameter is on the fast path if EVERY module that owns it has a rule; a tied parameter
        # (several owners) then gets one block per use, summed with its cross terms (engine.tied)
        ruled: dict[int, bool] = {}
        for m, rule in rules.items():
            for p in owned(m, self._aliases).values():
                ruled[id(p)] = ruled.get(id(p), True) and rule is not None
        self.modules: dict[nn.Module, dict[str, int]] = {}
        for m, rule in rules.items():
            if rule is None:
                continue
            own = {a: index[id(p)] for a, p in owned(m, self._aliases).items() if id(p) in index and ruled[id(p)]}
            if own:
                self.modules[m] = own
        self.tapped = [m for m, rule in rules.items() if rule is not None and rule.forward is not None]
        self.hf = [m for m in rules if is_hf(m) and hasattr(m, "config")]
        self.bare: dict[nn.Module, dict[str, int]] = bare_candidates(model, index, lambda m: rules[m] is not None)
        covered = set(self.fast_indices())
        self.fallback = [i for i in range(len(self.params)) if i not in covered]
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.device = self.params[0].device if self.params else torch.device("cpu")

    @property
    def model(self) -> nn.Module:
        model = self._strong if self._strong is not None else self._model()
        if model is None:
            raise RuntimeError("the model of this per-sample capture no longer exists")
        return model

    def name_of(self, module: nn.Module) -> str:
        return self.module_names.get(id(module), "?")

    def fast_indices(self) -> list[int]:
        """Indices of the parameters on the fast path: of the layer rules and the bare-parameter taps."""
        return sorted({i for own in list(self.modules.values()) + list(self.bare.values()) for i in own.values()})

    @property
    def fast_names(self) -> list[str]:
        """Names of the trainable parameters a rule (or a bare-parameter tap) covers."""
        fb = set(self.fallback)
        return [n for i, n in enumerate(self.names) if i not in fb]

    @property
    def fallback_names(self) -> list[str]:
        """Names of the others (the door's per-example fallback)."""
        return [self.names[i] for i in self.fallback]

    def matches(self, model: nn.Module) -> bool:
        """True if ``model`` still has the trainable parameters this plan was made for."""
        return model is self.model and tuple(id(p) for p in model.parameters() if p.requires_grad) == self._key

    def vjp_owners(self) -> dict[nn.Module, dict[str, int]]:
        """Module → {attribute: index} of the fallback parameters it owns (the hook door's vjp)."""
        fb = set(self.fallback)
        index = {id(p): i for i, p in enumerate(self.params)}
        out = {}
        for m in self.model.modules():
            own = {a: index[id(p)] for a, p in owned(m, self._aliases).items() if id(p) in index and index[id(p)] in fb}
            if own:
                out[m] = own
        return out

    def demote(self, indices: Sequence[int]) -> None:
        """Move parameters off the rules (to the door's per-example fallback)."""
        drop = set(indices)
        self.fallback = sorted(set(self.fallback) | drop)
        for table in (self.bare, self.modules):
            for m in list(table):
                own = {a: i for a, i in table[m].items() if i not in drop}
                if own:
                    table[m] = own
                else:
                    del table[m]

    # -- blocks ------------------------------------------------------------------------
    def budget(self, captured: Sequence[tuple[Call, Optional[Tensor]]]) -> Budget:
        """The memory :class:`~dpopt.engine.layers.Budget` of one source built from ``captured``.

        ``cache_bytes`` as given, or (None) :func:`~dpopt.engine.layers.derived_cache_bytes`
        of the model's parameter bytes (every parameter tensor once), its
        trainable parameters' bytes (the non-private ``.grad``) and the bytes
        of the distinct layer inputs recorded for the calls that received a
        gradient (each storage once). Its ``norm_form`` is the plan's.
        """
        if self.cache_bytes is not None:
            return Budget(self.chunk_bytes, self.cache_bytes, norm_form=self.norm_form)
        seen: dict[int, int] = {}
        for p in self.model.parameters():
            seen.setdefault(id(p), p.numel() * p.element_size())
        grads = sum(p.numel() * p.element_size() for p in self.params)
        acts: dict[tuple, int] = {}
        for c, e in captured:
            a = c.inp
            if e is None or c.index is not None or not isinstance(a, Tensor) or a.device.type == "meta":
                continue
            st = a.untyped_storage()
            acts[(a.device, st.data_ptr())] = st.nbytes()
        cache = derived_cache_bytes(sum(seen.values()), grads, sum(acts.values()))
        return Budget(self.chunk_bytes, cache, norm_form=self.norm_form)

    def blocks(
        self,
        captured: Sequence[tuple[Call, Optional[Tensor]]],
        rows: int,
        budget: Optional[Budget] = None,
        views: int = 1,
    ) -> list:
        """Blocks of the rule-covered parameters from ``(call, e)`` pairs, computing in
        :func:`~dpopt.engine.layers.compute_dtype` of the parameters' dtype (float32 for bf16/fp16
        parameters and for float32 ones under autocast alike: the recorded bf16 ``a`` and ``e`` are
        cast to it, per chunk of examples by a ``chunked`` rule, whole by the others).

        Args:
            captured: fast calls and their output gradients ``e [rows, ...]`` (None: unused).
            rows: n, the rows of the pass; views: K (rows per example): the
                blocks are over B = n / K examples, each the sum of its K rows
                (module docstring).
            budget: the source's memory budget; None: :meth:`budget` of ``captured``.
        """
        if budget is None:
            budget = self.budget(captured)
        b = rows // views
        per_module: dict[nn.Module, list] = {m: [] for m in self.modules}
        bare: dict[int, list] = {i: [] for own in self.bare.values() for i in own.values()}
        for c, e in captured:
            if e is None:
                continue
            if c.index is not None:
                if c.index in bare:
                    g = reduce_to(
                        e.detach().to(compute_dtype(self.params[c.index].dtype)),
                        tuple(c.out.shape),
                        tuple(self.params[c.index].shape),
                    )
                    bare[c.index].append(_sum_views(g, views))
                continue
            if c.module not in per_module:
                continue
            dt = compute_dtype(self.params[next(iter(self.modules[c.module].values()))].dtype)
            a, e = c.inp.detach(), e.detach()
            if not RULES[type(c.module)].chunked:  # a chunked rule's blocks cast per chunk of examples
                a, e = (a.to(dt) if a.is_floating_point() else a), e.to(dt)
            st = None if c.stats is None else tuple(t.detach().to(dt) for t in c.stats)
            per_module[c.module].append((a, e, st, c.tag))
        blocks: list = []
        for m, own in self.modules.items():
            if per_module[m]:
                blocks.extend(self._module_blocks(m, own, per_module[m], b, views, budget))
        covered = {i for blk in blocks for i in blk.index}  # a layer never called (or unused): zero gradients,
        idle = sorted({i for own in self.modules.values() for i in own.values()} - covered)  # once per parameter
        if idle:  # (a tied weight whose other use was called is covered there, without a zero [B, V, D])
            blocks.append(DirectBlock(idle, [self._zeros(i, b) for i in idle]))
        for i, gs in bare.items():  # bare parameters: Σ over their recognised uses (engine.bare)
            blocks.append(DirectBlock([i], [sum(gs) if gs else self._zeros(i, b)]))
        return merge_shared(blocks, [p.shape for p in self.params], budget.chunk_bytes)

    def _zeros(self, i: int, b: int) -> Tensor:
        """``[b, *shape]`` zero per-example gradients of parameter ``i``, in its compute dtype."""
        p = self.params[i]
        return p.new_zeros((b, *p.shape), dtype=compute_dtype(p.dtype))

    def _module_blocks(self, m: nn.Module, own: dict, calls: list, b: int, views: int, budget: Budget) -> list:
        rule = RULES[type(m)]  # planned only if rule_for(m) (see __init__)
        if views > 1:
            calls = _merge_views(calls, b, views) if rule.views == "merge" else _split_views(calls, views)
        layer = LayerCalls(
            m,
            dict(own),
            {a: self.params[i].shape for a, i in own.items()},
            [(a, e) for a, e, _, _ in calls],
            [st for _, _, st, _ in calls],
            b,
            budget,
            [tag for _, _, _, tag in calls],
            views if rule.views == "merge" else 1,
            compute_dtype(self.params[next(iter(own.values()))].dtype),
        )
        return rule.blocks(layer)


def _is_cache(v) -> bool:
    """A Hugging Face key/value cache (``transformers.Cache``): the batched call already filled it.

    An enclosing call's recorded kwargs drop it (None): its per-example vjp
    re-runs the call, which would append to the cache again. Exact for a
    training forward, whose cache starts empty; otherwise the first-batch
    check refuses the mismatch.
    """
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers.") for c in type(v).__mro__)


def _fresh_outputs(out):
    """``out`` with each tensor that requires gradients replaced by a view of itself; and those tensors.

    An enclosing call may return tensors it also uses itself (the hidden
    states of every layer, its own input): a hook on such a tensor would
    receive the gradient flowing back through the call as well, which the
    call's vjp counts again. A fresh view receives only the gradient from
    outside the call.
    """
    flat, spec = tree_flatten(out)
    flat = [t.view_as(t) if isinstance(t, Tensor) and t.requires_grad else t for t in flat]
    return tree_unflatten(flat, spec), [t for t in flat if isinstance(t, Tensor)]


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """``[n]``: ⟨a_r, b_r⟩ over every dimension but the first, as one batched matmul (no ``a * b`` temporary)."""
    n = a.shape[0]
    return torch.bmm(a.reshape(n, 1, -1), b.reshape(n, -1, 1)).reshape(n)


PROBE_CHUNK = 1 << 16
"""Normals per float64 slice of the check's test direction ρ (:class:`_ProbeLoss`): 512 KiB."""


def _probe_chunks(seed: int, row: int, m: int, chunk: int = PROBE_CHUNK) -> Iterator[tuple[int, int, Tensor]]:
    """Row ``row`` of the check's test direction ρ (``m`` elements): ``(start, stop, float64 normals)`` slices.

    Each row has its own public generator, seeded ``seed + row`` (the check's direction is not private), so
    any row is drawn alone, in the same slices forward and backward, and ρ is never held whole.
    """
    gen = torch.Generator().manual_seed(seed + row)
    for s in range(0, m, chunk):
        t = min(m, s + chunk)
        yield s, t, torch.randn(t - s, generator=gen, dtype=torch.float64)


class _ProbeLoss(torch.autograd.Function):
    """Per row ``⟨ρ_r, o_r⟩ + ⅛‖o_r‖²`` → ``[n]`` (the first-batch check's loss when the door has none).

    ρ_r: standard normals (float64, rounded to ``o``'s dtype) of row ``row0 + r``'s generator
    (:func:`_probe_chunks`; inside ``aside()``, the check's :meth:`~dpopt.engine.check.RandomReplay.set_aside`:
    not the model's draws), drawn slice by slice in the forward and drawn again in the backward, so
    neither ρ (an output-sized tensor) nor a float64 copy of it is kept through the pass. Backward:
    ``g_r·(ρ_r + ¼·o_r)`` as ONE tensor of ``o``'s size. Before (issue 34): ρ in float64 and in ``o``'s
    dtype, and three output-sized products in the backward of the dot products, at the hook door's
    first-step peak (the GPT-2 shape's logits: 36 MiB each).
    """

    @staticmethod
    def forward(ctx, o: Tensor, seed: int, row0: int, aside: Callable) -> Tensor:
        ctx.save_for_backward(o)
        ctx.seed, ctx.row0, ctx.aside = seed, row0, aside
        n = o.shape[0]
        flat = o.reshape(n, -1)
        out = 0.125 * _row_dot(o, o)
        with aside():
            for r in range(n):
                dot = torch.zeros((), dtype=out.dtype, device=o.device)
                for s, t, z in _probe_chunks(seed, row0 + r, flat.shape[1]):
                    dot += torch.dot(flat[r, s:t], z.to(device=o.device, dtype=o.dtype)).to(out.dtype)
                out[r] += dot
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        (o,) = ctx.saved_tensors
        n = o.shape[0]
        grad = torch.empty(o.shape, dtype=o.dtype, device=o.device)  # contiguous: rows are flat slices
        flat = grad.view(n, -1)
        with ctx.aside():
            for r in range(n):
                for s, t, z in _probe_chunks(ctx.seed, ctx.row0 + r, flat.shape[1]):
                    flat[r, s:t].copy_(z)
        grad.add_(o, alpha=0.25)
        return grad.mul_(g.view(-1, *([1] * (o.dim() - 1))).to(grad.dtype)), None, None, None


def _dropped(g: Tensor) -> Tensor:
    """A parameter hook's stand-in for ``g``: a zero-stride zero of its shape (no gradient memory kept)."""
    return torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)


def _shapes(ts) -> list:
    return [tuple(t.shape) for t in ts]


def _sum_views(g: Tensor, views: int) -> Tensor:
    """``[B·K, ...]`` → ``[B, ...]``: the sum of each example's K consecutive rows."""
    if views == 1:
        return g
    return g.reshape(g.shape[0] // views, views, *g.shape[1:]).sum(1)


def _rows_view(t: Tensor, b: int, views: int) -> Tensor:
    return t.reshape(b, views, *t.shape[1:])


def _merge_views(calls: list, b: int, views: int) -> list:
    """Each call's ``[B·K, ...]`` tensors as ``[B, K, ...]``: the K views become positions of one example."""
    out = []
    for a, e, st, tag in calls:
        st = None if st is None else tuple(_rows_view(t, b, views) for t in st)
        out.append((_rows_view(a, b, views), _rows_view(e, b, views), st, tag))
    return out


def _split_views(calls: list, views: int) -> list:
    """K calls per call, view v = rows v, v + K, ... (view-major: each view a whole pass, as evaluation points)."""
    out = []
    for v in range(views):
        for a, e, st, tag in calls:
            out.append((a[v::views], e[v::views], None if st is None else tuple(t[v::views] for t in st), tag))
    return out


# --------------------------------------------------------------------------- the recorder
class Recorder:
    """Forward hooks, tapped forwards and bare-parameter taps that record the calls of one model.

    Args:
        plan: the :class:`Plan`.
        vjp: module → {attribute: index} of parameters computed by a vjp of
            the module's recorded call (the hook door); their calls are kept too.
        tensor_hooks: register a tensor hook on every recorded output (the
            user's backward fills :attr:`Call.grads`); False: the door fills
            them (:meth:`fill`).
        guard_buffers: snapshot the buffers at each root forward and refuse a
            forward that changed one (the hook door; the engine guards a whole step).
        hook_bare_owners: also record the calls of the modules that own bare
            parameters (for their vjp when a use is not recognised).
        lift: capture a layer whose call does not keep the examples along
            dim 0 through the vjp of the nearest enclosing call that does
            (:mod:`dpopt.engine.lift`; the hook door, whose fallback is that vjp).
        param_grads: False: the parameters of a rule layer (not tapped) leave
            the graph of each call whose inputs require a gradient (their
            ``requires_grad`` is off for the call only, :meth:`_params_off`), so
            the user's backward computes that layer's input gradient but not its
            weight gradient (the GEMM Eᵀ A per Linear) and forms no ``p.grad``
            for it: the hook door's clipped sum replaces that product (issue 34).
            The recorded outputs still require a gradient (through the input),
            so their tensor hooks fire as before; a call whose inputs require
            none keeps its parameters (its output needs them to require one).

    A forward that activation checkpointing re-runs inside the backward pass
    is recorded once (:mod:`dpopt.engine.recompute`): a non-reentrant
    checkpoint's recomputation is skipped (its first run is the recorded call),
    a reentrant one's is recorded as a call of the pass whose backward runs
    (:attr:`reentrant` is then set: the capture's own passes differentiate
    with :func:`~dpopt.engine.recompute.param_grads`).
    ``active`` switches recording off (the door's own reference computations).
    """

    def __init__(
        self,
        plan: Plan,
        vjp: Optional[dict] = None,
        *,
        tensor_hooks: bool,
        guard_buffers: bool,
        hook_bare_owners: bool = False,
        lift: bool = False,
        param_grads: bool = True,
    ):
        self.plan = plan
        self.param_grads = param_grads
        self._off: dict[nn.Module, list[list[Tensor]]] = {}  # module -> parameters switched off per running call
        self._attached_as = 0  # id(self) when attach() installed the _params_off hooks (param_grads=False)
        self.lifts: Optional[Lifts] = Lifts(plan.model, plan.module_names) if lift else None
        self._hooked: set = set()
        self.vjp = vjp if vjp is not None else {}
        self.tensor_hooks, self.guard_buffers, self.hook_bare_owners = tensor_hooks, guard_buffers, hook_bare_owners
        self.calls: list[Call] = []
        self.current: Optional[Pass] = None
        self.other: dict = {}  # bare parameters used otherwise than recognised: index -> (module, op)
        self.active = True
        self.clone_in: set = set()  # modules whose recorded input a later in-place op modified: keep a copy
        self.clone_out: set = set()  # ... whose output: downstream in-place ops modify a clone
        self._tapped = set(plan.tapped)
        self._buffers: dict = {}
        self._handles: list = []
        self._untap: Callable[[], None] = lambda: None
        self._late: set = set()  # dropped passes (drop_unused) that a backward reached later
        self._serial, self._warned = 0, False
        self._passes = 0  # root passes started (Pass.serial)
        self.unresolved: dict = {}  # off-axis layers of the last pass no enclosing call took (engine.lift)
        self._wrapped: dict = {}  # enclosing targets whose forward records its random draws -> the forward before
        self._draws: dict = {}  # module -> the random draws of its call that just ran (engine.lift)
        self.reentrant = False  # a reentrant checkpoint's recomputation was recorded (torch.autograd.grad refused)
        self.replayed = False  # a non-reentrant checkpoint's recomputation was seen (and skipped)
        # the door's policy for a transformers model's labels= loss (engine.hf_labels); None: refused
        self.labels_loss: Optional[LabelsLoss] = None
        self._backward: list = [None]  # the pass whose backward reached its root outputs last (_enter_backward)

    # -- install -------------------------------------------------------------------------
    def attach(self) -> "Recorder":
        """Install the hooks on the model (undone by :meth:`detach`)."""
        m, plan = self.plan.model, self.plan
        self._handles.append(m.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        for mod in plan.hf:  # transformers/peft models: their labels= loss per example (hook door) or refused
            self._handles.append(mod.register_forward_pre_hook(self._hf_pre, with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._hf_post, always_call=True))
        hooked = set(plan.modules) | set(self.vjp) | (set(plan.bare) if self.hook_bare_owners else set())
        for mod in hooked:
            self._handles.append(mod.register_forward_hook(self._layer, with_kwargs=True))
        self._hooked = hooked
        if not self.param_grads:
            self._attached_as = id(self)  # a deep copy of the model copies this recorder: its id differs
            for mod in plan.modules:
                if mod not in self._tapped:
                    self._handles.append(mod.register_forward_pre_hook(self._params_off, with_kwargs=True))
                    self._handles.append(mod.register_forward_hook(self._params_on, always_call=True))
        if self.lifts is not None:  # after _layer: a module's own call is decided before it encloses others
            for mod in m.modules():
                if next(iter(mod.children()), None) is not None:
                    self._handles.append(mod.register_forward_hook(self._enclosing, with_kwargs=True))
        # ViT's class token (engine.bare)
        self._handles += tap_bare(plan.bare, self.rows, self._bare_use, self._bare_other)
        # after the layer hooks: the root may itself be a layer, recorded before its pass ends
        self._handles.append(m.register_forward_hook(self._root_post, with_kwargs=True))
        self._untap = tap_forwards(m, self._tap, plan.tapped)  # MHA/LSTM/...: their inner linear maps
        return self

    def detach(self) -> None:
        """Remove every hook (the model is left as it was given); forget the calls."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._untap()
        self._untap = lambda: None
        for mod, prev in self._wrapped.items():
            if prev is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = prev
        self._wrapped = {}
        self.reset()

    def reset(self) -> None:
        """Forget every recorded call (and the current pass)."""
        self.calls, self.other, self.current = [], {}, None
        self._backward[0] = None
        self._late.clear()

    def take_unresolved(self) -> dict:
        """Off-axis layers no enclosing call below the root could take since the last call (then forgotten)."""
        out, self.unresolved = self.unresolved, {}
        return out

    def take(self) -> tuple[list[Call], dict]:
        """The recorded calls and unrecognised bare uses, forgotten here."""
        calls, other = self.calls, self.other
        self.calls, self.other = [], {}
        self._backward[0] = None  # its pass (and inputs) is the step's: nothing of a step outlives it
        return calls, other

    def drop_unused(self) -> None:
        """Forget the calls of earlier forward passes that received no gradient (a new pass starts).

        A step uses the one pass whose backward ran; a pass no backward has
        reached when the next one starts (an evaluation with gradients
        enabled, a discarded loss, a forward that raised) would otherwise keep
        its activations until the next step, or for ever after the last one.
        Its gradient slots, which its graph's hooks still hold, note a late
        backward instead (:meth:`dropped_received`: refused). Warned once.
        """
        keep = [c for c in self.calls if c.pass_ is None or c.pass_ is self.current or c.has_grad]
        if len(keep) == len(self.calls):
            return
        kept = {id(c) for c in keep}
        self._serial += 1
        for c in self.calls:
            if id(c) not in kept and isinstance(c.grads, GradSlots):
                key = (self._serial, id(c.pass_))
                c.grads.sink = (self._late, key)
                for t in c.outs:  # the tensor hooks go with the output's Python object; the graph's node stays
                    if t.grad_fn is not None:
                        t.grad_fn.register_prehook(partial(_note_late, self._late, key))
        self.calls = keep
        if not self._warned:
            self._warned = True
            warnings.warn(
                "a forward pass of the private model ran with gradients enabled and no backward pass "
                "followed it before the next forward pass: its recorded activations were dropped (said "
                "once). Run evaluation and generation under torch.no_grad() or torch.inference_mode()",
                RuntimeWarning,
                stacklevel=5,
            )

    def grads(self, loss: Tensor, params: Sequence[Tensor]) -> Sequence[Optional[Tensor]]:
        """Gradients of ``loss`` w.r.t. ``params`` (None: unused), through reentrant checkpoints once one was seen."""
        if self.reentrant:
            return param_grads(loss, params)
        return torch.autograd.grad(loss, params, allow_unused=True)

    def backward_only(self, loss: Tensor, params: Sequence[Tensor]) -> None:
        """:meth:`grads` for its tensor hooks alone: each parameter's gradient is dropped as it arrives.

        A hook on every leaf parameter hands autograd a zero-stride zero in
        place of the gradient, so the pass never holds all parameters'
        gradients at once (the check's batched pass: issue 43, bytes per
        parameter). Through reentrant checkpoints, or with non-leaf
        parameters, :meth:`grads` as it is.
        """
        if self.reentrant or not all(q.is_leaf for q in params):
            self.grads(loss, params)
            return
        handles = [q.register_hook(_dropped) for q in params]
        try:
            torch.autograd.grad(loss, params, allow_unused=True)
        finally:
            for h in handles:
                h.remove()

    def late_gradients(self) -> bool:
        """Whether a dropped pass received a gradient (kept for :meth:`dropped_received`)."""
        return bool(self._late)

    def dropped_received(self) -> int:
        """How many dropped passes (:meth:`drop_unused`) received a gradient since the last call."""
        late = len(self._late)
        self._late.clear()  # in place: the dropped slots' hooks hold this set
        return late

    def rows(self) -> int:
        """Rows of the current root forward pass (−1 outside one or while not recording)."""
        cur = self.current
        return cur.batch_size if self.active and cur is not None else -1

    # -- hooks ---------------------------------------------------------------------------
    def _root_pre(self, module, args, kwargs):
        if not self.active:
            return None
        lv = leaves((args, kwargs))
        b = int(lv[0].shape[0]) if lv and lv[0].dim() > 0 else -1
        self.current = Pass(
            b,
            args,
            kwargs,
            mode_signature(module) if self.guard_buffers else None,
            module_state(module) if self.guard_buffers else None,
        )
        if self.lifts is not None:
            self.lifts.start()
            self._passes += 1
            self.current.serial = self._passes
        if self.tensor_hooks and torch.is_grad_enabled() and self.calls:
            self.drop_unused()  # the hook door holds at most the passes a step can still use
        if self.guard_buffers:
            self._buffers = snapshot_buffers(module, reuse=self._buffers)
        return None

    def _root_post(self, module, args, kwargs, out):
        if not self.active:
            return None
        given = out
        if self.tensor_hooks and torch.is_grad_enabled() and self.current is not None:
            for t in leaves(out):  # a reentrant checkpoint's recomputation belongs to the pass whose backward runs
                if t.grad_fn is not None:
                    t.grad_fn.register_prehook(partial(_enter_backward, self._backward, self.current))
        if self.lifts is not None and self.current is not None:
            if self.lifts.pending:
                self.current.unresolved = self.unresolved = dict(self.lifts.pending)
            if self.tensor_hooks and torch.is_grad_enabled():  # the pass can be run again with the same gradients
                # fresh views: a root output the model also uses itself (an encoder-decoder's
                # encoder_last_hidden_state) would otherwise record the gradient flowing back through the
                # model too, and the re-run (HookCapture._again) would count that part twice
                out, _ = _fresh_outputs(out)
                outs = [t for t in leaves(out) if t.requires_grad]
                self.current.out_grads = slots = GradSlots([None] * len(outs))
                for k, t in enumerate(outs):
                    t.register_hook(partial(store_grad, slots, k))
        self.current = None
        if self.guard_buffers:
            check_buffers(module, self._buffers)  # restores them before raising: nothing private stays in the model
        return None if out is given else out

    def recheck_buffers(self) -> None:
        """After the backward: no buffer changed since the last root forward began (a backward hook's write).

        Values are compared (:func:`~dpopt.engine.inputs.changed_buffers`);
        nothing to do before the first recorded forward.

        Raises:
            ValueError: (buffers restored first) naming the changed buffers.
        """
        if self.guard_buffers and self._buffers:
            check_buffers(self.plan.model, self._buffers)

    def _params_off(self, module, args, kwargs):
        """Pre-hook (``param_grads=False``): the rule layer's own trainable parameters leave this call's graph.

        Only in a pass this recorder records with gradients on (the root's
        forward, or a checkpoint's recomputation of it in the backward, so that
        the recomputed graph saves the same tensors as the first run), and
        only when an input requires a gradient: the output then requires one
        through the input, its tensor hook records ``e`` as before, and
        autograd builds the layer's backward without the weight-gradient
        product. Undone by :meth:`_params_on` when the call returns or raises.

        Not in a copy: ``copy.deepcopy(model)`` copies the hooks with a copy of
        this recorder, and the copy (a reference model, an average) is the
        user's plain model, whose backward forms ``p.grad`` as usual.
        """
        if not (self.active and torch.is_grad_enabled()) or self._attached_as != id(self):
            return None
        if self.current is None and recomputation() is None:
            return None  # a call outside the root's forward: left as it is
        if peek_interpreter_stack() is not None:  # inside torch.func transforms (their own gradients): left alone
            return None
        if not any(t.requires_grad for t in leaves((args, kwargs))):
            return None
        own, params = module._parameters, self.plan.params
        # the plan's own parameter objects only: functional_call's substituted tensors are left alone
        off = [params[i] for a, i in self.plan.modules.get(module, {}).items() if own.get(a) is params[i]]
        off = [q for q in off if q.requires_grad]
        for q in off:
            q.requires_grad_(False)
        self._off.setdefault(module, []).append(off)
        return None

    def _params_on(self, module, args, out):
        """Forward hook (always called): the parameters :meth:`_params_off` switched off for this call, back on."""
        stack = self._off.get(module)
        if not stack:
            return None
        for q in stack.pop():
            q.requires_grad_(True)
        if not stack:
            del self._off[module]
        return None

    def _hf_pre(self, module, args, kwargs):
        if self.active and torch.is_grad_enabled():
            if self.labels_loss is None:
                refuse_batch_loss(module, kwargs)
            else:
                self.labels_loss.pre(module, kwargs)
        return None

    def _hf_post(self, module, args, out):
        if self.labels_loss is not None:
            self.labels_loss.post(module)  # restores the model's loss_function (set by pre, if it was)
        return None

    def _record(self, call: Call) -> None:
        if self.tensor_hooks:
            for k, t in enumerate(call.outs):
                if t.requires_grad:
                    t.register_hook(partial(store_grad, call.grads, k))  # never the call: no C++ cycle
            if call.fast and call.out is not call.inp:  # its gradient comes through the hook: drop the values
                call.out = OutputStub(call.out)
                call.outs = [call.out]
        self.calls.append(call)

    def _pass(self) -> Optional[Pass]:
        """The pass a call now running belongs to, or :data:`~dpopt.engine.recompute.REPLAY` to skip it.

        Inside a backward pass: a non-reentrant checkpoint's recomputation is
        skipped; any other forward there (a reentrant checkpoint's
        recomputation) belongs to the pass whose backward runs.
        """
        kind = recomputation()
        if kind == REPLAY:
            self.replayed = True
            return REPLAY  # type: ignore[return-value]
        if kind is None or self.current is not None:
            return self.current
        self.reentrant = True
        return self._backward[0]

    def _bare_use(self, module, index: int, r: Tensor) -> None:
        """A recognised use R [B, ...] of a bare parameter: its output gradient is recorded like a layer's."""
        self._record(Call(module, r, r, (), {}, [r], self.current, index=index))

    def _bare_other(self, module, index: int, op: str) -> None:
        self.other.setdefault(index, (module, op))

    def _tap(self, module, a: Tensor, o: Tensor, tag) -> None:
        """A linear map inside a tapped layer's forward: recorded like a call of ``module`` (input a, output o)."""
        if not self.active or module not in self.plan.modules or not o.requires_grad:
            return
        if self.lifts is not None and (module in self.lifts.lifted or self.lifts.off(module)):
            return
        pass_ = self._pass()
        if pass_ is REPLAY:
            return
        if module in self.clone_in:
            a = a.clone()
        self._record(Call(module, a, o, (a,), {}, [o], pass_, tag=tag, versions=self.guard_buffers))

    def _layer(self, module, args, kwargs, out):
        if not self.active or not torch.is_grad_enabled():
            return None
        lifts = self.lifts if self.current is not None else None
        if lifts is not None and (module in lifts.lifted or lifts.off(module)):
            return None  # its parameters are computed through the enclosing call (engine.lift)
        planned = module in self.plan.modules
        fast = planned and module not in self._tapped
        if planned and not fast and module not in self.vjp:
            return None  # its maps are recorded by its tapped forward (_tap)
        pass_ = self._pass()
        if pass_ is REPLAY:
            return None
        if not fast:
            outs = leaves(out)
            if lifts is not None and not on_axis(leaves((args, kwargs)), outs, self.rows()):
                lifts.pending[module] = (_shapes(leaves((args, kwargs))), _shapes(outs))
                return None
            if any(t.requires_grad for t in outs):
                draws = self._draws.pop(module, None)
                self._record(
                    Call(module, None, None, args, kwargs, outs, pass_, tag=draws, versions=self.guard_buffers)
                )
            return None
        inp = args[0] if args else next(iter(kwargs.values()), None)
        if not isinstance(out, Tensor) or not isinstance(inp, Tensor):
            raise ValueError(
                f"layer {self.plan.name_of(module)!r} ({type(module).__name__}) was called without a "
                "tensor input or output; the per-sample capture cannot record it"
            )
        if not out.requires_grad:
            return None
        inp, wide = expand_broadcast(module, inp, out, self.rows())  # [1, T] position ids: per example
        if lifts is not None and (off_axis(inp, self.rows()) or off_axis(wide, self.rows())):
            lifts.pending[module] = ([tuple(inp.shape)], [tuple(out.shape)])
            return None
        if module in self.clone_in:  # keep a copy a later in-place op cannot touch
            inp = inp.clone()
        self._record(Call(module, inp, wide, args, kwargs, [wide], pass_, versions=self.guard_buffers))
        if module in self.clone_out:  # downstream in-place ops then modify the clone, not the recorded tensor
            return wide.clone()
        return wide if wide is not out else None

    def stale(self, calls: Sequence[Call]) -> list[str]:
        """Names of layers whose calls in ``calls`` predate a lifting decision (:mod:`dpopt.engine.lift`).

        A call of a module lifted since, or a module that became an enclosing
        target after the pass and whose call was therefore not recorded
        (the first-batch check lifts at sizes that differ from every
        dimension of the model, after the user's pass).
        """
        if self.lifts is None:
            return []
        names = {self.plan.name_of(c.module) for c in calls if c.module in self.lifts.lifted}
        serial = max((c.pass_.serial for c in calls if c.pass_ is not None), default=0)
        have = {c.module for c in calls}
        names |= {  # a target since this pass: its call ran before its random draws were recorded
            self.plan.name_of(t)
            for t, s in self.lifts.since.items()
            if t in self.lifts.targets and self.vjp.get(t) and (s == serial or (s > serial and t not in have))
        }
        return sorted(names)

    def escalate(self, indices: Sequence[int]) -> bool:
        """Lift the owners of parameters the first-batch check refused one level up (:meth:`Lifts.escalate`).

        Returns:
            False if there is nothing to lift (no lifting here, or every owner is the root).
        """
        if self.lifts is None:
            return False
        bad = set(indices)
        owners = [m for m in self.plan.model.modules() if bad & set(self._owned(m).values())]
        return self.lifts.escalate(owners)

    def _owned(self, m: nn.Module) -> dict[str, int]:
        """{attribute or relative name: index} of the parameters ``m``'s calls carry now (engine.lift)."""
        return {**self.plan.modules.get(m, {}), **self.plan.bare.get(m, {}), **self.vjp.get(m, {})}

    def _enclosing(self, module, args, kwargs, out):
        """A module enclosing off-axis layers (:mod:`dpopt.engine.lift`): take them over, record its call."""
        lifts = self.lifts
        if lifts is None or not self.active or not torch.is_grad_enabled() or self.current is None:
            return None
        if module in lifts.lifted:
            return None
        target, waiting = module in lifts.targets, lifts.waiting_in(module) if lifts.pending else []
        if not target and not waiting:
            return None
        ins, outs = leaves((args, kwargs)), leaves(out)
        if (
            module is lifts.root
            or module in self.plan.modules
            or lifts.off(module)
            or not on_axis(ins, outs, self.rows())
        ):
            if target:  # what was lifted into it goes on up
                lifts.targets.discard(module)
                lifts.pending[module] = (_shapes(ins), _shapes(outs))
            return None
        if self._pass() is REPLAY:  # a non-reentrant checkpoint's recomputation (engine.recompute)
            return None
        if waiting:
            moved = lifts.assign(module, {m: self._owned(m) for m in waiting}, self.current.serial)
            for m in waiting:
                self.vjp.pop(m, None)
            self.plan.demote(list(moved.values()))
            self.vjp.setdefault(module, {}).update(moved)
            self._record_draws(module)
        if module not in self._hooked and any(t.requires_grad for t in outs):  # else _layer recorded it
            kwargs = {k: None if _is_cache(v) else v for k, v in kwargs.items()}
            out, outs = _fresh_outputs(out)
            draws = self._draws.pop(module, None)
            self._record(
                Call(module, None, None, args, kwargs, outs, self.current, tag=draws, versions=self.guard_buffers)
            )
            return out
        return None

    def _record_draws(self, module: nn.Module) -> None:
        """From its next call on, record the random draws of an enclosing target's forward (dropout: engine.lift).

        Its per-example vjp re-runs the call on each example alone; example
        i then replays its slice of the batched call's draws
        (:class:`~dpopt.engine.check.RandomReplay`), so the gradient is that
        of the pass the user's backward ran. An instance ``forward`` wraps the
        class's (undone by :meth:`detach`); it records only while this
        recorder records a root pass with gradients.
        """
        if module in self._wrapped:
            return
        inner = module.__dict__.get("forward")
        call = inner if inner is not None else type(module).forward.__get__(module)

        def forward(*args, **kwargs):
            if not (self.active and torch.is_grad_enabled() and self.current is not None):
                return call(*args, **kwargs)
            replay = RandomReplay(module)
            with replay.recording():
                out = call(*args, **kwargs)
            self._draws[module] = replay.outs
            return out

        module.forward = forward
        self._wrapped[module] = inner

    # -- the door fills the gradients ----------------------------------------------------
    @staticmethod
    def release_outputs(calls: Sequence[Call]) -> None:
        """Keep only an :class:`OutputStub` of each rule call's output (after :meth:`modified` was asked)."""
        for c in calls:
            if c.fast and c.out is not c.inp and not isinstance(c.out, OutputStub):
                c.out = OutputStub(c.out)
                c.outs = [c.out]

    def fill(self, calls: Sequence[Call], loss: Tensor, grad_outputs: Optional[Tensor] = None) -> None:
        """Output gradients of ``loss`` (``grad_outputs``-weighted) for every call, without parameter gradients."""
        outs = [(c, k) for c in calls for k, t in enumerate(c.outs) if t.requires_grad]
        if not outs:
            return
        try:
            inputs: list = [t.edge if isinstance(t, OutputStub) else t for t in (c.outs[k] for c, k in outs)]
            gs = torch.autograd.grad(loss, inputs, grad_outputs=grad_outputs, allow_unused=True)
        except RuntimeError as err:
            refusal = reentrant_refused(err)
            if refusal is None:
                raise
            raise refusal from None
        for (c, k), g in zip(outs, gs):
            c.grads[k] = g

    # -- per-call checks -----------------------------------------------------------------
    def layout(self, calls: Sequence[Call], rows: int) -> dict:
        """Modules with a call whose input or output does not have ``rows`` along dim 0 → (input, output) shapes.

        A rule's call: its recorded input and output; a vjp call: every input
        off the axis, or an output that received a gradient off the axis.
        """
        bad: dict = {}
        for c in calls:
            for m, shapes in (c.pass_.unresolved if c.pass_ is not None else {}).items():
                bad.setdefault(m, shapes)
            if c.fast:
                wrong = off_axis(c.inp, rows) or off_axis(c.out, rows)
            else:
                ins = leaves((c.args, c.kwargs))
                wrong = all(off_axis(t, rows) for t in ins) or any(off_axis(c.outs[k], rows) for k in c.used)
            if wrong and c.module not in bad:
                ins = [tuple(c.inp.shape)] if c.fast else [tuple(t.shape) for t in leaves((c.args, c.kwargs))]  # type: ignore[list-item, misc]
                bad[c.module] = (ins, [tuple(t.shape) for t in c.outs])
        return bad

    @staticmethod
    def modified(calls: Sequence[Call]) -> tuple[set, set]:
        """Modules whose recorded (input, output) a later in-place op changed."""
        ins, outs = set(), set()
        for c in calls:
            if c.fast and c.inp._version != c.in_version:
                ins.add(c.module)
            if c.fast and c.out._version != c.out_version:
                outs.add(c.module)
        return ins, outs

    @staticmethod
    def inputs_modified(calls: Sequence[Call]) -> list[Call]:
        """Calls whose inputs (any tensor of args/kwargs) were modified in place after the call."""
        return [
            c
            for c in calls
            if c.versions is not None and [t._version for t in leaves((c.args, c.kwargs))] != c.versions
        ]

    # -- the hook door's vjp of a module call --------------------------------------------
    def vjp_grads(self, c: Call, own: dict[str, int], es: list[Tensor], rows: int) -> list[Tensor]:
        """Per-row gradients [rows, *shape] of ``own`` parameters of one call: vjp of the module at each row."""
        m, attrs, params = c.module, list(own), self.plan.params
        primals = tuple(params[i].detach() for i in own.values())
        flat, spec = tree_flatten((c.args, c.kwargs))
        batched = [isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == rows for t in flat]
        data = [t.detach() if isinstance(t, Tensor) else t for t in flat]
        used = c.used

        def call_at(ps, xs: list):
            leaves_, j = [], 0
            for t, bt in zip(data, batched):
                if bt:
                    leaves_.append(xs[j])
                    j += 1
                else:
                    leaves_.append(t)
            args, kwargs = tree_unflatten(leaves_, spec)
            outs = leaves(functional_call(m, (dict(zip(attrs, ps)), guarded_buffers(m)), tuple(args), kwargs))
            return tuple(outs[k] for k in used)

        xs = [t for t, bt in zip(data, batched) if bt]
        es = [e.detach() for e in es]
        self.active = False
        try:

            def one(xs_i, es_i):
                _, pull = vjp(lambda *ps: call_at(ps, [x.unsqueeze(0) for x in xs_i]), *primals)
                return pull(tuple(e.unsqueeze(0) for e in es_i))

            def loop() -> list[Tensor]:
                out_rows = []
                for i in range(rows):
                    ps = [q.detach().requires_grad_(True) for q in primals]
                    with torch.enable_grad():
                        outs = call_at(ps, [x[i : i + 1] for x in xs])
                        pairs = [(o, e[i : i + 1]) for o, e in zip(outs, es) if o.requires_grad]
                        gs = torch.autograd.grad([o for o, _ in pairs], ps, [e for _, e in pairs], allow_unused=True)
                    out_rows.append([torch.zeros_like(q) if g is None else g for q, g in zip(primals, gs)])
                return [torch.stack([r[k] for r in out_rows]) for k in range(len(primals))]

            if c.tag:  # random draws recorded in the batched call (engine.lift): example i replays its slice
                replay = RandomReplay(m)
                replay.outs = list(c.tag)
                with replay.replaying(rows):
                    return loop()
            try:
                return list(vmap(one)(xs, es))
            except Exception:  # noqa: BLE001 — a layer vmap cannot batch: exact single-example loop
                return loop()
        finally:
            self.active = True

    @staticmethod
    def _captured(calls: Sequence[Call], other: dict) -> list:
        """``(call, e)`` of the fast calls (a bare parameter used otherwise goes by its owner's vjp), ``e``
        the stored output gradient as it is: the door's scale is folded into the blocks
        (:func:`~dpopt.engine.layers.scaled_block`), never copied into every layer's ``[B, T, q]`` gradient
        (issue 34: the copies cost the hook door time and, before, held each layer's gradient twice)."""
        return [(c, c.grads[0]) for c in calls if c.fast and not (c.index is not None and c.index in other)]

    def build(
        self, calls: Sequence[Call], rows: int, scale: float, views: int = 1, other: Optional[dict] = None
    ) -> list:
        """Every block of one pass: the rules' (:meth:`Plan.blocks`) and, with ``vjp``, the vjp parameters'.

        Args:
            calls: calls that received gradients; rows: n; scale: the factor
                turning a stored output gradient into the ``e`` of each row
                (the door's loss reduction and views); views: K.
            other: bare parameters whose use the taps did not recognise: the
                vjp of their owner's call (hook door).
        """
        plan, other = self.plan, other or {}
        b = rows // views
        stale = self.stale(calls)
        if stale:
            raise ValueError(
                f"layers {stale} were recorded on this batch before the first-batch check decided to compute "
                "their parameters through an enclosing layer (engine.lift), and the batch could not be run "
                "again: repeat this step (zero the gradients and run the forward and backward again)"
            )
        with no_autocast(plan.device):
            blocks = [scaled_block(blk, scale) for blk in plan.blocks(self._captured(calls, other), rows, None, views)]
        bare_vjp = {m: {a: i for a, i in own.items() if i in other} for m, own in plan.bare.items()}
        bare_vjp = {m: own for m, own in bare_vjp.items() if own}
        if bare_vjp:  # drop their (zero) tap blocks
            blocks = [blk for blk in blocks if not (isinstance(blk, DirectBlock) and set(blk.index) <= set(other))]
        vjps = {**self.vjp, **bare_vjp}
        fallback = sorted({i for own in vjps.values() for i in own.values()})  # a tied one: once, uses summed
        if fallback:
            grads = {i: plan._zeros(i, b) for i in fallback}  # bf16 vjps summed in the compute dtype
            for c in calls:
                if c.index is not None:
                    continue
                own = vjps.get(c.module) if not c.fast else self.vjp.get(c.module)
                if own:
                    es = [c.grads[k] if scale == 1 else c.grads[k] * scale for k in c.used]  # type: ignore[operator]
                    for i, g in zip(own.values(), self.vjp_grads(c, own, es, rows)):  # type: ignore[arg-type]
                        grads[i] = grads[i] + _sum_views(g, views).to(grads[i].dtype)
            blocks.append(DirectBlock(fallback, [grads[i] for i in fallback]))
        return blocks

    # -- the first-batch check -----------------------------------------------------------
    def check(
        self,
        args,
        kwargs,
        rows: int,
        views: int,
        run: Callable,
        params: Optional[Sequence[Tensor]] = None,
        row_loss: Optional[Callable] = None,
        compare: Optional[int] = None,
    ) -> tuple[dict, list[int]]:
        """One verification pass: this capture vs single-example autograd.

        In the mode the model is in (the caller sets the mode of the release),
        on ``rows`` rows (a verification size: :func:`~dpopt.engine.check.free_sizes`):
        the batched pass records the calls and the gradients of Σ_r f_r(out_r)
        (the door's per-row losses, or ⟨ρ_r, out_r⟩ + ‖out_r‖²/8 for random ρ when the door
        has no loss), its random draws recorded
        (:class:`~dpopt.engine.check.RandomReplay`); each row is then run alone
        with its draws replayed, and the per-example gradients
        (1/K) Σ_v ∇f_{iK+v} compared with the capture's blocks
        (:func:`~dpopt.engine.check.disagreeing`).

        Args:
            args, kwargs: the model's inputs with ``rows`` rows along dim 0.
            views: K. run: ``run(args, kwargs, loss_of) -> (calls, other)``,
                the door's batched forward/backward with ``loss_of(outputs) -> scalar``.
            params: the tensors the single-example autograd differentiates
                (default the plan's; FSDP: the unsharded ones), by index.
            row_loss: ``row_loss(outputs, rows_slice) -> [len] per-row losses``
                (the engine's ``loss_fn``; a nonlinear loss also tests the
                outputs' values, not only their Jacobian); None: random linear.

        Returns:
            ``(layout, off)``: modules with an off-axis call (then nothing was
            compared), and the indices of the parameters that disagree.

        A disagreement in float32 or half precision is checked again in
        float64 (:func:`~dpopt.engine.check.in_float64`: the same inputs,
        random draws replayed as in the first pass; not everywhere:
        :meth:`_can_recheck`): a parameter
        counts as off only if it disagrees there too (rounding is not mixing).

        Raises:
            OutputLayout: the model's output is not ``[rows, ...]`` tensors.
            Unreplayable: a random op that cannot be replayed per example.
            ValueError: the model fails on one example (:func:`~dpopt.engine.check.alone_failed`).

        ``compare``: compare only the first ``compare`` examples (their
        ``compare·K`` rows run alone; None: all). For a check at the size of
        a large batch (a new size class): the batched pass has every row,
        the single-example loop and its ``[compare, *shape]`` reference
        gradients only a few.
        """
        # glibc keeps the freed heap of what ran before (the door's pass, an earlier check size) and of this
        # check's passes, whose tensors have other sizes than the step's: resident and unused through the first
        # step, 60-130 MiB on GPT-2 (issue 34). Handed back before and after (no tensor is touched)
        release_free_heap()
        with preserved_state(self.plan.model):  # its passes leave no buffer value and no RNG draw behind
            self._compare = compare
            try:
                return self._check(args, kwargs, rows, views, run, params, row_loss)
            finally:
                self._compare = None
                release_free_heap()

    def _check(
        self,
        args,
        kwargs,
        rows: int,
        views: int,
        run: Callable,
        params: Optional[Sequence[Tensor]] = None,
        row_loss: Optional[Callable] = None,
    ) -> tuple[dict, list[int]]:
        """:meth:`check` inside its state guard."""
        plan = self.plan
        tol = rtol(plan.dtype, plan.device)  # outside no_autocast: autocast's dtype sets the tolerance
        bad, off = self._check_once(args, kwargs, rows, views, run, params, row_loss, tol)
        if not off or not self._can_recheck(params):
            return bad, off
        try:
            with in_float64(plan.model) as cast:  # rounding or mixing? the same check in float64
                bad64, off64 = self._check_once(
                    cast(args), cast(kwargs), rows, views, run, params, row_loss, RTOL[torch.float64]
                )
        except Exception:  # noqa: BLE001 — a model that cannot run in float64: the float32 verdict stands
            return bad, off
        return bad, off if bad64 else [i for i in off if i in set(off64)]

    def _can_recheck(self, params: Optional[Sequence[Tensor]]) -> bool:
        """Whether a float32/half disagreement can be rechecked in float64 (:meth:`check`).

        Not in float64 already, not under autocast (the release's precision
        is autocast's), not with parameters other than the plan's own (FSDP's
        unsharded ones) and not under torch.distributed with several
        processes (an extra forward on one rank only could stall a
        collective): there the float32 verdict stands.
        """
        plan = self.plan
        if plan.dtype == torch.float64 or torch.is_autocast_enabled(plan.device.type):
            return False
        if params is not None and any(p is not q for p, q in zip(params, plan.params)):
            return False
        dist = torch.distributed
        return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)

    def _check_once(
        self,
        args,
        kwargs,
        rows: int,
        views: int,
        run: Callable,
        params: Optional[Sequence[Tensor]],
        row_loss: Optional[Callable],
        tol: float,
    ) -> tuple[dict, list[int]]:
        """:meth:`check`'s one pass at tolerance ``tol`` (no recheck)."""
        plan = self.plan
        gen = torch.Generator().manual_seed(0)  # not private: a test direction for the check only
        replay = RandomReplay(plan.model)
        if row_loss is None:
            rs: list[int] = []

            def row_loss(out, sl: slice) -> Tensor:
                outs = [o for o in leaves(out) if o.is_floating_point()]
                if not rs:  # one generator seed per output (its rows: seed + row, _probe_chunks)
                    with replay.set_aside():  # not the model's draws (a checkpointed backward draws after them)
                        rs.extend(int(torch.randint(1 << 62, (), generator=gen)) for _ in outs)
                # ⟨ρ_r, out_r⟩ + ½‖out_r‖²/4: the quadratic term makes each row's output gradient depend on its
                # output's value, so a call that mixes examples is caught also where no trainable layer follows
                # it (an enclosing call's vjp, engine.lift, receives the batched pass's output gradient)
                # as per-row dot products with a one-tensor backward (_ProbeLoss): no product of the outputs'
                # size is made beside the pass's activations (issue 34: o·r, 0.125·o and its square were 3
                # logits [B, T, V] at the first step's peak; bmm's backward still made 3 before _ProbeLoss)
                return sum(_ProbeLoss.apply(o, seed, sl.start, replay.set_aside) for o, seed in zip(outs, rs))

        def loss_of(out) -> Tensor:
            outs = leaves(out)
            if not outs or any(o.dim() == 0 or o.shape[0] != rows for o in outs):
                raise OutputLayout(tuple(outs[0].shape) if len(outs) == 1 else type(out).__name__)
            release_free_heap()  # the forward's freed temporaries: not resident through the backward
            return row_loss(out, slice(0, rows)).sum()

        saved = self.take()
        try:
            with replay.recording():
                calls, other = run(args, kwargs, loss_of)
                if self.stale([c for c in calls if c.has_grad]):  # lifted in this pass (engine.lift): run it again
                    calls, other = run(args, kwargs, loss_of)
        finally:
            self.calls, self.other = saved
        bad = self.layout(calls, rows)
        if bad:
            return bad, []
        blocks = self.build([c for c in calls if c.has_grad], rows, 1.0 / views, views, other)
        indices = sorted({i for blk in blocks for i in blk.index})
        if not indices:  # every parameter left the rules during this pass (a bare one used otherwise): nothing
            for blk in blocks:  # to compare (Conv1d / InstanceNorm with one channel: their [1, ...] parameters)
                blk.free()
            return {}, []
        b = rows // views
        m = b if getattr(self, "_compare", None) is None else max(1, min(b, int(cast(int, self._compare))))
        chosen = [(plan.params if params is None else params)[i] for i in indices]
        release_free_heap()  # the batched pass's activations, freed: not kept resident through the loop
        owners = [i for blk in blocks for i in blk.index]
        if views == 1 and not self.reentrant and all(q.is_leaf for q in chosen) and len(owners) == len(set(owners)):
            try:  # one example's gradients at a time, each parameter's as the backward reaches it
                sq = {i: v for blk in blocks for i, v in zip(blk.index, blk.sq_norms([(None, None)] * len(blk.index)))}
                with replay.replaying(rows):
                    stats = self._loop_streamed(args, kwargs, row_loss, indices, chosen, blocks, b, m)
                with no_autocast(plan.device):
                    return {}, disagreeing_rows({i: v[:m] for i, v in sq.items()}, *stats, tol, plan.names)
            finally:
                for blk in blocks:
                    blk.free()
        with replay.replaying(rows):
            ref = self._loop(args, kwargs, row_loss, rows, indices, params, upto=m * views)
        ref = {i: _sum_views(g, views) / views for i, g in ref.items()}
        c = torch.rand(m, generator=gen, dtype=torch.float64).to(plan.device)
        if m < b:  # the first m examples only: zero weights and no norm comparison for the others
            c = torch.cat([c, c.new_zeros(b - m)])
            ref = {i: torch.cat([g, g.new_zeros((b - m, *g.shape[1:]))]) for i, g in ref.items()}
            blocks = [_FirstRows(blk, m) for blk in blocks]
        with no_autocast(plan.device):
            off = disagreeing(blocks, ref, c, [compute_dtype(q.dtype) for q in plan.params], tol, plan.names)
        for blk in blocks:
            blk.free()
        return {}, off

    def _loop_streamed(
        self,
        args,
        kwargs,
        row_loss: Callable,
        indices: list[int],
        chosen: list[Tensor],
        blocks: Sequence,
        b: int,
        m: int,
    ) -> tuple[dict, dict, dict]:
        """:meth:`_loop`'s reference, compared as it is computed: no ``[b, *shape]`` tensor is kept.

        For examples i < ``m`` (one row each, K = 1), the single-example
        backward hands each parameter's gradient g_i to a hook on the
        parameter, which reduces it at once to three numbers — ‖g_i‖², whether
        it is finite, and ‖ĝ_i − g_i‖ against the capture's gradient of
        example i (the block's weighted sum with weight 1 on i and every
        other row left out) — and gives autograd a zero-stride zero in its
        place. The memory of the check is then one parameter's gradient and
        its capture counterpart at a time (issue 43: bytes per parameter),
        where :meth:`_loop` held ``2·b`` copies of every parameter's.

        Returns:
            ``(ref_sq, finite, dist)``: parameter index → ``[m]`` float64
            ‖g_i‖², ``[m]`` bool, ``[m]`` float64 ‖ĝ_i − g_i‖ (NaN where not
            finite) — :func:`~dpopt.engine.check.disagreeing_rows`' inputs.
        """
        plan = self.plan
        where = {i: (blk, k) for blk in blocks for k, i in enumerate(blk.index)}
        ref_sq = {i: torch.zeros(m, dtype=torch.float64) for i in indices}
        finite = {i: torch.ones(m, dtype=torch.bool) for i in indices}
        dist = {i: torch.zeros(m, dtype=torch.float64) for i in indices}
        flat, spec = tree_flatten((args, kwargs))
        batched = [isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == b for t in flat]
        current = [0]  # the example whose single-example backward is running
        cache: dict[int, list[Optional[Tensor]]] = {}  # a block's outputs for it, until each is taken
        seen: set[int] = set()  # parameters whose hook ran in it

        def captured(i: int, e: int) -> Tensor:
            """The capture's gradient of parameter ``i`` for example ``e`` (a fresh tensor or a row view)."""
            blk, k = where[i]
            if type(blk) is DirectBlock:
                return blk.grads[k][e]
            if id(blk) not in cache:
                onehot = torch.zeros(b, dtype=torch.float64, device=plan.device)
                onehot[e] = 1.0
                others = torch.arange(b, device=plan.device) != e
                with no_autocast(plan.device):
                    cache[id(blk)] = [
                        *blk.grad_sums([onehot.to(compute_dtype(plan.params[j].dtype)) for j in blk.index], others)
                    ]
            parts = cache[id(blk)]
            out, parts[k] = parts[k], None
            if all(t is None for t in parts):
                del cache[id(blk)]
            return cast(Tensor, out)

        def reduce(i: int, g: Tensor) -> None:
            e = current[0]
            seen.add(i)
            with torch.no_grad():  # chunked reductions: beside g, only the capture's ĝ (issue 43)
                sq, ok = finite_sq_norm64(g)
                ref_sq[i][e], finite[i][e] = sq, ok
                hat = captured(i, e)
                dist[i][e] = sq_dist64(hat, g) ** 0.5 if ok else float("nan")
                del hat

        def hook(i: int, g: Tensor) -> Tensor:
            reduce(i, g)
            return _dropped(g)

        self.active = False
        handles = [q.register_hook(partial(hook, i)) for i, q in zip(indices, chosen)]
        try:
            with torch.enable_grad():
                for e in range(m):
                    current[0] = e
                    seen.clear()
                    cache.clear()
                    a_i, kw_i = tree_unflatten([t[e : e + 1] if bt else t for t, bt in zip(flat, batched)], spec)
                    try:
                        out = plan.model(*a_i, **kw_i)
                    except Unreplayable:
                        raise
                    except Exception as err:  # noqa: BLE001 — the user's model on one example: refuse, say why
                        raise alone_failed(err) from err
                    loss = row_loss(out, slice(e, e + 1)).sum()
                    torch.autograd.grad(loss, chosen, allow_unused=True)
                    for i, q in zip(indices, chosen):  # unused in this example's pass: its gradient is zero
                        if i not in seen:
                            reduce(i, torch.zeros_like(q))
        finally:
            for h in handles:
                h.remove()
            self.active = True
        return ref_sq, finite, dist

    def _loop(
        self,
        args,
        kwargs,
        row_loss: Callable,
        rows: int,
        indices: list[int],
        params: Optional[Sequence[Tensor]] = None,
        upto: Optional[int] = None,
    ) -> dict:
        """Exact per-row gradients [upto, *shape] of f_r(out_r) for rows 0..upto−1 (default all), one at a time."""
        params = [(self.plan.params if params is None else params)[i] for i in indices]
        if not params:  # nothing to differentiate (torch.autograd.grad refuses an empty list)
            return {}
        flat, spec = tree_flatten((args, kwargs))
        batched = [isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == rows for t in flat]
        out_rows = []
        self.active = False
        try:
            with torch.enable_grad():
                for i in range(rows if upto is None else upto):
                    a_i, kw_i = tree_unflatten([t[i : i + 1] if bt else t for t, bt in zip(flat, batched)], spec)
                    try:
                        out = self.plan.model(*a_i, **kw_i)
                    except Unreplayable:
                        raise
                    except Exception as err:  # noqa: BLE001 — the user's model on one example: refuse, say why
                        raise alone_failed(err) from err
                    loss = row_loss(out, slice(i, i + 1)).sum()
                    gs = self.grads(loss, params)
                    out_rows.append([torch.zeros_like(q) if g is None else g for q, g in zip(params, gs)])
        finally:
            self.active = True
        return {i: torch.stack([r[k] for r in out_rows]) for k, i in enumerate(indices)}


class _FirstRows:
    """A block seen through its first ``m`` examples (squared norms and weighted sums).

    :meth:`Recorder.check` with ``compare``: the weights of the other
    examples are zero and their rows are left out of the sums (a non-finite
    row times a zero weight would still be NaN).
    """

    def __init__(self, blk, m: int):
        self.blk, self.m, self.index = blk, int(m), blk.index

    def sq_norms(self, geos):
        return [
            v.clone() if v.shape[0] <= self.m else torch.cat([v[: self.m], v.new_zeros(v.shape[0] - self.m)])
            for v in self.blk.sq_norms(geos)
        ]

    def grad_sums(self, coefs, bad):
        c = coefs[0]
        later = torch.arange(c.shape[0], device=c.device) >= self.m  # weight 0 already; rows zeroed (a NaN row)
        return self.blk.grad_sums(coefs, later if bad is None else bad | later)

    def free(self) -> None:
        self.blk.free()


def demotion_warning(plan: Plan, module: nn.Module, ins, outs) -> str:
    """The engine door's warning for a layer whose calls do not keep the rows along dim 0."""
    names = [plan.names[i] for i in plan.modules[module].values()] if module in plan.modules else []
    return (
        f"layer {plan.name_of(module)!r} ({type(module).__name__}) does not keep the examples along dim 0 "
        f"(input {[public_shape(s) for s in ins]}, output {[public_shape(s) for s in outs]}); its parameters {names} use "
        "the per-example torch.func path. To keep it on the fast path give it tensors with the examples along "
        "dim 0 (batch_first=True, position ids expanded to [B, T], no reshape(B*T, ...))."
    )
