"""A ledger write that fails in the middle of a release (a full disk, a read-only journal) releases nothing.

The ledger is write-ahead for what is released (:meth:`dpopt.privatizer.Privatizer.release`): the entry is
recorded, and with an autoflushed journal written, before any noise is drawn. When that write raises, the
step is refused with a :class:`~dpopt.errors.LedgerWriteError` that names the write's error, says nothing was
released and what to do; the parameters are unchanged, the ledger (in memory and on disk) holds exactly the
releases applied, a correlated-noise stream did not advance, and the run goes on once the disk is fixed
(the old code left the Privatizer half open: every later ``step()`` raised "begin() called twice").
The :class:`~dpopt.errors.LedgerWriteError` tests run on make_private's door (independent, banded and BLT
noise) and on the Privatizer itself (the noise drawn, reproducible noise); ``dpopt train``'s batched journal
flush has its own full-disk tests (tests/faults/test_full_disk.py).
"""

from __future__ import annotations

import errno
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dpopt.accounting.ledger as ledger_module
from dpopt import PrivacyEngine
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.ledger_check import check_ledger
from dpopt.correlated_noise import Participation, make_mechanism
from dpopt.errors import LedgerWriteError
from dpopt.privatizer import Privatizer, QuantileClipping

MECHANISMS = ["independent", "banded:2", "blt"]


class FailingDisk:
    """Replaces the journal's ``append_whole``: write number ``fail_at`` (0-based, counted from its installation;
    one write per release with an autoflushed journal) and every later one raise ``error`` until ``fixed``."""

    def __init__(self, monkeypatch, fail_at: int, error: OSError):
        self.real, self.fail_at, self.error, self.fixed, self.writes = (
            ledger_module.append_whole,
            fail_at,
            error,
            False,
            0,
        )
        monkeypatch.setattr(ledger_module, "append_whole", self)

    def __call__(self, path, data: bytes, sync: bool = True) -> None:
        if not self.fixed and self.writes >= self.fail_at:
            raise self.error
        self.real(path, data, sync)
        self.writes += 1


def _private(tmp_path, mech: str, journal: bool = True):
    """make_private of a Linear(2, 2) (DP-SGD, σ = 1, C = 1) over 32 examples in batches of 8, 2 epochs,
    journaled (autoflush) to ``tmp_path / ledger.jsonl`` (unless ``journal`` is False); secret noise (so
    check_ledger passes)."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 2), torch.randint(0, 2, (32,))
    kw = {} if mech == "independent" else {"noise_mechanism": mech, "epochs": 2}
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=torch.nn.Linear(2, 2),
            optimizer="dp-sgd",
            data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
            lr=0.1,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            **kw,
        )
    if journal:
        engine.open_journal(tmp_path / "ledger.jsonl")
    return engine, model, opt, loader


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


def _assert_journal_is_the_ledger(engine, tmp_path, releases: int) -> None:
    """The journal re-read holds exactly the engine's ``releases`` releases, steps 0 … releases-1, and
    dpopt's ledger check passes it against the engine's claims (counts of reads and releases included)."""
    journal = PrivacyLedger.read_journal(tmp_path / "ledger.jsonl")
    assert len(journal) == len(engine.ledger) == releases
    assert [e.step for e in journal] == list(range(releases))
    assert [e.to_dict() for e in journal] == [e.to_dict() for e in engine.ledger]
    result = check_ledger(journal, engine.summary(1e-5))
    assert result.passed, result.format()


@pytest.mark.parametrize("mech", MECHANISMS)
@pytest.mark.parametrize(
    "error",
    [OSError(errno.ENOSPC, "No space left on device"), PermissionError(errno.EACCES, "Permission denied")],
    ids=["full-disk", "read-only"],
)
def test_a_failed_ledger_write_releases_nothing_and_the_run_goes_on(tmp_path, monkeypatch, mech, error):
    """Release 2 (0-based) of make_private's optimizer fails to write its entry. That step raises
    LedgerWriteError (its cause's text, "Nothing was released"), the parameters are those after release 1,
    the journal and the ledger hold releases 0-1, a repeated step() raises the same refusal (not "begin()
    called twice"). Once the disk is fixed the loop goes on: independent noise releases the next batch as
    release 2; correlated noise releases the failed cyclic batch as pure noise (release 2) when the loop
    moves on, then the next batch as release 3 — the stream never saw the failed attempt. The journal then
    holds exactly the releases applied, and passes the ledger check."""
    engine, model, opt, loader = _private(tmp_path, mech)
    disk = FailingDisk(monkeypatch, 2, error)
    batches = iter(loader)
    for _ in range(2):
        x, y = next(batches)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    before = _params(model)
    x, y = next(batches)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(LedgerWriteError, match=r"ledger write of release 3 \(1-based\) failed") as info:
        opt.step()
    text = str(info.value)
    assert error.strerror in text and "Nothing was released" in text and "Free space" in text
    assert "per-sample gradients were dropped" in text and "forward and backward" in text and "step()" in text
    assert "step again (" not in text  # the old advice: a bare step() cannot retry (its records are gone)
    assert info.value.__cause__ is error and isinstance(info.value, OSError)
    assert _same(_params(model), before) and all(p.grad is None for p in model.parameters())
    assert opt.privatizer.steps == 2 and len(engine.ledger) == 2
    _assert_journal_is_the_ledger(engine, tmp_path, 2)
    with pytest.raises(LedgerWriteError, match="ledger write of release 3.*repeats a refused step") as again:
        opt.step()  # no new backward: the refusal again (its class, an OSError), never "begin() called twice"
    assert "begin()" not in str(again.value) and isinstance(again.value, OSError)
    assert "zero_grad(), forward, backward and step()" in str(again.value)
    assert opt.privatizer.steps == 2 and len(engine.ledger) == 2 and _same(_params(model), before)

    disk.fixed = True
    x, y = next(batches)  # correlated noise: handing this batch out releases the failed one (pure noise)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    applied = 3 if mech == "independent" else 4
    assert opt.privatizer.steps == applied and not _same(_params(model), before)
    _assert_journal_is_the_ledger(engine, tmp_path, applied)


@pytest.mark.parametrize("mech", MECHANISMS)
def test_a_disk_that_stays_full_refuses_every_step_clearly(tmp_path, monkeypatch, mech):
    """The disk never comes back: every later step() on a new batch raises LedgerWriteError again (correlated
    noise: from the loader, whose next batch first owes the failed batch's pure-noise release), nothing more is
    applied or recorded, and the owed release is still owed (it is attempted again, not forgotten)."""
    engine, model, opt, loader = _private(tmp_path, mech)
    FailingDisk(monkeypatch, 1, OSError(errno.ENOSPC, "No space left on device"))
    batches = iter(loader)
    x, y = next(batches)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    after_first = _params(model)
    for _ in range(2):
        with pytest.raises(LedgerWriteError, match=r"release 2 \(1-based\) failed.*No space left"):
            x, y = next(batches)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        opt.zero_grad()
        if mech != "independent":  # the loader's generator ended with the error: a new pass
            batches = iter(loader)
    assert _same(_params(model), after_first)
    assert opt.privatizer.steps == 1 == len(engine.ledger)
    _assert_journal_is_the_ledger(engine, tmp_path, 1)


def _privatizer(mech: str, ledger: PrivacyLedger, seed: int = 7, quantile=None) -> Privatizer:
    """A Privatizer of σ = 1, C = 1, B̄ = 4 with reproducible noise (``seed``) and ``mech`` over 6 steps."""
    mechanism = None if mech == "independent" else make_mechanism(mech, 1.0, Participation(6, 2, 3))
    return Privatizer(
        1.0,
        1.0,
        4.0,
        0.25,
        ledger=ledger,
        generator=torch.Generator().manual_seed(seed),
        mechanism=mechanism,
        quantile=quantile,
    )


def _pure_noise(priv: Privatizer) -> torch.Tensor:
    """One release of a zero sum (an empty step): the release IS the step's noise / B̄."""
    priv.begin()
    return priv.release(params_like=[torch.zeros(5, 3)]).grads[0]


@pytest.mark.parametrize("mech", MECHANISMS)
def test_the_failed_release_draws_no_noise_and_the_stream_does_not_advance(tmp_path, monkeypatch, mech):
    """Reproducible noise, σ = 1: a run whose release 2 fails to write and is retried (the Privatizer keeps the
    step open; ``release()`` again) releases the SAME values, bit for bit, as a run without the failure. So the failed attempt drew nothing from the noise
    source and put nothing into the correlated stream (a draw made for it would shift every later value), and
    no draw is reused: the noise of release t is the noise release t has without a failure."""
    reference = _privatizer(mech, PrivacyLedger())
    expected = [_pure_noise(reference) for _ in range(4)]
    ledger = PrivacyLedger()
    ledger.open_journal(tmp_path / "ledger.jsonl", autoflush=True)
    priv = _privatizer(mech, ledger)
    disk = FailingDisk(monkeypatch, 2, OSError(errno.ENOSPC, "No space left on device"))
    drawn = []
    start_normal = priv.noise.start_normal
    monkeypatch.setattr(priv.noise, "start_normal", lambda *a, **k: drawn.append(a) or start_normal(*a, **k))
    got = [_pure_noise(priv) for _ in range(2)]
    calls = len(drawn)
    with pytest.raises(LedgerWriteError, match="Nothing was released"):
        _pure_noise(priv)
    assert len(drawn) == calls and priv.steps == 2 and len(ledger) == 2  # nothing drawn for the failed release
    disk.fixed = True
    got.append(priv.release(params_like=[torch.zeros(5, 3)]).grads[0])  # the step stayed open: retried
    got.append(_pure_noise(priv))
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert priv.steps == 4 and [e.step for e in PrivacyLedger.read_journal(tmp_path / "ledger.jsonl")] == [0, 1, 2, 3]


def test_quantile_clipping_discards_the_failed_release_noise_and_keeps_its_bound(tmp_path, monkeypatch):
    """Quantile clipping's entry holds the noisy count, so its noise is drawn before the write: when the write
    fails, the bound stays the one before the step (no adaptation from an unrecorded count), the clip history
    does not grow, and the next release draws FRESH noise: none of the failed attempt's normals (gradient
    and count) reappears in it (with reproducible noise the generator has moved on: P(equal) = 0)."""
    ledger = PrivacyLedger()
    ledger.open_journal(tmp_path / "ledger.jsonl", autoflush=True)
    priv = _privatizer("independent", ledger, quantile=QuantileClipping(2.0, 0.5, 0.2))
    disk = FailingDisk(monkeypatch, 1, OSError(errno.ENOSPC, "No space left on device"))
    draws = []
    draw = priv._draw
    monkeypatch.setattr(priv, "_draw", lambda *a, **k: draws.append(_copied(draw(*a, **k))) or draws[-1])
    _pure_noise(priv)
    bound, history = priv.bounds, list(priv.clip_history)
    with pytest.raises(LedgerWriteError, match=r"release 2 \(1-based\) failed"):
        _pure_noise(priv)
    assert priv.bounds == bound and priv.clip_history == history and len(ledger) == 1 and priv.steps == 1
    disk.fixed = True
    priv.release(params_like=[torch.zeros(5, 3)])  # the step stayed open: retried
    (failed, failed_count), (fresh, fresh_count) = draws[1], draws[2]
    assert not torch.isin(fresh[0].flatten(), failed[0].flatten()).any() and fresh_count != failed_count
    assert [e.step for e in PrivacyLedger.read_journal(tmp_path / "ledger.jsonl")] == [0, 1]
    assert priv.clip_history == history + [bound[0]]


def _copied(drawn):
    """A ``_draw`` result (noise list, count noise) with its tensors cloned (the release adds into them)."""
    noise, count = drawn
    return [z.clone() for z in noise], count


def test_a_ledger_record_whose_journal_write_fails_leaves_the_ledger_as_it_was(tmp_path, monkeypatch):
    """PrivacyLedger.record with an autoflushed journal is all or nothing: the failed entry is not in memory
    (whether it would have joined the last run-length group or started a new one), and the next record
    writes the journal's header and entries as if the failure never happened."""
    from dp_accounting import dp_event

    ledger = PrivacyLedger()
    ledger.open_journal(tmp_path / "j.jsonl", autoflush=True)
    event = dp_event.GaussianDpEvent(1.0)
    disk = FailingDisk(monkeypatch, 1, OSError(errno.ENOSPC, "No space left on device"))
    ledger.record(0, event, noise_std=1.0)
    for step, meta in [(1, {"noise_std": 1.0}), (1, {"noise_std": 2.0})]:  # joins group 0 / a new group
        with pytest.raises(OSError, match="No space left"):
            ledger.record(step, event, **meta)
        assert len(ledger) == 1 and len(ledger.groups) == 1 and ledger.groups[0].count == 1
    disk.fixed = True
    ledger.record(1, event, noise_std=2.0)
    on_disk = PrivacyLedger.read_journal(tmp_path / "j.jsonl")
    assert [e.to_dict() for e in on_disk] == [e.to_dict() for e in ledger] and len(on_disk) == 2


def test_step_after_the_engine_was_detached_says_so(tmp_path):
    """engine.detach() removes the per-sample hooks: a later step() says the engine was detached and what to do
    (make_private again), not "without a backward pass"; nothing is released. make_private again trains."""
    engine, model, opt, loader = _private(tmp_path, "independent")
    batches = iter(loader)
    x, y = next(batches)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    engine.detach()
    before = _params(model)
    x, y = next(batches)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(
        RuntimeError, match=r"after the PrivacyEngine was detached.*make_private\(\.\.\.\) again"
    ) as info:
        opt.step()
    assert "without a backward pass" not in str(info.value)
    assert _same(_params(model), before) and len(engine.ledger) == 1 == opt.privatizer.steps
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=model,
            optimizer="dp-sgd",
            data_loader=DataLoader(loader.dataset, batch_size=8),
            lr=0.1,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    x, y = next(iter(loader))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert len(engine.ledger) == 2 and not _same(_params(model), before)


@pytest.mark.parametrize("mech", ["independent", "banded:2"])
def test_the_dp_optimizer_door_discards_a_failed_step_and_steps_again(tmp_path, monkeypatch, mech):
    """DPOptimizer.step (the door of ``dpopt train``'s loop and of make_optimizer): release 1 fails to write;
    the step raises LedgerWriteError, the parameters are unchanged and the next step() is a clean release 1
    (before: "begin() called twice"); the journal holds releases 0 and 1 only. (``dpopt train`` itself journals
    in batches, flushed before any file that depends on a release; its full disk: tests/faults/test_full_disk.py.)"""
    from dpopt.engine.reference import PerSampleGrads
    from dpopt.methods import make_optimizer

    ledger = PrivacyLedger()
    ledger.open_journal(tmp_path / "ledger.jsonl", autoflush=True)
    w = torch.nn.Parameter(torch.zeros(3))
    mechanism = None if mech == "independent" else make_mechanism(mech, 1.0, Participation(6, 2, 3))
    opt = make_optimizer(
        "dp-sgd",
        [w],
        noise_multiplier=1.0,
        expected_batch_size=2.0,
        sample_rate=0.5,
        ledger=ledger,
        mechanism=mechanism,
        lr=0.1,
    )
    disk = FailingDisk(monkeypatch, 1, OSError(errno.ENOSPC, "No space left on device"))
    grads = PerSampleGrads([torch.ones(2, 3)])
    opt.step(grads)
    before = w.detach().clone()
    with pytest.raises(LedgerWriteError, match=r"release 2 \(1-based\) failed.*Nothing was released"):
        opt.step(grads)
    assert torch.equal(w.detach(), before) and opt.privatizer.steps == 1 == len(ledger)
    disk.fixed = True
    release = opt.step(grads)
    assert release.step == 1 and not torch.equal(w.detach(), before)
    assert [e.step for e in PrivacyLedger.read_journal(tmp_path / "ledger.jsonl")] == [0, 1]


def test_a_correlated_stream_that_cannot_go_on_is_refused_before_its_release_is_charged():
    """A copy of a correlated-noise Privatizer has no stream state (never copied): its next release is refused
    BEFORE the entry is written (the write-ahead ledger must not charge a release the stream cannot make)."""
    import copy

    priv = _privatizer("banded:2", PrivacyLedger())
    _pure_noise(priv)
    twin = copy.deepcopy(priv)
    twin.begin()
    with pytest.raises(RuntimeError, match="stream at release 0 but asked for release 1"):
        twin.release(params_like=[torch.zeros(5, 3)])
    assert len(twin.ledger) == 1 and twin.steps == 1


def test_a_retry_after_a_failed_draw_uses_its_written_entry_once_and_only_with_its_settings(monkeypatch):
    """The noise draw fails AFTER the entry was written ahead: the entry stays (charged), the step stays open;
    a retry with another sigma is refused (the release would not be the one on record: under-charged), a retry
    with the recorded settings releases without writing a second entry; a step discarded instead keeps its
    index used (the ledger holds it), so the next release is index 1, not a second index 0."""
    priv = _privatizer("independent", PrivacyLedger())
    normals = priv._normals

    def failing(*a, **k):
        raise MemoryError("noise draw failed")

    monkeypatch.setattr(priv, "_normals", failing)
    priv.begin()
    with pytest.raises(MemoryError):
        priv.release(params_like=[torch.zeros(5, 3)])
    assert len(priv.ledger) == 1 and priv.steps == 0
    monkeypatch.setattr(priv, "_normals", normals)
    priv.noise_multiplier = 0.5
    with pytest.raises(RuntimeError, match=r"release 1 \(1-based\) is on record with .*sigma or the clip bound"):
        priv.release(params_like=[torch.zeros(5, 3)])
    priv.noise_multiplier = 1.0
    release = priv.release(params_like=[torch.zeros(5, 3)])
    assert release.step == 0 and len(priv.ledger) == 1 and priv.steps == 1
    monkeypatch.setattr(priv, "_normals", failing)
    priv.begin()
    with pytest.raises(MemoryError):
        priv.release(params_like=[torch.zeros(5, 3)])
    priv._reset()  # discarded: release 1 stays charged, its index used
    monkeypatch.setattr(priv, "_normals", normals)
    assert priv.steps == 2 and [e.step for e in priv.ledger] == [0, 1]
    assert _pure_noise(priv).shape == (5, 3) and [e.step for e in priv.ledger] == [0, 1, 2]


@pytest.mark.parametrize("mech", ["independent", "banded:2"])
def test_step_after_detach_on_a_released_batch_says_detached_first(tmp_path, mech):
    """A second step() on a batch already released, after engine.detach(): the detach refusal (what to do:
    make_private again), not the release boundary's "already released" one, which would send the user looking
    for a loop bug; nothing released."""
    engine, model, opt, loader = _private(tmp_path, mech)
    x, y = next(iter(loader))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    engine.detach()
    before = _params(model)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for _ in range(2):  # repeated without a new backward: still the detach refusal
        with pytest.raises(RuntimeError, match=r"after the PrivacyEngine was detached") as info:
            opt.step()
        assert "already released" not in str(info.value) and "cyclic batch of step" not in str(info.value)
    assert _same(_params(model), before) and len(engine.ledger) == 1 == opt.privatizer.steps


@pytest.mark.parametrize("mech", MECHANISMS)
def test_after_a_failed_write_a_new_backward_on_the_same_batch_makes_the_release(tmp_path, monkeypatch, mech):
    """What the LedgerWriteError message says to do: fix the cause, run the forward and backward pass of the batch
    again and step(). That step makes release 3 (1-based) on the same batch (correlated noise: the cyclic batch of
    step 3, no pure-noise release), and the journal holds exactly the releases applied."""
    engine, model, opt, loader = _private(tmp_path, mech)
    disk = FailingDisk(monkeypatch, 2, OSError(errno.ENOSPC, "No space left on device"))
    batches = iter(loader)
    for _ in range(3):
        x, y = next(batches)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if opt.privatizer.steps == 2:
            with pytest.raises(LedgerWriteError):
                opt.step()
            disk.fixed = True
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert opt.privatizer.steps == 3 == len(engine.ledger)
    _assert_journal_is_the_ledger(engine, tmp_path, 3)


def test_withdraw_last_takes_back_only_an_unwritten_entry(tmp_path):
    """A data-parallel release that no rank made: the entry in memory is taken back (groups too), never a
    written one."""
    from dp_accounting import dp_event

    ledger = PrivacyLedger()
    event = dp_event.GaussianDpEvent(1.0)
    for step in range(3):  # one run-length group of 3
        ledger.record(step, event, noise_std=1.0)
    assert ledger._withdraw_last() and len(ledger) == 2 and len(ledger.groups) == 1
    ledger.record(2, dp_event.GaussianDpEvent(2.0), noise_std=2.0)  # a new group of 1
    assert len(ledger.groups) == 2 and ledger._withdraw_last() and len(ledger.groups) == 1
    assert [e.step for e in ledger.entries] == [0, 1]
    ledger.open_journal(tmp_path / "j.jsonl", autoflush=True)
    ledger.record(2, event, noise_std=1.0)  # written: stays
    assert not ledger._withdraw_last() and len(ledger) == 3
    assert [e.step for e in PrivacyLedger.load(tmp_path / "j.jsonl").entries] == [0, 1, 2]
    assert not PrivacyLedger()._withdraw_last()


def test_a_journal_that_cannot_be_started_leaves_none_so_another_path_opens(tmp_path, monkeypatch):
    """open_journal whose first write fails (disk full) raises it and keeps no journal: before, the engine kept
    the failed path and refused every other one ("already keeps its ledger journal at ..."), so every later
    step failed. Now another path opens, the steps go on, and the journal holds the whole ledger."""
    engine, model, opt, loader = _private(tmp_path, "independent", journal=False)
    for xb, yb in loader:  # one release before any journal: the journal must then hold it too
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        break
    failing = FailingDisk(monkeypatch, fail_at=0, error=OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError, match="No space left"):
        engine.open_journal(tmp_path / "full.jsonl")
    failing.fixed = True
    assert engine.open_journal(tmp_path / "ledger.jsonl") == tmp_path / "ledger.jsonl"
    for xb, yb in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    _assert_journal_is_the_ledger(engine, tmp_path, len(engine.ledger))
    assert len(engine.ledger) >= 2
