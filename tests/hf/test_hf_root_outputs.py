"""A model whose root output also carries tensors it uses itself (an encoder-decoder's
``encoder_last_hidden_state``): the first step of a model with enclosing-call parameters
(``engine.lift``) runs its pass again with the gradients recorded at the root's outputs; those must
be only the gradients from outside the model. Before fresh views were hooked there, the re-run
counted the encoder's gradient twice (every encoder parameter's update 2× on step 0 for T5; found
by a fresh user, 2026-12-06); later steps were exact, so a test of one later step could not see it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader

T = pytest.importorskip("transformers")

import dpopt  # noqa: E402

B, L, V = 4, 8, 64


def _t5():
    cfg = T.T5Config(
        vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0, decoder_start_token_id=0
    )
    return T.T5ForConditionalGeneration(cfg)


def _bart():
    cfg = T.BartConfig(
        vocab_size=V,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    return T.BartForConditionalGeneration(cfg)


def _examples(n: int) -> list:
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(3, V, (L,), generator=g)
        out.append({"input_ids": ids, "decoder_input_ids": torch.randint(3, V, (L,), generator=g), "labels": ids})
    return out


def _per_example_loss(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], decoder_input_ids=batch["decoder_input_ids"]).logits
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").mean(1)


def _clipped_sum(model, batch, c: float) -> list:
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(B):  # each example alone
        one = {k: v[i : i + 1] for k, v in batch.items()}
        g = torch.autograd.grad(_per_example_loss(model, one).sum(), params, allow_unused=True)
        g = [torch.zeros_like(p) if x is None else x for p, x in zip(params, g)]
        n = float(torch.sqrt(sum((x * x).sum() for x in g)))
        norms.append(n)
        for t, x in zip(total, g):
            t += min(1.0, c / n) * x
    return total, norms


@pytest.mark.parametrize("build", [_t5, _bart], ids=["t5", "bart"])
def test_first_step_of_an_encoder_decoder_root_is_exact(build):
    torch.manual_seed(0)
    model = build().double().train()
    data = _examples(B)
    batch = next(iter(DataLoader(data, batch_size=B)))
    _, norms = _clipped_sum(model, batch, float("inf"))
    c = sorted(norms)[1]  # half of the examples clipped
    want, _ = _clipped_sum(model, batch, c)
    engine = dpopt.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    private, opt, _ = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(data, batch_size=B),
        noise_multiplier=0.0,
        max_grad_norm=c,
        poisson_sampling=False,
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.zero_grad()
            _per_example_loss(private, batch).mean().backward()
            opt.step()  # the first step: the check places the relative-position tables, then the pass re-runs
    finally:
        engine.detach()
    got = [p.grad * B for p in model.parameters() if p.requires_grad]
    err = torch.sqrt(sum(((g - w) ** 2).sum() for g, w in zip(got, want)))
    assert float(err) <= 1e-9 * float(torch.sqrt(sum((w**2).sum() for w in want)))
