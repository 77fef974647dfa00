"""HF's own ``labels=`` loss through ``PrivacyEngine``: the plain HF loop trains exactly.

``loss = model(input_ids=..., labels=...).loss; loss.backward()``: for a causal
LM the capture replaces the model's ``loss_function`` by the per-example form
(each example's token mean, averaged over the examples: ``loss_reduction="mean"``;
summed: ``"sum"``); a sequence classifier's loss is already a per-example mean
and is accepted as is. Checked: per-example gradients (read out with one-hot
weights) equal single-example autograd of each example's own HF loss (its
token mean, the batched pass's dropout masks replayed); the ``.loss`` value;
σ = 0 sensitivity ≤ C; the refusals (``num_items_in_batch``, a classifier
with ``"sum"``, a negative class label); the model's ``loss_function`` is
restored after each call.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

T = pytest.importorskip("transformers")

import hf_zoo  # noqa: E402
from hf_zoo import make, mismatches, source_grads  # noqa: E402

import dpopt  # noqa: E402
from dpopt.engine.check import RandomReplay  # noqa: E402
from dpopt.engine.hooks import HookCapture  # noqa: E402
from dpopt.losses import per_example_lm_loss  # noqa: E402

_prop = getattr(T.PreTrainedModel, "loss_function", None)
SETTABLE = isinstance(_prop, property) and _prop.fset is not None
needs_setter = pytest.mark.skipif(not SETTABLE, reason="this transformers cannot replace loss_function (< 4.48)")


def _lm(name):
    model, x, y, _, _ = make(name)
    return model.hf, {"input_ids": x}, y  # the HF model itself is the root: the plain HF loop


def _bert():
    model, x, y, _, _ = make("bert")
    ids, mask, tt = x.unbind(1)
    return model.hf, {"input_ids": ids, "attention_mask": mask, "token_type_ids": tt}, y


def _rows(inputs, i):
    return {k: v[i : i + 1] for k, v in inputs.items()}


def _captured(hf, inputs, y, reduction="mean"):
    """Per-example gradients from the plain HF loop (the second batch: the first runs the check)."""
    replay = RandomReplay(hf)
    cap = HookCapture(hf, reduction)
    try:
        hf(**inputs, labels=y).loss.backward()
        cap.collect()
        hf.zero_grad()
        with replay.recording():
            loss = hf(**inputs, labels=y).loss
            loss.backward()
        return source_grads(cap.collect()), replay, float(loss)
    finally:
        cap.detach()


def _reference(hf, inputs, y, replay):
    """Each example alone, its own HF loss (one example: HF's token mean IS its per-example loss)."""
    params = [p for p in hf.parameters() if p.requires_grad]
    rows = []
    with replay.replaying(int(y.shape[0])):
        for i in range(int(y.shape[0])):
            loss = hf(**_rows(inputs, i), labels=y[i : i + 1]).loss
            rows.append(torch.autograd.grad(loss, params, allow_unused=True))
    return [torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows]) for k, p in enumerate(params)]


def _names(hf):
    return [n for n, p in hf.named_parameters() if p.requires_grad]


@needs_setter
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_causal_lm_labels_loss_is_exact_per_example(name):
    hf, inputs, y = _lm(name)
    assert int((y == -100).sum()) > 0  # example 0 has fewer valid tokens: HF's batch token mean would couple them
    got, replay, loss = _captured(hf, inputs, y)
    want = _reference(hf, inputs, y, replay)
    assert mismatches(got, want, _names(hf), 1e-4) == []
    assert "_loss_function" not in hf.__dict__  # restored after the call
    with replay.replaying(int(y.shape[0])):  # the .loss returned: the mean of per-example token means
        per = torch.stack([per_example_lm_loss(hf(**_rows(inputs, i)).logits, y[i : i + 1])[0] for i in range(3)])
    assert loss == pytest.approx(float(per.mean()), rel=1e-5)


@needs_setter
def test_sum_reduction_is_the_sum_of_per_example_token_means():
    hf, inputs, y = _lm("gpt2")
    hf.eval()
    cap = HookCapture(hf, "sum")
    try:
        with torch.enable_grad():
            loss = hf(**inputs, labels=y).loss
    finally:
        cap.detach()
    with torch.no_grad():
        hf_mean = hf(**inputs, labels=y).loss  # detached: HF's own token mean again
        per = per_example_lm_loss(hf(**inputs).logits, y)
    assert float(loss) == pytest.approx(float(per.sum()), rel=1e-5)
    assert abs(float(hf_mean) - float(per.mean())) > 1e-4  # HF's batch token mean is another number


def test_sequence_classification_labels_loss_is_accepted_as_is_and_exact():
    hf, inputs, y = _bert()
    got, replay, _ = _captured(hf, inputs, y)
    want = _reference(hf, inputs, y, replay)
    assert mismatches(got, want, _names(hf), 1e-4) == []


def test_refusals():
    hf, inputs, y = _bert()
    cap = HookCapture(hf, "sum")
    try:
        with pytest.raises(ValueError, match="loss_reduction='mean'"):
            hf(**inputs, labels=y)
    finally:
        cap.detach()
    cap = HookCapture(hf, "mean")
    try:
        bad = y.clone()
        bad[1] = -100
        with pytest.raises(ValueError, match="negative label"):
            hf(**inputs, labels=bad)
        with pytest.raises(ValueError, match="num_items_in_batch"):
            hf(**inputs, labels=y, num_items_in_batch=torch.tensor(9))
    finally:
        cap.detach()


@needs_setter
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_sensitivity_of_the_plain_hf_loop_through_make_private(name, monkeypatch):
    monkeypatch.setattr(hf_zoo, "P_DROP", 0.0)
    hf, inputs, y = _lm(name) if name == "gpt2" else _bert()
    params = [p for p in hf.parameters() if p.requires_grad]
    norms = []
    for i in range(int(y.shape[0])):
        gs = torch.autograd.grad(hf(**_rows(inputs, i), labels=y[i : i + 1]).loss, params, allow_unused=True)
        norms.append(float(torch.sqrt(sum(g.double().square().sum() for g in gs if g is not None))))
    c = 0.5 * sorted(norms)[len(norms) // 2]
    keys = list(inputs)
    engine = dpopt.PrivacyEngine()
    opt = torch.optim.SGD(params, lr=0.0)
    hf, opt, _ = engine.make_private(
        module=hf,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(*inputs.values(), y), batch_size=len(y)),
        poisson_sampling=False,  # the test steps on its own (neighbouring) batches
        noise_multiplier=0.0,
        max_grad_norm=c,
    )

    def released(keep):
        opt.zero_grad()
        hf(**{k: inputs[k][keep] for k in keys}, labels=y[keep]).loss.backward()
        opt.step()
        return torch.cat([p.grad.flatten() for p in params]) * opt.expected_batch_size

    try:
        full = released(torch.arange(len(y)))
        assert float(full.norm()) > 0
        for j in range(len(y)):
            keep = torch.tensor([i for i in range(len(y)) if i != j])
            assert float((full - released(keep)).norm()) <= c * (1 + 1e-5), f"{name}: example {j}"
    finally:
        engine.detach()
