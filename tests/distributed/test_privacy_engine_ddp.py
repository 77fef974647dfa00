"""PrivacyEngine.make_private(..., distributed=True): the Opacus-style API path, 2 gloo processes on CPU.

* reproducible noise: each rank's loader draws only its shard and the union of the two ranks' batches
  is the one-process batch; the final parameters equal the one-process run's to float tolerance
  (only the summation order differs) and ε, the step count and the global expected batch size q·N
  are the same — for AdamW (the user's optimizer post-processes the release), dp-macadam (geometry
  feedback) and SGD with adaptive clipping (the clipped count is all-reduced: the same bounds). The
  ranks start from different initialisations: make_private broadcasts rank 0's.
* secret noise: the replicas end bit-identical and each rank's ledger holds each step once.
* refusals, raised on EVERY rank (none waits in a collective): a DistributedDataParallel module,
  poisson_sampling=False, settings that differ between ranks, a refusal on one rank only.

One spawn runs every 2-process case; the processes are killed if they outlive
the deadline and every collective times out after 60 s, so a hang cannot stall CI.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from gloo_ranks import gloo_group, spawn_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.accounting.accountant import dpsgd_epsilon
from dpopt.data import load_dataset
from dpopt.distributed import check_replicas, context, shard_bounds

BATCH = 128  # 1437 digits -> len(loader) = 12 steps per epoch, q = 1/12
CASES = {
    "adamw": dict(optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), epochs=2, kw={}),
    "macadam": dict(optimizer=lambda m: "dp-macadam", epochs=1, kw=dict(lr=3e-3)),
    "adaptive": dict(
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9),
        epochs=1,
        kw=dict(clipping="adaptive"),
    ),
}
SEED = 11  # the reproducible noise/mask stream (research mode: the test needs the same draws twice)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _data(batch_size: int = BATCH) -> DataLoader:
    d = load_dataset("digits")
    return DataLoader(TensorDataset(d.x_train, d.y_train, torch.arange(d.n_train)), batch_size=batch_size)


def _train(name: str, init_seed: int, distributed: bool, reproducible: bool = True) -> dict:
    case = CASES[name]
    torch.manual_seed(init_seed)
    model = _model()
    engine = dpopt.PrivacyEngine()
    generator = torch.Generator().manual_seed(SEED) if reproducible else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reproducible-noise warning
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=case["optimizer"](model),
            data_loader=_data(),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            noise_generator=generator,
            distributed=distributed,
            **case["kw"],
        )
    batches = []
    for _ in range(case["epochs"]):
        for x, y, idx in loader:
            batches.append(idx.tolist())
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "epsilon": engine.get_epsilon(1e-5),
        "steps": len(engine.ledger),
        "ledger_steps": [e.step for e in engine.ledger.entries],
        "batches": batches,
        "expected_batch_size": opt.expected_batch_size,
        "len": len(loader),
        "clip_history": list(opt.privatizer.clip_history),
        "replicas_equal": check_replicas(list(model.parameters()), context()) if distributed else None,
    }


def _refusal(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _make(model, loader, **kw):
    return lambda: dpopt.PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        distributed=True,
        **kw,
    )


def _refusals(rank: int) -> dict:
    model = _model()
    other = _model()
    ddp = nn.parallel.DistributedDataParallel(_model())
    return {
        "ddp": _refusal(_make(ddp, _data())),
        "no_poisson": _refusal(_make(model, _data(), poisson_sampling=False)),
        "mismatch": _refusal(_make(model, _data(64 if rank == 0 else 32))),
        # rank 1 alone refuses (an optimizer over another model's parameters): rank 0 must not hang
        "one_rank": _refusal(
            lambda: dpopt.PrivacyEngine().make_private(
                module=model,
                optimizer=torch.optim.SGD((other if rank == 1 else model).parameters(), lr=0.1),
                data_loader=_data(),
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                distributed=True,
            )
        ),
        "hooks_left": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
    }


def _worker(rank: int, world: int, tmp: str) -> None:
    with gloo_group(rank, world, tmp):
        results = {name: _train(name, init_seed=100 + rank, distributed=True) for name in CASES}
        results["secret"] = _train("adamw", init_seed=100 + rank, distributed=True, reproducible=False)
        results["refusals"] = _refusals(rank)
        torch.save(results, f"{tmp}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine-ddp")
    spawn_ranks(_worker, tmp)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_process(ddp_runs, name):
    single = _train(name, init_seed=100, distributed=False)  # rank 0's initialisation, the same stream
    n = 1437
    for rank, res in enumerate(r[name] for r in ddp_runs):
        assert res["len"] == single["len"] == 12 and res["steps"] == single["steps"] == 12 * CASES[name]["epochs"]
        assert res["expected_batch_size"] == pytest.approx(single["expected_batch_size"]) == pytest.approx(n / 12)
        assert res["epsilon"] == pytest.approx(single["epsilon"], rel=1e-12)
        assert res["ledger_steps"] == list(range(res["steps"]))  # each step recorded once
        assert res["clip_history"] == pytest.approx(single["clip_history"], rel=1e-6)
        lo, hi = shard_bounds(n, rank, 2)
        assert all(lo <= i < hi for batch in res["batches"] for i in batch)  # its shard only
        for a, b in zip(res["params"], single["params"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for t, batch in enumerate(single["batches"]):  # the union of the shards' batches is the one-process batch
        assert sorted(ddp_runs[0][name]["batches"][t] + ddp_runs[1][name]["batches"][t]) == batch
    if name == "adamw":
        assert single["epsilon"] == pytest.approx(dpsgd_epsilon(1.0, 1 / 12, 24, 1e-5), rel=1e-9)


def test_secret_noise_replicas_identical(ddp_runs):
    a, b = (r["secret"] for r in ddp_runs)
    assert a["replicas_equal"] and b["replicas_equal"]
    for p, q in zip(a["params"], b["params"]):
        assert torch.equal(p, q)
    assert a["steps"] == b["steps"] == 24 and a["ledger_steps"] == list(range(24))
    assert a["epsilon"] == b["epsilon"] == pytest.approx(dpsgd_epsilon(1.0, 1 / 12, 24, 1e-5), rel=1e-9)
    assert not any(set(x) & set(y) for x, y in zip(a["batches"], b["batches"]))  # disjoint shards


def test_refusals_on_every_rank(ddp_runs):
    r0, r1 = (r["refusals"] for r in ddp_runs)
    for r in (r0, r1):
        assert r["ddp"].startswith("ValueError") and "bare module" in r["ddp"]
        assert r["no_poisson"].startswith("ValueError") and "poisson_sampling=False" in r["no_poisson"]
        assert r["mismatch"].startswith("ValueError") and "different settings" in r["mismatch"]
        assert r["hooks_left"] == 0  # every refusal detached its hooks
    assert r1["one_rank"].startswith("ValueError") and "trainable parameters" in r1["one_rank"]
    assert r0["one_rank"].startswith("RuntimeError") and "another rank" in r0["one_rank"]


def test_distributed_without_process_group_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="init_process_group"):
        _make(model, _data())()
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0
