"""Resident memory per parameter of private training at model scale, beside the non-private run.

    python benchmarks/memory_per_param.py            # a table
    python benchmarks/memory_per_param.py --json     # one JSON object

The model is 10 × ``Linear(2236, 2236)`` with ReLUs between them (50.0 M float32 parameters),
batch B = 4, plain SGD, σ = 1, C = 1. Each configuration runs in its own fresh process (so that one
run's freed memory cannot be re-used by the next), ``--steps`` steps:

* ``non-private``: forward, backward, ``torch.optim.SGD`` step;
* ``privacy-engine``: the user-loop door, :class:`dpopt.PrivacyEngine` ``make_private`` (hooks);
* ``dp-sgd``: dpopt's own loop door (``iter_per_sample_sources`` + the ``dp-sgd`` optimizer, what
  :mod:`dpopt.training` runs).

Per configuration, in bytes per parameter over the resident memory once the model, data and
optimizer were built: ``between`` (after the last step), ``peak`` (the largest high-water mark of
the steps after the first), ``first_peak`` (the first step's: it runs the first-batch checks) and
``live`` (storage of the tensors alive after the last step other than the parameters, found with
``gc``: what the run keeps, whatever the allocator does with freed memory). The high-water mark
(``VmHWM``) is reset before every step by writing 5 to ``/proc/self/clear_refs`` (Linux).
``*_over_non_private`` subtracts the non-private figure.

Every configuration runs twice: with glibc's default allocator, which keeps freed blocks below
its dynamic mmap threshold (up to 32 MiB, so every per-layer tensor of this model) in the heap —
resident memory between steps then stays at the step's transient peak — and with
``MALLOC_MMAP_THRESHOLD_=1048576`` (rows ``… [mmap 1 MiB]``), which returns every block of 1 MiB or
more to the OS when it is freed. Targets (issue 43): between ≤ 1 byte per parameter over
non-private; the release's own peak ≤ 8 bytes × the largest parameter tensor (here 5.0 M
elements, 0.8 bytes per parameter of the model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings

import torch
from torch import nn
from torch.nn import functional as F

WIDTH, LAYERS, BATCH = 2236, 10, 4
CONFIGS = ("non-private", "privacy-engine", "dp-sgd")


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _build():
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        layers.append(nn.Linear(WIDTH, WIDTH))
        if i < LAYERS - 1:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, WIDTH, (BATCH,))
    return model, x, y


def _step_fn(config: str):
    model, x, y = _build()
    params = [p for p in model.parameters()]
    if config == "non-private":
        opt = torch.optim.SGD(params, lr=0.01)

        def step():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

    elif config == "privacy-engine":
        import dpopt

        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # poisson_sampling=False (a fixed benchmark batch) is warned about
            model, opt, _ = dpopt.PrivacyEngine().make_private(
                module=model,
                optimizer=torch.optim.SGD(params, lr=0.01),
                data_loader=loader,
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                poisson_sampling=False,
            )

        def step():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

    elif config == "dp-sgd":
        from dpopt.engine import iter_per_sample_sources
        from dpopt.methods import make_optimizer

        opt = make_optimizer(
            "dp-sgd",
            params,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            expected_batch_size=float(BATCH),
            sample_rate=BATCH / 50_000,
            dataset="synthetic",
            lr=0.01,
        )

        def loss_fn(out, target):
            return F.cross_entropy(out, target)

        def step():
            opt.step(iter_per_sample_sources(model, loss_fn, x, y, None, opt.evaluation_points()))

    else:
        raise ValueError(f"unknown configuration {config!r}; one of {CONFIGS}")
    return step, sum(p.numel() for p in params), max(p.numel() for p in params)


def run_child(config: str, steps: int) -> dict:
    """One configuration in this process: bytes per parameter between steps and at peak."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    step, n_params, largest = _step_fn(config)
    base = _status("VmRSS")
    peaks, between = [], []
    resets = True
    for _ in range(steps):
        resets = _reset_peak() and resets
        step()
        peaks.append(_status("VmHWM") - base)
        between.append(_status("VmRSS") - base)
    return {
        "live": _live_bytes() / n_params,
        "first_peak": peaks[0] / n_params,
        "config": config,
        "parameters": n_params,
        "largest_tensor": largest,
        "steps": steps,
        "peak_resets": resets,
        "between_bytes_per_param": [b / n_params for b in between],
        "peak_bytes_per_param": [p / n_params for p in peaks],
        "between": between[-1] / n_params,
        "peak": max(peaks[1:] or peaks) / n_params,
    }


def _live_bytes() -> int:
    """Bytes of the storages of every live tensor that is not an ``nn.Parameter`` (each storage once)."""
    import gc

    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gc walks deprecated torch module attributes
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and not isinstance(obj, nn.Parameter):
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure(steps: int, configs=CONFIGS) -> dict:
    """Every configuration in a fresh child process; ratios to the non-private run."""
    rows = {}
    for suffix, extra in (("", {}), (" [mmap 1 MiB]", {"MALLOC_MMAP_THRESHOLD_": "1048576"})):
        for config in configs:
            out = subprocess.run(
                [sys.executable, __file__, "--child", config, "--steps", str(steps)],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, **extra},
            )
            rows[config + suffix] = json.loads(out.stdout.strip().splitlines()[-1])
        base = rows.get("non-private" + suffix)
        if base is not None:
            for config in configs:
                row = rows[config + suffix]
                for key in ("between", "peak", "first_peak", "live"):
                    row[key + "_over_non_private"] = row[key] - base[key]
    return {"model": f"{LAYERS} x Linear({WIDTH}, {WIDTH})", "batch": BATCH, "steps": steps, "rows": rows}


def main(argv=None) -> int:
    """Run the measurement and print a table or (``--json``) one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per configuration (default 8)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.child:
        print(json.dumps(run_child(args.child, args.steps)))
        return 0
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown --configs {unknown}; choose from {CONFIGS}")
    result = measure(args.steps, configs)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"bytes per parameter, {result['model']}, B {BATCH}, {args.steps} steps (fresh process each)")
    print(
        f"{'config':30s} {'between':>8s} {'peak':>6s} {'first':>6s} {'live':>5s}   over non-private: between peak first"
    )
    nan = float("nan")
    for name, row in result["rows"].items():
        print(
            f"{name:30s} {row['between']:8.2f} {row['peak']:6.2f} {row['first_peak']:6.2f} {row['live']:5.2f}"
            f"   {row.get('between_over_non_private', nan):24.2f} {row.get('peak_over_non_private', nan):5.2f}"
            f" {row.get('first_peak_over_non_private', nan):5.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
