"""`dpopt train --noise-mechanism banded:B --sampling cyclic-poisson` (amplified banded MF, issue 36): the run's
ledger records the amplified rounds, `dpopt check` / `dpopt ledger` re-score it from the files, ε equals an
independent dp_accounting computation, --target-epsilon calibrates it, and combinations without a valid
accountant exit 2 with one line."""

import json
import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from typer.testing import CliRunner

from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.ledger_check import check_run
from dpopt.cli import app
from dpopt.data import load_dataset

BASE = ["train", "--dataset", "digits", "--epochs", "1", "--batch-size", "256", "--method", "dp-sgd"]


def _digits_parts(q: float, batch: int = 256) -> tuple[int, int]:
    """(L, b'): L = round(N/B̄) steps per epoch, b' = round(q·L) parts (the CLI's documented rule)."""
    n = len(load_dataset("digits").y_train)
    per_epoch = round(n / batch)
    return per_epoch, round(q * per_epoch)


def _pld_epsilon(mu_inv: float, q: float, rounds: int, delta: float) -> float:
    """ε of ``rounds`` Poisson-sampled Gaussians (noise multiplier ``mu_inv``) from dp_accounting's PLD at a
    fine grid (an accountant configured independently of dpopt's)."""
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(mu_inv))
    return acc.compose(dp_event.SelfComposedDpEvent(event, rounds)).get_epsilon(delta)


@pytest.fixture(scope="module")
def amplified_run(tmp_path_factory):
    """digits, B̄ = 256, q = 0.5, banded:2, σ = 2, one epoch: L = 6 steps per epoch (N = 1437), b' = 3 parts,
    T = 6 steps, k = 2 rounds."""
    run_dir = tmp_path_factory.mktemp("amplified") / "run"
    args = BASE + ["--noise-multiplier", "2", "--noise-mechanism", "banded:2", "--sampling", "cyclic-poisson"]
    result = CliRunner().invoke(app, args + ["--sample-rate", "0.5", "--out", str(run_dir)])
    assert result.exit_code == 0, result.output
    (run_dir.parent / "stdout.txt").write_text(result.output)
    return run_dir


def test_amplified_run_records_one_sampled_gaussian_per_round(amplified_run):
    """The ledger has one PoissonSampledDpEvent(q, Gaussian(σ/‖c‖)) per round (k = 2) and ε is dp_accounting's
    for 2 such rounds (rel 1e-3: PLD grids); an epoch is L steps."""
    run_dir = amplified_run
    per_epoch, parts = _digits_parts(0.5)
    assert (per_epoch, parts) == (6, 3)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == per_epoch and summary["sample_rate"] == 0.5
    assert (summary["sampling"], summary["min_separation"]) == ("cyclic-poisson", parts)
    assert "σ = 2, q = 0.50000 within b' = 3 cyclic parts" in (run_dir.parent / "stdout.txt").read_text()
    ledger = PrivacyLedger.load(run_dir / "ledger.json")
    rec = ledger.mechanism
    assert rec["kind"] == "banded" and rec["sample_rate"] == 0.5 and rec["min_separation"] == parts
    assert rec["amplification"].startswith("cyclic-poisson") and rec["noise_multiplier"] == 2.0
    assert "cyclic poisson" in ledger.sampling
    kinds = [type(e.event).__name__ for e in ledger.entries]
    assert kinds.count("PoissonSampledDpEvent") == per_epoch // parts == 2  # one per round, at t mod b' = 0
    col = math.sqrt(sum(c * c for c in rec["strategy"]["coefficients"]))
    assert summary["epsilon"] == pytest.approx(_pld_epsilon(2.0 / col, 0.5, 2, 1e-5), rel=1e-3)
    epochs = [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [1]  # an epoch is L = round(N/B̄) steps, not 1/q = 2


def test_amplified_run_checks_rescores_and_refuses_resume(amplified_run):
    runner = CliRunner()
    summary = json.loads((amplified_run / "summary.json").read_text())
    checked = runner.invoke(app, ["check", str(amplified_run)])
    assert checked.exit_code == 0 and "RESULT: PASS" in checked.output
    rescored = runner.invoke(app, ["ledger", str(amplified_run)])
    assert rescored.exit_code == 0 and f"pld: {summary['epsilon']:.5f}" in rescored.output
    resumed = runner.invoke(app, ["train", "--resume", str(amplified_run)])
    assert resumed.exit_code == 2 and "refused" in resumed.output and "Traceback" not in resumed.output


def test_target_epsilon_calibrates_the_amplified_run(tmp_path):
    """--target-epsilon 4: σ = DP-SGD's σ for k = 2 rounds at q = 0.5, times ‖c‖; the run's ε is at most the
    target and within 1 % of it (the calibration's search tolerance), and the check passes."""
    runner = CliRunner()
    run_dir = tmp_path / "run"
    args = BASE + ["--target-epsilon", "4", "--noise-mechanism", "banded:3", "--sampling", "cyclic-poisson"]
    result = runner.invoke(app, args + ["--sample-rate", "0.5", "--out", str(run_dir)])
    assert result.exit_code == 0, result.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.99 * 4 <= summary["epsilon"] <= 4.0 + 1e-9
    assert check_run(run_dir).passed


def _tamper(run_dir, edit) -> None:
    """Apply ``edit`` to the mechanism record of both ledger files (every journal header line: the last one
    holds; and its snapshot ledger.json)."""
    lines = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    for raw in lines:
        if "format" in raw:
            edit(raw["mechanism"])
    (run_dir / "ledger.jsonl").write_text("".join(json.dumps(raw) + "\n" for raw in lines))
    snap = json.loads((run_dir / "ledger.json").read_text())
    edit(snap["mechanism"])
    (run_dir / "ledger.json").write_text(json.dumps(snap))


def test_amplified_blt_run_checks_and_a_tampered_record_fails(tmp_path):
    """BLT over cyclic Poisson sampling (the spectral bound): digits, q = 0.5, σ = 2, L = 6 steps, b' = 3
    parts, k = 2 rounds. ε equals dp_accounting's PLD of 2 sampled Gaussians at σ/√λ_max(UᵀU) recomputed from
    the recorded strategy; `dpopt check` passes the run and fails it once the record's amplified sensitivity
    or a strategy coefficient is edited."""
    import shutil

    from dpopt.accounting.matrix_factorization import strategy_from_record
    from dpopt.accounting.sampled_matrix_mechanism import amplified_sensitivity

    run_dir = tmp_path / "run"
    args = BASE + ["--noise-multiplier", "2", "--noise-mechanism", "blt", "--sampling", "cyclic-poisson"]
    result = CliRunner().invoke(app, args + ["--sample-rate", "0.5", "--out", str(run_dir)])
    assert result.exit_code == 0, result.output
    rec = PrivacyLedger.load(run_dir / "ledger.json").mechanism
    per_epoch, parts = _digits_parts(0.5)
    assert (rec["steps"], rec["min_separation"], rec["amplification"]) == (
        per_epoch,
        parts,
        "cyclic-poisson spectral bound (dpopt.accounting.sampled_matrix_mechanism)",
    )
    s = amplified_sensitivity(strategy_from_record(rec["strategy"]), per_epoch, parts)
    assert rec["amplified_sensitivity"] == pytest.approx(s, rel=1e-12)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epsilon"] == pytest.approx(_pld_epsilon(2.0 / s, 0.5, 2, 1e-5), rel=1e-3)
    assert check_run(run_dir).passed
    for name, edit in (
        ("sensitivity", lambda m: m.update(amplified_sensitivity=m["amplified_sensitivity"] * 0.5)),
        ("coefficient", lambda m: m["strategy"]["omega"].__setitem__(0, m["strategy"]["omega"][0] * 0.5)),
    ):
        bad = tmp_path / name
        shutil.copytree(run_dir, bad)
        _tamper(bad, edit)
        assert not check_run(bad).passed


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--noise-mechanism", "banded:2", "--sampling", "cyclic-poisson"], "needs --sample-rate"),
        (["--noise-mechanism", "banded:2", "--sampling", "cyclic-poisson", "--sample-rate", "0.01"], "is 0 parts"),
        (["--sampling", "cyclic-poisson", "--sample-rate", "0.5"], "correlated noise only"),
        (["--noise-mechanism", "banded:2", "--sampling", "poisson"], "cyclic or cyclic-poisson"),
        (["--noise-mechanism", "banded:2", "--sample-rate", "0.5"], "read only with --sampling cyclic-poisson"),
        (["--noise-mechanism", "banded:4", "--target-epsilon", "1000"], "looser than the smallest noise"),
        (["--noise-mechanism", "blt", "--target-epsilon", "1000"], "choose a smaller --target-epsilon"),
    ],
)
def test_combinations_without_an_accountant_exit_2(tmp_path, extra, needle):
    result = CliRunner().invoke(app, BASE + extra + ["--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / "run" / "ledger.json").exists()


def test_old_format_ledgers_still_pass_dpopt_check(tmp_path, monkeypatch):
    """A BLT run over 5 epochs of cyclic batches (digits, B̄ = 720: 2 batches per epoch, k = 5, b = 2).
    Today's run records ``sensitivity_method: toeplitz-monotone`` (McKenna's exact Δ) and checks. A run as
    dpopt wrote it before the field (the general bound, no field; made here by running with the legacy method
    and deleting the field) still passes `dpopt check`; an edited old record or an unknown method fails it
    (relabelling a ledger whose two methods differ: tests/core/test_correlated_noise_toeplitz.py)."""
    import functools
    import shutil

    from dpopt.correlated_noise import CorrelatedNoise, Participation, sensitivity, strategy_from_record

    args = BASE[:4] + ["5", "--batch-size", "720"] + BASE[7:] + ["--noise-multiplier", "2", "--noise-mechanism", "blt"]
    runner = CliRunner()
    new_dir, old_dir = tmp_path / "new", tmp_path / "old"
    assert runner.invoke(app, args + ["--out", str(new_dir)]).exit_code == 0
    with monkeypatch.context() as m:
        legacy = functools.partialmethod(CorrelatedNoise.__init__, sensitivity_method="general-bound")
        m.setattr(CorrelatedNoise, "__init__", legacy)
        assert runner.invoke(app, args + ["--out", str(old_dir)]).exit_code == 0
    _tamper(old_dir, lambda rec: rec.pop("sensitivity_method"))
    new, old = (PrivacyLedger.load(d / "ledger.json").mechanism for d in (new_dir, old_dir))
    assert new["sensitivity_method"] == "toeplitz-monotone" and "sensitivity_method" not in old
    assert (new["participations"], new["min_separation"]) == (5, 2)
    s = strategy_from_record(new["strategy"])
    p = Participation(new["steps"], new["participations"], new["min_separation"])
    assert new["sensitivity"] == pytest.approx(sensitivity(s, p), rel=1e-12)
    assert old["sensitivity"] == pytest.approx(sensitivity(s, p, "general-bound"), rel=1e-12)
    assert new["sensitivity"] <= old["sensitivity"] * (1 + 1e-12)  # (here Alg. 4 happens to be tight)
    for run_dir in (new_dir, old_dir):
        checked = runner.invoke(app, ["check", str(run_dir)])
        assert checked.exit_code == 0 and "RESULT: PASS" in checked.output, checked.output
    for name, src, edit in (
        ("old-sensitivity", old_dir, lambda rec: rec.update(sensitivity=rec["sensitivity"] * 0.95)),
        ("old-strategy", old_dir, lambda rec: rec["strategy"]["omega"].__setitem__(0, rec["strategy"]["omega"][0] / 2)),
        ("unknown", new_dir, lambda rec: rec.update(sensitivity_method="toeplitz-v9")),
    ):
        bad = tmp_path / name
        shutil.copytree(src, bad)
        _tamper(bad, edit)
        checked = runner.invoke(app, ["check", str(bad)])
        assert checked.exit_code != 0 and "RESULT: PASS" not in checked.output, name


def test_amplification_that_costs_is_warned(tmp_path):
    """`dpopt train` plans the mechanism through the same check as make_private: BLT at q = 0.5, σ = 1 over 6
    steps (3 parts) scores a larger ε than the 6 cyclic batches would; warned, the run still amplified."""
    args = BASE + ["--noise-multiplier", "1", "--noise-mechanism", "blt", "--sampling", "cyclic-poisson"]
    result = CliRunner().invoke(app, args + ["--sample-rate", "0.5", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if "MORE than the unamplified" in ln]  # one line, no traceback
    assert len(lines) == 1 and lines[0].startswith("warning: sampling='cyclic-poisson'"), result.output
    assert "(6 batches)" in lines[0] and "use sampling='cyclic'" in lines[0]
    assert PrivacyLedger.load(tmp_path / "run" / "ledger.json").mechanism["sample_rate"] == 0.5


def test_ledger_lists_no_op_steps_as_no_op(amplified_run):
    """`dpopt ledger` on the amplified run: steps 1-2 and 4-5 (t mod b' ≠ 0) recorded NoOpDpEvents; they read
    "no added cost: charged in advance" (their batches are used; no "sensitivity" on them), never a blank σ
    ("sigma =  -> sigma_eff = ") nor "q = 1 (no sampling)"; the header names the mechanism (banded:2, σ = 2, Δ)
    and --json flags the no-op groups."""
    out = CliRunner().invoke(app, ["ledger", str(amplified_run)])
    assert out.exit_code == 0, out.output
    rows = [line.strip() for line in out.output.splitlines() if line.startswith("  step")]
    assert rows[1] == "steps 1-2 (2x): no-op, no added cost: charged in advance by the earlier releases"
    assert rows[3] == "steps 4-5 (2x): no-op, no added cost: charged in advance by the earlier releases"
    assert rows[0].startswith("step 0 (1x): q = 0.5, Gaussians sigma = ") and "sigma_eff = 1.79781" in rows[0]
    assert "sigma =  ->" not in out.output and out.output.count("no sampling") == 0
    record = PrivacyLedger.load(amplified_run / "ledger.json").mechanism
    header = [line for line in out.output.splitlines() if line.startswith("mechanism ")]
    assert header == [
        f"mechanism banded:2 (2 bands), sigma = 2, Delta = {record['sensitivity']:.6g}, q = 0.5; "
        "each round of b' steps charges one Poisson-sampled Gaussian at sigma / (the per-round sensitivity: a "
        "column norm, or sqrt(lambda_max) of a part's columns); its other steps are no-ops"
    ]
    data = json.loads(CliRunner().invoke(app, ["ledger", str(amplified_run), "--json"]).output)
    assert [r["no_op"] for r in data["runs"][:4]] == [False, True, False, True]
    assert data["mechanism"] == {
        "kind": "banded",
        "bands": 2,
        "noise_multiplier": 2.0,
        "sensitivity": record["sensitivity"],
        "sample_rate": 0.5,
    }


def test_cyclic_horizon_is_epochs_times_batches(tmp_path):
    """digits (N = 1437), B̄ = 64: b = round(1437/64) = 22 cyclic batches, 2 epochs are T = 44 steps
    (not round(2 · 1437/64) = 45, which would charge k = 3 participations); k = 2, 22 apart. The summary's
    expected_batch_size is N/b = 1437/22 (the divisor used), and it records no sample_rate (nothing is sampled)."""
    run_dir = tmp_path / "run"
    args = ["train", "--dataset", "digits", "--epochs", "2", "--batch-size", "64", "--method", "dp-sgd"]
    args += ["--noise-multiplier", "2", "--noise-mechanism", "banded:2", "--out", str(run_dir)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rec = PrivacyLedger.load(run_dir / "ledger.json").mechanism
    assert (rec["steps"], rec["participations"], rec["min_separation"]) == (44, 2, 22)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 44
    assert summary["expected_batch_size"] == pytest.approx(1437 / 22, rel=1e-12)
    assert summary.get("sample_rate") is None
    assert check_run(run_dir).passed


def test_cyclic_poisson_summary_records_the_divisor_used(amplified_run):
    """q = 0.5, b' = 3 parts of digits: expected batch q·N/b' = 0.5 · 1437 / 3, and q is recorded."""
    summary = json.loads((amplified_run / "summary.json").read_text())
    assert summary["expected_batch_size"] == pytest.approx(0.5 * 1437 / 3, rel=1e-12)
    assert summary["sample_rate"] == 0.5
