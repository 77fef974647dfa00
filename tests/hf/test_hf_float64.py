"""Float64 models: Gemma-2 (its own NaN on a left-padded row) is not refused as mixing; dpopt.hf.loss keeps float64.

Gemma-2's eager attention adds the float64 mask minimum and takes the
softmax in float32, where it is −inf: a fully masked row (a left pad's query)
is NaN, and that example's gradient is NaN — in the batched pass and alone
alike. The first-batch check compares the examples whose single-example
gradient is finite and requires the others to be non-finite in the capture
too (:func:`dpopt.engine.check.agrees`); before, the NaN made every parameter
"disagree" and the model was refused as mixing examples. Checked: accepted
through ``PrivacyEngine``'s hooks, the finite examples' per-example
gradients equal single-example autograd (relative 1e-10), the padded one is
non-finite in both (the source counts it: ``nonfinite``). ``dpopt.hf.loss.per_example_loss`` computes a float64
classifier's loss in float64 (it used to cast the logits to float32).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

T = pytest.importorskip("transformers")

from hf_zoo import Wrap, make, source_grads  # noqa: E402

from dpopt.engine.hooks import HookCapture  # noqa: E402
from dpopt.hf.loss import per_example_loss  # noqa: E402
from dpopt.losses import per_example_lm_loss  # noqa: E402

B, L = 4, 8


def _gemma2():
    if not hasattr(T, "Gemma2Config"):
        pytest.skip("no Gemma-2 in this transformers")
    cfg = T.Gemma2Config(
        vocab_size=37,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        sliding_window=4,
    )
    torch.manual_seed(0)
    model = Wrap(T.Gemma2ForCausalLM(cfg), ("input_ids", "attention_mask")).to(torch.float64).train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 37, (B, L), generator=gen)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, :3] = 0  # example 0 is left-padded
    ids[0, :3] = 0
    return model, torch.stack([ids, mask], 1), ids.masked_fill(mask == 0, -100)


def test_gemma2_float64_left_padding_is_accepted_and_exact_on_its_finite_examples():
    model, x, y = _gemma2()
    cap = HookCapture(model, "sum")
    try:
        for _ in range(2):  # the first batch runs the check (it used to refuse here)
            model.zero_grad()
            per_example_lm_loss(model(x), y).sum().backward()
            src = cap.collect()
    finally:
        cap.detach()
    got = source_grads(src)
    params = [p for p in model.parameters() if p.requires_grad]
    want = []
    for i in range(B):
        gs = torch.autograd.grad(per_example_lm_loss(model(x[i : i + 1]), y[i : i + 1]).sum(), params)
        want.append(gs)
    finite = [all(bool(torch.isfinite(g).all()) for g in row) for row in want]
    assert finite[1:] == [True] * (B - 1)  # (transformers 5: example 0 is NaN alone too, HF's own overflow)
    assert src.nonfinite == finite.count(False)  # the same failure in the capture (left out of its sums)
    rows = [i for i in range(B) if finite[i]]
    for k in range(len(params)):
        ref = torch.stack([want[i][k] for i in rows])
        torch.testing.assert_close(got[k][rows], ref, rtol=1e-10, atol=1e-12)


def test_per_example_loss_keeps_a_float64_classifier_in_float64():
    model, x, y, _, _ = make("bert", torch.float64)
    model.eval()
    ids, mask, tt = x.unbind(1)
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": tt, "labels": y}
    with torch.no_grad():
        loss = per_example_loss(model.hf, inputs)
        logits = model.hf(input_ids=ids, attention_mask=mask, token_type_ids=tt).logits
    assert loss.dtype == torch.float64
    want = F.cross_entropy(logits, y, reduction="none")  # float64 throughout
    torch.testing.assert_close(loss, want, rtol=1e-14, atol=0.0)
