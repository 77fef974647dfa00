"""GPU checks of the per-sample engine, the DP step, transformers and FSDP (issues 14 and 23) in one command.

Under 10 minutes on one GPU (an H200: a few minutes). Six parts:

1. **Engine equality on the device** (fails the script). For ``mlp``, ``cnn5`` and ``wrn16-4`` from
   :func:`dpopt.models.build_model`, the fast engine
   (``dpopt.engine.iter_per_sample_sources(..., engine="fast")``) and the ``torch.func`` reference
   engine (``engine="reference"``) are given the same small batch on the device, and their
   per-sample squared norms ‖w_i‖² and clipped sums Σ_i min(1, C/‖w_i‖)·w_i are compared, each
   engine clipping with its own norms (what the Privatizer does with it), in two geometries: flat
   and a random AdaClip / DP-MacAdam shift/scale. C is the median reference norm, so about half
   the examples are clipped. Reported: the largest relative error of the norms, split by sign
   (``norms_over`` = max_i (a_i − b_i)/b_i, ``norms_under`` = max_i (b_i − a_i)/b_i, a = fast,
   b = reference; an *under*-estimate is the privacy-relevant direction: it would let a clipped
   example exceed C) and of the clipped sums (max over parameters of ‖a − b‖ / ‖b‖).
   The same comparison with K augmented views per example (``rows_per_example=K`` on both engines,
   issue 24) for ``cnn5-ws`` and ``wrn16-4-ws``: the fast engine's grouping of an example's K rows
   inside its layer rules (WS convolutions, GroupNorm, the Linear head) against the reference's
   per-row gradients averaged over each example's rows.
   Cases and tolerances (:func:`tolerances`):

   * float64 (where the device supports it), every model: 1e-9 for everything (the engine tests
     use 1e-9);
   * float32, ``cnn5`` (and ``wrn16-4`` on a GPU), TF32 disabled for the check: 1e-4 for
     everything in the flat geometry (float32 rounding of two different summation orders); in
     the shift/scale geometry 1e-4 below the reference but up to 3e-3 above it, and 3e-3 for the
     clipped sums — the fast engine may evaluate the T = 1 shifted closed form in float32 and
     return a rigorous *upper* bound of the norm (``dpopt.engine.shifted_norm``: at most
     2·RECHECK_RTOL = 2e-3 above the exact value), which clips slightly more, never less;
   * on CUDA also float32 ``cnn5`` with torch's *default* TF32 settings (cuDNN convolutions may
     use TF32 on Ampere and later): reported, never failed — it says whether the default
     precision stays within the engine's own first-batch verification tolerance for float32, 1e-3.

2. **Step-time ratios** (GPU only): DP-SGD / non-private and DP-MacAdam / DP-SGD on ``cnn5``
   (B = 512) and ``wrn16-4`` (B = 256), timed round-robin by ``benchmarks/step_time.py``'s
   functions with ``torch.cuda.synchronize()`` before the clock starts and before it stops.
   Reported, not failed (the issue's cnn5 targets: ≤ 1.3 and ≤ 2.5).

3. **Peak CUDA memory** (GPU only): ``torch.cuda.max_memory_allocated`` during one cnn5 DP-SGD
   step with a logical batch of 4096 in physical chunks of 256, against a plain B = 256 DP-SGD
   step and a non-private B = 256 step (each measured after a warm-up step, peak stats reset).

4. **Transformers, fast = reference** (fails the script). Tiny Hugging Face models built from
   configs (no download; dropout 0): a GPT-2 LM (``GPT2LMHeadModel``, its head tied to the token
   embedding; loss = each example's mean token cross-entropy, ``dpopt.losses.per_example_lm_loss``)
   and a BERT classifier (``BertForSequenceClassification`` with a padded example); per-sample
   squared norms and clipped sums (per parameter, relative to max(its own norm, 1e-6 × the whole
   gradient's): BERT's key biases have an exactly-zero gradient), flat geometry, fast against
   reference engine. Tolerances:
   float64 1e-9; float32 (TF32 off) 1e-3, the engine's own float32 verification tolerance
   (attention and LayerNorm sum in other orders than the single-example reference). Skipped,
   with the reason, without ``transformers``.

5. **Transformer step ratios and peak memory** (GPU only): the GPT-2-shaped model of
   ``benchmarks/transformer_step.py`` (4 blocks, d 256, T 128, vocab 8192, tied head) in full
   fine-tuning and with LoRA adapters (r 8 on qkv and proj, everything else frozen), B = 32:
   DP-SGD (dpopt's own loop door) / non-private step time, and ``torch.cuda.max_memory_allocated``
   of one step of each. Reported, not failed.

6. **FSDP smoke run** (GPU only: a world-size-1 NCCL process group in this process): the same
   GPT-2-shaped model with every block and the root ``fully_shard``-ed, trained 2 steps through
   ``PrivacyEngine.make_private(..., distributed="fsdp")`` at σ = 0 with reproducible masks, against
   the same 2 steps without FSDP: the final parameters must agree to rtol 1e-4 / atol 1e-5 (fails the
   script); then one σ = 1 step must complete; peak memory reported. (Two NCCL ranks need two GPUs:
   the distributed noise-once checks stay the CPU gloo tests.) ``run_fsdp_smoke`` also runs on the CPU
   with gloo (the CPU test's dry run).

Each part runs guarded: an exception in one is recorded in the JSON (``"error"``) and the others
still run, so one slip does not cost the GPU session.

``--device auto`` (default) uses CUDA when torch sees a GPU. Without one (CPU fallback), the
equality checks (parts 1 and 4) run on the CPU at a tiny size (a few examples; a few seconds) and
parts 2, 3, 5 and 6 are printed as SKIPPED. ``--json`` prints one JSON object as the last line. Exit code 1 if an
equality check exceeds its tolerance, 0 otherwise.

Usage::

    python benchmarks/gpu_check.py                  # auto: GPU if available, else the CPU fallback
    python benchmarks/gpu_check.py --device cuda --json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared CPUs; see step_time.py

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from dpopt.engine import iter_per_sample_sources  # noqa: E402
from dpopt.models import build_model  # noqa: E402
from dpopt.types import ClipGeometry  # noqa: E402

INPUT_SHAPES = {
    "mlp": (1, 28, 28),
    "mlp-small": (64,),
    "cnn5": (3, 32, 32),
    "wrn16-4": (3, 32, 32),
    "cnn5-ws": (3, 32, 32),
    "wrn16-4-ws": (3, 32, 32),
}
#: (model, dtype name, batch size, enforced[, K views per example]): on a GPU / in the CPU fallback.
#: With K, the batch has batch·K rows, example-major (augmentation multiplicity, issue 24).
GPU_CASES = [
    ("mlp", "float64", 32, True),
    ("cnn5", "float64", 16, True),
    ("wrn16-4", "float64", 8, True),
    ("cnn5", "float32", 16, True),
    ("wrn16-4", "float32", 8, True),
    ("cnn5", "float32+tf32", 16, False),
    ("cnn5-ws", "float64", 8, True, 4),
    ("wrn16-4-ws", "float64", 4, True, 4),
    ("cnn5-ws", "float32", 8, True, 4),
]
CPU_CASES = [
    ("mlp", "float64", 4, True),
    ("cnn5", "float64", 3, True),
    ("cnn5", "float32", 3, True),
    ("cnn5-ws", "float64", 2, True, 3),
]
TIMING = {"cnn5": 512, "wrn16-4": 256}
MEMORY = {"model": "cnn5", "logical": 4096, "physical": 256}
#: Part 4: (model, dtype name, batch, tokens, width) on a GPU / in the CPU fallback.
HF_GPU_CASES = [
    ("gpt2", "float64", 8, 32, 64),
    ("bert", "float64", 8, 32, 64),
    ("gpt2", "float32", 8, 32, 64),
    ("bert", "float32", 8, 32, 64),
]
HF_CPU_CASES = [("gpt2", "float64", 3, 6, 16), ("bert", "float64", 3, 6, 16)]
HF_VOCAB = 97
#: Part 5: the batch of the GPT-2-shaped step ratios; part 6: the FSDP smoke run's data and batch.
TRANSFORMER_BATCH = 32
FSDP_SMOKE = {"examples": 64, "batch": 16, "steps": 2}


# --------------------------------------------------------------------------- tolerances
def tolerances(dtype: torch.dtype, geometry: str) -> dict:
    """Largest allowed relative errors (module docstring) for one dtype and geometry."""
    if dtype == torch.float64:
        return {"norms_over": 1e-9, "norms_under": 1e-9, "clipped_sums": 1e-9}
    if geometry == "flat":
        return {"norms_over": 1e-4, "norms_under": 1e-4, "clipped_sums": 1e-4}
    return {"norms_over": 3e-3, "norms_under": 1e-4, "clipped_sums": 3e-3}


REPORTED_ONLY_TOLERANCE = 1e-3  # the engine's own float32 verification tolerance (dpopt.engine.fast._RTOL)


def loss_fn(out, target):
    return nn.functional.cross_entropy(out, target)


def _sibling_module(filename: str):
    """``benchmarks/<filename>``, loaded from its file (no ``sys.path`` change), once per process."""
    name = "dpopt_benchmarks_" + Path(filename).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(filename))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def step_time_module():
    """``benchmarks/step_time.py``, loaded from its file (no ``sys.path`` change), once."""
    return _sibling_module("step_time.py")


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``auto``: as ``step_time.py --device``."""
    return step_time_module().resolve_device(name)


def supports_float64(device: torch.device) -> bool:
    try:
        a = torch.ones(2, 2, dtype=torch.float64, device=device)
        return bool(torch.isfinite(a @ a).all())
    except (RuntimeError, TypeError):
        return False


@contextmanager
def tf32(enabled: Optional[bool]):
    """Set TF32 for matmuls and cuDNN (None: touch nothing, torch's settings apply); restore afterwards."""
    if enabled is None:
        yield
        return
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# --------------------------------------------------------------------------- 1. equality
def _rel_norm_errs(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(largest relative over-estimate, largest relative under-estimate) of a against b, both ≥ 0."""
    if not b.numel():
        return 0.0, 0.0
    a, b = a.double(), b.double()
    rel = (a - b) / b.abs().clamp_min(1e-30 + 1e-12 * float(b.abs().max()))
    return max(0.0, float(rel.max())), max(0.0, float((-rel).max()))


def _rel_sum_err(a: list, b: list) -> float:
    errs = []
    for x, y in zip(a, b):
        x, y = x.double(), y.double()
        errs.append(float((x - y).norm()) / max(float(y.norm()), 1e-300))
    return max(errs) if errs else 0.0


def equality_case(
    model_name: str, dtype: torch.dtype, batch: int, device: torch.device, seed: int = 0, views: int = 1
) -> dict:
    """Fast vs reference engine on one batch: largest relative errors of the norms and clipped sums.

    ``views`` = K > 1: ``batch`` examples of K rows each (``rows_per_example=K`` on both engines: the
    fast engine's grouping inside its layer rules against the reference's per-row gradients averaged).
    Runs inside ``torch.random.fork_rng`` (the caller's global RNG state is left as it was).
    """
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return _equality_case(model_name, dtype, batch, device, seed, views)


def _equality_case(
    model_name: str, dtype: torch.dtype, batch: int, device: torch.device, seed: int, views: int = 1
) -> dict:
    model = build_model(model_name).to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch * views, *INPUT_SHAPES[model_name], generator=g, dtype=dtype).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).repeat_interleave(views).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    shift = tuple((0.01 * torch.randn(p.shape, generator=g, dtype=dtype)).to(device) for p in params)
    scale = tuple((0.5 + torch.rand(p.shape, generator=g, dtype=dtype)).to(device) for p in params)
    groups = [0] * len(params)
    # Keep both iterators referenced while their first sources are in use (a fast source is freed
    # when its iterator moves on).
    it_fast = iter(iter_per_sample_sources(model, loss_fn, x, y, engine="fast", rows_per_example=views))
    it_ref = iter(iter_per_sample_sources(model, loss_fn, x, y, engine="reference", rows_per_example=views))
    fast, ref = next(it_fast), next(it_ref)
    out = {}
    for name, geo in (("flat", ClipGeometry()), ("shift-scale", ClipGeometry(shift, scale))):
        sq_f, sq_r = fast.sq_norms(geo, groups, 1)[:, 0], ref.sq_norms(geo, groups, 1)[:, 0]
        bound = sq_r.double().sqrt().median().to(sq_r.dtype)
        sums = []
        for src, sq in ((fast, sq_f), (ref, sq_r)):
            c = torch.clamp(bound / sq.clamp_min(0).sqrt().clamp_min(1e-30), max=1.0)
            sums.append(src.weighted_sum(c[:, None], geo, groups))
        over, under = _rel_norm_errs(sq_f, sq_r)
        out[name] = {"norms_over": over, "norms_under": under, "clipped_sums": _rel_sum_err(*sums)}
    del fast, ref, it_fast, it_ref
    return out


def run_equality(device: torch.device, cases) -> dict:
    has64 = supports_float64(device)
    results, passed = [], True
    for model_name, dtype_name, batch, enforced, *rest in cases:
        views = rest[0] if rest else 1
        use_tf32 = None if dtype_name.endswith("+tf32") else False
        dtype = torch.float64 if dtype_name == "float64" else torch.float32
        if dtype == torch.float64 and not has64:
            results.append({"model": model_name, "dtype": dtype_name, "skipped": "no float64 on this device"})
            continue
        t = time.perf_counter()
        with tf32(use_tf32 if device.type == "cuda" else None):
            errs = equality_case(model_name, dtype, batch, device, views=views)
        worst = max(v for geo in errs.values() for v in geo.values())
        if enforced:
            tol = {geo: tolerances(dtype, geo) for geo in errs}
            beyond = [
                f"{geo} {k} {v:.1e} > {tol[geo][k]:g}"
                for geo, e in errs.items()
                for k, v in e.items()
                if not v <= tol[geo][k]
            ]
            passed &= not beyond
            verdict = "ok" if not beyond else "FAIL: " + "; ".join(beyond)
        else:
            tol = REPORTED_ONLY_TOLERANCE
            beyond = [] if worst <= tol else [f"max {worst:.1e} > {tol:g}"]
            verdict = f"{'within' if not beyond else 'OUTSIDE'} {tol:g} (reported only)"
        results.append(
            {
                "model": model_name,
                "dtype": dtype_name,
                "batch": batch,
                "views": views,
                "errors": errs,
                "max_rel_error": worst,
                "tolerance": tol,
                "enforced": enforced,
                "ok": not beyond,
                "beyond": beyond,
                "seconds": round(time.perf_counter() - t, 3),
            }
        )
        f, ss = errs["flat"], errs["shift-scale"]
        print(
            f"  {model_name:8s} {dtype_name:13s} B = {batch:3d}{f' K = {views}' if views > 1 else ''}: max rel error {worst:.2e} "
            f"[flat: norms +{f['norms_over']:.1e}/-{f['norms_under']:.1e}, sums {f['clipped_sums']:.1e}; "
            f"shift-scale: norms +{ss['norms_over']:.1e}/-{ss['norms_under']:.1e}, sums "
            f"{ss['clipped_sums']:.1e}] {verdict}"
        )
    return {"passed": passed, "cases": results, "float64": has64}


# --------------------------------------------------------------------------- 2. timings
def run_timings(
    device: torch.device,
    models=tuple(TIMING),
    rounds: int = 3,
    per_round: int = 2,
    warmup: int = 2,
    batch_sizes: Optional[dict] = None,
) -> dict:
    st = step_time_module()
    out = {}
    for model_name in models:
        b = (batch_sizes or TIMING)[model_name]
        x, y = st.batch(model_name, b, device=device)
        steps = {
            "non-private": st.non_private_step(model_name, x, y),
            "dp-sgd": st.dpopt_step(model_name, "dp-sgd", x, y),
            "dp-macadam": st.dpopt_step(model_name, "dp-macadam", x, y),
        }
        res = st.time_round_robin(steps, rounds, per_round, warmup, sync=st.synchronizer(device))
        ms = {k: round(1e3 * v["median"], 2) for k, v in res.items()}
        r = {
            "batch": b,
            "ms": ms,
            "dp-sgd/non-private": res["dp-sgd"]["median"] / res["non-private"]["median"],
            "dp-macadam/dp-sgd": res["dp-macadam"]["median"] / res["dp-sgd"]["median"],
            "timed_steps": res["dp-sgd"]["n"],
        }
        print(
            f"  {model_name:8s} B = {b}: non-private {ms['non-private']:.1f} ms, dp-sgd {ms['dp-sgd']:.1f} ms, "
            f"dp-macadam {ms['dp-macadam']:.1f} ms; dp-sgd/non-private {r['dp-sgd/non-private']:.2f}, "
            f"dp-macadam/dp-sgd {r['dp-macadam/dp-sgd']:.2f}"
        )
        out[model_name] = r
        del steps, x, y
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- 3. CUDA memory
def _cuda_peak(make_step, device: torch.device) -> dict:
    """Peak allocated bytes during one step (after a warm-up step), and what was allocated before it."""
    step = make_step()
    step()  # warm-up: engine plan and verification, kernel choice, optimizer state
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del step
    gc.collect()
    torch.cuda.empty_cache()
    return {"peak_mib": peak / 2**20, "before_mib": before / 2**20, "step_mib": (peak - before) / 2**20}


def run_memory(device: torch.device) -> dict:
    st = step_time_module()
    m, big, phys = MEMORY["model"], MEMORY["logical"], MEMORY["physical"]
    configs = {
        f"dp-sgd {big} in chunks of {phys}": lambda: st.dpopt_step(
            m, "dp-sgd", *st.batch(m, big, device=device), physical=phys
        ),
        f"dp-sgd {phys}": lambda: st.dpopt_step(m, "dp-sgd", *st.batch(m, phys, device=device)),
        f"non-private {phys}": lambda: st.non_private_step(m, *st.batch(m, phys, device=device)),
    }
    mem = {name: _cuda_peak(make, device) for name, make in configs.items()}
    for name, v in mem.items():
        print(
            f"  {m} {name:28s}: peak {v['peak_mib']:8.1f} MiB ({v['before_mib']:.1f} MiB allocated before the "
            f"step, {v['step_mib']:.1f} MiB during it)"
        )
    a, b = mem[f"dp-sgd {big} in chunks of {phys}"], mem[f"dp-sgd {phys}"]
    out = {
        "mib": mem,
        "peak_4096_over_256": a["peak_mib"] / b["peak_mib"],
        "step_4096_over_256": a["step_mib"] / max(b["step_mib"], 1e-9),
    }
    print(
        f"  logical {big} / physical {phys} over B = {phys}: peak {out['peak_4096_over_256']:.3f}, "
        f"in-step {out['step_4096_over_256']:.3f}"
    )
    return out


# --------------------------------------------------------------------------- 4. transformers: fast = reference
class HFLogits(nn.Module):
    """A Hugging Face model as ``x -> logits``: ``x [B, T]`` ids, or ``[B, k, T]`` (ids, mask, token types)."""

    def __init__(self, hf: nn.Module, keys=("input_ids",)):
        super().__init__()
        self.hf, self.keys = hf, tuple(keys)

    def forward(self, x):
        if len(self.keys) == 1:
            return self.hf(**{self.keys[0]: x}).logits
        return self.hf(**dict(zip(self.keys, x.unbind(1)))).logits


def hf_case(name: str, batch: int, tokens: int, width: int, seed: int = 0):
    """(model, x, y, loss_fn) of a tiny GPT-2 LM or BERT classifier from a config (no download; dropout 0).

    GPT-2: ``x`` ids ``[B, T]``, ``y`` next-token targets with example 0's last two ignored (-100), loss =
    the example's mean token cross-entropy. BERT: ``x [B, 3, T]`` (ids, attention mask, token types),
    example 0 padded, 3 classes.
    """
    import transformers as T

    from dpopt.losses import per_example_lm_loss

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if name == "gpt2":
        cfg = T.GPT2Config(
            n_layer=2,
            n_embd=width,
            n_head=2,
            vocab_size=HF_VOCAB,
            n_positions=tokens,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        hf = T.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, HF_VOCAB, (batch, tokens), generator=g)
        y = ids.roll(-1, dims=1)
        y[0, -2:] = -100
        return HFLogits(hf).train(), ids, y, per_example_lm_loss
    cfg = T.BertConfig(
        vocab_size=HF_VOCAB,
        hidden_size=width,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * width,
        max_position_embeddings=tokens,
        type_vocab_size=2,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    model = HFLogits(T.BertForSequenceClassification(cfg), ("input_ids", "attention_mask", "token_type_ids"))
    ids = torch.randint(1, HF_VOCAB, (batch, tokens), generator=g)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[0, -2:] = 0
    ids[0, -2:] = 0
    types = torch.zeros(batch, tokens, dtype=torch.long)
    types[:, tokens // 2 :] = 1
    return model.train(), torch.stack([ids, mask, types], 1), torch.randint(0, 3, (batch,), generator=g), loss_fn


def _rel_sum_err_floored(a: list, b: list, floor: float = 1e-6) -> float:
    """max over parameters of ‖a_k − b_k‖ / max(‖b_k‖, floor·‖b‖).

    A parameter whose clipped sum is zero in exact arithmetic (BERT's attention key biases: softmax ignores
    a shift shared by every key) is compared relative to the whole gradient, not to its own float noise
    (~1e-22)."""
    total = math.sqrt(sum(float(y.double().norm()) ** 2 for y in b))
    return max(
        (
            float((x.double() - y.double()).norm()) / max(float(y.double().norm()), floor * total, 1e-300)
            for x, y in zip(a, b)
        ),
        default=0.0,
    )


def hf_tolerance(dtype: torch.dtype) -> float:
    """Part 4's largest allowed relative error (module docstring): 1e-9 in float64, 1e-3 in float32."""
    return 1e-9 if dtype == torch.float64 else 1e-3


def run_hf_equality(device: torch.device, cases) -> dict:
    """Part 4: fast vs reference engine on tiny HF models (flat geometry); ``passed`` False if any case fails."""
    if importlib.util.find_spec("transformers") is None:
        print("  SKIPPED: transformers is not installed (pip install dpopt[hf])")
        return {"passed": True, "skipped": "transformers is not installed", "cases": []}
    has64 = supports_float64(device)
    results, passed = [], True
    for name, dtype_name, batch, tokens, width in cases:
        dtype = torch.float64 if dtype_name == "float64" else torch.float32
        if dtype == torch.float64 and not has64:
            results.append({"model": name, "dtype": dtype_name, "skipped": "no float64 on this device"})
            continue
        t = time.perf_counter()
        with (
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
            tf32(False if device.type == "cuda" else None),
        ):
            model, x, y, lf = hf_case(name, batch, tokens, width)
            model = model.to(device=device, dtype=dtype)
            x, y = x.to(device), y.to(device)
            it_fast = iter(iter_per_sample_sources(model, lf, x, y, engine="fast"))
            it_ref = iter(iter_per_sample_sources(model, lf, x, y, engine="reference"))
            fast, ref = next(it_fast), next(it_ref)
            geo, groups = ClipGeometry(), [0] * fast.num_params
            sq_f, sq_r = fast.sq_norms(geo, groups, 1)[:, 0], ref.sq_norms(geo, groups, 1)[:, 0]
            bound = sq_r.double().sqrt().median().to(sq_r.dtype)
            sums = [
                src.weighted_sum(
                    torch.clamp(bound / sq.clamp_min(0).sqrt().clamp_min(1e-30), max=1.0)[:, None], geo, groups
                )
                for src, sq in ((fast, sq_f), (ref, sq_r))
            ]
            over, under = _rel_norm_errs(sq_f, sq_r)
            errs = {"norms_over": over, "norms_under": under, "clipped_sums": _rel_sum_err_floored(*sums)}
            del fast, ref, it_fast, it_ref
        tol = hf_tolerance(dtype)
        beyond = [f"{k} {v:.1e} > {tol:g}" for k, v in errs.items() if not v <= tol]
        passed &= not beyond
        results.append(
            {
                "model": name,
                "dtype": dtype_name,
                "batch": batch,
                "tokens": tokens,
                "width": width,
                "errors": errs,
                "tolerance": tol,
                "ok": not beyond,
                "beyond": beyond,
                "seconds": round(time.perf_counter() - t, 3),
            }
        )
        print(
            f"  {name:5s} {dtype_name:8s} B = {batch}, T = {tokens}, d = {width}: norms +{over:.1e}/-{under:.1e}, "
            f"sums {errs['clipped_sums']:.1e} {'ok' if not beyond else 'FAIL: ' + '; '.join(beyond)}"
        )
    return {"passed": passed, "cases": results}


# --------------------------------------------------------------------------- 5. transformer step ratios
def transformer_module():
    """``benchmarks/transformer_step.py``, loaded from its file once (its GPT-2-shaped model and loss)."""
    return _sibling_module("transformer_step.py")


def _lm_batch(ts, b: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ts.V, (b, ts.T + 1), generator=g)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def _lm_step(name: str, private: bool, b: int, device: torch.device):
    """A step of ``transformer_step.build(name)`` on ``device``: non-private SGD, or dpopt's dp-sgd (σ = C = 1)."""
    from dpopt.methods import make_optimizer

    ts = transformer_module()
    model = ts.build(name).to(device)
    x, y = _lm_batch(ts, b, device)
    params = [p for p in model.parameters() if p.requires_grad]
    if not private:
        opt = torch.optim.SGD(params, lr=0.1)

        def step():
            opt.zero_grad(set_to_none=True)
            ts.loss_fn(model(x), y).backward()
            opt.step()

        return step
    dp = make_optimizer(
        "dp-sgd",
        params,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=float(b),
        sample_rate=b / ts.N_DATA,
        dataset="synthetic",
    )

    def step():
        dp.step(iter_per_sample_sources(model, ts.loss_fn, x, y, None, dp.evaluation_points()))

    return step


def run_transformer_timings(
    device: torch.device,
    batch: int = TRANSFORMER_BATCH,
    rounds: int = 3,
    per_round: int = 2,
    warmup: int = 2,
    memory: bool = True,
) -> dict:
    """Part 5: DP-SGD / non-private of the GPT-2-shaped model, full fine-tuning and LoRA; peak CUDA memory."""
    st = step_time_module()
    out = {}
    for name, label in (("gpt2", "gpt2 full"), ("gpt2-lora", "gpt2 lora")):
        steps = {"non-private": _lm_step(name, False, batch, device), "dp-sgd": _lm_step(name, True, batch, device)}
        res = st.time_round_robin(steps, rounds, per_round, warmup, sync=st.synchronizer(device))
        ms = {k: round(1e3 * v["median"], 2) for k, v in res.items()}
        r = {"batch": batch, "ms": ms, "dp-sgd/non-private": res["dp-sgd"]["median"] / res["non-private"]["median"]}
        del steps
        gc.collect()
        if memory:
            r["peak_mib"] = {
                k: _cuda_peak(lambda k=k, name=name: _lm_step(name, k == "dp-sgd", batch, device), device)["peak_mib"]
                for k in ("non-private", "dp-sgd")
            }
            r["peak_dp/non-private"] = r["peak_mib"]["dp-sgd"] / r["peak_mib"]["non-private"]
        print(
            f"  {label:9s} B = {batch}: non-private {ms['non-private']:.1f} ms, dp-sgd {ms['dp-sgd']:.1f} ms, "
            f"ratio {r['dp-sgd/non-private']:.2f}"
            + (
                f"; peak {r['peak_mib']['non-private']:.0f} / {r['peak_mib']['dp-sgd']:.0f} MiB "
                f"({r['peak_dp/non-private']:.2f}x)"
                if memory
                else ""
            )
        )
        out[label] = r
    return out


# --------------------------------------------------------------------------- 6. FSDP smoke run
def _fsdp_train(sharded: bool, sigma: float, device: torch.device, steps: int) -> tuple[list, object]:
    """``FSDP_SMOKE`` steps of the GPT-2-shaped model through make_private (reproducible masks and noise)."""
    import warnings

    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    import dpopt

    ts = transformer_module()
    model = ts.build("gpt2").to(device)
    if sharded:
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)  # the root unit: embeddings, ln_f and the tied head
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ts.V, (FSDP_SMOKE["examples"], ts.T + 1), generator=g)
    data = TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    engine = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reproducible-noise warning
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=FSDP_SMOKE["batch"]),
            noise_multiplier=sigma,
            max_grad_norm=1.0,
            noise_generator=torch.Generator().manual_seed(2),
            distributed="fsdp" if sharded else False,
        )
    for t, (x, y) in enumerate(loader):
        if t >= steps:
            break
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        ts.loss_fn(model(x), y).backward()
        opt.step()
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone() for p in model.parameters()]
    return params, engine


def run_fsdp_smoke(device: torch.device, steps: int = FSDP_SMOKE["steps"]) -> dict:
    """Part 6: FSDP2 on a world-size-1 process group (NCCL on CUDA, gloo on the CPU) equals the plain run.

    Joins a one-rank group in this process (file-less ``HashStore``) unless one is initialised, and
    destroys it afterwards. ``passed``: σ = 0 parameters within rtol 1e-4 / atol 1e-5 of the plain run's
    and a σ = 1 step completed.
    """
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    try:
        t = time.perf_counter()
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        plain, _ = _fsdp_train(False, 0.0, device, steps)
        peak_plain = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        sharded, engine = _fsdp_train(True, 0.0, device, steps)
        peak_fsdp = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
        worst = max(float(((a - b).abs() / (1e-5 + 1e-4 * b.abs())).max()) for a, b in zip(sharded, plain))
        moved = any(not torch.equal(a, b) for a, b in zip(sharded, transformer_module().build("gpt2").parameters()))
        _, noisy_engine = _fsdp_train(True, 1.0, device, 1)
        out = {
            "backend": dist.get_backend(),
            "steps": steps,
            "ledger_steps": len(engine.ledger),
            "worst_over_tolerance": worst,
            "equal": worst <= 1.0,
            "trained": moved,
            "noisy_step_ledger": len(noisy_engine.ledger),
            "peak_mib_plain": peak_plain,
            "peak_mib_fsdp": peak_fsdp,
            "seconds": round(time.perf_counter() - t, 2),
        }
        out["passed"] = bool(out["equal"] and moved and out["ledger_steps"] == steps and out["noisy_step_ledger"] == 1)
        print(
            f"  world size 1 ({out['backend']}): {steps} steps sigma 0 FSDP vs plain: max |diff| / (1e-5 + 1e-4|x|) "
            f"= {worst:.2f} ({'ok' if out['equal'] else 'FAIL'}); a sigma-1 step: "
            f"{'ok' if out['noisy_step_ledger'] == 1 else 'FAIL'}"
            + (f"; peak {peak_plain:.0f} MiB plain, {peak_fsdp:.0f} MiB fsdp" if cuda else "")
        )
        return out
    finally:
        if own:
            dist.destroy_process_group()


def _guarded(report: dict, key: str, fn) -> None:
    """``report[key] = fn()``; an exception is recorded as ``{"error": ...}`` (and fails the script)."""
    try:
        report[key] = fn()
    except Exception as exc:  # noqa: BLE001 - a GPU session must not be lost to one part's slip
        import traceback

        traceback.print_exc()
        report[key] = {"error": f"{type(exc).__name__}: {exc}", "passed": False}
        print(f"  ERROR in {key}: {type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto (default: cuda if available), cuda or cpu")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument(
        "--threads", type=int, default=0, help="CPU threads for torch.set_num_threads (default: leave torch's setting)"
    )
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(
        f"gpu_check: device {device} ({name}), torch {torch.__version__}"
        + ("" if cuda else "; no CUDA device: CPU fallback at a tiny size")
    )
    report: dict = {"device": str(device), "device_name": name, "torch": torch.__version__, "skipped": []}

    print("1. fast vs reference engine (per-sample squared norms, clipped sums):")
    _guarded(report, "equality", lambda: run_equality(device, GPU_CASES if cuda else CPU_CASES))

    if cuda:
        print("2. step-time ratios (torch.cuda.synchronize around each timed step):")
        _guarded(report, "timings", lambda: run_timings(device))
        print(f"3. peak CUDA memory, {MEMORY['model']} DP-SGD (torch.cuda.max_memory_allocated):")
        _guarded(report, "memory", lambda: run_memory(device))
    else:
        report["skipped"] = ["timings (cnn5, wrn16-4)", "cuda memory"]
        print("2. step-time ratios on cnn5 and wrn16-4: SKIPPED (GPU only; no CUDA device)")
        print("3. peak CUDA memory: SKIPPED (GPU only; no CUDA device)")

    print("4. transformers (tiny HF GPT-2 and BERT from configs), fast vs reference engine:")
    _guarded(report, "transformers", lambda: run_hf_equality(device, HF_GPU_CASES if cuda else HF_CPU_CASES))
    if cuda:
        print("5. GPT-2-shaped step ratios (full fine-tuning, LoRA) and peak CUDA memory:")
        _guarded(report, "transformer_timings", lambda: run_transformer_timings(device))
        print("6. FSDP smoke run (world size 1, NCCL):")
        _guarded(report, "fsdp", lambda: run_fsdp_smoke(device))
    else:
        report["skipped"] += ["transformer timings", "fsdp (nccl)"]
        print("5. GPT-2-shaped step ratios and memory: SKIPPED (GPU only; no CUDA device)")
        print("6. FSDP smoke run: SKIPPED (GPU only: a world-size-1 NCCL group; the CPU gloo tests cover FSDP)")

    failed_parts = [
        k
        for k in ("equality", "transformers", "fsdp", "timings", "memory", "transformer_timings")
        if k in report and report[k].get("passed", True) is False
    ]
    report["failed_parts"] = failed_parts
    report["passed"] = not failed_parts
    report["seconds"] = round(time.perf_counter() - t0, 2)
    print(
        f"{'PASSED' if report['passed'] else 'FAILED'}: engine equality and FSDP checks "
        f"({'all within tolerance' if report['passed'] else 'failed: ' + ', '.join(failed_parts)}); "
        f"{report['seconds']:.1f} s"
    )
    if args.json:
        print(json.dumps(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
