"""`dpopt sweep`: grids from TOML, a killed sweep resumes and skips its finished runs, run dirs get curves.png."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpopt.errors import ConfigError
from dpopt.experiments.sweep import load_sweep, parse_sweep, read_results, run_sweep

CONFIG = """
[sweep]
threads = 1
[base]
dataset = "digits"
batch_size = 64
epochs = {epochs}
[grid]
noise_multiplier = [1.0, 2.0]
seed = [0, 1]
[[variant]]
method = ["dp-sgd", "dp-adam"]
[[variant]]
method = "dp-macadam"
hparams = {{ variance_update = "unbiased" }}
label = "macadam-unbiased"
"""


def _write(tmp_path: Path, epochs: float = 1.0) -> Path:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(CONFIG.format(epochs=epochs))
    return cfg


def test_grid_points_and_labels(tmp_path):
    sweep = load_sweep(_write(tmp_path), out=tmp_path / "out")
    assert len(sweep.points) == 12  # (2 methods + 1 variant) × 2 σ × 2 seeds
    labels = [p.label for p in sweep.points]
    assert labels.count("macadam-unbiased") == 4 and labels.count("dp-sgd") == 4
    unb = [p for p in sweep.points if p.label == "macadam-unbiased"][0]
    assert unb.options["hparams"] == {"variance_update": "unbiased"} and unb.options["method"] == "dp-macadam"
    assert len({p.run_id for p in sweep.points}) == 12
    assert sweep.results == tmp_path / "out" / "results.jsonl"
    assert load_sweep(_write(tmp_path), out=tmp_path / "out").points == sweep.points  # stable identities


def test_data_dir_override_keeps_run_identities(tmp_path):
    """--data-dir replaces where the data is read from, not what a run is: finished runs stay recognised."""
    cfg = tmp_path / "dd.toml"
    cfg.write_text(
        CONFIG.format(epochs=1.0).replace('dataset = "digits"', 'dataset = "digits"\ndata_dir = "../shared/data"')
    )
    plain = load_sweep(cfg, out=tmp_path / "out")
    moved = load_sweep(cfg, out=tmp_path / "out", data_dir=str(tmp_path))
    assert [p.run_id for p in moved.points] == [p.run_id for p in plain.points]
    assert {p.options["data_dir"] for p in plain.points} == {"../shared/data"}
    assert {p.options["data_dir"] for p in moved.points} == {str(tmp_path)}


def test_unknown_option_refused():
    with pytest.raises(ConfigError, match="noise_multipler"):
        parse_sweep({"grid": {"noise_multipler": [1.0]}})
    with pytest.raises(ConfigError, match="out"):
        parse_sweep({"base": {"out": "x"}})


def _sweep_cmd(cfg: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "dpopt", "sweep", str(cfg), "--out", str(out)]


@pytest.mark.slow
def test_killed_sweep_resumes_and_skips_finished_runs(tmp_path):
    cfg, out = _write(tmp_path, epochs=1.0), tmp_path / "out"
    results = out / "results.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(_sweep_cmd(cfg, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(read_results(results)) < 2 and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    first = read_results(results)
    assert 2 <= len(first) < 12, "the sweep was to be killed part-way"
    done_before = {r["run_id"] for r in first}
    mtimes = {r["run_id"]: Path(r["run_dir"], "summary.json").stat().st_mtime for r in first}

    again = subprocess.run(_sweep_cmd(cfg, out), capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"{len(first)} already finished" in again.stderr
    assert f"{len(first)} skipped as already finished, of 12" in again.stdout
    records = read_results(results)
    ids = [r["run_id"] for r in records]
    assert len(ids) == 12 and len(set(ids)) == 12  # every run once: nothing finished was run again
    assert [r["run_id"] for r in records[: len(first)]] == [r["run_id"] for r in first]
    for r in records:
        if r["run_id"] in done_before:  # not retrained
            assert Path(r["run_dir"], "summary.json").stat().st_mtime == mtimes[r["run_id"]]
        assert (Path(r["run_dir"]) / "curves.png").is_file()
        summary = json.loads(Path(r["run_dir"], "summary.json").read_text())
        assert {k: r[k] for k in summary} == summary  # the record is the run's public summary ...
        assert r["point"]["label"] == r["label"] and "noise_multiplier" in r["point"]  # ... plus the grid point
        assert r["noise"] == "secret"  # seeds fix initialisation only

    third = run_sweep(load_sweep(cfg, out=out))
    assert third == {"total": 12, "skipped": 12, "ran": 0, "interrupted": False}


@pytest.mark.slow
def test_interrupted_run_is_resumed_from_its_checkpoint(tmp_path):
    """SIGINT stops the in-progress run cleanly (checkpoint written, exit 130); the rerun continues it."""
    cfg = tmp_path / "one.toml"
    cfg.write_text(
        '[sweep]\nthreads = 1\n[base]\ndataset = "digits"\nmethod = "dp-sgd"\nbatch_size = 32\n'
        "epochs = 40\n[grid]\nseed = [0]\n"
    )
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(_sweep_cmd(cfg, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and not list(out.glob("runs/*/checkpoint.pt")):
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, proc.stderr.read()
    assert read_results(out / "results.jsonl") == []
    again = subprocess.run(_sweep_cmd(cfg, out), capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    (record,) = read_results(out / "results.jsonl")
    assert record["resumed_from_step"] > 0 and record["status"] == "completed"
    assert record["steps"] >= round(40 / (32 / 1437))  # planned steps reached (lost steps stay charged)
