"""Per-step cost of FSDP2's agreed first-batch-check signature (2 gloo ranks on CPU).

``ShardedCapture.collect`` computes this rank's check signature (:func:`dpopt.engine.check.signature`)
and runs one all-reduce of three floats per step (:meth:`dpopt.fsdp.ShardedCapture._agree`: the need flag,
the check's k and rows; two flags before 2026-12-07). This
times, in a warm steady loop of a small model (Linear 4→6, Tanh, Linear 6→3; 12 rows per rank, σ = 0),
a whole ``PrivacyEngine`` step, that all-reduce and the signature, as CPU seconds
(``time.process_time``, rank 0) and wall seconds, three repetitions::

    python benchmarks/fsdp_signature_cost.py

Prints one JSON line: per repetition, the step's, the all-reduce's and the signature's seconds per call.
"""

from __future__ import annotations

import datetime
import json
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

N = 12


def _worker(rank: int, world: int, tmp: str) -> None:
    """One rank: warm up, then time steps, all-reduces and signatures; rank 0 writes the JSON."""
    from torch.distributed.fsdp import fully_shard

    import dpopt
    from dpopt.engine.check import signature

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    fully_shard(m[0])
    fully_shard(m[2])
    fully_shard(m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = dpopt.PrivacyEngine().make_private(
            module=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=0.0),
            data_loader=DataLoader(TensorDataset(torch.zeros(64, 4), torch.zeros(64, dtype=torch.long)), 64),
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            distributed="fsdp",
        )
    g = torch.Generator().manual_seed(11 + rank)
    x, y = torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)

    def step():
        next(iter(loader))  # q = 1: the release's batch (32 rows per rank); the step trains on x, y (public)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(5):
        step()
    cap = opt._capture
    out: dict = {"step": [], "allreduce": [], "signature": []}
    for _ in range(3):
        for name, fn, reps in (
            ("step", step, 30),
            ("allreduce", lambda: cap._agree(False, 8, N), 300),
            ("signature", lambda: signature(m, N), 300),
        ):
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(reps):
                fn()
            out[name].append({"cpu_s": (time.process_time() - c0) / reps, "wall_s": (time.perf_counter() - w0) / reps})
    if rank == 0:
        print(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    """Spawn the 2 ranks."""
    mp.spawn(_worker, args=(2, tempfile.mkdtemp()), nprocs=2)


if __name__ == "__main__":
    main()
