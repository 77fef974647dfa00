"""The first-batch check re-runs on any change of signature, not only of ``training`` flags (issue 33, case 6).

The signature of a release (:func:`dpopt.engine.check.signature`) is the
train/eval flags, a fingerprint of the modules' non-parameter state (plain
attributes, submodule identities: :func:`~dpopt.engine.check.module_state`)
and the batch-size class (power-of-two bucket; a new class is checked at a
size ≥ the batch's own). Three models passed the check on step 1 and then
mixed examples at 1.2·C:

* ``flag``: a plain attribute ``self.mix`` switched on after step 1;
* ``large``: mixes only in batches of more than 12 examples (the check ran at 2-3);
* ``swap``: a parameter-free submodule swapped after ``make_private`` for one
  that centres over the batch.

Through ``PrivacyEngine`` (hook door) each is now refused at the first step
after the change, with the message naming the parameters; through
``iter_per_sample_sources`` each is moved to the exact per-example path, and
σ = 0 sensitivity (removing one example moves the clipped sum by ≤ C) holds.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.engine import iter_per_sample_sources
from dpopt.engine.check import Signature, module_state, signature, size_class
from dpopt.types import ClipGeometry

ce = nn.functional.cross_entropy


class Flag(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)
        self.mix = False

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(0) if self.mix else h


class Large(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(0) if x.shape[0] > 12 else h


class Centre(nn.Module):
    def forward(self, h):
        return h - h.mean(0)


class Swap(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)
        self.post = nn.Identity()

    def forward(self, x):
        return self.post(self.fc(x))


CASES = {
    "flag": (Flag, lambda m: setattr(m, "mix", True)),
    "large": (Large, lambda m: None),
    "swap": (Swap, lambda m: setattr(m, "post", Centre())),
}


def _data(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("name", list(CASES))
def test_privacy_engine_refuses_after_the_change(name):
    build, change = CASES[name]
    x, y = _data()
    model = build()
    eng = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, _ = eng.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=16),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            poisson_sampling=False,  # steps on the test's own batches
        )
    opt.zero_grad()
    ce(model(x[:4]), y[:4]).backward()
    opt.step()  # the first batch: checked (small), per example: released
    assert len(eng.ledger) == 1
    change(model)
    opt.zero_grad()
    ce(model(x[:16]), y[:16]).backward()
    with pytest.raises(ValueError, match=r"\['fc.bias', 'fc.weight'\] captured from the backward pass do not match"):
        opt.step()
    assert len(eng.ledger) == 1  # nothing released


def _clipped_sum(model, x, y, c):
    src = next(iter(iter_per_sample_sources(model, ce, x, y)))
    geo = ClipGeometry()
    n = src.num_params
    norms = src.sq_norms(geo, [0] * n, 1)[:, 0].sqrt()
    w = torch.clamp(c / norms, max=1.0).unsqueeze(1)
    return torch.cat([s.flatten() for s in src.weighted_sum(w, geo, [0] * n)])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", list(CASES))
def test_engine_door_sensitivity_after_the_change(name):
    build, change = CASES[name]
    x, y = _data(16)
    model = build().double()
    x = x.double()
    list(iter_per_sample_sources(model, ce, x[:4], y[:4]))  # step 1: checked on 4 examples, no mixing there
    change(model)
    c = 0.05  # below every per-example norm here: every example clipped
    full = _clipped_sum(model, x, y, c)
    worst = 0.0
    for j in range(16):
        keep = torch.tensor([i for i in range(16) if i != j])
        worst = max(worst, float((full - _clipped_sum(model, x[keep], y[keep], c)).norm()) / c)
    assert worst <= 1 + 1e-9


def test_signature_parts():
    m = Swap()
    s1 = signature(m, 16)
    assert isinstance(s1, Signature) and s1.size == size_class(16) == 5
    assert signature(m, 31) == s1 and signature(m, 32) != s1  # power-of-two classes
    m.post = Centre()
    assert signature(m, 16) != s1  # a swapped parameter-free submodule
    f = Flag()
    before = module_state(f)
    f.mix = True
    assert module_state(f) != before  # a plain attribute
    f.mix = False
    assert module_state(f) == before
    f.eval()
    assert module_state(f) == before and signature(f, 16) != signature(f.train(), 16)  # flags: the mode part
    # a parameter update is not a change of signature (values of parameters are not state)
    with torch.no_grad():
        f.fc.weight.add_(1.0)
    assert module_state(f) == before


def test_unchanged_signature_is_checked_once():
    """A model that does not change is checked once per size class, then steps run unchecked."""
    x, y = _data()
    model = Swap()
    eng = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, _ = eng.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=16),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            poisson_sampling=False,  # steps on the test's own batches
        )
    cap = opt._capture
    for b in (16, 17, 20, 31, 16):
        opt.zero_grad()
        ce(model(x[:b]), y[:b]).backward()
        opt.step()
    assert len(cap._modes._done) == 1  # one size class (16..31), one module state, one mode


def test_the_checked_signatures_stay_bounded_in_a_long_run():
    """A signature per step (an attribute that changes every step) must not grow memory with the run."""
    from dpopt.engine.check import ModeCheck

    modes = ModeCheck()
    for step in range(3 * ModeCheck.MAX_SIGNATURES):
        modes.done((True, step))
    assert len(modes._done) == ModeCheck.MAX_SIGNATURES
    assert modes.needed((True, 0))  # forgotten: checked again if it returns
    assert not modes.needed((True, 3 * ModeCheck.MAX_SIGNATURES - 1))
