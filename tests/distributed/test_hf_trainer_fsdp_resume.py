"""Resume of a 2-process ``DPTrainer`` run with an FSDP2 model (``TrainingArguments(fsdp=..., fsdp_config=...)``).

Each run is killed right after ``checkpoint-2`` was written (an exception raised in ``on_save`` on both ranks) and
resumed, in a new trainer with a new unsharded model, from that checkpoint to 3 steps:

* σ = 0, q = 1 (every record in every batch: deterministic), AdamW: the resumed parameters equal the
  uninterrupted run's (the model is reloaded from the gathered checkpoint into the shards, and each rank's AdamW
  moments of its own shards from its own file — losing them would change the third update);
* σ = 1, q = 8/32, SGD: both ranks hold 3 releases and the ε of an uninterrupted 3-step run; one journal (rank 0's)
  with a header and 3 lines; each rank wrote its own optimizer-state file;
* that checkpoint resumed by a data-parallel (unsharded) trainer is refused on both ranks (its optimizer state
  is in the per-rank files).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from gloo_ranks import gloo_group, progress, spawn_ranks, torchrun_env

pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.fsdp")

import transformers as T  # noqa: E402
from test_hf_trainer_fsdp import N, Tokens, full_params, gpt2  # noqa: E402

from dpopt.accounting.accountant import dpsgd_epsilon  # noqa: E402
from dpopt.hf import DPTrainer  # noqa: E402

pytestmark = pytest.mark.distributed

WORLD, STEPS = 2, 3


class Killed(Exception):
    """The simulated kill."""


class KillAfterSave(T.TrainerCallback):
    def on_save(self, args, state, control, **kw):
        if state.global_step == 2:
            raise Killed


CASES = {
    "exact": dict(sigma=0.0, per_device=4, accumulation=4, optim="adamw_torch"),  # B-bar = 32 = N: q = 1
    "epsilon": dict(sigma=1.0, per_device=2, accumulation=2, optim="sgd"),  # B-bar = 8: q = 1/4
}


def trainer(out, case, callbacks=(), sharding=None):
    args = T.TrainingArguments(
        str(out),
        per_device_train_batch_size=case["per_device"],
        gradient_accumulation_steps=case["accumulation"],
        max_steps=STEPS,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        optim=case["optim"],
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        **({"fsdp": True, "fsdp_config": {"fsdp_version": 2}} if sharding is None else sharding),
    )
    return DPTrainer(
        model=gpt2(), args=args, train_dataset=Tokens(), noise_multiplier=case["sigma"], max_grad_norm=1e-2,
        privacy_unit="record", callbacks=list(callbacks),
    )  # fmt: skip


def _worker(rank: int, world: int, tmp: str) -> None:
    torchrun_env(rank, world)
    out = {}
    with gloo_group(rank, world, tmp), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, case in CASES.items():
            folder = Path(tmp) / name
            if name == "exact":
                whole = trainer(Path(tmp) / "uninterrupted", case)
                whole.train()
                out["uninterrupted"] = full_params(whole.model)
            first = trainer(folder, case, [KillAfterSave()])
            try:
                first.train()
            except Killed:
                pass
            second = trainer(folder, case)
            second.train(resume_from_checkpoint=str(folder / "checkpoint-2"))
            out[name] = {"params": full_params(second.model), "ledger": len(second.ledger), "eps": second.get_epsilon()}
            progress(tmp, rank, name)
        plain = trainer(Path(tmp) / "plain", CASES["epsilon"], sharding={})  # data parallel, not sharded
        try:
            plain.train(resume_from_checkpoint=str(Path(tmp) / "epsilon" / "checkpoint-2"))
        except ValueError as exc:
            out["refused"] = str(exc)
        torch.save(out, Path(tmp) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-fsdp-resume")
    spawn_ranks(_worker, tmp, stall_s=120)
    return tmp, [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_resumed_parameters_equal_the_uninterrupted_run(runs):
    _, ranks = runs
    for r in ranks:
        want, got = r["uninterrupted"], r["exact"]["params"]
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-7)
    start = full_params(gpt2())
    assert max(float((ranks[0]["uninterrupted"][n] - start[n]).abs().max()) for n in start) > 1e-3  # it trained


def test_resumed_ledger_reaches_the_uninterrupted_epsilon_with_one_journal(runs):
    tmp, ranks = runs
    want = dpsgd_epsilon(1.0, 8 / N, STEPS, 1e-5)
    for r in ranks:
        assert r["epsilon"]["ledger"] == STEPS and r["epsilon"]["eps"] == pytest.approx(want, rel=1e-9)
    journals = sorted((tmp / "epsilon").glob("ledger-*.jsonl"))
    assert len(journals) == 1 and len(journals[0].read_text().splitlines()) == STEPS + 1
    shards = sorted(p.name for p in (tmp / "epsilon" / "checkpoint-2").glob("optimizer-shard-*"))
    assert shards == ["optimizer-shard-0-of-2.pt", "optimizer-shard-1-of-2.pt"]


def test_a_sharded_checkpoint_resumed_without_sharding_is_refused(runs):
    _, ranks = runs
    for r in ranks:
        assert "was written by a sharded (FSDP2) run" in r["refused"], r.get("refused")
