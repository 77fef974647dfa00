"""The ledger check on runs produced by a real Privatizer on synthetic per-sample gradients.

Every run directory here is written the way a training run writes it:
``ledger.json`` from ``PrivacyLedger.save`` and ``summary.json`` whose ε is
computed from that ledger with one accountant. Tampered runs are made by
editing those files, as a careless (or dishonest) implementation would.
"""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from dpopt.accounting.accountant import dpsgd_epsilon, epsilon
from dpopt.accounting.budget import split_budget
from dpopt.accounting.events import poisson_gaussian_step
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.ledger_check import check_ledger, check_run
from dpopt.engine.reference import PerSampleGrads
from dpopt.privatizer import Privatizer, QuantileClipping

Q, DELTA, SIGMA, BBAR = 0.01, 1e-5, 1.0, 8.0


def _run(steps=40, sigma=SIGMA, share=None, bounds=1.0, groups=None, seed=0):
    """Run a Privatizer for ``steps`` steps; with ``share``, quantile clipping at total σ."""
    gen = torch.Generator().manual_seed(seed)
    if share is not None:
        grad_sigma, count_mult, _ = split_budget(sigma, share)
        priv = Privatizer(
            grad_sigma, bounds, expected_batch_size=BBAR, sample_rate=Q, quantile=QuantileClipping(count_mult)
        )
    else:
        priv = Privatizer(sigma, bounds, expected_batch_size=BBAR, sample_rate=Q, groups=groups)
    n_params = 1 if groups is None else len(groups)
    for _step in range(steps):
        b = int(torch.randint(0, 12, (), generator=gen))  # Poisson-like varying size, sometimes 0
        grads = [torch.randn(b, 3, generator=gen) * 2.0 for _ in range(n_params)]
        priv.privatize(PerSampleGrads(grads), params_like=[torch.zeros(3)] * n_params)
    return priv


def _write(tmp_path, priv, accountant="rdp", **overrides):
    """Write ledger.json and an honest summary.json (RDP by default: fast; PLD is exercised below)."""
    priv.ledger.save(tmp_path / "ledger.json")
    summary = {
        "epsilon": epsilon(priv.ledger, DELTA, accountant),
        "delta": DELTA,
        "accountant": accountant,
        "noise_multiplier": SIGMA,
        "sample_rate": Q,
        "steps": priv.steps,
        "privatizer_reads": priv.reads,
        "privatizer_releases": priv.releases,
    }
    if priv.quantile is not None:
        summary["noise_multiplier_total"] = SIGMA
    summary.update(overrides)
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return summary


def _edit_ledger(tmp_path, fn):
    data = json.loads((tmp_path / "ledger.json").read_text())
    for entry in data["entries"]:
        fn(entry)
    (tmp_path / "ledger.json").write_text(json.dumps(data))


# --- honest runs pass -----------------------------------------------------------------
@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_quantile_run_passes(tmp_path, accountant):
    priv = _run(share=0.05)
    _write(tmp_path, priv, accountant)
    result = check_run(tmp_path)
    assert result.passed, result.format()
    assert [i.key for i in result.items] == ["releases", "noise", "composition", "budget_split", "noise_source"]
    assert priv.reads == priv.releases == 2 * priv.steps
    assert result.facts["sigma_eff"] == [pytest.approx(SIGMA, rel=1e-12)]
    assert "count share r = 0.05" in " ".join(result["budget_split"].evidence)


def test_plain_run_passes_and_matches_dpsgd(tmp_path):
    priv = _run()
    summary = _write(tmp_path, priv, "pld")
    assert summary["epsilon"] == pytest.approx(dpsgd_epsilon(SIGMA, Q, 40, DELTA), rel=1e-9)
    assert check_run(tmp_path).passed


# --- (a) a read without a release -------------------------------------------------------
def test_dropped_count_release_fails(tmp_path):
    """Hand-edited ledger: the count Gaussian removed from every event (meta untouched)."""
    priv = _run(share=0.05)
    _write(tmp_path, priv)

    def drop_count(entry):
        entry["event"]["event"] = entry["event"]["event"]["events"][0]

    _edit_ledger(tmp_path, drop_count)
    result = check_run(tmp_path)
    assert not result.passed
    assert set(result.failures) == {"releases", "noise", "composition", "budget_split"}
    text = result.format()
    assert "reads 2, releases 2, Gaussians in event 1" in text
    assert "recorded but the event has no count Gaussian" in text
    assert "is above the re-scored whole ledger" in text
    assert "σ_eff = 1.02598" in text and "the pieces do not add up" in text


def test_summary_reads_without_releases_fail(tmp_path):
    priv = _run(share=0.05)
    _write(tmp_path, priv, privatizer_reads=priv.reads + 3)
    result = check_run(tmp_path)
    assert result.failures == ["releases"]
    assert "3 reads of private data were never released" in result.format()


def test_missing_steps_fail(tmp_path):
    priv = _run()
    _write(tmp_path, priv, steps=priv.steps + 10)
    assert check_run(tmp_path).failures == ["releases"]


# --- the counter-example: only the gradient release recorded --------------------------
@pytest.mark.parametrize("accountant,honest,leaky", [("rdp", 2.10, 1.98), ("pld", 1.83, 1.73)])
def test_gradient_only_ledger_is_flagged(tmp_path, accountant, honest, leaky):
    """q = 0.01, 1000 steps, σ = 1, r = 0.05: an implementation that records only the gradient
    release at σ_grad ≈ 1.026 (its own ledger and summary consistent) reports less ε."""
    grad_sigma, count_mult, _ = split_budget(SIGMA, 0.05)
    steps = 1000
    leaky_ledger = PrivacyLedger()
    for step in range(steps):
        leaky_ledger.record(
            step,
            poisson_gaussian_step(grad_sigma, Q),
            max_grad_norm=[1.0],
            sensitivity=1.0,
            noise_multiplier=grad_sigma,
            noise_std=grad_sigma,
            reads=1,
            releases=1,
        )
    eps_leaky = epsilon(leaky_ledger, DELTA, accountant)
    assert eps_leaky == pytest.approx(leaky, abs=0.01)
    assert dpsgd_epsilon(SIGMA, Q, steps, DELTA, accountant) == pytest.approx(honest, abs=0.01)
    claimed = {
        "epsilon": eps_leaky,
        "delta": DELTA,
        "accountant": accountant,
        "noise_multiplier": SIGMA,
        "noise_multiplier_total": SIGMA,
        "sample_rate": Q,
        "steps": steps,
    }
    result = check_ledger(leaky_ledger, claimed)
    assert result.failures == ["budget_split"]
    assert "σ_eff = 1.02598" in result.format() and "claims σ = 1" in result.format()
    # if the Privatizer counted its reads honestly, (a) catches it too
    claimed.update(privatizer_reads=2 * steps, privatizer_releases=steps)
    assert check_ledger(leaky_ledger, claimed).failures == ["releases", "budget_split"]


# --- (b) noise calibrated to the bound applied -------------------------------------------
def test_per_layer_bounds_use_total_bound(tmp_path):
    """Bounds (1, 2, 2): sensitivity √(1+4+4) = 3, noise std σ·3 (meta and empirical)."""
    priv = Privatizer(
        SIGMA, [1.0, 2.0, 2.0], expected_batch_size=BBAR, sample_rate=Q, groups=[0, 1, 2]
    )  # secret noise: the 7-s.e. band below needs no fixed seed
    d = 20_000
    rel = priv.privatize(PerSampleGrads([torch.zeros(2, d, dtype=torch.float64)] * 3))
    meta = priv.ledger.entries[0].meta
    assert meta["sensitivity"] == pytest.approx(3.0) and meta["noise_std"] == pytest.approx(3.0 * SIGMA)
    noise = torch.cat([g * BBAR for g in rel.grads])  # zero gradients: the release is pure noise
    # 60,000 samples: the sample std's relative s.e. is 1/√(2n) ≈ 0.29%, so ±2% is a 7-s.e. band.
    assert float(noise.std()) == pytest.approx(3.0 * SIGMA, rel=0.02)
    assert float(noise.std()) > 2.5 * SIGMA  # not calibrated to the smallest (1) or mean (5/3) bound
    priv.ledger.save(tmp_path / "ledger.json")
    _write(tmp_path, priv)
    assert check_run(tmp_path).passed


def test_noise_sized_to_smallest_bound_fails(tmp_path):
    priv = _run(steps=10, bounds=[1.0, 2.0, 2.0], groups=[0, 1, 2])
    _write(tmp_path, priv)

    def understate(entry):
        entry["meta"]["sensitivity"] = 1.0
        entry["meta"]["noise_std"] = entry["meta"]["noise_multiplier"] * 1.0

    _edit_ledger(tmp_path, understate)
    result = check_run(tmp_path)
    assert result.failures == ["noise"]
    assert "sensitivity 1 but √(Σ C_k²) of bounds [1.0, 2.0, 2.0] is 3" in result.format()


def test_count_noise_mismatch_fails(tmp_path):
    priv = _run(share=0.05, steps=10)
    _write(tmp_path, priv)

    def halve(entry):
        entry["meta"]["count_noise_std"] /= 2

    _edit_ledger(tmp_path, halve)
    result = check_run(tmp_path)
    assert result.failures == ["noise"]
    assert "count_noise_std/count_sensitivity" in result.format()


# --- (c) one accountant over the whole ledger ---------------------------------------------
def test_sum_of_epoch_epsilons_is_flagged(tmp_path):
    """ε summed over 4 'epochs' of 10 steps is not the ledger's ε."""
    priv = _run(steps=40)
    per_epoch = epsilon(
        PrivacyLedger.from_dict({**priv.ledger.to_dict(), "entries": priv.ledger.to_dict()["entries"][:10]}),
        DELTA,
        "rdp",
    )
    _write(tmp_path, priv, epsilon=4 * per_epoch)
    result = check_run(tmp_path)
    assert result.failures == ["composition"]
    assert "is above the re-scored whole ledger" in result.format()


def test_under_reported_epsilon_is_flagged(tmp_path):
    priv = _run(steps=40)
    honest = _write(tmp_path, priv)["epsilon"]
    _write(tmp_path, priv, epsilon=honest * 0.99)
    result = check_run(tmp_path)
    assert result.failures == ["composition"]
    assert "BELOW" in result.format() and "under-reported" in result.format()


def test_wrong_sample_rate_or_sampling_fails(tmp_path):
    priv = _run(steps=5)
    _write(tmp_path, priv, sample_rate=0.02)
    assert check_run(tmp_path).failures == ["composition"]
    ledger = priv.ledger
    ledger.sampling = "shuffle"
    claimed = json.loads((tmp_path / "summary.json").read_text())
    claimed["sample_rate"] = Q
    assert "assume Poisson sampling" in check_ledger(ledger, claimed).format()


# --- the Privatizer facts the check relies on ---------------------------------------------
def test_empty_batch_is_released_and_charged():
    gen = torch.Generator().manual_seed(0)
    priv = Privatizer(SIGMA, 1.0, expected_batch_size=BBAR, sample_rate=Q, generator=gen)
    rel = priv.privatize(PerSampleGrads([torch.zeros(0, 3)]))
    assert len(priv.ledger) == 1 and priv.reads == priv.releases == 1
    assert rel.grads[0].shape == (3,) and bool((rel.grads[0] != 0).all())  # pure noise, not zeros
    assert epsilon(priv.ledger, DELTA, "rdp") == pytest.approx(dpsgd_epsilon(SIGMA, Q, 1, DELTA, "rdp"), rel=1e-12)
    assert epsilon(priv.ledger, DELTA, "rdp") > 0


# --- CLI ---------------------------------------------------------------------------------
def _app():
    import typer

    from dpopt.cli.accounting import register

    app = typer.Typer()
    register(app)
    return app


def test_cli_check_exit_codes(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir(), bad.mkdir()
    priv = _run(share=0.05, steps=10)
    _write(good, priv)
    _write(bad, priv)
    _edit_ledger(bad, lambda e: e["event"].update(event=e["event"]["event"]["events"][0]))
    runner = CliRunner()
    ok = runner.invoke(_app(), ["check", str(good)])
    assert ok.exit_code == 0 and "RESULT: PASS" in ok.output
    fail = runner.invoke(_app(), ["check", str(bad), "--json"])
    assert fail.exit_code == 1
    data = json.loads(fail.output)
    assert data["passed"] is False and not data["items"][0]["passed"]
    missing = runner.invoke(_app(), ["check", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "not a run directory" in missing.output


def test_cli_ledger_lists_and_rescores(tmp_path):
    priv = _run(share=0.05, steps=12)
    summary = _write(tmp_path, priv, "pld")
    out = CliRunner().invoke(_app(), ["ledger", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["releases"] == 12 and len(data["runs"]) == 1 and data["runs"][0]["count"] == 12
    assert data["runs"][0]["sigma_eff"] == [pytest.approx(SIGMA, rel=1e-12)]
    assert set(data["epsilon_by_accountant"]) == {"pld", "rdp", "prv"}
    assert data["epsilon_by_accountant"]["pld"] == pytest.approx(summary["epsilon"], rel=1e-12)
    assert data["epsilon_by_accountant"]["rdp"] > data["epsilon_by_accountant"]["pld"]
    text = CliRunner().invoke(_app(), ["ledger", str(tmp_path), "--accountant", "rdp"]).output
    assert "steps 0-11 (12x)" in text and "rdp: " in text and "*" in text


def test_check_ledger_argument_errors():
    with pytest.raises(TypeError):
        check_ledger({"entries": []}, {})
    with pytest.raises(ValueError, match="rtol"):
        check_ledger(PrivacyLedger(), {}, rtol=0)
    result = check_ledger(PrivacyLedger(), {})
    assert not result.passed and "the ledger is empty" in result.format()
    assert math.isinf(dpsgd_epsilon(0.0, Q, 3, DELTA))


# --- (e) noise source: reproducible and version-1 ledgers fail ------------------------------
def test_reproducible_noise_fails_with_evidence(tmp_path):
    gen = torch.Generator().manual_seed(0)
    priv = Privatizer(SIGMA, 1.0, expected_batch_size=BBAR, sample_rate=Q, generator=gen)  # reproducible
    for _ in range(3):
        priv.privatize(PerSampleGrads([torch.randn(2, 3, generator=gen)]))
    assert priv.ledger.noise == "reproducible"
    _write(tmp_path, priv)
    result = check_run(tmp_path)
    assert result.failures == ["noise_source"]
    assert "noise reproducible from a published seed" in result["noise_source"].evidence[0]
    assert "(e) [FAIL]" in result.format()


def test_version1_ledger_is_unknown_and_fails(tmp_path):
    priv = _run(steps=5)
    _write(tmp_path, priv)
    data = json.loads((tmp_path / "ledger.json").read_text())
    data["version"] = 1
    del data["noise"], data["dataset_size"]
    (tmp_path / "ledger.json").write_text(json.dumps(data))
    result = check_run(tmp_path)
    assert result.failures == ["noise_source"]
    text = result["noise_source"].evidence[0]
    assert "predates the record of its noise source" in text and "treated as reproducible" in text


@pytest.mark.parametrize("mode", ["secret", "secure"])
def test_secret_and_secure_noise_pass_without_nonfinite_steps(tmp_path, mode):
    priv = _run(steps=5)
    priv.ledger.noise = mode  # as mark_noise(mode) leaves a fresh ledger
    summary = _write(tmp_path, priv, noise=mode)
    assert "nonfinite_steps" not in summary  # runs no longer write this private count
    result = check_run(tmp_path)
    assert result.passed, result.format()
    assert mode in result["noise_source"].evidence[0]
    assert any("dataset_size = 'public'" in e for e in result["noise_source"].evidence)
    # a summary that disagrees with the ledger fails
    _write(tmp_path, priv, noise="reproducible")
    assert check_run(tmp_path).failures == ["noise_source"]


def test_release_without_noise_fails_the_check():
    """σ = 0 is consistent bookkeeping but no privacy: the noise item must say so (ε = ∞)."""
    priv = Privatizer(0.0, 1.0, expected_batch_size=BBAR, sample_rate=Q)
    for _ in range(3):
        priv.privatize(PerSampleGrads([torch.ones(2, 3)]))
    result = check_ledger(priv.ledger, {})
    assert not result["noise"].passed
    assert "WITHOUT noise" in result.format()


def test_summary_epsilon_slightly_below_the_ledger_fails():
    """Review finding: the composition item accepted a claim up to rtol BELOW the re-scored ε."""
    priv = Privatizer(1.0, 1.0, expected_batch_size=BBAR, sample_rate=Q)
    for _ in range(5):
        priv.privatize(PerSampleGrads([torch.ones(2, 3)]))
    eps = epsilon(priv.ledger, 1e-5, "rdp")
    claim = {
        "epsilon": eps * (1 - 1e-4),
        "delta": 1e-5,
        "accountant": "rdp",
        "noise_multiplier": 1.0,
        "sample_rate": Q,
        "steps": 5,
    }
    assert not check_ledger(priv.ledger, claim)["composition"].passed
    assert check_ledger(priv.ledger, dict(claim, epsilon=eps))["composition"].passed
