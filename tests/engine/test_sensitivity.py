"""Sensitivity holds on any model: with σ = 0, removing one example moves the clipped sum by ≤ C.

Clipping is done through the source interface exactly as the Privatizer does
(flat geometry, one group): c_i = min(1, C/‖g_i‖) from ``sq_norms``, then
``weighted_sum(c)``. For each model kind (including broadcast position ids and
sequence-first inputs, where the fast engine once moved the sum by 1.7·C) and
both engines, every neighbour D − {j} of a batch D with B = T (a batch size
that collides with a model dimension) is checked.
"""

from __future__ import annotations

import pytest
import torch
from per_example_zoo import CASES, ce, make

from dpopt.engine import iter_per_sample_sources
from dpopt.types import ClipGeometry

T = B = 5
KINDS = [
    "tok-pos",
    "seq-first",
    "transpose-inside",
    "time-distributed",
    "gru",
    "shared",
    "conv-groupnorm",
    "mixes-examples",
]


def clipped_sum(model, x, y, engine, batch_dim, c):
    """Σ_i min(1, C/‖g_i‖) g_i as one flat vector, and the per-example norms."""
    src = next(iter(iter_per_sample_sources(model, ce, x, y, engine=engine, batch_dim=batch_dim)))
    n = src.num_params
    geo = ClipGeometry()
    norms = src.sq_norms(geo, [0] * n, 1)[:, 0].sqrt()
    w = torch.clamp(c / norms, max=1.0).unsqueeze(1)
    return torch.cat([s.flatten() for s in src.weighted_sum(w, geo, [0] * n)]), norms


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("engine", ["fast", "reference"])
@pytest.mark.parametrize("name", KINDS)
def test_removing_one_example_moves_the_clipped_sum_by_at_most_c(name, engine):
    case = CASES[name]
    model, x, y = make(case, B, T)
    _, norms = clipped_sum(model, x, y, "reference", case.batch_dim, 1.0)
    c = 0.5 * float(norms.median())  # most examples are clipped
    full, _ = clipped_sum(model, x, y, engine, case.batch_dim, c)
    for j in range(B):
        keep = torch.tensor([i for i in range(B) if i != j])
        xj = x.index_select(case.batch_dim, keep)
        part, _ = clipped_sum(model, xj, y[keep], engine, case.batch_dim, c)
        assert float((full - part).norm()) <= c * (1 + 1e-5), f"{name}/{engine}: example {j}"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_first_batch_of_one_example_does_not_verify_a_mixing_model():
    """Review finding: a first Poisson batch of ONE example, tiled to the check's sizes, made a forward
    that mixes examples look per-example, and the model stayed on the fast path for good. With one
    example the check now waits for a batch of ≥ 2; the next batches are then exact and bounded."""
    case = CASES["mixes-examples"]
    model, x, y = make(case, B, T)
    list(iter_per_sample_sources(model, ce, x[:1], y[:1]))  # the first batch: one example
    _, norms = clipped_sum(model, x, y, "reference", case.batch_dim, 1.0)
    c = 0.5 * float(norms.median())
    full, fast_norms = clipped_sum(model, x, y, "fast", case.batch_dim, c)
    torch.testing.assert_close(fast_norms, norms, rtol=1e-6, atol=1e-9)
    for j in range(B):
        keep = torch.tensor([i for i in range(B) if i != j])
        part, _ = clipped_sum(model, x[keep], y[keep], "fast", case.batch_dim, c)
        assert float((full - part).norm()) <= c * (1 + 1e-5), f"example {j}"
