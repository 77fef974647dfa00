"""Privatizer / DPOptimizer state never loses a release (DESIGN.md "The ledger travels with the state")."""

from __future__ import annotations

import copy

import pytest
import torch

from dpopt.engine.reference import PerSampleGrads
from dpopt.methods import make_optimizer
from dpopt.privatizer import Privatizer


def _run(p: Privatizer, steps: int) -> None:
    for _ in range(steps):
        p.privatize(PerSampleGrads([torch.randn(4, 3)]))


def test_older_state_of_the_same_run_keeps_the_later_releases():
    p = Privatizer(1.0, 1.0, 4.0, 0.1)
    _run(p, 2)
    old = copy.deepcopy(p.state_dict())
    _run(p, 3)
    with pytest.warns(UserWarning, match="the 3 releases made after that state stay charged"):
        p.load_state_dict(old)
    assert len(p.ledger) == 5 and p.steps == 2  # the counter rolls back, the record does not


def test_newer_state_replaces_a_prefix_and_other_runs_are_refused():
    p = Privatizer(1.0, 1.0, 4.0, 0.1)
    _run(p, 2)
    q = Privatizer(1.0, 1.0, 4.0, 0.1)
    q.load_state_dict(p.state_dict())
    _run(p, 2)
    q.load_state_dict(p.state_dict())  # q's 2 releases are a prefix of p's 4
    assert len(q.ledger) == 4 and q.ledger.run_id == p.ledger.run_id
    other = Privatizer(1.0, 1.0, 4.0, 0.1)
    _run(other, 1)
    with pytest.raises(ValueError, match="different runs"):
        q.load_state_dict(other.state_dict())
    assert len(q.ledger) == 4


def test_state_without_ledger_needs_a_ledger_that_holds_its_releases():
    p = Privatizer(1.0, 1.0, 4.0, 0.1)
    _run(p, 3)
    bare = p.state_dict(include_ledger=False)
    with pytest.raises(ValueError, match="saved after 3 releases but carries no ledger"):
        Privatizer(1.0, 1.0, 4.0, 0.1).load_state_dict(bare)
    q = Privatizer(1.0, 1.0, 4.0, 0.1)
    q.ledger.load_state_dict(p.ledger.state_dict())  # the ledger restored separately (a journal)
    q.load_state_dict(bare)
    assert q.steps == 3 and len(q.ledger) == 3


def test_dp_optimizer_refuses_a_plain_torch_state():
    w = [torch.nn.Parameter(torch.randn(3, 2))]
    opt = make_optimizer("dp-adam", w, noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.1)
    plain = torch.optim.Adam(w).state_dict()
    with pytest.raises(ValueError, match="restart epsilon from zero"):
        opt.load_state_dict(plain)
