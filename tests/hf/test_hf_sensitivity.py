"""σ = 0 sensitivity ≤ C on every tiny HF model, through dpopt's loop and through PrivacyEngine.

Eval mode (dropout off), so that the full batch and each neighbour D − {j}
run the same function; C is half the median per-example norm (most examples
clipped, some not). PrivacyEngine: noise_multiplier 0 and lr 0, the released
gradient × expected batch size is the clipped sum.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("transformers")

from hf_zoo import CASES, make, reference, trainable  # noqa: E402

import dpopt  # noqa: E402
from dpopt.engine import iter_per_sample_sources  # noqa: E402
from dpopt.types import ClipGeometry  # noqa: E402


def _bound(model, loss_fn, x, y) -> float:
    norms = torch.sqrt(sum(g.double().flatten(1).square().sum(1) for g in reference(model, loss_fn, x, y)))
    return 0.5 * float(norms.median())


def _fast_sum(model, loss_fn, x, y, c):
    src = next(iter(iter_per_sample_sources(model, loss_fn, x, y)))
    n = src.num_params
    norms = src.sq_norms(ClipGeometry(), [0] * n, 1)[:, 0].sqrt()
    w = torch.clamp(c / norms, max=1.0).unsqueeze(1)
    return torch.cat([s.flatten() for s in src.weighted_sum(w, ClipGeometry(), [0] * n)])


@pytest.mark.parametrize("name", list(CASES))
def test_removing_one_example_moves_the_clipped_sum_by_at_most_c_in_dpopts_loop(name):
    model, x, y, loss_fn, _ = make(name)
    model.eval()
    c = _bound(model, loss_fn, x, y)
    full = _fast_sum(model, loss_fn, x, y, c)
    for j in range(y.shape[0]):
        keep = torch.tensor([i for i in range(y.shape[0]) if i != j])
        part = _fast_sum(model, loss_fn, x[keep], y[keep], c)
        assert float((full - part).norm()) <= c * (1 + 1e-5), f"{name}: example {j}"


@pytest.mark.parametrize("name", list(CASES))
def test_removing_one_example_moves_the_release_by_at_most_c_through_privacy_engine(name):
    model, x, y, loss_fn, batch_loss = make(name)
    model.eval()
    c = _bound(model, loss_fn, x, y)
    engine = dpopt.PrivacyEngine()
    opt = torch.optim.SGD(trainable(model), lr=0.0)
    model, opt, _ = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=len(y)),
        poisson_sampling=False,  # the test steps on its own (neighbouring) batches
        noise_multiplier=0.0,
        max_grad_norm=c,
    )

    def released(xs, ys):
        opt.zero_grad()
        batch_loss(model(xs), ys).backward()
        opt.step()
        return torch.cat([p.grad.flatten() for p in trainable(model)]) * opt.expected_batch_size

    try:
        full = released(x, y)
        for j in range(y.shape[0]):
            keep = torch.tensor([i for i in range(y.shape[0]) if i != j])
            assert float((full - released(x[keep], y[keep])).norm()) <= c * (1 + 1e-5), f"{name}: example {j}"
    finally:
        engine.detach()
