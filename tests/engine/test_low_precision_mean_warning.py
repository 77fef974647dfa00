"""``make_private`` warns once when trainable parameters are bf16/fp16 and ``loss_reduction="mean"``.

Why (docs/pitfalls.md item 19; measured in ``test_bf16_weights.py``): the user's 16-bit backward of a mean loss
rounds ∂ℓ_i/B at a scale that depends on B, so with σ = 0 removing one example moves the clipped sum by up to
1.0018·C; with ``loss_reduction="sum"`` it moves by C to float32 rounding. The warning names the fix, points at
the user's call line (both doors: ``make_private`` and ``make_private_with_epsilon``), and is not raised for
float32 parameters, for ``"sum"``, or for 16-bit parameters that are frozen.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dpopt import PrivacyEngine

MATCH = r"loss_reduction=\"sum\".*pitfalls\.md, item 19"


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def _private(model: torch.nn.Module, reduction: str, **kwargs):
    x, y = torch.randn(16, 4).to(next(model.parameters()).dtype), torch.randint(0, 3, (16,))
    return PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        loss_reduction=reduction,
        **kwargs,
    )


def _ours(record: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in record if "item 19" in str(w.message)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_mean_warns_once_at_the_callers_line(dtype):
    with pytest.warns(UserWarning, match=MATCH) as record:
        _private(_model(dtype), "mean")
    ours = _ours(list(record))
    assert len(ours) == 1
    assert ours[0].category is UserWarning and str(dtype) in str(ours[0].message)
    assert ours[0].filename == __file__  # stacklevel: the user's line, not dpopt's


def test_make_private_with_epsilon_warns_at_the_callers_line():
    model = _model(torch.bfloat16)
    x, y = torch.randn(16, 4).to(torch.bfloat16), torch.randint(0, 3, (16,))
    with pytest.warns(UserWarning, match=MATCH) as record:
        PrivacyEngine().make_private_with_epsilon(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
            target_epsilon=5.0,
            target_delta=1e-5,
            epochs=1,
            max_grad_norm=1.0,
        )
    ours = _ours(list(record))
    assert len(ours) == 1 and ours[0].filename == __file__


@pytest.mark.parametrize(
    "dtype, reduction, frozen",
    [
        (torch.bfloat16, "sum", False),
        (torch.float16, "sum", False),
        (torch.float32, "mean", False),
        (torch.bfloat16, "mean", True),  # the bf16 layer is frozen: its dtype is not the trained parameters'
    ],
)
def test_no_warning_for_sum_float32_or_frozen_low_precision(dtype, reduction, frozen):
    model = _model(dtype)
    if frozen:
        model[0].requires_grad_(False)
        model[2].float()  # the trained layer in float32, the frozen one in bf16
        model[0].register_forward_hook(lambda m, i, out: out.float())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _private(model, reduction)
    assert _ours(record) == []
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*item 19", category=UserWarning)
        _private(model, reduction)  # raises if it warns
