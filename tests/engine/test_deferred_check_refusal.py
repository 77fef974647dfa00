"""PrivacyEngine's deferred first-batch check (``HookCapture.finish_check``): every refusal releases NOTHING.

The check's pass at the batch's size runs inside ``optimizer.step()`` after the clipped sums were accumulated
(issue 34: memory) and before the release. Whatever stops it — a disagreement with single-example autograd, a
parameter the check moved to an enclosing call, an exception raised by the model in the check's pass — the step
must leave no trace: the parameters, the wrapped optimizer's state (Adam's step counter), the Privatizer's step
count, the ledger and the accountant's history as they were. And the loop cannot get past the check by stepping
again, by zero_grad() in between, or through a second optimizer over the same model.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import dpopt
from dpopt.engine.hooks import CHECK_NOTE

B = 8


class _MixesInLargeBatches(nn.Module):
    """Centres its hidden layer over the batch, only for batches of more than 4 rows (the check's small passes
    have at most 4: only the deferred pass at the batch's size can see it)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.fc1(x)
        if h.shape[0] > 4:
            h = h - h.mean(0)
        return self.fc2(torch.tanh(h))


class _FailsInLargePasses(nn.Module):
    """Per example; raises in any pass of more than ``above`` rows while ``explode`` is set (a model error the
    user's own pass, run before it was set, does not meet). The check's passes: the model's dimensions on the
    batch's first 8 examples, then 2 and 4 rows (in collect), then 9 rows (deferred to finish_check)."""

    def __init__(self, above: int = B):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 5), nn.Linear(5, 3)
        self.explode, self.above = False, above

    def forward(self, x):
        if self.explode and x.shape[0] > self.above:
            raise RuntimeError("boom: the model failed in a large pass")
        return self.fc2(torch.tanh(self.fc1(x)))


def private_one_batch(model: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer=torch.optim.Adam):
    """``PrivacyEngine().make_private`` of ``model`` with ``optimizer(params, lr=0.1)``, σ = 1, C = 1, over a loader
    of the one batch ``(x, y)`` (``x``: [n, ...], ``y``: [n]; batch_size n, no Poisson sampling), its warnings
    silenced. Returns ``(engine, model, opt)``: the wrapped model and optimizer."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
    engine = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, _ = engine.make_private(
            module=model,
            optimizer=optimizer(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )
    return engine, model, opt


def _private(model: nn.Module):
    torch.manual_seed(0)
    x, y = torch.randn(B, 6), torch.randint(0, 3, (B,))
    return (*private_one_batch(model, x, y), x, y)


def _backward(model, x, y) -> None:
    nn.functional.cross_entropy(model(x), y).backward()


def _trace(engine, model, opt) -> dict:
    """Everything a release changes: parameters, Adam's state (its step counter), the Privatizer's counts, the
    ledger and the accountant's history."""
    priv = opt.privatizer
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "adam": copy.deepcopy(opt.original_optimizer.state_dict()["state"]),
        "priv": (priv.steps, priv.releases, priv.reads),
        "ledger": len(engine.ledger),
        "history": list(engine.accountant.history),
    }


def _assert_nothing_released(engine, model, opt, before: dict) -> None:
    after = _trace(engine, model, opt)
    assert all(torch.equal(a, b) for a, b in zip(after["params"], before["params"])), "a parameter changed"
    assert after["adam"] == before["adam"], "the wrapped optimizer stepped"
    assert after["priv"] == before["priv"], "the Privatizer counted a step, read or release"
    assert after["ledger"] == before["ledger"] and after["history"] == before["history"], "a release was recorded"
    assert opt.privatizer._sum is None and not opt._open  # no clipped sum left for a later release


def test_a_mismatch_found_late_releases_nothing_and_cannot_be_stepped_past():
    engine, model, opt, x, y = _private(_MixesInLargeBatches())
    before = _trace(engine, model, opt)
    assert before["adam"] == {} and before["ledger"] == 0
    opt.zero_grad()
    _backward(model, x, y)
    with pytest.raises(ValueError, match="do not match single-example autograd") as err:
        opt.step()
    # the message says what to change
    assert "use dpopt's own loop (dpopt.iter_per_sample_sources)" in str(err.value)
    _assert_nothing_released(engine, model, opt, before)
    # stepping again at once: the backward's records went with the refused step; the refusal itself holds
    with pytest.raises(ValueError, match="do not match single-example autograd.*repeats a refused step"):
        opt.step()
    _assert_nothing_released(engine, model, opt, before)
    # zero_grad() between backward and step: nothing to step on
    _backward(model, x, y)
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="without a backward pass"):
        opt.step()
    _assert_nothing_released(engine, model, opt, before)
    # a fresh forward and backward: the signature was never vouched for, the check runs (and refuses) again
    for _ in range(2):
        opt.zero_grad()
        _backward(model, x, y)
        with pytest.raises(ValueError, match="do not match single-example autograd"):
            opt.step()
        _assert_nothing_released(engine, model, opt, before)


def test_a_second_optimizer_does_not_skip_the_check():
    """A second make_private over the refused model is refused; a copy of (model, optimizer) made after the
    refusal has not been vouched for either: its step refuses too."""
    engine, model, opt, x, y = _private(_MixesInLargeBatches())
    opt.zero_grad()
    _backward(model, x, y)
    with pytest.raises(ValueError, match="do not match single-example autograd"):
        opt.step()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=B)
    with pytest.raises(ValueError, match="still carries the hooks"):
        dpopt.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )
    model2, opt2 = copy.deepcopy((model, opt))
    before = _trace(engine, model, opt)
    before2 = _trace(opt2._engine, model2, opt2)
    opt2.zero_grad()
    _backward(model2, x, y)
    with pytest.raises(ValueError, match="do not match single-example autograd"):
        opt2.step()
    _assert_nothing_released(opt2._engine, model2, opt2, before2)
    _assert_nothing_released(engine, model, opt, before)


@pytest.mark.parametrize("above", [4, B])  # in collect's passes; in the deferred pass only
def test_an_exception_in_the_checks_pass_releases_nothing_and_the_check_runs_again(above):
    """The model raises in the deferred pass only: the step re-raises it, nothing is released, the signature is
    not marked checked (the next step checks again: with the model still failing, it refuses again); once the
    model runs, the check passes and the step releases (one ledger entry, Adam's counter at 1)."""
    engine, model, opt, x, y = _private(_FailsInLargePasses(above))
    before = _trace(engine, model, opt)
    for _ in range(2):
        opt.zero_grad()
        _backward(model, x, y)  # the user's pass of B = 8 rows runs before the model starts failing
        model.explode = True
        with pytest.raises(RuntimeError, match="boom") as err:
            opt.step()
        model.explode = False
        if hasattr(err.value, "add_note"):  # Python 3.11+: the model's error says where it was raised
            assert err.value.__notes__ == [CHECK_NOTE]
        _assert_nothing_released(engine, model, opt, before)
        assert opt._capture._deferred == [] and not opt._capture.verified
    opt.zero_grad()
    _backward(model, x, y)
    opt.step()
    after = _trace(engine, model, opt)
    assert after["ledger"] == 1 and len(after["history"]) == 1 and after["priv"][:2] == (1, 1)
    assert [int(s["step"]) for s in after["adam"].values()] == [1] * 4
    assert not all(torch.equal(a, b) for a, b in zip(after["params"], before["params"]))
    assert opt._capture.verified


def test_a_refused_chunk_of_a_logical_batch_drops_the_whole_open_step():
    """BatchMemoryManager's protocol: a skipped (chunk) step runs the deferred check too; when it refuses, the
    open logical step is dropped (no clipped sum survives to a later release)."""
    engine, model, opt, x, y = _private(_MixesInLargeBatches())
    before = _trace(engine, model, opt)
    opt.zero_grad()
    _backward(model, x, y)
    opt.signal_skip_step(True)
    with pytest.raises(ValueError, match="do not match single-example autograd"):
        opt.step()
    _assert_nothing_released(engine, model, opt, before)
    assert opt._step_skip_queue == []  # the chunk's signal went with it


class _ReshapesLargeBatches(nn.Module):
    """Per example at every size, but from 8 rows on its ``fc2`` runs on ``[2·B, 3]`` (the rows' halves) instead
    of twice on ``[B, 3]``: a layer call that does not keep the examples along dim 0, met only by the check's
    deferred pass (at 9 rows: the user's batch of 7 is a dimension of the model)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 6), nn.Linear(3, 4), nn.Linear(8, 7)

    def forward(self, x):
        h, n = torch.tanh(self.fc1(x)), x.shape[0]
        if n >= 8:
            g = self.fc2(h.reshape(2 * n, 3)).reshape(n, 8)
        else:
            g = torch.cat([self.fc2(h[:, :3]), self.fc2(h[:, 3:])], 1)
        return self.fc3(torch.tanh(g))


def test_an_unsupported_layer_call_found_late_releases_nothing():
    model = _ReshapesLargeBatches()
    torch.manual_seed(0)
    x, y = torch.randn(7, 6), torch.randint(0, 7, (7,))
    engine, model, opt = private_one_batch(model, x, y)
    before = _trace(engine, model, opt)
    for _ in range(3):  # and the loop cannot step past it
        opt.zero_grad()
        _backward(model, x, y)
        with pytest.raises(ValueError, match="layer 'fc2' .* does not keep the examples along dim 0") as err:
            opt.step()
        assert "train with dpopt's own loop" in str(err.value)  # what to change
        _assert_nothing_released(engine, model, opt, before)


@pytest.mark.parametrize("where", ["accumulate", "collect"])
def test_a_step_that_fails_before_the_check_finishes_keeps_no_rows_of_the_batch(where):
    """Ctrl-C while the clipped sums are accumulated (or an error in collect after the check deferred its pass):
    nothing is released, the deferred pass's inputs — rows of the private batch — are dropped with the step (a
    copy of (model, optimizer) made then holds none), and the next batch is checked before it is released."""
    engine, model, opt, x, y = _private(_FailsInLargePasses())
    before = _trace(engine, model, opt)
    cap, priv = opt._capture, opt.privatizer
    target, name = (priv, "accumulate") if where == "accumulate" else (cap, "_build")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    setattr(target, name, interrupted)
    opt.zero_grad()
    _backward(model, x, y)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    delattr(target, name)
    _assert_nothing_released(engine, model, opt, before)
    assert cap._deferred == [] and cap._deferred_key is None and not cap.verified
    _, opt2 = copy.deepcopy((model, opt))
    assert opt2._capture._deferred == []
    runs = []
    verify_at = cap._verify_at
    cap._verify_at = lambda inputs, n, compare=None: runs.append(n) or verify_at(inputs, n, compare=compare)
    opt.zero_grad()
    _backward(model, x, y)
    opt.step()
    assert runs and max(runs) >= B and cap.verified  # checked again, at the batch's size, then released
    assert len(engine.ledger) == 1


class _MixesAbove8(_MixesInLargeBatches):
    """Centres its hidden layer over the batch only in passes of more than 8 rows (the batch's size, 16)."""

    def forward(self, x):
        h = self.fc1(x)
        if h.shape[0] > 8:
            h = h - h.mean(0)
        return self.fc2(torch.tanh(h))


def test_the_pass_at_the_batch_size_still_refuses_mixing_with_its_uncompared_rows_cut(monkeypatch):
    """B = 16: the deferred pass runs at 16 rows (the model mixes only there), compares its first 8 examples,
    and drops the other 8 rows' records before the single-example loop (issue 34: memory,
    ``capture._cut_rows``). The compared rows' values came from the mixing pass: still refused, nothing
    released."""
    from dpopt.engine import capture as capture_module

    cuts: list = []
    real = capture_module._cut_rows
    monkeypatch.setattr(
        capture_module, "_cut_rows", lambda calls, rows, keep: cuts.append((rows, keep)) or real(calls, rows, keep)
    )
    torch.manual_seed(0)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    engine, model, opt = private_one_batch(_MixesAbove8(), x, y)
    before = _trace(engine, model, opt)
    opt.zero_grad()
    _backward(model, x, y)
    with pytest.raises(ValueError, match="do not match single-example autograd"):
        opt.step()
    _assert_nothing_released(engine, model, opt, before)
    assert cuts and all(keep == 8 < rows for rows, keep in cuts), cuts  # the cut ran, on the pass at 16+ rows


def test_a_per_example_model_passes_the_check_with_its_uncompared_rows_cut(monkeypatch):
    """The same shapes without mixing (B = 16, rows after the 8th cut): the check passes and the step releases."""
    from dpopt.engine import capture as capture_module

    cuts: list = []
    real = capture_module._cut_rows
    monkeypatch.setattr(
        capture_module, "_cut_rows", lambda calls, rows, keep: cuts.append((rows, keep)) or real(calls, rows, keep)
    )
    torch.manual_seed(0)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    engine, model, opt = private_one_batch(_FailsInLargePasses(), x, y)
    opt.zero_grad()
    _backward(model, x, y)
    opt.step()
    assert cuts and opt.privatizer.releases == 1, (cuts, opt.privatizer.releases)
