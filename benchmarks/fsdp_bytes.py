"""Bytes communicated per DP step: dpopt's FSDP2 path vs its DDP path, on a small GPT-2-shaped model (issue 23).

Two gloo ranks on CPU (loopback: wall time is meaningless here, bytes are not). Every collective
``torch.distributed`` runs is counted (FSDP2's parameter all-gathers, dpopt's reduce-scatter or
all-reduce, the small count/flag collectives) as the bytes a ring algorithm SENDS per rank:
all-gather / reduce-scatter (W−1)/W × the full buffer, all-reduce 2(W−1)/W ×, broadcast 1 ×.
The per-step figure is the mean over the steps after the first (the first runs the per-example check)::

    python benchmarks/fsdp_bytes.py [--steps 4] [--json]

Prints both paths' bytes per step, their ratio (target ≤ 1.5) and the analytic ratio of
:func:`dpopt.fsdp.bytes_per_step`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, T, D, LAYERS = 256, 16, 64, 2


class Block(nn.Module):
    """GPT-2's block shape: ln_1, attention (c_attn → causal softmax → c_proj), ln_2, MLP (c_fc, GELU, c_proj)."""

    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.c_attn, self.attn_proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.c_fc, self.c_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, h):
        q, k, v = self.c_attn(self.ln_1(h)).chunk(3, dim=-1)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.attn_proj(a)
        return h + self.c_proj(nn.functional.gelu(self.c_fc(self.ln_2(h))))


class TinyGPT(nn.Module):
    """wte, wpe, LAYERS blocks, ln_f, lm_head (untied): next-token logits [B, T, VOCAB] of ids [B, T]."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.lm_head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, ids):
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]).expand(ids.shape[0], -1))
        for blk in self.blocks:
            h = blk(h)
        return self.lm_head(self.ln_f(h))


class Counter:
    """Counts ring-equivalent bytes sent per rank by the collectives of ``torch.distributed`` (patched)."""

    FACTORS = {
        "all_gather_into_tensor": ("out", 1),
        "all_gather_single": ("out", 1),
        "reduce_scatter_tensor": ("in", 1),
        "reduce_scatter_single": ("in", 1),
        "all_reduce": ("in", 2),
        "broadcast": ("in", None),
    }

    def __init__(self, world: int):
        self.world, self.bytes, self.by_op = world, 0.0, {}
        for name, (which, k) in self.FACTORS.items():
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn, which, k))

    def _wrap(self, name, fn, which, k):
        def counted(*args, **kwargs):
            t = args[0] if which == "out" or name in ("all_reduce", "broadcast") else args[1]
            n = t.numel() * t.element_size()
            sent = n if k is None else k * (self.world - 1) / self.world * n
            self.bytes += sent
            self.by_op[name] = self.by_op.get(name, 0.0) + sent
            return fn(*args, **kwargs)

        return counted


def _run(rank: int, world: int, tmp: str, mode: str, steps: int) -> None:
    from torch.distributed.fsdp import fully_shard

    import dpopt

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/rdv-{mode}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    counter = Counter(world)
    torch.manual_seed(0)
    model = TinyGPT()
    n_params = sum(p.numel() for p in model.parameters())
    if mode == "fsdp":
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
    ids = torch.randint(0, VOCAB, (512, T + 1), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=64)  # q = 1/8, B̄ = 64
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = dpopt.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            distributed="fsdp" if mode == "fsdp" else True,
        )
    per_step = []
    for t, (x, y) in enumerate(loader):
        if t >= steps:
            break
        before = counter.bytes
        opt.zero_grad()
        tokens = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), reduction="none")
        (tokens.reshape(x.shape[0], T).mean(1).sum() / max(x.shape[0], 1)).backward()  # mean of per-example losses
        opt.step()
        per_step.append(counter.bytes - before)
    if rank == 0:
        with open(f"{tmp}/{mode}.json", "w") as f:
            json.dump(
                {
                    "per_step": per_step,
                    "by_op": counter.by_op,
                    "params": n_params,
                    "collective": getattr(opt.privatizer.reduce, "collective", "all_reduce"),
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from dpopt.fsdp import bytes_per_step

    tmp = tempfile.mkdtemp()
    out = {}
    for mode in ("fsdp", "ddp"):
        mp.spawn(_run, args=(2, tmp, mode, args.steps), nprocs=2)
        with open(f"{tmp}/{mode}.json") as f:
            res = json.load(f)
        steady = res["per_step"][1:] or res["per_step"]
        out[mode] = {
            "bytes_per_step": sum(steady) / len(steady),
            "first_step": res["per_step"][0],
            "collective": res["collective"],
            "params": res["params"],
        }
    out["ratio"] = out["fsdp"]["bytes_per_step"] / out["ddp"]["bytes_per_step"]
    out["analytic_ratio"] = bytes_per_step([p for p in TinyGPT().parameters()], 2)["ratio"]
    if args.json:
        print(json.dumps(out))
    else:
        for mode in ("fsdp", "ddp"):
            r = out[mode]
            print(
                f"{mode:5s} {r['params']} params: {r['bytes_per_step'] / 1e6:.3f} MB sent per rank per step "
                f"(first step {r['first_step'] / 1e6:.3f} MB; release: {r['collective']})"
            )
        print(f"ratio fsdp/ddp {out['ratio']:.3f} (target <= 1.5; analytic {out['analytic_ratio']:.3f})")


if __name__ == "__main__":
    main()
