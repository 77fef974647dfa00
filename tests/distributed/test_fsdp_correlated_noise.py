"""Correlated noise (issue 36) with FSDP2: make_private(distributed="fsdp", noise_mechanism=...) on 2 gloo ranks.

Each rank owns a ``Shard(0)`` chunk of every parameter and streams the correlated noise of that chunk only
(``dpopt.fsdp.ShardedRelease``): its state holds the chunk, never the whole model, and never leaves the process.

* reproducible noise (research mode) and a fixed public partition: the released gradient of every step equals
  the one-process release (rtol 1e-4, atol 1e-6: float32 sums in another order), with every example clipped
  (C far below every norm) and with about half clipped (C the median norm; lr = 0 keeps the norms those of the
  initialisation, so the test checks that every batch really has clipped and unclipped examples): the noise of
  each coordinate is the one-process w_t bit for bit, so any other noise (a shard not correlated, the stream
  run twice, a shard noised by both ranks) moves a release by ~σC;
* cyclic Poisson sampling (``sampling="cyclic-poisson"``, q = 0.5: b' = 3 parts of 32, banded:2, trained): each
  rank Poisson-samples its slice of part t mod 3 (the union is the one-process batch) and every release equals
  the one-process release, as above;
* ε, the ledger's mechanism record and every ledger entry equal the one-process run's;
* secret noise (each rank its own OS-seeded stream), zero gradients: the released noise w_t on 12,448
  coordinates has the strategy's covariance across the T = 6 steps, (σC/B̄)²·C⁻¹C⁻ᵀ — per-step variance
  (the diagonal) and the lag-1 covariance (the first off-diagonal) among the 21 entries — on each rank's
  shard separately, each entry within 5.6 standard errors (se = √((Σ_ss Σ_tt + Σ_st²)/d); two-sided false
  alarm ≤ 42 × 2.1e-8 ≈ 9e-7 per run, Bonferroni over both shards: the noise is secret, so every run is a
  new draw; at 5 se it was 2.4e-5). Power kept: the lag-1 entries are ≈ 25 se and the diagonal ≈ 55 se, so
  white noise, a doubled or a missing stream still fail; the stream state is the shard's size;
* copies (deepcopy, pickle) and a forked child of a rank carry no stream state and refuse to continue;
  resume (a Privatizer state after step 0) is refused as in one process.
"""

from __future__ import annotations

import copy
import os
import pickle
import select
import signal
import types
import warnings

import numpy as np
import pytest
import torch
from gloo_ranks import gloo_group, progress, spawn_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt
import dpopt.privacy_engine as privacy_engine_module

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # one 2-rank spawn: 95-130 s at load 15-20

N, BATCH, EPOCHS, SEED = 96, 16, 2, 11  # 6 cyclic batches, T = 12 releases, k = 2 participations
SIGMA = 1.5
POISSON = dict(sampling="cyclic-poisson", sample_rate=0.5)  # b' = round(0.5 × 6) = 3 parts of 32, k = 4
STATS_N, STATS_BATCH, STATS_T = 48, 16, 6  # 3 cyclic batches × 2 epochs


def _data(n: int = N, dim: int = 8, batch: int = BATCH) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, dim, generator=g), torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y, torch.arange(n)), batch_size=batch)


def _model() -> nn.Module:
    torch.manual_seed(3)  # the same initialisation on every rank and in the one-process run
    return nn.Sequential(nn.Linear(8, 33), nn.ReLU(), nn.Linear(33, 3))  # 33 rows: uneven shards 17/16


def _shard(m: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(m[0])
    fully_shard(m[2])
    fully_shard(m)
    return m


def _full(p) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def example_norms() -> torch.Tensor:
    """‖∇ℓ_i‖ of every example at the initialisation (mean loss of a batch of one), single-example autograd."""
    model = _model()
    x, y, _ = _data().dataset.tensors
    norms = []
    for i in range(N):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        norms.append(torch.sqrt(sum((p.grad**2).sum() for p in model.parameters())))
    return torch.stack(norms)


def _make_private(
    model, opt, loader, mechanism: str, c: float, reproducible: bool, sharded: bool, epochs: int, **sampling
):
    engine = dpopt.PrivacyEngine()
    real = privacy_engine_module.secrets
    privacy_engine_module.secrets = types.SimpleNamespace(randbits=lambda k: 1234)  # the same public partition
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reproducible-noise warning
            model, opt, loader = engine.make_private(
                module=model,
                optimizer=opt,
                data_loader=loader,
                noise_multiplier=SIGMA,
                max_grad_norm=c,
                noise_generator=torch.Generator().manual_seed(SEED) if reproducible else None,
                distributed="fsdp" if sharded else False,
                noise_mechanism=mechanism,
                epochs=epochs,
                **sampling,
            )
    finally:
        privacy_engine_module.secrets = real
    return engine, model, opt, loader


def release_run(mechanism: str, c: float, sharded: bool, lr: float = 0.0, **sampling) -> dict:
    """EPOCHS epochs of cyclic batches, reproducible noise: every release (× B̄, full shape) and the ledger."""
    model = _model()
    if sharded:
        model = _shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    engine, model, opt, loader = _make_private(model, opt, _data(), mechanism, c, True, sharded, EPOCHS, **sampling)
    released, batches = [], []
    for _ in range(EPOCHS):
        for x, y, idx in loader:
            batches.append(idx.tolist())
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            released.append([_full(p.grad) * opt.expected_batch_size for p in model.parameters()])
    return {
        "released": released,
        "batches": batches,
        "params": [_full(p) for p in model.parameters()],
        "epsilon": engine.get_epsilon(1e-5),
        "mechanism": engine.ledger.mechanism,
        "sampling": engine.ledger.sampling,
        "ledger": [(e.step, repr(e.event), sorted(e.meta.items())) for e in engine.ledger.entries],
        "expected_batch_size": opt.expected_batch_size,
    }


def _secret_state(mech, key: str, step: int, shard: int) -> dict:
    """Copies, pickles, a forked child and a resume, in the middle of the run (release ``step`` is next)."""
    z = torch.zeros(shard, dtype=torch.float64)
    out = {}
    for name, clone in (("deepcopy", copy.deepcopy(mech)), ("pickle", pickle.loads(pickle.dumps(mech)))):
        try:
            clone.correlate(z, step, key)
            out[name] = (clone._state == {}, "continued")
        except RuntimeError as exc:
            out[name] = (clone._state == {}, str(exc))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            try:
                mech.correlate(z, step, key)
                os.write(write, b"continued")
            except RuntimeError:
                os.write(write, b"refused")
        finally:
            os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], 60.0)  # a child stuck on a lock inherited from gloo's threads
    out["fork"] = os.read(read, 32).decode() if ready else "no answer"
    os.close(read)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return out


def noise_run() -> dict:
    """Secret noise, zero gradients (the released gradient × B̄ is w_t), blt:2 over T = 6 steps."""
    torch.manual_seed(4)
    model = _shard(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)))  # 12,448 coordinates
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, model, opt, loader = _make_private(
        model, opt, _data(STATS_N, 64, STATS_BATCH), "blt:2", 0.7, False, True, 2
    )
    priv = opt.privatizer
    mech, key = priv.mechanism, "fsdp-shard:cpu"
    released, checks = [], {}
    for _ in range(2):
        for x, _y, _ in loader:
            if priv.steps == 3:
                own = sum(b.numel() for b in mech._state[key][1]) // len(mech._state[key][1])
                checks = _secret_state(mech, key, 3, own)
                try:
                    priv.load_state_dict(priv.state_dict())
                    checks["resume"] = "accepted"
                except ValueError as exc:
                    checks["resume"] = str(exc)
            opt.zero_grad()
            (model(x) * 0).sum().backward()
            opt.step()
            released.append([p.grad.to_local().clone() * opt.expected_batch_size for p in model.parameters()])
    return {
        "released": released,  # this rank's shard of w_t, per parameter
        "state": {k: [b.numel() for b in v[1]] for k, v in mech._state.items()},
        "params": sum(p.numel() for p in model.parameters()),
        "hook_mechanism": priv.reduce.mechanism is mech,
        "strategy": mech.strategy,
        "bbar": opt.expected_batch_size,
        "checks": checks,
        "steps": len(engine.ledger),
    }


def _worker(rank: int, world: int, tmp: str) -> None:
    with gloo_group(rank, world, tmp):
        half = float(example_norms().median())
        cases = [
            ("all_clipped", lambda: release_run("blt:2", 1e-3, True)),
            ("half_clipped", lambda: release_run("banded:3", half, True)),
            ("trained", lambda: release_run("blt:2", 1.0, True, lr=0.5)),
            ("noise", noise_run),
            ("cyclic_poisson", lambda: release_run("banded:2", 1.0, True, lr=0.5, **POISSON)),
        ]
        results = {}
        for name, run in cases:
            results[name] = run()
            progress(tmp, rank, name)
        torch.save(results, f"{tmp}/rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mf-fsdp")
    spawn_ranks(_worker, tmp, stall_s=180)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("case", ["all_clipped", "half_clipped", "trained", "cyclic_poisson"])
def test_releases_equal_one_process(runs, case):
    norms = example_norms()
    c, mechanism = {
        "all_clipped": (1e-3, "blt:2"),
        "half_clipped": (float(norms.median()), "banded:3"),
        "cyclic_poisson": (1.0, "banded:2"),
    }.get(case, (1.0, "blt:2"))
    sampling = POISSON if case == "cyclic_poisson" else {}
    single = release_run(mechanism, c, sharded=False, lr=0.0 if "clipped" in case else 0.5, **sampling)
    if case == "all_clipped":
        assert bool((norms > c).all())
    if case == "half_clipped":  # every batch has clipped and unclipped examples (lr = 0: the norms stay)
        for batch in single["batches"]:
            clipped = int((norms[batch] > c).sum())
            assert 0 < clipped < len(batch)
    steps = EPOCHS * (N // BATCH)
    for res in (r[case] for r in runs):
        assert len(res["released"]) == len(single["released"]) == steps
        for t, (a, b) in enumerate(zip(res["released"], single["released"])):
            for u, v in zip(a, b):
                torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-6, msg=f"release {t}")
        for a, b in zip(res["params"], single["params"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        assert res["mechanism"] == single["mechanism"] and res["mechanism"]["kind"] == mechanism.split(":")[0]
        assert res["sampling"] == single["sampling"]
        assert res["ledger"] == single["ledger"]
        assert res["epsilon"] == single["epsilon"]
        assert res["expected_batch_size"] == single["expected_batch_size"] == BATCH
    r0, r1 = (r[case]["batches"] for r in runs)
    for t, batch in enumerate(single["batches"]):  # each rank its slice of the one-process cyclic batch
        assert not set(r0[t]) & set(r1[t]) and sorted(r0[t] + r1[t]) == sorted(batch)
    if case == "cyclic_poisson":  # resampled parts: not the fixed batches of the cyclic cases
        assert single["mechanism"]["sample_rate"] == 0.5 and single["batches"][3:6] != single["batches"][:3]
    if case in ("trained", "cyclic_poisson"):
        moved = [not torch.equal(a, b) for a, b in zip(single["params"], _model().parameters())]
        assert all(moved)


def test_noise_has_the_strategy_covariance_on_each_shard(runs):
    for res in (r["noise"] for r in runs):
        assert res["steps"] == STATS_T
        W = torch.stack([torch.cat([g.reshape(-1) for g in step]) for step in res["released"]]).double().numpy()
        T, d = W.shape
        assert T == STATS_T and d > 6000 and (W != 0).all()
        Dinv = np.linalg.inv(res["strategy"].matrix(T))
        want = (SIGMA * 0.7) ** 2 * (Dinv @ Dinv.T)  # × B̄ undone: (σC)² C⁻¹C⁻ᵀ
        got = W @ W.T / d
        se = np.sqrt((np.outer(np.diag(want), np.diag(want)) + want**2) / d)
        assert np.all(np.abs(got - want) <= 5.6 * se), np.max(np.abs(got - want) / se)
        lag1 = np.diag(want, 1)
        assert np.all(np.abs(lag1) > 2 * 5.6 * np.diag(se, 1))  # the lag-1 covariance is really there (not white)


def test_stream_state_is_the_shard_only(runs):
    sizes = []
    for res in (r["noise"] for r in runs):
        assert res["hook_mechanism"]
        assert list(res["state"]) == ["fsdp-shard:cpu"]  # no full-model stream ("cpu") on any rank
        buffers = res["state"]["fsdp-shard:cpu"]
        assert len(buffers) == 2  # blt:2: two buffers
        shard = sum(g.numel() for g in res["released"][0])
        assert buffers == [shard, shard] and shard < res["params"]
        sizes.append(shard)
    assert sum(sizes) == runs[0]["noise"]["params"]  # 128 and 32 rows split evenly: the shards tile the model


def test_copies_forks_and_resume_refused(runs):
    for r in runs:
        checks = r["noise"]["checks"]
        for name in ("deepcopy", "pickle"):
            empty, answer = checks[name]
            assert empty and "never copied" in answer
        assert checks["fork"] == "refused"
        assert "resuming a correlated-noise" in checks["resume"]
        assert r["noise"]["steps"] == STATS_T  # the original stream went on after the copies and the fork
