"""``DPTrainer`` step time under ``torchrun`` on CPU: 2 processes (gloo) beside 1 process, at the same B̄.

A small GPT-2 (2 layers, width 64, blocks of 32 tokens, N = 512) trains with DP-SGD (σ = 1, C = 1,
plain SGD) at the same global expected batch B̄ = 32 in both layouts:

* 1 process:  ``per_device_train_batch_size 8 × gradient_accumulation_steps 4 × 1``;
* 2 processes: ``per_device_train_batch_size 8 × gradient_accumulation_steps 2 × 2``.

Each layout runs under ``python -m torch.distributed.run`` (one torch thread per process); rank 0
reports the median wall time of a step (``on_step_begin`` → ``on_step_end``, the first 3 steps left
out: the engine's first-batch check runs there). The ratio (2-process step / 1-process step) is the
figure; on a CPU shared with other work it says little about GPUs, where the same command runs with
``--device cuda`` (NCCL) — the absolute speed-up needs a device and is for the GPU check script.

Usage::

    python benchmarks/hf_ddp_step.py              # table and one JSON line
    python benchmarks/hf_ddp_step.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

N, L, V, BBAR = 512, 32, 100, 32


def worker(out: str, steps: int, world: int, device: str) -> None:
    """The script each torchrun process runs (rank 0 writes ``out/timing.json``)."""
    import warnings

    import torch
    import transformers as T

    from dpopt.hf import DPTrainer

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.randint(1, V, (N, L), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return N

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "attention_mask": torch.ones(L, dtype=torch.long), "labels": self.x[i]}

    class Clock(T.TrainerCallback):
        def __init__(self):
            self.times: list = []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)

    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=V, n_positions=L))
    per_device = 8
    args = T.TrainingArguments(
        out,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=BBAR // (per_device * world),
        max_steps=steps,
        learning_rate=0.1,
        optim="sgd",
        save_strategy="no",
        report_to=[],
        use_cpu=device == "cpu",
        disable_tqdm=True,
        logging_steps=10_000,
    )
    clock = Clock()
    tr = DPTrainer(
        model=model,
        args=args,
        train_dataset=Tokens(),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        privacy_unit="record",
        callbacks=[clock],
    )
    tr.train()
    if tr.args.process_index == 0:
        Path(out, "timing.json").write_text(
            json.dumps({"world": tr.args.world_size, "bbar": tr.bbar, "q": tr.sample_rate, "times": clock.times})
        )


def launch(world: int, steps: int, device: str) -> dict:
    """Run the worker under torchrun with ``world`` processes; rank 0's timings."""
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        src = str(Path(__file__).resolve().parents[1] / "src")
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={world}",
            __file__,
            "--worker",
            out,
            "--steps",
            str(steps),
            "--world",
            str(world),
            "--device",
            device,
        ]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return json.loads(Path(out, "timing.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker, a.steps, a.world, a.device)
        return
    rows = {}
    for world in (1, 2):
        res = launch(world, a.steps, a.device)
        kept = res["times"][3:]
        rows[world] = {"bbar": res["bbar"], "q": res["q"], "median_s": statistics.median(kept), "steps": len(kept)}
        print(
            f"{world} process(es): B-bar {res['bbar']}, q {res['q']:.4g}, median step {rows[world]['median_s']:.3f} s"
        )
    ratio = rows[2]["median_s"] / rows[1]["median_s"]
    print(f"2-process / 1-process step time: {ratio:.2f}")
    print(json.dumps({"device": a.device, "one": rows[1], "two": rows[2], "ratio_two_over_one": ratio}))


if __name__ == "__main__":
    main()
