"""DPTrainer's door: a journal write that fails mid-run (a full disk) releases nothing (docs/correlated-noise.md,
"A ledger write that fails releases nothing"; the other doors: tests/core/test_ledger_write_failure.py)."""

from __future__ import annotations

import errno
import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import transformers as T  # noqa: E402

import dpopt.accounting.ledger as ledger_module  # noqa: E402
from dpopt.accounting.ledger import PrivacyLedger  # noqa: E402
from dpopt.errors import LedgerWriteError  # noqa: E402
from dpopt.hf import DPTrainer  # noqa: E402

V, L = 37, 8


class Tokens(torch.utils.data.Dataset):
    """32 random token sequences for a causal LM."""

    def __init__(self, n=32):
        self.x = torch.randint(1, V, (n, L), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": torch.ones(L, dtype=torch.long), "labels": self.x[i]}


class Snapshots(T.TrainerCallback):
    """The model's parameters after every optimizer step."""

    def __init__(self):
        self.params: list = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append([p.detach().clone() for p in model.parameters()])


@pytest.mark.parametrize("mechanism", ["independent", "banded:2"])
def test_a_full_disk_mid_run_stops_the_trainer_with_nothing_released(tmp_path, monkeypatch, mechanism):
    """The journal opens at the step-2 checkpoint (autoflush); the append of release 3 (0-based) fails with
    ENOSPC. train() raises LedgerWriteError (its cause, "Nothing was released"), the model is the one after
    release 2, and the ledger and the journal re-read hold releases 0-2 only (never "begin() called twice")."""
    real = ledger_module.append_whole

    def full_at_release_3(path, data, sync=True):
        if any(json.loads(line).get("step") == 3 for line in data.decode().splitlines() if line):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data, sync)

    monkeypatch.setattr(ledger_module, "append_whole", full_at_release_3)
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V, n_positions=16, bos_token_id=0, eos_token_id=0)
    snaps = Snapshots()
    args = T.TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=6,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    kw = {} if mechanism == "independent" else {"noise_mechanism": mechanism}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = DPTrainer(
            model=T.GPT2LMHeadModel(cfg),
            args=args,
            train_dataset=Tokens(),
            privacy_unit="record",
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            callbacks=[snaps],
            **kw,
        )
        with pytest.raises(
            LedgerWriteError, match=r"release 4 \(1-based\) failed.*No space left.*Nothing was released"
        ) as info:
            tr.train()
    # the advice is the trainer's (its options, its output_dir), not a manual loop's step()
    text, journal = str(info.value), next(tmp_path.glob("ledger-*.jsonl"))
    assert info.value.errno == errno.ENOSPC and isinstance(info.value.__cause__, OSError)
    assert "step()" not in text and "backward pass" not in text, text
    assert f"DPTrainer stopped: free space on the disk of {journal} (the ledger journal in output_dir)" in text
    if mechanism == "independent":
        assert "then call trainer.train(resume_from_checkpoint=True) with the same DPTrainer options" in text
        assert "continues from the last checkpoint-N in output_dir" in text
    else:
        assert "then start a new run (another output_dir): with noise_mechanism='banded:2'" in text
        assert "resume_from_checkpoint is refused" in text
    assert len(snaps.params) == 3
    assert all(torch.equal(p.detach(), q) for p, q in zip(tr.model.parameters(), snaps.params[-1]))
    journal = PrivacyLedger.read_journal(next(tmp_path.glob("ledger-*.jsonl")))
    assert [e.step for e in journal] == [0, 1, 2] and len(tr.ledger) == 3
