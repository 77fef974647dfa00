"""Input checks shared by both per-sample engines: the example axis of a batch.

``x``'s examples lie along ``batch_dim`` (default 0, the documented
convention); the targets ``y`` always have the examples along dim 0, and
``x.shape[batch_dim]`` must equal ``y.shape[0]`` (never a silent cut).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

__all__ = ["LossFn", "LossShapeError", "check_inputs", "buffers_unchanged", "example_loss", "snapshot_buffers",
           "changed_buffers", "restore_buffers", "check_buffers"]

LossFn = Callable[[Tensor, Tensor], Tensor]
"""``loss_fn(out_i, target[1, ...]) -> scalar``: the loss of one example (its model output and target)."""


def check_inputs(x: Tensor, y: Tensor, batch_dim: int = 0) -> int:
    """Validate a batch and return ``batch_dim`` as a non-negative axis of ``x``.

    Args:
        x: inputs, a tensor with the examples along ``batch_dim``.
        y: targets, a tensor with the examples along dim 0.
        batch_dim: x's example axis (negative values count from the end).

    Raises:
        ValueError: x is a ``PackedSequence`` or not a tensor; ``batch_dim`` is
            not an axis of x; or x's example axis and y's dim 0 differ in length
            (never a silent cut).
    """
    if isinstance(x, PackedSequence):
        raise ValueError("PackedSequence inputs are not supported: pass the padded tensor (examples along "
                         "batch_dim, e.g. [B, T, ...]) and call pack_padded_sequence inside the model's "
                         "forward, with the lengths derived from the padded tensor (each example is then "
                         "packed alone by the per-example path)")
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        raise ValueError(f"x and y must be tensors, got {type(x).__name__} and {type(y).__name__}")
    if x.dim() == 0 or y.dim() == 0:
        raise ValueError("x and y need an example axis (got a 0-dim tensor)")
    if not -x.dim() <= batch_dim < x.dim():
        raise ValueError(f"batch_dim={batch_dim} is not an axis of x with shape {tuple(x.shape)}")
    bd = batch_dim % x.dim()
    if x.shape[bd] != y.shape[0]:
        raise ValueError(f"x has {x.shape[bd]} examples along batch_dim={batch_dim} (shape {tuple(x.shape)}) but "
                         f"y has {y.shape[0]} along dim 0 (shape {tuple(y.shape)}); pass batch_dim= for inputs "
                         "whose examples are not along dim 0 (e.g. batch_dim=1 for sequence-first [T, B, ...])")
    return bd


@contextmanager
def buffers_unchanged(model: nn.Module, reuse: Optional[dict] = None) -> Iterator[dict]:
    """Refuse a forward pass that changes a buffer of ``model`` (running statistics, counters).

    A buffer updated while private examples pass through the model holds an
    un-noised function of them (InstanceNorm's ``running_mean``, a custom
    ``self.seen += x.sum(0)``); it would be released with ``model.pt`` and
    would shape every later output. Detected by identity and version counter
    of every buffer before and after the block; before raising, every buffer
    is restored to its value before the block (a copy is kept, so a caller
    who catches the error and saves the model publishes nothing new).

    Yields the snapshot; pass it back as ``reuse`` next time so that unchanged
    buffers are not copied again (:func:`snapshot_buffers`).

    Raises:
        ValueError: naming the changed buffers and the fix.
    """
    before = snapshot_buffers(model, reuse)
    try:
        yield before
    except BaseException:
        if changed_buffers(model, before):  # an error inside the block: still leave nothing behind
            restore_buffers(model, before)
        raise
    check_buffers(model, before)


def check_buffers(model: nn.Module, before: dict) -> None:
    """Raise (after restoring them) if any buffer changed since :func:`snapshot_buffers`.

    Raises:
        ValueError: naming the changed buffers and the fix.
    """
    changed = changed_buffers(model, before)
    if changed:
        restore_buffers(model, before)
        raise ValueError(f"the model's forward pass changed its buffers {changed} while computing per-sample "
                         "gradients of private examples: their new values are un-noised statistics of the "
                         "private batch and would be released with the model. Use layers without tracked "
                         "statistics (e.g. InstanceNorm with track_running_stats=False, GroupNorm) and keep "
                         "buffers constant during training")


class LossShapeError(ValueError):
    """``loss_fn`` returned more than one number for a single example."""


def example_loss(loss: Tensor) -> Tensor:
    """The loss of one example as a 0-dim tensor (a 1-element result, e.g. ``reduction="none"``, is accepted).

    Raises:
        LossShapeError: (a ValueError) ``loss_fn`` returned more than one number for one example.
    """
    if loss.dim() == 0:
        return loss
    if loss.numel() == 1:
        return loss.reshape(())
    raise LossShapeError(f"loss_fn must return one number per example, got a tensor of shape {tuple(loss.shape)} "
                     "for a single example; reduce it (e.g. reduction='mean' or 'sum', or .sum() over tokens)")


def snapshot_buffers(model: nn.Module, reuse: Optional[dict] = None) -> dict:
    """``{name: (buffer, version, copy of its value)}`` for :func:`changed_buffers` / :func:`restore_buffers`.

    An entry of ``reuse`` (an earlier snapshot) whose buffer is the same object
    at the same version is kept as it is: its copy still holds the value, and
    the per-step engine then copies no buffer at all once they are known.
    """
    reuse = reuse or {}
    out = {}
    for name, buf in model.named_buffers():
        old = reuse.get(name)
        same = old is not None and old[0] is buf and old[1] == buf._version
        out[name] = old if same else (buf, buf._version, buf.detach().clone())
    return out


def restore_buffers(model: nn.Module, before: dict) -> None:
    """Put back every buffer recorded in ``before`` (object and value); drop buffers added since."""
    for name, _ in list(model.named_buffers()):
        if name not in before:
            owner, _, attr = name.rpartition(".")
            mod = model.get_submodule(owner) if owner else model
            del mod._buffers[attr]
    for name, (buf, _, value) in before.items():
        owner, _, attr = name.rpartition(".")
        mod = model.get_submodule(owner) if owner else model
        with torch.no_grad():
            buf.copy_(value)
        mod._buffers[attr] = buf


def changed_buffers(model: nn.Module, before: dict) -> list[str]:
    """Names of buffers added, removed, rebound or modified in place since ``before``."""
    after = dict(model.named_buffers())
    return sorted(name for name in set(before) | set(after)
                  if name not in before or name not in after or after[name] is not before[name][0]
                  or after[name]._version != before[name][1])
