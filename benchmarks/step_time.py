"""Step time and peak memory of DP training steps, side by side in one process.

Measures, on the MNIST MLP (784-1000-10, B = 256) and the CIFAR-10 ``cnn5``
(B = 512), the median wall-clock time of one optimizer step for

* non-private SGD (forward + backward + ``torch.optim.SGD`` update, same batch),
* the floor of a DP step: that non-private step plus one draw of the noise of every parameter
  (dpopt's tail-preserving float64 sampler; ``floor/non-private`` in the JSON),
* dpopt DP-SGD, DP-MacAdam and DP-Muon (``dpopt.engine`` fast path),
* Opacus DP-SGD in each ``grad_sample_mode``: ``hooks``, ``ghost`` (ghost clipping) and
  ``functorch`` (skipped if Opacus is absent); ``dp-sgd/opacus-best`` compares with the fastest
  (``cpu:dp-sgd/opacus-best``: in CPU time per step, with the mode that used the least),
* a plain ``torch.func`` vmap DP-SGD step (the hand-written baseline),

and prints ratios to the non-private step. Configurations are timed
round-robin (R rounds × K steps each), so slow periods of a shared machine
hit every configuration alike; the median and the 10th percentile of the
per-step times are reported. Also: the Newton–Schulz share of a DP-Muon step
on cnn5 (time inside ``orthogonalize`` / step time), and the peak resident
memory of cnn5 DP-SGD with a logical batch of 4096 in physical chunks of 256
against a plain B = 256 step.

Peak memory: torch's CPU allocations are invisible to ``tracemalloc`` and the
default CPU allocator keeps no statistics, so each memory configuration runs
in its own fresh subprocess and reports the kernel's high-water mark of its
resident memory (``VmHWM`` in ``/proc/self/status``; see :func:`peak_rss_kib`
for why not ``ru_maxrss``), which includes every allocation of the process.
A child that only imports, builds the model and the batch gives the baseline.

Usage::

    python benchmarks/step_time.py              # table
    python benchmarks/step_time.py --json       # table, then one JSON line (last line)
    python benchmarks/step_time.py --all-methods --models mlp   # every registered method / non-private
    python benchmarks/step_time.py --device cuda --models cnn5,wrn16-4 --no-opacus   # on a GPU
    nice -n 10 python benchmarks/step_time.py --models "" --transformers --json   # gpt2, gpt2-lora entries
    nice -n 10 python benchmarks/step_time.py --models mlp --compile --json   # compiled vs eager dp-sgd

``--compile [BACKEND]`` (default backend ``inductor``) times only non-private, eager ``dp-sgd`` and
``dp-sgd`` with ``compile=BACKEND`` (:mod:`dpopt.engine.compiled`), side by side, and reports the first
compiled step (compilation + the first-batch check on the compiled path) separately from the steady state
(``compiled/eager`` in the JSON; ``compile_seconds``, ``eager_first_step_seconds``).

``--device cpu|cuda|auto`` (default ``cpu``; ``auto`` = ``cuda`` when available): models and
batches live on that device, and on CUDA every timed step is bracketed by
``torch.cuda.synchronize()`` (kernels run asynchronously, so an unsynchronised wall clock
measures the launches, not the work); the memory children then report
``torch.cuda.max_memory_allocated`` (``cuda_peak_kib``) and the 4096/256 ratio uses it.
``benchmarks/gpu_check.py`` runs the GPU checks with these functions.

Inputs are synthetic tensors of the datasets' shapes (step time does not
depend on pixel values); labels are uniform over 10 classes.
"""

from __future__ import annotations

import os

# Shared CPUs: with OpenMP's default spin-waiting, a 2-thread torch op stalls whenever another
# process holds one of the cores (we measured 5-80x slower tiny ops on this machine). Sleeping
# waits fix that and cost nothing measurable on an idle machine. Must be set before torch loads;
# an explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from typing import Callable, Iterator, Optional  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from dpopt.engine import iter_per_sample_sources  # noqa: E402
from dpopt.methods import get_method, list_methods, make_optimizer  # noqa: E402
from dpopt.models import build_model  # noqa: E402

SHAPES = {
    "mlp": ((1, 28, 28), 256, 60_000, "mnist"),
    "cnn5": ((3, 32, 32), 512, 50_000, "cifar10"),
    "wrn16-4": ((3, 32, 32), 256, 50_000, "cifar10"),
}
EPOCHS_MNIST = 5


# the function itself, as a user passes it: dpopt's engine computes its per-example losses in one batched
# call (dpopt.engine.row_losses; a def wrapping it would keep torch.func.vmap of the single-row call)
loss_fn = nn.functional.cross_entropy


def batch(model_name: str, b: int, seed: int = 0, device="cpu"):
    """Synthetic inputs and labels, drawn on the CPU (the same values on every device), then moved."""
    shape, _, _, _ = SHAPES[model_name]
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(b, *shape, generator=g), torch.randint(0, 10, (b,), generator=g)
    return (x, y) if torch.device(device).type == "cpu" else (x.to(device), y.to(device))


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``auto`` (``cuda`` if available, else ``cpu``); ``cuda`` without a GPU is an error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but torch sees no CUDA device")
    return torch.device(name)


def synchronizer(device) -> Optional[Callable[[], None]]:
    """``torch.cuda.synchronize`` for a CUDA device (kernels are asynchronous), None on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None


# --------------------------------------------------------------------------- step factories
def non_private_step(model_name: str, x, y) -> Callable[[], None]:
    torch.manual_seed(0)
    model = build_model(model_name).to(x.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def floor_step(model_name: str, x, y) -> Callable[[], None]:
    """The floor of a DP step: the non-private step plus ONE Gaussian draw of every parameter's noise
    (dpopt's tail-preserving sampler, float64, as the Privatizer draws it) — the GEMMs and the noise,
    nothing per example."""
    from dpopt.noise import NoiseSource

    step = non_private_step(model_name, x, y)
    d = sum(p.numel() for p in build_model(model_name).parameters() if p.requires_grad)
    src = NoiseSource("secret")
    device = x.device

    def floor():
        step()
        if device.type == "cpu" and hasattr(src, "start_normal"):
            src.start_normal(d).consume()
        else:
            src.normal((d,), dtype=torch.float64, device=device)

    return floor


def dpopt_step(
    model_name: str,
    method: str,
    x,
    y,
    physical: Optional[int] = None,
    engine: str = "fast",
    compile: object = False,
) -> Callable[[], None]:
    _, b, n, dataset = SHAPES[model_name]
    torch.manual_seed(0)
    model = build_model(model_name).to(x.device)
    opt = make_optimizer(
        method,
        [p for p in model.parameters() if p.requires_grad],
        noise_multiplier=1.0,
        expected_batch_size=float(x.shape[0]),
        sample_rate=x.shape[0] / n,
        dataset=dataset,
        generator=torch.Generator().manual_seed(0),
    )

    def step():
        opt.step(
            iter_per_sample_sources(
                model, loss_fn, x, y, physical, opt.evaluation_points(), engine=engine, compile=compile
            )
        )

    return step


OPACUS_MODES = ("hooks", "ghost", "functorch")

#: The two UserWarnings an Opacus run prints here, as (category, regex matched at the message's start):
#: torch's full-backward-hook warning, which Opacus's hooks fire on every backward pass (the first layer's
#: input, the batch, does not require grad; warned once per call site, attributed to this script in
#: ``hooks``/``functorch`` mode and to Opacus in ``ghost`` mode), and Opacus's notice that its secure RNG is
#: off (``PrivacyEngine()``; the benchmark times the default). Only these are silenced: any other warning of a
#: run still prints.
OPACUS_QUIET = (
    (UserWarning, re.escape("Full backward hook is firing when gradients are computed with respect to module outputs")),
    (UserWarning, re.escape("Secure RNG turned off.")),
)


@contextlib.contextmanager
def opacus_quiet() -> Iterator[None]:
    """Within the block, ignore exactly the warnings of :data:`OPACUS_QUIET` (category and message prefix);
    the warning filters are restored on exit (``warnings.catch_warnings``)."""
    with warnings.catch_warnings():
        for category, message in OPACUS_QUIET:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def opacus_step(model_name: str, x, y, mode: str = "hooks") -> Optional[Callable[[], None]]:
    """Opacus DP-SGD step (same model, batch, C = 1, σ = 1) in ``grad_sample_mode`` ``mode``:
    ``hooks`` (materialises per-sample gradients), ``ghost`` (ghost clipping: per-sample norms
    without per-sample gradients, two backward passes) or ``functorch`` (vmap per-sample grads)."""
    try:
        from opacus import PrivacyEngine
    except ImportError:
        return None
    torch.manual_seed(0)
    model = build_model(model_name).to(x.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=x.shape[0])
    kw = dict(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode=mode,
    )
    with opacus_quiet():
        engine = PrivacyEngine(accountant="rdp")
        if mode == "ghost":
            model, opt, criterion, _ = engine.make_private(criterion=nn.CrossEntropyLoss(), **kw)
        else:
            model, opt, _ = engine.make_private(**kw)
            criterion = loss_fn

    def step():
        opt.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        opt.step()

    return step


def vmap_dpsgd_step(model_name: str, x, y) -> Callable[[], None]:
    """A plain ``torch.func`` DP-SGD step (vmap(grad) per-sample gradients, flat clip, Gaussian noise,
    SGD update) — the baseline a user writes by hand; no ledger, no checks."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = build_model(model_name).to(x.device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    gen = torch.Generator(device=x.device).manual_seed(0)
    b = x.shape[0]

    def one(p, xi, yi):
        return loss_fn(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_sample = vmap(grad(one), in_dims=(None, 0, 0))

    def step():
        g = per_sample(params, x, y)
        norms = torch.sqrt(sum(t.reshape(b, -1).pow(2).sum(1) for t in g.values()))
        w = (1.0 / norms.clamp_min(1e-12)).clamp(max=1.0)
        for k, t in g.items():
            s = torch.einsum("b,b...->...", w, t)
            s.add_(torch.randn(s.shape, generator=gen, device=s.device))
            params[k].sub_(s, alpha=0.1 / b)

    return step


class NSTimer:
    """Wraps ``dpopt.transforms.muon.orthogonalize`` to accumulate the seconds spent in it."""

    def __init__(self):
        import dpopt.transforms.muon as muon

        self.muon, self.inner, self.seconds = muon, muon.orthogonalize, 0.0

        def timed(*args, **kw):
            t = time.perf_counter()
            out = self.inner(*args, **kw)
            self.seconds += time.perf_counter() - t
            return out

        muon.orthogonalize = timed

    def restore(self):
        self.muon.orthogonalize = self.inner


# --------------------------------------------------------------------------- timing
def time_round_robin(
    steps: dict[str, Callable[[], None]],
    rounds: int,
    per_round: int,
    warmup: int,
    probes: Optional[dict[str, Callable[[], float]]] = None,
    sync: Optional[Callable[[], None]] = None,
) -> dict[str, dict]:
    """Median / p10 seconds per step of each configuration, timed round-robin.

    Also the median process CPU time per step (``cpu_median``: all threads of this process,
    ``time.process_time``), which a loaded machine inflates far less than wall time.

    ``probes[name]()`` (optional) returns a cumulative counter (e.g. NS seconds);
    its per-step increments are recorded alongside. ``sync`` (e.g. :func:`synchronizer`
    on CUDA) is called before the clock starts and before it stops, so that each step's
    asynchronous work is inside its own interval.
    """
    sync = sync or (lambda: None)
    for _name, f in steps.items():
        for _ in range(warmup):
            f()
    times: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    extra: dict[str, list[float]] = {k: [] for k in (probes or {})}
    for _ in range(rounds):
        for name, f in steps.items():
            for _ in range(per_round):
                before = probes[name]() if probes and name in probes else 0.0
                sync()
                t, c = time.perf_counter(), time.process_time()
                f()
                sync()
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
                if probes and name in probes:
                    extra[name].append(probes[name]() - before)
    out = {}
    for k, v in times.items():
        v = sorted(v)
        out[k] = {
            "median": statistics.median(v),
            "p10": v[int(0.1 * (len(v) - 1))],
            "n": len(v),
            "cpu_median": statistics.median(cpu[k]),
        }
        if k in extra:
            out[k]["probe_median"] = statistics.median(extra[k])
            out[k]["probe_share"] = statistics.median([e / t for e, t in zip(extra[k], times[k])])
    return out


def compile_run(model_name: str, x, y, backend: str, args, device) -> dict:
    """Non-private, eager dp-sgd and compiled dp-sgd side by side; the first step of each dp-sgd timed apart."""
    eager = dpopt_step(model_name, "dp-sgd", x, y)
    comp = dpopt_step(model_name, "dp-sgd", x, y, compile=backend)
    t = time.perf_counter()
    eager()  # the first step runs the first-batch check
    eager_first = time.perf_counter() - t
    t = time.perf_counter()
    comp()  # compilation and the first-batch check on the compiled path
    compile_s = time.perf_counter() - t
    steps = {"non-private": non_private_step(model_name, x, y), "dp-sgd": eager, f"dp-sgd compiled ({backend})": comp}
    res = time_round_robin(steps, args.rounds, args.per_round, args.warmup, None, synchronizer(device))
    base, dp, cp = (res[k] for k in steps)
    load = os.getloadavg()[0]
    print(
        f"\n{model_name}: B = {x.shape[0]}, {args.threads} threads, {base['n']} timed steps each (round-robin); "
        f"1-min load average {load:.1f} on {os.cpu_count()} CPUs"
    )
    for k, v in res.items():
        print(f"{k:32s} {1e3 * v['median']:10.1f} ms  / non-private {v['median'] / base['median']:5.2f}")
    print(
        f"compiled / eager dp-sgd: {cp['median'] / dp['median']:.2f} (cpu {cp['cpu_median'] / dp['cpu_median']:.2f}); "
        f"first compiled step (compile + check) {compile_s:.1f} s, first eager step (check) {eager_first:.1f} s"
    )
    return {
        "compiled/eager": cp["median"] / dp["median"],
        "cpu:compiled/eager": cp["cpu_median"] / dp["cpu_median"],
        "dp-sgd/non-private": dp["median"] / base["median"],
        "compiled/non-private": cp["median"] / base["median"],
        "compile_seconds": round(compile_s, 2),
        "eager_first_step_seconds": round(eager_first, 2),
        "backend": backend,
        "ms": {k: round(1e3 * v["median"], 2) for k, v in res.items()},
        "threads": args.threads,
        "loadavg_1min": round(load, 2),
    }


# --------------------------------------------------------------------------- memory (subprocess)
def memory_child(spec: str, threads: int, device="cpu") -> None:
    """Child process: ``model:config:B:P`` → run 2 steps, print {"maxrss_kib": ...}
    (and ``"cuda_peak_kib"``, ``torch.cuda.max_memory_allocated``, on a CUDA device)."""
    torch.set_num_threads(threads)
    model_name, config, b, p = spec.split(":")
    b, p = int(b), (int(p) if p != "none" else None)
    x, y = batch(model_name, b, device=device)
    if config == "baseline":
        build_model(model_name).to(device)
    elif config == "non-private":
        f = non_private_step(model_name, x, y)
        f(), f()
    else:
        f = dpopt_step(model_name, config, x, y, physical=p)
        f(), f()
    out = {"maxrss_kib": peak_rss_kib()}
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        out["cuda_peak_kib"] = torch.cuda.max_memory_allocated(device) // 1024
    print(json.dumps(out))


def peak_rss_kib() -> int:
    """Peak resident memory of this process in KiB.

    ``VmHWM`` from ``/proc/self/status`` (Linux): the high-water mark of the
    process's current address space, which starts afresh at ``execve``.
    ``ru_maxrss`` is the fallback elsewhere; on Linux it is NOT used because
    it carries the parent's peak over fork + exec (we saw every child report
    the benchmark parent's 3.7 GB).
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run_memory(spec: str, threads: int, device="cpu") -> float:
    """Peak memory (MiB) of a fresh child running ``spec``: resident (VmHWM) on the CPU,
    ``torch.cuda.max_memory_allocated`` on a CUDA device."""
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", spec, "--threads", str(threads)]
    cuda = torch.device(device).type == "cuda"
    if cuda:
        cmd += ["--device", str(device)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    return json.loads(out)["cuda_peak_kib" if cuda else "maxrss_kib"] / 1024.0  # MiB


# --------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,cnn5")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument(
        "--all-methods", action="store_true", help="MLP: time every registered method (DP step / non-private step)"
    )
    ap.add_argument("--no-opacus", action="store_true")
    ap.add_argument("--no-vmap", action="store_true", help="skip the plain torch.func vmap DP-SGD baseline")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--reference", action="store_true", help="also time the torch.func reference engine")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, or auto (cuda if available)")
    ap.add_argument(
        "--transformers",
        action="store_true",
        help="also run benchmarks/transformer_step.py's gpt2 and gpt2-lora entries (CPU)",
    )
    ap.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        help="time only non-private, dp-sgd and dp-sgd compiled with this torch.compile backend (default inductor)",
    )
    ap.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if args.memory_child:
        memory_child(args.memory_child, args.threads, device)
        return {}

    result: dict[str, dict] = {}
    notes: list[str] = []
    try:
        get_method("dp-muon")
        have_muon = True
    except ValueError:
        have_muon = False
        notes.append("dp-muon is not registered in dpopt.methods: skipped")
    for model_name in [m for m in args.models.split(",") if m]:
        _, b, n, _ = SHAPES[model_name]
        x, y = batch(model_name, b, device=device)
        if args.compile:
            result[model_name] = compile_run(model_name, x, y, args.compile, args, device)
            continue
        steps: dict[str, Callable[[], None]] = {
            "non-private": non_private_step(model_name, x, y),
            "floor: non-private + noise": floor_step(model_name, x, y),
            "dp-sgd": dpopt_step(model_name, "dp-sgd", x, y),
            "dp-macadam": dpopt_step(model_name, "dp-macadam", x, y),
        }
        probes = {}
        ns = None
        if have_muon:
            steps["dp-muon"] = dpopt_step(model_name, "dp-muon", x, y)
            ns = NSTimer()
            probes["dp-muon"] = lambda ns=ns: ns.seconds
        if args.all_methods:
            for spec in list_methods():
                if spec.name not in steps:
                    steps[spec.name] = dpopt_step(model_name, spec.name, x, y)
        if not args.no_opacus:
            for mode in OPACUS_MODES:
                try:
                    op = opacus_step(model_name, x, y, mode)
                except Exception as exc:  # a mode this Opacus version or model does not support
                    notes.append(f"opacus {mode}: {type(exc).__name__}: {exc}")
                    continue
                if op is None:
                    notes.append("opacus not installed: `pip install -e .[bench]`")
                    break
                steps[f"opacus {mode}"] = op
        if not args.no_vmap:
            steps["torch.func vmap dp-sgd"] = vmap_dpsgd_step(model_name, x, y)
        if args.reference:
            steps["dp-sgd (reference engine)"] = dpopt_step(model_name, "dp-sgd", x, y, engine="reference")
        with opacus_quiet():  # around the whole loop, not inside Opacus's step: no cost in its timed steps
            res = time_round_robin(steps, args.rounds, args.per_round, args.warmup, probes, synchronizer(device))
        if ns is not None:
            ns.restore()
        base = res["non-private"]["median"]
        load = os.getloadavg()[0]
        on = f", device {device}" if device.type != "cpu" else ""
        print(
            f"\n{model_name}: B = {b}, {args.threads} threads{on}, {res['non-private']['n']} timed steps each "
            f"(round-robin); OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; 1-min load average "
            f"{load:.1f} on {os.cpu_count()} CPUs"
        )
        print(
            f"{'configuration':28s} {'median ms':>10s} {'p10 ms':>9s} {'/ non-private':>14s} {'/ dp-sgd':>9s} "
            f"{'cpu ms':>8s} {'cpu / np':>9s}"
        )
        for k, v in res.items():
            print(
                f"{k:28s} {1e3 * v['median']:10.1f} {1e3 * v['p10']:9.1f} {v['median'] / base:14.2f} "
                f"{v['median'] / res['dp-sgd']['median']:9.2f} {1e3 * v['cpu_median']:8.1f} "
                f"{v['cpu_median'] / res['non-private']['cpu_median']:9.2f}"
            )
        r = {
            "dp-sgd/non-private": res["dp-sgd"]["median"] / base,
            "dp-macadam/dp-sgd": res["dp-macadam"]["median"] / res["dp-sgd"]["median"],
            "p10:dp-sgd/non-private": res["dp-sgd"]["p10"] / res["non-private"]["p10"],
            "p10:dp-macadam/dp-sgd": res["dp-macadam"]["p10"] / res["dp-sgd"]["p10"],
            "floor/non-private": res["floor: non-private + noise"]["median"] / base,
            "ms": {k: round(1e3 * v["median"], 2) for k, v in res.items()},
            "cpu_ms": {k: round(1e3 * v["cpu_median"], 2) for k, v in res.items()},
            "cpu:dp-sgd/non-private": res["dp-sgd"]["cpu_median"] / res["non-private"]["cpu_median"],
            "cpu:dp-macadam/dp-sgd": res["dp-macadam"]["cpu_median"] / res["dp-sgd"]["cpu_median"],
            "threads": args.threads,
            "loadavg_1min": round(load, 2),
        }
        if device.type != "cpu":
            r["device"] = str(device)
        opacus = {k: v["median"] for k, v in res.items() if k.startswith("opacus ")}
        if opacus:
            best = min(opacus, key=opacus.get)
            r["opacus_best_mode"] = best.split(" ", 1)[1]
            r["dp-sgd/opacus-best"] = res["dp-sgd"]["median"] / opacus[best]
            r["dp-sgd/opacus"] = {k.split(" ", 1)[1]: res["dp-sgd"]["median"] / v for k, v in opacus.items()}
            # CPU time as transformer_step.py's ``cpu:`` keys: against the mode with the least CPU per step, which
            # a loaded machine inflates far less than wall time (it may differ from the wall-time best)
            best_cpu = min(opacus, key=lambda k: res[k]["cpu_median"])
            r["opacus_best_cpu_mode"] = best_cpu.split(" ", 1)[1]
            r["cpu:dp-sgd/opacus-best"] = res["dp-sgd"]["cpu_median"] / res[best_cpu]["cpu_median"]
            cpu_mode = "" if best_cpu == best else f" ({best_cpu})"  # named again only where it differs
            print(
                f"dp-sgd / opacus-best ({best}): wall {r['dp-sgd/opacus-best']:.2f}, "
                f"cpu {r['cpu:dp-sgd/opacus-best']:.2f}{cpu_mode}"
            )
        if "torch.func vmap dp-sgd" in res:
            r["dp-sgd/vmap"] = res["dp-sgd"]["median"] / res["torch.func vmap dp-sgd"]["median"]
        if "dp-muon" in res:
            r["dp-muon/dp-sgd"] = res["dp-muon"]["median"] / res["dp-sgd"]["median"]
            r["ns_share"] = res["dp-muon"]["probe_share"]
            print(
                f"Newton–Schulz share of a DP-Muon step: {100 * r['ns_share']:.2f}% "
                f"({1e3 * res['dp-muon']['probe_median']:.1f} ms of {1e3 * res['dp-muon']['median']:.1f} ms)"
            )
        if model_name == "mlp":
            steps_5 = max(1, int(round(EPOCHS_MNIST / (b / n))))
            r["run_seconds_5_epochs_estimate"] = steps_5 * res["dp-macadam"]["median"]
            print(
                f"5-epoch MNIST DP-MacAdam estimate: {steps_5} steps × median = "
                f"{r['run_seconds_5_epochs_estimate']:.0f} s (training steps only)"
            )
        if args.all_methods:
            r["per_method_over_non_private"] = {k: v["median"] / base for k, v in res.items() if k != "non-private"}
        if model_name == "cnn5" and not args.no_memory:
            mem = {
                spec: run_memory(spec, args.threads, device)
                for spec in (
                    "cnn5:baseline:256:none",
                    "cnn5:dp-sgd:256:none",
                    "cnn5:dp-sgd:4096:256",
                    "cnn5:non-private:256:none",
                )
            }
            r["peak_mem_4096_over_256"] = mem["cnn5:dp-sgd:4096:256"] / mem["cnn5:dp-sgd:256:none"]
            r["peak_mem_mib"] = {k: round(v, 1) for k, v in mem.items()}
            print(
                (
                    "peak CUDA memory (max_memory_allocated, MiB): "
                    if device.type == "cuda"
                    else "peak resident memory (VmHWM, MiB): "
                )
                + ", ".join(f"{k} {v:.0f}" for k, v in mem.items())
            )
            print(f"logical 4096 / physical 256 over B = 256: {r['peak_mem_4096_over_256']:.3f}")
        result[model_name] = r
    if args.transformers:  # GPT-2-shaped LM, full fine-tuning and LoRA (issue 20): its own module
        import transformer_step

        result.update(
            transformer_step.main(
                ["--models", "gpt2,gpt2-lora", "--threads", str(args.threads)]
                + (["--no-memory"] if args.no_memory else [])
            )
        )
    for note in notes:
        print("note:", note)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
