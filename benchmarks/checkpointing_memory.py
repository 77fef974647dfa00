"""Peak memory of DP fine-tuning with and without gradient checkpointing (Hugging Face GPT-2, CPU).

A GPT-2 built from a config (no download): ``--layers`` blocks (4), d ``--hidden`` (256), 4 heads,
vocab ``--vocab`` (512: the blocks' activations, not the logits, dominate), T ``--seq`` (128),
B ``--batch`` (8), dropout 0. Each configuration runs in its own fresh
subprocess, two steps (the first also runs dpopt's first-batch check); the second step's peak of
live CPU tensor memory is measured with the torch profiler (``profile_memory=True``: allocations
and frees in time order, :func:`peak_tensor_bytes`), above what was held before it (parameters,
data). The process's resident memory is no measure here: freed tensors stay resident in the
allocator.

Configurations:

* ``non-private`` — ``model(input_ids=x, labels=x).loss.backward()``, SGD (and with checkpointing);
* ``privacy-engine`` — the same plain HF loop through ``dpopt.PrivacyEngine`` (hook capture;
  HF's ``labels=`` loss made per example), σ 1, C 1;
* ``... +ckpt(reentrant)`` / ``... +ckpt(non-reentrant)`` — the same after
  ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ...})``.

The capture keeps each linear layer's input (the per-example gradient needs it) however the
forward is run, so checkpointing saves only the activations that are NOT layer inputs (attention
probabilities, MLP intermediates after the activation, norms' outputs...): the ratios printed are
``privacy-engine +ckpt / privacy-engine`` and ``non-private +ckpt / non-private`` of the peak.

Measured (this default, CPU, 2026-12-06 23:20 UTC, after issue 34's memory changes): non-private 118.1 MiB,
+ckpt 39.6 (0.33×); privacy-engine 124.1 (1.05× non-private), +ckpt reentrant 100.1 (0.81×), +ckpt
non-reentrant 102.0 (0.82×). Before those changes (2026-12-06) privacy-engine read 140.8, +ckpt 140.8 (1.00×)
and 151.7 (1.08×). docs/finetuning.md (its gradient checkpointing paragraph).

Usage::

    nice -n 10 python benchmarks/checkpointing_memory.py            # table and ratios
    python benchmarks/checkpointing_memory.py --layers 2 --seq 128  # smaller
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import warnings

CONFIGS = (
    "non-private",
    "non-private +ckpt(non-reentrant)",
    "privacy-engine",
    "privacy-engine +ckpt(reentrant)",
    "privacy-engine +ckpt(non-reentrant)",
)


def child(config: str, layers: int, hidden: int, seq: int, batch: int, vocab: int = 512) -> dict:
    """One configuration, two steps; returns the second step's peak of live tensor memory (MiB)."""
    import torch
    import transformers as T
    from torch.utils.data import DataLoader, TensorDataset

    import dpopt

    torch.manual_seed(0)
    cfg = T.GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=4,
        vocab_size=vocab,
        n_positions=seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    model = T.GPT2LMHeadModel(cfg).train()
    x = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    if "ckpt" in config:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": "(reentrant)" in config})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    engine = None
    if not config.startswith("non-private"):
        engine = dpopt.PrivacyEngine()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # poisson_sampling=False (a fixed benchmark batch) is warned about
            model, opt, _ = engine.make_private(
                module=model,
                optimizer=opt,
                data_loader=DataLoader(TensorDataset(x), batch_size=batch),
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                poisson_sampling=False,  # every step on the one fixed batch x (a Poisson loader refuses that)
            )

    def step() -> None:
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()

    step()  # the first step also runs dpopt's first-batch check
    peak = peak_tensor_bytes(step)
    if engine is not None:
        engine.detach()
    return {"config": config, "step_peak_mib": peak / 2**20}


def peak_tensor_bytes(fn) -> int:
    """Peak of the bytes CPU tensors hold during ``fn()`` above those held before (torch profiler).

    ``profile_memory=True`` attributes each allocation and free to the op that made it
    (``self_cpu_memory_usage``; ``[memory]`` events for those outside any op); their running
    sum in start-time order is the live memory, and its maximum the peak.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.layers, a.hidden, a.seq, a.batch, a.vocab)))
        return 0
    rows = {}
    for config in CONFIGS:
        cmd = [sys.executable, __file__, "--child", config]
        cmd += ["--layers", str(a.layers), "--hidden", str(a.hidden), "--seq", str(a.seq), "--batch", str(a.batch)]
        cmd += ["--vocab", str(a.vocab)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        rows[config] = json.loads(out)
    print(f"GPT-2 {a.layers} layers, d {a.hidden}, T {a.seq}, B {a.batch}, V {a.vocab} (CPU)")
    print("| configuration | step's peak tensor memory, MiB |")
    print("|---|---:|")
    for config, r in rows.items():
        print(f"| {config} | {r['step_peak_mib']:.1f} |")
    base = rows["privacy-engine"]["step_peak_mib"]
    for config in CONFIGS[3:]:
        print(f"ratio {config} / privacy-engine: {rows[config]['step_peak_mib'] / base:.2f}")
    np_ = rows["non-private"]["step_peak_mib"]
    print(f"ratio non-private +ckpt / non-private: {rows[CONFIGS[1]]['step_peak_mib'] / np_:.2f}")
    print(f"ratio privacy-engine / non-private: {base / np_:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
