"""DPSFTTrainer with FSDP2 under 2 gloo processes equals the same run data parallel (σ = 0, float64).

Both doors — a policy ``fully_shard``-ed before DPSFTTrainer, and ``fsdp="full_shard",
fsdp_config={"fsdp_version": 2}`` in the ``SFTConfig`` — against the DDP run of the same trainer, data
and seed (each rank starts from ITS OWN random model, seed = rank: DDP and ``fsdp=`` take rank 0's; for
the pre-sharded door the test gives every rank rank 0's weights before ``fully_shard``, the user's job). The
DDP run is exact against single-example autograd (tests/distributed/test_trl_ddp.py), so equality here
carries that exactness over: plain SGD at lr 1, q = 1 (N = B̄ = 2 per device × 2 accumulation × 2 ranks
= 8 texts), C = 0.05 below every example's norm (every example clipped), 2 steps. The gathered
parameters of every case must agree to 1e-12 (float64; the sum order differs) and must have moved.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from gloo_ranks import gloo_group, spawn_ranks, torchrun_env

pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf_trl"))  # trl_zoo (spawned ranks inherit sys.path)

from trl import SFTConfig  # noqa: E402
from trl_zoo import gpt2, texts, tokenizer  # noqa: E402

from dpopt.hf import DPSFTTrainer  # noqa: E402

pytestmark = pytest.mark.distributed

WORLD, N, STEPS, C = 2, 8, 2, 0.05
DOORS = ("ddp", "sharded_model", "fsdp_args")


def full_params(model):
    """{name: full tensor} of the trainable parameters, gathered from the shards (a collective for FSDP)."""
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def run(door: str, out: str, seed: int):
    from torch.distributed.fsdp import fully_shard

    model = gpt2(seed=seed, double=True)
    if door == "sharded_model":
        torch.distributed.broadcast_object_list(holder := [model.state_dict()], src=0)  # rank 0's model everywhere
        model.load_state_dict(holder[0])
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    start = full_params(model)
    extra = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2}) if door == "fsdp_args" else {}
    args = SFTConfig(
        out,
        max_length=16,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=1.0,
        lr_scheduler_type="constant",
        optim="sgd",
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        **extra,
    )
    tr = DPSFTTrainer(
        model=model,
        args=args,
        train_dataset=texts(N),
        processing_class=tokenizer(),
        noise_multiplier=0.0,
        max_grad_norm=C,
        delta=1e-3,
    )
    tr.train()
    return {"start": start, "final": full_params(tr.model), "sharded": tr.sharded, "q": tr.sample_rate}


def _worker(rank: int, world: int, tmp: str) -> None:
    torchrun_env(rank, world, HF_HUB_DISABLE_TELEMETRY="1", TQDM_DISABLE="1")
    with gloo_group(rank, world, tmp), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = {door: run(door, str(Path(tmp) / f"{door}-rank{rank}"), seed=rank) for door in DOORS}
        torch.save(results, Path(tmp) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl-sft-fsdp")
    spawn_ranks(_worker, tmp, stall_s=120)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("door", ["sharded_model", "fsdp_args"])
def test_sft_fsdp2_equals_data_parallel_on_every_rank(ranks, door):
    ddp = ranks[0]["ddp"]
    assert not ddp["sharded"] and ddp["q"] == 1.0
    moved = max(float((ddp["final"][k] - ddp["start"][k]).abs().max()) for k in ddp["final"])
    assert moved > 1e-4  # the step is not vanishing
    for r in ranks:
        got = r[door]
        assert got["sharded"] and got["q"] == 1.0
        for k, want in ddp["final"].items():
            assert float((got["final"][k] - want).abs().max()) <= 1e-12, k
