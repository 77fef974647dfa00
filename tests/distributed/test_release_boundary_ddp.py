"""The release boundary under data parallelism (issue 33, cases 1-2, the DDP door): 2 gloo ranks, σ = 0.

Each rank's BatchMemoryManager loop skips empty chunks (``if len(x) == 0: continue``; at q = 1/24 over a
24-example shard many of a rank's batches are empty while the other rank's are not) and breaks out of the
second epoch (a decision every rank takes at the same logical batch: see docs/pitfalls.md, item 25).
Every logical batch is still released exactly once on every rank (a batch the rank skipped: pure noise), so
the ranks' all-reduces stay paired and their ledgers equal; every release is the sum over BOTH ranks'
chunks of one Poisson step, each example at most once (σ = 0: removing one moves it by at most C). Before
(main fb334df): 27 releases for 39 Poisson steps, a skipped chunk shifting one rank's releases against the
other's (one run: an example added twice, 2·C).
"""

from __future__ import annotations

import warnings

import torch
from gloo_ranks import gloo_group, spawn_ranks
from torch import nn
from torch.utils.data import DataLoader, Dataset

import dpopt
from dpopt.utils.batch_memory_manager import BatchMemoryManager

N = 48


class OneHot(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.eye(N, dtype=torch.float64)[i], torch.tensor(0)


def _worker(rank: int, world: int, tmp: str) -> None:
    with gloo_group(rank, world, tmp):
        model = nn.Linear(N, 1, bias=False).double()
        nn.init.zeros_(model.weight)
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, loader = dpopt.PrivacyEngine().make_private(
                module=model,
                optimizer=sgd,
                data_loader=DataLoader(OneHot(), batch_size=2),
                noise_multiplier=0.0,
                max_grad_norm=1.0,
                loss_reduction="sum",
                distributed=True,
            )
        drawn = []  # this rank's shard of each logical batch, in order
        poisson = loader.poisson
        orig_iter = type(poisson).__iter__

        class _Recording(type(poisson)):
            def __iter__(self):
                for b in orig_iter(self):
                    drawn.append(frozenset(b))
                    yield b

        poisson.__class__ = _Recording
        releases = []
        ebs = opt.expected_batch_size
        sgd.register_step_pre_hook(lambda o, a, k: releases.append(model.weight.grad.detach().flatten() * ebs))
        for epoch in range(2):
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=1, optimizer=opt) as chunks:
                for x, _ in chunks:
                    # a collective decision (the ledger is the same on every rank), taken where every rank is
                    # at the same logical batch: as a chunk is handed out
                    if epoch == 1 and len(opt.privatizer.ledger) >= len(loader) + 3:
                        break
                    if len(x) == 0:
                        continue
                    opt.zero_grad()
                    model(x).sum().backward()
                    opt.step()
        torch.save(
            {"releases": releases, "ledger": len(opt.privatizer.ledger), "len": len(loader), "drawn": drawn},
            f"{tmp}/rank{rank}.pt",
        )


def test_skipped_and_broken_bmm_loops_on_two_ranks_release_in_step(tmp_path):
    spawn_ranks(_worker, tmp_path)
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert runs[0]["ledger"] == runs[1]["ledger"] >= runs[0]["len"] + 3
    assert len(runs[0]["releases"]) == runs[0]["ledger"] == len(runs[0]["drawn"]) == len(runs[1]["drawn"])
    for i, (a, b) in enumerate(zip(runs[0]["releases"], runs[1]["releases"])):
        torch.testing.assert_close(a, b)  # the same all-reduced release on both ranks
        m = a.round()
        torch.testing.assert_close(a, m, rtol=0, atol=1e-9)
        assert m.max().item() <= 1.0  # each example at most once: sensitivity C
        step = runs[0]["drawn"][i] | runs[1]["drawn"][i]  # the i-th Poisson step over the whole dataset
        assert set(torch.nonzero(m).flatten().tolist()) <= step, "a release merged two Poisson steps"
