"""The float32 shifted closed form (engine/shifted_norm.py) on models whose layers do not all see one
example per row of dim 0, in a DP-MacAdam-like clip geometry (shift m, scale b).

Ground truth: per-example gradients from a loop of single-example autograd calls
(per_example_zoo.loop_grads), evaluated in float64 as ‖(g_i − m)/b‖². The fast
engine must never read a norm below it (beyond float32 rounding of the other
layers' forms) and at most 2·RECHECK_RTOL above; and with σ = 0, removing one
example must move the clipped sum Σ_i c_i (g_i − m)/b by at most C.
"""

from __future__ import annotations

import pytest
import torch
from per_example_zoo import CASES, ce, loop_grads, make

from dpopt.engine import iter_per_sample_sources
from dpopt.engine.shifted_norm import RECHECK_RTOL
from dpopt.types import ClipGeometry

B = T = 5
KINDS = ["tok-pos", "seq-first", "time-distributed", "transpose-inside", "gru", "conv-groupnorm"]


def _float32(model, x):
    return model.float(), (x.float() if x.is_floating_point() else x)


def _geometry(grads, gen):
    """A shift near the mean gradient and a coordinate-wise scale spread over e^±1 (float32, param-shaped)."""
    shift, scale = [], []
    for g in grads:
        mean = g.mean(0)
        rms = float(g.square().mean().sqrt()) or 1.0
        shift.append((mean + 0.1 * rms * torch.randn(mean.shape, generator=gen)).float())
        scale.append((rms * torch.exp(2 * torch.rand(mean.shape, generator=gen) - 1)).float())
    return ClipGeometry(tuple(shift), tuple(scale))


def _source(model, x, y, batch_dim):
    return next(iter(iter_per_sample_sources(model, ce, x, y, engine="fast", batch_dim=batch_dim)))


def _clipped_sum(model, x, y, batch_dim, geo, c):
    src = _source(model, x, y, batch_dim)
    n = src.num_params
    norms = src.sq_norms(geo, [0] * n, 1)[:, 0].sqrt()
    w = torch.clamp(c / norms, max=1.0).unsqueeze(1)
    return torch.cat([s.double().flatten() for s in src.weighted_sum(w, geo, [0] * n)])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", KINDS)
def test_shifted_norms_bound_the_single_example_truth_and_sensitivity_holds(name):
    case = CASES[name]
    model, x, y = make(case, B, T)
    model, x = _float32(model, x)
    truth_grads = [g.double() for g in loop_grads(model, ce, x, y, case.batch_dim)]
    geo = _geometry(truth_grads, torch.Generator().manual_seed(7))
    truth = sum(
        ((g - m.double()) / s.double()).flatten(1).square().sum(1) for g, m, s in zip(truth_grads, geo.shift, geo.scale)
    )

    src = _source(model, x, y, case.batch_dim)
    got = src.sq_norms(geo, [0] * src.num_params, 1)[:, 0].double()
    if case.batch_dim == 0:  # (batch_dim != 0: every parameter takes the per-example path, by design)
        assert any(getattr(blk, "form", None) == "closed" for blk in src.blocks), "closed form not exercised"
    ratio = got / truth
    assert float(ratio.min()) >= 1 - 1e-5, f"{name}: a norm below the single-example truth ({ratio.tolist()})"
    assert float(ratio.max()) <= 1 + 2 * RECHECK_RTOL + 1e-5, f"{name}: {ratio.tolist()}"

    c = 0.5 * float(truth.sqrt().median())  # most examples are clipped
    full = _clipped_sum(model, x, y, case.batch_dim, geo, c)
    for j in range(B):
        keep = torch.tensor([i for i in range(B) if i != j])
        part = _clipped_sum(model, x.index_select(case.batch_dim, keep), y[keep], case.batch_dim, geo, c)
        assert float((full - part).norm()) <= c * (1 + 1e-4), f"{name}: removing example {j}"
