"""PrivacyEngine.make_private(..., distributed="fsdp") on FOUR gloo ranks (dpopt.fsdp): the two-rank checks that
depend on the world size, at W = 4 (uneven chunks: 33 rows shard 9/9/9/6, 10 rows 3/3/3/1).

* reproducible noise: the final parameters gathered from the shards equal the one-process run's (rtol 1e-4,
  atol 1e-5, as for two ranks), ε and the ledger too, and every rank's ledger is the same;
* secret noise, zero gradients: the released sum is pure noise of std σC (± 5 %, ~7.5k coordinates: a
  6.4-sigma band of the sample std), every coordinate noised (each of the 4 owners added its chunk's
  noise, once: not 2σC, not σC/2).

Marked slow: one spawn of 4 ranks (each imports torch and trains 6 + 3 steps; 4 processes share 2 cores):
115 s at load 20 (nice 10); on a quiet 2-core machine about a third of that (not measured quiet here).
"""

from __future__ import annotations

import faulthandler

import pytest
import torch
from gloo_ranks import gloo_group, progress, spawn_ranks
from test_fsdp import SIGMA, C, _train

WORLD = 4
HANG_S = 240
pytestmark = pytest.mark.slow


def _worker(rank: int, world: int, tmp: str) -> None:
    stacks = open(f"{tmp}/stacks-rank{rank}.txt", "w")
    faulthandler.dump_traceback_later(HANG_S, exit=False, file=stacks)
    with gloo_group(rank, world, tmp):
        progress(tmp, rank, "group")
        results = {"equal": _train(True, eps=True)}
        progress(tmp, rank, "equal")
        results["noise"] = _train(True, reproducible=False, zero_loss=True, steps=3, lr=0.0)
        progress(tmp, rank, "noise")
        torch.save(results, f"{tmp}/rank{rank}.pt")
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp-four")
    spawn_ranks(_worker, tmp, world=WORLD, deadline_s=HANG_S + 60, stall_s=240)  # slow is not stuck (gloo_ranks)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_four_ranks_equal_one_process(runs):
    single = _train(False, eps=True)
    for r in runs:
        res = r["equal"]
        assert res["steps"] == single["steps"] == 6
        assert res["epsilon"] == pytest.approx(single["epsilon"], rel=1e-12)
        assert res["ledger"] == runs[0]["equal"]["ledger"]
        assert [e[:2] for e in res["ledger"]] == [e[:2] for e in single["ledger"]]
        for a, b in zip(res["params"], single["params"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # 33-row tensors (Linear 0's weight and bias, LayerNorm's) in chunks of 9 (the last 6), 10-row ones of 3 (last 1)
    assert [r["equal"]["local_rows"] for r in runs] == [[9, 9, 9, 9, 3, 3]] * 3 + [[6, 6, 6, 6, 1, 1]]


def test_four_ranks_noise_std_is_sigma_c_once(runs):
    a = runs[0]["noise"]["released"]
    for r in runs[1:]:  # one global tensor: every rank gathers the same values
        for sa, sb in zip(a, r["noise"]["released"]):
            for u, v in zip(sa, sb):
                assert torch.equal(u, v)
    z = torch.cat([t.reshape(-1) for step in a for t in step]).double()
    assert z.numel() > 7000 and (z == 0).sum() == 0
    assert z.std().item() == pytest.approx(SIGMA * C, rel=0.05)
    assert abs(z.mean().item()) < 6 * SIGMA * C / z.numel() ** 0.5
