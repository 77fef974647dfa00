"""Buffers are checked by value, and the first-batch check leaves no state behind (issue 33, case 4).

Writes that do not bump a buffer's version counter — ``buf.data = ...``,
``buf.data.mul_(0).add_(...)`` (the EMA-codebook idiom), a write from a
``register_full_backward_hook`` — used to pass the identity/version guard: in
the ``PrivacyEngine`` door ``model.state_dict()`` then held one record's raw
features (the check's single-example passes ran last), and in the
``iter_per_sample_sources`` door ``buf.data = ...`` under ``torch.func.vmap``
let a batched tensor escape into the model (SIGSEGV). Each write is now
refused with a message naming the buffer, the buffer is restored to its value
before the private pass, and the process survives. The check's own passes
restore the buffers and torch's random generator.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.engine import iter_per_sample_sources

SRC = str(Path(dpopt.__file__).resolve().parents[1])


class Coded(nn.Module):
    """A linear classifier with a buffer ``code`` written in one of several ways.

    ``feeds``: the buffer is added to the input (else it only accumulates, and
    nothing but a buffer check can see the write).
    """

    def __init__(self, mode: str, feeds: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)
        self.register_buffer("code", torch.zeros(4))
        self.mode, self.feeds = mode, feeds
        if mode == "backward-hook":
            self.fc.register_full_backward_hook(self._hook)

    def _hook(self, module, grad_in, grad_out):
        self.code.data.add_(grad_out[0].detach().sum(0).sum())  # a statistic of the private gradients
        return None

    def forward(self, x):
        if self.mode == "data-assign":
            self.code.data = 0.5 * self.code + 0.5 * x.detach().mean(0)  # rebinds: identity and version kept
        elif self.mode == "data-inplace":
            self.code.data.mul_(0).add_(x.detach()[0])  # EMA-codebook idiom: version counter of .data only
        elif self.mode == "alone-only" and x.shape[0] == 1:
            self.code.data = x.detach()[0].clone()  # only in a single-example pass (the check's)
        return self.fc(x + self.code) if self.feeds else self.fc(x)


def _data(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def _plain_loop(model, steps=2):
    eng = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, dl = eng.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=16),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
        )
    n = 0
    for x, y in dl:
        if len(x) < 2:
            continue
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        n += 1
        if n >= steps:
            break
    return model


@pytest.mark.parametrize("feeds", [False, True], ids=["stat-only", "feeds-forward"])
@pytest.mark.parametrize("mode", ["data-assign", "data-inplace", "backward-hook", "alone-only"])
def test_privacy_engine_refuses_and_restores(mode, feeds):
    model = Coded(mode, feeds)
    with pytest.raises(ValueError, match=r"changed its buffers \['code'\]") as err:
        _plain_loop(model)
    assert "buf.data" in str(err.value)
    assert torch.equal(model.state_dict()["code"], torch.zeros(4))  # nothing of any record left in the model


@pytest.mark.parametrize("mode", ["data-inplace", "alone-only"])
def test_engine_door_refuses_and_restores(mode):
    model = Coded(mode, feeds=True)
    x, y = _data(8).tensors
    with pytest.raises(ValueError, match=r"buffers \['code'\]"):
        for _ in iter_per_sample_sources(model, nn.functional.cross_entropy, x, y):
            pass
    assert torch.equal(model.code, torch.zeros(4))


def test_engine_door_data_rebind_is_refused_without_crashing():
    """``buf.data = f(x)`` under torch.func.vmap used to leave a batched tensor in the model: SIGSEGV."""
    script = textwrap.dedent(f"""
        import sys, warnings, torch
        sys.path.insert(0, {SRC!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        warnings.simplefilter("ignore")
        from test_buffers_by_value import Coded, _data
        from dpopt.engine import iter_per_sample_sources
        model = Coded("data-assign", feeds=True)
        x, y = _data(8).tensors
        try:
            for _ in iter_per_sample_sources(model, torch.nn.functional.cross_entropy, x, y):
                pass
            print("ACCEPTED")
        except ValueError as err:
            print("REFUSED", "['code']" in str(err), torch.equal(model.code, torch.zeros(4)))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "REFUSED True True"


def test_buffer_set_between_steps_by_the_user_is_accepted():
    """A public write outside the private pass (the user's, between steps) is not a refusal."""
    model = Coded("none", feeds=True)
    eng = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, dl = eng.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=16),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
        )
    for step, (x, y) in enumerate(dl):
        model.code.data = torch.full((4,), float(step))  # public: a function of the step count only
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert torch.equal(model.code, torch.full((4,), float(step)))


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.drop, self.fc2 = nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def test_first_batch_check_restores_the_random_generator():
    """The check's extra passes (dropout draws included) do not shift the user's random stream."""
    model = Dropped().train()
    eng = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, dl = eng.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=16),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
        )
    cap = opt._capture
    for x, y in dl:  # noqa: B007 (x and y are read after the loop)
        if len(x) >= 2:
            break
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    assert not cap.verified
    state = torch.get_rng_state()
    opt.step()  # runs the first-batch check (dropout passes)
    assert cap.verified
    assert torch.equal(torch.get_rng_state(), state)


def test_engine_door_check_restores_the_random_generator():
    model = Dropped().train()
    x, y = _data(8).tensors
    torch.manual_seed(5)
    want = torch.rand(3)  # the draw after the real pass, were there no check (the stream the user expects)
    torch.manual_seed(5)
    src = next(iter(iter_per_sample_sources(model, nn.functional.cross_entropy, x, y)))
    assert src.batch_size == 8
    # the check ran (first batch) and its passes drew: the stream moved by the real pass only
    torch.manual_seed(5)
    model2 = Dropped().train()
    from dpopt.engine.fast import PerSampleEngine

    eng = PerSampleEngine(model2, nn.functional.cross_entropy, verify=False)
    eng.compute(x, y)
    after_unchecked = torch.rand(3)
    torch.manual_seed(5)
    model3 = Dropped().train()
    eng3 = PerSampleEngine(model3, nn.functional.cross_entropy, verify=True)
    eng3.compute(x, y)
    assert eng3.verified
    assert torch.equal(torch.rand(3), after_unchecked)
    assert not torch.equal(after_unchecked, want)  # the real pass itself drew (a real test of the stream)
