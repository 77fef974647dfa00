"""Bare ``nn.Parameter``s used in a module's ``forward`` and broadcast over the batch (ViT's class token).

HF ViT's embeddings own ``cls_token [1, 1, D]`` and ``position_embeddings
[1, N + 1, D]`` and use them directly in ``forward``::

    cls_tokens = self.cls_token.expand(batch_size, -1, -1)        # [B, 1, D]
    embeddings = torch.cat((cls_tokens, embeddings), dim=1)
    embeddings = embeddings + self.position_embeddings            # broadcast add

No layer rule sees these uses, and autograd sums their gradients over the
batch. While the owning module's ``forward`` runs, a ``TorchFunctionMode``
(:class:`_Tap`) watches every torch function that receives such a
parameter P (leading dimension 1, owned by one module without a rule) and
records the result R of the recognised patterns, whose gradient is per
example:

* ``P.expand(B, ...)`` — R = P broadcast along dim 0 (then ``cat`` or
  anything: R's gradient row i is example i's);
* ``X + P`` / ``P + X`` / ``torch.add(X, P)`` with R ``[B, ...]`` and P
  broadcast to it.

Example i's gradient of P is then R's output gradient row i summed over the
dimensions P was broadcast along (:func:`reduce_to`): exact, no loop over
examples. Any other use of P (slicing, ``repeat``, interpolation, a use
outside the owner's ``forward``) is not recognised: the parameter stays on
the per-example path (``dpopt train``), and the first-batch check
(:mod:`dpopt.engine.check`) compares the result with single-example
autograd either way.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["bare_candidates", "reduce_to", "tap_bare"]

_ADD = ("add", "__add__", "__radd__")


def bare_candidates(model: nn.Module, index: dict, ruled) -> dict:
    """Module → {attribute: parameter index} of the bare broadcast parameters the taps may capture.

    Args:
        model: the model; index: ``id(param)`` → trainable-parameter index.
        ruled: ``ruled(module) -> bool``: the module has a fast rule.

    A candidate is trainable, has dim ≥ 1 with size 1 along dim 0, and is
    owned by exactly one module, which has no rule.
    """
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    out: dict = {}
    for m in model.modules():
        if ruled(m):
            continue
        own = {
            a: index[id(p)]
            for a, p in m._parameters.items()
            if p is not None and id(p) in index and owners[id(p)] == 1 and p.dim() >= 1 and p.shape[0] == 1
        }
        if own:
            out[m] = own
    return out


def reduce_to(e: Tensor, out_shape, p_shape) -> Tensor:
    """Per-example gradients ``[b, *p_shape]`` of P from the gradient ``e [b, ...]`` of R = broadcast(P).

    Sums over the dimensions of R that P was broadcast along (right-aligned,
    as torch broadcasting).
    """
    b = e.shape[0]
    pp = (1,) * (len(out_shape) - len(p_shape)) + tuple(p_shape)
    dims = tuple(j for j in range(1, len(out_shape)) if pp[j] == 1 and out_shape[j] != 1)
    g = e.sum(dims, keepdim=True) if dims else e
    return g.reshape(b, *p_shape)


class _Tap(TorchFunctionMode):
    """Record the per-example results R of recognised uses of the watched parameters (module docstring)."""

    def __init__(self, module: nn.Module, params: dict, b: int, on_use: Callable, on_other: Optional[Callable]):
        super().__init__()
        self.module, self.params, self.b, self.on_use = module, params, int(b), on_use  # id(P) -> (index, P)
        self.on_other = on_other

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        hits = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and id(t) in self.params]
        if not hits or not isinstance(out, Tensor) or not out.requires_grad:
            return out  # shape queries and the like
        i, p = self.params[id(hits[0])]
        if self._recognised(func, args, kwargs, hits, p, out):
            self.on_use(self.module, i, out)
        elif self.on_other is not None:
            for t in hits:
                self.on_other(self.module, self.params[id(t)][0], getattr(func, "__name__", str(func)))
        return out

    def _recognised(self, func, args, kwargs, hits, p, out) -> bool:
        name = getattr(func, "__name__", "")
        if len(hits) != 1 or out.dim() == 0 or out.shape[0] != self.b or self.b < 1:
            return False
        if name == "expand":
            return args[0] is p and out.dim() == p.dim()
        if name in _ADD:
            return len(args) == 2 and not kwargs and p.dim() <= out.dim()
        return False


def tap_bare(
    owners: dict, batch_size: Callable[[], int], on_use: Callable, on_other: Optional[Callable] = None
) -> list:
    """Hooks that run each owner's ``forward`` under a :class:`_Tap` of its bare parameters; returns the handles.

    Args:
        owners: module → {attribute: index} (:func:`bare_candidates`).
        batch_size: ``() -> int``, the batch size of the current pass (≤ 0: nothing is tapped).
        on_use: ``on_use(module, index, R)`` for every recognised use.
        on_other: ``on_other(module, index, op_name)`` for every other use that
            produces a tensor requiring gradients (the parameter then needs the
            per-example path).

    The watched tensors are read when the owner's ``forward`` starts (under
    ``functional_call`` they are the substituted ones).
    """
    handles = []
    for m, own in owners.items():
        modes: list = []

        def pre(module, args, own=own, modes=modes):
            b = batch_size()
            if b <= 0 or not torch.is_grad_enabled():
                return
            params = {}
            for a, i in own.items():
                t = getattr(module, a)
                if isinstance(t, Tensor):
                    params[id(t)] = (i, t)
            mode = _Tap(module, params, b, on_use, on_other)
            modes.append(mode)
            mode.__enter__()

        def post(module, args, out, modes=modes):
            if modes:
                modes.pop().__exit__(None, None, None)

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, always_call=True))
    return handles
