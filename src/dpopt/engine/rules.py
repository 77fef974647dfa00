"""Fast per-sample rules, registered per layer type: the one place to add a rule.

A *rule* says, for one layer type, whether a module instance is supported and
how to build its blocks (:mod:`dpopt.engine.layers`) from the calls the
engine recorded in one forward/backward pass. Rules are looked up by the
EXACT module type (a subclass may change ``forward``, so it falls back to the
per-example reference path unless it registers its own rule).

============  ===========================================  ==================
module        weight                                       other parameters
============  ===========================================  ==================
Linear        :class:`~.layers.FactoredBlock` (any ``...``)  bias: direct Σ_t e
Conv2d        FactoredBlock via im2col (groups = 1, any      bias: direct
              stride/dilation/padding/padding_mode)
Embedding     :class:`~.layers.SparseRowsBlock`              —
              (no ``max_norm``/``scale_grad_by_freq``)
LayerNorm     direct (x̂ ⊙ e summed)                          bias: direct
RMSNorm       direct (x̂ ⊙ e summed, x̂ = x/rms(x))            —
GroupNorm     direct (closed form from group stats)           bias: direct
HF Conv1D     FactoredBlock, g_i = Σ_t a_it e_itᵀ ([in, out])  bias: direct
HF RMSNorm    as RMSNorm (LlamaRMSNorm and identical copies)  —
MHA           tapped forward (:mod:`.attention`): in_proj     out_proj: Linear's rule;
              FactoredBlock from the recorded projections    bias/bias_k/v: direct
LSTM/GRU/RNN  tapped forward (:mod:`.recurrent`): W_ih, W_hh  biases: direct Σ_t e
              FactoredBlocks over the time steps
WSConv2d      tapped forward (:mod:`.ws`): Jᵀ of the          bias: direct
              standardization applied to the conv gradient
              (groups = 1), chunked per-example norms
============  ===========================================  ==================

A parameter owned by several modules (tied weights) is given to each
owner's rule; the engine sums the uses (:mod:`dpopt.engine.tied`). A
parameter is on the fast path only if every module owning it has a rule.

Adding a rule (as Opacus's ``register_grad_sampler``)::

    @register_rule(nn.MyLayer, supports=lambda m: m.some_option is None)
    def _my_layer(layer: LayerCalls) -> list:
        # layer.calls: [(a [B, ...], e [B, ...])] per call and evaluation point
        return [DirectBlock([layer.index["weight"]], [...per-sample grads [B, *shape]...])]

The rule only has to be exact for one example per row of dim 0: the engine
verifies that layout on every batch, and compares the rule's per-example
norms and sums with the reference path on the first batch
(:meth:`~dpopt.engine.fast.PerSampleEngine._verify`), so a wrong rule is
demoted with a warning rather than trusted. A rule must be registered before
the engine plans the model (:func:`~dpopt.engine.fast.get_engine`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional, cast

import torch
from torch import Tensor, nn

from .layers import (
    Budget,
    ConvPart,
    DirectBlock,
    FactoredBlock,
    LinearPart,
    SparseRowsBlock,
    group_norm_grads,
    layer_norm_grads,
    rms_norm_grads,
)

__all__ = ["LayerCalls", "Rule", "RULES", "register_rule", "rule_for", "tap_forwards", "is_tapped", "linear_bias_sums"]


@dataclass
class LayerCalls:
    """What a rule receives: one module's recorded calls in one source (private data).

    Attributes:
        module: the layer (its hyperparameters are read, never its parameters' values).
        index: parameter attribute name (``"weight"``, ``"bias"``) → the
            trainable-parameter index it covers; only attributes the fast path
            owns are present (a frozen parameter, or a shared one whose other owner has
            no rule, is absent; a tied one is present in each owner).
        shapes: attribute name → parameter shape.
        calls: ``(a, e)`` per recorded call and evaluation point: the layer
            input ``a [B, ...]`` and the gradient of the coefficient-weighted
            per-example losses w.r.t. the layer output, ``e [B, ...]``; both
            cast to :attr:`dtype` (``a`` if floating), except for a rule
            registered ``chunked=True``, which receives them as recorded (bf16
            under autocast or with bf16 weights) and casts them per chunk of
            examples. Never empty (a layer without calls gets zero gradients
            from the engine).
        stats: per call, the ``(mean, rstd)`` autograd saved for a norm
            layer's backward, or None.
        batch_size: B.
        budget: the source's memory :class:`~dpopt.engine.layers.Budget`.
        tags: per call, the tag a tapped forward gave it (``Rule.forward``:
            which linear map inside the layer the call is), else None.
        views: K, the rows per example of a ``views="merge"`` rule's calls
            (``a``, ``e`` are ``[B, K, ...]``); 1 otherwise.
        dtype: the dtype of the blocks' norms and sums,
            :func:`~dpopt.engine.layers.compute_dtype` of the parameters' (float32 for bf16).
    """

    module: nn.Module
    index: dict[str, int]
    shapes: dict[str, torch.Size]
    calls: list[tuple[Tensor, Tensor]]
    stats: list[Optional[tuple[Tensor, Tensor]]]
    batch_size: int
    budget: Budget
    tags: list = field(default_factory=list)
    views: int = 1
    dtype: torch.dtype = torch.float32

    def rows(self, t: Tensor) -> Tensor:
        """``[B, K, ...]`` → ``[B·K, ...]`` (example-major rows) when the calls carry K views, else ``t``."""
        return t.flatten(0, 1) if self.views > 1 else t

    def per_example(self, g: Tensor) -> Tensor:
        """``[B·K, ...]`` per-row gradients → ``[B, ...]``, the sum over each example's K rows."""
        return g.reshape(-1, self.views, *g.shape[1:]).sum(1) if self.views > 1 else g

    def summed_outputs(self, dims: tuple) -> Tensor:
        """Σ of the output gradients over calls, views and ``dims`` of the rows ``[B·K, ...]``, per example:
        a bias's per-example gradient (``dims=(2, 3)`` for a Conv2d: ``[B, q]``)."""
        return self.per_example(sum(self.rows(e).sum(dims, dtype=self.dtype) for _, e in self.calls))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Rule:
    """A registered rule: ``supports(module) -> bool`` and ``blocks(LayerCalls) -> list of blocks``.

    ``forward`` (optional): a *tapped forward* ``forward(module, record, *args, **kwargs)``
    computing exactly what ``module(*args, **kwargs)`` computes while exposing
    the linear maps inside it: for each, ``record(owner, a, out, tag)`` with
    the map's input ``a [B, ...]`` and output ``out [B, ...]`` (examples along
    dim 0), ``owner`` the module whose parameters it uses (the layer or one of
    its children), ``tag`` saying which map it is (passed to the owner's rule
    in :attr:`LayerCalls.tags`). Used for layers whose fused kernels expose no
    intermediate tensor (``nn.MultiheadAttention``, ``nn.LSTM``): both capture
    paths install it (:func:`tap_forwards`) instead of recording the layer's
    own input and output.

    ``chunked``: the rule's blocks cast ``a`` and ``e`` to :attr:`LayerCalls.dtype`
    themselves, per chunk of examples (:class:`~dpopt.engine.layers.LinearPart`,
    :class:`~dpopt.engine.layers.ConvPart`); otherwise the engine casts them whole.
    """

    layer_type: type
    supports: Callable[[nn.Module], bool]
    blocks: Callable[[LayerCalls], list]
    forward: Optional[Callable] = None
    views: str = "split"
    chunked: bool = False


RULES: dict[type, Rule] = {}


def _always(module: nn.Module) -> bool:
    return True


def register_rule(
    *layer_types: type,
    supports: Optional[Callable[[nn.Module], bool]] = None,
    forward: Optional[Callable] = None,
    views: str = "split",
    chunked: bool = False,
):
    """Decorator: register ``fn(layer: LayerCalls) -> list of blocks`` as the fast rule of ``layer_types``.

    Args:
        layer_types: exact module types the rule handles.
        supports: ``supports(module) -> bool`` for options the rule cannot
            handle (default: every instance); an unsupported instance uses the
            reference path.
        forward: a tapped forward (:class:`Rule`), or None: the engine records
            the layer's first input and its output.
        views: how K rows per example (``rows_per_example``,
            :mod:`dpopt.engine.capture`) reach the rule: ``"split"`` (default,
            exact for any rule that sums over its calls): K calls of ``[B, ...]``,
            view v of every example; ``"merge"`` (a rule that sums over every
            axis between dim 0 and its feature axes, as Linear, Embedding,
            LayerNorm): one call of ``[B, K, ...]`` (cheaper for ghost norms).
        chunked: the rule receives ``a`` and ``e`` as recorded and casts them to
            :attr:`LayerCalls.dtype` per chunk (:class:`Rule`); default False: cast whole.

    Raises:
        ValueError: no layer type given, a type that already has a rule, or an unknown ``views``.
    """
    if not layer_types:
        raise ValueError("register_rule needs at least one layer type")
    if views not in ("split", "merge"):
        raise ValueError(f"views must be 'split' or 'merge', got {views!r}")

    def decorate(fn: Callable[[LayerCalls], list]) -> Callable[[LayerCalls], list]:
        for t in layer_types:
            if t in RULES:
                raise ValueError(f"{t.__name__} already has a fast rule ({RULES[t].blocks.__name__})")
            RULES[t] = Rule(t, supports or _always, fn, forward, views, chunked)
        return fn

    return decorate


def is_tapped(module: nn.Module) -> bool:
    """True if ``module``'s calls are recorded by its rule's tapped forward, not by a forward hook."""
    rule = rule_for(module)
    return rule is not None and rule.forward is not None


def tap_forwards(model: nn.Module, record: Callable, modules: Optional[list] = None) -> Callable[[], None]:
    """Install the tapped forward of every supported tapped layer of ``model``; returns the undo function.

    Each such module gets an instance attribute ``forward`` (what
    ``nn.Module.__call__`` runs) calling ``rule.forward(module, record, ...)``;
    the undo function restores what was there before. ``record(owner, a, out,
    tag)`` receives every tapped call (the capture path decides which owners
    it keeps). ``modules``: the tapped modules if already known (a plan's:
    no walk of the model).
    """
    saved = []
    for m in model.modules() if modules is None else modules:
        if is_tapped(m):
            saved.append((m, m.__dict__.get("forward")))
            m.forward = partial(RULES[type(m)].forward, m, record)  # type: ignore[arg-type, misc]

    def undo() -> None:
        for m, prev in saved:
            if prev is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = prev

    return undo


LAZY_RULES: dict[str, Callable[[], None]] = {}
"""Module-name prefix -> a function registering the rules of that package's layers on first sight
(:mod:`dpopt.engine.hf_rules` adds ``"transformers."``: the package is imported only when a model uses it)."""


def rule_for(module: nn.Module) -> Optional[Rule]:
    """The rule of ``module``'s exact type if it supports this instance, else None (reference path).

    The rules of Hugging Face ``transformers`` layers (:mod:`dpopt.engine.hf_rules`:
    ``Conv1D``, ``LlamaRMSNorm``, ...) are registered (:data:`LAZY_RULES`) the first
    time a module of that package is seen, so that dpopt never imports
    ``transformers`` itself.
    """
    t = type(module)
    if t not in RULES:
        for prefix, register in LAZY_RULES.items():
            if t.__module__.startswith(prefix):
                register()  # idempotent (a registry restored by a test loses them)
    rule = RULES.get(t)
    return rule if rule is not None and rule.supports(module) else None


# --------------------------------------------------------------------------- factored weights
def linear_bias_sums(layer: LayerCalls) -> Tensor:
    """A linear map's per-example bias gradient Σ_t e_it summed over the calls, ``[B, q]`` in :attr:`LayerCalls.dtype`.

    One call with T = 1 (every MLP layer): the recorded rows themselves, a view of ``e`` when it is in that dtype
    (no copy: nothing writes into a block's per-example gradients, :class:`~dpopt.engine.layers.DirectBlock`);
    with several calls the first term is a copy, since the later ones are added into it in place.
    """
    b = layer.batch_size
    total: Optional[Tensor] = None
    one = len(layer.calls) == 1
    for _, e in layer.calls:
        q = e.shape[-1]
        if e.numel() == b * q:  # one position per example (T = 1): Σ_t is the row itself (no reduction pass)
            part = e.reshape(b, q).to(layer.dtype, copy=not one)
        else:
            part = e.reshape(b, -1, q).sum(1, dtype=layer.dtype)
        total = part if total is None else total.add_(part)  # the calls in order, as sum() added them
    if total is None:
        raise ValueError("a linear layer with no recorded call has no per-example bias gradient")
    return total


@register_rule(nn.Linear, views="merge", chunked=True)
def _linear(layer: LayerCalls) -> list:
    b, calls, dt = layer.batch_size, layer.calls, layer.dtype
    parts = [LinearPart(a, e, dt) for a, e in calls]
    blocks: list = []
    if "weight" in layer.index:
        blocks.append(FactoredBlock(layer.index["weight"], layer.shapes["weight"], parts, layer.budget, b))
    if "bias" in layer.index:
        # one call with T = 1 (every MLP layer): the bias's flat norms are the ‖e_i‖² the weight's closed form
        # computes anyway (LinearPart.sq64), shared; otherwise its norms come from the summed rows.
        shared = len(parts) == 1 and parts[0].T == 1 and b > 0
        flat = [parts[0].bias_sq_norms] if shared else None
        blocks.append(DirectBlock([layer.index["bias"]], [linear_bias_sums(layer)], flat))
    return blocks


@register_rule(nn.Conv2d, supports=lambda m: m.groups == 1, views="merge", chunked=True)  # type: ignore[arg-type, return-value]
def _conv2d(layer: LayerCalls) -> list:
    b, calls, m, blocks = layer.batch_size, layer.calls, layer.module, []
    if "weight" in layer.index:
        blocks.append(
            FactoredBlock(
                layer.index["weight"],
                layer.shapes["weight"],
                [ConvPart(m, layer.rows(a), layer.rows(e), layer.views, layer.dtype) for a, e in calls],
                layer.budget,
                b,
            )
        )
    if "bias" in layer.index:
        blocks.append(DirectBlock([layer.index["bias"]], [layer.summed_outputs((2, 3))]))  # type: ignore[arg-type]
    return blocks


# --------------------------------------------------------------------------- sparse rows
@register_rule(nn.Embedding, supports=lambda m: m.max_norm is None and not m.scale_grad_by_freq, views="merge")
def _embedding(layer: LayerCalls) -> list:
    m = layer.module
    return [
        SparseRowsBlock(
            cast(int, layer.index.get("weight")),
            cast(int, m.num_embeddings),
            cast(Optional[int], m.padding_idx),
            layer.calls,
            layer.batch_size,
        )
    ]


# --------------------------------------------------------------------------- norm layers (direct)
def _affine_blocks(layer: LayerCalls, grads: list[tuple[Tensor, Tensor]]) -> list:
    """DirectBlocks of a norm layer's (weight, bias) from per-call per-sample gradients."""
    blocks = []
    if "weight" in layer.index:
        blocks.append(DirectBlock([layer.index["weight"]], [sum(g[0] for g in grads)]))  # type: ignore[list-item]
    if "bias" in layer.index:
        blocks.append(DirectBlock([layer.index["bias"]], [sum(g[1] for g in grads)]))  # type: ignore[list-item]
    return blocks


@register_rule(nn.GroupNorm, views="merge")
def _group_norm(layer: LayerCalls) -> list:
    m = layer.module
    return _affine_blocks(
        layer,
        [
            group_norm_grads(a, e, m.num_groups, m.eps, st, layer.views)  # type: ignore[arg-type]
            for (a, e), st in zip(layer.calls, layer.stats)
        ],
    )


@register_rule(nn.LayerNorm, views="merge")
def _layer_norm(layer: LayerCalls) -> list:
    m = layer.module
    return _affine_blocks(
        layer,
        [
            layer_norm_grads(a, e, m.normalized_shape, m.eps, st)  # type: ignore[arg-type]
            for (a, e), st in zip(layer.calls, layer.stats)
        ],
    )


@register_rule(nn.RMSNorm, views="merge")
def _rms_norm(layer: LayerCalls) -> list:
    m = layer.module
    if "weight" not in layer.index:
        return []
    return [
        DirectBlock(
            [layer.index["weight"]],
            [
                sum(
                    rms_norm_grads(a, e, m.normalized_shape, m.eps)  # type: ignore[arg-type, list-item, misc]
                    for a, e in layer.calls
                )
            ],
        )
    ]
