"""Every Opacus name of issue 22's "Done when" list, on dpopt's PrivacyEngine: none raises AttributeError/TypeError.

Each name is called the way Opacus code calls it, and what it returns is
checked against a value computed here (not only "it did not raise"). Opacus's
own ``opacus.schedulers`` are driven too when Opacus is installed (the dev
extra); CI without Opacus runs the rest.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from opacus_setup import data, model, run_epoch
from torch import nn
from torch.utils.data import DataLoader

import dpopt
from dpopt.accounting.accountant import dpsgd_epsilon

DELTA = 1e-5


def _quiet():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("ignore")
    return ctx


def test_make_private_takes_every_opacus_argument_at_once():
    engine = dpopt.PrivacyEngine(accountant="rdp")
    m = model()
    ctx = _quiet()
    try:
        m, opt, loader = engine.make_private(
            module=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
            data_loader=DataLoader(data(), batch_size=16),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode="hooks",
            batch_first=True,
            poisson_sampling=True,
            clipping="adaptive",
            max_clipbound=4.0,
            min_clipbound=0.25,
            clipbound_learning_rate=0.2,
            target_unclipped_quantile=0.5,
            unclipped_num_std=1.5,
            loss_reduction="mean",
            noise_generator=torch.Generator().manual_seed(0),
            secure_mode=False,
        )
    finally:
        ctx.__exit__(None, None, None)
    run_epoch(m, opt, loader)
    assert len(engine.ledger) == 4 and engine.accountant.history[0][1:] == (0.25, 4)
    assert all(0.25 <= e.meta["max_grad_norm"][0] <= 4.0 for e in engine.ledger.entries)


def test_every_done_when_name(tmp_path):
    engine = dpopt.PrivacyEngine(accountant="rdp")
    m = model()
    ctx = _quiet()
    try:
        m, opt, loader = engine.make_private_with_epsilon(
            module=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
            data_loader=DataLoader(data(), batch_size=16),
            target_epsilon=4.0,
            target_delta=DELTA,
            epochs=2,
            max_grad_norm=1.0,
            noise_generator=torch.Generator().manual_seed(0),
        )
    finally:
        ctx.__exit__(None, None, None)
    sigma = opt.noise_multiplier
    assert dpsgd_epsilon(sigma, 0.25, 8, DELTA, "rdp") <= 4.0
    assert opt.expected_batch_size == 16.0  # q N = 64 / 4
    run_epoch(m, opt, loader)
    acc = engine.accountant
    assert acc.get_epsilon(delta=DELTA) == pytest.approx(dpsgd_epsilon(sigma, 0.25, 4, DELTA, "rdp"), rel=1e-9)
    assert acc.history == [(sigma, 0.25, 4)] and len(acc) == 1

    opt.noise_multiplier = 2.0  # settable, applies to the next release
    opt.max_grad_norm = 0.5
    assert (opt.noise_multiplier, opt.max_grad_norm) == (2.0, 0.5)
    x, y = next(iter(loader))  # one logical batch in two chunks of disjoint examples
    h = len(y) // 2
    for part, skip in ((slice(0, h), True), (slice(h, None), False)):
        opt.signal_skip_step(do_skip=skip)  # the first chunk: added, not released
        opt.zero_grad()
        nn.CrossEntropyLoss()(m(x[part]), y[part]).backward()
        opt.step()
        assert len(engine.ledger) == (4 if skip else 5)  # the last chunk: one release at the new sigma and bound
    last = engine.ledger.entries[-1].meta
    assert last["noise_multiplier"] == 2.0 and last["noise_std"] == pytest.approx(1.0)

    fixed = dpopt.PrivacyEngine.get_compatible_module(nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)))
    assert isinstance(fixed[1], nn.GroupNorm)

    path = tmp_path / "ckpt.pt"
    ctx = _quiet()
    try:
        engine.save_checkpoint(path=path, module=m, optimizer=opt)
        fresh = dpopt.PrivacyEngine(accountant="rdp")
        m2 = model(seed=3)
        m2, opt2, _ = fresh.make_private(
            module=m2,
            optimizer=torch.optim.SGD(m2.parameters(), lr=0.1),
            data_loader=DataLoader(data(), batch_size=16),
            noise_multiplier=sigma,
            max_grad_norm=1.0,
        )
        fresh.load_checkpoint(path=path, module=m2, optimizer=opt2)
    finally:
        ctx.__exit__(None, None, None)
    assert fresh.accountant.history == acc.history == [(sigma, 0.25, 4), (2.0, 0.25, 1)]
    assert opt2.noise_multiplier == 2.0 and opt2.max_grad_norm == 0.5


@pytest.mark.parametrize("library", ["dpopt", "opacus"])
def test_schedulers_drive_dpopt_optimizer(library):
    if library == "opacus":
        schedulers = pytest.importorskip("opacus.schedulers")
    else:
        import dpopt.schedulers as schedulers
    engine = dpopt.PrivacyEngine(accountant="rdp")
    m = model()
    ctx = _quiet()
    try:
        m, opt, loader = engine.make_private(
            module=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
            data_loader=DataLoader(data(), batch_size=16),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            noise_generator=torch.Generator().manual_seed(0),
        )
    finally:
        ctx.__exit__(None, None, None)
    made = [
        schedulers.ExponentialNoise(opt, gamma=0.5),
        schedulers.StepNoise(opt, step_size=1, gamma=1.0),
        schedulers.LambdaNoise(opt, noise_lambda=lambda e: 1.0),
        schedulers.ExponentialGradClip(opt, gamma=0.5),
        schedulers.StepGradClip(opt, step_size=1, gamma=1.0),
        schedulers.LambdaGradClip(opt, scheduler_function=lambda e: 1.0),
    ]
    run_epoch(m, opt, loader, steps=1)
    made[0].step()  # sigma 0.5
    made[3].step()  # C 0.5
    run_epoch(m, opt, loader, steps=1)
    metas = [e.meta for e in engine.ledger.entries]
    assert [x["noise_multiplier"] for x in metas] == [1.0, 0.5]
    assert [x["noise_std"] for x in metas] == pytest.approx([1.0, 0.25])  # sigma_t * C_t
    assert not math.isnan(engine.accountant.get_epsilon(delta=DELTA))
