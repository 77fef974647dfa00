"""``validate(model)`` / ``fix(model)``: what the per-sample engines cannot train privately, and the fix.

Opacus's ``ModuleValidator`` in dpopt. :func:`validate` lists every problem
(:func:`dpopt.models.check_model` raises on the first one, and keeps doing so:
training refuses such a model); :func:`fix` replaces what has a standard
replacement and returns the model:

========================================  =======================================  ==========================
layer                                     why it is refused                        ``fix``
========================================  =======================================  ==========================
BatchNorm1d/2d/3d, SyncBatchNorm          mixes the examples of a batch; running   ``nn.GroupNorm`` (below)
                                          statistics are un-noised releases
InstanceNorm with track_running_stats     running statistics are un-noised         ``track_running_stats=False``
                                          releases of private batches              (buffers removed)
Embedding/EmbeddingBag with max_norm      renormalises released rows in place      ``max_norm=None``
                                          depending on private tokens
Embedding/EmbeddingBag with sparse=True   sparse gradients unsupported             ``sparse=False``
========================================  =======================================  ==========================

GroupNorm replacement: for BatchNorm2d/3d over C channels (spatial inputs),
``num_groups = gcd(32, C)`` (as Opacus's ``_batchnorm_to_groupnorm``: the
largest divisor of C that divides 32). For BatchNorm1d, ``num_groups = 1``:
its input may be plain features ``[B, C]``, where a group of one feature has
no spread and would normalise every input to the same output (with 1 group it
normalises over all C features, like LayerNorm). ``eps`` and ``affine`` kept,
weights freshly initialised (γ = 1, β = 0: the BatchNorm's running statistics
are dropped, never copied).
"""

from __future__ import annotations

import math

from torch import nn

__all__ = ["validate", "fix", "groupnorm_groups"]

_BATCHNORM = nn.modules.batchnorm._BatchNorm
_INSTANCENORM = nn.modules.instancenorm._InstanceNorm


def groupnorm_groups(channels: int, max_groups: int = 32, spatial: bool = True) -> int:
    """Number of GroupNorm groups replacing a BatchNorm over ``channels``.

    gcd(max_groups, channels) for spatial inputs (BatchNorm2d/3d); 1 otherwise
    (BatchNorm1d, whose input may be plain features: module docstring).
    """
    return math.gcd(int(max_groups), int(channels)) if spatial else 1


def _groups_for(m: nn.Module) -> int:
    return groupnorm_groups(m.num_features, spatial=not isinstance(m, nn.BatchNorm1d))  # type: ignore[arg-type]


def validate(model: nn.Module) -> list[str]:
    """Every layer of ``model`` that dpopt's engines refuse, with the reason and the fix (empty: valid).

    Static properties only (as :func:`~dpopt.models.check_model`); what depends
    on the forward pass — examples along dim 0, buffers changed by the forward,
    examples mixed — is checked by the engines on the first batch.
    """
    problems = []
    for name, m in model.named_modules():
        where = f"{name or '<root>'} ({type(m).__name__})"
        if isinstance(m, _BATCHNORM):
            problems.append(
                f"{where}: batch normalisation mixes the examples of a batch; fix() replaces it with "
                f"GroupNorm({_groups_for(m)}, {m.num_features})"
            )
        if isinstance(m, _INSTANCENORM) and m.track_running_stats:
            problems.append(
                f"{where}: track_running_stats=True keeps un-noised statistics of private batches; "
                "fix() sets track_running_stats=False"
            )
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            if m.max_norm is not None:
                problems.append(
                    f"{where}: max_norm={m.max_norm} renormalises released rows in place depending on "
                    "private tokens; fix() sets max_norm=None"
                )
            if m.sparse:
                problems.append(f"{where}: sparse=True gradients are not supported; fix() sets sparse=False")
    return problems


def _replace(m: nn.Module) -> nn.Module:
    if isinstance(m, _BATCHNORM):
        return nn.GroupNorm(_groups_for(m), m.num_features, eps=m.eps, affine=m.affine)
    if isinstance(m, _INSTANCENORM) and m.track_running_stats:
        m.track_running_stats = False
        for buf in ("running_mean", "running_var", "num_batches_tracked"):
            if buf in m._buffers:
                del m._buffers[buf]
                setattr(m, buf, None)
    if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
        m.max_norm = None
        m.sparse = False
    return m


def fix(model: nn.Module) -> nn.Module:
    """Return ``model`` with every fixable problem of :func:`validate` fixed (in place; the root may be replaced).

    Raises:
        ValueError: a problem remains after fixing (none known today).
    """
    model = _replace(model)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            new = _replace(child)
            if new is not child:
                setattr(parent, child_name, new)
    left = validate(model)
    if left:
        raise ValueError(f"fix() could not fix: {left}")
    return model
