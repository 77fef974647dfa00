"""Nothing a step creates outlives the step under ``make_private(..., distributed=True)`` and ``"fsdp"`` (FSDP2)
(issue 42), 2 gloo ranks.

On each rank a weak reference to every step's input, model output, loss and
an inner layer's input and output is dead after ``step()`` + ``zero_grad()``
+ ``gc.collect()``; the recorder holds no call. Before the fix each rank kept
every step's activations (≈ 115 KiB per step per rank on an MLP): the tensor
hook of each recorded output reached its ``Call`` (a cycle through autograd's
C++ side).
"""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from gloo_ranks import gloo_group, spawn_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt


def _run(rank: int, mode) -> dict:
    """Steps through ``make_private(..., distributed=mode)`` (True: replicas; "fsdp": FSDP2); the alive counts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
    g = torch.Generator().manual_seed(rank)
    data = DataLoader(
        TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)), batch_size=8
    )
    engine = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=data,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            distributed=mode,
        )
    refs, alive = [], []
    handle = model[2].register_forward_hook(lambda m, a, o: refs.extend([weakref.ref(a[0]), weakref.ref(o)]))
    for x, y in loader:
        x = x.clone()
        opt.zero_grad()
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        refs += [weakref.ref(x), weakref.ref(out), weakref.ref(loss)]
        del x, y, out, loss
        gc.collect()
        alive.append(sum(r() is not None for r in refs))
    handle.remove()
    return {"alive": alive, "refs": len(refs), "steps": len(engine.ledger), "calls": len(opt._capture._rec.calls)}


def _worker(rank: int, world: int, tmp: str) -> None:
    with gloo_group(rank, world, tmp):
        torch.save({"ddp": _run(rank, True), "fsdp": _run(rank, "fsdp")}, f"{tmp}/rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("no-step-outlives")
    spawn_ranks(_worker, tmp)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_ranks_keep_nothing_of_a_step(runs, mode):
    for res in (run[mode] for run in runs):
        assert res["steps"] == len(res["alive"]) >= 4 and res["refs"] >= 5 * res["steps"]
        assert res["alive"] == [0] * res["steps"], res
        assert res["calls"] == 0
