"""Resume of a 2-process ``DPTrainer`` run (gloo, CPU): the ledger continues on every rank, one journal.

* stopped right after ``checkpoint-2`` was written (a kill between steps), resumed to 4 steps with 2
  processes: both ranks hold 4 releases and the ε of an uninterrupted 4-step run; the journal (rank 0's
  only) has a header and 4 lines;
* stopped after step 3, whose release was made but is in no checkpoint, resumed from ``checkpoint-2``:
  the journal keeps that release charged — 3 + 2 = 5 releases on BOTH ranks (rank 1 takes rank 0's
  record), none written twice;
* the 2-process checkpoint resumed by ONE process with the same B̄ (gradient accumulation doubled):
  the same q, the ledger continues (6 releases, ε of 6 steps).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from gloo_ranks import gloo_group, spawn_ranks, torchrun_env

pytest.importorskip("transformers")

import transformers as T  # noqa: E402

from dpopt.accounting.accountant import dpsgd_epsilon  # noqa: E402
from dpopt.hf import DPTrainer  # noqa: E402

pytestmark = pytest.mark.slow  # 6 trainer runs in 2 processes: ~40 s quiet, longer on a loaded machine

V, L, N, SIGMA = 37, 8, 32, 1.0
Q = 8 / N  # B-bar = 2 x 2 x 2 processes


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randint(1, V, (N, L), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": torch.ones(L, dtype=torch.long), "labels": self.x[i]}


class Killed(Exception):
    """The simulated kill."""


class KillAt(T.TrainerCallback):
    def __init__(self, step: int, when: str):
        self.step, self.when = step, when

    def on_save(self, args, state, control, **kw):
        if self.when == "save" and state.global_step == self.step:
            raise Killed

    def on_step_end(self, args, state, control, **kw):
        if self.when == "step" and state.global_step == self.step:
            raise Killed


def trainer(out, max_steps, accumulation=2, callbacks=()):
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(
        T.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V, n_positions=16, bos_token_id=0, eos_token_id=0)
    )
    args = T.TrainingArguments(
        str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    return DPTrainer(
        model=model,
        args=args,
        train_dataset=Tokens(),
        noise_multiplier=SIGMA,
        max_grad_norm=1.0,
        privacy_unit="record",
        callbacks=list(callbacks),
    )


def _worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    torchrun_env(rank, world)
    results = {}
    with gloo_group(rank, world, tmp), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, when, stop in (("clean", "save", 2), ("lost", "step", 3)):
            out = Path(tmp) / name
            try:
                trainer(out, 4, callbacks=[KillAt(stop, when)]).train()
            except Killed:
                pass
            dist.barrier()  # a restart after a kill: every process is gone, rank 0's files are complete
            again = trainer(out, 4)
            again.train(resume_from_checkpoint=str(out / "checkpoint-2"))
            results[name] = {"releases": len(again.ledger), "epsilon": again.get_epsilon(), "q": again.sample_rate}
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-ddp-resume")
    spawn_ranks(_worker, tmp)
    return tmp, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def _journal(run: Path) -> list:
    journals = sorted(run.glob("ledger-*.jsonl"))
    assert len(journals) == 1, journals
    return journals[0].read_text().splitlines()


def test_resume_after_a_kill_between_steps_reaches_the_uninterrupted_epsilon(resumed):
    tmp, ranks = resumed
    want = dpsgd_epsilon(SIGMA, Q, 4, 1e-5)
    for r in ranks:
        assert r["clean"]["releases"] == 4 and r["clean"]["q"] == Q
        assert r["clean"]["epsilon"] == pytest.approx(want, rel=1e-9)
    assert len(_journal(tmp / "clean")) == 1 + 4


def test_a_release_after_the_checkpoint_stays_charged_on_every_rank(resumed):
    tmp, ranks = resumed
    want = dpsgd_epsilon(SIGMA, Q, 5, 1e-5)
    for r in ranks:
        assert r["lost"]["releases"] == 5
        assert r["lost"]["epsilon"] == pytest.approx(want, rel=1e-9)
    assert len(_journal(tmp / "lost")) == 1 + 5  # each release once: rank 1 never appended


def test_one_process_resumes_a_two_process_checkpoint_at_the_same_bbar(resumed, tmp_path):
    tmp, _ = resumed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = trainer(tmp / "clean", 6, accumulation=4)  # B-bar = 2 x 4 x 1 = 8: the same q
        one.train(resume_from_checkpoint=str(tmp / "clean" / "checkpoint-4"))
    assert one.sample_rate == Q and len(one.ledger) == 6
    assert one.get_epsilon() == pytest.approx(dpsgd_epsilon(SIGMA, Q, 6, 1e-5), rel=1e-9)
    assert len(_journal(tmp / "clean")) == 1 + 6
