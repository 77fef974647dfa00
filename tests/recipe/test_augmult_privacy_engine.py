"""PrivacyEngine.make_private(..., augmentation_multiplicity=K): the user forwards B·K example-major rows.

Checked with σ = 0 against per-example gradients computed by hand with torch.func (example i's gradient =
mean over its K views of the single-view gradient, then clipped): the released update equals
Σ_i clip_C(g_i) / B̄ for loss_reduction "mean" (over the B·K rows) and "sum" (over the rows, divided by K
by the user: the sum over examples of their view-means); removing one example with all its views moves
the clipped sum by ≤ C; ε after a step equals K = 1's; a batch that is not a multiple of K is refused.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.augment import crop_flip, repeat_labels, repeat_views

K, B, C = 3, 5, 0.05


def small_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def _data(b=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 3, 8, 8, generator=g, dtype=torch.float64)
    return repeat_views(x, K, crop_flip, g), torch.randint(0, 3, (b,), generator=g)


def _clipped_truth(model, rows, y):
    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss(ps, xi, yi):
        return F.cross_entropy(functional_call(model, ps, (xi[None],)), yi[None])

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, rows, repeat_labels(y, K))
    per_ex = torch.cat([g[n].reshape(len(y), K, -1).mean(1) for n in params], dim=1)  # [B, d]: mean over views
    scale = torch.clamp(C / per_ex.norm(dim=1), max=1.0)
    return (per_ex * scale[:, None]).sum(0)


def _release_times_b(model0, rows, y, k=K, reduction="mean", sigma=0.0):
    model = _copy(model0)
    params = list(model.parameters())
    loader = DataLoader(TensorDataset(torch.zeros(len(y), 1), y), batch_size=len(y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = dpopt.PrivacyEngine()
        model, opt, _ = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(params, lr=1.0),
            data_loader=loader,
            noise_multiplier=sigma,
            max_grad_norm=C,
            poisson_sampling=False,
            augmentation_multiplicity=k,
            loss_reduction=reduction,
        )
    before = torch.cat([p.detach().flatten() for p in params])
    opt.zero_grad()
    out = model(rows)
    ys = repeat_labels(y, k)
    loss = F.cross_entropy(out, ys) if reduction == "mean" else F.cross_entropy(out, ys, reduction="sum") / k
    loss.backward()
    opt.step()
    return (before - torch.cat([p.detach().flatten() for p in params])) * opt.expected_batch_size, engine


def _copy(m):
    import copy

    return copy.deepcopy(m)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_release_is_the_clipped_sum_of_view_means(reduction):
    torch.manual_seed(0)
    model = small_cnn().double().train()
    rows, y = _data()
    got, _ = _release_times_b(model, rows, y, reduction=reduction)
    assert torch.allclose(got, _clipped_truth(model, rows, y), rtol=1e-6, atol=1e-9)


def test_sigma_zero_removing_one_example_with_all_views_moves_at_most_c():
    torch.manual_seed(1)
    model = small_cnn().double().train()
    rows, y = _data(b=6)
    full, _ = _release_times_b(model, rows, y)
    moves = []
    for j in range(6):
        keep = [i for i in range(6) if i != j]
        keep_rows = torch.tensor([i * K + v for i in keep for v in range(K)])
        part, _ = _release_times_b(model, rows[keep_rows], y[torch.tensor(keep)])
        moves.append(float((full - part).norm()))
    assert max(moves) <= C * (1 + 1e-6) and min(moves) > 0.5 * C


def test_epsilon_identical_to_k1_and_bad_row_counts_refused():
    torch.manual_seed(2)
    model = small_cnn().double().train()
    rows, y = _data()
    _, e4 = _release_times_b(model, rows, y, sigma=2.0)
    _, e1 = _release_times_b(model, rows[::K].contiguous(), y, k=1, sigma=2.0)
    eps = e4.get_epsilon(1e-5)
    assert 0 < eps < float("inf") and eps == e1.get_epsilon(1e-5)
    assert [e.event for e in e4.ledger.entries] == [e.event for e in e1.ledger.entries]
    with pytest.raises(ValueError):
        _release_times_b(model, rows[:-1], y)


def test_physical_chunks_of_examples_with_their_views_equal_one_pass():
    """Opacus's micro-batch protocol (BatchMemoryManager's signal_skip_step): chunks of examples, each with
    all K of its views, accumulate into ONE release equal to the single pass."""
    torch.manual_seed(3)
    model0 = small_cnn().double().train()
    rows, y = _data(b=6)
    whole, _ = _release_times_b(model0, rows, y)
    model = _copy(model0)
    params = list(model.parameters())
    loader = DataLoader(TensorDataset(torch.zeros(6, 1), y), batch_size=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, _ = dpopt.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(params, lr=1.0),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=C,
            poisson_sampling=False,
            augmentation_multiplicity=K,
        )
    before = torch.cat([p.detach().flatten() for p in params])
    for chunk, last in (([0, 1], False), ([2, 3, 4], False), ([5], True)):
        opt.signal_skip_step(do_skip=not last)
        opt.zero_grad()
        sel = torch.tensor([i * K + v for i in chunk for v in range(K)])
        F.cross_entropy(model(rows[sel]), repeat_labels(y[torch.tensor(chunk)], K), reduction="sum").div(
            K * 6
        ).backward()  # the logical batch's mean: each row weighted 1/(B·K)
        opt.step()
    got = (before - torch.cat([p.detach().flatten() for p in params])) * opt.expected_batch_size
    assert torch.allclose(got, whole, rtol=1e-6, atol=1e-9)


# --------------------------------------------------------------------------- the loader's batch vs the rows
def _poisson_setup(n=40, batch=8):
    torch.manual_seed(5)
    model = small_cnn().double().train()
    g = torch.Generator().manual_seed(6)
    ds = TensorDataset(
        torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
    )
    model, opt, loader = dpopt.PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(ds, batch_size=batch),
        noise_multiplier=1.0,
        max_grad_norm=C,
        augmentation_multiplicity=K,
    )
    return model, opt, loader


def test_a_poisson_loop_that_repeats_each_example_k_times_steps():
    model, opt, loader = _poisson_setup()
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(repeat_views(x, K, crop_flip)), repeat_labels(y, K)).backward()
        opt.step()
    assert len(opt.privatizer.ledger) == len(loader)


def test_a_loop_that_forgets_to_repeat_the_views_is_refused_before_any_release():
    """rows = the loader's B examples (a multiple of K here) instead of B·K: K different examples would be
    averaged and clipped as one, and ε would not hold."""
    model, opt, loader = _poisson_setup(n=60, batch=4)
    refused = 0
    for x, y in loader:
        x, y = x[: len(y) // K * K], y[: len(y) // K * K]  # a multiple of K, so only the batch check can see it
        if len(y) == 0:
            continue
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(
            ValueError, match=r"did not carry 3 rows per example of the data loader's last batch.*repeat_views"
        ):
            opt.step()
        refused += 1
        if refused == 3:
            break
    assert refused == 3 and len(opt.privatizer.ledger) == 0


def test_batch_memory_manager_chunks_with_their_views_pass_the_batch_check():
    from dpopt.utils.batch_memory_manager import BatchMemoryManager

    model, opt, loader = _poisson_setup(n=40, batch=10)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as chunks:
        for x, y in chunks:
            opt.zero_grad()
            F.cross_entropy(model(repeat_views(x, K, crop_flip)), repeat_labels(y, K)).backward()
            opt.step()
    assert len(opt.privatizer.ledger) == len(loader)


def test_copies_of_the_optimizer_never_carry_the_loader():
    import copy

    model, opt, loader = _poisson_setup()
    assert opt._loader is loader
    assert copy.deepcopy((model, opt))[1]._loader is None
