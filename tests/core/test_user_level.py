"""User-level DP through make_private (dpopt.users): sampling, per-user clipping, sensitivity, accounting."""

from __future__ import annotations

import math

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.engine.reference import PerSampleGrads
from dpopt.noise import NoiseSource
from dpopt.users import (
    UserPoissonBatchSampler,
    UserRows,
    group_by_user,
    group_privacy,
    users_of,
)

K = 3  # max_records_per_user in these tests


def _data(user_sizes: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    n = sum(user_sizes)
    x = torch.randn(n, 4, generator=g) * 3
    y = torch.randint(0, 3, (n,), generator=g)
    ids = [u for u, s in enumerate(user_sizes) for _ in range(s)]
    return x, y, ids


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _one_step(x, y, ids, c: float, *, seed: int = 5):
    """One σ = 0 step at q_user = 1: (clipped sum = release × B̄, the batch's x, y and user slots)."""
    model = _model()
    engine = dpopt.PrivacyEngine()
    with pytest.warns(UserWarning, match="reproducible"):
        m, opt, dl = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)),
            noise_multiplier=0.0,
            max_grad_norm=c,
            privacy_unit="user",
            user_ids=ids,
            max_records_per_user=K,
            noise_generator=torch.Generator().manual_seed(seed),
        )
    (xb, yb) = next(iter(dl))
    slots = dl.last_batch_rows.slots.clone()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(xb), yb).backward()
    opt.step()
    total = torch.cat([p.grad.flatten() for p in model.parameters()]) * opt.expected_batch_size
    return total, xb, yb, slots, engine


def _per_example(xb, yb) -> torch.Tensor:
    model = _model()
    rows = []
    for i in range(len(xb)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(xb[i : i + 1]), yb[i : i + 1]).backward()
        rows.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return torch.stack(rows)


def test_release_is_the_sum_of_clipped_per_user_means():
    """σ = 0, q = 1: release × B̄ = Σ_u clip_C(mean of u's records' gradients) — by hand, per example."""
    sizes = [1, K, K + 4, 2]  # 1, k and more than k records
    x, y, ids = _data(sizes)
    c = 0.3
    total, xb, yb, slots, _ = _one_step(x, y, ids, c)
    g = _per_example(xb, yb)
    expect = torch.zeros_like(g[0])
    for u in range(int(slots.max()) + 1):
        mean = g[slots == u].mean(0)
        expect += mean * min(1.0, c / float(mean.norm()))
    assert len(xb) == 1 + K + K + 2  # the > k user contributes exactly k rows
    torch.testing.assert_close(total, expect, rtol=1e-5, atol=1e-6)
    # records of the big user are its own: rows of slot 2 are rows of user 2 in the dataset
    big = set(torch.nonzero(torch.tensor(ids) == 2).flatten().tolist())
    rows = [i for i in range(len(x)) if any(torch.equal(x[i], r) for r in xb[slots == 2])]
    assert len(rows) == K and set(rows) <= big


@pytest.mark.parametrize("removed", [0, 1, 2])  # a user with 1, k and more than k records
def test_sigma_zero_removing_one_user_moves_the_release_by_at_most_c(removed):
    sizes = [1, K, K + 4, 2, 2]
    x, y, ids = _data(sizes)  # user 2's records differ: its choice of k is coupled by its key (same stream)
    c = 0.05  # every user's mean gradient is clipped: the move is exactly C
    full, *_ = _one_step(x, y, ids, c)
    keep = [i for i, u in enumerate(ids) if u != removed]
    less, *_ = _one_step(x[keep], y[keep], [ids[i] for i in keep], c)
    moved = float((full - less).norm())
    assert moved <= c * (1 + 1e-5)
    assert moved == pytest.approx(c, rel=1e-4)  # not k·C: the user's records were clipped as one unit


def test_record_level_clipping_would_move_by_k_c():
    """The same removal at privacy_unit='record' moves the clipped sum by more than C (why the unit matters)."""
    sizes = [1, K, 2]
    x, y, ids = _data(sizes)
    c = 0.05

    def total(xs, ys):
        model = _model()
        engine = dpopt.PrivacyEngine()
        with pytest.warns(UserWarning, match="poisson_sampling=False"):
            m, opt, dl = engine.make_private(
                module=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                data_loader=DataLoader(TensorDataset(xs, ys), batch_size=len(xs)),
                noise_multiplier=0.0,
                max_grad_norm=c,
                poisson_sampling=False,  # the test steps on the whole dataset, its own batch
            )
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(xs), ys).backward()  # the whole dataset: one step
        opt.step()
        return torch.cat([p.grad.flatten() for p in model.parameters()]) * opt.expected_batch_size

    keep = [i for i, u in enumerate(ids) if u != 1]
    moved = float((total(x, y) - total(x[keep], y[keep])).norm())
    assert moved > 1.5 * c


def test_epsilon_equals_dp_accounting_at_q_user():
    x, y, ids = _data([2] * 20)
    model = _model()
    engine = dpopt.PrivacyEngine()
    m, opt, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.1,
        max_grad_norm=1.0,
        privacy_unit="user",
        user_ids=ids,
        sample_rate=0.25,
    )
    steps = 0
    for xb, yb in dl:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(xb), yb).backward()
        opt.step()
        steps += 1
    assert steps == 4 and opt.expected_batch_size == pytest.approx(0.25 * 20)  # B̄ = q_user · N_users
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(0.25, dp_event.GaussianDpEvent(1.1)), steps)
    assert engine.get_epsilon(1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
    header = engine.ledger.to_dict()
    assert header["privacy_unit"] == f"user (at most {dpopt.users.DEFAULT_MAX_RECORDS_PER_USER} records each)"
    assert header["num_users"] == 20
    summary = engine.summary(1e-5)
    assert summary["privacy_unit"] == "user" and summary["num_users"] == 20 and summary["sample_rate"] == 0.25


def test_sampler_draws_users_at_q_and_at_most_k_records():
    """Each user joins with probability q (binomial test, error rate < 1e-6) and brings min(n_u, k) records."""
    users = users_of([u for u in range(50) for _ in range(1 + u % 6)], sum(1 + u % 6 for u in range(50)))
    sampler = UserPoissonBatchSampler(
        users, 0.3, 400, 4, noise=NoiseSource("reproducible", generator=torch.Generator().manual_seed(3))
    )
    joined = 0
    for rows in sampler:
        slots = sampler.groups.popleft()
        sampler.sizes.popleft()
        owners = {}
        for r, s in zip(rows, slots.tolist()):
            owners.setdefault(s, []).append(r)
        for recs in owners.values():
            u = next(i for i, rr in enumerate(users) if recs[0] in rr)
            assert set(recs) <= set(users[u]) and len(recs) == min(len(users[u]), 4) and len(set(recs)) == len(recs)
        joined += len(owners)
    n = 400 * 50
    # |joined/n − q| ≤ 5 standard deviations: fails with probability < 1e-6 under the null
    assert abs(joined / n - 0.3) <= 5 * math.sqrt(0.3 * 0.7 / n)


def test_record_choice_is_uniform_and_keyed_by_user():
    """A user with 6 records and k = 2: each record in a batch with probability 1/3 (5-sigma binomial bound,
    false-failure rate < 1e-6 per record); the same secret stream gives the same choice whatever other users exist."""
    users = [[0, 1, 2, 3, 4, 5]]
    sampler = UserPoissonBatchSampler(
        users, 1.0, 3000, 2, noise=NoiseSource("reproducible", generator=torch.Generator().manual_seed(1))
    )
    counts = torch.zeros(6)
    for rows in sampler:
        counts[rows] += 1
    n, p = 3000, 1 / 3
    assert ((counts / n - p).abs() <= 5 * math.sqrt(p * (1 - p) / n)).all()
    one = UserPoissonBatchSampler(
        [[0, 1, 2, 3, 4, 5]],
        1.0,
        1,
        2,
        keys=["'u'"],
        noise=NoiseSource("reproducible", generator=torch.Generator().manual_seed(7)),
    )
    two = UserPoissonBatchSampler(
        [[0], [1, 2, 3, 4, 5, 6]],
        1.0,
        1,
        2,
        keys=["'v'", "'u'"],
        noise=NoiseSource("reproducible", generator=torch.Generator().manual_seed(7)),
    )
    (a,), (b,) = list(one), list(two)
    assert [r + 1 for r in a] == b[1:]  # user 'u' brings the same two of its records next to another user


def test_sharded_sampler_ranks_partition_the_users_and_their_union_is_the_one_process_sample():
    """Data parallel (ctx of 2 ranks): each rank samples its contiguous shard of the users only. Reproducible
    noise: the union of the ranks' batches is the one-process batch of the same seed, row for row. Secret noise:
    every user of rank 1's shard joins at q (6-sigma binomial bound per user: false failure 2e-9 each, 1e-8 for
    the 5 users per run; at 5 sigma it was 2.9e-6. Power: 6 sd is 0.054 of a rate 0.4; a shard drawn twice,
    rate 0.64, is 27 sd away)."""
    from dpopt.distributed import DistributedContext

    sizes = [1 + u % 4 for u in range(9)]
    users = users_of([u for u, n in enumerate(sizes) for _ in range(n)], sum(sizes))

    def batches(ctx, steps=30, q=0.4, mode="reproducible"):
        noise = NoiseSource(mode, generator=torch.Generator().manual_seed(5)) if mode == "reproducible" else None
        return list(UserPoissonBatchSampler(users, q, steps, 2, noise=noise, ctx=ctx))

    ranks = [DistributedContext(rank=r, world_size=2) for r in range(2)]
    shard = [set(i for u in range(lo, hi) for i in users[u]) for lo, hi in ((0, 4), (4, 9))]
    whole = batches(None)
    parts = [batches(ctx) for ctx in ranks]
    for t, rows in enumerate(whole):
        assert parts[0][t] + parts[1][t] == rows  # the one-process batch, split at the shard boundary
        assert set(parts[0][t]) <= shard[0] and set(parts[1][t]) <= shard[1]
    assert any(parts[0]) and any(parts[1])
    full = batches(ranks[1], steps=1, q=1.0, mode="secret")[0]
    assert {next(u for u in range(9) if i in users[u]) for i in full} == set(range(4, 9))  # q = 1: all its users
    n, q = 3000, 0.4
    joined = torch.zeros(9)
    for rows in batches(ranks[1], steps=n, q=q, mode="secret"):
        for u in {next(u for u in range(9) if i in users[u]) for i in rows}:
            joined[u] += 1
    assert joined[:4].sum() == 0
    assert ((joined[4:] / n - q).abs() <= 6 * math.sqrt(q * (1 - q) / n)).all()


def test_group_by_user_matches_index_add_for_factored_and_materialised_sources():
    g = [torch.randn(6, 3, 2), torch.randn(6, 2)]
    slots = torch.tensor([0, 0, 1, 2, 2, 2])
    grouped = group_by_user(PerSampleGrads(g), slots)

    class Opaque:  # only the protocol: weighted_sum path
        num_params, batch_size, nonfinite, params, points = 2, 6, 0, None, None

        def weighted_sum(self, w, geometry, groups):
            return PerSampleGrads(g).weighted_sum(w, geometry, groups)

    other = group_by_user(Opaque(), slots)
    for a, b, full in zip(grouped.grads, other.grads, g):
        assert a.shape[0] == 3
        torch.testing.assert_close(a[2], full[3:6].mean(0))
        torch.testing.assert_close(a.to(b.dtype), b)


def test_chunks_must_end_between_users():
    rows = UserRows(torch.tensor([0, 0, 1, 1, 1, 2]))
    assert rows.take(2).tolist() == [0, 0]
    with pytest.raises(ValueError, match="inside a user"):
        rows.take(2)
    assert rows.take(3).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="more rows"):
        rows.take(5)


def test_refusals_name_what_to_change():
    x, y, ids = _data([2, 2])
    dl = DataLoader(TensorDataset(x, y), batch_size=2)
    kw = dict(optimizer="dp-sgd", data_loader=dl, noise_multiplier=1.0, max_grad_norm=1.0, lr=0.1)
    with pytest.raises(ValueError, match="needs user_ids"):
        dpopt.PrivacyEngine().make_private(module=_model(), privacy_unit="user", **kw)
    with pytest.raises(ValueError, match="one user id per record"):
        dpopt.PrivacyEngine().make_private(module=_model(), privacy_unit="user", user_ids=[0, 1], **kw)
    with pytest.raises(ValueError, match="privacy_unit must be one of"):
        dpopt.PrivacyEngine().make_private(module=_model(), privacy_unit="person", **kw)
    with pytest.raises(ValueError, match="user_ids are read only"):
        dpopt.PrivacyEngine().make_private(module=_model(), user_ids=ids, **kw)
    with pytest.raises(ValueError, match="max_records_per_user"):
        dpopt.PrivacyEngine().make_private(
            module=_model(), privacy_unit="user", user_ids=ids, max_records_per_user=0, **kw
        )


def test_group_privacy_arithmetic():
    eps, delta = group_privacy(1.0, 1e-6, 3)
    assert eps == 3.0 and delta == pytest.approx(3 * math.exp(2.0) * 1e-6)
    assert group_privacy(2.0, 1e-5, 1) == (2.0, 1e-5)
    with pytest.raises(ValueError):
        group_privacy(1.0, 1e-5, 0)


def test_make_private_with_epsilon_calibrates_at_q_user():
    from dpopt.accounting.calibration import calibrate_noise_multiplier

    x, y, ids = _data([2] * 20)
    model = _model()
    engine = dpopt.PrivacyEngine()
    _, opt, dl = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=10),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=1.0,
        privacy_unit="user",
        user_ids=ids,
        sample_rate=0.2,
    )
    assert (
        len(dl) == 5 and opt.noise_multiplier == calibrate_noise_multiplier(3.0, 1e-5, 0.2, 10, "pld").noise_multiplier
    )


def test_batch_memory_manager_is_refused_with_the_user_unit():
    from dpopt.utils.batch_memory_manager import BatchMemoryManager

    x, y, ids = _data([2] * 6)
    model = _model()
    _, opt, dl = dpopt.PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        privacy_unit="user",
        user_ids=ids,
    )
    with pytest.raises(ValueError, match="cut users in two"):
        with BatchMemoryManager(data_loader=dl, max_physical_batch_size=2, optimizer=opt):
            pass


def test_make_private_block_unit_is_recorded_and_warned():
    x, y, _ = _data([2] * 4)
    model = _model()
    engine = dpopt.PrivacyEngine()
    with pytest.warns(UserWarning, match="protects ONE BLOCK"):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            privacy_unit="block",
        )
    assert engine.ledger.to_dict()["privacy_unit"] == "block" and engine.ledger.num_users is None
