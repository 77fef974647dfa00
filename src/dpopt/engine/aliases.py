"""Parameters registered on two modules, one inside the other (aliases): owned by the inner module only.

Opacus's ``DPLSTM`` (``RenameParamsMixin``) registers each of its
``RNNLinear`` children's parameters again on itself under the names of
``nn.LSTM`` (``weight_ih_l0`` is ``l0.ih.weight``: the same tensor, compared by
identity). The inner module is the one whose forward uses it; the outer
registration is a second name. Counting both as owners would give the
parameter a second vjp (the outer module's whole call) and double its
per-example gradient. The capture's plan (:class:`~dpopt.engine.capture.Plan`)
reads each module's parameters through :func:`owned`, which drops such
aliases. A parameter used by the outer module's own code as well is then
missed by the capture, and the first-batch check against single-example
autograd refuses the model (tested).

Tied parameters of modules that are not nested (a language model's input
embedding and output projection) are not aliases: every owner keeps it
(:mod:`dpopt.engine.tied`).
"""

from __future__ import annotations

from torch import nn

__all__ = ["alias_names", "owned"]


def alias_names(model: nn.Module) -> dict[nn.Module, set[str]]:
    """Module → attributes of its ``_parameters`` that are (by identity) a parameter of one of its descendants.

    Args:
        model: the root module.

    Returns:
        only modules with at least one alias.
    """
    out: dict[nn.Module, set[str]] = {}
    for m in model.modules():
        if not any(p is not None for p in m._parameters.values()):
            continue
        inner = {id(p) for c in m.children() for _, p in c.named_parameters(remove_duplicate=False)}
        names = {a for a, p in m._parameters.items() if p is not None and id(p) in inner}
        if names:
            out[m] = names
    return out


def owned(module: nn.Module, aliases: dict[nn.Module, set[str]]) -> dict[str, nn.Parameter]:
    """``module``'s own parameters (attribute → parameter), without None entries and without its aliases."""
    drop = aliases.get(module, set())
    return {a: p for a, p in module._parameters.items() if p is not None and a not in drop}
