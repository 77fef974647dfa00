"""What the commands write (issue 19, item 5): strict JSON everywhere, exit code 3 when a finished run's
ledger check fails, and `dpopt diagnose` never writing into a run directory."""

import json
import math

import pytest
from typer.testing import CliRunner

from dpopt.cli import app
from dpopt.cli.common import EXIT_CHECK_FAILED
from dpopt.jsonio import dumps, json_safe, loads

runner = CliRunner()


def strict(text: str):
    """json.loads that refuses Infinity/NaN (what jq, JSON.parse or serde do)."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_jsonio_writes_strings_and_reads_them_back():
    doc = {
        "epsilon": math.inf,
        "low": -math.inf,
        "loss": math.nan,
        "rows": [1.5, (2.0, math.inf)],
        "n": 3,
        "name": "dp-sgd",
        "none": None,
    }
    text = dumps(doc)
    assert strict(text) == {
        "epsilon": "inf",
        "low": "-inf",
        "loss": "nan",
        "rows": [1.5, [2.0, "inf"]],
        "n": 3,
        "name": "dp-sgd",
        "none": None,
    }
    back = loads(text)
    assert back["epsilon"] == math.inf and back["low"] == -math.inf and math.isnan(back["loss"])
    assert back["rows"] == [1.5, [2.0, math.inf]] and back["name"] == "dp-sgd" and back["none"] is None
    assert loads('{"epsilon": Infinity}')["epsilon"] == math.inf  # files written before the convention
    assert json_safe(2.5) == 2.5 and json_safe(-math.inf) == "-inf"
    # a default hook's non-finite result is converted too; other objects still need a default
    assert strict(dumps({"x": object()}, default=lambda o: math.inf)) == {"x": "inf"}
    with pytest.raises(TypeError):
        dumps({"x": object()})


def test_sigma_zero_run_writes_strict_json_and_exits_3(tmp_path):
    """σ = 0: ε = inf. Every JSON output parses strictly; the ledger check fails, so the command exits 3
    with every file written; `dpopt check` exits 1 on the same run; resume of the finished run reads it."""
    out = tmp_path / "run"
    res = runner.invoke(
        app,
        [
            "train",
            "--method",
            "dp-sgd",
            "--epochs",
            "0.1",
            "--noise-multiplier",
            "0",
            "--accountant",
            "rdp",
            "--out",
            str(out),
            "--json",
        ],
    )
    assert res.exit_code == EXIT_CHECK_FAILED == 3, res.output
    assert "ledger check failed" in res.stderr and "check.txt" in res.stderr
    line = strict(res.stdout.strip().splitlines()[-1])
    assert line["epsilon"] == "inf" and line["check"].startswith("FAIL")
    summary = strict((out / "summary.json").read_text())
    assert summary["epsilon"] == "inf" and summary["noise_multiplier"] == 0
    for row in (out / "metrics.jsonl").read_text().splitlines():
        assert strict(row)["epsilon"] == "inf"
    strict((out / "config.json").read_text())
    for name in ("ledger.json", "model.pt", "check.txt", "summary.json"):
        assert (out / name).is_file(), name
    check = runner.invoke(app, ["check", str(out), "--json"])
    assert check.exit_code == 1 and strict(check.stdout)["passed"] is False
    ledger = runner.invoke(app, ["ledger", str(out), "--json"])
    assert ledger.exit_code == 0 and strict(ledger.stdout)["epsilon"] == "inf"
    assert strict(ledger.stdout)["epsilon_summary"] == math.inf or strict(ledger.stdout)["epsilon_summary"] == "inf"

    from dpopt.training.results import finished_summary

    done = finished_summary(out)  # the reader resume and the sweep use: "inf" comes back as a float
    assert done is not None and done["epsilon"] == math.inf


def test_a_run_that_passes_its_check_exits_0(tmp_path):
    res = runner.invoke(
        app,
        [
            "train",
            "--method",
            "dp-sgd",
            "--epochs",
            "0.1",
            "--accountant",
            "rdp",
            "--out",
            str(tmp_path / "ok"),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    assert strict(res.stdout.strip().splitlines()[-1])["check"] == "pass"


def test_train_help_names_exit_code_3_and_the_json_convention():
    res = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    text = " ".join(res.stdout.split())
    assert "Exit code 3" in text and "ledger check FAILED" in text
    assert '"inf"' in text


def test_account_json_infinity_is_a_string():
    res = runner.invoke(app, ["account", "--noise-multiplier", "0", "--sample-rate", "0.01", "--steps", "10", "--json"])
    assert res.exit_code == 0 and strict(res.stdout)["epsilon"] == "inf"


# --------------------------------------------------------------------------- diagnose
DIAG = [
    "diagnose",
    "--dataset",
    "digits",
    "--noise-multiplier",
    "1",
    "--batch-sizes",
    "64",
    "--examples",
    "32",
    "--trials",
    "2",
    "--curve-points",
    "2",
]


@pytest.mark.parametrize("marker", ["ledger.json", "summary.json", "model.pt", "privacy_ledger.json"])
def test_diagnose_refuses_a_run_directory_and_writes_nothing(tmp_path, marker):
    run = tmp_path / "run"
    run.mkdir()
    (run / marker).write_text("{}")
    before = sorted(p.name for p in run.iterdir())
    for out in (run, run / "diag"):  # the run directory itself, or a folder inside it
        res = runner.invoke(app, DIAG + ["--out", str(out)])
        assert res.exit_code == 2, res.output
        assert res.output.startswith("error: --out") and marker in res.output and "run's directory" in res.output
        assert "NON-PRIVATE" not in res.output  # refused before anything was computed
    assert sorted(p.name for p in run.iterdir()) == before and not (run / "diag").exists()


def test_diagnose_markdown_opens_with_a_visible_heading(tmp_path):
    out = tmp_path / "diag"
    res = runner.invoke(app, DIAG + ["--out", str(out)])
    assert res.exit_code == 0, res.output
    for name in ("recovery.md", "snr.md", "cosines.md"):
        text = (out / name).read_text()
        assert text.startswith("# NON-PRIVATE") and "<!--" not in text
        assert "WITHOUT noise" in text.split("\n\n")[1]
    doc = strict((out / "diagnostics.json").read_text())
    assert doc["notice"].startswith("NON-PRIVATE")


def test_sweep_records_are_strict_and_read_back_as_floats(tmp_path):
    """The sweep's results.jsonl (written by dpopt sweep, read by sweep resume and dpopt report)."""
    from dpopt.experiments import sweep as sw

    path = tmp_path / "results.jsonl"
    sw._append(path, {"run_id": "x", "epsilon": math.inf, "test_loss": math.nan, "test_accuracy": 0.5})
    line = path.read_text().strip()
    assert strict(line)["epsilon"] == "inf" and strict(line)["test_loss"] == "nan"
    (record,) = sw.read_results(path)
    assert record["epsilon"] == math.inf and math.isnan(record["test_loss"]) and record["test_accuracy"] == 0.5


# --------------------------------------------------------------------------- check on a DPTrainer checkpoint
def _engine_checkpoint(folder, sigma=1.0):
    """A checkpoint directory as DPTrainer writes it: privacy_ledger.json + privacy_summary.json of a PrivacyEngine."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import dpopt

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8)
    engine = dpopt.PrivacyEngine()
    model, opt, data = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=data,
        noise_multiplier=sigma,
        max_grad_norm=1.0,
    )
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    folder.mkdir()
    engine.ledger.save(folder / "privacy_ledger.json")
    (folder / "privacy_summary.json").write_text(dumps(engine.summary(1e-5)))
    return engine


def test_check_reads_a_dptrainer_checkpoint_directory(tmp_path):
    ckpt = tmp_path / "checkpoint-4"
    engine = _engine_checkpoint(ckpt)
    res = runner.invoke(app, ["check", str(ckpt)])
    assert res.exit_code == 0, res.output
    assert f"{len(engine.ledger)} ledger entries" in res.output
    claims = loads((ckpt / "privacy_summary.json").read_text())
    claims["epsilon"] = claims["epsilon"] / 2  # an under-reported epsilon beside the same ledger fails
    (ckpt / "privacy_summary.json").write_text(dumps(claims))
    res = runner.invoke(app, ["check", str(ckpt)])
    assert res.exit_code == 1 and "under-reported" in res.output
