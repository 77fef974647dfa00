"""dpopt.losses.per_example_lm_loss: each example's loss over its own valid tokens (hand-computed values)."""

from __future__ import annotations

import math

import pytest
import torch

from dpopt.losses import per_example_lm_loss


def _logits():
    # B = 2, T = 3, V = 2: position logits chosen so that each token's loss is log(1 + e^{-1}) or log(1 + e)
    z = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]], [[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]]], dtype=torch.float64)
    return z


LO, HI, MID = math.log1p(math.exp(-1.0)), math.log1p(math.exp(1.0)), math.log(2.0)


def test_token_mean_and_sum_per_example_without_shift():
    labels = torch.tensor([[0, 1, -100], [0, -100, -100]])
    mean = per_example_lm_loss(_logits(), labels, shift=False)
    torch.testing.assert_close(mean, torch.tensor([LO, HI], dtype=torch.float64))  # (LO + LO)/2, HI/1
    total = per_example_lm_loss(_logits(), labels, reduction="sum", shift=False)
    torch.testing.assert_close(total, torch.tensor([2 * LO, HI], dtype=torch.float64))


def test_causal_shift_predicts_the_next_token():
    labels = torch.tensor([[7, 1, 0], [5, 1, 0]])  # label 0 is ignored after the shift: position t predicts t+1
    out = per_example_lm_loss(_logits(), labels)  # positions 0, 1 against labels 1, 0
    torch.testing.assert_close(out, torch.tensor([(HI + HI) / 2, (LO + LO) / 2], dtype=torch.float64))


def test_an_example_with_no_valid_token_has_loss_zero_and_no_nan():
    labels = torch.full((2, 3), -100)
    labels[1, 0] = 1
    out = per_example_lm_loss(_logits(), labels, shift=False)
    assert float(out[0]) == 0.0 and abs(float(out[1]) - LO) < 1e-12


def test_one_examples_loss_does_not_depend_on_the_others():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 5, 7, generator=g)
    y = torch.randint(0, 7, (3, 5), generator=g)
    y[2, 1:] = -100  # a short example
    full = per_example_lm_loss(z, y)
    for i in range(3):
        torch.testing.assert_close(per_example_lm_loss(z[i : i + 1], y[i : i + 1]), full[i : i + 1])


def test_bad_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="reduction must be one of"):
        per_example_lm_loss(_logits(), torch.zeros(2, 3, dtype=torch.long), reduction="token")
    with pytest.raises(ValueError, match=r"logits \[B, T, V\] and labels \[B, T\]"):
        per_example_lm_loss(_logits(), torch.zeros(2, 4, dtype=torch.long))
