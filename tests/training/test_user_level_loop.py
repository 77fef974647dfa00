"""User-level DP through dpopt's own loop (``dpopt train --user-ids``; dpopt.users): σ = 0 sensitivity per user,
ε at q_user, the unit in the ledger header, and the CLI flag."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dpopt.data import Dataset
from dpopt.training import TrainConfig, build_run
from dpopt.training.loop import run_steps

K = 3


def _data(drop=None):
    """48 digits-like records of 6 users (sizes 1, K, K + 5 — all equal records —, and three more)."""
    g = torch.Generator().manual_seed(0)
    sizes = [1, K, K + 5, 2, 4, 1]
    ids = [u for u, s in enumerate(sizes) for _ in range(s)]
    x = torch.randn(len(ids), 64, generator=g)
    y = torch.randint(0, 10, (len(ids),), generator=g)
    big = [i for i, u in enumerate(ids) if u == 2]
    x[big], y[big] = x[big[0]].clone(), y[big[0]].clone()  # which k records user 2 brings changes no value
    keep = [i for i, u in enumerate(ids) if u != drop]
    data = Dataset("digits", x[keep], y[keep], x[:4].clone(), y[:4].clone())
    return data, [str(ids[i]) for i in keep]


def _clipped_sum(tmp_path, drop, c):
    data, ids = _data(drop)
    path = tmp_path / f"users-{drop}.txt"
    path.write_text("\n".join(ids) + "\n")
    users = len(set(ids))
    cfg = TrainConfig(
        dataset="digits",
        method="dp-sgd",
        noise_multiplier=0.0,
        max_grad_norm=c,
        lr=1.0,
        sample_rate=1.0,
        batch_size=float(users),
        epochs=1.0,
        user_ids=str(path),
        max_records_per_user=K,
        physical_batch_size=2,
        reproducible_noise=True,
    )
    with pytest.warns(UserWarning):
        run = build_run(cfg, data)
    before = [p.detach().clone() for p in run.model.parameters()]
    run_steps(run)
    assert run.ledger.privacy_unit == f"user (at most {K} records each)" and run.ledger.num_users == users
    return torch.cat([((b - p.detach()) * users).flatten() for b, p in zip(before, run.model.parameters())])


@pytest.mark.parametrize("removed", [0, 1, 2])  # 1, k and more than k records
def test_sigma_zero_removing_one_user_moves_the_update_by_c(tmp_path, removed):
    c = 1e-3
    moved = float((_clipped_sum(tmp_path, None, c) - _clipped_sum(tmp_path, removed, c)).norm())
    assert moved <= c * (1 + 1e-4)
    assert moved == pytest.approx(c, rel=1e-3)


def test_cli_user_ids_records_the_unit_and_epsilon_at_q_user(tmp_path):
    from typer.testing import CliRunner

    from dpopt.accounting.accountant import dpsgd_epsilon
    from dpopt.cli import app

    ids = tmp_path / "users.txt"
    ids.write_text("\n".join(str(i // 5) for i in range(1437)) + "\n")  # digits' 1437 training records, 288 users
    out = tmp_path / "run"
    args = ["train", "--dataset", "digits", "--method", "dp-sgd", "--user-ids", str(ids), "--max-records-per-user"]
    args += ["2", "--batch-size", "32", "--epochs", "0.25", "--noise-multiplier", "1.0", "--out", str(out), "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    q = 32 / 288
    assert summary["sample_rate"] == pytest.approx(q)
    assert summary["epsilon"] == pytest.approx(dpsgd_epsilon(1.0, q, summary["steps"], 1e-5, "pld"), rel=1e-6)
    ledger = json.loads((out / "ledger.json").read_text())
    assert ledger["privacy_unit"] == "user (at most 2 records each)" and ledger["num_users"] == 288
    bad = tmp_path / "short.txt"
    bad.write_text("1\n2\n")
    res = CliRunner().invoke(app, args[:6] + [str(bad)] + args[7:-3] + ["--out", str(tmp_path / "run2")])
    assert res.exit_code == 2 and "1437 records" in res.output and "Traceback" not in res.output


def test_user_ids_refusals(tmp_path):
    data = _data()[0]
    cfg = TrainConfig(batch_size=2.0, user_ids="x.txt")
    with pytest.raises(ValueError, match="validation_fraction"):
        build_run(dataclasses.replace(cfg, validation_fraction=0.1), data)
    with pytest.raises(ValueError, match="max_records_per_user"):
        build_run(dataclasses.replace(cfg, max_records_per_user=0), data)
    with pytest.raises(ValueError, match="cannot read user_ids"):
        build_run(dataclasses.replace(cfg, user_ids=str(tmp_path / "missing.txt")), data)
    (tmp_path / "two.txt").write_text("\n".join(["a", "b"] * 9) + "\nc\n")  # 19 records, 3 users
    with pytest.raises(ValueError, match="exceeds the 3 users"):
        build_run(dataclasses.replace(cfg, batch_size=5.0, user_ids=str(tmp_path / "two.txt")), data)


def test_resume_continues_the_user_sampler_and_the_ledger(tmp_path):
    """Reproducible noise: an interrupted user-level run resumed ends at the uninterrupted run's parameters
    and ε (the sampler's position and stream travel in the checkpoint; the ledger continues)."""
    import os
    import signal
    import warnings

    from dpopt.accounting.ledger import PrivacyLedger
    from dpopt.training import resume, train

    ids = tmp_path / "users.txt"
    ids.write_text("\n".join(str(i // 5) for i in range(1437)) + "\n")
    kw = dict(method="dp-sgd", epochs=0.75, batch_size=32.0, user_ids=str(ids), max_records_per_user=2)
    kw.update(reproducible_noise=True, accountant="rdp", checkpoint_every=1)
    warnings.simplefilter("ignore", UserWarning)
    full = train(TrainConfig(out=str(tmp_path / "full"), **kw))

    def interrupt(info):
        if info["step"] == 3:
            os.kill(os.getpid(), signal.SIGINT)

    part = train(TrainConfig(out=str(tmp_path / "part"), **kw), on_step=interrupt)
    assert part["status"] == "interrupted" and part["steps"] == 3 < full["steps"]
    done = resume(tmp_path / "part")
    assert done["steps"] == full["steps"] and done["epsilon"] == full["epsilon"]
    ledger = PrivacyLedger.load(tmp_path / "part")
    assert len(ledger) == full["steps"] and ledger.num_users == 288
    a, b = torch.load(tmp_path / "full" / "model.pt"), torch.load(tmp_path / "part" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
