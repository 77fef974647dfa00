"""Updates go to the parameter they were computed for (issue 9, items 7 and 9).

σ = 0 and a huge C make the DP-SGD step exactly −lr · Σ_i g_i / B̄, computed
here with plain autograd, so every check is an equality to float tolerance.
"""

import pytest
import torch
from torch import nn

from dpopt.engine import iter_per_sample_sources
from dpopt.engine.reference import PerSampleGrads, per_sample_gradients
from dpopt.methods import make_optimizer

DT = torch.float64
LR, BBAR = 0.5, 4.0


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


def _lora_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    for p in model[0].parameters():
        p.requires_grad_(False)  # frozen backbone; only the head trains
    return model


def _data(n=4):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)


def _expected(model, x, y):
    """θ − lr · (Σ_i ∇ℓ_i) / B̄ for the trainable parameters (unclipped, noiseless)."""
    loss = sum(_loss(model(x[i : i + 1]), y[i : i + 1]) for i in range(len(x)))
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, trainable)
    return [p.detach() - LR * g / BBAR for p, g in zip(trainable, grads)]


def _opt(params, method="dp-sgd", **kw):
    return make_optimizer(
        method, params, noise_multiplier=0.0, expected_batch_size=BBAR, sample_rate=0.5, lr=LR, max_grad_norm=1e9, **kw
    )


@pytest.mark.parametrize("engine", ["fast", "reference"])
def test_frozen_layer_untouched_and_trainable_layer_updated(engine):
    model, (x, y) = _lora_model(), _data()
    frozen = [p.detach().clone() for p in model[0].parameters()]
    expected = _expected(model, x, y)
    opt = _opt(model.parameters())  # all parameters, frozen ones included, as users write it
    opt.step(iter_per_sample_sources(model, _loss, x, y, engine=engine))
    for p, f in zip(model[0].parameters(), frozen):
        assert torch.equal(p, f)
    for p, e in zip(model[2].parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)


def test_parameters_matched_by_identity_not_position():
    model, (x, y) = _lora_model(), _data()
    expected = _expected(model, x, y)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _opt(list(reversed(params)))  # optimizer order differs from the source's (model) order
    opt.step(iter_per_sample_sources(model, _loss, x, y))
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-10, atol=1e-12)


def test_source_of_another_model_is_refused():
    model, other = _lora_model(), _lora_model()
    x, y = _data()
    opt = _opt(model.parameters())
    with pytest.raises(ValueError, match="cover different parameters"):
        opt.step(iter_per_sample_sources(other, _loss, x, y))
    # the refused step released and recorded nothing
    assert len(opt.privatizer.ledger) == 0 and opt.privatizer.steps == 0


def test_hand_built_source_with_wrong_count_is_refused():
    model = _lora_model()
    opt = _opt(model.parameters())
    with pytest.raises(ValueError, match="trains 2"):
        opt.step(PerSampleGrads([torch.zeros(3, 3, 6, dtype=DT)]))


def test_disk_refuses_gradients_evaluated_only_at_theta():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3)).to(DT)
    x, y = _data()
    opt = make_optimizer(
        "disk-sgd", model.parameters(), noise_multiplier=0.0, expected_batch_size=BBAR, sample_rate=0.5, lr=0.1
    )
    opt.step(iter_per_sample_sources(model, _loss, x, y, points=opt.evaluation_points()))
    assert len(opt.evaluation_points()) == 2  # from step 2 on, DiSK needs θ + γd as well
    with pytest.raises(ValueError, match="evaluation points"):
        opt.step(iter_per_sample_sources(model, _loss, x, y))  # forgot points=
    with pytest.raises(ValueError, match="evaluation points"):
        opt.step(per_sample_gradients(model, _loss, x, y))
    opt.step(iter_per_sample_sources(model, _loss, x, y, points=opt.evaluation_points()))
    assert opt.privatizer.steps == 2
