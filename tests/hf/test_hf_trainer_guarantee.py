"""DPTrainer's guarantee (issue 33, case 7; and the DPTrainer door of cases 1-3).

Before (main fb334df): target_epsilon resumed to a larger max_steps recalibrated σ for the new steps alone
(ε 3.541 for a target of 3, no warning); TrainingArguments.max_grad_norm = 0.1 was ignored (clipped at 1.0);
packed texts made the 16-token block the privacy unit silently; the epoch counter restarted after a resume;
a user's log keys were dropped. Tiny models from configs (tests/hf/test_trainer.py's helpers).
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import transformers as T  # noqa: E402
from test_trainer import L, Tokens, V, bert, gpt2, targs, trainable  # noqa: E402

from dpopt.hf import DPTrainer  # noqa: E402
from dpopt.hf.trainer import LEDGER_FILE, SUMMARY_FILE  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _ckpt(**kw):
    return dict(save_strategy="steps", save_steps=2, **kw)


# -- target_epsilon over the whole run, resumed ---------------------------------------------
@pytest.mark.slow
def test_target_epsilon_resumed_to_more_steps_is_calibrated_with_the_spent_releases(tmp_path):
    tr = DPTrainer(
        model=bert(),
        args=targs(tmp_path, max_steps=2, **_ckpt()),
        train_dataset=Tokens(classes=3),
        target_epsilon=3.0,
        delta=1e-5,
        privacy_unit="record",
    )
    tr.train()
    first = tr.noise_multiplier
    assert tr.get_epsilon() <= 3.0
    tr2 = DPTrainer(
        model=bert(),
        args=targs(tmp_path, max_steps=6, **_ckpt()),
        train_dataset=Tokens(classes=3),
        target_epsilon=3.0,
        delta=1e-5,
        privacy_unit="record",
    )
    tr2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert len(tr2.ledger) == 6
    eps = tr2.get_epsilon()
    assert eps <= 3.0 and eps == pytest.approx(3.0, rel=0.03)  # before: 3.541 (sigma for 4 steps from zero)
    assert tr2.noise_multiplier > first  # the 4 remaining steps pay for the 2 already spent


def test_target_epsilon_already_spent_is_refused_on_resume(tmp_path):
    tr = DPTrainer(
        model=bert(),
        args=targs(tmp_path, max_steps=2, **_ckpt()),
        train_dataset=Tokens(classes=3),
        noise_multiplier=0.6,
        privacy_unit="record",
    )
    tr.train()
    spent = tr.get_epsilon()
    tr2 = DPTrainer(
        model=bert(),
        args=targs(tmp_path, max_steps=4, **_ckpt()),
        train_dataset=Tokens(classes=3),
        target_epsilon=spent * 0.9,
        privacy_unit="record",
    )
    with pytest.raises(ValueError, match="already out of reach.*raise target_epsilon"):
        tr2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


# -- TrainingArguments.max_grad_norm is C, or a conflict is refused ----------------------------
def _one_example_update(tr, model):
    """σ = 0, SGD lr 1: (θ before − θ after) × B̄ = the clipped gradient of one example."""
    # a non-empty Poisson batch handed out: the step on one example of ours is its release
    next(b for b in tr.get_train_dataloader() if len(b["input_ids"]) > 0)
    one = {k: torch.stack([Tokens()[0][k]]) for k in ("input_ids", "attention_mask", "labels")}
    before = trainable(model)
    tr.training_step(model, one)
    tr.optimizer.step()
    after = trainable(model)
    return math.sqrt(
        sum(float(((before[n] - after[n]) * tr.expected_batch_size).double().square().sum()) for n in before)
    )


def test_a_user_set_training_arguments_max_grad_norm_is_the_bound(tmp_path):
    model = gpt2()
    tr = DPTrainer(
        model=model,
        args=targs(tmp_path, max_grad_norm=0.1),
        train_dataset=Tokens(),
        noise_multiplier=0.0,
        privacy_unit="record",
        method=torch.optim.SGD(model.parameters(), lr=1.0),
    )
    assert tr.max_grad_norm == 0.1 and tr.args.max_grad_norm == 0.0
    moved = _one_example_update(tr, model)
    assert tr.optimizer.max_grad_norm == pytest.approx(0.1)
    assert moved == pytest.approx(0.1, rel=1e-4)  # clipped at 0.1 (before: at 1.0, DPTrainer's default)


def test_max_grad_norm_conflicts_are_refused_and_defaults_agree(tmp_path):
    with pytest.raises(ValueError, match="disagree.*Set it in one place"):
        DPTrainer(
            model=gpt2(),
            args=targs(tmp_path, max_grad_norm=0.1),
            train_dataset=Tokens(),
            noise_multiplier=1.0,
            max_grad_norm=0.5,
        )
    with pytest.raises(ValueError, match="no clipping.*DPTrainer\\(max_grad_norm=C\\)"):
        DPTrainer(model=gpt2(), args=targs(tmp_path, max_grad_norm=0.0), train_dataset=Tokens(), noise_multiplier=1.0)
    same = DPTrainer(
        model=gpt2(),
        args=targs(tmp_path, max_grad_norm=0.5),
        train_dataset=Tokens(),
        noise_multiplier=1.0,
        max_grad_norm=0.5,
    )
    assert same.max_grad_norm == 0.5
    default = DPTrainer(
        model=gpt2(), args=targs(tmp_path), train_dataset=Tokens(), noise_multiplier=1.0, max_grad_norm=0.3
    )  # args at the dataclass default 1.0: not user-set
    assert default.max_grad_norm == 0.3
    assert (
        DPTrainer(model=gpt2(), args=targs(tmp_path), train_dataset=Tokens(), noise_multiplier=1.0).max_grad_norm == 1.0
    )


# -- packing: the unit is the block, said at run time ---------------------------------------
def group_texts(records, block):
    """run_clm's group_texts: concatenate every record's tokens, cut into blocks, labels = input_ids."""
    ids = [t for r in records for t in r]
    n = len(ids) // block * block
    return [
        {"input_ids": ids[i : i + block], "attention_mask": [1] * block, "labels": ids[i : i + block]}
        for i in range(0, n, block)
    ]


def test_packed_texts_are_detected_warned_and_recorded(tmp_path):
    g = torch.Generator().manual_seed(0)
    records = [torch.randint(1, V, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (40,), generator=g)]
    blocks = group_texts(records, 8)
    args = targs(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, logging_steps=1)
    with pytest.warns(UserWarning, match="looks packed.*BLOCK of 8 tokens"):
        tr = DPTrainer(
            model=gpt2(), args=args, train_dataset=blocks, noise_multiplier=1.0, data_collator=T.default_data_collator
        )
        out = tr.train()
    assert tr.block_tokens == 8 and tr.ledger.privacy_unit == "block of 8 tokens"
    saved = json.loads((tmp_path / "checkpoint-2" / LEDGER_FILE).read_text())
    summary = json.loads((tmp_path / "checkpoint-2" / SUMMARY_FILE).read_text())
    assert saved["privacy_unit"] == "block of 8 tokens" and summary["privacy_unit"] == "block of 8 tokens"
    assert out.metrics["privacy_unit_tokens"] == 8
    assert any(row.get("privacy_unit_tokens") == 8 for row in tr.state.log_history)


def test_declared_examples_and_classifiers_are_not_taken_as_packed(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tr = DPTrainer(
            model=gpt2(),
            args=targs(tmp_path, max_steps=1),
            train_dataset=Tokens(),
            noise_multiplier=1.0,
            privacy_unit="record",
        )
        tr.get_train_dataloader()
        cls = DPTrainer(
            model=bert(), args=targs(tmp_path, max_steps=1), train_dataset=Tokens(classes=3), noise_multiplier=1.0
        )
        cls.get_train_dataloader()
    assert tr.block_tokens is None and tr.ledger.privacy_unit is None and cls.block_tokens is None
    declared = DPTrainer(
        model=gpt2(), args=targs(tmp_path, max_steps=1), train_dataset=Tokens(), noise_multiplier=1.0, privacy_unit=L
    )
    declared.get_train_dataloader()
    assert declared.ledger.privacy_unit == f"block of {L} tokens"
    named = DPTrainer(
        model=gpt2(),
        args=targs(tmp_path, max_steps=1),
        train_dataset=Tokens(),
        noise_multiplier=1.0,
        privacy_unit="block",
    )  # declared; N read from the blocks
    named.get_train_dataloader()
    assert named.block_tokens == L and named.ledger.privacy_unit == f"block of {L} tokens"
    with pytest.raises(ValueError, match="privacy_unit"):
        DPTrainer(
            model=gpt2(), args=targs(tmp_path), train_dataset=Tokens(), noise_multiplier=1.0, privacy_unit="person"
        )  # not a unit (user-level DP: tests/hf/test_hf_user_level.py)


# -- epoch counter and user log keys ----------------------------------------------------------
def test_the_epoch_counter_continues_after_resume(tmp_path):
    # B-bar = 4 over N = 32: 8 Poisson steps per epoch
    tr = DPTrainer(
        model=gpt2(),
        args=targs(tmp_path, max_steps=2, logging_steps=1, **_ckpt()),
        train_dataset=Tokens(),
        noise_multiplier=1.0,
        privacy_unit="record",
    )
    tr.train()
    assert tr.state.epoch == pytest.approx(2 / 8)
    tr2 = DPTrainer(
        model=gpt2(),
        args=targs(tmp_path, max_steps=4, logging_steps=1, **_ckpt()),
        train_dataset=Tokens(),
        noise_multiplier=1.0,
        privacy_unit="record",
    )
    tr2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    epochs = [row["epoch"] for row in tr2.state.log_history if "epsilon" in row and "train_runtime" not in row]
    assert epochs[-2:] == [pytest.approx(3 / 8), pytest.approx(4 / 8)]  # before: 1/8, 2/8 (restarted)
    assert tr2.state.epoch == pytest.approx(4 / 8)


def test_user_log_keys_pass_through_and_private_keys_do_not(tmp_path):
    class Mine(T.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            self.trainer.log({"my_public_metric": 7.0, "loss": 1.25})

    cb = Mine()
    tr = DPTrainer(
        model=gpt2(),
        args=targs(tmp_path, max_steps=2),
        train_dataset=Tokens(),
        noise_multiplier=1.0,
        privacy_unit="record",
        callbacks=[cb],
    )
    cb.trainer = tr
    tr.train()
    rows = [r for r in tr.state.log_history if "my_public_metric" in r]
    assert len(rows) == 2 and all(r["my_public_metric"] == 7.0 and "loss" not in r and "epsilon" in r for r in rows)
    assert all("loss" not in r and "grad_norm" not in r and "train_loss" not in r for r in tr.state.log_history)


# -- the release boundary through DPTrainer (cases 1 and 3) --------------------------------------
def test_an_example_forwarded_twice_by_the_collator_is_refused(tmp_path):
    """K = 1: a collator that repeats a row gives the step more rows than the Poisson batch had examples.

    q = 1 (B-bar = 8 x 4 = N): at q = 1/8 the first Poisson batch is empty with probability (7/8)^32 = 1.4 %,
    and that empty batch is one honest release of pure noise before the refusal (the ledger then has 1 entry)."""

    def doubling(items):
        return T.default_data_collator(list(items) + list(items[:1]))

    tr = DPTrainer(
        model=gpt2(),
        args=targs(tmp_path, max_steps=2, per_device_train_batch_size=8, gradient_accumulation_steps=4),
        train_dataset=Tokens(),
        noise_multiplier=1.0,
        privacy_unit="record",
        data_collator=doubling,
    )
    with pytest.raises(ValueError, match="more rows than the data loader's last batch had examples"):
        tr.train()
    assert len(tr.ledger) == 0


def test_a_step_left_open_by_a_failed_training_step_is_closed_before_the_next_batch(tmp_path):
    """An exception between the chunks of one Poisson batch leaves the step open; the next batch drawn releases
    it on its own (one charged release) instead of adding the next batch into it."""
    model = gpt2()
    tr = DPTrainer(
        model=model,
        args=targs(tmp_path, gradient_accumulation_steps=4, max_steps=2),
        train_dataset=Tokens(),
        noise_multiplier=0.0,
        privacy_unit="record",
        method=torch.optim.SGD(model.parameters(), lr=1.0),
    )
    loader = tr.get_train_dataloader()
    it = iter(loader)
    batch = next(it)
    while batch["input_ids"].shape[0] < 3:  # a batch of >= 2 chunks (chunks of at most 2 examples)
        batch = next(it)
    calls = []
    orig = tr._losses

    def failing(m, inputs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the second chunk fails")
        return orig(m, inputs)

    tr._losses = failing
    with pytest.raises(RuntimeError, match="second chunk"):
        tr.training_step(model, batch)
    assert tr.optimizer._open and len(tr.ledger) == 0  # the first chunk was added
    next(it)  # a new Poisson batch is drawn: the open step is released on its own
    assert not tr.optimizer._open and len(tr.ledger) == 1
