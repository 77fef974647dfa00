"""What HF does behind the user's back: its batch-token-mean .loss is refused where it cannot be made per example.

``model(..., labels=...).loss`` weighs each example by the other examples'
lengths (the sensitivity bound would not hold); ``num_items_in_batch``
divides by an accumulated token count. PrivacyEngine refuses each with the
fix; the per-example form (dpopt.losses.per_example_lm_loss) is what trains.
(Gradient checkpointing is supported: tests/hf/test_hf_checkpointing.py.)
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("transformers")

from hf_zoo import make, trainable  # noqa: E402

import dpopt  # noqa: E402
from dpopt.engine.hooks import HookCapture  # noqa: E402


def test_hf_batch_token_mean_loss_differs_from_the_mean_of_per_example_losses():
    """Why it is refused: with examples of different lengths HF's .loss is not (1/B) Σ ℓ_i."""
    model, x, y, _, batch_loss = make("gpt2")
    model.eval()
    with torch.no_grad():
        hf_loss = model.hf(input_ids=x, labels=y).loss
        ours = batch_loss(model(x), y)
    assert abs(float(hf_loss) - float(ours)) > 1e-4  # example 0 has 2 fewer valid tokens


_prop = getattr(pytest.importorskip("transformers").PreTrainedModel, "loss_function", None)
SETTABLE = isinstance(_prop, property) and _prop.fset is not None
# labels= alone trains per example where loss_function can be replaced (tests/hf/test_hf_labels_loss.py)
REFUSED = [{"labels": True, "num_items_in_batch": 7}] + ([] if SETTABLE else [{"labels": True}])


@pytest.mark.parametrize("kwargs", REFUSED)
def test_privacy_engine_refuses_the_hf_loss_with_the_per_example_form(kwargs):
    model, x, y, _, _ = make("gpt2")
    cap = HookCapture(model, "mean")
    try:
        extra = {k: (y if v is True else torch.tensor(v)) for k, v in kwargs.items()}
        with pytest.raises(ValueError, match=r"per_example_lm_loss\(logits, labels\)\.mean\(\)"):
            model.hf(input_ids=x, **extra)
    finally:
        cap.detach()
    model.hf(input_ids=x, labels=y)  # detached: the model is as it was given


def test_the_per_example_form_trains_through_privacy_engine():
    model, x, y, _, batch_loss = make("gpt2")
    engine = dpopt.PrivacyEngine()
    opt = torch.optim.SGD(trainable(model), lr=0.1)
    model, opt, _ = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=len(y)),
        poisson_sampling=False,  # the test steps on its own (neighbouring) batches
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    before = [p.detach().clone() for p in trainable(model)]
    try:
        opt.zero_grad()
        batch_loss(model(x), y).backward()
        opt.step()
    finally:
        engine.detach()
    assert any(not torch.equal(a, p) for a, p in zip(before, trainable(model)))
    assert len(engine.ledger) == 1


def test_hf_rules_are_registered_again_after_the_registry_was_restored():
    from transformers.pytorch_utils import Conv1D

    from dpopt.engine.rules import RULES, rule_for

    saved = dict(RULES)
    try:
        RULES.pop(Conv1D, None)
        assert rule_for(Conv1D(4, 3)) is not None and Conv1D in RULES
    finally:
        RULES.clear()
        RULES.update(saved)
