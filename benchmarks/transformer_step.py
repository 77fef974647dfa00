"""Step time and peak memory of DP training on sequence models (issue 20), side by side in one run.

Models (built from ``torch.nn`` modules, sized for a 2-core CPU; synthetic token batches):

* ``gpt2`` — a GPT-2-shaped causal LM: 4 pre-norm blocks, d 256, 4 heads, MLP 4d, T 128,
  vocab 8192, learned positions (ids expanded to ``[B, T]``), output head **tied** to the token
  embedding; B = 8; loss = each example's mean token cross-entropy (the batch mean of those);
* ``gpt2-untied`` — the same with its own head (Opacus's ghost clipping cannot run tied weights:
  the Opacus comparison uses this one on both sides); its own entry (``--models gpt2-untied``) times
  both dpopt doors and Opacus on it;
* ``gpt2-lora`` / ``gpt2-lora-untied`` — the same with every weight frozen except LoRA adapters
  (r 8, α 16) on the attention projections (qkv and out) of every block;
* ``bert`` — a BERT-shaped classifier: ``nn.TransformerEncoder`` (4 ``TransformerEncoderLayer``,
  d 256, 4 heads, ``nn.MultiheadAttention`` inside, batch_first), T 128, B 8, 2 classes;
* ``lstm`` — an LSTM classifier (embedding 64, ``nn.LSTM(64, 128)``, T 32, B 64, 10 classes);
  Opacus runs its ``DPLSTM`` (the same shapes).

Configurations per model, timed round-robin (:func:`step_time.time_round_robin`):

* ``non-private`` — forward, backward, ``torch.optim.SGD``;
* ``dp-sgd`` — dpopt's own loop door (``iter_per_sample_sources`` + the ``dp-sgd`` optimizer);
* ``dp-sgd (PrivacyEngine)`` — the user-loop door (``dpopt.PrivacyEngine``, hook capture);
* ``opacus hooks`` / ``opacus ghost`` — Opacus 1.x ``grad_sample_mode`` (on the untied model
  for GPT-2; ``DPMultiheadAttention`` via ``ModuleValidator.fix`` for BERT; ``DPLSTM`` for the
  LSTM), C = 1, σ = 1.

JSON (``--json``, the last line): per model its ratios — ``dp-sgd/non-private``,
``privacy-engine/non-private``, ``dp-sgd/opacus-best`` (against the fastest Opacus mode, on the untied model
for GPT-2), ``privacy-engine/opacus-best`` where the PrivacyEngine ran on Opacus's model, each also as
``cpu:`` (process CPU time), ``peak_mem_dp/non-private`` and ``peak_mem_pe/non-private`` — plus the
medians (``ms``, ``cpu_ms``) and ``peak_mem_mib``. The default ``--models`` include ``gpt2-untied``, the
issue-34 entry (both doors and Opacus on one model).

Peak memory: each configuration in its own fresh subprocess, two steps, the kernel's high-water
mark of resident memory (``VmHWM``, :func:`step_time.peak_rss_kib`); ``peak_mem_dp/non-private``
and ``peak_mem_pe/non-private`` divide dpopt's ``dp-sgd`` and ``PrivacyEngine`` children by the
non-private child.

``--malloc-mmap-threshold BYTES`` fixes glibc's mmap threshold for every configuration (the timing
process by ``mallopt``, each memory child by ``MALLOC_MMAP_THRESHOLD_`` in its environment; the
non-private side included). glibc's threshold is otherwise dynamic (every freed mmapped block of up to
32 MiB raises it to its size), and dpopt's own 6–8 MiB float64 blocks of the GPT-2 shape then come from
the heap and fragment it (docs/performance.md, "The steady step's excess is glibc's dynamic mmap
threshold"). The JSON then carries ``malloc_mmap_threshold``.

Usage::

    nice -n 10 python benchmarks/transformer_step.py --json      # table, then one JSON line
    python benchmarks/transformer_step.py --models gpt2,gpt2-lora --rounds 3

``benchmarks/step_time.py --transformers`` adds the ``gpt2`` and ``gpt2-lora`` entries of this
benchmark to its own JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from step_time import peak_rss_kib  # noqa: E402  (also sets OMP_WAIT_POLICY)
from torch import nn  # noqa: E402

import dpopt  # noqa: E402
from dpopt.engine import iter_per_sample_sources  # noqa: E402
from dpopt.methods import make_optimizer  # noqa: E402

V, D, HEADS, LAYERS, T, B = 8192, 256, 4, 4, 128, 8
LSTM_T, LSTM_B, LSTM_V = 32, 64, 1000
N_DATA = 50_000  # public dataset size used for the sampling rate (accounting only)


# --------------------------------------------------------------------------- models
class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update: ``base(x) + (α/r)·B(A(x))`` (Hu et al. 2021)."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16.0):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Linear(base.in_features, r, bias=False)
        self.b = nn.Linear(r, base.out_features, bias=False)
        nn.init.zeros_(self.b.weight)
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + self.scale * self.b(self.a(x))


class Block(nn.Module):
    """Pre-norm GPT-2 block: x + proj(causal attention(ln1 x)), x + mlp(ln2 x)."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class MiniGPT(nn.Module):
    """GPT-2-shaped LM: token + position embeddings, blocks, final LayerNorm, (tied) head → logits [B, T, V]."""

    def __init__(self, tied: bool = True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        # GPT-2's initialisation (std 0.02 / 0.01): with nn.Embedding's N(0, 1) the tied head's logits had std 16
        # (softmax saturated, first loss 173 against ln V = 9.0), unlike a freshly initialised or trained GPT-2
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)  # [B, T]: per example
        x = self.wte(ids) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def with_lora(model: MiniGPT) -> MiniGPT:
    """Freeze everything, then LoRA (r 8) on every block's qkv and proj."""
    model.requires_grad_(False)
    for blk in model.blocks:
        blk.qkv, blk.proj = LoRALinear(blk.qkv), LoRALinear(blk.proj)
    return model


class Bert(nn.Module):
    """BERT-shaped classifier: embeddings + LayerNorm, nn.TransformerEncoder (MHA inside), first token → head."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.ln = nn.LayerNorm(D)
        layer = nn.TransformerEncoderLayer(D, HEADS, 4 * D, dropout=0.1, activation="gelu", batch_first=True)
        self.enc = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D, 2)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0], 1)
        return self.head(self.enc(self.ln(self.tok(ids) + self.pos(pos)))[:, 0])


class LSTMClassifier(nn.Module):
    """Embedding 64 → LSTM(64, 128) → last step → Linear(128, 10); ``opacus=True`` uses Opacus's DPLSTM."""

    def __init__(self, opacus: bool = False):
        super().__init__()
        self.emb = nn.Embedding(LSTM_V, 64)
        if opacus:
            from opacus.layers import DPLSTM

            self.rnn = DPLSTM(64, 128, batch_first=True)
        else:
            self.rnn = nn.LSTM(64, 128, batch_first=True)
        self.head = nn.Linear(128, 10)

    def forward(self, ids):
        return self.head(self.rnn(self.emb(ids))[0][:, -1])


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name.startswith("gpt2"):
        model = MiniGPT(tied="untied" not in name)
        return with_lora(model) if "lora" in name else model
    if name == "bert":
        return Bert()
    if name == "bert-opacus":  # Opacus needs its DPMultiheadAttention in place of nn.MultiheadAttention
        from opacus.validators import ModuleValidator

        return ModuleValidator.fix(Bert())
    if name in ("lstm", "lstm-opacus"):
        return LSTMClassifier(opacus=name == "lstm-opacus")
    raise ValueError(f"unknown model {name!r}")


def batch(name: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if name.startswith("gpt2"):
        ids = torch.randint(0, V, (B, T + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()  # next-token targets [B, T]
    if name.startswith("bert"):
        return torch.randint(0, V, (B, T), generator=g), torch.randint(0, 2, (B,), generator=g)
    return torch.randint(0, LSTM_V, (LSTM_B, LSTM_T), generator=g), torch.randint(0, 10, (LSTM_B,), generator=g)


def loss_fn(out, target):
    """Mean token cross-entropy of the examples given (for one example: its own mean; LM or classifier)."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


# --------------------------------------------------------------------------- steps
def non_private_step(name: str) -> Callable[[], None]:
    model, (x, y) = build(name), batch(name)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def dpopt_step(name: str) -> Callable[[], None]:
    """dpopt's own loop door: iter_per_sample_sources + the dp-sgd DPOptimizer (σ = 1, C = 1)."""
    model, (x, y) = build(name), batch(name)
    opt = make_optimizer(
        "dp-sgd",
        [p for p in model.parameters() if p.requires_grad],
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=float(len(y)),
        sample_rate=len(y) / N_DATA,
        dataset="synthetic",
    )

    def step():
        opt.step(iter_per_sample_sources(model, loss_fn, x, y, None, opt.evaluation_points()))

    return step


def _loader(x, y):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(y))


def privacy_engine_step(name: str) -> Callable[[], None]:
    """The user-loop door: dpopt.PrivacyEngine (hook capture), σ = 1, C = 1."""
    model, (x, y) = build(name), batch(name)
    params = [p for p in model.parameters() if p.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # poisson_sampling=False (fixed benchmark batch) is warned about
        model, opt, _ = dpopt.PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(params, lr=0.1),
            data_loader=_loader(x, y),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def opacus_step(name: str, mode: str) -> Optional[Callable[[], None]]:
    """Opacus DP-SGD (σ = 1, C = 1) in ``grad_sample_mode`` ``mode``; None without Opacus."""
    try:
        from opacus import PrivacyEngine
    except ImportError:
        return None
    warnings.filterwarnings("ignore", module="opacus")
    model, (x, y) = build(name), batch(name)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    kw = dict(
        module=model,
        optimizer=opt,
        data_loader=_loader(x, y),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode=mode,
    )
    if mode == "ghost":  # Opacus's sequence form: flattened tokens, shape= the logits' [B, T, V]
        model, opt, dp_loss, _ = PrivacyEngine(accountant="rdp").make_private(criterion=nn.CrossEntropyLoss(), **kw)

        def criterion(out, target):
            if out.dim() == 3:
                return dp_loss(out.reshape(-1, out.shape[-1]), target.reshape(-1), shape=out.shape)
            return dp_loss(out, target)
    else:
        model, opt, _ = PrivacyEngine(accountant="rdp").make_private(**kw)
        criterion = loss_fn

    def step():
        opt.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        opt.step()

    return step


def factory(name: str, config: str) -> Optional[Callable[[], None]]:
    if config == "non-private":
        return non_private_step(name)
    if config == "dp-sgd":
        return dpopt_step(name)
    if config == "dp-sgd (PrivacyEngine)":
        return privacy_engine_step(name)
    if config.startswith("opacus "):
        return opacus_step(name, config.split(" ", 1)[1])
    raise ValueError(config)


# --------------------------------------------------------------------------- timing
def time_round_robin(steps: dict, rounds: int, per_round: int, warmup: int) -> dict:
    """Per configuration: median and p10 wall seconds, and median CPU seconds of this process, per step.

    Round-robin (every configuration once per round) so that slow periods of a shared machine hit
    all alike. The CPU time (``time.process_time``: all threads of this process) is what a step costs
    in work; on a machine whose cores other processes also use, it is far less noisy than the wall
    clock (we ran at 1-minute load averages of 10-14 on 2 cores), so the ratios are given for both.
    """
    for f in steps.values():
        for _ in range(warmup):
            f()
    wall: dict = {k: [] for k in steps}
    cpu: dict = {k: [] for k in steps}
    for _ in range(rounds):
        for k, f in steps.items():
            for _ in range(per_round):
                t, c = time.perf_counter(), time.process_time()
                f()
                wall[k].append(time.perf_counter() - t)
                cpu[k].append(time.process_time() - c)
    out = {}
    for k in steps:
        w = sorted(wall[k])
        out[k] = {
            "median": statistics.median(w),
            "p10": w[int(0.1 * (len(w) - 1))],
            "n": len(w),
            "cpu": statistics.median(cpu[k]),
        }
    return out


# --------------------------------------------------------------------------- memory (subprocess)
def _trim_and_reset_peak() -> bool:
    """Return freed heap to the OS (glibc ``malloc_trim``) and reset ``VmHWM`` to the current RSS (Linux).

    So that a step's high-water mark is its own: without the trim, the first
    step's freed blocks stay resident and the second step's mark starts there.
    False where either is unavailable (the per-step figures are then omitted).
    """
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except (OSError, AttributeError):
        return False


def memory_child(spec: str, threads: int) -> None:
    """Child: ``model|config`` → two steps, print {"maxrss_kib": ..., "step_kib": [first, second]}.

    ``step_kib``: each step's own high-water mark of resident memory (heap
    trimmed and the mark reset before it, :func:`_trim_and_reset_peak`): the
    first step runs the first-batch check, the second is a steady step.
    ``maxrss_kib``: the larger of the two (the whole run's mark without resets).
    """
    torch.set_num_threads(threads)
    name, config = spec.split("|")
    f = factory(name, config)
    steps = []
    for _ in range(2):
        reset = _trim_and_reset_peak()
        f()
        steps.append(peak_rss_kib() if reset else None)
    out: dict = {"maxrss_kib": max(steps) if None not in steps else peak_rss_kib()}
    if None not in steps:
        out["step_kib"] = steps
    print(json.dumps(out))


def fix_mmap_threshold(nbytes: int) -> None:
    """Fix glibc's mmap threshold at ``nbytes`` here (``mallopt``) and in every memory child started later.

    The children read ``MALLOC_MMAP_THRESHOLD_`` from their environment at start-up (glibc's tunable;
    setting it also switches the dynamic threshold off, as ``mallopt`` does here).

    Raises:
        ValueError: ``nbytes`` outside 0..32 MiB (glibc's limit on 64-bit), or glibc refused it.
    """
    import ctypes

    if not 0 <= nbytes <= 32 << 20:
        raise ValueError(f"--malloc-mmap-threshold {nbytes}: glibc takes 0..{32 << 20} bytes")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(nbytes)
    try:
        ok = ctypes.CDLL(None).mallopt(-3, ctypes.c_int(nbytes)) == 1  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        ok = False
    if not ok:
        raise ValueError(f"--malloc-mmap-threshold {nbytes}: not glibc, or mallopt refused it")


def run_memory(name: str, config: str, threads: int) -> Optional[float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", f"{name}|{config}", "--threads", str(threads)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    except subprocess.CalledProcessError as err:
        print(f"note: memory child {name}|{config} failed: {err.stderr.strip().splitlines()[-1:]}")
        return None
    return json.loads(out)["maxrss_kib"] / 1024.0


# --------------------------------------------------------------------------- main
PLAN = {  # model → [(label, model to build, config)]
    "gpt2": [
        ("non-private", "gpt2", "non-private"),
        ("dp-sgd", "gpt2", "dp-sgd"),
        ("dp-sgd (PrivacyEngine)", "gpt2", "dp-sgd (PrivacyEngine)"),
        ("untied non-private", "gpt2-untied", "non-private"),
        ("untied dp-sgd", "gpt2-untied", "dp-sgd"),
        ("untied opacus hooks", "gpt2-untied", "opacus hooks"),
        ("untied opacus ghost", "gpt2-untied", "opacus ghost"),
    ],
    "bert": [
        ("non-private", "bert", "non-private"),
        ("dp-sgd", "bert", "dp-sgd"),
        ("dp-sgd (PrivacyEngine)", "bert", "dp-sgd (PrivacyEngine)"),
        ("opacus hooks", "bert-opacus", "opacus hooks"),
        ("opacus ghost", "bert-opacus", "opacus ghost"),
    ],
    "lstm": [
        ("non-private", "lstm", "non-private"),
        ("dp-sgd", "lstm", "dp-sgd"),
        ("dp-sgd (PrivacyEngine)", "lstm", "dp-sgd (PrivacyEngine)"),
        ("opacus hooks", "lstm-opacus", "opacus hooks"),
    ],
}
PLAN["gpt2-lora"] = [(k, m.replace("gpt2", "gpt2-lora"), c) for k, m, c in PLAN["gpt2"]]
PLAN["gpt2-untied"] = [  # the issue-34 entry: both dpopt doors and Opacus on the same (untied) model
    ("non-private", "gpt2-untied", "non-private"),
    ("dp-sgd", "gpt2-untied", "dp-sgd"),
    ("dp-sgd (PrivacyEngine)", "gpt2-untied", "dp-sgd (PrivacyEngine)"),
    ("opacus hooks", "gpt2-untied", "opacus hooks"),
    ("opacus ghost", "gpt2-untied", "opacus ghost"),
]


def memory_medians(
    configs: dict[str, tuple[str, str]], threads: int, runs: int
) -> tuple[dict[str, Optional[float]], dict[str, list[float]]]:
    """Each configuration's peak resident memory (MiB): the median of ``runs`` fresh children, the
    configurations interleaved (run k of every configuration before run k + 1 of any), and ``[min, max]``.

    Why several: a child's peak carries up to ≈ ±32 MiB of glibc heap layout that varies from process to
    process (whether a large backward buffer reuses resident free heap or gets fresh pages; the same seeds
    and inputs give either: docs/performance.md, "The kernels as a C extension"). A configuration whose
    children all failed gets None (and no range).
    """
    seen: dict[str, list[float]] = {label: [] for label in configs}
    for _ in range(max(1, runs)):
        for label, (name, config) in configs.items():
            v = run_memory(name, config, threads)
            if v is not None:
                seen[label].append(v)
    mem = {k: (statistics.median(v) if v else None) for k, v in seen.items()}
    spread = {k: [round(min(v), 1), round(max(v), 1)] for k, v in seen.items() if v}
    return mem, spread


def run_model(model: str, rounds: int, per_round: int, warmup: int, threads: int, memory: int, notes: list) -> dict:
    """Time one PLAN entry round-robin; return its ratios (and peak memory from subprocesses: ``memory`` children
    per configuration, 0 for none)."""
    steps = {}
    for label, name, config in PLAN[model]:
        try:
            f = factory(name, config)
        except Exception as exc:  # noqa: BLE001 — a configuration a library cannot run: say which, go on
            notes.append(f"{model} {label}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        if f is None:
            notes.append(f"{model} {label}: opacus not installed")
            continue
        steps[label] = f
    res = time_round_robin(steps, rounds, per_round, warmup)
    base = res["non-private"]["median"]
    print(
        f"\n{model}: {threads} threads, {res['non-private']['n']} timed steps each (round-robin), "
        f"1-min load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'configuration':28s} {'median ms':>10s} {'p10 ms':>9s} {'cpu ms':>9s} {'/ non-private':>14s} "
        f"{'cpu / np':>9s}"
    )
    for k, v in res.items():
        ref = res["untied non-private"] if k.startswith("untied") else res["non-private"]
        print(
            f"{k:28s} {1e3 * v['median']:10.1f} {1e3 * v['p10']:9.1f} {1e3 * v['cpu']:9.1f} "
            f"{v['median'] / ref['median']:14.2f} {v['cpu'] / ref['cpu']:9.2f}"
        )
    r: dict = {
        "dp-sgd/non-private": res["dp-sgd"]["median"] / base,
        "p10:dp-sgd/non-private": res["dp-sgd"]["p10"] / res["non-private"]["p10"],
        "cpu:dp-sgd/non-private": res["dp-sgd"]["cpu"] / res["non-private"]["cpu"],
        "ms": {k: round(1e3 * v["median"], 1) for k, v in res.items()},
        "cpu_ms": {k: round(1e3 * v["cpu"], 1) for k, v in res.items()},
        "threads": threads,
        "loadavg_1min": round(os.getloadavg()[0], 2),
    }
    if "dp-sgd (PrivacyEngine)" in res:
        r["privacy-engine/non-private"] = res["dp-sgd (PrivacyEngine)"]["median"] / base
        r["cpu:privacy-engine/non-private"] = res["dp-sgd (PrivacyEngine)"]["cpu"] / res["non-private"]["cpu"]
    opacus = {k: v for k, v in res.items() if "opacus" in k}
    if opacus:
        best = min(opacus, key=lambda k: opacus[k]["median"])
        mine = res["untied dp-sgd" if best.startswith("untied") else "dp-sgd"]
        r["opacus_best_mode"] = best
        r["dp-sgd/opacus-best"] = mine["median"] / opacus[best]["median"]
        best_cpu = min(opacus, key=lambda k: opacus[k]["cpu"])
        r["cpu:dp-sgd/opacus-best"] = mine["cpu"] / opacus[best_cpu]["cpu"]
        # the hook door against the same Opacus mode, where it ran on the same model (gpt2-untied, bert, lstm;
        # the gpt2 / gpt2-lora entries time the PrivacyEngine on the tied model only)
        hook = res.get("untied dp-sgd (PrivacyEngine)" if best.startswith("untied") else "dp-sgd (PrivacyEngine)")
        hook_cpu = res.get(
            "untied dp-sgd (PrivacyEngine)" if best_cpu.startswith("untied") else "dp-sgd (PrivacyEngine)"
        )
        if hook is not None:
            r["privacy-engine/opacus-best"] = hook["median"] / opacus[best]["median"]
        if hook_cpu is not None:
            r["cpu:privacy-engine/opacus-best"] = hook_cpu["cpu"] / opacus[best_cpu]["cpu"]
        print(
            f"dp-sgd / opacus-best ({best}, same model): wall {r['dp-sgd/opacus-best']:.2f}, "
            f"cpu {r['cpu:dp-sgd/opacus-best']:.2f} ({best_cpu})"
        )
    if memory:
        configs = {
            label: (name, config)
            for label, name, config in PLAN[model]
            if label in ("non-private", "dp-sgd", "dp-sgd (PrivacyEngine)") or "opacus" in label
        }
        mem, spread = memory_medians(configs, threads, memory)
        r["peak_mem_mib"] = {k: (round(v, 1) if v is not None else None) for k, v in mem.items()}
        r["peak_mem_range_mib"] = spread
        r["memory_runs"] = memory
        if mem.get("dp-sgd") and mem.get("non-private"):
            r["peak_mem_dp/non-private"] = mem["dp-sgd"] / mem["non-private"]
        if mem.get("dp-sgd (PrivacyEngine)") and mem.get("non-private"):
            r["peak_mem_pe/non-private"] = mem["dp-sgd (PrivacyEngine)"] / mem["non-private"]
        print(
            f"peak resident memory (VmHWM, MiB, own subprocess each; median of {memory} [min–max]): "
            + ", ".join(f"{k} {v:.0f} [{spread[k][0]:.0f}–{spread[k][1]:.0f}]" for k, v in mem.items() if v is not None)
        )
    return r


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2-untied,gpt2,gpt2-lora,bert,lstm")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument(
        "--memory-runs",
        type=int,
        default=3,
        help="fresh memory children per configuration; their median is the figure (glibc's heap layout moves a "
        "single child's peak by up to ≈ 32 MiB)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="fix glibc's mmap threshold (0..32 MiB) in every configuration, non-private included "
        "(mallopt here, MALLOC_MMAP_THRESHOLD_ in the memory children); default: glibc's dynamic one",
    )
    ap.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.malloc_mmap_threshold is not None:
        fix_mmap_threshold(args.malloc_mmap_threshold)
    if args.memory_child:
        memory_child(args.memory_child, args.threads)
        return {}
    notes: list[str] = []
    result = {
        m: run_model(
            m, args.rounds, args.per_round, args.warmup, args.threads, 0 if args.no_memory else args.memory_runs, notes
        )
        for m in args.models.split(",")
        if m
    }
    for note in notes:
        print("note:", note)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
