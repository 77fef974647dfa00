"""One-run audits of real training runs (dpopt.auditing.one_run): the canary sources, small audits, the verdict.

Error rates: audits at beta = 0.05 on honest runs PASS with probability >= 0.95
for any seed; each test is seeded (deterministic inputs; the run's noise is
secret, so the stated rate is the chance that a run fails).
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
    r = one_run(TrainConfig(method="dp-sgd", epochs=1, noise_multiplier=1.0), canaries=300, data=digits)
    assert r.verdict == "PASS" and r.m == 300 and r.scores.shape == (300,) and r.included.dtype == bool
    assert 0 <= r.bounds.steinke <= r.epsilon and r.estimator == "steinke"  # q < 1: f-DP not judged
    d = r.to_dict()
    assert {"epsilon_lower", "epsilon", "estimator", "m", "confidence"} <= set(d) and d["confidence"] == 0.95
    # the included canaries score higher on average (the audit sees them). With these 300 canaries the
    # difference was 0.9-2.9 standard errors over 6 runs (one CI run drew it negative: ~5 % of runs); with
    # 3000 it was 7.0-10.7 standard errors over 5 runs, so a failure is a < 1e-9 event
    big = one_run(TrainConfig(method="dp-sgd", epochs=1, noise_multiplier=1.0), canaries=3000, data=digits)
    assert big.scores[big.included].mean() > big.scores[~big.included].mean()


def test_full_batch_white_box_is_judged_on_the_gaussian_mu_too(digits):
    n = digits.n_train
    cfg = TrainConfig(method="dp-sgd", epochs=5, sample_rate=1.0, batch_size=float(n), noise_multiplier=2.0)
    r = one_run(cfg, canaries=1000, data=digits)
    assert r.claimed_mu == pytest.approx(5**0.5 / 2.0, rel=2e-3)  # T = 5 Gaussians of sigma 2: mu = sqrt(T)/sigma
    assert r.verdict == "PASS" and r.bounds.mu <= r.claimed_mu and r.details["fdp_judged"]
    assert r.bounds.mu > 0.3  # power: the mu bound reaches a good part of the true 1.118 (m = 1000)


def test_a_run_with_a_tenth_of_the_noise_is_caught(digits, monkeypatch):
    from dpopt.privatizer import Privatizer

    draw = Privatizer._draw

    def weak(self, std, rounded=False):
        noise, count = draw(self, std, rounded)
        return [z.mul(0.1) for z in noise], count

    monkeypatch.setattr(Privatizer, "_draw", weak)
    r = one_run(TrainConfig(method="dp-sgd", epochs=1, noise_multiplier=3.0), canaries=500, data=digits)
    assert r.verdict == "EXCEEDS" and r.bounds.steinke > r.epsilon


def test_black_box_audit_runs_the_training_loop(digits):
    r = one_run(TrainConfig(method="dp-sgd", epochs=1, noise_multiplier=1.0), canaries=100, mode="black", data=digits)
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

    def weak(self, std, rounded=False):
        noise, count = draw(self, std, rounded)
        return [z.mul(factor) for z in noise], count

    monkeypatch.setattr(Privatizer, "_draw", weak)


def test_cli_one_run_json_report_and_exit_codes(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from dpopt.cli import app

    runner = CliRunner()
    args = ["audit", "--one-run", "--canaries", "300", "--epochs", "1", "--noise-multiplier", "3", "--json"]
    res = runner.invoke(app, args + ["--report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert len(res.output.strip().splitlines()) == 1  # one JSON line, as every --json
    doc = json.loads(res.output)
    assert doc["m"] == 300 and doc["confidence"] == 0.95 and doc["estimator"] == "steinke"
    assert 0 <= doc["epsilon_lower"] <= doc["epsilon"] and doc["verdict"] == "PASS"
    md = (tmp_path / "one-run-audit.md").read_text()
    assert "PASS" in md and "one-run-audit.png" in md and (tmp_path / "one-run-audit.png").stat().st_size > 1000
    _weak_noise(monkeypatch, 0.02)
    res = runner.invoke(app, args)
    assert res.exit_code == 1 and json.loads(res.output)["verdict"] == "EXCEEDS"
    res = runner.invoke(app, ["audit", "--one-run", "--beta", "2"])
    assert res.exit_code == 2 and "--beta must be in (0, 1)" in res.output
