"""Helper shared by the recipe tests (not a test module): per-example gradients read back from a source.

``one_hot_grads(src)``: the source's weighted sums with one-hot weights e_i (flat geometry, unit
scale), i.e. example i's gradient, stacked over the batch: one tensor per parameter, shape
``(batch_size, *param.shape)``. Recovers what the Privatizer would clip, through the
same ``sq_norms`` / ``weighted_sum`` calls, so tests compare it with ``torch.func`` single-example autograd.
"""

from __future__ import annotations

import torch

from dpopt.types import ClipGeometry


def one_hot_grads(src, dtype=None):
    """Per-example gradients of ``src`` (a per-sample source), one ``(B, *shape)`` tensor per parameter.

    ``dtype``: of the one-hot weights; default ``src.dtype`` (sources without that attribute, e.g. the
    reference engine's ``PerSampleGrads``, need it given).
    """
    b, n = src.batch_size, src.num_params
    src.sq_norms(ClipGeometry(), [0] * n, 1)
    rows = []
    for i in range(b):
        w = torch.zeros(b, 1, dtype=src.dtype if dtype is None else dtype)
        w[i] = 1
        rows.append([t.clone() for t in src.weighted_sum(w, ClipGeometry(), [0] * n)])
    return [torch.stack([r[k] for r in rows]) for k in range(n)]
