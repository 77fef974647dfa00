"""Layers whose rows are not examples, captured through the nearest enclosing call that keeps them.

A layer may see rows that are not the batch's examples: OPT's decoder
flattens its tokens to ``[B·T, H]`` before ``final_layer_norm``/``fc1``/``fc2``;
a mixture of experts routes ``[B·T, H]`` tokens (routers over all tokens,
experts over data-dependent subsets); Swin partitions images into
``[B·nW, w², C]`` windows; T5/MPNet's ``relative_attention_bias``, BEiT's
relative position table, DeBERTa-v2's ``pos_key_proj`` and BART's learned
positions act on tables shared by the batch; a parametrization (weight norm)
computes a weight from its original parameters with no batch at all. The
output gradient of such a call is not split by example, so no rule applies.

Per-example gradients stay exact through the chain rule one level up: let A
be the nearest module enclosing the layer whose call has the examples along
dim 0 (some input ``[B, ...]``, and every output that requires gradients
``[B, ...]``). If the parameter θ is used only inside A's call, example i's
loss depends on θ only through A's output row i, so

    ∂ℓ_i/∂θ = (∂A(x_i; θ)/∂θ)ᵀ e_i,   e_i = ∂ℓ_i/∂A_i,

the vjp of A's call on example i alone (its other inputs held fixed), with
the output gradient the user's backward delivered: the hook door's existing
per-example vjp (:meth:`~dpopt.engine.capture.Recorder.vjp_grads`: a
``torch.func`` vmap, or an exact loop of single-example calls where the call
cannot be vmapped, as a mixture of experts' data-dependent routing). This
covers every kind above with ONE mechanism — tokens, windows and routed
subsets are mapped back to their example by A's own forward, tables and
parametrizations are differentiated through the gather/broadcast that carries
them into each example's activations. Shared tables reach later layers
through extra outputs (T5 passes ``position_bias`` from layer to layer): such
an output does not have the examples along dim 0, so A is then an enclosing
module further up (the stack), whose outputs do.

The root module is never such an enclosing call: there the per-example
vjp would recompute the whole model on each example alone with the output
gradient of the batched pass, and a model that mixes examples could pass the
check (its Jacobian alone may hide the mixing); a layer no enclosing call
below the root can take is refused as before. Below the root, mixing inside
an enclosing call shows in what follows it (the trainable layers that read
its batched output, and the check's per-row loss, quadratic in the outputs).

Decisions are per module and sticky (:class:`Lifts`): a module seen off the
example axis once is lifted for good, its parameters move to the vjp of its
enclosing module, and a module that receives lifted parameters is lifted on
in turn if one of its calls is off the axis. The first-batch check
(:mod:`dpopt.engine.check`, at batch sizes that differ from every dimension of
the model) compares the result with single-example autograd as for any other
parameter: a parameter also used outside A (so the vjp of A misses a use) is
refused there, never silently wrong.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from .check import off_axis

__all__ = ["Lifts", "on_axis"]


def on_axis(ins: list, outs: list, rows: int) -> bool:
    """Whether a call keeps the ``rows`` examples along dim 0.

    Args:
        ins: the call's input tensors; outs: its output tensors; rows: the pass's rows.

    True if some input has ``rows`` along dim 0 and every output that
    requires gradients does (outputs without gradients, such as routing
    indices, do not carry a parameter's gradient).
    """
    if not any(not off_axis(t, rows) for t in ins):
        return False
    return all(not off_axis(t, rows) for t in outs if isinstance(t, Tensor) and t.requires_grad)


class Lifts:
    """Which modules are captured through an enclosing call, and where (the hook door; module docstring).

    Args:
        model: the root module; names: ``id(module)`` → its qualified name (``"<root>"`` for the root).

    Attributes:
        lifted: module → the enclosing module whose call computes its parameters' gradients.
        targets: modules that receive lifted parameters; since: target → the
            serial of the pass in which it became one.
        pending: modules of the current pass seen off the example axis and not yet
            assigned, with their (input, output) shapes for an error message.
        forced: modules the first-batch check found a parameter of used outside
            their calls (:meth:`escalate`): lifted at the next pass, called or not.
    """

    def __init__(self, model: nn.Module, names: dict):
        self.parent: dict[nn.Module, nn.Module] = {}
        for m in model.modules():
            for child in m.children():
                self.parent.setdefault(child, m)
        self.root = model
        self.names = names
        self.lifted: dict[nn.Module, nn.Module] = {}
        self.targets: set = set()
        self.since: dict[nn.Module, int] = {}
        self.pending: dict[nn.Module, tuple] = {}
        self.forced: set = set()

    def start(self) -> None:
        """A new pass: forget the pending modules; the forced ones not yet lifted are pending from the start."""
        self.pending = {m: ([], []) for m in self.forced if m not in self.lifted and m is not self.root}

    def off(self, m: nn.Module) -> bool:
        """True if ``m`` must be lifted whatever its call's layout (:attr:`forced`, not yet lifted)."""
        return m in self.forced and m not in self.lifted

    def escalate(self, owners: list) -> bool:
        """Force the given modules (owners of parameters the check refused) one level up; False if none can move.

        A parameter used outside its module's calls (DeBERTa-v2's encoder reads
        ``rel_embeddings.weight`` directly) disagrees with single-example
        autograd; its owner (or the target its parameter was lifted into) is
        then lifted to an enclosing call, which sees that use.
        """
        moved = False
        for m in owners:
            m = self.lifted.get(m, m)
            up = self.parent.get(m)
            if up is not None and up is not self.root and m not in self.forced:
                self.forced.add(m)
                self.targets.discard(m)
                moved = True
        return moved

    def encloses(self, a: nn.Module, m: nn.Module) -> bool:
        """True if ``a`` is a strict ancestor of ``m``."""
        p = self.parent.get(m)
        while p is not None:
            if p is a:
                return True
            p = self.parent.get(p)
        return False

    def waiting_in(self, a: nn.Module) -> list:
        """The pending modules that ``a`` encloses."""
        return [m for m in self.pending if self.encloses(a, m)]

    def relative(self, a: nn.Module, m: nn.Module) -> str:
        """``m``'s qualified name relative to its ancestor ``a``, with a trailing dot."""
        full_a, full_m = self.names[id(a)], self.names[id(m)]
        if a is self.root:
            return full_m + "."
        return full_m[len(full_a) + 1 :] + "."

    def assign(self, a: nn.Module, owned: dict[nn.Module, dict[str, int]], serial: int = 0) -> dict[str, int]:
        """Lift the pending modules ``a`` encloses into ``a``; returns their parameters by name relative to ``a``.

        ``owned``: module → {attribute (or relative dotted name): index} of the
        parameters each pending module carries now (its own, and those lifted into it).
        """
        moved: dict[str, int] = {}
        for m in self.waiting_in(a):
            prefix = self.relative(a, m)
            moved.update({prefix + k: i for k, i in owned.get(m, {}).items()})
            self.lifted[m] = a
            for q, t in list(self.lifted.items()):  # what was lifted into m goes on to a
                if t is m:
                    self.lifted[q] = a
            self.targets.discard(m)
            del self.pending[m]
        if a not in self.targets:
            self.targets.add(a)
            self.since[a] = serial
        return moved

    def first_pending(self) -> Optional[tuple]:
        """``(module, (inputs, outputs) shapes)`` of a module no enclosing call could take, or None."""
        for m, shapes in self.pending.items():
            return m, shapes
        return None
