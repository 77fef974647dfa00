"""Buffers changed by a forward pass on private examples are refused (they would be released un-noised)."""

import pytest
import torch
from torch import nn

from dpopt.engine import iter_per_sample_sources
from dpopt.models import check_model


def _loss(out, y):
    return nn.functional.cross_entropy(out, y)


class Counter(nn.Module):
    """A custom layer that accumulates a statistic of its inputs in a buffer."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, 3)
        self.register_buffer("seen", torch.zeros(d))

    def forward(self, x):
        self.seen += x.detach().sum(0)
        return self.lin(x)


class Rebind(Counter):
    def forward(self, x):
        self.seen = self.seen + x.detach().sum(0)  # rebinding, not in place
        return self.lin(x)


def test_instance_norm_with_running_stats_is_refused_statically():
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    )
    with pytest.raises(ValueError, match="track_running_stats=False"):
        check_model(model)
    check_model(nn.Sequential(nn.InstanceNorm2d(4, affine=True)))  # no tracked statistics: fine


@pytest.mark.parametrize("layer", [Counter, Rebind])
@pytest.mark.parametrize("engine", ["fast", "reference"])
def test_forward_that_changes_a_buffer_is_refused(layer, engine):
    torch.manual_seed(0)
    model = layer(5)
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    if engine == "reference" and layer is Rebind:
        # functional_call restores the module's own buffer after the call: the rebound value is
        # discarded, nothing private reaches the model
        list(iter_per_sample_sources(model, _loss, x, y, engine=engine))
        assert torch.equal(model.seen, torch.zeros(5))
        return
    with pytest.raises(ValueError, match=r"changed its buffers \['seen'\]"):
        list(iter_per_sample_sources(model, _loss, x, y, engine=engine))
    assert torch.equal(model.seen, torch.zeros(5))  # restored: nothing private left in the model


def test_constant_buffers_are_fine():
    model = nn.Sequential(nn.Linear(5, 3))
    model.register_buffer("scale", torch.ones(3))
    src = next(iter(iter_per_sample_sources(model, _loss, torch.randn(4, 5), torch.randint(0, 3, (4,)))))
    assert src.batch_size == 4


@pytest.mark.parametrize("engine", ["fast", "reference"])
def test_loss_must_be_one_number_per_example(engine):
    import warnings

    model = nn.Sequential(nn.Linear(5, 3))
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a 1-element loss (reduction="none") is fine: no fallback warning
        src = next(
            iter(
                iter_per_sample_sources(
                    model, lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"), x, y, engine=engine
                )
            )
        )
    assert src.batch_size == 4
    with pytest.raises(ValueError, match="one number per example"):
        list(iter_per_sample_sources(model, lambda o, t: o.sum(0), x, y, engine=engine))


class Toggle(nn.Module):
    """A constant buffer that the forward starts changing when ``poison`` is set."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.register_buffer("scale", torch.ones(3))
        self.poison = False

    def forward(self, x):
        if self.poison:
            self.scale += x.detach().sum()
        return self.lin(x) * self.scale


def test_buffer_copies_are_reused_while_unchanged_and_refreshed_after_a_public_change():
    """The per-step snapshot copies no buffer while they stay the same object at the same version;
    a change made between steps is copied again, and a refused forward restores THAT value."""
    from dpopt.engine.fast import get_engine

    torch.manual_seed(0)
    model = Toggle()
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    list(iter_per_sample_sources(model, _loss, x, y))
    engine = get_engine(model, _loss)
    first = engine._buffers["scale"]
    list(iter_per_sample_sources(model, _loss, x, y))
    assert engine._buffers["scale"] is first  # reused: no new copy
    with torch.no_grad():
        model.scale.fill_(2.0)  # a public change between steps
    list(iter_per_sample_sources(model, _loss, x, y))
    assert engine._buffers["scale"] is not first and torch.equal(engine._buffers["scale"][2], torch.full((3,), 2.0))
    model.poison = True
    with pytest.raises(ValueError, match=r"changed its buffers \['scale'\]"):
        list(iter_per_sample_sources(model, _loss, x, y))
    assert torch.equal(model.scale, torch.full((3,), 2.0))  # the latest public value, not the first copy
