"""DPTrainer(privacy_unit="user", user_column=...): users sampled and clipped as units (dpopt.users).

Tiny GPT-2 from a config (tests/hf/test_trainer.py's helpers). σ = 0 and SGD at lr 1: the update × B̄
is the clipped sum, so removing one user (all their records) must move it by at most C — exactly C
when every user's mean gradient is clipped — for users with 1, k and more than k records, with
physical chunks (per_device_train_batch_size 1) smaller than most users: a chunk is a whole user.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from test_trainer import L, V, gpt2, pld_epsilon, targs, trainable  # noqa: E402

from dpopt.hf import DPTrainer  # noqa: E402
from dpopt.hf.trainer import SUMMARY_FILE  # noqa: E402

K = 3


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


class UserTokens(torch.utils.data.Dataset):
    """Random token sequences, each with a ``user_id``; the records of user ``same`` are all equal
    (so which k of them are drawn changes no value)."""

    def __init__(self, sizes, same=None, drop=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        ids = [u for u, s in enumerate(sizes) for _ in range(s)]
        x = torch.randint(1, V, (len(ids), L), generator=g)
        if same is not None:
            rows = [i for i, u in enumerate(ids) if u == same]
            x[rows] = x[rows[0]].clone()
        keep = [i for i, u in enumerate(ids) if u != drop]
        self.x, self.ids = x[keep], [ids[i] for i in keep]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {
            "input_ids": self.x[i],
            "attention_mask": torch.ones(L, dtype=torch.long),
            "labels": self.x[i],
            "user_id": self.ids[i],
        }


def _clipped_sum(tmp_path, data, c, users):
    """One σ = 0 step at q_user = 1 (B̄ = N_users): (θ before − θ after) × B̄, flattened."""
    model = gpt2()
    tr = DPTrainer(
        model=model,
        args=targs(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_grad_norm=c),
        train_dataset=data,
        noise_multiplier=0.0,
        privacy_unit="user",
        max_records_per_user=K,
        method=torch.optim.SGD(model.parameters(), lr=1.0),
    )
    tr.per_device_batch, tr.accumulation = 1, users  # B̄ = all users: q_user = 1; a chunk per user
    loader = tr.get_train_dataloader()
    assert tr.sample_rate == 1.0 and tr.expected_batch_size == users
    batch = next(iter(loader))
    before = trainable(model)
    tr.training_step(model, batch)
    tr.optimizer.step()
    after = trainable(model)
    return torch.cat([((before[n] - after[n]) * users).double().flatten() for n in before])


@pytest.mark.parametrize("removed", [0, 1, 2])  # 1, k and more than k records
def test_sigma_zero_removing_one_user_moves_the_update_by_at_most_c(tmp_path, removed):
    sizes = [1, K, K + 3, 2]
    c = 1e-3  # every user's mean gradient is clipped
    full = _clipped_sum(tmp_path / "a", UserTokens(sizes, same=2), c, 4)
    less = _clipped_sum(tmp_path / "b", UserTokens(sizes, same=2, drop=removed), c, 3)
    # B̄ differs (N_users is public): compare clipped sums, the release before noise and division
    moved = float((full - less).norm())
    assert moved <= c * (1 + 1e-4)
    assert moved == pytest.approx(c, rel=1e-3)  # one unit of norm C (per-record clipping: up to k·C)


def test_user_level_run_epsilon_ledger_and_summary(tmp_path):
    data = UserTokens([1, 2, 3, 4, 5, 1, 2, 3] * 2)  # 16 users, 40 records
    tr = DPTrainer(
        model=gpt2(),
        args=targs(tmp_path, max_steps=3, save_strategy="steps", save_steps=3),
        train_dataset=data,
        noise_multiplier=0.8,
        privacy_unit="user",
        user_column="user_id",
        max_records_per_user=2,
        delta=1e-3,
    )
    out = tr.train()
    q = 1.0 / math.ceil(16 / 4)  # B̄ = 2 × 2 users
    assert tr.sample_rate == q and tr.expected_batch_size == pytest.approx(q * 16)
    assert tr.get_epsilon() == pytest.approx(pld_epsilon(0.8, q, 3, 1e-3), rel=1e-6)
    assert out.metrics["epsilon"] == pytest.approx(tr.get_epsilon())
    assert tr.ledger.privacy_unit == "user (at most 2 records each)" and tr.ledger.num_users == 16
    summary = json.loads((tmp_path / "checkpoint-3" / SUMMARY_FILE).read_text())
    assert summary["privacy_unit"] == "user (at most 2 records each)"
    assert summary["num_users"] == 16 and summary["max_records_per_user"] == 2
    tr.model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)


def test_user_unit_refusals(tmp_path):
    from test_trainer import Tokens

    tr = DPTrainer(
        model=gpt2(), args=targs(tmp_path), train_dataset=Tokens(), noise_multiplier=1.0, privacy_unit="user"
    )
    with pytest.raises(ValueError, match="no 'user_id' key"):
        tr.get_train_dataloader()
    with pytest.raises(ValueError, match="max_records_per_user"):
        DPTrainer(
            model=gpt2(),
            args=targs(tmp_path),
            train_dataset=Tokens(),
            noise_multiplier=1.0,
            privacy_unit="user",
            max_records_per_user=0,
        )


def test_split_by_user_cuts_between_users_only():
    from dpopt.hf.batches import split_by_user

    slots = torch.tensor([0, 1, 1, 1, 2, 3, 3])
    inputs = {"input_ids": torch.arange(7).view(7, 1)}
    chunks = split_by_user(inputs, slots, 2)
    assert [c["input_ids"].flatten().tolist() for c in chunks] == [[0], [1, 2, 3], [4], [5, 6]]
    assert [c["input_ids"].flatten().tolist() for c in split_by_user(inputs, slots, 5)] == [[0, 1, 2, 3, 4], [5, 6]]
    with pytest.raises(ValueError, match="do not match"):
        split_by_user(inputs, slots[:5], 2)
