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

__all__ = [
    "LossFn",
    "LossShapeError",
    "check_inputs",
    "buffers_unchanged",
    "example_loss",
    "snapshot_buffers",
    "changed_buffers",
    "restore_buffers",
    "check_buffers",
    "preserved_state",
    "BufferWrite",
    "guarded_buffers",
]

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
        raise ValueError(
            "PackedSequence inputs are not supported: pass the padded tensor (examples along "
            "batch_dim, e.g. [B, T, ...]) and call pack_padded_sequence inside the model's "
            "forward, with the lengths derived from the padded tensor (each example is then "
            "packed alone by the per-example path)"
        )
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        raise ValueError(f"x and y must be tensors, got {type(x).__name__} and {type(y).__name__}")
    if x.dim() == 0 or y.dim() == 0:
        raise ValueError("x and y need an example axis (got a 0-dim tensor)")
    if not -x.dim() <= batch_dim < x.dim():
        raise ValueError(f"batch_dim={batch_dim} is not an axis of x with shape {tuple(x.shape)}")
    bd = batch_dim % x.dim()
    if x.shape[bd] != y.shape[0]:
        raise ValueError(
            f"x has {x.shape[bd]} examples along batch_dim={batch_dim} (shape {tuple(x.shape)}) but "
            f"y has {y.shape[0]} along dim 0 (shape {tuple(y.shape)}); pass batch_dim= for inputs "
            "whose examples are not along dim 0 (e.g. batch_dim=1 for sequence-first [T, B, ...])"
        )
    return bd


@contextmanager
def buffers_unchanged(model: nn.Module, reuse: Optional[dict] = None) -> Iterator[dict]:
    """Refuse a forward pass that changes a buffer of ``model`` (running statistics, counters).

    A buffer updated while private examples pass through the model holds an
    un-noised function of them (InstanceNorm's ``running_mean``, a custom
    ``self.seen += x.sum(0)``); it would be released with ``model.pt`` and
    would shape every later output. Detected by value (:func:`changed_buffers`:
    identity, storage pointer and values of every buffer before and after the
    block, so ``buf.data = ...``, ``buf.data.mul_(...)`` and writes from
    backward hooks are seen, not only ops that bump the version counter);
    before raising, every buffer
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


class BufferWrite(ValueError):
    """The model's forward (or backward) wrote a buffer while private examples passed through it."""


class _GuardedBuffer(Tensor):
    """An alias of a buffer (same storage) whose ``.data`` cannot be rebound (:func:`guarded_buffers`)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # ops see a plain tensor, return plain tensors

    @property
    def data(self):  # noqa: D401 — the tensor's data, as for any tensor
        return Tensor.data.__get__(self)

    @data.setter
    def data(self, value):
        raise BufferWrite(
            "the model's forward pass rebinds a buffer (buf.data = ...) while computing per-sample "
            "gradients of private examples: its new value would be an un-noised statistic of the "
            "private batch, released with the model. Keep buffers constant during training (an "
            "EMA/codebook update belongs in parameters trained privately, or outside the private "
            "forward)"
        )


def guarded_buffers(module: nn.Module) -> dict:
    """``{name: alias}`` of ``module``'s buffers for ``functional_call`` under ``torch.func`` transforms.

    Each alias shares its buffer's storage (an in-place write is still a
    write to the buffer, seen by :func:`changed_buffers`), but assigning its
    ``.data`` raises :class:`BufferWrite`: under ``vmap`` such an assignment
    would put a batched tensor into a plain one (a later use crashes the
    process), and outside it would hide the write from the buffer check.
    """
    return {k: Tensor._make_subclass(_GuardedBuffer, b.detach(), False) for k, b in module.named_buffers()}


def check_buffers(model: nn.Module, before: dict) -> None:
    """Raise (after restoring them) if any buffer changed since :func:`snapshot_buffers`.

    Raises:
        BufferWrite: (a ValueError) naming the changed buffers and the fix.
    """
    changed = changed_buffers(model, before)
    if changed:
        restore_buffers(model, before)
        raise BufferWrite(
            f"the model's forward pass changed its buffers {changed} while computing per-sample "
            "gradients of private examples (compared by value: writes through buf.data and from "
            "backward hooks count): their new values are un-noised statistics of the "
            "private batch and would be released with the model; they were restored. Use layers "
            "without tracked statistics (e.g. InstanceNorm with track_running_stats=False, "
            "GroupNorm) and keep buffers constant during training (an EMA/codebook update belongs "
            "in parameters trained privately, or outside the private forward)"
        )


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
    raise LossShapeError(
        f"loss_fn must return one number per example, got a tensor of shape {tuple(loss.shape)} "
        "for a single example; reduce it (e.g. reduction='mean' or 'sum', or .sum() over tokens)"
    )


def _same_values(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` hold the same values (shape, dtype, and elements; NaN equals NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def snapshot_buffers(model: nn.Module, reuse: Optional[dict] = None) -> dict:
    """``{name: (buffer, version, copy of its value, storage pointer)}`` for :func:`changed_buffers` / :func:`restore_buffers`.

    An entry of ``reuse`` (an earlier snapshot) whose buffer is the same
    object, on the same storage, at the same version and with the same values
    as its copy is kept as it is (no new copy: the per-step engine then copies
    no buffer at all once they are known); any other buffer is copied now.
    Values are compared, not only version counters: a write through
    ``buf.data`` leaves the version counter of ``buf`` unchanged.
    """
    reuse = reuse or {}
    out = {}
    for name, buf in model.named_buffers():
        old = reuse.get(name)
        same = (
            old is not None
            and len(old) == 4
            and old[0] is buf
            and old[1] == buf._version
            and old[3] == buf.data_ptr()
            and _same_values(buf.detach(), old[2])
        )
        out[name] = old if same else (buf, buf._version, buf.detach().clone(), buf.data_ptr())
    return out


def restore_buffers(model: nn.Module, before: dict) -> None:
    """Put back every buffer recorded in ``before`` (object, storage and value); drop buffers added since.

    A buffer whose data was rebound (``buf.data = t``) or reshaped gets a
    fresh copy of its recorded value as its data (``buf.data = copy``); any
    other is overwritten in place.
    """
    for name, _ in list(model.named_buffers()):
        if name not in before:
            owner, _, attr = name.rpartition(".")
            mod = model.get_submodule(owner) if owner else model
            del mod._buffers[attr]
    for name, entry in before.items():
        buf, value = entry[0], entry[2]
        owner, _, attr = name.rpartition(".")
        mod = model.get_submodule(owner) if owner else model
        with torch.no_grad():
            if (len(entry) > 3 and buf.data_ptr() != entry[3]) or buf.shape != value.shape or buf.dtype != value.dtype:
                buf.data = value.clone()
            else:
                buf.copy_(value)
        mod._buffers[attr] = buf


def changed_buffers(model: nn.Module, before: dict) -> list[str]:
    """Names of buffers added, removed, rebound, moved to other storage or changed in value since ``before``.

    ``before``: a :func:`snapshot_buffers` result. The values are compared
    elementwise with the snapshot's copies (NaN equals NaN), so writes that
    the version counter does not see (``buf.data.mul_(0).add_(x)``,
    ``buf.data = x``, a backward hook) are reported.
    """
    after = dict(model.named_buffers())
    out = []
    for name in set(before) | set(after):
        if name not in before or name not in after:
            out.append(name)
            continue
        buf, entry = after[name], before[name]
        if (
            buf is not entry[0]
            or buf._version != entry[1]
            or (len(entry) > 3 and buf.data_ptr() != entry[3])
            or not _same_values(buf.detach(), entry[2])
        ):
            out.append(name)
    return sorted(out)


@contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Context: ``model``'s buffers (by value) and torch's random number generators restored on exit.

    For the first-batch check's extra passes (the batched verification pass
    and each example alone): whatever they draw or write, the model and the
    generators are left as the user's own forward left them, so a check run
    after the user's step (the hook door) never leaves one record's values in
    ``model.state_dict()`` and never shifts the user's random stream.
    Generators: the CPU one and those of the CUDA devices holding the
    model's parameters or buffers (``torch.random.fork_rng``).

    Raises:
        ValueError: (after restoring them) the passes changed a buffer
            (:func:`check_buffers`: names the buffers and the fix); an error
            raised inside the block is re-raised after the restore.
    """
    devices = sorted(
        {t.device.index or 0 for t in list(model.parameters()) + list(model.buffers()) if t.device.type == "cuda"}
    )
    before = snapshot_buffers(model)
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        except BaseException:
            if changed_buffers(model, before):
                restore_buffers(model, before)
            raise
    check_buffers(model, before)
