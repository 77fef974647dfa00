"""``dpopt train --noise-mechanism`` under data parallel (dpopt.training.train in 2 gloo processes, as torchrun runs
it), against the one-process run (issue 36: "DDP adds the stream once per coordinate").

digits (N = 1437 training records after the default split), batch 256: b = round(N/256) = 6 cyclic batches, 1.5
epochs → T = round(1.5 × 6) = 9 steps, k = 2 participations. Both runs cut the same public partition (``secrets.randbits`` fixed)
and use the same reproducible noise (``--reproducible-noise``: research mode, test only):

* each rank draws a slice of every cyclic batch (disjoint; the union is the one-process batch) and rank 0 alone adds
  the stream, so the final parameters equal the one-process run's within 1e-5 absolute + 1e-4 relative (float32;
  only the summation order differs) — every rank adding the noise moves them by ~σC·lr/B̄ per step, far beyond;
* ε, the ledger's mechanism record and its entries are the one-process run's; one run directory (rank 0's) and one
  journal with a header and a line per release;
* ``--sampling cyclic-poisson --sample-rate 0.5 --noise-mechanism banded:2`` (b' = round(0.5 × 6) = 3 parts,
  T = 9): with reproducible noise each rank Poisson-samples its slice of part t mod 3 and the union is the
  one-process batch every step; the parameters, ε and the ledger's mechanism record are the one-process run's;
* secret noise, cyclic Poisson (rank 0 alone streams; each rank samples its slice from its own source): ``train``
  finds the replicas bit-identical (it raises otherwise) and ``dpopt check``'s verdict on the run directory
  passes (the mechanism record re-derives every amplified event).
"""

from __future__ import annotations

import json
import types
import warnings
from pathlib import Path

import pytest
import torch
from gloo_ranks import gloo_group, spawn_ranks

import dpopt.training.build as build_module
from dpopt.cyclic_batches import CyclicBatchSampler, CyclicPoissonBatchSampler
from dpopt.training import TrainConfig, train

pytestmark = pytest.mark.distributed


def _cfg(out: Path, **kw) -> TrainConfig:
    base: dict = dict(
        dataset="digits",
        method="dp-adam",
        batch_size=256,
        epochs=1.5,
        noise_multiplier=2.0,
        max_grad_norm=1.0,
        lr=0.01,
        seed=3,
        reproducible_noise=True,
        noise_mechanism="blt:2",
        out=str(out),
        checkpoint_every=0,
    )
    base.update(kw)
    return TrainConfig(**base)


POISSON = dict(noise_mechanism="banded:2", sampling="cyclic-poisson", sample_rate=0.5)  # b' = 3 parts, T = 9


def _train(out: Path, **kw) -> dict:
    """train() with the public partition fixed, and the indices of every batch this process drew."""
    real, seen = build_module.secrets, []
    sampler = CyclicPoissonBatchSampler if kw.get("sampling") == "cyclic-poisson" else CyclicBatchSampler
    original = sampler.sample

    def sample(self):
        idx = original(self)
        seen.append(sorted(idx.tolist()))
        return idx

    build_module.secrets = types.SimpleNamespace(randbits=lambda k: 4321)
    sampler.sample = sample  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            summary = train(_cfg(out, **kw))
    finally:
        build_module.secrets = real
        sampler.sample = original  # type: ignore[method-assign]
    return {"summary": summary, "batches": seen}


def _worker(rank: int, world: int, tmp: str) -> None:
    with gloo_group(rank, world, tmp):
        result = _train(Path(tmp) / "ddp")
        result["poisson"] = _train(Path(tmp) / "cp", **POISSON)
        result["secret"] = _train(Path(tmp) / "secret", reproducible_noise=False, **POISSON)
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-mf-ddp")
    spawn_ranks(_worker, tmp)
    single = _train(tmp / "single")
    single["poisson"] = _train(tmp / "cp-single", **POISSON)
    return tmp, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)], single


def test_each_rank_a_disjoint_slice_of_the_one_process_batch(runs):
    _, ranks, single = runs
    steps = single["summary"]["steps"]
    assert steps == 9 and len(single["batches"]) == steps
    for t, batch in enumerate(single["batches"]):
        a, b = (r["batches"][t] for r in ranks)
        assert a and b and not set(a) & set(b) and sorted(a + b) == batch
    assert single["batches"][6:] == single["batches"][:3]  # b = 6: the cycle repeats


def test_parameters_epsilon_and_ledger_equal_one_process(runs):
    tmp, ranks, single = runs
    one, two = single["summary"], ranks[0]["summary"]
    assert two["world_size"] == 2 and two["steps"] == one["steps"]
    assert ranks[1]["summary"]["run_dir"] is None  # rank 0 alone writes the run directory
    assert two["epsilon"] == pytest.approx(one["epsilon"], rel=1e-12)
    a = torch.load(tmp / "ddp" / "model.pt", weights_only=True)
    b = torch.load(tmp / "single" / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
    ledgers = [json.loads((tmp / d / "ledger.json").read_text()) for d in ("ddp", "single")]
    assert ledgers[0]["mechanism"] == ledgers[1]["mechanism"] and ledgers[0]["mechanism"]["kind"] == "blt"
    assert len(ledgers[0]["entries"]) == len(ledgers[1]["entries"]) == one["steps"]
    journal = (tmp / "ddp" / "ledger.jsonl").read_text().splitlines()
    assert len(journal) == one["steps"] + 1  # a header and one line per release


def test_cyclic_poisson_equals_one_process(runs):
    tmp, ranks, single = runs
    one, two = single["poisson"], [r["poisson"] for r in ranks]
    assert one["summary"]["steps"] == two[0]["summary"]["steps"] == len(one["batches"]) == 9
    for t, batch in enumerate(one["batches"]):  # each rank its Poisson sample of its slice; the union is one's
        a, b = (r["batches"][t] for r in two)
        assert not set(a) & set(b) and sorted(a + b) == batch
    assert one["batches"][3:6] != one["batches"][:3]  # the parts are resampled each cycle (not fixed batches)
    assert two[0]["summary"]["epsilon"] == pytest.approx(one["summary"]["epsilon"], rel=1e-12)
    a = torch.load(tmp / "cp" / "model.pt", weights_only=True)
    b = torch.load(tmp / "cp-single" / "model.pt", weights_only=True)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
    ledgers = [json.loads((tmp / d / "ledger.json").read_text()) for d in ("cp", "cp-single")]
    assert ledgers[0]["mechanism"] == ledgers[1]["mechanism"]
    assert (ledgers[0]["mechanism"]["sample_rate"], ledgers[0]["mechanism"]["min_separation"]) == (0.5, 3)
    assert ledgers[0]["sampling"] == ledgers[1]["sampling"] and "cyclic poisson" in ledgers[0]["sampling"]
    assert [e["event"] for e in ledgers[0]["entries"]] == [e["event"] for e in ledgers[1]["entries"]]


def test_secret_noise_run_checks(runs):
    tmp, ranks, _ = runs
    summary = ranks[0]["secret"]["summary"]
    assert summary["noise"] == "secret" and summary["world_size"] == 2 and summary["check"] == "pass"
    assert ranks[1]["secret"]["summary"]["run_dir"] is None
    ledger = json.loads((tmp / "secret" / "ledger.json").read_text())
    assert ledger["mechanism"]["kind"] == "banded" and ledger["mechanism"]["sample_rate"] == 0.5
    assert len(ledger["entries"]) == summary["steps"] == 9
