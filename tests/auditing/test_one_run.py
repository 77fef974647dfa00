"""One-run audits of real training runs (dpopt.auditing.one_run): the canary sources, small audits, the verdict.

Error rates: audits at beta = 0.05 on honest runs PASS with probability >= 0.95
for any seed. Each test is seeded, the run's noise and Poisson masks too
(``reproducible_noise=True``, through :func:`_cfg` or, for the CLI, ``--seed``):
each test is deterministic and the stated rate is the chance that its seed would have
failed. (With the secret default every CI run drew new noise, so each PASS and each
power check was a new draw that failed with up to that probability.)
"""

import numpy as np
import pytest
import torch

from dpopt.auditing import one_run
from dpopt.auditing import one_run_audit as OR
from dpopt.data import load_dataset
from dpopt.engine.reference import PerSampleGrads
from dpopt.training import TrainConfig
from dpopt.types import ClipGeometry

pytestmark = pytest.mark.filterwarnings("ignore:reproducible_noise:UserWarning")  # the research mode's warning


def _cfg(**kw) -> TrainConfig:
    """A run whose noise and Poisson masks are seeded from ``cfg.seed`` (module docstring)."""
    return TrainConfig(reproducible_noise=True, **kw)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def _materialised(model_params, canary, real_grads, rows, size, base_geo):
    """The same examples as explicit per-sample gradients whose clip-space images the sources describe."""
    scale = base_geo.scale
    b_real = real_grads[0].shape[0]
    grads = [torch.cat([g, torch.zeros((rows.numel(),) + g.shape[1:], dtype=g.dtype)]) for g in real_grads]
    cz = torch.zeros((b_real + rows.numel(), canary.numel()), dtype=canary.dtype)
    cz[b_real + torch.arange(rows.numel()), rows] = size * scale[-1][rows]  # g = scale * A on coordinate j
    return grads + [cz]


def test_canary_sources_equal_materialised_per_sample_gradients():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(2))]
    canary = torch.nn.Parameter(torch.zeros(7))
    real = [torch.randn(4, 3, 2), torch.randn(4, 2)]
    rows = torch.tensor([1, 5, 6])
    allp = params + [canary]
    geo = ClipGeometry(tuple(torch.randn_like(p) for p in allp), tuple(torch.rand_like(p) + 0.5 for p in allp))
    extended = OR._WithCanaryVector(PerSampleGrads(real, params=params), canary)
    rows_src = OR._CanaryRows(rows, params, canary, 30.0, None)
    full = PerSampleGrads(_materialised(params, canary, real, rows, 30.0, geo), params=allp)
    groups = [0, 0, 0]
    sq = torch.cat([extended.sq_norms(geo, groups, 1).double(), rows_src.sq_norms(geo, groups, 1).double()])
    torch.testing.assert_close(sq, full.sq_norms(geo, groups, 1).double(), rtol=1e-5, atol=1e-5)
    w = torch.rand(7, 1)
    parts = [extended.weighted_sum(w[:4], geo, groups), rows_src.weighted_sum(w[4:], geo, groups)]
    for a, b, ref in zip(*parts, full.weighted_sum(w, geo, groups)):
        torch.testing.assert_close((a + b).double(), ref.double(), rtol=1e-5, atol=1e-5)


def test_small_white_box_audit_passes_with_a_bound_below_the_claim(digits):
    r = one_run(_cfg(method="dp-sgd", epochs=1, noise_multiplier=1.0), canaries=300, data=digits)
    assert r.verdict == "PASS" and r.m == 300 and r.scores.shape == (300,) and r.included.dtype == bool
    assert 0 <= r.bounds.steinke <= r.epsilon and r.estimator == "steinke"  # q < 1: f-DP not judged
    d = r.to_dict()
    assert {"epsilon_lower", "epsilon", "estimator", "m", "confidence"} <= set(d) and d["confidence"] == 0.95
    # the included canaries score higher on average (the audit sees them). With these 300 canaries the
    # difference was 0.9-2.9 standard errors over 6 runs (one CI run drew it negative: ~5 % of runs); with
    # 3000 it was 7.0-10.7 standard errors over 5 runs, so a failure is a < 1e-9 event
    big = one_run(_cfg(method="dp-sgd", epochs=1, noise_multiplier=1.0), canaries=3000, data=digits)
    assert big.scores[big.included].mean() > big.scores[~big.included].mean()


def test_full_batch_white_box_is_judged_on_the_gaussian_mu_too(digits):
    n = digits.n_train
    cfg = _cfg(method="dp-sgd", epochs=5, sample_rate=1.0, batch_size=float(n), noise_multiplier=2.0)
    r = one_run(cfg, canaries=1000, data=digits)
    assert r.claimed_mu == pytest.approx(5**0.5 / 2.0, rel=2e-3)  # T = 5 Gaussians of sigma 2: mu = sqrt(T)/sigma
    assert r.verdict == "PASS" and r.bounds.mu <= r.claimed_mu and r.details["fdp_judged"]
    assert r.bounds.mu > 0.3  # power: the mu bound reaches a good part of the true 1.118 (m = 1000)


def test_a_run_with_a_tenth_of_the_noise_is_caught(digits, monkeypatch):
    from dpopt.privatizer import Privatizer

    draw = Privatizer._draw

    def weak(self, std, rounded=False, **kw):  # kw (scaled=False) passed through; dropping it scales once too
        noise, count = draw(self, std, rounded, **kw)
        return [z.mul(0.1) for z in noise], count

    monkeypatch.setattr(Privatizer, "_draw", weak)
    r = one_run(_cfg(method="dp-sgd", epochs=1, noise_multiplier=3.0), canaries=500, data=digits)
    assert r.verdict == "EXCEEDS" and r.bounds.steinke > r.epsilon


def test_black_box_audit_runs_the_training_loop(digits):
    r = one_run(_cfg(method="dp-sgd", epochs=1, noise_multiplier=1.0), canaries=100, mode="black", data=digits)
    assert r.mode == "black" and r.verdict == "PASS" and r.bounds.steinke <= r.epsilon
    assert np.all(r.scores <= 0)  # minus a cross-entropy


def test_validation(digits):
    with pytest.raises(ValueError, match="mode must be"):
        one_run(canaries=100, mode="grey", data=digits)
    with pytest.raises(ValueError, match="canaries must be >= 10"):
        one_run(canaries=5, data=digits)
    with pytest.raises(ValueError, match="per-layer"):
        one_run(TrainConfig(method="dp-sgd", clipping="per-layer", epochs=1), canaries=20, data=digits)


def _weak_noise(monkeypatch, factor):
    from dpopt.privatizer import Privatizer

    draw = Privatizer._draw

    def weak(self, std, rounded=False, **kw):  # kw (scaled=False) passed through; dropping it scales once too
        noise, count = draw(self, std, rounded, **kw)
        return [z.mul(factor) for z in noise], count

    monkeypatch.setattr(Privatizer, "_draw", weak)


def test_cli_one_run_json_report_and_exit_codes(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from dpopt.cli import app

    runner = CliRunner()
    args = ["audit", "--one-run", "--canaries", "300", "--epochs", "1", "--noise-multiplier", "3", "--json"]
    args += ["--seed", "0"]  # canaries, noise and masks seeded (module docstring)
    res = runner.invoke(app, args + ["--report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert len(res.stdout.strip().splitlines()) == 1  # one JSON line, as every --json
    doc = json.loads(res.stdout)
    again = runner.invoke(app, args)
    assert again.exit_code == 0  # --seed: the same audit, bound for bound (the first one also names its report)
    assert json.loads(again.stdout) == {k: v for k, v in doc.items() if k != "report"}
    assert doc["m"] == 300 and doc["confidence"] == 0.95 and doc["estimator"] == "steinke"
    assert 0 <= doc["epsilon_lower"] <= doc["epsilon"] and doc["verdict"] == "PASS"
    md = (tmp_path / "one-run-audit.md").read_text()
    assert "PASS" in md and "one-run-audit.png" in md and (tmp_path / "one-run-audit.png").stat().st_size > 1000
    _weak_noise(monkeypatch, 0.02)
    res = runner.invoke(app, args)
    assert res.exit_code == 1 and json.loads(res.stdout)["verdict"] == "EXCEEDS"
    res = runner.invoke(app, ["audit", "--one-run", "--beta", "2"])
    assert res.exit_code == 2 and "--beta must be in (0, 1)" in res.output


def test_cli_one_run_seed_is_secret_unless_asked(monkeypatch):
    """`dpopt audit --one-run` without --seed: the audit's draws come from OS entropy (one_run(seed=None)) and the
    run's noise is secret; with --seed 7: the canaries are seeded 7 and the run's noise and masks are seeded from
    cfg.seed = 7 (reproducible_noise). Captured at the library's door, no training."""
    from typer.testing import CliRunner

    import dpopt.auditing
    from dpopt.cli import app

    calls = []

    def capture(cfg, **kw):
        calls.append((cfg, kw))
        raise ValueError("captured")  # the CLI's one-line refusal, exit 2: nothing trains

    monkeypatch.setattr(dpopt.auditing, "one_run", capture)
    runner = CliRunner()
    assert runner.invoke(app, ["audit", "--one-run"]).exit_code == 2
    assert runner.invoke(app, ["audit", "--one-run", "--seed", "7"]).exit_code == 2
    (secret_cfg, secret_kw), (seeded_cfg, seeded_kw) = calls
    assert secret_kw["seed"] is None and not secret_cfg.reproducible_noise
    assert seeded_kw["seed"] == 7 and seeded_cfg.seed == 7 and seeded_cfg.reproducible_noise


def test_one_run_seed_none_draws_fresh_canaries(monkeypatch, digits):
    """one_run(seed=None): the inclusion draw comes from OS entropy and is not recorded; two audits differ in
    their m = 200 inclusion bits (equal with probability 2^-200). Seeded: equal. The training is replaced by a
    stub returning zero scores (the draw precedes it)."""
    monkeypatch.setattr(
        OR, "_white_box", lambda cfg, data, included, gen: (np.zeros(len(included)), 1.0, {"sample_rate": 0.5})
    )
    first, second = (one_run(_cfg(), canaries=200, seed=None, data=digits) for _ in range(2))
    assert not np.array_equal(first.included, second.included) and first.details["seed"] is None
    seeded = [one_run(_cfg(), canaries=200, seed=3, data=digits).included for _ in range(2)]
    assert np.array_equal(*seeded)


# --------------------------------------------------------------------------- correlated noise (issue 36)
def _mutant(name):
    """Apply mutant ``name`` of tests/auditing/mutants.py in this process; returns its undo."""
    import importlib.util
    import sys
    from pathlib import Path

    mod = sys.modules.get("dpopt_mutants")  # test_mutations.py loads it under this name too
    if mod is None:
        spec = importlib.util.spec_from_file_location("dpopt_mutants", Path(__file__).parent / "mutants.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["dpopt_mutants"] = mod  # its dataclasses resolve their module through sys.modules
        spec.loader.exec_module(mod)
    return mod.activate(name)


def _independent_reference(cfg, steps, b):
    """(Δ, the claim's μ = Δ/σ, its ε(δ) in float64) of ``cfg``'s mechanism over ``steps`` releases and ``b``
    cyclic batches, from the strategy alone (Balle & Wang 2018 for ε)."""
    from dpopt.accounting.matrix_factorization import gaussian_epsilon
    from dpopt.correlated_noise import Participation, optimize_strategy, parse_mechanism, sensitivity

    kind, size = parse_mechanism(cfg.noise_mechanism)
    participation = Participation(steps, -(-steps // b), b)  # the strategy is tuned for the run's participations
    delta_s = sensitivity(optimize_strategy(kind, steps, size, participation=participation), participation)
    mu = delta_s / cfg.noise_multiplier
    return delta_s, mu, gaussian_epsilon(mu, cfg.delta)


def test_white_box_audit_of_a_blt_run_is_judged_against_the_mechanisms_epsilon(digits):
    from dpopt.accounting import dpsgd_epsilon

    cfg = _cfg(method="dp-sgd", epochs=2, noise_multiplier=1.0, noise_mechanism="blt")
    r = one_run(cfg, canaries=500, data=digits)
    d = r.details
    b = round(digits.n_train / 64)  # cyclic batches: b = round(1/q) = 22
    assert d["noise_mechanism"] == "blt:4" and d["min_separation"] == b and d["steps"] in (44, 45)
    assert d["participations"] == -(-d["steps"] // b) > 1  # several participations: dpopt's general bound on Δ
    delta_s, mu, eps = _independent_reference(cfg, d["steps"], b)
    assert d["mechanism_sensitivity"] == pytest.approx(delta_s, rel=1e-9)
    assert r.claimed_mu == pytest.approx(mu, rel=1e-9) and d["fdp_judged"]  # one Gaussian: μ-GDP, f-DP judged
    assert r.epsilon == pytest.approx(eps, rel=5e-3)  # the ledger's PLD ε of Gaussian(σ/Δ) vs Balle-Wang in float64
    # ... and not the ε of independent Poisson-sampled noise at this σ (what an audit without the mechanism claims)
    assert r.epsilon > 3 * dpsgd_epsilon(1.0, 64 / digits.n_train, d["steps"], 1e-5)
    # an honest run: the bounds are sound (a false EXCEEDS has probability <= 2·beta = 0.1 by the two theorems;
    # measured, audit seeds 0-2: Steinke 2.4-3.0 against the claim 12.5, mu 0.82-1.06 against 2.40), and the
    # audit has power (included minus excluded mean score: 16-17 standard errors over those seeds)
    assert r.verdict == "PASS" and 0 < r.bounds.steinke <= r.epsilon and r.bounds.mu <= r.claimed_mu
    assert r.bounds.mu > 0.3
    assert r.scores[r.included].mean() > r.scores[~r.included].mean()


def test_white_box_audit_of_amplified_banded_uses_cyclic_poisson_and_its_ledger(digits):
    from dpopt.accounting import epsilon as event_epsilon
    from dpopt.correlated_noise import Participation, amplified_banded_event, optimize_strategy

    cfg = _cfg(
        method="dp-sgd",
        epochs=1,
        noise_multiplier=1.0,
        noise_mechanism="banded:4",
        sampling="cyclic-poisson",
        sample_rate=0.2,
    )
    r = one_run(cfg, canaries=300, data=digits)
    d = r.details
    assert d["sample_rate"] == 0.2 and d["min_separation"] == 4 and d["steps"] == 22  # b' = round(0.2 × 22)
    assert d["expected_batch_size"] == pytest.approx(0.2 * digits.n_train / 4)
    assert r.claimed_mu is None and not d["fdp_judged"]  # sampled rounds: not μ-GDP, Steinke judged only
    # the claim: 6 rounds of the Poisson-sampled Gaussian at σ/‖c‖, rebuilt from the strategy (not the ledger)
    event = amplified_banded_event(1.0, optimize_strategy("banded", 22, 4), Participation(22, 6, 4), 0.2)
    assert r.epsilon == pytest.approx(event_epsilon(event, 1e-5), rel=1e-6)
    assert r.verdict == "PASS" and 0 <= r.bounds.steinke <= r.epsilon  # fails w.p. <= beta = 0.05


def test_correlated_noise_scores_are_the_exact_log_likelihood_ratios():
    """_mf_scores against multivariate normal densities of x = p + σ·C⁻¹z, and the C = I reduction."""
    from itertools import product

    from scipy.stats import multivariate_normal

    from dpopt.correlated_noise import optimize_strategy

    rng = np.random.default_rng(3)
    steps, sigma = 6, 0.7
    for kind, size, sep, q in [("blt", 2, 3, None), ("banded", 2, 2, None), ("banded", 2, 2, 0.3)]:
        c = optimize_strategy(kind, steps, size).matrix(steps)
        cinv = np.linalg.inv(c)
        cov = sigma**2 * cinv @ cinv.T
        slots = np.array([0, 1, 1, 0])[: min(4, sep * 2)] % sep
        x = rng.normal(size=(steps, slots.size)) + 0.5
        got = OR._mf_scores(x, c, slots, sep, sigma, q)
        for j, r in enumerate(slots):
            mine = [t for t in range(steps) if t % sep == r]
            out = multivariate_normal(np.zeros(steps), cov).logpdf(x[:, j])
            if q is None:  # the fixed pattern of batch r
                p = np.isin(np.arange(steps), mine).astype(float)
                want = multivariate_normal(p, cov).logpdf(x[:, j]) - out
            else:  # every inclusion pattern of the part's steps, each step w.p. q
                terms = []
                for bits in product((0, 1), repeat=len(mine)):
                    p = np.zeros(steps)
                    p[[t for t, b in zip(mine, bits) if b]] = 1.0
                    w = np.prod([q if b else 1 - q for b in bits])
                    terms.append(np.log(w) + multivariate_normal(p, cov).logpdf(x[:, j]))
                want = np.logaddexp.reduce(terms) - out
            assert got[j] == pytest.approx(want, rel=1e-9, abs=1e-9)
    # C = I: the independent-noise score of every step
    x = rng.normal(size=(5, 3))
    ident = OR._mf_scores(x, np.eye(5), np.zeros(3, dtype=int), 1, sigma, 0.25)
    torch.testing.assert_close(
        torch.from_numpy(ident), OR._lr_score(torch.from_numpy(x), 0.25, sigma).sum(0), rtol=1e-12, atol=1e-12
    )


def test_a_blt_run_whose_noise_is_divided_by_bbar_is_caught(digits):
    """Mutant ``noise_div_bbar_twice`` (tests/auditing/mutants.py) under BLT: the ledger claims ε ≈ 1 while
    the noise is 1/B̄ ≈ 1/65 of it. Measured (audit seeds 0, 1): claim 0.815, Steinke bound 3.12 (the
    scores separate the canaries perfectly; the true μ is ≈ 65 × 0.22). Missing the mutant would need the
    separation to fail, a < 1e-9 event at that μ. The honest runs above pass, so the mutant is what is caught.
    (``noise_half`` is not used: at m = 10³ the one-run bounds reach about half the true μ, so a 2× leak is
    not resolved at a test's cost.)"""
    undo = _mutant("noise_div_bbar_twice")
    try:
        cfg = _cfg(method="dp-sgd", epochs=1, noise_multiplier=6.0, noise_mechanism="blt")
        r = one_run(cfg, canaries=300, data=digits)
    finally:
        undo()
    assert r.epsilon < 1.5 and r.verdict == "EXCEEDS" and r.bounds.steinke > r.epsilon


def test_cli_one_run_takes_the_noise_mechanism_and_amplified_blt():
    import json

    from typer.testing import CliRunner

    from dpopt.cli import app

    runner = CliRunner()
    args = ["audit", "--one-run", "--canaries", "100", "--epochs", "1", "--noise-multiplier", "3", "--json"]
    args += ["--seed", "0"]  # canaries, noise and masks seeded (module docstring)
    res = runner.invoke(app, args + ["--noise-mechanism", "blt"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["details"]["noise_mechanism"] == "blt:4" and doc["details"]["fdp_judged"] and doc["verdict"] == "PASS"
    assert doc["claimed_mu"] == pytest.approx(doc["details"]["mechanism_sensitivity"] / 3.0)
    res = runner.invoke(
        app, args + ["--noise-mechanism", "blt", "--sampling", "cyclic-poisson", "--sample-rate", "0.2"]
    )
    assert res.exit_code == 0, res.output  # amplified BLT (the spectral bound): judged on Steinke's bound only
    doc = json.loads(res.stdout)
    assert doc["details"]["sampling"].startswith("cyclic poisson") and doc["claimed_mu"] is None
    text = runner.invoke(app, args[:-3] + ["--seed", "0", "--noise-mechanism", "banded:4"])  # the text report
    assert text.exit_code == 0, text.output
    head, claims = text.stdout.splitlines()[:2]
    assert head.startswith("One-run white-box audit of dp-sgd on digits, noise banded:4: m = 100 canaries")
    assert claims.startswith("claimed ε ") and ", μ " in claims.split("|")[0] and claims.endswith("PASS")


def test_black_box_audit_of_a_banded_run_claims_the_mechanisms_mu(digits):
    cfg = _cfg(method="dp-sgd", epochs=1, noise_multiplier=2.0, noise_mechanism="banded:2")
    r = one_run(cfg, canaries=100, mode="black", data=digits)
    d = r.details
    # the included canaries join the training set, so b = round(N'/B̄) is that of the augmented set
    assert d["min_separation"] == round((digits.n_train + r.included.sum()) / 64)
    delta_s, mu, _ = _independent_reference(cfg, d["steps"], d["min_separation"])
    assert d["noise_mechanism"] == "banded:2" and d["sample_rate"] is None and d["fdp_judged"]
    assert r.claimed_mu == pytest.approx(mu, rel=1e-9) and d["mechanism_sensitivity"] == pytest.approx(delta_s)
    assert r.verdict == "PASS" and r.bounds.steinke <= r.epsilon  # fails w.p. <= 2·beta (two theorems)


def test_cli_audit_refuses_options_of_the_other_mode(monkeypatch):
    """`--noise-mechanism` without --one-run, `--trials` with it: refused (one line, exit 2), never silently
    ignored; nothing is audited (the library doors raise if reached)."""
    from typer.testing import CliRunner

    import dpopt.auditing
    from dpopt.cli import app

    def reached(*args, **kwargs):
        raise AssertionError("an audit ran")

    monkeypatch.setattr(dpopt.auditing, "one_run", reached)
    monkeypatch.setattr(dpopt.auditing, "audit_all", reached)
    runner = CliRunner()
    res = runner.invoke(app, ["audit", "--noise-mechanism", "blt"])
    assert res.exit_code == 2 and res.stderr.strip() == (
        "error: --noise-mechanism applies to --one-run only (a training-run audit): add --one-run or drop it"
    )
    res = runner.invoke(app, ["audit", "--epochs", "1", "--canaries", "100"])
    assert res.exit_code == 2 and res.stderr.strip().startswith("error: --canaries, --epochs apply to --one-run only")
    res = runner.invoke(app, ["audit", "--one-run", "--trials", "400"])
    assert res.exit_code == 2 and res.stderr.strip() == (
        "error: --trials does not apply to --one-run (only to the one-step audits); drop it"
    )
    res = runner.invoke(app, ["audit", "--one-run", "--all", "--alpha", "0.01"])
    assert res.exit_code == 2 and "--all, --alpha do not apply to --one-run" in res.stderr


def test_reproducible_audit_warns_once_without_naming_dpopt_check(digits):
    """The audit keeps no run directory: its reproducible_noise warning is the audit's own (no `dpopt check`
    part), once; the training build's warning (which names `dpopt check`) is not shown."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one_run(_cfg(method="dp-sgd", epochs=1, noise_multiplier=1.0), canaries=50, data=digits)
    texts = [str(w.message) for w in caught if "reproducible_noise" in str(w.message)]
    assert texts == [OR.REPRODUCIBLE_AUDIT_WARNING] and "dpopt check" not in texts[0]


def test_cli_one_run_seed_prints_a_one_line_note(monkeypatch):
    """`dpopt audit --one-run --seed 3`: a `note:` line (no file:line, no source line, no `dpopt check`)."""
    import warnings

    from typer.testing import CliRunner

    import dpopt.auditing
    from dpopt.cli import app

    def warn_then_refuse(cfg, **kw):
        warnings.warn(OR.REPRODUCIBLE_AUDIT_WARNING, UserWarning, stacklevel=2)
        warnings.warn("another warning", UserWarning, stacklevel=2)
        raise ValueError("captured")

    monkeypatch.setattr(dpopt.auditing, "one_run", warn_then_refuse)
    res = CliRunner().invoke(app, ["audit", "--one-run", "--seed", "3"])
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [
        f"note: {OR.REPRODUCIBLE_AUDIT_WARNING}",
        "warning: another warning",
        "error: captured",
    ]
