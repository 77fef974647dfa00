"""Runs that survive interruption (issue 10): SIGINT/SIGTERM stop cleanly, resume continues exactly.

Signals go to a real process (subprocess) where the done-when asks for it; the clip-state carry-over of
quantile clipping and DP-MacAdam is tested in-process (the signal sent to this process from on_step).
"""

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from typer.testing import CliRunner

from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.ledger_check import check_run
from dpopt.cli import app
from dpopt.training import TrainConfig, resume, train

ARGS = ["--method", "dp-sgd", "--epochs", "6", "--threads", "1", "--checkpoint-every", "5", "--accountant", "rdp"]


def _start(out, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "dpopt", "train", *ARGS, "--out", str(out), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _interrupt(proc, out, sig):
    deadline = time.time() + 300  # a hang guard only (a loaded machine can take minutes to start)
    while not (out / "checkpoint.pt").exists():  # the run is under way
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    return proc.returncode, stdout, stderr


def _account(out):
    s = json.loads((out / "summary.json").read_text())
    res = CliRunner().invoke(
        app,
        [
            "account",
            "--noise-multiplier",
            str(s["noise_multiplier"]),
            "--sample-rate",
            str(s["sample_rate"]),
            "--steps",
            str(s["steps"]),
            "--accountant",
            "rdp",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])["epsilon"]


def test_sigint_stops_cleanly_and_resume_completes(tmp_path):
    out = tmp_path / "run"
    code, stdout, stderr = _interrupt(_start(out), out, signal.SIGINT)
    assert code == 130, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["stop_signal"] == "SIGINT"
    done, planned = summary["steps"], summary["planned_steps"]
    assert 5 <= done < planned
    assert len(PrivacyLedger.load(out)) == len(PrivacyLedger.load(out / "ledger.json")) == done
    assert check_run(out).passed, (out / "check.txt").read_text()
    assert "--resume" in stdout
    res = subprocess.run(
        [sys.executable, "-m", "dpopt", "train", "--resume", str(out), "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    final = json.loads((out / "summary.json").read_text())
    assert final["status"] == "completed" and "stop_signal" not in final
    assert final["steps"] == final["planned_steps"] == planned == len(PrivacyLedger.load(out))
    assert [e.step for e in PrivacyLedger.load(out).entries] == list(range(planned))
    assert final["epsilon"] == pytest.approx(_account(out), rel=1e-9)
    assert check_run(out).passed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows if "status" not in r] == list(range(1, 7))


def test_sigterm_with_reproducible_noise_resumes_to_the_uninterrupted_parameters(tmp_path):
    full, out = tmp_path / "full", tmp_path / "part"
    ref = subprocess.run(
        [sys.executable, "-m", "dpopt", "train", *ARGS, "--reproducible-noise", "--out", str(full)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ref.returncode == 3, ref.stderr  # finished, but reproducible noise fails the ledger check
    code, _, stderr = _interrupt(_start(out, "--reproducible-noise"), out, signal.SIGTERM)
    assert code == 143, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["stop_signal"] == "SIGTERM"
    assert len(PrivacyLedger.load(out)) == summary["steps"] < summary["planned_steps"]
    assert check_run(out).failures == ["noise_source"]  # reproducible noise fails the check, as always
    res = subprocess.run(
        [sys.executable, "-m", "dpopt", "train", "--resume", str(out), "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 3, res.stderr  # completed; the check still fails (reproducible noise)
    a, b = torch.load(full / "model.pt"), torch.load(out / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (
        json.loads((out / "summary.json").read_text())["epsilon"]
        == json.loads((full / "summary.json").read_text())["epsilon"]
    )


@pytest.mark.parametrize("method, clipping", [("dp-sgd", "quantile"), ("dp-macadam", "flat")])
def test_clip_state_carries_over(tmp_path, method, clipping):
    kw = dict(method=method, clipping=clipping, epochs=1.0, seed=2, reproducible_noise=True, accountant="rdp")
    warnings.simplefilter("ignore", UserWarning)
    full = train(TrainConfig(out=str(tmp_path / "full"), **kw))

    def interrupt(info):
        if info["step"] == 9:
            os.kill(os.getpid(), signal.SIGINT)

    part = train(TrainConfig(out=str(tmp_path / "part"), **kw), on_step=interrupt)
    assert part["status"] == "interrupted" and part["steps"] == 9
    ckpt = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=False)
    assert ckpt["privatizer"]["steps"] == 9 and "noise_state" in ckpt["privatizer"]
    if clipping == "quantile":
        assert len(ckpt["privatizer"]["clip_history"]) == 9 and ckpt["privatizer"]["bounds"][0] != 1.0
    else:  # MacAdam's geometry (centre and scale) is in the transform state
        state = ckpt["optimizer"]["state"][0]["0.macadam"]
        assert state["step"] == 9 and {"center", "exp_avg", "exp_avg_sq"} <= set(state)
    done = resume(tmp_path / "part")
    assert done["steps"] == full["steps"] and done["epsilon"] == full["epsilon"]
    assert done.get("final_max_grad_norm") == full.get("final_max_grad_norm")
    a, b = torch.load(tmp_path / "full" / "model.pt"), torch.load(tmp_path / "part" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_secret_noise_state_is_never_saved_and_resume_reseeds(tmp_path):
    def interrupt(info):
        if info["step"] == 4:
            os.kill(os.getpid(), signal.SIGINT)

    s = train(TrainConfig(method="dp-sgd", epochs=0.5, accountant="rdp", out=str(tmp_path / "r")), on_step=interrupt)
    assert s["status"] == "interrupted"
    ckpt = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=False)
    assert "noise_state" not in ckpt["privatizer"] and "noise_state" not in ckpt["sampler"]
    text = repr(ckpt)
    assert "seed" not in json.dumps(ckpt["privatizer"]) and "batch" not in json.dumps(ckpt["loop"])
    assert "nonfinite" not in text
    done = resume(tmp_path / "r")
    assert done["steps"] == done["resumed_from_step"] + (done["steps"] - 4) and check_run(tmp_path / "r").passed


def test_killed_run_keeps_releases_after_the_checkpoint(tmp_path):
    """SIGKILL after a flush: releases journaled after the checkpoint stay charged on resume."""
    out = tmp_path / "r"
    train(TrainConfig(method="dp-sgd", epochs=0.4, accountant="rdp", checkpoint_every=3, out=str(out)))
    ledger = PrivacyLedger.load(out)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    # make it look like a run killed at step 5 whose last checkpoint was at step 3, mid-way through a flush
    ckpt["step"], ckpt["ledger_length"] = 3, 3
    ckpt["loop"]["step"], ckpt["sampler"]["position"], ckpt["privatizer"]["steps"] = 3, 3, 3
    ckpt["privatizer"]["reads"] = ckpt["privatizer"]["releases"] = 3
    ckpt["privatizer"]["ledger_length"] = 3  # a state saved after 3 releases says so (Privatizer.load_state_dict)
    ckpt["loop"]["metrics"] = []
    torch.save(ckpt, out / "checkpoint.pt")
    lines = (out / "ledger.jsonl").read_text().splitlines()
    (out / "ledger.jsonl").write_text("\n".join(lines[:6]) + "\n" + lines[6][:20])  # header + 5 entries + torn
    with pytest.warns(UserWarning):
        done = resume(out)
    assert done["lost_steps"] == 2 and done["steps"] == len(ledger) + 2 == len(PrivacyLedger.load(out))
    assert check_run(out).passed


def test_overwrite_clears_the_old_run_first(tmp_path):
    out = tmp_path / "r"
    train(TrainConfig(method="dp-sgd", epochs=0.3, accountant="rdp", out=str(out)))
    (out / "stale.txt").write_text("not a run file")
    old = (out / "ledger.jsonl").read_text()

    def interrupt(info):
        os.kill(os.getpid(), signal.SIGINT)

    charged = len(PrivacyLedger.load(out / "ledger.jsonl"))
    with pytest.warns(
        UserWarning, match=rf"overwrite: .* held {charged} charged release\(s\).* kept as ledger-replaced-"
    ):
        s = train(
            TrainConfig(method="dp-sgd", epochs=0.3, accountant="rdp", out=str(out), overwrite=True), on_step=interrupt
        )
    assert s["steps"] == 1 and len(PrivacyLedger.load(out)) == 1 and (out / "ledger.jsonl").read_text() != old
    assert (out / "stale.txt").exists()  # only run files are removed
    (aside,) = out.glob("ledger-replaced-*.jsonl")  # the earlier run's charged releases are never deleted
    assert aside.read_text() == old and charged > 0
    assert check_run(out).passed


def test_piped_output_is_plain_and_not_wrapped(tmp_path):
    out = tmp_path / ("a-very-long-directory-name-" * 4)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpopt",
            "train",
            "--method",
            "dp-sgd",
            "--epochs",
            "2",
            "--accountant",
            "rdp",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert f"run directory: {out}" in res.stdout
    epoch_lines = [line for line in res.stderr.splitlines() if line.startswith("step ")]
    assert len(epoch_lines) == 2 and "ε" in epoch_lines[0]


def test_resume_refuses_flags_typed_at_their_default_value(tmp_path):
    """--epochs 10 is the default: a value comparison let `--resume DIR --epochs 10` through silently."""
    cfg = TrainConfig(
        dataset="digits", method="dp-sgd", epochs=0.3, accountant="rdp", out=str(tmp_path / "r"), checkpoint_every=2
    )
    train(cfg)
    for extra in (["--epochs", "10"], ["--seed", "0"], ["--method", "dp-macadam"], ["--epochs", "3"]):
        res = CliRunner().invoke(app, ["train", "--resume", str(tmp_path / "r"), *extra])
        assert res.exit_code != 0 and "do not give " + extra[0] in res.output, (extra, res.output)


def test_resuming_a_completed_run_leaves_its_files_alone(tmp_path):
    out = tmp_path / "done"
    train(
        TrainConfig(dataset="digits", method="dp-sgd", epochs=0.3, accountant="rdp", out=str(out), checkpoint_every=2)
    )
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.warns(UserWarning, match="already complete"):
        summary = resume(out)
    assert summary == json.loads(before["summary.json"])
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before
    res = CliRunner().invoke(app, ["train", "--resume", str(out)])  # the CLI says so in a note, not a warning
    text = " ".join(res.output.split())
    assert res.exit_code == 0 and "is already complete" in text and "nothing was trained" in text
    assert "UserWarning" not in text
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_resume_hint_names_torchrun_for_multi_process_runs():
    from dpopt.cli.train import _resume_command

    assert _resume_command({"run_dir": "runs/x"}) == "dpopt train --resume runs/x"
    assert _resume_command({"run_dir": "runs/x", "world_size": 1}) == "dpopt train --resume runs/x"
    assert (
        _resume_command({"run_dir": "runs/x", "world_size": 2})
        == "torchrun --standalone --nproc_per_node 2 -m dpopt train --resume runs/x"
    )


def test_ema_state_and_ledger_carry_over(tmp_path):
    """--ema-decay: the checkpoint holds the averager (its step = the ledger's length); resumed = uninterrupted."""
    kw = dict(method="dp-sgd", epochs=1.0, seed=4, reproducible_noise=True, accountant="rdp", ema_decay=0.9)
    warnings.simplefilter("ignore", UserWarning)
    full = train(TrainConfig(out=str(tmp_path / "full"), **kw))

    def interrupt(info):
        if info["step"] == 7:
            os.kill(os.getpid(), signal.SIGINT)

    part = train(TrainConfig(out=str(tmp_path / "part"), **kw), on_step=interrupt)
    assert part["status"] == "interrupted" and part["steps"] == 7
    ckpt = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=False)
    assert ckpt["averager"]["step"] == 7 == ckpt["ledger_length"] == len(PrivacyLedger.load(tmp_path / "part"))
    done = resume(tmp_path / "part")
    assert done["steps"] == full["steps"] and done["epsilon"] == full["epsilon"]
    assert done["ema_test_accuracy"] == full["ema_test_accuracy"]
    for name in ("model.pt", "model_ema.pt"):
        a, b = torch.load(tmp_path / "full" / name), torch.load(tmp_path / "part" / name)
        assert all(torch.equal(a[k], b[k]) for k in a)
