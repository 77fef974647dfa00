"""Amplified banded MF (issue 36): cyclic Poisson sampling (Choquette-Choo et al., arXiv 2306.08153, Thm 4).

ε is compared with an independent float64 computation of the hockey-stick divergence of k Poisson-sampled
Gaussians (direct quadrature, both directions of add/remove); the sampler's inclusion law with a χ² test at a
stated false-alarm rate; BLT and banded with more bands than parts get the spectral bound; what has no
accountant is refused.
"""

import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from scipy.optimize import brentq
from scipy.stats import chi2, norm
from test_correlated_noise import _data, sgd_args
from torch import nn
from torch.utils.data import DataLoader

from dpopt import PrivacyEngine
from dpopt.accounting.accountant import epsilon
from dpopt.accounting.ledger_check import check_ledger
from dpopt.accounting.matrix_factorization import check_record, mixture_of_gaussians_round
from dpopt.correlated_noise import (
    CorrelatedNoise,
    Participation,
    Strategy,
    amplified_banded_event,
    amplified_step_events,
    optimize_strategy,
)
from dpopt.cyclic_batches import CyclicPoissonBatchSampler, CyclicPoissonLoader
from dpopt.errors import ConfigError
from dpopt.noise import NoiseSource


def _sampled_gaussian_delta(s: float, q: float, k: int, eps: float) -> float:
    """δ(ε) of k compositions of the Poisson-sampled Gaussian (sensitivity 1, std s), add/remove, in float64:
    max(H_ε(P^k‖Q^k), H_ε(Q^k‖P^k)) with P = (1−q)N(0, s²) + qN(1, s²), Q = N(0, s²), H_ε(A‖B) =
    ∫ (a − e^ε b)_+, by the trapezoid rule on a grid of step s/100 over [−11s, 1 + 11s]^k (k ≤ 2; the
    tails beyond carry < 1e-27 of each density)."""
    x = np.linspace(-11 * s, 1 + 11 * s, int((1 + 22 * s) / (s / 100)) + 1)
    dx = x[1] - x[0]
    q0 = norm.pdf(x, 0, s)
    p0 = (1 - q) * q0 + q * norm.pdf(x, 1, s)
    w = np.full_like(x, dx)
    w[0] = w[-1] = dx / 2
    if k == 1:
        return max(float(np.sum(w * np.maximum(a - math.exp(eps) * b, 0))) for a, b in ((p0, q0), (q0, p0)))
    assert k == 2
    out = []
    for a, b in ((p0, q0), (q0, p0)):
        total = 0.0
        for i in range(0, len(x), 500):  # rows in chunks (memory)
            blk = np.outer(a[i : i + 500], a) - math.exp(eps) * np.outer(b[i : i + 500], b)
            total += float(np.sum(np.maximum(blk, 0) * np.outer(w[i : i + 500], w)))
        out.append(total)
    return max(out)


def _sampled_gaussian_epsilon(s: float, q: float, k: int, delta: float) -> float:
    return brentq(lambda e: _sampled_gaussian_delta(s, q, k, e) - delta, 0.0, 30.0, xtol=1e-6)


# -- accounting --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rounds", [1, 2])
def test_epsilon_equals_an_independent_float64_computation(rounds):
    """banded:3 over b' = 4 partitions, T = 4·rounds steps, q = 0.3, σ = 1.2·‖c‖ (σ/‖c‖ = 1.2): the ledger's
    events composed under dpopt's PLD equal the quadrature's ε (relative 5e-3: the PLD grid and the
    quadrature's step)."""
    T, parts, q = 4 * rounds, 4, 0.3
    strategy = optimize_strategy("banded", T, 3)
    col = float(np.linalg.norm(strategy.coefficients))
    sigma = 1.2 * col
    part = Participation(T, rounds, parts)
    events = amplified_step_events(sigma, strategy, part, q)
    assert [type(e).__name__ for e in events].count("PoissonSampledDpEvent") == rounds  # one per round
    got = epsilon(dp_event.ComposedDpEvent(events), 1e-5)
    want = _sampled_gaussian_epsilon(1.2, q, rounds, 1e-5)
    assert got == pytest.approx(want, rel=5e-3)
    assert epsilon(amplified_banded_event(sigma, strategy, part, q), 1e-5) == pytest.approx(got, rel=1e-9)


def test_mixture_of_gaussians_round_is_the_poisson_sampled_gaussian():
    """dp_accounting's MixtureOfGaussiansDpEvent (arXiv 2310.15526) of one round, under its PLD accountant,
    equals the Poisson-sampled Gaussian of the ledger (3 rounds; both on a 1e-3 loss grid, relative 1e-2: two
    PLD constructions)."""
    strategy, q = optimize_strategy("banded", 12, 2), 0.2
    sigma = 0.9 * float(np.linalg.norm(strategy.coefficients))
    out = []
    for ev in (
        mixture_of_gaussians_round(sigma, strategy, q),
        amplified_step_events(sigma, strategy, Participation(12, 3, 4), q)[0],
    ):
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
        acc.compose(ev, 3)
        out.append(acc.get_epsilon(1e-6))
    assert out[0] == pytest.approx(out[1], rel=1e-2)


def test_amplified_ledger_rederives_and_tampering_is_caught():
    T, q, sigma = 8, 0.4, 1.5
    strategy = optimize_strategy("banded", T, 2)
    mech = CorrelatedNoise(strategy, Participation(T, 4, 2), sigma, sample_rate=q)
    rec = mech.record()
    assert rec["sample_rate"] == q and rec["amplification"].startswith("cyclic-poisson")
    assert mech.sampling == "cyclic poisson (q=0.4 within 2 partitions)"

    class E:
        def __init__(self, step, event, ms):
            self.step, self.event, self.meta = step, event, {"mechanism_sensitivity": ms}

    entries = [E(t, mech.step_event(t), float(mech.prefix[t])) for t in range(T)]
    assert check_record(rec, entries) == []
    assert check_record(dict(rec, sample_rate=0.5), entries)  # a different q in the header: every round disagrees
    assert check_record({k: v for k, v in rec.items() if k != "sample_rate"}, entries)  # unamplified header


@pytest.mark.parametrize("strategy, parts", [(("blt", 2), 4), (("banded", 3), 2)])
def test_overlapping_columns_get_the_spectral_bound(strategy, parts):
    """BLT, and banded with more bands than parts: one sampled Gaussian per round at σ/√λ_max(UᵀU) (the spectral
    bound, tests/accounting/test_sampled_matrix_mechanism.py), recorded and re-derived from the record."""
    from dpopt.accounting.sampled_matrix_mechanism import amplified_sensitivity

    s = optimize_strategy(strategy[0], 8, strategy[1])
    mech = CorrelatedNoise(s, Participation(8, 8 // parts, parts), 1.0, sample_rate=0.5)
    scale = amplified_sensitivity(s, 8, parts)
    want = dp_event.PoissonSampledDpEvent(0.5, dp_event.GaussianDpEvent(1.0 / scale))
    assert [mech.step_event(t) for t in range(8)] == [
        want if t % parts == 0 else dp_event.NoOpDpEvent() for t in range(8)
    ]
    rec = mech.record()
    assert rec["amplification"].startswith("cyclic-poisson spectral") and rec["amplified_sensitivity"] == scale


def test_what_remains_refused():
    """q outside (0, 1]; overlapping columns over more than 2048 steps (the dense eigenproblem)."""
    with pytest.raises(ValueError, match="sample_rate"):
        CorrelatedNoise(optimize_strategy("blt", 8, 2), Participation(8, 2, 4), 1.0, sample_rate=1.5)
    with pytest.raises(ValueError, match="up to T = 2048"):
        amplified_step_events(1.0, Strategy("banded", (1.0, 0.5, 0.25)), Participation(4096, 2048, 2), 0.5)


# -- the sampler -------------------------------------------------------------------------------------------


def test_cyclic_poisson_inclusion_law():
    """N = 60 in b' = 3 parts, q = 0.3, R = 2,000 rounds (6,000 steps; reproducible uniforms, so the test is
    deterministic). (1) an example appears only at the steps of its own part (exact); (2) its inclusion
    count over the R rounds is Binomial(R, q): Σ_i (c_i − Rq)² / (Rq(1−q)) over the 60 examples is
    compared with the χ²₆₀ quantile at 1 − 1e-4 (false alarm 1e-4 for a fresh seed); (3) consecutive rounds
    are independent: the count of examples included in both rounds r and r+1 has mean 60q² per round pair,
    checked at 5 standard errors of its mean over the 1,999 pairs (false alarm ≤ 6e-7)."""
    n, parts, q, R = 60, 3, 0.3, 2000
    sampler = CyclicPoissonBatchSampler(n, parts, q, steps=parts * R, noise=NoiseSource("reproducible", seed=5))
    home = {i: j for j, p in enumerate(sampler.partitions) for i in p}
    assert sorted(home) == list(range(n))
    inc = np.zeros((R, n), dtype=bool)
    for t, batch in enumerate(sampler):
        assert all(home[i] == t % parts for i in batch)
        assert len(set(batch)) == len(batch)
        inc[t // parts, batch] = True
    counts = inc.sum(0)
    stat = float(np.sum((counts - R * q) ** 2) / (R * q * (1 - q)))
    assert stat <= chi2.ppf(1 - 1e-4, n), stat
    both = (inc[1:] & inc[:-1]).sum(1)
    se = math.sqrt(n * q * q * (1 - q * q) / (R - 1))
    assert abs(both.mean() - n * q * q) <= 5 * se


def test_ranks_split_one_cyclic_poisson_sample():
    """Data parallel, W = 2 ranks of one partition (seed 9): N = 61 in b' = 3 balls-in-bins parts (26/20/15: an
    uneven slice), q = 0.3, R = 2,000 rounds. Secret noise (each rank its own source): (1) every example a rank draws is in its
    own slice of part t mod b' (so the ranks' batches are disjoint and inside the step's part; exact); (2) the
    union's inclusion count of each example over the R rounds is Binomial(R, q) — χ²₆₁ at 1 − 1e-7 (the
    uniforms are secret, new every run: false alarm 1e-7 per run; at 1 − 1e-4 it was 1e-4. Power: each rank
    sampling the WHOLE part would give 1 − (1 − q)² = 0.51, a count of ≈ 1,020 instead of 600 and a
    statistic of ≈ 61 × 420² / 420 ≈ 25,600 against the limit 137; duplicates are caught by (1) too). Reproducible noise (the seed shared by the ranks): the union of the
    ranks' batches IS the one-process batch of the same seed and partition, every step (exact)."""
    n, parts, q, R = 61, 3, 0.3, 2000
    ranks = [CyclicPoissonBatchSampler(n, parts, q, steps=parts * R, seed=9, rank=r, world_size=2) for r in (0, 1)]
    one = CyclicPoissonBatchSampler(n, parts, q, seed=9)
    slices = [[set(p.tensor_split(2)[r].tolist()) for p in map(torch.tensor, one.partitions)] for r in (0, 1)]
    sizes = [len(p) for p in one.partitions]
    assert sizes == [26, 20, 15]  # the partition of seed 9 (balls-in-bins: random sizes, one odd)
    assert [len(s) for s in slices[0]] == [-(-k // 2) for k in sizes] and [len(s) for s in slices[1]] == [
        k // 2 for k in sizes
    ]
    counts = np.zeros(n)
    for t, (a, b) in enumerate(zip(*ranks)):
        assert set(a) <= slices[0][t % parts] and set(b) <= slices[1][t % parts], t
        assert len(set(a)) == len(a) and len(set(b)) == len(b)
        counts[a + b] += 1
    stat = float(np.sum((counts - R * q) ** 2) / (R * q * (1 - q)))
    assert stat <= chi2.ppf(1 - 1e-7, n), stat
    shared = [
        CyclicPoissonBatchSampler(
            n, parts, q, steps=12, noise=NoiseSource("reproducible", seed=4), seed=9, rank=r, world_size=2
        )
        for r in (0, 1)
    ]
    alone = CyclicPoissonBatchSampler(n, parts, q, steps=12, noise=NoiseSource("reproducible", seed=4), seed=9)
    both = 0
    for a, b, whole in zip(*shared, alone):
        assert sorted(a + b) == sorted(whole)
        both += bool(a) and bool(b)
    assert both >= 6  # most steps draw on both ranks (a slice of 10 at q = 0.3 is empty with probability 2.8 %)
    with pytest.raises(ValueError, match="rank must lie"):
        CyclicPoissonBatchSampler(n, parts, q, rank=2, world_size=2)


def test_the_sampler_carries_no_private_sizes_in_copies():
    import pickle

    s = CyclicPoissonBatchSampler(20, 2, 0.5)
    list(s)
    assert len(s.sizes) == 2
    assert len(pickle.loads(pickle.dumps(s)).sizes) == 0


# -- the make_private door -----------------------------------------------------------------------------------


def _train(model, opt, loader, epochs: int = 2) -> int:
    """``epochs`` passes of the user's loop over ``loader`` (an empty Poisson batch's forward and backward
    release pure noise); returns the number of steps."""
    steps = 0
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            steps += 1
    return steps


def _check_pld_and_ledger(engine, q: float, sigma: float, sensitivity: float, rounds: int, steps: int):
    """The engine's ε at δ = 1e-5 is dp_accounting's PLD of ``rounds`` Poisson-sampled (rate ``q``) Gaussians at
    σ/``sensitivity`` (relative 1e-3), and check_ledger passes its ledger against those claims."""
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma / sensitivity)), rounds)
    eps = engine.get_epsilon(1e-5)
    assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)
    claims = {"epsilon": eps, "delta": 1e-5, "accountant": "pld", "noise_multiplier": sigma, "steps": steps}
    result = check_ledger(engine.ledger, claims)
    assert result.passed, result.failures


def _calibrated_epsilon(engine, steps: int = 8) -> float:
    """ε at δ = 1e-5 of the ``steps`` step events of the mechanism a make_private_with_epsilon call calibrated."""
    mech = engine._claims["privatizers"][0].mechanism
    return epsilon(dp_event.ComposedDpEvent([mech.step_event(t) for t in range(steps)]), 1e-5)


def test_make_private_cyclic_poisson_trains_accounts_and_checks():
    """48 examples, loader batch 12 (len 4), q = 0.5: b' = 2 parts of 24, expected batch 12; epochs = 2: T = 8,
    k = 4 rounds. ε = dp_accounting's PLD of 4 Poisson-sampled Gaussians at σ/‖c‖, below the unamplified one."""
    torch.manual_seed(0)
    model, engine = nn.Linear(5, 2), PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer="dp-adam",
        data_loader=DataLoader(_data(), batch_size=12),
        noise_multiplier=1.5,
        max_grad_norm=1.0,
        noise_mechanism="banded:2",
        epochs=2,
        sampling="cyclic-poisson",
        sample_rate=0.5,
        lr=0.05,
    )
    # one pass of the loader is one epoch of the horizon (len(data_loader) = 4 steps, cycling the 2 parts), so
    # `epochs` passes make the T planned releases
    assert isinstance(loader, CyclicPoissonLoader) and len(loader) == 4
    assert opt.expected_batch_size == pytest.approx(12.0)
    steps = _train(model, opt, loader)
    assert steps == 8 and len(engine.ledger) == 8
    rec = engine.ledger.mechanism
    assert (rec["steps"], rec["participations"], rec["min_separation"], rec["sample_rate"]) == (8, 4, 2, 0.5)
    assert engine.ledger.sampling == "cyclic poisson (q=0.5 within 2 partitions)"
    col = float(np.linalg.norm(opt.privatizer.mechanism.strategy.coefficients))
    _check_pld_and_ledger(engine, 0.5, 1.5, col, rounds=4, steps=8)


def test_make_private_with_epsilon_calibrates_the_amplified_run():
    model = nn.Linear(5, 2)
    engine = PrivacyEngine()
    engine.make_private_with_epsilon(
        module=model,
        optimizer="dp-sgd",
        data_loader=DataLoader(_data(), batch_size=12),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=1.0,
        noise_mechanism="banded:2",
        sampling="cyclic-poisson",
        sample_rate=0.5,
        lr=0.1,
    )
    assert 3.0 * 0.98 <= _calibrated_epsilon(engine) <= 3.0


def test_make_private_blt_cyclic_poisson_accounts_checks_and_calibrates():
    """BLT over cyclic Poisson sampling through make_private: ε is dp_accounting's PLD of k = 4 sampled Gaussians
    at σ/√λ_max(UᵀU), check_ledger passes, and make_private_with_epsilon reaches the target within 2 %."""
    from dpopt.accounting.sampled_matrix_mechanism import amplified_sensitivity

    torch.manual_seed(0)
    model, engine = nn.Linear(5, 2), PrivacyEngine()
    common = dict(data_loader=DataLoader(_data(), batch_size=12), max_grad_norm=1.0, epochs=2, lr=0.1)
    common.update(noise_mechanism="blt", sampling="cyclic-poisson", sample_rate=0.5)
    model, opt, loader = engine.make_private(module=model, optimizer="dp-sgd", noise_multiplier=1.5, **common)
    _train(model, opt, loader)
    scale = amplified_sensitivity(opt.privatizer.mechanism.strategy, 8, 2)
    _check_pld_and_ledger(engine, 0.5, 1.5, scale, rounds=4, steps=8)
    calibrated = PrivacyEngine()
    calibrated.make_private_with_epsilon(
        module=nn.Linear(5, 2), optimizer="dp-sgd", target_epsilon=3.0, target_delta=1e-5, **common
    )
    assert 3.0 * 0.98 <= _calibrated_epsilon(calibrated) <= 3.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"sample_rate": None}, "needs sample_rate"),
        ({"sample_rate": 0.1}, "0 partitions"),
        ({"sampling": "poisson"}, "'cyclic' or 'cyclic-poisson'"),
        ({"noise_mechanism": "independent", "epochs": None}, "independent noise is Poisson-sampled"),
    ],
)
def test_make_private_refuses_sampling_without_an_accountant(kwargs, match):
    args = sgd_args(**{"epochs": 2, "sampling": "cyclic-poisson", "sample_rate": 0.5, **kwargs})
    with pytest.raises(ConfigError, match=match):
        PrivacyEngine().make_private(**args)


def test_sample_rate_without_sampling_suggests_cyclic_poisson():
    """sample_rate with a noise_mechanism but no sampling=: the refusal says sample_rate is also read with
    sampling='cyclic-poisson' and suggests it (independent noise: no such suggestion)."""
    for mech, hint in (("blt", True), ("independent", False)):
        args = sgd_args(noise_mechanism=mech, sample_rate=0.5)
        if mech != "independent":
            args["epochs"] = 3
        with pytest.raises(ValueError, match="privacy_unit='user' or sampling='cyclic-poisson'") as err:
            PrivacyEngine().make_private(**args)
        assert ("pass sampling='cyclic-poisson'" in str(err.value)) == hint


def _blt_run(engine, sample_rate, target=None, n=64, epochs=3, sigma=1.0, **extra):
    model = nn.Linear(5, 2)
    args = dict(
        **extra,
        module=model,
        optimizer="dp-sgd",
        data_loader=DataLoader(_data(n), batch_size=16),
        max_grad_norm=1.0,
        noise_mechanism="blt",
        epochs=epochs,
        sampling="cyclic-poisson",
        sample_rate=sample_rate,
        lr=0.1,
    )
    if target is None:
        return engine.make_private(noise_multiplier=sigma, **args)
    return engine.make_private_with_epsilon(target_epsilon=target, target_delta=1e-5, **args)


def test_amplification_that_costs_is_warned_with_both_epsilons():
    """64 examples, batch 16, blt, 3 epochs (T = 12): cyclic Poisson at q = 0.5 (2 parts: 6 rounds) scores σ = 1
    at a larger ε than the 4 cyclic batches' Gaussian; the warning gives both (each re-derived here, at
    δ = 1e-5) and the accounting is not switched. make_private_with_epsilon warns as well (at ε = 4)."""
    from dpopt.accounting.accountant import AccountingWarning
    from dpopt.accounting.matrix_factorization import Participation, amplified_sensitivity, prefix_sensitivities

    engine = PrivacyEngine()
    with pytest.warns(AccountingWarning, match="use sampling='cyclic'") as rec:
        _, opt, _ = _blt_run(engine, 0.5)
    mech = opt.privatizer.mechanism
    assert mech.sample_rate == 0.5  # still amplified: nothing switched
    acc = pld_privacy_accountant.PLDAccountant()
    s = amplified_sensitivity(mech.strategy, 12, 2)
    acc.compose(dp_event.PoissonSampledDpEvent(0.5, dp_event.GaussianDpEvent(1.0 / s)), 6)
    amp = acc.get_epsilon(1e-5)
    plain = epsilon(
        dp_event.GaussianDpEvent(1.0 / float(prefix_sensitivities(mech.strategy, Participation(12, 3, 4))[-1])), 1e-5
    )
    assert amp > plain * 1.2
    text = str([w for w in rec if issubclass(w.category, AccountingWarning)][0].message)
    assert f"epsilon={amp:.4g}" in text and f"epsilon={plain:.4g}" in text
    with pytest.warns(AccountingWarning, match=r"epsilon=4, MORE than the unamplified.*epsilon=3\.5.*sigma=3\.105"):
        _blt_run(PrivacyEngine(), 0.5, target=4.0)


def test_amplification_that_helps_is_not_warned():
    """A smaller q at a larger σ (256 examples, batch 16: 16 batches, 1 epoch; q = 1/4: 4 parts of 64, 4 rounds,
    σ = 3): the amplified ε is the smaller one, so nothing is warned; the helper warns only where it loses."""
    import warnings

    from dpopt.accounting.accountant import AccountingWarning
    from dpopt.accounting.calibration import warn_if_amplification_costs

    with warnings.catch_warnings():
        warnings.simplefilter("error", AccountingWarning)
        _, opt, _ = _blt_run(PrivacyEngine(), 0.25, n=256, epochs=1, sigma=3.0)
        mech = opt.privatizer.mechanism
        assert mech.participation.min_separation == 4 and mech.horizon == 16
        assert warn_if_amplification_costs(mech.strategy, 16, 16, 4, 0.25, 3.0, 1e-5) is None
    with pytest.warns(AccountingWarning):  # the same run at σ = 1 loses (ε 10.2 against 5.9)
        amp, plain = warn_if_amplification_costs(mech.strategy, 16, 16, 4, 0.25, 1.0, 1e-5)
    assert amp > plain


def test_amplification_check_runs_at_the_users_delta():
    """make_private(delta=...) compares amplified and cyclic-batch ε at the user's δ, not at 1e-5. 256 examples,
    batch 16, blt, 1 epoch, q = 1/4 (4 parts), σ = 2: amplified ε 3.07 > 2.66 unamplified at δ = 1e-5 (warned),
    but at δ = 1e-3 amplification wins (the helper returns None there; re-derived here) and nothing is warned.
    Without delta the check falls back to 1e-5 (the message says which δ), and the given δ is the ledger's."""
    import warnings

    from dpopt.accounting.accountant import AccountingWarning
    from dpopt.accounting.calibration import warn_if_amplification_costs

    def run(**kw):
        return _blt_run(PrivacyEngine(), 0.25, n=256, epochs=1, sigma=2.0, **kw)

    with pytest.warns(AccountingWarning, match=r"delta=1e-05"):
        engine_default = run()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AccountingWarning)
        _, opt, _ = run(delta=1e-3)
        mech = opt.privatizer.mechanism
        assert warn_if_amplification_costs(mech.strategy, 16, 16, 4, 0.25, 2.0, 1e-3) is None
    assert engine_default[1].privatizer.mechanism.sample_rate == mech.sample_rate == 0.25  # nothing switched
    with pytest.warns(AccountingWarning, match=r"delta=1e-08"):
        run(delta=1e-8)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\), got 1.5"):
        run(delta=1.5)
    with pytest.raises(ValueError, match="takes the run's delta as target_delta"):
        _blt_run(PrivacyEngine(), 0.5, target=4.0, delta=1e-3)


def test_make_private_records_the_given_delta_in_the_ledger():
    engine = PrivacyEngine()
    _blt_run(engine, 0.25, n=256, epochs=1, sigma=3.0, delta=1e-3)
    assert engine.ledger.delta == 1e-3
    engine = PrivacyEngine()
    _blt_run(engine, 0.25, n=256, epochs=1, sigma=3.0)
    assert engine.ledger.delta is None  # not told: the ledger states no δ (`dpopt ledger FILE` asks for --delta)
    engine = PrivacyEngine()
    _blt_run(engine, 0.25, target=3.0, n=256, epochs=1)  # make_private_with_epsilon: its target_delta (1e-5)
    assert engine.ledger.delta == 1e-5
