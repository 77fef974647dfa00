"""DPDPOTrainer refuses FSDP2 at construction, on EVERY rank of 2 gloo processes.

Both doors (:func:`dpopt.hf.dpo.dpo_refusals`): a policy ``fully_shard``-ed before the
trainer (DTensor parameters: DPDPOTrainer's default reference, a copy of the policy broadcast from
rank 0, is built for replicated parameters), and an unsharded model with ``fsdp="full_shard",
fsdp_config={"fsdp_version": 2}`` in the config (DPTrainer would shard it, then the engine's sharded
release would refuse the pair unit, augmentation_multiplicity=2, after the model is sharded). A rank
that did not refuse would go on to train while the other stops, so each rank records what it raised;
the message names what to do instead (data parallel). The DDP run is tests/distributed/test_trl_ddp.py;
DPSFTTrainer with FSDP2 is tests/distributed/test_trl_sft_fsdp.py.
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

from trl import DPOConfig  # noqa: E402
from trl_zoo import gpt2, pairs, tokenizer  # noqa: E402

from dpopt.hf import DPDPOTrainer  # noqa: E402

pytestmark = pytest.mark.distributed

WORLD = 2
FSDP = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2})
DOORS = ("sharded_model", "fsdp_args")


def sharded_gpt2():
    """The tiny GPT-2 with ``fully_shard`` on its block, then on the root."""
    from torch.distributed.fsdp import fully_shard

    model = gpt2()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


def build(door: str, out: str):
    model = sharded_gpt2() if door == "sharded_model" else gpt2()
    extra = FSDP if door == "fsdp_args" else {}
    common = dict(per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=True, bf16=False, **extra)
    kw = dict(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-3, processing_class=tokenizer())
    return DPDPOTrainer(model=model, args=DPOConfig(out, beta=0.5, **common), train_dataset=pairs(8), **kw)


def _worker(rank: int, world: int, tmp: str) -> None:
    torchrun_env(rank, world, HF_HUB_DISABLE_TELEMETRY="1", TQDM_DISABLE="1")
    with gloo_group(rank, world, tmp), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raised = {}
        for door in DOORS:
            try:
                build(door, str(Path(tmp) / f"{door}-rank{rank}"))
                raised[door] = None
            except ValueError as err:
                raised[door] = str(err)
        torch.save(raised, Path(tmp) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl-fsdp")
    spawn_ranks(_worker, tmp, stall_s=120)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("door", DOORS)
def test_dpo_fsdp2_is_refused_on_every_rank_with_what_to_do(ranks, door):
    what = "a fully_shard-ed (FSDP2) policy" if door == "sharded_model" else "fsdp= in the DPOConfig"
    for rank, raised in enumerate(ranks):
        message = raised[door]
        assert message is not None, f"rank {rank} built DPDPOTrainer with {door}"
        assert message.startswith("DPDPOTrainer cannot honour these settings privately"), message
        assert f"{what}: DPDPOTrainer does not support FSDP2" in message, message
        assert "augmentation_multiplicity=2" in message and "run data parallel" in message, message
