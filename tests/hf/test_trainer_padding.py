"""The zero-weight stand-in chunks DPTrainer pads an FSDP2 rank with (dpopt.hf.distributed): they add exactly 0.

Every rank of a sharded model must run the same number of forward/backward chunks per logical batch; a rank
with fewer runs stand-ins (one public row, loss × 0). Checked here on one process, through the engine's own
skip-step path (the Poisson loader's tagged batch, reproducible for the test, σ = 0, SGD with lr 1): the release with a stand-in chunk
after the batch's real chunk is bit for bit the release without it; the stand-in's row is not counted as an
example (``ReleaseBoundary.public_rows``), and without that declaration the rows-vs-examples check refuses the
step (the extra row would be an example forwarded twice). The helpers: :func:`padded` and :func:`agreed_chunks`.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("transformers")

import transformers as T  # noqa: E402

import dpopt  # noqa: E402
from dpopt.distributed import DistributedContext  # noqa: E402
from dpopt.hf.batches import stand_in  # noqa: E402
from dpopt.hf.distributed import agreed_chunks, padded  # noqa: E402
from dpopt.losses import per_example_lm_loss  # noqa: E402
from dpopt.release_boundary import boundary_of  # noqa: E402

V, L, N = 37, 8, 32


def _data():
    x = torch.randint(1, V, (N, L), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x[i], "attention_mask": torch.ones(L, dtype=torch.long), "labels": x[i]} for i in range(N)]


def _gpt2():
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V, n_positions=16, bos_token_id=0, eos_token_id=0)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return T.GPT2LMHeadModel(cfg)


def _loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return per_example_lm_loss(logits, batch["labels"]).sum()


def _release(pad: int, declare: bool = True):
    """The parameters after one release of the Poisson batch (SGD lr 1, σ = 0), with ``pad`` stand-in chunks."""
    model = _gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = dpopt.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(_data(), batch_size=8, collate_fn=torch.utils.data.default_collate),
            noise_multiplier=0.0,
            max_grad_norm=0.05,
            loss_reduction="sum",
            noise_generator=torch.Generator().manual_seed(1),  # the same Poisson batch in every call (test only)
        )
    batch = next(b for b in loader if b["input_ids"].shape[0] >= 2)  # q = 1/4: empty with probability 1e-4
    chunks = [(batch, True)] + [(stand_in(batch), False)] * pad
    opt.zero_grad()
    for i, (chunk, real) in enumerate(chunks):
        loss = _loss(model, chunk)
        (loss if real else loss * 0.0).backward()
        if not real and declare:
            boundary_of(opt).public_rows(1)
        if i < len(chunks) - 1:
            opt.signal_skip_step(True)
            opt.step()
            opt.zero_grad()
    opt.step()
    return [p.detach().clone() for p in model.parameters()], batch


def test_stand_in_chunks_add_exactly_zero_to_the_release():
    plain, batch = _release(0)
    for pad in (1, 2):
        padded_params, same = _release(pad)
        assert torch.equal(same["input_ids"], batch["input_ids"])  # the same Poisson batch (same seed)
        for a, b in zip(plain, padded_params):
            assert torch.equal(a, b)  # bit for bit: c_i · 0 = 0
    start = [p.detach() for p in _gpt2().parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(plain, start))  # the release did move the parameters


def test_an_undeclared_stand_in_row_is_refused_as_an_extra_example():
    with pytest.raises(ValueError, match="more rows than the data loader's last batch"):
        _release(1, declare=False)


def test_padded_and_agreed_chunks_on_one_process():
    one = DistributedContext()
    assert agreed_chunks(3, one) == 3
    with pytest.raises(ValueError, match="at least one chunk"):
        agreed_chunks(0, one)
    assert padded(["a", "b"], 4, "s") == [("a", True), ("b", True), ("s", False), ("s", False)]
    assert padded([], 1, "s") == [("s", False)]
    with pytest.raises(ValueError, match="more chunks than the ranks agreed on") as e:
        padded(["a", "b"], 1, "s")
    assert not any(ch.isdigit() for ch in str(e.value))  # realised chunk counts are private: never in a message
    with pytest.raises(ValueError, match=">= 0"):
        boundary_of(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)).public_rows(-1)
