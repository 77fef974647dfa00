"""Correlated noise (DP matrix factorization, issue 36): strategies, sensitivity, the streamed noise,
accounting, the ledger record, secret state and the make_private door.

Statistical tests state their false-alarm rates; sensitivity is compared with an enumeration of every
participation pattern; ε with an independent float64 computation of the Gaussian mechanism's ε.
"""

import copy
import io
import math
import os
import pickle

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt.privatizer as privatizer_module
from dpopt import PrivacyEngine
from dpopt.accounting.accountant import epsilon
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.ledger_check import check_ledger
from dpopt.correlated_noise import (
    CorrelatedNoise,
    Participation,
    amplified_banded_event,
    brute_force_sensitivity,
    monotone_envelope,
    optimize_strategy,
    parse_mechanism,
    prefix_sensitivities,
    sensitivity,
)
from dpopt.cyclic_batches import CyclicBatchSampler
from dpopt.engine.reference import PerSampleGrads
from dpopt.errors import ConfigError
from dpopt.privatizer import Privatizer


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """ε(δ) of the Gaussian mechanism with sensitivity/σ = μ (Balle & Wang 2018, Thm 8), float64 brentq."""

    def gap(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return brentq(gap, 0.0, 200.0, xtol=1e-12)


STRATEGIES = {
    "banded3": lambda T: optimize_strategy("banded", T, 3),
    "blt2": lambda T: optimize_strategy("blt", T, 2),
}


# -- strategies and sensitivity -----------------------------------------------------------------------


@pytest.mark.parametrize("name", STRATEGIES)
def test_optimised_strategies_beat_independent_noise(name):
    T = 64
    s = STRATEGIES[name](T)
    d, c = s.inverse_coefficients(T), s.column(T)
    C, D = s.matrix(T), np.tril(np.ones((T, T)))
    assert np.allclose(np.linalg.inv(C)[:, 0], d, atol=1e-10)  # d are the coefficients of C⁻¹
    B = D @ np.linalg.inv(C)
    mean_err = np.sum(B**2) / T * np.sum(c**2)  # single participation: Δ² = ‖c‖²
    assert mean_err < 0.5 * (T + 1) / 2  # independent noise: mean over t of t+1 = (T+1)/2


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("k,sep", [(1, 1), (2, 5), (3, 4), (2, 3), (4, 2), (5, 2)])
def test_sensitivity_against_every_participation_pattern(name, k, sep):
    T = 11
    s = STRATEGIES[name](T)
    p = Participation(T, k, sep)
    exact = brute_force_sensitivity(s, p)
    got = sensitivity(s, p)
    assert got >= exact * (1 - 1e-12)  # never below the truth
    if k == 1 or (s.kind == "banded" and s.bands <= sep) or monotone_envelope(s.column(T)) is not None:
        assert got == pytest.approx(exact, rel=1e-12)  # closed forms and the monotone Toeplitz form are exact
    else:
        assert got <= 1.05 * exact  # the DP bound is close
    assert np.all(s.matrix(T).T @ s.matrix(T) >= -1e-12)  # X ≥ 0: Σ|X_ij| is the vector sensitivity


def _best_pattern(X, k, sep):
    """max over every pattern (≤ k positions, ≥ sep apart) of Σ_{i,j∈π} X_ij, by enumeration."""
    T, best = X.shape[0], 0.0

    def walk(start, chosen):
        nonlocal best
        if chosen:
            idx = np.array(chosen)
            best = max(best, float(X[np.ix_(idx, idx)].sum()))
        if len(chosen) < k:
            for j in range(start, T):
                walk(j + sep, chosen + [j])

    walk(0, [])
    return best


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("k,sep", [(1, 1), (2, 5), (3, 3)])
def test_prefix_sensitivity_is_that_of_the_first_rows(name, k, sep):
    T = 10
    s = STRATEGIES[name](T)
    p = Participation(T, k, sep)
    prefix = prefix_sensitivities(s, p)
    C = s.matrix(T)
    X_full = np.abs(C.T @ C)
    for t in range(T):
        best = _best_pattern(np.abs(C[: t + 1].T @ C[: t + 1]), k, sep)  # brute force on the first t+1 rows
        assert prefix[t] >= math.sqrt(best) * (1 - 1e-12)
        if k == 1 or (s.kind == "banded" and s.bands <= sep) or monotone_envelope(s.column(T)) is not None:
            assert prefix[t] == pytest.approx(math.sqrt(best), rel=1e-12)
    assert np.all(np.diff(prefix) >= -1e-15)
    assert prefix[-1] ** 2 <= X_full.sum() + 1e-9


def test_banded_one_band_is_independent_noise():
    s = optimize_strategy("banded", 20, 1)
    assert s.coefficients == (1.0,)
    assert sensitivity(s, Participation(20, 4, 5)) == pytest.approx(2.0)  # √k


def test_bad_specs_are_refused():
    for bad in ("banded", "banded:0", "blt:x", "gaussian", "banded:2:3"):
        with pytest.raises(ValueError, match="noise_mechanism"):
            parse_mechanism(bad)
    assert parse_mechanism("BANDED:4") == ("banded", 4)
    assert parse_mechanism("blt") == ("blt", 4)
    with pytest.raises(ValueError, match="do not fit"):
        Participation(10, 3, 5)


# -- the stream ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("large", [False, True], ids=["small-model", "large-model"])
@pytest.mark.parametrize("name", STRATEGIES)
def test_noise_covariance_across_steps_is_the_strategys(name, large, monkeypatch):
    """Released noise through the Privatizer: Cov(w_s, w_t) = (σS/B̄)² (C⁻¹C⁻ᵀ)_{st}, per coordinate.

    ``large``: the model counts as one above ``EARLY_DRAW_MAX`` (lowered to 1,000 here), whose
    independent noise is streamed chunk by chunk; correlated noise must still go through the
    mechanism there (it did not when the two paths were first merged: independent noise, accounted
    as correlated).

    d = 40,000 coordinates give each covariance entry a standard error
    se = √((Σ_ss Σ_tt + Σ_st²)/d); each of the 21 entries is compared at 5 se (two-sided false alarm
    ≤ 21 × 5.7e-7 ≈ 1.2e-5 for a fresh seed, Bonferroni). The noise is seeded (``generator=``), so the
    test is deterministic: with the secret default its four cases failed an honest stream in ≈ 4.8e-5 of
    CI runs."""
    if large:
        monkeypatch.setattr(privatizer_module, "EARLY_DRAW_MAX", 1_000)
    T, d, sigma, S, bbar = 6, 40_000, 1.3, 0.7, 2.0
    mech = CorrelatedNoise(STRATEGIES[name](T), Participation(T), sigma)
    priv = Privatizer(sigma, S, bbar, 1.0, mechanism=mech, generator=torch.Generator().manual_seed(17))
    zeros = [torch.zeros(1, d, dtype=torch.float64)]
    rel = [priv.privatize(PerSampleGrads(zeros)) for _ in range(T)]
    W = torch.stack([r.grads[0] for r in rel]).numpy()  # [T, d]
    Dinv = np.linalg.inv(mech.strategy.matrix(T))
    want = (sigma * S / bbar) ** 2 * (Dinv @ Dinv.T)
    got = W @ W.T / d
    se = np.sqrt((np.outer(np.diag(want), np.diag(want)) + want**2) / d)
    assert np.all(np.abs(got - want) <= 5 * se), np.max(np.abs(got - want) / se)
    for t, r in enumerate(rel):  # the marginal std every variance-correcting transform reads
        assert float(r.noise_std[0]) == pytest.approx(math.sqrt(want[t, t]), rel=1e-6)


def test_sensitivity_through_the_mechanism_path():
    """Same seeded noise, neighbouring batches (one example removed): the releases differ by the clipped
    example / B̄ exactly (the noise, correlated or not, cancels): ‖Δ release‖·B̄ ≤ C."""
    T, C = 5, 1.0
    outs = []
    for drop in (False, True):
        gen = torch.Generator().manual_seed(7)
        mech = CorrelatedNoise(optimize_strategy("blt", T, 2), Participation(T), 2.0)
        priv = Privatizer(2.0, C, 4.0, 1.0, mechanism=mech, generator=gen)
        rels = []
        for t in range(T):
            g = torch.arange(12, dtype=torch.float64).view(3, 4) + t
            rels.append(priv.privatize(PerSampleGrads([g[:2] if drop else g])).grads[0])
        outs.append(torch.stack(rels))
    diff = (outs[0] - outs[1]) * 4.0
    norms = diff.norm(dim=1)
    assert torch.all(norms <= C + 1e-9)
    assert norms.max() == pytest.approx(C, rel=1e-9)  # the removed example's gradient is clipped to C


def test_past_the_horizon_is_refused():
    mech = CorrelatedNoise(optimize_strategy("banded", 3, 2), Participation(3), 1.0)
    priv = Privatizer(1.0, 1.0, 1.0, 1.0, mechanism=mech)
    for _ in range(3):
        priv.privatize(PerSampleGrads([torch.ones(1, 3)]))
    with pytest.raises(RuntimeError, match=r"step 4 \(1-based\) is past the 3-step correlated-noise horizon"):
        priv.privatize(PerSampleGrads([torch.ones(1, 3)]))


def test_sigma_zero_and_quantile_clipping_are_refused():
    with pytest.raises(ValueError, match="noise_multiplier > 0"):
        CorrelatedNoise(optimize_strategy("banded", 3, 2), Participation(3), 0.0)
    from dpopt.privatizer import QuantileClipping

    mech = CorrelatedNoise(optimize_strategy("banded", 3, 2), Participation(3), 1.0)
    with pytest.raises(ConfigError, match="quantile"):
        Privatizer(1.0, 1.0, 1.0, 1.0, mechanism=mech, quantile=QuantileClipping(2.0))


# -- secret state: copies, forks, resume ----------------------------------------------------------------


def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", [pickle.dumps, copy.deepcopy, copy.copy, _round_trip])
def test_copies_carry_no_stream_state_and_refuse_to_continue(how):
    mech = CorrelatedNoise(optimize_strategy("blt", 6, 2), Participation(6), 1.0)
    priv = Privatizer(1.0, 1.0, 1.0, 1.0, mechanism=mech)
    priv.privatize(PerSampleGrads([torch.zeros(1, 5)]))
    clone = pickle.loads(how(priv)) if how is pickle.dumps else how(priv)
    if how is copy.copy:  # a shallow copy shares the mechanism object: no second stream exists
        assert clone.mechanism is priv.mechanism
        return
    assert clone.mechanism._state == {}
    assert all("buf" not in k for k in clone.mechanism.__dict__)
    with pytest.raises(RuntimeError, match="never copied"):
        clone.privatize(PerSampleGrads([torch.zeros(1, 5)]))
    priv.privatize(PerSampleGrads([torch.zeros(1, 5)]))  # the original goes on


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_cannot_continue_the_stream():
    mech = CorrelatedNoise(optimize_strategy("banded", 6, 3), Participation(6), 1.0)
    mech.correlate(torch.zeros(4, dtype=torch.float64), 0)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            try:
                mech.correlate(torch.zeros(4, dtype=torch.float64), 1)
                os.write(write, b"continued")
            except RuntimeError:
                os.write(write, b"refused")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 32)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"refused"
    mech.correlate(torch.zeros(4, dtype=torch.float64), 1)  # the parent's stream goes on


@pytest.mark.parametrize("kind,size", [("banded", 3), ("blt", 2)])
def test_no_written_form_holds_the_stream_state(kind, size):
    """The stream's state (banded: the last b − 1 noise vectors; blt: its buffers) is as secret as the noise:
    after 3 releases no float64 word of it is in a pickle or torch.save of the mechanism, of the Privatizer or
    of its state_dict; copy.copy and deepcopy of the mechanism itself hold none of it either (and refuse)."""
    mech = CorrelatedNoise(optimize_strategy(kind, 6, size), Participation(6), 1.0)
    priv = Privatizer(1.0, 1.0, 1.0, 1.0, mechanism=mech)
    for _ in range(3):
        priv.privatize(PerSampleGrads([torch.zeros(1, 50)]))
    ((key, (t, buf)),) = mech._state.items()
    assert (
        key == "cpu"
        and t == 3
        and len(buf) == (size - 1 if kind == "banded" else size)
        and all(float(b.abs().min()) > 0 for b in buf)
    )
    pieces = [b[i : i + 1].numpy().tobytes() for b in buf for i in range(50)]
    blobs = [pickle.dumps(mech), pickle.dumps(priv), _saved(priv), _saved(priv.state_dict())]
    for piece in pieces:
        assert all(piece not in blob for blob in blobs)
    for how in (copy.copy, copy.deepcopy):
        clone = how(mech)
        assert clone._state == {}
        with pytest.raises(RuntimeError, match="never copied"):
            clone.correlate(torch.zeros(50, dtype=torch.float64), 3)
    assert mech.correlate(torch.zeros(50, dtype=torch.float64), 3).shape == (50,)  # the original goes on


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_resume_is_refused_but_a_fresh_state_loads():
    def make():
        mech = CorrelatedNoise(optimize_strategy("banded", 6, 3), Participation(6), 1.0)
        return Privatizer(1.0, 1.0, 1.0, 1.0, mechanism=mech)

    priv = make()
    fresh = priv.state_dict()
    priv.privatize(PerSampleGrads([torch.zeros(1, 5)]))
    state = priv.state_dict()
    assert "noise_state" not in state and "mechanism" not in str(state.keys())
    with pytest.raises(ValueError, match="resuming a correlated-noise"):
        make().load_state_dict(state)
    make().load_state_dict(fresh)  # step 0: nothing to resume


# -- accounting and the ledger ----------------------------------------------------------------------------


def _run_privatizer(strategy, participation, sigma, steps):
    mech = CorrelatedNoise(strategy, participation, sigma)
    priv = Privatizer(sigma, 1.0, 1.0, 1.0, mechanism=mech)
    for _ in range(steps):
        priv.privatize(PerSampleGrads([torch.zeros(1, 3)]))
    return priv


@pytest.mark.parametrize(
    "name,k,sep", [("banded3", 1, 1), ("blt2", 1, 1), ("banded3", 3, 4), ("blt2", 2, 5), ("banded3", 2, 2)]
)
def test_epsilon_equals_an_independent_gaussian_computation(name, k, sep):
    T, sigma, delta = 12, 1.5, 1e-5
    s = STRATEGIES[name](T)
    p = Participation(T, k, sep)
    priv = _run_privatizer(s, p, sigma, T)
    exact_delta = brute_force_sensitivity(s, p)
    want = _gaussian_epsilon(sensitivity(s, p) / sigma, delta)
    got = epsilon(priv.ledger, delta, "pld")
    assert got >= want * (1 - 1e-9)  # PLD connect-the-dots is an upper bound
    assert got == pytest.approx(want, rel=2e-3)
    if k == 1 or (s.kind == "banded" and s.bands <= sep) or monotone_envelope(s.column(T)) is not None:
        # exact sensitivity: ε is that of the truth
        assert got == pytest.approx(_gaussian_epsilon(exact_delta / sigma, delta), rel=2e-3)
    assert epsilon(priv.ledger, delta, "rdp") >= want * (1 - 1e-9)


def test_a_prefix_of_the_run_is_charged_its_own_sensitivity():
    T, sigma, delta = 12, 1.0, 1e-5
    s = optimize_strategy("banded", T, 3)
    p = Participation(T, 2, 6)
    priv = _run_privatizer(s, p, sigma, 7)  # 7 releases: the second participation has begun
    prefix = prefix_sensitivities(s, p)
    want = _gaussian_epsilon(prefix[6] / sigma, delta)
    assert epsilon(priv.ledger, delta, "pld") == pytest.approx(want, rel=2e-3)


def test_amplified_banded_event_is_dpsgd_over_rounds():
    s = optimize_strategy("banded", 20, 4)
    ev = amplified_banded_event(1.0, s, Participation(20, 4, 5), 0.1)
    col = float(np.linalg.norm(s.column(20)))
    assert ev.count == 4 and ev.event.sampling_probability == 0.1
    assert ev.event.event.noise_multiplier == pytest.approx(1.0 / col)
    with pytest.raises(ValueError, match="bands <= min_separation"):
        amplified_banded_event(1.0, s, Participation(20, 4, 3), 0.1)
    with pytest.raises(ValueError, match="banded"):
        amplified_banded_event(1.0, optimize_strategy("blt", 20, 2), Participation(20, 4, 5), 0.1)


def _claims(ledger, eps, steps):
    return {"epsilon": eps, "delta": 1e-5, "accountant": "pld", "noise_multiplier": 1.5, "steps": steps}


def test_dpopt_check_rescores_the_ledger_from_the_file_alone(tmp_path):
    T = 12
    priv = _run_privatizer(optimize_strategy("blt", T, 2), Participation(T, 2, 6), 1.5, T)
    path = priv.ledger.save(tmp_path / "ledger.json")
    loaded = PrivacyLedger.load(path)
    assert loaded.mechanism == priv.ledger.mechanism
    eps = epsilon(loaded, 1e-5)
    result = check_ledger(loaded, _claims(loaded, eps, T))
    assert result.passed, result.failures
    # tampering with the strategy, the sensitivity or σ in the file is caught
    for key, value in (("sensitivity", 1.0), ("noise_multiplier", 3.0), ("min_separation", 11)):
        bad = PrivacyLedger.load(path)
        bad.mechanism = {**bad.mechanism, key: value}
        assert not check_ledger(bad, _claims(bad, eps, T)).passed, key
    bad = PrivacyLedger.load(path)
    bad.mechanism = {**bad.mechanism, "strategy": {**bad.mechanism["strategy"], "omega": [-0.01, -0.01]}}
    assert not check_ledger(bad, _claims(bad, eps, T)).passed
    assert not check_ledger(loaded, _claims(loaded, 0.9 * eps, T)).passed  # under-reported ε


# -- the doors ------------------------------------------------------------------------------------------


def test_cyclic_batches_keep_their_order_across_epochs_and_partial_iterations():
    sampler = CyclicBatchSampler(10, 4)
    first = list(sampler)
    assert sorted(i for b in first for i in b) == list(range(10))
    assert list(sampler) == first  # the next epoch: the same batches, in the same order
    it = iter(sampler)
    partial = [next(it), next(it)]  # a loop that breaks early ...
    assert partial == first[:2]
    assert list(sampler)[:2] == first[2:]  # ... continues with the next batch


def _data(n=48):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 2, (n,), generator=g))


def sgd_args(**kwargs) -> dict:
    """make_private's arguments for a fresh Linear(5, 2) under SGD (lr 0.1) on :func:`_data` in batches of 12,
    σ = 1, C = 1, banded:2 noise; ``kwargs`` are added to them or replace them."""
    model = nn.Linear(5, 2)
    args = dict(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=12),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        noise_mechanism="banded:2",
    )
    args.update(kwargs)
    return args


@pytest.mark.parametrize("optimizer", ["dp-sgd", "dp-adambc", "dp-macadam"])
@pytest.mark.parametrize("mechanism", ["banded:2", "blt:2"])
def test_make_private_trains_accounts_and_checks(mechanism, optimizer):
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=DataLoader(_data(), batch_size=12),
        noise_multiplier=1.5,
        max_grad_norm=1.0,
        noise_mechanism=mechanism,
        epochs=2,
        lr=0.05,
    )
    seen = []
    for _ in range(2):
        for x, y in loader:
            seen.append(sorted(map(tuple, x.tolist())))
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    # balls-in-bins: 4 batches of random size, every example in exactly one, the same batches each epoch
    assert len(seen) == 8 and seen[4:] == seen[:4]
    assert sorted(r for b in seen[:4] for r in b) == sorted(map(tuple, _data().tensors[0].tolist()))
    assert torch.isfinite(model.weight).all()
    rec = engine.ledger.mechanism
    assert rec["participations"] == 2 and rec["min_separation"] == 4 and rec["steps"] == 8
    eps = engine.get_epsilon(1e-5)
    assert eps == pytest.approx(_gaussian_epsilon(rec["sensitivity"] / 1.5, 1e-5), rel=2e-3)
    result = check_ledger(engine.ledger, _claims(engine.ledger, eps, 8))
    assert result.passed, result.failures


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({}, "exactly one of epochs"),
        ({"epochs": 1, "poisson_sampling": False}, "poisson_sampling"),
        ({"epochs": 1, "clipping": "adaptive"}, "adaptive"),
        ({"epochs": 1, "noise_multiplier": 0.0}, "needs noise_multiplier > 0"),
    ],
)
def test_make_private_refuses_combinations_without_an_accountant(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PrivacyEngine().make_private(**sgd_args(**kwargs))


def test_make_private_refuses_a_horizon_with_independent_noise():
    model = nn.Linear(5, 2)
    with pytest.raises(ConfigError, match="horizon"):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), batch_size=12),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            epochs=2,
        )


# -- audit ----------------------------------------------------------------------------------------------


def test_one_run_audit_of_a_blt_run_stays_below_its_claim():
    """Steinke, Nasr, Jagielski (2023) one-run audit of a BLT run through the Privatizer: m canaries,
    each its own coordinate and step, included with probability ½ (a seeded coin: the canaries are the
    auditor's); the white-box score whitens the releases with C (the optimal test for a Gaussian shift
    along C's column). The lower bound at confidence 1 − β (β = 0.05) must not exceed the claimed ε."""
    from dpopt.auditing.one_run_stats import steinke_epsilon

    T, m, sigma, delta = 20, 2000, 0.6, 1e-5
    strategy = optimize_strategy("blt", T, 2)
    mech = CorrelatedNoise(strategy, Participation(T), sigma)
    priv = Privatizer(sigma, 1.0, 1.0, 1.0, mechanism=mech)
    coin = torch.Generator().manual_seed(3)
    included = torch.rand(m, generator=coin) < 0.5
    step_of = torch.arange(m) % T
    releases = []
    for t in range(T):
        rows = [i for i in range(m) if step_of[i] == t and included[i]]
        g = torch.zeros(max(1, len(rows)), m, dtype=torch.float64)
        for r, i in enumerate(rows):
            g[r, i] = 1.0
        if not rows:
            g = g[:0]
        releases.append(priv.privatize(PerSampleGrads([g]), params_like=[torch.zeros(m)]).grads[0])
    X = torch.stack(releases).numpy()  # [T, m]
    C = strategy.matrix(T)
    white = C @ X  # C x̃ = C x + σ z
    scores = np.array([C[:, step_of[i]] @ white[:, i] / np.linalg.norm(C[:, step_of[i]]) for i in range(m)])
    k = 300
    order = np.argsort(scores)
    guess_in, guess_out = order[-k:], order[:k]
    correct = int(included.numpy()[guess_in].sum() + (~included.numpy()[guess_out]).sum())
    lower = steinke_epsilon(m, 2 * k, correct, delta, 0.05)
    mu = sensitivity(strategy, Participation(T)) / sigma
    claimed = _gaussian_epsilon(mu, delta)  # = the ledger's ε (test_epsilon_equals_an_independent_...)
    assert [type(e.event).__name__ for e in priv.ledger.entries][0] == "GaussianDpEvent"
    assert 0.0 < lower <= claimed


def test_dpopt_train_door_checks_and_refuses_resume(tmp_path):
    """`dpopt train --noise-mechanism blt` (dpopt's own loop, cyclic batches) → `dpopt check` passes;
    --resume is refused with one line and exit 2; a bad spec is refused the same way."""
    from typer.testing import CliRunner

    from dpopt.accounting.ledger_check import check_run
    from dpopt.cli import app

    runner = CliRunner()
    run_dir = tmp_path / "run"
    args = ["train", "--dataset", "digits", "--epochs", "2", "--batch-size", "256", "--noise-multiplier", "2"]
    result = runner.invoke(app, args + ["--noise-mechanism", "blt:2", "--out", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert check_run(run_dir).passed
    ledger = PrivacyLedger.load(run_dir / "ledger.json")
    rec = ledger.mechanism
    assert rec["kind"] == "blt" and rec["participations"] == 2 == -(-rec["steps"] // rec["min_separation"])
    assert "cyclic" in ledger.sampling
    resumed = runner.invoke(app, ["train", "--resume", str(run_dir)])
    assert resumed.exit_code == 2 and "refused" in resumed.output
    bad = runner.invoke(app, args + ["--noise-mechanism", "banded:0", "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "--noise-mechanism banded:0" in bad.output and "Traceback" not in bad.output


def test_calibrated_sigma_meets_the_target_from_below():
    from dpopt.correlated_noise import calibrate_noise_multiplier, gaussian_epsilon

    T = 30
    s, p = optimize_strategy("banded", T, 4), Participation(T, 3, 10)
    sigma = calibrate_noise_multiplier(2.0, 1e-5, s, p)
    priv = _run_privatizer(s, p, sigma, T)
    got = epsilon(priv.ledger, 1e-5)
    assert got <= 2.0 and got == pytest.approx(2.0, rel=5e-3)
    assert gaussian_epsilon(sensitivity(s, p) / sigma, 1e-5) == pytest.approx(
        _gaussian_epsilon(sensitivity(s, p) / sigma, 1e-5), rel=1e-9
    )


def test_a_mechanism_needs_a_fresh_ledger_and_no_budget_stop():
    from dpopt.training.config import TrainConfig, validate_config

    priv = _run_privatizer(optimize_strategy("banded", 4, 2), Participation(4), 1.0, 2)
    mech = CorrelatedNoise(optimize_strategy("banded", 4, 2), Participation(4), 1.0)
    with pytest.raises(ConfigError, match="fresh ledger"):
        Privatizer(1.0, 1.0, 1.0, 1.0, ledger=priv.ledger, mechanism=mech)
    with pytest.raises(ConfigError, match="max_epsilon"):
        validate_config(TrainConfig(noise_mechanism="blt", max_epsilon=3.0), 1000)
    with pytest.raises(ConfigError, match="quantile"):
        validate_config(TrainConfig(noise_mechanism="banded:2", clipping="quantile"), 1000)


def test_make_private_with_epsilon_calibrates_the_mechanism():
    model = nn.Linear(5, 2)
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_data(), batch_size=12),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=1.0,
        noise_mechanism="banded:2",
    )
    for _ in range(2):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    eps = engine.get_epsilon(1e-5)
    assert eps <= 3.0 and eps == pytest.approx(3.0, rel=5e-3)
    assert engine.ledger.mechanism["steps"] == 8


def test_adding_one_example_leaves_the_other_examples_partition_law_unchanged():
    """The MF accounting (cyclic batches, and cyclic Poisson) analyses ONE example added to a fixed partition of
    the others (the worst part for it). Under add/remove neighbours that needs the partition of the common
    examples to have the same law in D and D' = D + x. The sampler's balanced split (randperm, tensor_split)
    breaks it: D = {y0, y1}, b = 2 batches: y0 and y1 are never together; in D' (3 examples, sizes 2 and 1)
    they are together with probability 1/3. Measured consequence through the real sampler (one epoch, T = b = 2,
    C = I, σ = 1, gradients y = +1, x = −1; exact output mixtures): δ(ε = 3) = 0.048 against the claimed
    Gaussian's 0.0015 (ε = 2: 0.093 vs 0.021) for the balanced split. The sampler's balls-in-bins assignment
    (each example i.i.d. uniform over the parts, arXiv 2410.06266) makes the others' law the same in D and D'."""
    from scipy.stats import norm

    seeds = range(2000)

    def together(n: int) -> float:  # P(examples 0 and 1 share a batch), over the partition's seeds
        return float(np.mean([any({0, 1} <= set(b) for b in CyclicBatchSampler(n, 2, seed=s).batches) for s in seeds]))

    def sums(n: int) -> dict:  # the law of the two batch sums, gradients +1, +1 (and −1 for example 2)
        law: dict = {}
        for s in seeds:
            key = tuple(sum(-1.0 if i == 2 else 1.0 for i in b) for b in CyclicBatchSampler(n, 2, seed=s).batches)
            law[key] = law.get(key, 0.0) + 1.0 / len(seeds)
        return law

    grid = np.linspace(-10, 10, 801)
    y1, y2 = np.meshgrid(grid, grid, indexing="ij")

    def density(law: dict) -> np.ndarray:
        return sum(w * norm.pdf(y1, m[0]) * norm.pdf(y2, m[1]) for m, w in law.items())

    p, q = density(sums(3)), density(sums(2))
    cell = (grid[1] - grid[0]) ** 2
    real = max(np.maximum(p - math.exp(3.0) * q, 0).sum(), np.maximum(q - math.exp(3.0) * p, 0).sum()) * cell
    claimed = norm.cdf(-3.0 + 0.5) - math.exp(3.0) * norm.cdf(-3.0 - 0.5)  # one Gaussian, sensitivity 1, σ = 1
    assert claimed == pytest.approx(0.0015, abs=1e-4)
    assert abs(together(3) - together(2)) < 0.05  # 4.5 standard errors at 2000 seeds
    assert real <= 0.01


@pytest.mark.parametrize("epochs,steps", [(1.5, 6), (0.99, 4), (2, 8), (0.25, 1)])
@pytest.mark.parametrize("mechanism", ["banded:2", "blt"])
def test_both_doors_plan_the_same_horizon_for_fractional_epochs(epochs, steps, mechanism):
    # 4 batches per epoch: T = ⌈epochs × 4⌉ (1.5 → 6, 0.99 → 3.96 → 4) through both doors
    _, opt, _ = PrivacyEngine().make_private(**sgd_args(epochs=epochs, noise_mechanism=mechanism))
    args = sgd_args(noise_mechanism=mechanism)
    del args["noise_multiplier"]
    _, cal, _ = PrivacyEngine().make_private_with_epsilon(**args, target_epsilon=3.0, target_delta=1e-5, epochs=epochs)
    assert opt.privatizer.mechanism.participation.steps == cal.privatizer.mechanism.participation.steps == steps


def test_get_epsilon_reads_at_the_recorded_delta():
    engine = PrivacyEngine()
    model, opt, loader = engine.make_private(**sgd_args(epochs=1, delta=1e-3))
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert engine.get_epsilon() == engine.get_epsilon(1e-3) < engine.get_epsilon(1e-5)
    bare = PrivacyEngine()
    bare.make_private(**sgd_args(epochs=1))
    with pytest.raises(ValueError, match=r"get_epsilon needs delta.*get_epsilon\(delta=\.\.\.\)"):
        bare.get_epsilon()


@pytest.mark.parametrize("mechanism", ["banded:4", "blt"])
def test_make_private_with_epsilon_refuses_a_target_looser_than_the_search(mechanism):
    args = sgd_args(noise_mechanism=mechanism)
    del args["noise_multiplier"]
    with pytest.raises(ConfigError, match=r"target_epsilon = 1000 cannot be reached.*choose a smaller target_epsilon"):
        PrivacyEngine().make_private_with_epsilon(**args, target_epsilon=1000.0, target_delta=1e-5, epochs=2)
