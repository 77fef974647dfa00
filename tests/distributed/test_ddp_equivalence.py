"""Data-parallel training (dpopt.distributed): 2 gloo processes on CPU.

* reproducible noise: the 2-process run gives the same ε, the same ledger and
  the same parameters (float tolerance: only the summation order differs) as the
  1-process run with the same seed — for DP-MacAdam (geometry feedback) with
  micro-batches and for DP-SGD with quantile clipping (the count is all-reduced);
* secret noise: the noise is drawn once (total std σC, not √2·σC), only rank 0
  writes the run directory, the saved ledger has one entry per step, and the
  ranks end with identical parameters (``train`` checks it, or raises).

One ``mp.spawn`` runs every 2-process case (a few seconds).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from gloo_ranks import gloo_group, spawn_ranks

from dpopt.distributed import AllReduceRelease, DistributedContext, ShardedPoissonSampler, context, shard_bounds
from dpopt.engine.reference import PerSampleGrads
from dpopt.noise import NoiseSource
from dpopt.privatizer import Privatizer
from dpopt.sampling import PoissonSampler
from dpopt.training import TrainConfig, train

CASES = {
    "macadam": dict(method="dp-macadam", physical_batch_size=16),
    "quantile": dict(method="dp-sgd", clipping="quantile"),
}


def _cfg(out: Path, reproducible: bool = True, **kw) -> TrainConfig:
    return TrainConfig(
        dataset="digits",
        batch_size=64,
        epochs=0.25,
        noise_multiplier=1.0,
        seed=3,
        reproducible_noise=reproducible,
        out=str(out),
        checkpoint_every=0,
        **kw,
    )


def _noise_std(rank: int) -> float:
    """Empirical std of one secret release of an empty step on this rank (σ = C = B̄ = 1)."""
    priv = Privatizer(1.0, 1.0, 1.0, 0.5)
    priv.reduce = AllReduceRelease(context())
    priv.begin()
    release = priv.release(params_like=[torch.zeros(40_000)])
    return float(release.grads[0].std())


def _worker(rank: int, world: int, tmp: str) -> None:
    with gloo_group(rank, world, tmp):
        results = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, kw in CASES.items():
                results[name] = train(_cfg(Path(tmp) / f"ddp-{name}", **kw))
            results["secret"] = train(_cfg(Path(tmp) / "ddp-secret", reproducible=False, method="dp-sgd"))
        results["noise_std"] = _noise_std(rank)
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    spawn_ranks(_worker, tmp)
    return tmp, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def _params(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", weights_only=True)


@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_equal_one_process(ddp_runs, tmp_path, name):
    tmp, ranks = ddp_runs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        single = train(_cfg(tmp_path / "single", **CASES[name]))
    summary = ranks[0][name]
    assert summary["world_size"] == 2 and ranks[1][name] == {
        "rank": 1,
        "world_size": 2,
        "steps": single["steps"],
        "run_dir": None,
    }
    assert summary["steps"] == single["steps"] > 1
    assert summary["epsilon"] == pytest.approx(single["epsilon"], rel=1e-12)
    if name == "quantile":
        assert summary["final_max_grad_norm"] == pytest.approx(single["final_max_grad_norm"], rel=1e-5)
    a, b = _params(tmp / f"ddp-{name}"), _params(tmp_path / "single")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
    ledger_ddp = json.loads((tmp / f"ddp-{name}" / "ledger.json").read_text())
    ledger_one = json.loads((tmp_path / "single" / "ledger.json").read_text())
    assert len(ledger_ddp["entries"]) == len(ledger_one["entries"]) == single["steps"]


def test_secret_noise_run(ddp_runs):
    tmp, ranks = ddp_runs
    summary = ranks[0]["secret"]
    assert summary["noise"] == "secret" and summary["check"] == "pass" and summary["world_size"] == 2
    ledger = json.loads((tmp / "ddp-secret" / "ledger.json").read_text())
    assert len(ledger["entries"]) == summary["steps"]  # each step recorded once
    journal = (tmp / "ddp-secret" / "ledger.jsonl").read_text().splitlines()
    assert len(journal) == summary["steps"] + 1  # header + one line per step
    assert ranks[1]["secret"]["run_dir"] is None


def test_noise_drawn_once(ddp_runs):
    _, ranks = ddp_runs
    stds = [r["noise_std"] for r in ranks]
    assert stds[0] == stds[1]  # the same release on both ranks
    # 40,000 draws: the std's standard error is 1/√80000 ≈ 0.0035; √2 would be 1.414
    assert abs(stds[0] - 1.0) < 0.025


def test_shards_partition_and_reproducible_union():
    n, q, world = 1001, 0.3, 3
    bounds = [shard_bounds(n, r, world) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(bounds[r][1] == bounds[r + 1][0] for r in range(world - 1))
    one = PoissonSampler(n, q, 4, noise=NoiseSource("reproducible", seed=5))
    shards = [
        ShardedPoissonSampler(n, q, 4, DistributedContext(r, world), noise=NoiseSource("reproducible", seed=5))
        for r in range(world)
    ]
    for _ in range(4):
        union = torch.cat([s.sample() for s in shards])
        assert torch.equal(union, one.sample())


def test_single_process_release_unchanged():
    """No reduce hook: the release is bit-identical to the hook with one process drawing (sanity of _draw)."""
    g = torch.arange(12.0).reshape(3, 4)
    src = PerSampleGrads([g])
    outs = []
    for hook in (None, AllReduceRelease(DistributedContext())):
        priv = Privatizer(1.0, 5.0, 3.0, 0.1, noise=NoiseSource("reproducible", seed=1))
        priv.reduce = hook
        outs.append(priv.privatize(src).grads[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
