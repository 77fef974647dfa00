"""DPTrainer with bf16: bf16 WEIGHTS (``model.to(torch.bfloat16)``) and ``bf16=True`` (autocast, float32
weights), one process on CPU. σ = 0 and q = 1 (the batch is the whole dataset, so the neighbour without one
example gives the same batches minus that example): the run completes, the ledger records every release
(σ = 0), and removing example j moves the clipped sum (float32, recorded in the Privatizer before the release
is rounded to the parameters' dtype) by at most C — by C itself to float32 rounding, since every example is
clipped (C far below every per-example norm).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

import transformers as T  # noqa: E402

from dpopt.hf import DPTrainer  # noqa: E402
from dpopt.privatizer import Privatizer  # noqa: E402

V, L, N, C, STEPS = 37, 8, 6, 1e-3, 2


class Tokens(torch.utils.data.Dataset):
    def __init__(self, drop=None):
        x = torch.randint(1, V, (N, L), generator=torch.Generator().manual_seed(0))
        self.x = x if drop is None else x[torch.arange(N) != drop]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": torch.ones(L, dtype=torch.long), "labels": self.x[i]}


def _run(tmp_path, mode: str, drop, sums: list):
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V, n_positions=16, bos_token_id=0, eos_token_id=0,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip  # no dropout: same g_i each run
    model = T.GPT2LMHeadModel(cfg)
    if mode == "weights":
        model = model.to(torch.bfloat16)
    data = Tokens(drop)
    args = T.TrainingArguments(
        str(tmp_path / f"{mode}-{drop}"), per_device_train_batch_size=len(data), max_steps=STEPS,
        learning_rate=0.0, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, bf16=mode == "autocast",
    )  # fmt: skip
    before = len(sums)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # σ = 0: not private (warned)
        tr = DPTrainer(model=model, args=args, train_dataset=data, noise_multiplier=0.0, max_grad_norm=C,
                       privacy_unit="record")  # fmt: skip
        tr.train()
    assert tr.sample_rate == 1.0  # the whole dataset in every batch
    assert len(tr.ledger) == STEPS and [e.step for e in tr.ledger.entries] == list(range(STEPS))
    assert all(e.meta["noise_multiplier"] == 0.0 for e in tr.ledger.entries)
    want = torch.bfloat16 if mode == "weights" else torch.float32
    assert all(p.dtype == want for p in model.parameters())
    return sums[before:]


@pytest.mark.parametrize("mode", ["weights", "autocast"])
def test_dptrainer_bf16_sigma_zero_sensitivity_within_c(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # restored: later float32 trainers stay float32
    sums: list = []
    add_noise = Privatizer._add_noise

    def recorded(self, std, dtypes):
        assert std == 0.0 and all(s.dtype == torch.float32 for s in self._sum)  # float32 sums
        sums.append(torch.cat([s.reshape(-1) for s in self._sum]).double())
        return add_noise(self, std, dtypes)

    monkeypatch.setattr(Privatizer, "_add_noise", recorded)
    full = _run(tmp_path, mode, None, sums)
    assert len(full) == STEPS
    assert float(full[0].norm()) > 0
    for j in (0, N - 1):
        less = _run(tmp_path, mode, j, sums)
        for a, b in zip(full, less):  # lr = 0: the same parameters at every step
            moved = float((a - b).norm())
            # ≤ C (the bound); = C to float32 rounding of the sums (every example is clipped to C exactly)
            assert C * (1 - 1e-4) <= moved <= C * (1 + 1e-5), moved / C
