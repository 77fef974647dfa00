"""DPTrainer: a buffer written through ``.data`` during the private forward is refused and restored (issue 33, case 4).

The Hugging Face door is ``PrivacyEngine``'s hook capture, so the by-value
buffer check (:func:`dpopt.engine.inputs.changed_buffers`) runs there too: a
forward hook that copies an example's embedding into a buffer through
``buf.data`` (the version counter does not move) is refused naming the buffer,
nothing is released, and the buffer holds its value from before the step.
"""

from __future__ import annotations

import warnings

import pytest
import torch

T = pytest.importorskip("transformers")

from dpopt.hf import DPTrainer  # noqa: E402

V, L, N = 37, 8, 32


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=N, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(1, V, (n, L), generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": torch.ones(L, dtype=torch.long), "labels": self.y[i]}


def test_buffer_written_through_data_is_refused_and_restored(tmp_path):
    torch.manual_seed(0)
    cfg = T.BertConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
        pad_token_id=0,
    )
    model = T.BertForSequenceClassification(cfg)
    model.register_buffer("seen", torch.zeros(16))

    def keep(module, args, out):  # one record's raw embedding into a buffer (what a codebook EMA does)
        model.seen.data.copy_(out.detach()[0, 0])

    model.bert.embeddings.register_forward_hook(keep)
    args = T.TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=8,  # q = 1: at q = 1/8 the first batch is empty (one release of pure noise
        max_steps=2,  # before the refusal) with probability (7/8)^32 = 1.4 %
        logging_steps=1000,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    tr = DPTrainer(model=model, args=args, train_dataset=Tokens(), noise_multiplier=0.0, max_grad_norm=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ValueError, match=r"changed its buffers \['seen'\]"):
            tr.train()
    assert len(tr.ledger) == 0
    assert torch.equal(model.seen, torch.zeros(16))
