"""The first-batch check of both per-sample capture paths, in the mode that trains.

One module for the check that :class:`~dpopt.engine.fast.PerSampleEngine`
(``dpopt train``, :func:`dpopt.engine.iter_per_sample_sources`) and
:class:`~dpopt.engine.hooks.HookCapture` (``PrivacyEngine``) run before they
trust "dim 0 is the example" (DESIGN.md, "one example per row, verified in
the mode that trains"). The capture paths differ in how they obtain the
batched per-example quantities (a loss they own vs. the user's backward);
what they check, and how, lives here:

* **the mode** — the check runs with every module in the train/eval mode of
  the release it vouches for (:func:`mode_signature`, :func:`in_modes`):
  train mode with its real behaviour (``if self.training: h = h - h.mean(0)``
  mixes examples only there). A step whose mode signature was never checked
  is checked again (:class:`ModeCheck`);
* **randomness made comparable** — equal seeds do not give example i the same
  dropout mask in a batched and in a single-example pass, so
  :class:`RandomReplay` records the output of every random op of the batched
  pass (a ``TorchDispatchMode`` on the aten ops tagged
  ``nondeterministic_seeded``) and replays example i's slice of it in example
  i's single-example pass: both sides then see the same masks, and the
  comparison is exact up to float rounding. The reference side is always the
  exact loop of single-example autograd calls (never ``torch.func.vmap``,
  which refuses random ops and would hide the mode from the dispatch mode);
* **the layout of every call** — :func:`off_axis`: a recorded layer input or
  output without the batch size along dim 0;
* **the verification batch sizes** — :func:`free_sizes` of :func:`model_dims`:
  sizes that differ from every dimension in the model, so that a tensor can
  have that size along an axis only if the axis is the example axis;
* **the agreement test** — :func:`disagreeing`: per parameter, the capture
  path's per-example squared norms and a random weighted sum against the
  reference per-example gradients, within :func:`rtol` of the gradient scale
  (never relative to an exact zero).

* **rounding is not mixing** — in float32 (or half) a disagreement is
  checked again in float64 (:func:`in_float64`: the same model and inputs,
  cast for the recheck and restored after, tolerance
  ``RTOL[float64]``); only the parameters that still disagree count. A layer
  whose per-example gradient is a small difference of large terms (the raw
  weight of a weight-standardized conv, a bias summed over K views and 1,024
  positions) can differ from the loop by more than float32's 1e-3 of its
  scale while being exactly per example; a forward that mixes examples
  differs by O(1) in any precision.

What each path does with a disagreement is its own (the fast engine moves
the parameters to the exact per-example path, whose examples are computed
alone; the hook path, which cannot recompute an example alone, refuses).
The honest criterion is σ = 0 sensitivity (removing one example moves the
clipped sum by ≤ C), tested in ``tests/engine/test_train_mode_check.py``.

What replay cannot make comparable is refused as :class:`Unreplayable`: a
random op whose batched output has no unique example axis matching the
single-example request, a different number of random calls per example, or
a random op whose output depends on its (non-random) data input other than
dropout (``rrelu`` in train mode). What no check can see: a random op whose
*parameters* mix examples (``torch.bernoulli(h.mean(0))``) — replay gives
both sides the same draw, so the dependence of example i's draw on the other
examples is invisible; such a layer is outside the engines' contract.
"""

from __future__ import annotations

import functools
import os
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "mode_signature",
    "module_state",
    "own_hook",
    "size_class",
    "Signature",
    "signature",
    "in_modes",
    "ModeCheck",
    "RandomReplay",
    "Unreplayable",
    "off_axis",
    "free_sizes",
    "model_dims",
    "rtol",
    "agrees",
    "disagreeing",
    "disagreeing_rows",
    "alone_failed",
    "RTOL",
    "layer_of",
    "layer_scales",
    "sq_norm64",
    "finite_sq_norm64",
    "sq_dist64",
    "in_float64",
]

RTOL = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
"""Relative tolerance of the check per dtype (of the layer's gradient scale)."""


# --------------------------------------------------------------------------- the mode
def mode_signature(model: nn.Module) -> tuple[bool, ...]:
    """``module.training`` of every module of ``model`` (``model.modules()`` order): the mode of a release."""
    return tuple(bool(m.training) for m in model.modules())


_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"training", "_is_hf_initialized"}
_PRIMITIVE = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


#: Tuple and list attributes are keyed by their elements up to this many elements in all (counted over the
#: nesting) and this many levels deep; the rest by identity.
_SEQ_BUDGET, _SEQ_DEPTH = 256, 3


def _attribute_key(v, depth: int = 0, budget: Optional[list] = None):
    """A hashable summary of one plain attribute: its value (primitives), a tensor's (shape, dtype, device) (its
    values may be a per-step cache), a tuple or list by its elements' keys, a plain weak reference by its
    referent's key (``None`` once dead), any other object by its identity (:class:`_Held`).

    A tuple or list is keyed by its class and its elements, not by its identity: ``nn.LSTM``'s forward rebuilds its
    ``_flat_weights`` and ``_flat_weight_refs`` lists whenever the parameters it sees were swapped (the check's and
    the capture's passes swap them), so keyed by identity every step was a new signature, checked again (53× the
    step on an LSTM). Only a plain ``tuple`` / ``list`` or a subclass without instance attributes (a namedtuple;
    its class by identity) is expanded, and only :data:`_SEQ_BUDGET` elements in all, :data:`_SEQ_DEPTH` levels
    deep (a list that contains itself stops there); a subclass with a ``__dict__``, and the elements past the
    budget, count by identity. ``weakref.WeakMethod`` (a new bound method at each call) counts by identity.
    """
    if isinstance(v, _PRIMITIVE):
        return "nan" if isinstance(v, float) and v != v else v
    if isinstance(v, Tensor):
        return ("tensor", tuple(v.shape), v.dtype, v.device)
    if type(v) is weakref.ref:
        target = v()
        return ("weakref", None if target is None else _attribute_key(target, depth + 1, budget))
    if isinstance(v, (tuple, list)) and depth < _SEQ_DEPTH and not hasattr(v, "__dict__"):
        budget = [_SEQ_BUDGET] if budget is None else budget
        budget[0] -= len(v)
        if budget[0] >= 0:
            head = type(v).__name__ if type(v) in (tuple, list) else _Held(type(v))
            return (head, *(_attribute_key(e, depth + 1, budget) for e in v))
    return ("obj", _Held(v))


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
_GLOBAL_TABLES = tuple(
    getattr(torch.nn.modules.module, "_global" + t, None) for t in _HOOK_TABLES
)  # torch's process-wide module hooks (register_module_forward_hook, ...): the dicts themselves, mutated in place
_GLOBAL_FLAGS = tuple(getattr(torch.nn.modules.module, "_global" + t, None) for t in _HOOK_FLAGS[1:])


def own_hook(fn) -> bool:
    """True if the hook function ``fn`` is dpopt's own (its code is in dpopt's package): left out of :func:`module_state`.

    dpopt's hooks (the capture's recording hooks, the check's replay, the
    ``PrivacyEngine`` loss-reduction watch's process-wide forward hook) come
    and go between steps and are what the check verifies (or only inspect);
    counting them would make every step a new signature. ``functools.partial``
    is unwrapped; a bound method counts by its function, a callable object by
    its class's ``__call__``. Decided by the code object's file, not by
    ``__module__`` (which ``functools.wraps`` copies onto a user's wrapper).
    """
    inner = _inner(fn)
    inner = getattr(inner, "__func__", inner)  # a bound method: its function
    code = getattr(inner, "__code__", None)
    if code is None:  # a callable object: its class's __call__
        call = next((k.__dict__["__call__"] for k in type(inner).__mro__ if "__call__" in k.__dict__), None)
        code = getattr(getattr(call, "__func__", call), "__code__", None)
    return code is not None and os.path.abspath(code.co_filename).startswith(_PACKAGE_DIR)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # .../dpopt/


def _inner(fn):
    """``fn`` without ``functools.partial`` wrappers."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


class _Held:
    """An object by identity: equal only to a ``_Held`` of the same LIVE object, hashed by its id.

    ``id()`` alone would let an object rebuilt by a factory with other closure values (``h.remove(); h =
    layer.register_forward_hook(make(a))``, a function-valued module attribute replaced) land at the freed one's
    address and keep the fingerprint. A ``_Held`` keeps a weak reference (functions, bound methods, partials, most
    objects): once the object is gone it equals nothing, so a signature that named it is never matched again, and
    nothing is kept alive by the remembered signatures. An object without weak references (a dict, a list) is
    compared by its id alone, as before. A copy or pickle of a ``_Held`` is a fresh ``object()``, equal to
    nothing: a restored signature is never taken as checked.
    """

    __slots__ = ("_ref", "_id")

    def __init__(self, obj) -> None:
        try:
            self._ref: Optional[weakref.ref] = weakref.ref(obj)
        except TypeError:  # no weak references: compared by id
            self._ref = None
        self._id = id(obj)

    def __eq__(self, other) -> bool:
        if not isinstance(other, _Held) or other._id != self._id:
            return False
        if self._ref is None or other._ref is None:
            return self._ref is other._ref  # both by id alone
        mine = self._ref()
        return mine is not None and mine is other._ref()

    def __hash__(self) -> int:
        return self._id

    def __reduce__(self):
        return (object, ())

    def __repr__(self) -> str:
        return f"_Held({'by id' if self._ref is None else 'weak'} at {self._id:#x})"


def _class_forward(m: nn.Module):
    """The raw ``forward`` attribute of ``m``'s class (first in the MRO's ``__dict__``s; None without one): read
    without the descriptor protocol, which can build a new object per access (``partialmethod``, ``classmethod``)."""
    for k in type(m).__mro__:
        f = k.__dict__.get("forward")
        if f is not None:
            return f
    return None


def _hooks(tables: tuple, flags: tuple) -> tuple:
    """The user's hooks of one module (or torch's global tables): per table, ``(_Held(fn), flags...)`` in call order."""
    out = []
    for k, table in enumerate(tables):
        if table:  # most modules have no hooks: one truth test per table
            ids = tuple(
                (_Held(fn), *(key in f for f in flags if f is not None))
                for key, fn in table.items()
                if not own_hook(fn)
            )
            if ids:
                out.append((k, ids))
    return tuple(out)


def module_state(model: nn.Module) -> tuple:
    """A fingerprint of ``model``'s non-parameter state: what can change how a forward treats the batch.

    Per module in ``model.named_modules()`` order: its name, its identity
    and type (a parameter-free submodule swapped after the check changes it),
    every plain attribute of its ``__dict__`` other than ``nn.Module``'s
    own bookkeeping (parameters, buffers and submodules are not in it;
    ``training`` is :func:`mode_signature`'s): primitives by value
    (a flag ``self.mix = True`` switched after step 1 changes it), tensors by
    shape, dtype and device, tuples and lists by their elements (a function
    replaced in a list changes it; :func:`_attribute_key`), any other object
    (a function, a config) by identity; and its hooks: per table (forward pre-hooks, forward hooks,
    backward pre-hooks, backward hooks) the identity of each hook function in
    call order with its with-kwargs / always-call flags (and whether the
    backward hooks are full ones). Last, one entry for torch's process-wide
    module hooks (``torch.nn.modules.module.register_module_forward_hook`` and
    its siblings), alike. A hook added, removed or replaced after the check
    (one that mixes examples: ``lambda m, i, o: o + o.mean(0)``) is a new
    signature, checked again. dpopt's own hooks (:func:`own_hook`) are left
    out, so a steady loop is checked once. A hook handle's key is not in it
    (the same function registered again gives the same fingerprint). A hook
    function counts by its identity (:class:`_Held`): a hook
    rebuilt by a factory with other closure values is seen even where it lands
    at a freed hook's address. Also per module: its class's ``forward`` (held), so
    ``SomeModule.forward = patched`` after the check is seen. Not seen (by
    design, identity only): a hook or forward whose behaviour depends on
    state outside the module (a global flag, a mutable callable object's
    field), the values of tensors (a plain tensor attribute's or one's in a
    list), and modules that are not in ``named_modules()`` (kept in a plain
    list). Cost: one pass over the modules' attribute dicts and non-empty
    hook tables (measured in ``benchmarks/signature_cost.py``).
    """
    out: list[tuple] = []
    for name, m in model.named_modules():
        d = m.__dict__
        attrs = tuple((k, _attribute_key(v)) for k, v in d.items() if k not in _MODULE_INTERNALS)
        tables = (
            d.get("_forward_pre_hooks"),
            d.get("_forward_hooks"),
            d.get("_backward_pre_hooks"),
            bw := d.get("_backward_hooks"),
        )
        hooks = _hooks(tables, tuple(d.get(f) for f in _HOOK_FLAGS)) if any(tables) else ()
        if hooks and bw:
            hooks += (("full", d.get("_is_full_backward_hook")),)
        fwd = _Held(_class_forward(m))
        out.append(
            (name, id(m), type(m).__qualname__, fwd, attrs, hooks)
            if hooks
            else (name, id(m), type(m).__qualname__, fwd, attrs)
        )
    glob = _hooks(_GLOBAL_TABLES, (None,) + _GLOBAL_FLAGS)
    if glob:
        out.append(
            ("<global module hooks>", glob, getattr(torch.nn.modules.module, "_global_is_full_backward_hook", None))
        )
    return tuple(out)


def size_class(examples: int) -> int:
    """The batch-size class of a batch of ``examples``: ``examples.bit_length()`` (power-of-two buckets).

    A batch in a class not checked before is checked again, at a size of
    that class or above (so a forward that mixes examples only in batches
    larger than the first check's is seen). Poisson batches around E[B]
    fall in one or two classes.
    """
    return int(examples).bit_length()


class Signature(tuple):
    """``(modes, state, size_class)``: what a first-batch check vouches for (:func:`signature`)."""

    __slots__ = ()

    def __new__(cls, modes: tuple, state: tuple, size: int):
        return super().__new__(cls, (tuple(modes), state, int(size)))

    def __getnewargs__(self):  # copy / pickle
        return tuple(self)

    @property
    def modes(self) -> tuple:
        return self[0]

    @property
    def size(self) -> int:
        return self[2]


def signature(
    model: nn.Module, examples: int, modes: Optional[tuple] = None, state: Optional[tuple] = None
) -> Signature:
    """The check's key of a release: :func:`mode_signature`, :func:`module_state` and :func:`size_class`.

    Args:
        model: the root module. examples: the batch's examples (private: used
            only for its class, never stored elsewhere). modes, state: as
            recorded at the forward pass (default: now).
    """
    return Signature(
        mode_signature(model) if modes is None else modes,
        module_state(model) if state is None else state,
        size_class(examples),
    )


@contextmanager
def in_modes(model: nn.Module, signature: Optional[Sequence[bool]] = None) -> Iterator[None]:
    """Context: every module in the mode ``signature`` gives (None: as it is), each restored after.

    Raises:
        ValueError: the signature does not have one flag per module (the model
            gained or lost modules since it was recorded).
    """
    mods = list(model.modules())
    saved = [m.training for m in mods]
    if signature is not None and len(signature) != len(mods):
        raise ValueError(
            f"mode signature of {len(signature)} modules for a model with {len(mods)}: the model's "
            "modules changed between its forward pass and the optimizer step"
        )
    try:
        if signature is not None:
            for m, flag in zip(mods, signature):
                m.training = bool(flag)
        yield
    finally:
        for m, flag in zip(mods, saved):
            m.training = flag


class ModeCheck:
    """Which mode signatures a capture path has verified (a mode not verified yet is checked again).

    Args:
        enabled: False: every mode counts as verified (``verify=False``).

    A change of ``model.training`` of any submodule between steps gives a new
    signature: the first step in it runs the check again. A signature once
    verified stays verified (what a check demotes is demoted for good, so an
    earlier verdict stays sound).
    """

    #: Signatures remembered: a module attribute that changes every step makes a new signature each step;
    #: the oldest is forgotten past this many (it is checked again if it returns), so memory stays bounded.
    MAX_SIGNATURES = 256

    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled)
        self._done: dict = {}  # insertion-ordered set of checked signatures

    def needed(self, signature: tuple) -> bool:
        """True if a step in mode ``signature`` must first be checked.

        ``signature``: a :class:`Signature` (modes, module state, size
        class), or a plain mode signature (checked if any :class:`Signature`
        with those modes was).
        """
        if not self.enabled or signature in self._done:
            return False
        if isinstance(signature, Signature):
            return True
        return not any(isinstance(d, Signature) and d.modes == tuple(signature) for d in self._done)

    def done(self, signature: tuple) -> None:
        """Record that ``signature`` was checked."""
        self._done[signature if isinstance(signature, Signature) else tuple(signature)] = None
        while len(self._done) > self.MAX_SIGNATURES:
            del self._done[next(iter(self._done))]

    @property
    def any_done(self) -> bool:
        """True once some signature was checked (a later refusal is a change since then, not the first batch)."""
        return bool(self._done)

    def checked_size(self, signature: "Signature") -> int:
        """The largest size class checked with the same modes and module state (0: none)."""
        return max([d.size for d in self._done if isinstance(d, Signature) and d[:2] == signature[:2]] or [0])


# --------------------------------------------------------------------------- randomness
class Unreplayable(Exception):
    """A random op of the batched pass cannot be given to a single-example pass (the message says which)."""


_GENERATORS = {
    "bernoulli",
    "bernoulli_",
    "binomial",
    "cauchy",
    "cauchy_",
    "exponential",
    "exponential_",
    "geometric",
    "geometric_",
    "log_normal",
    "log_normal_",
    "multinomial",
    "normal",
    "normal_",
    "normal_functional",
    "poisson",
    "rand",
    "rand_like",
    "randint",
    "randint_like",
    "randn",
    "randn_like",
    "random",
    "random_",
    "randperm",
    "uniform",
    "uniform_",
    "_standard_gamma",
    "_sample_dirichlet",
}
"""Random aten ops whose output is a draw (its parameters may be tensors): replayed as recorded."""


def _op_name(func) -> str:
    return func._schema.name.split("::")[-1]


def _bound(func, args, kwargs) -> dict:
    """The op's arguments by schema name, defaults filled in."""
    schema = func._schema.arguments
    out = {a.name: a.default_value for a in schema if a.has_default_value()}
    out.update(zip([a.name for a in schema], args))
    out.update(kwargs)
    return out


def _inactive(func, args, kwargs) -> bool:
    """A random-tagged op that draws nothing here (dropout probability 0, or not training)."""
    b = _bound(func, args, kwargs)
    for key in ("dropout_p", "dropout", "p"):
        if key in b and isinstance(b[key], (int, float)) and float(b[key]) == 0.0:
            return True
    return any(key in b and b[key] is False for key in ("train", "training", "is_training"))


class _RandomOps(TorchDispatchMode):
    def __init__(self, owner: "RandomReplay"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.owner.aside or torch.Tag.nondeterministic_seeded not in func.tags or _inactive(func, args, kwargs):
            return func(*args, **kwargs)
        return self.owner._random(func, args, kwargs)


class RandomReplay:
    """Record the random ops of a batched pass; replay example i's slice of each in its single-example pass.

    Args:
        model: the root module: each of its forward calls starts a pass (a
            forward pre-hook: while recording, a new pass forgets the earlier
            one; while replaying, each pass is the next example, 0, 1, ...).

    Use::

        rr = RandomReplay(model)
        with rr.recording():
            ... batched forward (and backward) on b examples ...
        with rr.replaying(b):
            for i in range(b): ... forward of example i alone ...

    The k-th random op of example i's pass returns the k-th recorded output
    narrowed to index i along its unique axis of size b (where the request
    has size 1 and every other size agrees), row i of a draw recorded under
    ``torch.func.vmap(randomness="different")`` (``[b, *request]``), or the
    whole recorded output if it has the requested shape (a draw shared by
    the batch), or — where no such axis exists — block i of a draw whose dim 0
    is b times the request's (rows flattened example-major, ``[B·T, ...]``; a
    wrong guess only makes the comparison fail, never passes a mixing model). Dropout through
    ``native_dropout`` replays the mask and recomputes ``input·mask/(1−p)``.
    ``scaled_dot_product_attention`` runs its math kernel in both phases (its
    attention dropout is then an aten draw; the fused CUDA kernels draw
    inside and could not be replayed).
    Only used inside the check: outside these contexts nothing is intercepted.

    Raises (from inside the replayed pass):
        Unreplayable: no such axis, more random calls than were recorded, or a
            random op whose output depends on its data input (module docstring).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.outs: list[Tensor] = []
        self.phase: Optional[str] = None
        self.example, self.k, self.b = -1, 0, 0
        self.aside = False  # draws that are not the model's (the check's own test directions): not intercepted

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """Context: random draws made here are neither recorded nor replayed (the check's own directions).

        Drawn lazily between a forward and its backward, they would otherwise sit
        among the model's draws, before those a checkpointed backward recomputes.
        """
        prev, self.aside = self.aside, True
        try:
            yield
        finally:
            self.aside = prev

    def _pre(self, module, args) -> None:
        if self.phase == "record":
            self.outs = []
        elif self.phase == "replay":
            self.example, self.k = self.example + 1, 0

    @contextmanager
    def _active(self, phase: str) -> Iterator["RandomReplay"]:
        handle = self.model.register_forward_pre_hook(self._pre)
        self.phase = phase
        try:  # the math attention kernel: its dropout is an aten draw (the fused kernels draw inside)
            with sdpa_kernel(SDPBackend.MATH), _RandomOps(self):
                yield self
        finally:
            self.phase = None
            handle.remove()

    def recording(self):
        """Context: record the random ops of the root module's last forward pass."""
        return self._active("record")

    def replaying(self, b: int):
        """Context: the root module's forward passes are examples 0..b−1 of the recorded batch of ``b``."""
        self.example, self.k, self.b = -1, 0, int(b)
        return self._active("replay")

    # -- the intercepted op --------------------------------------------------------------
    def _random(self, func, args, kwargs):
        name = _op_name(func)
        if name not in _GENERATORS and name != "native_dropout":
            raise Unreplayable(
                f"the random operation {name} (its output depends on its input) cannot be replayed per example"
            )
        if self.phase == "record":
            out = func(*args, **kwargs)
            kept = out[1] if name == "native_dropout" else (args[0] if name.endswith("_") else out)
            self.outs.append(kept.detach().clone())
            return out
        if self.k >= len(self.outs):
            raise Unreplayable(
                f"a single-example pass calls more random operations than the batched pass "
                f"({len(self.outs)}; {name} is one more)"
            )
        rec = self.outs[self.k]
        self.k += 1
        if name == "native_dropout":
            inp, p = args[0], float(_bound(func, args, kwargs)["p"])
            mask = self._slice(rec, tuple(inp.shape), name)
            scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
            return inp * mask.to(inp.dtype) * scale, mask.clone()
        out = func(*args, **kwargs)  # the request's shape, dtype and device (the draw itself is discarded)
        value = self._slice(rec, tuple(out.shape), name)
        out.copy_(value)
        return out

    def _slice(self, rec: Tensor, shape: tuple, name: str) -> Tensor:
        if tuple(rec.shape) == shape:
            return rec
        if rec.dim() == len(shape) + 1 and rec.shape[0] == self.b and tuple(rec.shape[1:]) == shape:
            return rec[self.example]  # recorded under torch.func.vmap(randomness="different"): [b, *per-example]
        axes = [
            k
            for k in range(rec.dim())
            if len(shape) == rec.dim()
            and rec.shape[k] == self.b
            and shape[k] == 1
            and all(rec.shape[j] == shape[j] for j in range(rec.dim()) if j != k)
        ]
        if (  # rows flattened example-major (OPT's [B·T, H] tokens, windows): example i's block of rows
            not axes
            and 0 <= self.example < self.b
            and len(shape) == rec.dim() >= 1
            and shape[0] >= 1
            and rec.shape[0] == self.b * shape[0]
            and tuple(rec.shape[1:]) == tuple(shape[1:])
        ):
            return rec.narrow(0, self.example * shape[0], shape[0])
        if len(axes) != 1 or not 0 <= self.example < self.b:
            raise Unreplayable(
                f"the random operation {name} drew a tensor of shape {_trailing_b(rec.shape)} in the "
                f"batched pass and one of shape {tuple(shape)} for a single example: no example "
                "axis to replay it along (apply dropout to tensors that keep the examples along "
                "one axis)"
            )
        return rec.narrow(axes[0], self.example, 1)


def _trailing_b(shape) -> str:
    return str(tuple(int(s) for s in shape))  # verification batches only: b is a public, chosen size


def alone_failed(err: Exception) -> ValueError:
    """The refusal when a model cannot be run on one example in the mode it trains in (the check's reference)."""
    return ValueError(
        f"the per-sample check runs each example alone, in the mode the model trains in, and the model "
        f"failed on one example ({type(err).__name__}: {err}). A forward that needs several examples "
        "in this mode (batch statistics under model.train()) mixes examples and cannot be trained "
        "privately: replace that layer (e.g. GroupNorm or LayerNorm), or train in eval mode"
    )


# --------------------------------------------------------------------------- layout
def off_axis(t: Tensor, b: int) -> bool:
    """True if ``t`` does not have the batch size ``b`` along dim 0 (the per-call layout test of both paths)."""
    return t.dim() == 0 or t.shape[0] != b


# --------------------------------------------------------------------------- sizes
def free_sizes(dims: set, k: int = 2, multiple: int = 1, at_least: int = 2) -> list[int]:
    """The k smallest row counts ≥ ``at_least`` rows (and ≥ 2 examples) that are multiples of ``multiple`` and not in ``dims``.

    ``multiple`` = K rows per example (:mod:`dpopt.engine.capture`): each
    size is then a whole number (≥ 2) of examples. ``at_least``: a lower
    bound in rows (the batch of a new size class: :func:`size_class`).
    """
    out: list = []
    n = max(2 * multiple, -(-int(at_least) // multiple) * multiple)
    while len(out) < k:
        if n not in dims:
            out.append(n)
        n += multiple
    return out


def _tensors(obj) -> list[Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, Tensor)]


def model_dims(model: nn.Module, args: tuple, kwargs: Optional[dict] = None) -> set:
    """Every dimension of the parameters, buffers, inputs and every module's inputs/outputs of ``model(*args)``.

    One forward pass without gradients, in the model's current mode.
    """
    kwargs = kwargs or {}
    dims: set = set()
    for t in list(model.parameters()) + list(model.buffers()) + _tensors((args, kwargs)):
        dims.update(t.shape)

    def hook(module, a, out):
        for t in _tensors((a, out)):
            dims.update(t.shape)

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return dims


# --------------------------------------------------------------------------- agreement
@contextmanager
def in_float64(model: nn.Module) -> Iterator[Callable]:
    """Context: ``model``'s floating parameters and buffers in float64; yields a cast for its inputs.

    For the check's recheck of a float32/half disagreement (rounding or
    mixing?). The Parameter objects stay the same (their ``.data`` is swapped,
    their ``.grad`` set aside) and on exit every parameter gets back its
    original data tensor and every buffer its original tensor object, so
    identity, version counters (:func:`~dpopt.engine.inputs.buffers_unchanged`),
    optimizer state and values are exactly as before. The yielded
    ``cast(tree)`` returns the pytree with its floating tensors in float64.
    """
    params = [p for p in model.parameters() if p.is_floating_point()]
    saved_p = [(p, p.data, p.grad) for p in params]
    saved_b = [
        (m, name, b)
        for m in model.modules()
        for name, b in m._buffers.items()
        if b is not None and b.is_floating_point()
    ]
    try:
        for p, data, _g in saved_p:
            p.grad = None
            p.data = data.double()
        for m, name, b in saved_b:
            m._buffers[name] = b.double()

        def cast(tree):
            flat, spec = tree_flatten(tree)
            return tree_unflatten(
                [t.double() if isinstance(t, Tensor) and t.is_floating_point() else t for t in flat], spec
            )

        yield cast
    finally:
        for p, data, g in saved_p:
            p.data = data
            p.grad = g
        for m, name, b in saved_b:
            m._buffers[name] = b


def rtol(dtype: torch.dtype, device: torch.device) -> float:
    """Relative tolerance of the check: the parameter dtype's (:data:`RTOL`), or autocast's if coarser."""
    tol = RTOL.get(dtype, 5e-2)
    if torch.is_autocast_enabled(device.type):
        tol = max(tol, RTOL.get(torch.get_autocast_dtype(device.type), 5e-2))
    return tol


def layer_of(name: str) -> str:
    """The layer a parameter belongs to, from its ``named_parameters`` name (``"h.0.attn.c_attn.weight"`` → ``"h.0.attn.c_attn"``)."""
    return name.rpartition(".")[0]


def sq_norm64(t: Tensor, chunk: int = 1 << 13) -> float:
    """‖t‖² accumulated in float64, ``chunk`` elements at a time: no float64 copy of all of ``t`` is made.

    The check's reductions of per-example gradients (a float64 copy of a
    whole parameter's gradient would be 8 bytes per element beside it;
    issue 43 bounds the check's memory by the largest parameter).
    """
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for s in range(0, flat.numel(), chunk):
        part = flat[s : s + chunk].double()
        total += torch.dot(part, part)
        del part  # one chunk at a time
    return float(total)


def finite_sq_norm64(t: Tensor, chunk: int = 1 << 13) -> tuple[float, bool]:
    """(‖t‖² in float64, whether every element of ``t`` is finite), in one pass of ``chunk`` elements.

    :func:`sq_norm64` with the finiteness test folded into the same chunks:
    ``torch.isfinite(t).all()`` on the whole tensor allocates ``abs``, two
    comparisons and their conjunction (7 bytes per element beside a float32
    ``t``), more than the gradient itself; here every temporary is a chunk
    (issue 43: the first-batch check is bounded by the largest parameter).
    No device synchronisation per chunk (one at the end).
    """
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    bad = torch.zeros((), dtype=torch.int64, device=t.device)
    for s in range(0, flat.numel(), chunk):
        part = flat[s : s + chunk].double()
        total += torch.dot(part, part)
        bad += part.numel() - torch.isfinite(part).sum()
        del part
    return float(total), int(bad) == 0


def sq_dist64(a: Tensor, b: Tensor, chunk: int = 1 << 13) -> float:
    """‖a − b‖² in float64, ``chunk`` elements at a time (no full-size difference or float64 copy).

    ``a`` and ``b`` are compared element by element in row-major order (the
    order of ``reshape``); both are converted to float64 before the
    subtraction, so the difference of two float32/half values is exact. Neither is written to.

    Raises:
        ValueError: ``a`` and ``b`` have different numbers of elements.
    """
    fa, fb = a.reshape(-1), b.reshape(-1)
    if fa.numel() != fb.numel():
        raise ValueError(f"sq_dist64 compares tensors of equal size; got {tuple(a.shape)} and {tuple(b.shape)}")
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    for s in range(0, fa.numel(), chunk):
        # promoted element by element: exact. Into a copy (one chunk-sized temporary, as for a float32 ``a``): for a
        # float64 ``a``, ``.double()`` is ``a`` itself, and ``sub_`` wrote a − b into the caller's tensor (a block's
        # per-example gradient, which may be a view of a recorded output gradient another block still reads)
        part = fa[s : s + chunk].to(torch.float64, copy=True).sub_(fb[s : s + chunk])
        total += torch.dot(part, part)
        del part
    return float(total)


def layer_scales(ref: dict, names: Sequence[str]) -> dict:
    """Parameter index → per-example squared gradient norm of its whole layer, ``[b]`` float64.

    The scale the check's tolerance is relative to: an exactly-zero gradient
    (the bias of a conv before a one-channel-per-group GroupNorm, an
    attention key bias, which softmax cancels) agrees with float noise the
    size of its layer's rounding, never with only a zero.
    """
    per = {i: torch.tensor([sq_norm64(row) for row in g], dtype=torch.float64, device=g.device) for i, g in ref.items()}
    total: dict = {}
    for i, v in per.items():
        key = layer_of(names[i])
        total[key] = v if key not in total else total[key] + v
    return {i: total[layer_of(names[i])] for i in per}


def agrees(
    sq: Tensor,
    s: Tensor,
    g: Tensor,
    c: Tensor,
    tol: float,
    scale_sq: Optional[Tensor] = None,
    keep: Optional[Tensor] = None,
) -> bool:
    """Capture-path ‖g_i‖² ``sq [B]`` and Σ_i c_i g_i ``s`` against per-example gradients ``g [B, ...]``.

    Tolerances are relative to the scale of the layer's gradients: the largest
    per-example squared norm of the layer, ``scale_sq [B]`` (default: this
    parameter's own), and Σ_i |c_i|·√scale_sq_i for the sum — so an
    exactly-zero gradient (a bias before a one-channel-per-group GroupNorm)
    agrees with float noise.

    ``keep [B]`` (bool): the examples compared (``s`` sums over them only); an
    example left out because its reference gradient is not finite (a model
    that overflows on it, e.g. a float64 mask minimum cast to float32 = −inf
    in a fully masked attention row) must be non-finite in the capture too
    wherever it is non-finite in ``g``: the same failure, never a finite value.
    """
    g64 = g.double().reshape(g.shape[0], -1)
    if keep is not None and not bool(keep.all()):
        broken = ~keep & ~torch.isfinite(g64).all(1)
        if bool(torch.isfinite(sq.double()[broken]).any()):
            return False
        if not bool(keep.any()):
            return True
        g64, sq, c = g64[keep], sq[keep], c[keep]
        scale_sq = None if scale_sq is None else scale_sq[keep]
    want = g64.square().sum(1)
    scale = want if scale_sq is None else torch.maximum(want, scale_sq.double())
    tol_sq = tol * float(scale.max()) + 1e-30
    if not float((sq.double() - want).abs().max()) <= tol_sq:
        return False
    c64 = c.double()
    want_s = c64 @ g64
    tol_s = tol * float(c64.abs() @ scale.sqrt()) + 1e-30
    return float((s.double().reshape(-1) - want_s).norm()) <= tol_s


def disagreeing(
    blocks: Sequence,
    ref: dict,
    c: Tensor,
    dtypes: Sequence[torch.dtype],
    tol: float,
    names: Optional[Sequence[str]] = None,
) -> list[int]:
    """Parameter indices whose blocks' per-example norms or weighted sum differ from ``ref``.

    Args:
        blocks: the capture path's blocks (``index``, ``sq_norms``, ``grad_sums``).
        ref: parameter index → reference per-example gradients ``[b, *shape]``
            (exact single-example autograd).
        c: weights ``[b]`` (float64) of the test sum.
        dtypes: the dtype each parameter's blocks compute in (by index; float32 for bf16 parameters).
        tol: :func:`rtol`.
        names: parameter names by index: tolerances relative to each layer's
            gradient scale (:func:`layer_scales`); None: to each parameter's own.
    """
    scales = layer_scales(ref, names) if names is not None else {}
    # examples whose reference gradient is finite in every parameter are compared; the others must fail alike
    keep = None
    if ref:
        keep = torch.stack([torch.isfinite(g.reshape(g.shape[0], -1)).all(1) for g in ref.values()]).all(0)
    bad = None if keep is None or bool(keep.all()) else ~keep.to(c.device)
    off = []
    for blk in blocks:
        sums = blk.grad_sums([c.to(dtypes[i]) for i in blk.index], bad)
        for i, sq, s in zip(blk.index, blk.sq_norms([(None, None)] * len(blk.index)), sums):
            if not agrees(sq, s, ref[i], c, tol, scales.get(i), keep):
                off.append(i)
    return off


def disagreeing_rows(
    sq: dict,
    ref_sq: dict,
    finite: dict,
    dist: dict,
    tol: float,
    names: Sequence[str],
) -> list[int]:
    """Parameter indices whose capture disagrees with single-example autograd, from per-example numbers only.

    The streamed form of :func:`disagreeing` (``Recorder._loop_streamed``:
    the reference gradients are reduced as they are computed, so no
    ``[b, *shape]`` tensor exists). Per parameter index ``i`` and compared
    example e (``[m]`` each): ``sq[i]`` the capture's ‖ĝ_e‖², ``ref_sq[i]``
    the reference's ‖g_e‖² (float64), ``finite[i]`` whether g_e is finite,
    ``dist[i]`` ‖ĝ_e − g_e‖ (float64).

    The tests are :func:`agrees`' with the weighted sum taken one example at a
    time: an example is kept if its reference is finite in every parameter
    (a non-kept one must be non-finite in the capture wherever it is in the
    reference); over the kept ones, |‖ĝ_e‖² − ‖g_e‖²| ≤ tol·max_e scale_e and
    ‖ĝ_e − g_e‖ ≤ tol·√scale_e, scale_e = max(‖g_e‖², the squared norm of
    g_e's whole layer, :func:`layer_scales`). The second implies
    :func:`agrees`' sum test for every weights c ∈ [0, 1]^m (triangle
    inequality), so this form is at least as strict.
    """
    if not ref_sq:
        return []
    keep = torch.stack([finite[i] for i in ref_sq]).all(0)
    layer: dict = {}
    for i, v in ref_sq.items():
        key = layer_of(names[i])
        layer[key] = v if key not in layer else layer[key] + v
    off = []
    for i in sorted(ref_sq):
        cap = sq[i].detach().double().cpu().reshape(-1)
        broken = ~keep & ~finite[i]
        if bool(torch.isfinite(cap[broken]).any()):
            off.append(i)
            continue
        if not bool(keep.any()):
            continue
        want = ref_sq[i][keep]
        scale = torch.maximum(want, layer[layer_of(names[i])][keep])
        if not float((cap[keep] - want).abs().max()) <= tol * float(scale.max()) + 1e-30:
            off.append(i)
        elif not bool((dist[i][keep] <= tol * scale.sqrt() + 1e-30).all()):
            off.append(i)
    return off
