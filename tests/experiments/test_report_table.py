"""`dpopt report` on a fixture results JSONL: the table's values, bold best, ε row, CSV; plots and curves.png."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dpopt.cli import app
from dpopt.experiments.report import summarize, write_report
from dpopt.reports.curves import write_curves

# (method, σ, seed, test accuracy); ε depends on σ only
ACC = [
    ("dp-sgd", 0.5, 0, 0.80),
    ("dp-sgd", 0.5, 1, 0.84),
    ("dp-sgd", 1.0, 0, 0.70),
    ("dp-sgd", 1.0, 1, 0.74),
    ("dp-adam", 0.5, 0, 0.90),
    ("dp-adam", 0.5, 1, 0.86),
    ("dp-adam", 1.0, 0, 0.60),
    ("dp-adam", 1.0, 1, 0.70),
]
EPS = {0.5: 5.0, 1.0: 1.25}


def _fixture(tmp_path: Path) -> Path:
    path = tmp_path / "results.jsonl"
    with open(path, "w") as fh:
        for i, (m, s, seed, acc) in enumerate(ACC):
            run = tmp_path / f"run{i}"
            run.mkdir()
            rows = [
                {
                    "epoch": e,
                    "step": 10 * e,
                    "test_accuracy": acc * e / 2,
                    "test_loss": 2.0 / e,
                    "epsilon": EPS[s] * e / 2,
                }
                for e in (1, 2)
            ]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            fh.write(
                json.dumps(
                    {
                        "method": m,
                        "noise_multiplier": s,
                        "seed": seed,
                        "test_accuracy": acc,
                        "epsilon": EPS[s],
                        "expected_batch_size": 256.0,
                        "run_dir": str(run),
                        "label": m,
                        "point": {"noise_multiplier": s, "seed": seed, "label": m},
                    }
                )
                + "\n"
            )
        fh.write('{"torn line')  # a killed writer's last line is ignored
    return path


def test_table_values(tmp_path):
    done = write_report(_fixture(tmp_path), tmp_path / "out")
    table = done["table"]
    assert table.rows == ["dp-sgd", "dp-adam"] and table.cols == [0.5, 1.0]
    assert table.cells[("dp-sgd", 0.5)].mean == pytest.approx(0.82)
    assert table.cells[("dp-sgd", 0.5)].std == pytest.approx(0.0282842712, rel=1e-8)  # sample std of 0.80, 0.84
    assert table.cells[("dp-adam", 1.0)].mean == pytest.approx(0.65)
    assert table.cells[("dp-adam", 1.0)].std == pytest.approx(0.0707106781, rel=1e-8)
    assert table.best(0.5) == "dp-adam" and table.best(1.0) == "dp-sgd"
    md = (tmp_path / "out" / "table.md").read_text().splitlines()
    assert md[0] == "| label | σ = 0.5 | σ = 1.0 |"
    assert md[2] == "| ε | 5.000 | 1.250 |"
    assert md[3] == "| dp-sgd | 0.8200 ± 0.0283 | **0.7200 ± 0.0283** |"
    assert md[4] == "| dp-adam | **0.8800 ± 0.0283** | 0.6500 ± 0.0707 |"
    with open(tmp_path / "out" / "table.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 4
    adam05 = [r for r in rows if r["label"] == "dp-adam" and r["noise_multiplier"] == "0.5"][0]
    assert float(adam05["test_accuracy_mean"]) == pytest.approx(0.88) and adam05["n"] == "2"
    assert float(adam05["epsilon"]) == 5.0 and adam05["best"] == "1"
    names = {p.name for p in done["files"]}
    assert {"test_accuracy_vs_noise_multiplier.png", "test_accuracy_vs_epsilon.png", "curves_by_epoch.png"} <= names
    assert "test_accuracy_vs_expected_batch_size.png" not in names  # one batch size only


def test_loss_metric_bolds_the_lowest(tmp_path):
    recs = [
        {"label": "a", "noise_multiplier": 1.0, "test_loss": 1.0, "epsilon": 1.0},
        {"label": "b", "noise_multiplier": 1.0, "test_loss": 0.5, "epsilon": 1.0},
    ]
    assert summarize(recs, metric="test_loss").best(1.0) == "b"


def test_report_cli(tmp_path):
    res = CliRunner().invoke(
        app,
        [
            "report",
            str(_fixture(tmp_path)),
            "--out",
            str(tmp_path / "o"),
            "--rows",
            "method",
            "--where",
            "seed=0",
            "--no-plots",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "| dp-sgd | 0.8000 | **0.7000** |" in res.output  # one run per cell: no ± shown
    assert not list((tmp_path / "o").glob("*.png"))
    bad = CliRunner().invoke(app, ["report", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")])
    assert bad.exit_code == 2


def test_write_curves(tmp_path):
    rows = [
        {"epoch": e, "step": 5 * e, "test_accuracy": 0.1 * e, "test_loss": 1.0 / e, "epsilon": 0.3 * e}
        for e in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = write_curves(tmp_path)
    assert path == tmp_path / "curves.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_curves(tmp_path / "nothing") is None
