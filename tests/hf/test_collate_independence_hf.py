"""DPTrainer: examples independent through its data collator (issue 33, case 5, the Hugging Face door).

``DPTrainer`` hands its ``data_collator`` to ``make_private`` as the loader's
``collate_fn``, so the first-batch check collates a few examples alone and
compares them with their rows of the padded batch (:mod:`dpopt.engine.collate_check`).
A BERT classifier on sequences of different lengths, padded to the batch's
longest by the collator:

* with the ``attention_mask`` of the true lengths (the safe form), every
  example's output is that of the example alone: it trains;
* with an all-ones mask (padding attended to), an example's output depends
  on the batch's longest sequence: refused before the first release, naming the fix.
"""

from __future__ import annotations

import warnings

import pytest
import torch

T = pytest.importorskip("transformers")

from dpopt.hf import DPTrainer  # noqa: E402

V, N = 37, 32


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


class Varying(torch.utils.data.Dataset):
    """N token sequences of lengths 2-8 (no padding id 0 inside), a class label each."""

    def __init__(self, n=N, seed=0):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, 9, (n,), generator=g)
        self.x = [torch.randint(1, V, (int(k),), generator=g) for k in lengths]
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


def collator(masked: bool):
    def collate(items):
        longest = max(len(it["input_ids"]) for it in items)
        ids = torch.zeros(len(items), longest, dtype=torch.long)
        mask = torch.zeros(len(items), longest, dtype=torch.long)
        for i, it in enumerate(items):
            ids[i, : len(it["input_ids"])] = it["input_ids"]
            mask[i, : len(it["input_ids"])] = 1
        return {
            "input_ids": ids,
            "attention_mask": mask if masked else torch.ones_like(mask),
            "labels": torch.stack([it["labels"] for it in items]),
        }

    return collate


def bert():
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
    return T.BertForSequenceClassification(cfg)


def targs(out, **kw):
    base = dict(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1000,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    base.update(kw)
    return T.TrainingArguments(str(out), **base)


def test_masked_padding_trains(tmp_path, monkeypatch):
    import dpopt.engine.hooks as hooks

    verdicts = []
    real = hooks.check_collate
    monkeypatch.setattr(hooks, "check_collate", lambda *a, **k: verdicts.append(real(*a, **k)) or verdicts[-1])
    tr = DPTrainer(
        model=bert(),
        # q = 16/32: the collate check compares examples only in a step of >= 2 examples of different lengths
        # (padding changes one's input). At q = 8/32 neither of the 2 steps had one in 3.0e-3² = 8.9e-6 of runs
        # (a batch of <= 1 example, or of equal lengths only); at q = 1/2 a step has none with probability
        # 33/2^32 + 2^-23 < 2e-7, both steps < 4e-14 (the masks are secret: a new draw every run)
        args=targs(tmp_path, gradient_accumulation_steps=4),
        train_dataset=Varying(),
        data_collator=collator(True),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
    )
    tr.train()
    assert len(tr.ledger) == 2
    assert True in verdicts  # examples were collated alone and compared (and agreed)


def test_padding_read_by_the_model_is_refused(tmp_path):
    tr = DPTrainer(
        model=bert(),
        args=targs(tmp_path, gradient_accumulation_steps=8),  # q = 1: no empty first batch (pure-noise release)
        train_dataset=Varying(),
        data_collator=collator(False),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
    )
    with pytest.raises(ValueError, match=r"collate_fn collates it alone.*mask padded positions"):
        tr.train()
    assert len(tr.ledger) == 0  # nothing released
