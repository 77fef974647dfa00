"""The engine's capture with the model's forward and backward compiled by ``torch.compile`` (``compile=``).

Why not ``torch.compile(model)`` with the ordinary capture: the capture
records each layer's input ``a`` and differentiates the per-example losses
w.r.t. the layer's output. Under ``torch.compile`` a forward hook with the
:class:`~dpopt.engine.capture.Recorder`'s Python breaks the graph at every
hooked layer (torch 2.13: only the hooked layers' own forwards were compiled,
one op each; the glue between them stayed eager), and a layer output that
lives inside one compiled graph is not a node autograd can differentiate
w.r.t.: its gradient would be missing. So this path keeps the layer outputs
out of the graph's interior by **taps**: every planned layer's call returns
``out + z`` where ``z`` is a zero tensor of the output's shape that requires
grad and is an INPUT of the compiled graph. Then

* the forward value is unchanged (``out + 0`` is exact),
* ``∂ℓ/∂z = ∂ℓ/∂out = e``, the output gradient the rules need, and autograd
  can return it because ``z`` is a graph input (the compiled backward computes it),
* the layer input ``a`` is a graph output (a value only).

The parameters enter the graph detached (``functional_call``), so the
compiled backward forms no weight gradient — as in the eager capture, the
weight gradients are replaced by the clipped sum Eᵀ diag(c) A
(:mod:`dpopt.engine.layers`, uncompiled). The per-example losses, the norms,
the clipped sum and the noise (the Privatizer) stay eager: no random draw that
protects anything runs in compiled code.

The root module is called through its ``forward`` (its own hooks, e.g. the
check's random-op recorder, are not traced: the graph that trains is the graph
that was checked), and the graph runs outside any torch dispatch mode: a
random draw inside it (dropout in train mode) cannot be replayed per example,
so a model with a dropout module in train mode (p > 0) is refused when the capture is built
(:func:`random_modules`), and one drawing otherwise (``F.dropout`` in a forward, a mode switched on
later) is refused by the first-batch check (the door then gives the model back its forward and hooks).

The graph is traced with ``fullgraph=True``: a forward with data-dependent
Python control flow (``if x.sum() > 0``), or anything else torch.compile
cannot put in one graph, is refused with dynamo's reason. The batch axis is
marked dynamic (one graph for every Poisson batch size ≥ 2; a recompilation,
e.g. a change of train/eval mode, is detected: :attr:`CompiledCapture.compiles`).

Both doors use this graph: dpopt's own loop through
:class:`~dpopt.engine.fast.PerSampleEngine` (:meth:`CompiledCapture.run`: the loss and its
backward to the taps are the engine's), and ``PrivacyEngine.make_private(..., compile=...)``
through :class:`CompiledForward` (the model's forward; the user's ``loss.backward()`` reaches the taps).
A batch of fewer than 2 rows runs the eager capture in both: dynamo would specialise its size, and
inductor's on-disk C++ code cache would then hold kernels with that size as a literal.

Exactness is not assumed: :class:`~dpopt.engine.fast.PerSampleEngine` runs its
first-batch check (:meth:`~dpopt.engine.capture.Recorder.check`: per-example
squared norms and a weighted sum against single-example eager autograd) ON
THIS PATH, in the mode that trains, and again on any batch whose call compiled
a new graph; any disagreement refuses (no fallback is taken silently).
"""

from __future__ import annotations

import gc
import types
from typing import Callable, Optional

import torch
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import _disable_current_modes

from .capture import Call, Plan

__all__ = ["CompiledCapture", "COMPILE_BACKENDS", "compile_backend", "random_modules"]

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""The ``torch.compile`` backends accepted: ``inductor`` (generated C++/OpenMP kernels on the CPU, Triton on
a GPU; what ``compile=True`` means), ``aot_eager`` (the same forward/backward graphs run by eager kernels:
fast to compile, for tests) and ``eager`` (dynamo's graph only)."""


RECOMPILES = 32
"""Graphs one capture may compile (train/eval modes, dtypes — the check's float64 recheck —, specialised
batch sizes); past it torch.compile refuses, and so does the capture."""


INDUCTOR_OPTIONS: dict = {}
"""Inductor config options (``torch._inductor.config`` names) applied while THIS module's graphs compile
(``config.patch`` around the backend call: they do not leak into other ``torch.compile`` calls). Empty by
default; ``benchmarks/compile_floor.py --option`` sets them to measure e.g. ``cpp_wrapper``."""


def compile_backend(compile: object) -> Optional[str]:
    """The backend named by a ``compile=`` argument: False/None → None (eager), True → ``"inductor"``.

    Raises:
        ValueError: a name not in :data:`COMPILE_BACKENDS`, or another type.
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        return "inductor"
    if isinstance(compile, str) and compile in COMPILE_BACKENDS:
        return compile
    raise ValueError(f"compile must be True, False or a backend name in {COMPILE_BACKENDS}, got {compile!r}")


_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def random_modules(model: nn.Module) -> list[str]:
    """Names of the model's dropout modules that draw at random now (train mode, ``p > 0``).

    Their draws would run inside the compiled graph, where the first-batch check cannot replay them per
    example (:mod:`dpopt.engine.check`), so the compiled capture refuses such a model up front.
    """
    return [
        name or type(model).__name__
        for name, m in model.named_modules()
        if isinstance(m, _RANDOM_MODULES) and m.training and float(m.p) > 0
    ]


def refusal(what: str) -> ValueError:
    """The error of a model the compiled capture cannot take (``compile=`` off trains it exactly)."""
    return ValueError(f"compile=True: {what}; train it without compile (the eager capture is exact for it)")


class CompiledCapture:
    """One compiled forward of a :class:`~dpopt.engine.capture.Plan`'s model with taps on its planned layers.

    Args:
        plan: the plan (its ``modules`` are tapped; tapped-forward layers, bare
            broadcast parameters and ``transformers`` models are refused).
        backend: a name in :data:`COMPILE_BACKENDS`.

    Attributes:
        compiles: graphs compiled so far (the backend counts them): a call
            that raises it ran a graph no check has vouched for yet.

    Raises:
        ValueError: at construction, a plan with layers this path cannot tap;
            at :meth:`run`, a forward torch.compile cannot trace as one graph.
    """

    def __init__(self, plan: Plan, backend: str):
        if plan.tapped:
            names = [plan.name_of(m) for m in plan.tapped]
            raise refusal(f"layers whose rule taps their inner maps ({names}: MultiheadAttention, LSTM, ...)")
        if plan.bare:
            raise refusal(f"bare parameters used in a forward ({sorted(plan.name_of(m) for m in plan.bare)})")
        if plan.hf:
            raise refusal("a transformers model (its labels= loss and caches are captured by the eager path)")
        drawing = random_modules(plan.model)
        if drawing:
            raise refusal(
                f"dropout in train mode ({drawing}) draws inside the compiled graph, where the first-batch check "
                "cannot replay its draws per example"
            )
        self.plan = plan
        self.backend = backend
        self.compiles = 0
        self._real = torch._dynamo.lookup_backend(backend)
        # dynamo caches graphs and counts recompilations per code object: a copy of _forward's code for
        # this capture, so that other captures (other models) neither share its limit nor keep its graphs alive
        forward = types.FunctionType(CompiledCapture._forward.__code__.replace(), globals(), "_forward")
        self._fn = torch.compile(types.MethodType(forward, self), backend=self._count, fullgraph=True, dynamic=None)
        self._live = False
        # the model's forward as given: the PrivacyEngine door (engine.hooks) replaces model.forward by one that
        # calls this capture, whose graph must trace the original
        self._call = plan.model.forward
        self._taps: list[Tensor] = []
        self._inputs: list[tuple[nn.Module, Tensor]] = []
        self._handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in plan.modules]
        self._trail: dict = {}  # (x's trailing shape, dtype, modes) -> [(module, output trailing shape, dtype)]

    def detach(self) -> None:
        """Remove the hooks from the model (the capture cannot be used afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _count(self, gm, example_inputs):
        """The backend: counts the graph, compiles it without inductor's on-disk graph cache.

        The cache key holds the graph's shapes; the batch axis is symbolic, except where dynamo
        specialises it (one example): a batch's size is private, so no graph is written to disk.
        """
        self.compiles += 1
        from torch._functorch import config as aot_config
        from torch._inductor import config

        options = dict(INDUCTOR_OPTIONS) if self.backend == "inductor" else {}
        with (
            config.patch(fx_graph_cache=False, fx_graph_remote_cache=False, **options),
            aot_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False),
        ):
            return self._real(gm, example_inputs)

    # -- the traced forward ------------------------------------------------------------------
    def _hook(self, module, args, kwargs, out):
        """Inside the compiled forward: record the layer input, return ``out + z`` (z: this call's tap)."""
        if not self._live:
            return None
        inp = args[0] if args else next(iter(kwargs.values()), None)
        k = len(self._inputs)
        self._inputs.append((module, inp))
        return out + self._taps[k]

    def _forward(self, params: dict, x: Tensor, taps: list[Tensor]):
        self._taps = taps
        model = self.plan.model
        with _reparametrize_module(model, params):  # the root's own hooks are not traced (module docstring)
            out = self._call(x)
        return out, [a for _, a in self._inputs]

    # -- the tap shapes ----------------------------------------------------------------------
    def _shapes(self, x: Tensor) -> list:
        """The planned calls of a forward of ``x``'s trailing shape: (module, output trailing shape, dtype).

        Learned once per trailing shape, dtype and train/eval modes by an eager
        ``no_grad`` forward of two rows (the compiled graph is guarded on the
        same things); every call must keep the rows along dim 0.
        """
        model = self.plan.model
        key = (tuple(x.shape[1:]), x.dtype, tuple(m.training for m in model.modules()))
        calls = self._trail.get(key)
        if calls is not None:
            return calls
        rows = min(2, int(x.shape[0]))
        seen: list = []

        def probe(module, args, kwargs, out):
            seen.append((module, out))

        handles = [m.register_forward_hook(probe, with_kwargs=True) for m in self.plan.modules]
        try:
            with torch.no_grad():
                model(x[:rows])
        finally:
            for h in handles:
                h.remove()
        calls = []
        for m, out in seen:
            if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != rows:
                shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise refusal(f"layer {self.plan.name_of(m)!r} returns {shape} for {rows} rows (not rows along dim 0)")
            calls.append((m, tuple(out.shape[1:]), out.dtype))
        self._trail[key] = calls
        return calls

    # -- one pass ------------------------------------------------------------------------------
    def forward(self, x: Tensor, offset=None) -> tuple:
        """One compiled forward of ``x`` (at θ + offset): ``(out, [(module, a, z), ...])`` in call order.

        ``a`` is the layer's input ``[n, ...]`` (row-major), ``z`` its tap: a zero leaf of the
        output's shape that requires grad, added to the layer's output inside the graph, so that a
        backward from ``out`` delivers ``∂ℓ/∂out`` of the layer as ``z``'s gradient (module docstring).

        Raises:
            ValueError: a forward torch.compile cannot trace as one graph (dynamo's reason in the message).
        """
        plan = self.plan
        n = int(x.shape[0])
        calls = self._shapes(x)
        # a zero per output element: a stride-0 broadcast zero (one scalar: no fill, no full read) was tried and
        # gave wrong output gradients through AOTAutograd (a view input), caught by the first-batch check
        taps = [torch.zeros((n, *shape), dtype=dt, device=x.device, requires_grad=True) for _, shape, dt in calls]
        trainable = dict(zip(plan.names, plan.params))
        if offset is None:
            params = {k: p.detach() for k, p in trainable.items()}
        else:
            params = {k: (p + o).detach() for (k, p), o in zip(trainable.items(), offset)}
        if n > 1:  # one graph for every batch size ≥ 2 (Poisson batches); where dynamo specialises: a new graph
            torch._dynamo.maybe_mark_dynamic(x, 0)
            for t in taps:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        self._inputs.clear()
        self._live = True
        try:
            # outside the check's random-op recorder (compiled draws are not replayable); with grad (optimizers
            # consume the sources under no_grad)
            with _disable_current_modes(), torch.enable_grad(), torch._dynamo.config.patch(recompile_limit=RECOMPILES):
                out, inputs = self._run_graph(params, x, taps)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as err:
            lines = str(err).splitlines()
            why = next((ln for ln in lines if "data-dependent" in ln or "Caused by" in ln), lines[0] if lines else "")
            raise refusal(
                "torch.compile cannot trace this model's forward as one graph (data-dependent control flow, "
                f"or an operation dynamo does not support): {why.strip()}"
            ) from None
        finally:
            self._live, self._taps, recorded = False, [], list(self._inputs)
            self._inputs.clear()
        if [m for m, _ in recorded] != [m for m, _, _ in calls] or len(inputs) != len(calls):
            raise refusal("the layers called by the compiled forward differ from those of the eager forward")
        # inductor may return a tensor in a permuted layout (a GroupNorm's output gradient came back
        # channels-last); the eager blocks (unfold, Gram, GEMMs) are slower on such strides: row-major here
        return out, [(m, a.contiguous(), z) for (m, _, _), a, z in zip(calls, inputs, taps)]

    def _run_graph(self, params: dict, x: Tensor, taps: list[Tensor]):
        """``self._fn(params, x, taps)``, once more after a garbage collection where dynamo failed on a process-wide
        module hook that vanished while it compiled.

        A ``PrivacyEngine`` watch of the loss's reduction (:mod:`dpopt.opacus_compat`) holds a process-wide
        forward hook and removes it when the watch is collected; a watch left in a reference cycle is collected
        whenever Python's cycle collector runs — possibly between dynamo's trace of ``nn.Module.__call__`` (which
        saw the hook) and its guards (which then read ``_global_forward_hooks[id]``: ``KeyError``, raised as an
        ``InternalTorchDynamoError``). Seen in CI (2026-12-07, ``tests/engine/test_compiled.py``, twice). Before
        the first graph is compiled a collection runs every pending removal, so the first trace and its guards see
        the same hooks (without it a retry compiled a second graph); after a failure the retry compiles against
        the hooks as they are.

        Raises:
            torch._dynamo.exc.InternalTorchDynamoError: any other internal error, or the same one again.
        """
        if self.compiles == 0:  # once, before the first trace (a compile takes seconds; a collection milliseconds)
            gc.collect()
        try:
            return self._fn(params, x, taps)
        except torch._dynamo.exc.InternalTorchDynamoError as err:
            if not (isinstance(err.__cause__ or err.__context__, KeyError) or str(err).startswith("KeyError:")):
                raise  # (dynamo re-raises its internal errors "from None": the KeyError is the context)
            gc.collect()
            return self._fn(params, x, taps)

    def run(self, x: Tensor, loss_of: Callable, offset=None) -> list[Call]:
        """One compiled forward of ``x`` (at θ + offset), then the output gradients of ``loss_of(out)``.

        ``loss_of(out) -> (loss, grad_outputs)`` runs eagerly on the compiled
        forward's output. Returns the calls (input ``a``, the tap as output,
        ``grads[0]`` = e, None if the loss does not reach the layer) in call order.

        Raises:
            ValueError: a forward torch.compile cannot trace as one graph (dynamo's reason in the message).
        """
        out, tapped = self.forward(x, offset)
        with torch.enable_grad():
            loss, grad_outputs = loss_of(out)
        with _disable_current_modes():
            es = torch.autograd.grad(loss, [z for _, _, z in tapped], grad_outputs=grad_outputs, allow_unused=True)
        result = []
        for (m, a, z), e in zip(tapped, es):
            c = Call(m, a, z, (a,), {}, [z], None, versions=False)
            c.grads[0] = e.contiguous() if e is not None else None
            result.append(c)
        return result


class CompiledForward:
    """The ``PrivacyEngine`` door's ``model.forward`` with ``make_private(..., compile=...)``.

    In that door the training loop is the user's (``loss = crit(model(x), y); loss.backward()``) and a
    :class:`~dpopt.engine.capture.Recorder` records each layer's call from forward hooks, with a tensor
    hook on its output for the gradient (:mod:`dpopt.engine.hooks`). This object becomes the model's
    ``forward`` (an instance attribute: ``model(x)`` still runs the model's own root hooks around it) and,
    for a batch of ≥ 2 rows given as one positional tensor with gradients enabled, runs the
    :class:`CompiledCapture`'s graph instead of the eager forward, the recorder switched off while it
    traces; each tapped layer's call is then handed to the recorder as if its forward hook had seen
    input ``a`` and output ``z`` (the tap: a graph input, so the user's ``loss.backward()`` delivers
    ``∂ℓ/∂out`` to the recorder's tensor hook on ``z``). The parameters enter the graph detached: the
    backward forms no ``p.grad`` (the door's clipped sum replaces it).

    Everything else runs the model's eager forward with the recorder on: one-row batches (dynamo
    specialises size 1: a graph per such batch, and one example cannot be checked against itself), other
    call signatures, ``no_grad`` evaluation, and the first-batch check's single-example reference passes
    (:meth:`~dpopt.engine.capture.Recorder.check` runs them with the recorder off), so the check compares
    the compiled graph with eager autograd. The door re-runs the check on the first pass after any new
    graph compiled (:class:`~dpopt.engine.hooks.HookCapture`: :attr:`compiles`).

    Raises:
        ValueError: what :class:`CompiledCapture` refuses, and layers whose parameters the door computes
            by a vjp of their own forward (no fast rule: the recorder could not record them inside the graph).
    """

    def __init__(self, rec, backend: str, vjp: dict):
        plan = rec.plan
        if vjp:
            names = sorted(plan.name_of(m) for m in vjp)
            raise refusal(f"layers without a per-sample rule ({names}: their gradients come from a vjp of their call)")
        self.rec = rec
        self.capture = CompiledCapture(plan, backend)
        self.model = plan.model
        self._given = self.model.__dict__.get("forward")  # an instance forward set before (restored by detach)
        self.model.forward = self

    @property
    def compiles(self) -> int:
        """Graphs compiled so far (:attr:`CompiledCapture.compiles`)."""
        return self.capture.compiles

    def __call__(self, *args, **kwargs):
        rec, cap = self.rec, self.capture
        x = args[0] if len(args) == 1 and not kwargs else None
        compiled = (
            isinstance(x, Tensor)
            and x.dim() > 0
            and int(x.shape[0]) >= 2
            and rec.active
            and rec.current is not None
            and torch.is_grad_enabled()
        )
        if not compiled:
            return cap._call(*args, **kwargs)
        rec.active = False  # its hooks return at once inside the graph (and the probe's eager forward)
        try:
            out, tapped = cap.forward(x)
        finally:
            rec.active = True
        for m, a, z in tapped:
            if rec._layer(m, (a,), {}, z) is not None:  # the recorder would have changed the layer's output
                raise refusal(f"layer {rec.plan.name_of(m)!r} needs its recorded output changed (a broadcast input)")
        return out

    def detach(self) -> None:
        """Give the model its forward back and remove the capture's hooks."""
        self.capture.detach()
        if self.model.__dict__.get("forward") is self:
            if self._given is None:
                del self.model.forward
            else:
                self.model.forward = self._given
