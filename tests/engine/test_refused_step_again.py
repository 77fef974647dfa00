"""A step the hook door refused, stepped again: refused for the same real reason, or accepted once fixed.

A first-batch check (or a layout test) that refuses the model drops the step's records with the refusal
(nothing of a step outlives it; nothing is released). The state the next ``step()`` sees is the state before
the refused step minus those records, so a ``step()`` repeated WITHOUT a new backward must say the refusal
again (not "without a backward pass", which it was not); ``zero_grad()`` forgets it (then no backward ran);
a new forward and backward is judged afresh: refused again while the model still mixes examples, accepted
(one release) once it does not. A layer that only the root call encloses off the examples' axis is refused
naming the layer at the first step (it was reported as "without a backward pass", the layer recorded nowhere).
The loss-reduction watch's refusal is judged afresh on the next pass too (its verdict used to outlive the pass
it judged, refusing every later step even after the loss was fixed).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from test_deferred_check_refusal import _assert_nothing_released, _trace, private_one_batch
from torch import nn

B = 6
MIXES = "do not match single-example autograd"


class Mixer(nn.Module):
    """Centres its input over the batch while ``mix`` is set (a layer the hook door cannot train: refused by the
    first-batch check at its small passes, in ``collect``)."""

    def __init__(self):
        super().__init__()
        self.fc, self.mix = nn.Linear(3, 2), True

    def forward(self, x):
        return self.fc(x - x.mean(0, keepdim=True) if self.mix else x)


class OffAxis(nn.Module):
    """Its ``fc`` runs on ``[T, B, 3]`` (examples along dim 1); only the root call encloses it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x.transpose(0, 1)).mean(0)


def _backward(model, x, y) -> None:
    nn.functional.cross_entropy(model(x), y).backward()


def _private(model, x):
    torch.manual_seed(0)
    y = torch.randint(0, 2, (B,))
    return (*private_one_batch(model, x, y, optimizer=torch.optim.SGD), y)


def test_a_refused_step_stepped_again_is_refused_for_the_same_reason():
    torch.manual_seed(1)
    x = torch.randn(B, 3)
    engine, model, opt, y = _private(Mixer(), x)
    before = _trace(engine, model, opt)
    opt.zero_grad()
    _backward(model, x, y)
    with pytest.raises(ValueError, match=MIXES) as first:
        opt.step()
    _assert_nothing_released(engine, model, opt, before)
    for _ in range(2):  # the user fixes nothing and steps again: the same reason, said again
        with pytest.raises(ValueError, match=MIXES) as again:
            opt.step()
        assert str(again.value).startswith(str(first.value)) and "repeats a refused step" in str(again.value)
        _assert_nothing_released(engine, model, opt, before)
    # a copy of (model, optimizer) is a branch: it carries no refusal of the original's step
    model2, opt2 = copy.deepcopy((model, opt))
    with pytest.raises(RuntimeError, match="without a backward pass"):
        opt2.step()
    # zero_grad(): the refusal is forgotten with the step's gradients; nothing to step on now
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="without a backward pass"):
        opt.step()
    # a new forward and backward WITHOUT zero_grad (a loop whose zero_grad followed the refused step): judged afresh
    _backward(model, x, y)
    with pytest.raises(ValueError, match=MIXES) as fresh:
        opt.step()
    assert "repeats a refused step" not in str(fresh.value)
    _assert_nothing_released(engine, model, opt, before)
    # fixed: accepted, one release
    model.mix = False
    _backward(model, x, y)
    opt.step()
    after = _trace(engine, model, opt)
    assert after["ledger"] == 1 and after["priv"][:2] == (1, 1) and opt._refusal is None
    assert not all(torch.equal(a, b) for a, b in zip(after["params"], before["params"]))


def test_a_layer_off_the_examples_axis_is_named_at_the_first_step_and_again():
    torch.manual_seed(1)
    x = torch.randn(B, 5, 3)
    engine, model, opt, y = _private(OffAxis(), x)
    before = _trace(engine, model, opt)
    opt.zero_grad()
    _backward(model, x, y)
    with pytest.raises(ValueError, match="layer 'fc' .* does not keep the examples along dim 0") as first:
        opt.step()
    shapes = re.search(r"\(inputs (.*?); sizes not shown", str(first.value))
    assert shapes is not None and shapes.group(1) == "['3-dim'], outputs ['3-dim']"  # [T, B, 3]: no B at dim 1
    assert str(B) not in str(first.value)  # the realised batch size (private under Poisson) is nowhere
    with pytest.raises(ValueError, match="layer 'fc' .*repeats a refused step"):
        opt.step()
    opt.zero_grad()
    _backward(model, x, y)
    with pytest.raises(ValueError, match="layer 'fc' .* does not keep the examples along dim 0"):
        opt.step()
    _assert_nothing_released(engine, model, opt, before)


def test_a_loss_reduction_refusal_is_judged_afresh_on_the_next_pass():
    """``loss_reduction="mean"`` with a sum-reduced loss module: refused, and again while the loss stays summed
    (also when stepped again at once); once the loss is mean-reduced the step is accepted (it was refused for
    ever: the verdict outlived the pass it judged)."""
    torch.manual_seed(1)
    x = torch.randn(B, 3)
    engine, model, opt, y = _private(nn.Linear(3, 2), x)
    before = _trace(engine, model, opt)
    summed, mean = nn.CrossEntropyLoss(reduction="sum"), nn.CrossEntropyLoss()
    for _ in range(2):
        opt.zero_grad()
        summed(model(x), y).backward()
        with pytest.raises(ValueError, match="reduction='sum'.*Pass loss_reduction='sum'"):
            opt.step()
        with pytest.raises(ValueError, match="reduction='sum'.*repeats a refused step"):
            opt.step()
        _assert_nothing_released(engine, model, opt, before)
        assert opt._loss_watch is not None  # still watching
    opt.zero_grad()
    mean(model(x), y).backward()
    opt.step()
    assert len(engine.ledger) == 1 and opt._loss_watch is None  # accepted; the watch is done
