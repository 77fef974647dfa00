"""Issue 42: the ledger keeps identical consecutive releases as one run-length group (memory and checkpoints),
ε of the grouped ledger is the per-release composition, the journal stays one line per release, and
checkpoints of the old format (three per-release copies) still load."""

from __future__ import annotations

import io
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpopt import PrivacyEngine
from dpopt.accounting.accountant import epsilon
from dpopt.accounting.events import (
    effective_noise_multiplier,
    poisson_composed_step,
    poisson_gaussian_step,
)
from dpopt.accounting.ledger import LedgerGroup, PrivacyLedger
from dpopt.accounting.pld import (
    _RELATIONS,
    _pld_epsilon_for_delta,
    _sampled_gaussian_pld,
    _self_compose,
)
from dpopt.accounting.rdp import RDP_ORDERS

DATA = Path(__file__).parent / "data"
DELTA = 1e-5
STEP = poisson_gaussian_step(1.1, 0.01)
META = {"max_grad_norm": 1.0, "sensitivity": 1.0, "noise_std": 1.1, "reads": 1, "releases": 1}


def _identical(n: int) -> PrivacyLedger:
    ledger = PrivacyLedger()
    for step in range(n):
        ledger.record(step, STEP, **META)
    return ledger


def _mixed() -> tuple[PrivacyLedger, list]:
    """σ changes, quantile clipping (a composed Gaussian pair), empty batches (same event, charged) and a
    resume (state_dict → load_state_dict, then more releases); returns the ledger and the per-release events."""
    ledger, events = PrivacyLedger(), []
    quantile = poisson_composed_step([1.3, 6.0], 0.02)
    plan = [
        (STEP, 5, META),
        (poisson_gaussian_step(1.5, 0.01), 4, dict(META, noise_std=1.5)),
        (quantile, 3, dict(META, released_fraction=0.5)),
        (quantile, 2, dict(META, released_fraction=0.75)),
        (STEP, 3, META),
        (STEP, 2, dict(META, reads=0)),
    ]  # the empty batches: same event, nothing read
    step = 0
    for i, (event, n, meta) in enumerate(plan):
        if i == 4:  # a resume: the saved state is taken into a fresh ledger, which goes on
            resumed = PrivacyLedger()
            resumed.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
            ledger = resumed
        for _ in range(n):
            ledger.record(step, event, **meta)
            events.append(event)
            step += 1
    return ledger, events


def test_identical_releases_are_one_group():
    ledger = _identical(10_000)
    assert len(ledger) == 10_000 and len(ledger.groups) == 1
    assert ledger.groups[0] == LedgerGroup(0, 10_000, STEP, META)
    last = ledger.last_entry
    assert (last.step, last.event, last.meta) == (9_999, STEP, META)
    assert [e.step for e in ledger.entries_since(9_997)] == [9_997, 9_998, 9_999]
    assert ledger.entries_since(10_000) == ()
    assert [e.step for e in ledger][:3] == [0, 1, 2] and sum(1 for _ in ledger) == 10_000
    assert PrivacyLedger().last_entry is None and PrivacyLedger().groups == ()


def test_groups_split_where_anything_differs():
    ledger, _ = _mixed()
    assert [(g.step, g.count) for g in ledger.groups] == [(0, 5), (5, 4), (9, 3), (12, 2), (14, 3), (17, 2)]
    # a gap in the steps starts a new group too
    gap = _identical(3)
    gap.record(10, STEP, **META)
    assert [(g.step, g.count) for g in gap.groups] == [(0, 3), (10, 1)]


def test_entries_round_trip_through_every_form():
    ledger, _ = _mixed()
    per_release = ledger.entries
    assert len(per_release) == 19
    for back in (PrivacyLedger.from_dict(ledger.state_dict()), PrivacyLedger.from_dict(ledger.to_dict())):
        assert back.entries == per_release and back.run_id == ledger.run_id
        assert back.extends(ledger) and ledger.extends(back)
    prefix = PrivacyLedger.from_dict(dict(ledger.to_dict(), entries=ledger.to_dict()["entries"][:13]))
    assert ledger.extends(prefix) and not prefix.extends(ledger)
    other = PrivacyLedger.from_dict(
        dict(
            ledger.to_dict(),
            entries=ledger.to_dict()["entries"][:12] + [dict(ledger.to_dict()["entries"][12], meta={"x": 1.0})],
        )
    )
    assert not ledger.extends(other)  # a different release at a shared position: another branch


def test_state_dict_size_does_not_grow_with_identical_releases():
    small = json.dumps(_identical(100).state_dict())
    large = json.dumps(_identical(10_000).state_dict())
    assert 0 <= len(large) - len(small) <= 8  # only the digits of the count differ
    assert json.loads(large)["version"] == 3 and json.loads(large)["groups"][0]["count"] == 10_000
    assert len(json.loads(json.dumps(_identical(10_000).to_dict()))["entries"]) == 10_000  # ledger.json: per release


def test_journal_is_one_line_per_release(tmp_path):
    ledger, _ = _mixed()
    ledger.open_journal(tmp_path / "ledger.jsonl")
    ledger.flush()
    lines = (tmp_path / "ledger.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 19  # the header, then one line per release
    assert [json.loads(line)["step"] for line in lines[1:]] == list(range(19))
    back = PrivacyLedger.read_journal(tmp_path / "ledger.jsonl")
    assert back.entries == ledger.entries and back.groups == ledger.groups


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_grouped_epsilon_equals_per_release_composition(accountant):
    ledger, events = _mixed()
    per_release = dp_event.ComposedDpEvent(events)  # no grouping at all: one event per release
    grouped = epsilon(ledger, DELTA, accountant)
    assert grouped == pytest.approx(epsilon(per_release, DELTA, accountant), rel=1e-9)
    assert 0 < grouped < float("inf")


def test_grouped_epsilon_equals_dp_accounting_rdp_release_by_release():
    ledger, events = _mixed()
    acc = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS))
    for event in events:
        acc.compose(event)
    assert epsilon(ledger, DELTA, "rdp") == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)


def test_grouped_epsilon_equals_dp_accounting_pld():
    """dp_accounting's PLDAccountant on the same releases (composed Gaussians collapsed to σ_eff, DESIGN.md)."""
    ledger, _ = _mixed()
    sigma_q = poisson_gaussian_step(effective_noise_multiplier([1.3, 6.0]), 0.02)
    counts = {STEP: 10, poisson_gaussian_step(1.5, 0.01): 4, sigma_q: 5}
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    for event, n in counts.items():
        acc.compose(event, n)
    assert epsilon(ledger, DELTA, "pld") == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)


@pytest.mark.parametrize("sigma,q,n", [(1.1, 0.01, 1), (1.0, 0.045, 300), (2.0, 0.2, 50)])
def test_cached_self_composition_and_scan_equal_dp_accounting(sigma, q, n):
    relation = _RELATIONS["add_or_remove_one"]
    theirs = _sampled_gaussian_pld(sigma, q, 1e-3, relation).self_compose(n)
    ours = _self_compose(sigma, q, 1e-3, relation, n)
    for a, b in ((theirs._pmf_remove, ours._pmf_remove), (theirs._pmf_add, ours._pmf_add)):
        assert a._lower_loss == b._lower_loss and a._infinity_mass == b._infinity_mass
        assert a._probs.shape == b._probs.shape and float(abs(a._probs - b._probs).max()) <= 1e-15
    for delta in (1e-8, 1e-5, 0.1):
        assert _pld_epsilon_for_delta(ours, delta) == pytest.approx(theirs.get_epsilon_for_delta(delta), rel=1e-9)


def test_incremental_epsilon_is_exact_after_every_growth():
    """A growing ledger scored again and again (the loop's epoch rows) gives the value of a fresh ledger."""
    ledger = _identical(10)
    for n in (10, 40, 41):
        while len(ledger) < n:
            ledger.record(len(ledger), STEP, **META)
        assert epsilon(ledger, DELTA, "pld") == epsilon(_identical(n), DELTA, "pld")
        assert epsilon(ledger, DELTA, "pld") == pytest.approx(
            epsilon(dp_event.SelfComposedDpEvent(STEP, n), DELTA, "pld"), rel=1e-12
        )


# -- PrivacyEngine checkpoints ------------------------------------------------------------------------------------
def _engine(accountant: str = "rdp"):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(40, 3), torch.randint(0, 2, (40,))), batch_size=8)
    engine = PrivacyEngine(accountant=accountant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.1, max_grad_norm=1.0
        )
    return engine, model, opt, loader


def _steps(model, opt, loader, n: int) -> None:
    done = 0
    while done < n:
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            done += 1
            if done == n:
                return


def _pad(engine, total: int) -> None:
    """Identical releases up to ``total`` (the last real release repeated, as a long run records them)."""
    while len(engine.ledger) < total:
        last = engine.ledger.last_entry
        engine.ledger.record(last.step + 1, last.event, **last.meta)


def _saved_bytes(tmp_path: Path, releases: int) -> int:
    engine, model, opt, loader = _engine()
    _steps(model, opt, loader, 3)
    _pad(engine, releases)
    tmp_path.mkdir()
    path = tmp_path / f"ckpt-{releases}.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=opt)
    assert not list(tmp_path.glob("*.tmp"))  # written atomically: no temporary file left behind
    return path.stat().st_size


def test_checkpoint_after_10000_identical_releases_is_the_size_of_one_after_100(tmp_path):
    small, large = _saved_bytes(tmp_path / "a", 100), _saved_bytes(tmp_path / "b", 10_000)
    assert abs(large - small) <= 64  # a few digits (counts, steps, run ids): not O(releases)


def test_checkpoint_holds_one_copy_of_the_ledger(tmp_path):
    engine, model, opt, loader = _engine()
    _steps(model, opt, loader, 4)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a file object without journal=
        engine.save_checkpoint(path=buf, module=model, optimizer=opt)
    ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    ledger = ckpt["privacy_ledger"]
    assert ledger["version"] == 3 and [g["count"] for g in ledger["groups"]] == [4]
    assert ckpt["optimizer_state_dict"]["privatizer"]["ledger"] is ledger  # one object: pickled once
    assert ckpt["privacy_accountant_state_dict"]["ledger"] is ledger


def test_checkpoint_round_trip_keeps_every_release(tmp_path):
    engine, model, opt, loader = _engine()
    _steps(model, opt, loader, 3)
    _pad(engine, 500)
    eps = engine.get_epsilon(DELTA)
    engine.save_checkpoint(path=tmp_path / "c.pt", module=model, optimizer=opt)
    fresh, model2, opt2, _ = _engine()
    fresh.load_checkpoint(path=tmp_path / "c.pt", module=model2, optimizer=opt2)
    assert len(fresh.ledger) == 500 and fresh.ledger.groups == engine.ledger.groups
    assert fresh.get_epsilon(DELTA) == eps


def test_old_format_checkpoint_loads(tmp_path):
    """``old_engine_checkpoint.pt``: written by dpopt before issue 42 (three per-release ledger copies; 3
    releases at σ 1.1 then 7 at σ 1.5; its ε under rdp at δ 1e-5 was 3.7945978784715186)."""
    for f in DATA.iterdir():
        if f.suffix in (".pt", ".jsonl"):
            shutil.copy(f, tmp_path)
    old = torch.load(tmp_path / "old_engine_checkpoint.pt", weights_only=False)
    assert len(old["privacy_ledger"]["entries"]) == 10 and old["privacy_ledger"]["version"] == 2
    engine, model, opt, loader = _engine()
    engine.load_checkpoint(path=tmp_path / "old_engine_checkpoint.pt", module=model, optimizer=opt)
    assert len(engine.ledger) == 10 and [(g.step, g.count) for g in engine.ledger.groups] == [(0, 3), (3, 7)]
    assert engine.get_epsilon(DELTA) == pytest.approx(3.7945978784715186, rel=1e-12)
    _steps(model, opt, loader, 2)  # training goes on, and its checkpoint is in the new form
    engine.save_checkpoint(path=tmp_path / "new.pt", module=model, optimizer=opt)
    assert torch.load(tmp_path / "new.pt", weights_only=False)["privacy_ledger"]["version"] == 3
    assert len(engine.ledger) == 12
