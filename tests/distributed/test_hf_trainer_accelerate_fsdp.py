"""``DPTrainer`` with ``TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2})`` under 2 gloo processes.

DPTrainer shards the (unsharded) model itself from the FSDP settings (:mod:`dpopt.hf.fsdp_args`) and trains it
through the engine's ``distributed="fsdp"``; plain SGD from ``optim="sgd"`` (the Trainer's optimizer, built on the
sharded parameters). One ``mp.spawn`` runs every case; the references are single-example autograd on the UNION of
the two ranks' Poisson batches (the helpers of test_hf_trainer_fsdp.py):

* σ = 0, B̄ = 2 × 2 × 2 = 8, C at the 30th percentile of the initial norms: every update equals
  lr · Σ_i clip_C(∇ℓ_i) / B̄ (some examples clipped, some not);
* q = 1 (every record in every batch: deterministic), σ = 0: the parameters equal, at every step, those of the
  same run with a model the test ``fully_shard``-ed itself (block, then root) — the path of docs/fsdp.md — and
  of ``fsdp="shard_grad_op"`` (reshard_after_forward=False);
  the torchrun test (:func:`test_torchrun_fsdp_args_equal_data_parallel`) checks the same against DDP;
* σ > 0: the noise of the update has std σ·C (once per coordinate), ε equals the one-process accountant's
  at the same σ, q, steps, on both ranks; one journal with a header and one line per release;
* both ranks hold the same full parameters at every step; the checkpoint's model (gathered to rank 0 only)
  loads into an unsharded GPT-2 with the final weights;
* refused on every rank, each with its message: cpu offload, activation checkpointing, a sharded state-dict
  type, cpu_ram_efficient_loading, a class to wrap the model lacks, a torch optimizer built before DPTrainer,
  a model already sharded plus fsdp=, and ``fully_shard`` on a block without the root.
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from gloo_ranks import gloo_group, progress, spawn_ranks, torchrun_env

pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.fsdp")

import transformers as T  # noqa: E402
from test_hf_trainer_fsdp import N, Recording, Tokens, clipped_sum, example_grads, full_params, gpt2  # noqa: E402

from dpopt.accounting.accountant import dpsgd_epsilon  # noqa: E402
from dpopt.hf import DPTrainer  # noqa: E402
from dpopt.hf.trainer import LEDGER_FILE  # noqa: E402
from dpopt.noise import NoiseSource  # noqa: E402

pytestmark = pytest.mark.distributed

PER_DEVICE, ACCUMULATION, WORLD = 2, 2, 2
BBAR = PER_DEVICE * ACCUMULATION * WORLD  # 8: q = 8/32
STEPS, LR = 3, 0.5
FSDP = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}}

CASES = {
    # masks_seed: σ = 0, so the Poisson masks are all that is drawn; seeded (reproducible NoiseSource, the same seed
    # on both ranks), the batches are fixed. On secret masks "a clipped and an unclipped example" (C at the 30th
    # percentile: 9 of 32 examples unclipped) failed with probability up to 0.75^9 per step, ~4e-4 over 3 steps.
    "half_clipped": dict(sigma=0.0, c=None, lr=0.05, masks_seed=4),
    "noise": dict(sigma=1.0, c=1e-3),
    # q = 1: B-bar = 4 x 4 x 2 = 32 = N; the same run with the model sharded by the test instead
    "q1_args": dict(sigma=0.0, c=1.0, per_device=4, accumulation=4),
    "q1_sharded": dict(sigma=0.0, c=1.0, per_device=4, accumulation=4, by_test=True),
    # "shard_grad_op": reshard_after_forward=False (the blocks stay unsharded between forward and backward)
    "q1_grad_op": dict(sigma=0.0, c=1.0, per_device=4, accumulation=4, sharding={"fsdp": "shard_grad_op"}),
}


def targs(out, lr=LR, per_device=PER_DEVICE, accumulation=ACCUMULATION, sharding=FSDP):
    return T.TrainingArguments(
        str(out),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        max_steps=STEPS,
        learning_rate=lr,
        lr_scheduler_type="constant",
        optim="sgd",
        logging_steps=1,
        save_strategy="steps",
        save_steps=STEPS,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        **copy.deepcopy(sharding),  # TrainingArguments rewrites the fsdp_config dict it is given, in place
    )


def shard_by_hand(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def run_case(out, name, c):
    case = CASES[name]
    by_test = case.get("by_test", False)
    model = shard_by_hand(gpt2()) if by_test else gpt2()
    lr = case.get("lr", LR)
    args = targs(
        out,
        lr=lr,
        per_device=case.get("per_device", PER_DEVICE),
        accumulation=case.get("accumulation", ACCUMULATION),
        sharding={} if by_test else {**FSDP, **case.get("sharding", {})},
    )
    tr = Recording(
        model=model, args=args, train_dataset=Tokens(), noise_multiplier=case["sigma"], max_grad_norm=c,
        privacy_unit="record",
    )  # fmt: skip
    if case.get("masks_seed") is not None:  # every rank the same seed: its shard of one reproducible Poisson sample
        tr.engine.noise = NoiseSource("reproducible", seed=case["masks_seed"])
    tr.seen, tr.ran = [], []
    tr.train()
    from torch.distributed.fsdp import FSDPModule

    return {
        "batches": [b for b, _ in tr.seen],
        "starts": [p for _, p in tr.seen],
        "final": full_params(tr.model),
        "epsilon": tr.get_epsilon(),
        "ledger": len(tr.ledger),
        "q": tr.sample_rate,
        "sharded": tr.sharded,
        "units": sorted(type(m).__name__ for m in tr.model.modules() if isinstance(m, FSDPModule)),
        "args_fsdp": bool(tr.args.fsdp),
        "optimizer": type(tr._private.original_optimizer).__name__,
        "reshard": [
            m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
            for m in tr.model.modules()
            if isinstance(m, FSDPModule) and m is not tr.model
        ],
    }


def refusals(tmp):
    """Each refused setting's message (raised on every rank, before any collective of the run)."""
    out = {}
    options = {
        "offload": dict(fsdp="full_shard offload", fsdp_config={"fsdp_version": 2}),
        "checkpointing": dict(fsdp=True, fsdp_config={"fsdp_version": 2, "activation_checkpointing": True}),
        "state_dict": dict(fsdp=True, fsdp_config={"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"}),
        "class": dict(fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["NoSuchBlock"]}),
        "ram": dict(fsdp=True, fsdp_config={"fsdp_version": 2, "cpu_ram_efficient_loading": True}),
    }
    for key, fsdp in options.items():
        try:
            DPTrainer(model=gpt2(), args=targs(tmp / key, sharding=fsdp), train_dataset=Tokens(),
                      noise_multiplier=1.0)  # fmt: skip
        except ValueError as exc:
            out[key] = str(exc)
    model = gpt2()
    try:
        DPTrainer(model=model, args=targs(tmp / "opt"), train_dataset=Tokens(), noise_multiplier=1.0,
                  method=torch.optim.SGD(model.parameters(), lr=LR))  # fmt: skip
    except ValueError as exc:
        out["optimizer"] = str(exc)
    try:
        DPTrainer(model=shard_by_hand(gpt2()), args=targs(tmp / "twice"), train_dataset=Tokens(), noise_multiplier=1.0)
    except ValueError as exc:
        out["twice"] = str(exc)
    from torch.distributed.fsdp import fully_shard

    model = gpt2()
    fully_shard(model.transformer.h[0])  # the block only, not the root
    try:
        DPTrainer(model=model, args=targs(tmp / "mix", sharding={}), train_dataset=Tokens(), noise_multiplier=1.0)
    except ValueError as exc:
        out["mix"] = str(exc)
    return out


def _worker(rank: int, world: int, tmp: str) -> None:
    torchrun_env(rank, world)
    cfg = json.loads((Path(tmp) / "cfg.json").read_text())
    with gloo_group(rank, world, tmp), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = {}
        for name, case in CASES.items():
            c = case["c"] if case["c"] is not None else cfg["clip_norm"]
            results[name] = run_case(Path(tmp) / name, name, c)
            progress(tmp, rank, name)
        results["refused"] = refusals(Path(tmp))
        torch.save(results, Path(tmp) / f"rank{rank}.pt")


def clip_norm():
    model, data = gpt2(), Tokens()
    batch = {k: torch.stack([data[i][k] for i in range(N)]) for k in ("input_ids", "attention_mask", "labels")}
    norms = [
        math.sqrt(sum(float(v.double().square().sum()) for v in g.values()))
        for g in example_grads(full_params(model), batch)
    ]
    return sorted(norms)[int(0.3 * N)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-accelerate-fsdp")
    (tmp / "cfg.json").write_text(json.dumps({"clip_norm": clip_norm()}))
    spawn_ranks(_worker, tmp, stall_s=120)
    return tmp, [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _updates(ranks, name):
    """Per step: (start params, union of the ranks' batches, update·B̄/lr) from rank 0's record."""
    r0, lr = ranks[0][name], CASES[name].get("lr", LR)
    for t, (start, end) in enumerate(zip(r0["starts"], r0["starts"][1:] + [r0["final"]])):
        parts = [r[name]["batches"][t] for r in ranks]
        union = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        yield start, union, {n: (start[n] - end[n]) / lr * BBAR for n in start}


def test_the_trainer_shards_the_model_and_accelerate_does_not(runs):
    _, ranks = runs
    for r in ranks:
        for name in ("half_clipped", "noise", "q1_args"):
            assert r[name]["sharded"] and not r[name]["args_fsdp"]  # DPTrainer's copy of args has fsdp off
            assert r[name]["units"] == ["FSDPGPT2Block", "FSDPGPT2LMHeadModel"]  # _no_split_modules, then the root
            assert r[name]["optimizer"] == "SGD"  # args.optim, built on the sharded parameters


def test_sigma0_update_is_the_clipped_sum_of_the_union_over_bbar(runs):
    tmp, ranks = runs
    c = json.loads((tmp / "cfg.json").read_text())["clip_norm"]
    lr = CASES["half_clipped"]["lr"]
    clipped = total = 0
    for start, batch, step in _updates(ranks, "half_clipped"):
        want, k = clipped_sum(start, batch, c)
        clipped, total = clipped + k, total + batch["input_ids"].shape[0]
        for n in start:  # atol: a float32 parameter of size ~1 resolves the sum to ~1.2e-7·B̄/lr
            torch.testing.assert_close(step[n], want[n], atol=max(1e-5, 4e-7 * BBAR / lr), rtol=1e-3)
    assert 0 < clipped < total, (clipped, total)  # both branches of clip_C (seeded masks: see CASES)


@pytest.mark.parametrize("other", ["q1_sharded", "q1_grad_op"])
def test_fsdp_args_equal_the_model_sharded_by_hand_at_every_step(runs, other):
    _, ranks = runs
    for r in ranks:
        a, b = r["q1_args"], r[other]
        assert a["q"] == b["q"] == 1.0 and a["sharded"] and b["sharded"]
        for sa, sb in zip(a["starts"] + [a["final"]], b["starts"] + [b["final"]]):
            for n in sa:
                torch.testing.assert_close(sa[n], sb[n], rtol=0, atol=0)
        moved = max(float((a["final"][n] - a["starts"][0][n]).abs().max()) for n in a["final"])
        assert moved > 1e-3, moved
    # full_shard reshards the block after its forward, shard_grad_op keeps it gathered until the backward
    assert ranks[0]["q1_args"]["reshard"] == [True] and ranks[0]["q1_grad_op"]["reshard"] == [False]


def test_noise_once_epsilon_journal_and_ranks_agree(runs):
    tmp, ranks = runs
    c, sigma = CASES["noise"]["c"], CASES["noise"]["sigma"]
    residuals = []
    for start, batch, step in _updates(ranks, "noise"):
        want, _ = clipped_sum(start, batch, c)
        residuals += [(step[n] - want[n]).reshape(-1) for n in start]
    z = torch.cat(residuals).double()
    # 12,480 coordinates of secret noise: the std's standard error is 0.63 %, 3.5 % is 5.5 standard errors (false
    # alarm 3.8e-8 per run; 2.1e-6 at 3 %); √2·σC (a draw on both ranks) would be 41 % off
    assert z.numel() > 12_000
    assert abs(float(z.std()) / (sigma * c) - 1.0) < 0.035
    want = dpsgd_epsilon(sigma, BBAR / N, STEPS, 1e-5)  # the one-process run's ε (test_hf_trainer_fsdp checks it)
    for r in ranks:
        assert r["noise"]["ledger"] == STEPS and r["noise"]["epsilon"] == pytest.approx(want, rel=1e-9)
    for name in CASES:
        for t in range(STEPS):
            for n, v in ranks[0][name]["starts"][t].items():
                assert torch.equal(v, ranks[1][name]["starts"][t][n])
        for n, v in ranks[0][name]["final"].items():
            assert torch.equal(v, ranks[1][name]["final"][n])
        journals = sorted((tmp / name).glob("ledger-*.jsonl"))
        assert len(journals) == 1 and len(journals[0].read_text().splitlines()) == STEPS + 1
        assert json.loads((tmp / name / f"checkpoint-{STEPS}" / LEDGER_FILE).read_text())["run_id"] in journals[0].name


def test_checkpoint_gathered_to_rank0_loads_into_an_unsharded_model(runs):
    tmp, ranks = runs
    saved = T.GPT2LMHeadModel.from_pretrained(tmp / "noise" / f"checkpoint-{STEPS}")
    final = ranks[0]["noise"]["final"]
    assert {n for n, _ in saved.named_parameters()} == set(final)
    for n, p in saved.named_parameters():
        torch.testing.assert_close(p.detach(), final[n], rtol=0, atol=0)
    name = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(final[name], ranks[0]["noise"]["starts"][0][name])  # the saved model is the trained one


def test_unsupported_fsdp_settings_are_refused_on_every_rank(runs):
    _, ranks = runs
    expected = {
        "offload": "cpu_offload",
        "checkpointing": "activation_checkpointing",
        "state_dict": "SHARDED_STATE_DICT",
        "class": "'NoSuchBlock', which is not a module class",
        "ram": "cpu_ram_efficient_loading",
        "optimizer": "holds the unsharded parameters",
        "twice": "already fully_shard-ed",
        "mix": "fully_shard was applied to submodules of the model (transformer.h.0) but not to the model itself",
    }
    for r in ranks:
        assert set(r["refused"]) == set(expected), r["refused"]
        for key, text in expected.items():
            assert text in r["refused"][key], (key, r["refused"][key])


SCRIPT = Path(__file__).with_name("hf_trainer_script.py")


def _torchrun(out: Path, *extra: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    cmd += [f"--master_port={port}", str(SCRIPT), str(out), *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


@pytest.mark.slow
def test_torchrun_fsdp_args_equal_data_parallel(tmp_path):
    """The user's script under ``torchrun --nproc_per_node 2``: ``fsdp=True, fsdp_config={"fsdp_version": 2}``
    gives DDP's parameters and ledger (q = 1, σ = 0: deterministic)."""
    _torchrun(tmp_path / "fsdp", "fsdp")
    _torchrun(tmp_path / "ddp")
    a, b = (torch.load(tmp_path / d / "result.pt", weights_only=False) for d in ("fsdp", "ddp"))
    assert a["sharded"] and not b["sharded"] and a["world_size"] == b["world_size"] == 2
    assert a["ledger"] == b["ledger"] and len(a["ledger"]) == 2
    for n in b["params"]:
        torch.testing.assert_close(a["params"][n], b["params"][n], rtol=0, atol=1e-7)
    assert any(not torch.equal(a["params"][n], a["start"][n]) for n in a["params"])  # it trained
