"""PrivacyEngine state that carries the ledger (issue 19, items 3 and 5).

Done-when: save -> fresh engine + fresh make_private -> load -> one more epoch gives the
epsilon of the WHOLE run, by both routes (save_checkpoint/load_checkpoint and
optimizer.state_dict()/load_state_dict()); loading an OLDER checkpoint keeps the releases made
after it (the journal). Before the fix, one digits epoch saved and reloaded then trained one
more reported epsilon 1.834 where the two epochs cost 2.279 (issue text). Also: states without
a ledger are refused, step() without backward raises while an empty Poisson batch still
releases, and non-default samplers are refused by make_private.

Expected values are computed independently with dpsgd_epsilon(sigma, q, steps) (the
accountant of plain DP-SGD at the Poisson rate and the steps run), never from the engine.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset, WeightedRandomSampler

import dpopt
from dpopt.accounting.accountant import dpsgd_epsilon
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.ledger_check import check_ledger
from dpopt.data import load_dataset

SIGMA, DELTA = 1.0, 1e-5
Q = 1 / 23  # len(DataLoader(1437 digits, batch_size=64)) = 23 -> q = 1/23, 23 steps per epoch


@pytest.fixture(scope="module")
def digits():
    d = load_dataset("digits")
    return TensorDataset(d.x_train.view(len(d.x_train), -1), d.y_train)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _private(digits, optimizer="adamw", model=None):
    engine = dpopt.PrivacyEngine()
    model = model or _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3) if optimizer == "adamw" else optimizer
    extra = {"lr": 2e-3} if isinstance(opt, str) else {}
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(digits, batch_size=64, shuffle=True),
        noise_multiplier=SIGMA,
        max_grad_norm=1.0,
        **extra,
    )
    return engine, model, opt, loader


def _epoch(model, opt, loader) -> None:
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _passes(engine) -> None:
    result = check_ledger(engine.ledger, engine.summary(DELTA))
    assert all(item.passed for item in result.items), [(i.name, i.evidence) for i in result.items]


def test_engine_ledger_is_every_privatizers_ledger(digits):
    engine, _, opt, _ = _private(digits)
    assert opt.privatizer.ledger is engine.ledger  # the releases land in the engine's ledger directly


@pytest.mark.parametrize("optimizer", ["adamw", "dp-adam"])
def test_optimizer_state_dict_route_keeps_the_whole_runs_epsilon(digits, tmp_path, optimizer):
    torch.manual_seed(0)
    engine, model, opt, loader = _private(digits, optimizer)
    _epoch(model, opt, loader)
    one_epoch = engine.get_epsilon(DELTA)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "state.pt")
    saved = torch.load(tmp_path / "state.pt")  # weights_only=True (torch's default) reads it
    assert "privatizer" in saved["optimizer"] and "noise_state" not in saved["optimizer"]["privatizer"]

    engine2, model2, opt2, loader2 = _private(digits, optimizer)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    assert len(engine2.ledger) == 23 and engine2.ledger.run_id == engine.ledger.run_id
    assert opt2.privatizer.ledger is engine2.ledger
    _epoch(model2, opt2, loader2)
    whole = dpsgd_epsilon(SIGMA, Q, 2 * 23, DELTA)
    assert len(engine2.ledger) == 46
    assert engine2.get_epsilon(DELTA) == pytest.approx(whole, rel=1e-9)
    assert engine2.get_epsilon(DELTA) > one_epoch * 1.1  # before the fix it reported one epoch's epsilon
    _passes(engine2)


def test_save_and_load_checkpoint_keep_the_whole_runs_epsilon(digits, tmp_path):
    torch.manual_seed(0)
    engine, model, opt, loader = _private(digits)
    _epoch(model, opt, loader)
    path = tmp_path / "ckpt.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=opt, checkpoint_dict={"epoch": 1})
    raw = torch.load(path)
    assert (
        raw["epoch"] == 1 and raw["accountant"] == "pld" and len(PrivacyLedger.from_dict(raw["privacy_ledger"])) == 23
    )
    assert sum(g["count"] for g in raw["privacy_ledger"]["groups"]) == 23  # run-length form (issue 42)
    assert raw["dpopt_checkpoint"]["run_id"] == engine.ledger.run_id
    assert engine.journal == tmp_path / f"ledger-{engine.ledger.run_id}.jsonl"

    engine2, model2, opt2, loader2 = _private(digits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the journal holds nothing beyond the checkpoint: no warning
        out = engine2.load_checkpoint(path=path, module=model2, optimizer=opt2)
    assert out["epoch"] == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    _epoch(model2, opt2, loader2)
    assert engine2.get_epsilon(DELTA) == pytest.approx(dpsgd_epsilon(SIGMA, Q, 46, DELTA), rel=1e-9)
    assert len(PrivacyLedger.read_journal(engine2.journal)) == 46  # the loaded run goes on in the journal
    _passes(engine2)


def test_loading_an_older_checkpoint_keeps_the_releases_made_after_it(digits, tmp_path):
    torch.manual_seed(0)
    engine, model, opt, loader = _private(digits)
    _epoch(model, opt, loader)
    engine.save_checkpoint(path=tmp_path / "epoch1.pt", module=model, optimizer=opt)
    _epoch(model, opt, loader)  # epoch 2: each release is appended to the journal as it is made
    assert len(PrivacyLedger.read_journal(engine.journal)) == 46

    engine2, model2, opt2, loader2 = _private(digits)
    with pytest.warns(UserWarning, match="the 23 releases made after it stay charged"):
        engine2.load_checkpoint(path=tmp_path / "epoch1.pt", module=model2, optimizer=opt2)
    assert len(engine2.ledger) == 46
    _epoch(model2, opt2, loader2)
    three = dpsgd_epsilon(SIGMA, Q, 3 * 23, DELTA)
    assert engine2.get_epsilon(DELTA) == pytest.approx(three, rel=1e-9)
    assert engine2.get_epsilon(DELTA) > dpsgd_epsilon(SIGMA, Q, 2 * 23, DELTA) * 1.05
    assert len(PrivacyLedger.read_journal(engine2.journal)) == 69
    _passes(engine2)


def test_older_optimizer_state_with_an_open_journal_keeps_later_releases(digits, tmp_path):
    torch.manual_seed(0)
    engine, model, opt, loader = _private(digits)
    engine.open_journal(tmp_path / "run.jsonl")
    _epoch(model, opt, loader)
    state = opt.state_dict()
    assert state["dpopt"]["journal"] == str((tmp_path / "run.jsonl").resolve())
    torch.save(state, tmp_path / "opt.pt")
    _epoch(model, opt, loader)
    engine2, model2, opt2, loader2 = _private(digits)
    with pytest.warns(UserWarning, match="23 releases made after it"):
        opt2.load_state_dict(torch.load(tmp_path / "opt.pt"))
    assert engine2.get_epsilon(DELTA) == pytest.approx(dpsgd_epsilon(SIGMA, Q, 46, DELTA), rel=1e-9)


def test_same_engine_rolling_back_keeps_its_releases(digits):
    torch.manual_seed(0)
    engine, model, opt, loader = _private(digits)
    _epoch(model, opt, loader)
    old = opt.state_dict()
    _epoch(model, opt, loader)
    with pytest.warns(UserWarning, match="23 releases made after it stay charged"):
        opt.load_state_dict(old)
    assert len(engine.ledger) == 46
    _passes(engine)


def test_states_without_a_ledger_are_refused(digits):
    torch.manual_seed(0)
    engine, model, opt, loader = _private(digits)
    plain = torch.optim.AdamW(_mlp().parameters(), lr=1e-3).state_dict()
    with pytest.raises(ValueError, match="epsilon would restart from zero"):
        opt.load_state_dict(plain)  # a fresh engine: refused too
    assert len(engine.ledger) == 0
    _epoch(model, opt, loader)
    with pytest.raises(ValueError, match="already made 23 releases"):
        opt.load_state_dict(plain)
    no_ledger = opt.original_optimizer.state_dict()
    no_ledger["privatizer"] = opt.privatizer.state_dict(include_ledger=False)
    with pytest.raises(ValueError, match="already made 23 releases"):
        opt.load_state_dict(no_ledger)
    assert len(engine.ledger) == 23


def test_a_state_of_another_run_is_refused_into_a_run_with_releases(digits):
    torch.manual_seed(0)
    a, model_a, opt_a, loader_a = _private(digits)
    b, model_b, opt_b, loader_b = _private(digits)
    _epoch(model_a, opt_a, loader_a)
    _epoch(model_b, opt_b, loader_b)
    with pytest.raises(ValueError, match="different runs"):
        opt_b.load_state_dict(opt_a.state_dict())
    assert len(b.ledger) == 23 and b.ledger.run_id != a.ledger.run_id
    with pytest.raises(ValueError, match="another PrivacyEngine"):
        b.save_checkpoint(path="unused.pt", module=model_a, optimizer=opt_a)


def test_checkpoint_from_opacus_shape_without_ledger_is_refused(digits, tmp_path):
    engine, model, opt, _ = _private(digits)
    torch.save(
        {
            "module_state_dict": model.state_dict(),
            "optimizer_state_dict": opt.original_optimizer.state_dict(),
            "privacy_accountant_state_dict": {"history": [(1.0, Q, 23)], "mechanism": "rdp"},
        },
        tmp_path / "opacus.pt",
    )
    with pytest.raises(ValueError, match="carries no privacy ledger"):
        engine.load_checkpoint(path=tmp_path / "opacus.pt", module=model, optimizer=opt)


def test_checkpoint_of_an_old_ledger_without_run_id_loads(digits, tmp_path):
    torch.manual_seed(0)
    engine, model, opt, loader = _private(digits)
    _epoch(model, opt, loader)
    engine.save_checkpoint(path=tmp_path / "c.pt", module=model, optimizer=opt)
    ckpt = torch.load(tmp_path / "c.pt")
    for ledger in (ckpt["privacy_ledger"], ckpt["optimizer_state_dict"]["privatizer"]["ledger"]):
        ledger.pop("run_id", None)  # one object since issue 42 (the checkpoint stores the ledger once)
    assert "run_id" not in ckpt["optimizer_state_dict"]["privatizer"]["ledger"]
    del ckpt["dpopt_checkpoint"]  # and no journal recorded
    torch.save(ckpt, tmp_path / "old.pt")
    engine2, model2, opt2, _ = _private(digits)
    engine2.load_checkpoint(path=tmp_path / "old.pt", module=model2, optimizer=opt2)
    assert len(engine2.ledger) == 23
    assert engine2.get_epsilon(DELTA) == pytest.approx(dpsgd_epsilon(SIGMA, Q, 23, DELTA), rel=1e-9)


# --- item 5: loop misuse -------------------------------------------------------------------------
def test_step_without_backward_raises_and_records_nothing(digits):
    engine, model, opt, loader = _private(digits)
    x, y = next(iter(loader))  # a batch the loader handed out (a step on other data is refused first)
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="without a backward pass"):
        opt.step()  # nothing since zero_grad
    model(x)  # a forward without backward
    with pytest.raises(RuntimeError, match="without a backward pass"):
        opt.step()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    with pytest.raises(ValueError, match="already released"):
        opt.step()  # the same backward (and batch) is not released twice
    assert len(engine.ledger) == 1


def test_empty_poisson_batch_is_still_a_release(digits):
    engine, model, opt, loader = _private(digits)
    next(iter(loader))  # a batch handed out; the step releases an empty subset of it (a valid release)
    x, y = loader.collate_fn([])  # the loader's own empty batch (shapes [0, 64] and [0])
    assert x.shape == (0, 64) and y.shape == (0,)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert len(engine.ledger) == 1 and engine.ledger.entries[0].meta["noise_std"] == SIGMA * 1.0
    assert all(torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0 for p in model.parameters())  # noise
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


# --- item 6: samplers ---------------------------------------------------------------------------
class _Halves(torch.utils.data.Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        yield list(range(self.n // 2))
        yield list(range(self.n // 2, self.n))

    def __len__(self):
        return 2


@pytest.mark.parametrize(
    "make",
    [
        lambda ds: DataLoader(ds, batch_size=64, sampler=WeightedRandomSampler(torch.ones(len(ds)), len(ds))),
        lambda ds: DataLoader(ds, batch_sampler=_Halves(len(ds))),
        lambda ds: DataLoader(ds, batch_size=64, sampler=RandomSampler(ds, replacement=True)),
        lambda ds: DataLoader(ds, batch_size=None),
    ],
    ids=["weighted", "batch_sampler", "replacement", "no-batching"],
)
def test_non_default_samplers_are_refused_with_advice(digits, make):
    engine = dpopt.PrivacyEngine()
    model = _mlp()
    with pytest.raises(ValueError, match="poisson_sampling=False"):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=make(digits),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    assert not model._forward_hooks and not model._forward_pre_hooks  # the refusal left no hook behind


def test_custom_sampler_kept_with_poisson_sampling_false(digits):
    engine = dpopt.PrivacyEngine()
    model = _mlp()
    user = DataLoader(digits, batch_size=64, sampler=WeightedRandomSampler(torch.ones(len(digits)), len(digits)))
    with pytest.warns(UserWarning, match="poisson_sampling=False"):
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=user,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )
    assert loader is user and engine.ledger.sampling != "poisson"
    x, y = next(iter(loader))
    assert len(y) == 64  # the user's batches, not Poisson ones


@pytest.mark.parametrize("shuffle", [False, True])
def test_default_loaders_still_become_poisson(digits, shuffle):
    model = _mlp()
    _, _, loader = dpopt.PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(digits, batch_size=64, shuffle=shuffle),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    assert loader.sample_rate == pytest.approx(Q) and len(loader) == 23


def test_summary_json_ready_after_load(digits, tmp_path):
    torch.manual_seed(0)
    engine, model, opt, loader = _private(digits)
    _epoch(model, opt, loader)
    engine.save_checkpoint(path=tmp_path / "c.pt", module=model, optimizer=opt)
    engine2, model2, opt2, _ = _private(digits)
    engine2.load_checkpoint(path=tmp_path / "c.pt", module=model2, optimizer=opt2)
    summary = engine2.summary(DELTA)
    assert summary["steps"] == 23 and summary["privatizer_releases"] == 23
    json.dumps(summary)


def test_journal_paths_moved_missing_and_foreign(digits, tmp_path):
    torch.manual_seed(0)
    engine, model, opt, loader = _private(digits)
    _epoch(model, opt, loader)
    (tmp_path / "a").mkdir()
    engine.save_checkpoint(path=tmp_path / "a" / "c.pt", module=model, optimizer=opt)
    _epoch(model, opt, loader)
    (tmp_path / "a").rename(tmp_path / "b")  # the directory moves as a whole: the journal is found
    engine2, model2, opt2, _ = _private(digits)
    with pytest.warns(UserWarning, match="23 releases made after it"):
        engine2.load_checkpoint(path=tmp_path / "b" / "c.pt", module=model2, optimizer=opt2)
    assert len(engine2.ledger) == 46 and engine2.journal.parent == tmp_path / "b"

    other, model3, opt3, _ = _private(digits)
    other.open_journal(tmp_path / "other.jsonl")
    with pytest.raises(ValueError, match="already keeps its journal"):  # refused before anything changes
        other.load_checkpoint(path=tmp_path / "b" / "c.pt", module=model3, optimizer=opt3)
    assert len(other.ledger) == 0

    foreign = PrivacyLedger()  # another run's journal, with one release in it
    foreign.record(0, engine.ledger.entries[0].event, **engine.ledger.entries[0].meta)
    foreign.open_journal(tmp_path / "foreign.jsonl")
    foreign.flush()
    with pytest.raises(ValueError, match="another run's record"):
        dpopt.PrivacyEngine().save_checkpoint(path=tmp_path / "y.pt", module=model3, journal=tmp_path / "foreign.jsonl")
    assert not (tmp_path / "y.pt").exists()

    engine2.journal.unlink()  # the journal gone: the checkpoint's own ledger is charged, warned
    engine5, model5, opt5, _ = _private(digits)
    with pytest.warns(UserWarning, match="which is missing"):
        engine5.load_checkpoint(path=tmp_path / "b" / "c.pt", module=model5, optimizer=opt5)
    assert len(engine5.ledger) == 23
