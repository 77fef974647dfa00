"""DPSFTTrainer and DPDPOTrainer refuse FSDP2 at construction, on EVERY rank of 2 gloo processes.

Both doors (:func:`dpopt.hf.trl_common.sharded_refusals`): a policy ``fully_shard``-ed before the
trainer (DTensor parameters: DPDPOTrainer's default reference, a copy of the policy broadcast from
rank 0, is built for replicated parameters), and an unsharded model with ``fsdp="full_shard",
fsdp_config={"fsdp_version": 2}`` in the config (DPTrainer would shard it). A rank that did not refuse
would go on to train while the other stops, so each rank records what it raised; the message names
what to do instead (data parallel, or DPTrainer for FSDP2). A DDP run of the same trainers is
tests/distributed/test_trl_ddp.py.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from gloo_ranks import gloo_group, spawn_ranks

pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf_trl"))  # trl_zoo (spawned ranks inherit sys.path)

from trl import DPOConfig, SFTConfig  # noqa: E402
from trl_zoo import gpt2, pairs, texts, tokenizer  # noqa: E402

from dpopt.hf import DPDPOTrainer, DPSFTTrainer  # noqa: E402

pytestmark = pytest.mark.distributed

WORLD = 2
FSDP = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2})
CASES = [(kind, door) for kind in ("sft", "dpo") for door in ("sharded_model", "fsdp_args")]


def sharded_gpt2():
    """The tiny GPT-2 with ``fully_shard`` on its block, then on the root."""
    from torch.distributed.fsdp import fully_shard

    model = gpt2()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def build(kind: str, door: str, out: str):
    model = sharded_gpt2() if door == "sharded_model" else gpt2()
    extra = FSDP if door == "fsdp_args" else {}
    common = dict(per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=True, bf16=False, **extra)
    kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-3, processing_class=tokenizer())
    if kind == "sft":
        return DPSFTTrainer(model=model, args=SFTConfig(out, max_length=16, **common), train_dataset=texts(8), **kw)
    return DPDPOTrainer(model=model, args=DPOConfig(out, beta=0.5, **common), train_dataset=pairs(8), **kw)


def _worker(rank: int, world: int, tmp: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        HF_HUB_DISABLE_TELEMETRY="1",
        TQDM_DISABLE="1",
    )
    with gloo_group(rank, world, tmp), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raised = {}
        for kind, door in CASES:
            try:
                build(kind, door, str(Path(tmp) / f"{kind}-{door}-rank{rank}"))
                raised[(kind, door)] = None
            except ValueError as err:
                raised[(kind, door)] = str(err)
        torch.save(raised, Path(tmp) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl-fsdp")
    spawn_ranks(_worker, tmp, stall_s=120)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("kind,door", CASES)
def test_fsdp2_is_refused_on_every_rank_with_what_to_do(ranks, kind, door):
    name = {"sft": "DPSFTTrainer", "dpo": "DPDPOTrainer"}[kind]
    what = "a fully_shard-ed (FSDP2) model" if door == "sharded_model" else "fsdp= in the config"
    for rank, raised in enumerate(ranks):
        message = raised[(kind, door)]
        assert message is not None, f"rank {rank} built {name} with {door}"
        assert f"{name} cannot honour these settings privately" in message, message
        assert f"{what}: {name} does not support FSDP2" in message, message
        assert "run data parallel" in message and "use DPTrainer for FSDP2" in message, message
        assert ("default reference model" in message) == (kind == "dpo"), message
