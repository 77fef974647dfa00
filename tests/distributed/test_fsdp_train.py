"""``torchrun -m dpopt train --fsdp`` (dpopt.fsdp_train) on 2 gloo processes against the one-process ``dpopt train``.

* The real command under ``torchrun --standalone --nproc_per_node 2`` (``python -m torch.distributed.run``)
  completes: DP-SGD on digits, B̄ = 256 (6 steps), micro-batches of 50 (the ranks' chunk counts differ
  from step to step: each runs the agreed number of passes), reproducible noise (so exit code 3: the
  ledger check fails ``noise_source`` by design, every file written).
* Its ledger is the one-process run's, entry for entry (step, event, metadata), its metrics rows
  (``--log-every 2`` and the epoch: ε, test loss) are the one-process run's, and its parameters
  (``model.pt``, gathered from the shards into a plain state dict) equal the one-process run's to
  rtol 1e-4 / atol 1e-5 (float32 sums in another order; seen: 7e-9), the test accuracy too.
* Correlated noise (issue 36), ``dpopt train --fsdp --noise-mechanism ...`` under torchrun (a script that fixes
  the public partition seed, ``secrets.randbits``, then runs the ``dpopt`` command line): with
  ``banded:2 --sampling cyclic-poisson --sample-rate 0.5`` (b' = 3 parts, T = 6) and reproducible noise the
  ledger (its ``mechanism`` header and every entry) and ε are the one-process ``dpopt train`` run's, and the
  parameters equal its parameters to rtol 1e-4 / atol 1e-5 (each rank samples its slice of the step's part and
  streams its shard's noise; noise on both ranks, or a rank sampling the whole part, moves them by ~σC·lr/B̄);
  with ``blt:2`` (cyclic batches) and secret noise the run's ``dpopt check`` passes and the ledger header
  records the mechanism.
* Refusals (in-process, no spawn): methods whose geometry or transform is not sharded, non-flat
  clipping, LoRA, and one process (no torchrun).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from dpopt.errors import ConfigError
from dpopt.fsdp_train import check_fsdp_config, train_fsdp
from dpopt.models import build_model
from dpopt.training import TrainConfig, train

pytestmark = pytest.mark.slow  # two torchrun ranks: ~25 s on a loaded 2-core machine (imports)

FLAGS = dict(
    dataset="digits",
    method="dp-sgd",
    batch_size=256,
    epochs=1.0,
    seed=3,
    physical_batch_size=50,
    reproducible_noise=True,
    log_every=2,
)


def _cli_flags(out) -> list:
    return [
        "train",
        "--fsdp",
        "--method",
        "dp-sgd",
        "--dataset",
        "digits",
        "--batch-size",
        "256",
        "--epochs",
        "1",
        "--seed",
        "3",
        "--physical-batch-size",
        "50",
        "--reproducible-noise",
        "--log-every",
        "2",
        "--out",
        str(out),
        "--json",
    ]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-train") / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "dpopt",
        *_cli_flags(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=out.parent)
    summary_path = out / "summary.json"
    assert summary_path.exists(), f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return out, proc


def test_torchrun_fsdp_train_completes(fsdp_run):
    out, proc = fsdp_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["fsdp"] is True and summary["steps"] == 6
    assert summary["check"] == "FAIL: noise_source"  # reproducible noise: exit 3 by design, files complete
    assert json.loads(proc.stdout.strip().splitlines()[-1])["run_dir"] == str(out)  # rank 0 printed once
    assert proc.stdout.count('"ledger_run_id"') == 1
    for name in ("config.json", "metrics.jsonl", "ledger.json", "model.pt", "check.txt"):
        assert (out / name).exists(), name
    assert not (out / "checkpoint.pt").exists()  # no sharded checkpoint (documented)


def test_ledger_and_parameters_equal_one_process(fsdp_run, tmp_path):
    out, _ = fsdp_run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        single = train(TrainConfig(**FLAGS, out=str(tmp_path / "one"), checkpoint_every=0))
    one = tmp_path / "one"
    a, b = (json.loads((d / "ledger.json").read_text())["entries"] for d in (out, one))
    assert len(a) == len(b) == 6
    assert [(e["step"], e["event"], e["meta"]) for e in a] == [(e["step"], e["event"], e["meta"]) for e in b]
    sharded, plain = torch.load(out / "model.pt"), torch.load(one / "model.pt")
    assert sharded.keys() == plain.keys()
    for k in plain:
        torch.testing.assert_close(sharded[k], plain[k], rtol=1e-4, atol=1e-5)
    torch.manual_seed(3)  # the runs' initialisation (build_run seeds, then builds): the runs moved away from it
    init = build_model("mlp-small", "digits").state_dict()
    assert all(not torch.allclose(plain[k], init[k]) for k in plain)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epsilon"] == pytest.approx(single["epsilon"], rel=1e-12)
    assert summary["test_accuracy"] == pytest.approx(single["test_accuracy"], abs=2 / 360)
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (out, one)]
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] == [2, 4, 6]  # --log-every 2, the epoch
    for a_row, b_row in zip(*rows):  # every rank evaluated (collective forwards); rank 0 wrote the rows
        assert a_row["epsilon"] == pytest.approx(b_row["epsilon"], rel=1e-12)
        assert a_row["test_loss"] == pytest.approx(b_row["test_loss"], rel=1e-4)


# the dpopt command line under torchrun with the public partition seed fixed (rank 0's is broadcast anyway)
_CLI_SCRIPT = """
import sys, types
import dpopt.training.build as build
build.secrets = types.SimpleNamespace(randbits=lambda k: 4321)
sys.argv = ["dpopt", *sys.argv[1:]]
from dpopt.cli import main
main()
"""
MECHANISM = ["--noise-mechanism", "banded:2", "--sampling", "cyclic-poisson", "--sample-rate", "0.5"]


def _torchrun_cli(tmp, out, flags: list) -> subprocess.CompletedProcess:
    script = tmp / "cli.py"
    script.write_text(_CLI_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd + flags, capture_output=True, text=True, timeout=300, env=env, cwd=tmp)


@pytest.fixture(scope="module")
def fsdp_mechanism_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp-train-mf")
    flags = [f for f in _cli_flags(tmp / "rep") if f != "--log-every" and f != "2"]
    rep = _torchrun_cli(tmp, tmp / "rep", flags + MECHANISM)
    assert (tmp / "rep" / "summary.json").exists(), f"exit {rep.returncode}\n{rep.stderr[-4000:]}"
    secret = [f for f in _cli_flags(tmp / "secret") if f not in ("--reproducible-noise", "--log-every", "2")]
    sec = _torchrun_cli(tmp, tmp / "secret", secret + ["--noise-mechanism", "blt:2"])
    assert sec.returncode == 0, sec.stderr[-4000:]
    return tmp


def test_fsdp_mechanism_run_equals_one_process(fsdp_mechanism_runs):
    import types

    import dpopt.training.build as build_module

    tmp = fsdp_mechanism_runs
    real, build_module.secrets = build_module.secrets, types.SimpleNamespace(randbits=lambda k: 4321)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = dict(FLAGS, noise_mechanism="banded:2", sampling="cyclic-poisson", sample_rate=0.5)
            single = train(TrainConfig(**cfg, out=str(tmp / "one"), checkpoint_every=0))
    finally:
        build_module.secrets = real
    summary = json.loads((tmp / "rep" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["fsdp"] is True and summary["steps"] == single["steps"] == 6
    assert summary["check"] == "FAIL: noise_source"  # reproducible noise: the only failing check, by design
    assert summary["epsilon"] == pytest.approx(single["epsilon"], rel=1e-12)
    a, b = (json.loads((tmp / d / "ledger.json").read_text()) for d in ("rep", "one"))
    assert a["mechanism"] == b["mechanism"] and a["mechanism"]["kind"] == "banded"
    assert (a["mechanism"]["sample_rate"], a["mechanism"]["min_separation"]) == (0.5, 3)
    assert a["sampling"] == b["sampling"]
    assert [(e["step"], e["event"], e["meta"]) for e in a["entries"]] == [
        (e["step"], e["event"], e["meta"]) for e in b["entries"]
    ]
    sharded, plain = torch.load(tmp / "rep" / "model.pt"), torch.load(tmp / "one" / "model.pt")
    torch.manual_seed(3)
    init = build_model("mlp-small", "digits").state_dict()
    for k in plain:
        torch.testing.assert_close(sharded[k], plain[k], rtol=1e-4, atol=1e-5)
        assert not torch.allclose(plain[k], init[k])


def test_fsdp_mechanism_secret_run_checks(fsdp_mechanism_runs):
    from dpopt.accounting import check_run

    out = fsdp_mechanism_runs / "secret"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["noise"] == "secret" and summary["check"] == "pass" and summary["fsdp"] is True
    ledger = json.loads((out / "ledger.json").read_text())
    assert ledger["mechanism"]["kind"] == "blt" and ledger["mechanism"]["steps"] == summary["steps"] == 6
    assert len(ledger["entries"]) == 6
    assert check_run(out).passed  # `dpopt check`: the file alone re-scores to the summary's ε


@pytest.mark.parametrize(
    "change,field",
    [
        ({"method": "dp-macadam"}, "method"),
        ({"clipping": "quantile"}, "clipping"),
        ({"lora_rank": 4}, "lora_rank"),
        ({"ema_decay": 0.99}, "ema_decay"),
        ({"checkpoint_every": 10}, "checkpoint_every"),
        ({"user_ids": "users.txt"}, "user_ids"),  # user-level sampler, not sharded
        ({"compile": True}, "compile"),  # the sharded capture has no compiled path
        ({"norm_form": "gram"}, "norm_form"),  # the sharded capture keeps the cost model's forms
    ],
)
def test_refusals_name_the_option(change, field):
    with pytest.raises(ConfigError) as info:
        check_fsdp_config(TrainConfig(**dict(FLAGS, **change)))
    assert info.value.arguments == (field,) and "fsdp" in str(info.value)


def test_one_process_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="torchrun"):
        train_fsdp(TrainConfig(**FLAGS, out=str(tmp_path / "x")))


# Rank 0 sends itself SIGTERM from on_step after release 2 of 6: the handler run_steps' loop installs
# (training.signals.graceful_stop) records it, and the between-steps check (shared over the ranks by
# any_rank) ends both ranks before release 3. Secret noise, so the ledger check can pass.
_STOP_SCRIPT = """
import json, os, signal, sys
from dpopt.fsdp_train import train_fsdp
from dpopt.training import TrainConfig

def on_step(info):
    if info["step"] == 2:
        os.kill(os.getpid(), signal.SIGTERM)

cfg = TrainConfig(dataset="digits", method="dp-sgd", batch_size=256, epochs=1.0, seed=3,
                  physical_batch_size=50, noise_multiplier=1.0, out=sys.argv[1], checkpoint_every=0)
summary = train_fsdp(cfg, on_step=on_step)
print("RESULT " + json.dumps({k: summary.get(k) for k in ("rank", "steps", "status", "stop_signal")}), flush=True)
"""


def test_stop_signal_ends_every_rank_between_releases(tmp_path):
    from dpopt.accounting import check_run, dpsgd_epsilon

    script, out = tmp_path / "stop.py", tmp_path / "run"
    script.write_text(_STOP_SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = sorted(
        (json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")),
        key=lambda r: r["rank"] or 0,
    )
    assert [r["steps"] for r in results] == [2, 2]  # both ranks stopped after release 2 (of 6 planned)
    assert results[0]["status"] == "interrupted" and results[0]["stop_signal"] == "SIGTERM"
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["planned_steps"]) == ("interrupted", 2, 6)
    entries = json.loads((out / "ledger.json").read_text())["entries"]
    assert [e["step"] for e in entries] == [0, 1]  # every release made is on disk, and no other
    journal = [line for line in (out / "ledger.jsonl").read_text().splitlines() if line.strip()]
    assert len(journal) == 1 + 2  # header + the two releases (flushed before the summary)
    assert check_run(out).passed  # the file alone re-scores to the summary's ε
    q = 256 / 1437
    assert summary["epsilon"] == pytest.approx(dpsgd_epsilon(1.0, q, 2, 1e-5), rel=1e-9)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and rows[-1]["status"] == "interrupted"
    assert not (out / "checkpoint.pt").exists()  # a sharded run keeps no checkpoint
