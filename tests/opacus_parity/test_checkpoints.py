"""Opacus's checkpoint round trip (privacy_engine_test ``test_checkpoints``) with the import switched.

``save_checkpoint(path=, module=, optimizer=, noise_scheduler=)`` → a fresh
engine, ``make_private``, scheduler → ``load_checkpoint`` restores the model,
the optimizer, the scheduler, and the accountant (its history and ε: the
ledger travelled in the checkpoint).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from opacus_setup import private, run_epoch

from dpopt.schedulers import StepNoise


def test_checkpoint_round_trip_restores_model_optimizer_scheduler_and_accountant(tmp_path):
    engine, m, opt, loader = private(accountant="rdp")
    sched = StepNoise(opt, step_size=1, gamma=0.5)
    run_epoch(m, opt, loader)
    sched.step()  # sigma 0.5 from now on
    run_epoch(m, opt, loader, steps=2)
    path = tmp_path / "ckpt.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.save_checkpoint(path=path, module=m, optimizer=opt, noise_scheduler=sched)

    fresh, m2, opt2, _ = private(accountant="rdp", seed=5)
    sched2 = StepNoise(opt2, step_size=3, gamma=0.9)
    assert not torch.equal(next(m2.parameters()), next(m.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh.load_checkpoint(path=path, module=m2, optimizer=opt2, noise_scheduler=sched2)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert fresh.accountant.history == engine.accountant.history == [(1.0, 0.25, 4), (0.5, 0.25, 2)]
    assert fresh.accountant.get_epsilon(1e-5) == pytest.approx(engine.accountant.get_epsilon(1e-5), rel=1e-12)
    assert (sched2.last_epoch, sched2.step_size, sched2.gamma) == (1, 1, 0.5)
