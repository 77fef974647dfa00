"""Multi-node data parallel, simulated on one machine: DPTrainer under ``torchrun --nnodes 2 --nproc_per_node 1``
twice (static rendezvous on 127.0.0.1) gives the parameters and ledger of ``--nnodes 1 --nproc_per_node 2``.

The script (hf_trainer_script.py) trains with σ = 0 and B̄ = N (q = 1: every record in every batch), so the
run is deterministic and the two layouts must agree: the same shards (rank r holds records [rN/W, (r+1)N/W)),
the same clipped sums, one all-reduce over the same two ranks. Slow tier (4 interpreters importing transformers).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = Path(__file__).with_name("hf_trainer_script.py")
TIMEOUT_S = 300


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path, nnodes: int, nproc: int, node_rank: int, port: int) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc_per_node={nproc}",
        f"--node_rank={node_rank}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        str(SCRIPT),
        str(out),
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs) -> None:
    """Wait for every torchrun; as soon as one fails (or the time is up) stop the others, whose rendezvous or
    collectives would wait for it until the timeout, and fail with every process's output."""
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p in procs) and all(p.poll() in (None, 0) for p in procs):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        report = "\n".join(
            f"--- node {i}: exit {p.returncode}\n{out[-3000:]}" for i, (p, out) in enumerate(zip(procs, outs))
        )
        pytest.fail(f"torchrun failed or did not finish in {TIMEOUT_S} s:\n{report}")


@pytest.mark.slow
def test_two_nodes_of_one_process_equal_one_node_of_two(tmp_path):
    one = tmp_path / "one-node"
    _finish([_torchrun(one, 1, 2, 0, _port())])
    two = tmp_path / "two-nodes"
    port = _port()
    _finish([_torchrun(two, 2, 1, r, port) for r in range(2)])
    a, b = (torch.load(d / "result.pt", weights_only=False) for d in (one, two))
    assert a["world_size"] == b["world_size"] == 2 and a["q"] == b["q"] == 1.0
    assert a["ledger"] == b["ledger"] and len(a["ledger"]) == 2
    assert a["params"].keys() == b["params"].keys()
    for n in a["params"]:
        torch.testing.assert_close(a["params"][n], b["params"][n], rtol=0, atol=1e-7)
    assert any(not torch.equal(a["params"][n], a["start"][n]) for n in a["params"])  # it trained
