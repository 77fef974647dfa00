"""Physical chunks of one collated Poisson batch, and the stand-in for an empty one.

The chunk sizes follow :func:`dpopt.utils.batch_memory_manager._chunks` (the
micro-batch rule of :class:`~dpopt.utils.batch_memory_manager.BatchMemoryManager`:
``ceil(n / max_size)`` contiguous chunks whose sizes differ by at most one); the
Trainer hands them to the PrivateOptimizer's skip-step protocol, so all of
them make ONE release.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from ..users import user_cuts
from ..utils.batch_memory_manager import _chunks

__all__ = ["split_batch", "split_by_user", "batch_size", "stand_in"]


def batch_size(inputs: Mapping[str, Any]) -> int:
    """The number of examples of a collated dict batch (dim 0 of its tensors).

    Raises:
        ValueError: a value that is not a tensor, or tensors whose dim 0 differ
            (the batch cannot be split by example).
    """
    sizes = set()
    for k, v in inputs.items():
        if not isinstance(v, Tensor) or v.dim() == 0:
            raise ValueError(
                f"DPTrainer splits each batch by example, but batch[{k!r}] is "
                f"{type(v).__name__} (not a tensor with the example on dim 0): collate to tensors"
            )
        sizes.add(int(v.shape[0]))
    if len(sizes) != 1:
        raise ValueError(f"the batch's tensors disagree on the number of examples (dim 0 sizes {sorted(sizes)})")
    return sizes.pop()


def split_batch(inputs: Mapping[str, Any], max_size: int) -> list[dict]:
    """``inputs`` cut along dim 0 into the BatchMemoryManager's chunks of at most ``max_size`` examples.

    An empty batch is one empty chunk. Raises as :func:`batch_size`; ``max_size`` must be ≥ 1.
    """
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    n = batch_size(inputs)
    out = []
    for idx in _chunks(list(range(n)), max_size) if n else [[]]:
        lo, hi = (idx[0], idx[-1] + 1) if idx else (0, 0)
        out.append({k: v[lo:hi] for k, v in inputs.items()})
    return out


def split_by_user(inputs: Mapping[str, Any], slots: Tensor, max_size: int) -> list[dict]:
    """``inputs`` cut along dim 0 between users only: consecutive whole users, ≤ ``max_size`` rows per
    chunk unless one user alone has more (then that user is a chunk of its own).

    Args:
        inputs: a collated batch whose rows are grouped by user (:class:`dpopt.users.UserDPDataLoader`).
        slots: int64 ``[rows]``, each row's user slot (non-decreasing).
        max_size: the physical batch size ≥ 1.

    Raises:
        ValueError: ``slots`` of another length than the batch, ``max_size`` < 1 (and as :func:`batch_size`).
    """
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    n = batch_size(inputs)
    if n != int(slots.numel()):
        raise ValueError("privacy_unit='user': the batch's rows do not match the user-level loader's last batch")
    if n == 0:
        return [dict(inputs)]
    return [{k: v[a:b] for k, v in inputs.items()} for a, b in user_cuts(slots, max_size)]


def stand_in(empty: Mapping[str, Tensor]) -> dict:
    """One PUBLIC example shaped like an empty batch's rows: zeros, an all-ones attention mask, labels −100.

    Used for an empty Poisson batch on models that cannot run a batch of
    zero examples (GPT-2's attention reshape): its loss is multiplied by 0,
    so its per-example gradient is exactly 0 and the clipped sum — the
    release before noise — is the empty batch's (flat clipping; no count is
    released). It holds no value of any record (only the padded length).
    """
    one = {}
    for k, v in empty.items():
        shape = (1,) + tuple(v.shape[1:])
        if k == "attention_mask":
            one[k] = torch.ones(shape, dtype=v.dtype, device=v.device)
        elif k in ("labels", "label") and v.dim() >= 2:
            one[k] = torch.full(shape, -100, dtype=v.dtype, device=v.device)
        else:
            one[k] = torch.zeros(shape, dtype=v.dtype, device=v.device)
    return one
