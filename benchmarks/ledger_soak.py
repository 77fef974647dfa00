"""Accounting cost against the step count (issue 42): checkpoints, ε, the ledger's hot-path reads, and
``make_private_with_epsilon``'s per-step path, at 100 … 100,000 releases.

Usage::

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/ledger_soak.py --json [--steps 100 1000 10000 100000]

:func:`measure` is the entry point (``benchmarks/soak.py`` calls it). Long ledgers are made by repeating the
last REAL release of a PrivacyEngine run (same event, same metadata, next step): exactly what a run at fixed
σ, q and C records, without training 100,000 steps. The journal is open while they are recorded (one line per
release, as in a real run), so a checkpoint's save time excludes the journal's own growth.

All times are wall-clock seconds (``time.perf_counter``) on whatever machine runs it; sizes are bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import timeit
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpopt import PrivacyEngine
from dpopt.accounting import pld as pld_module
from dpopt.accounting.accountant import epsilon

DELTA = 1e-5


def _engine(accountant: str = "pld", n: int = 512, batch: int = 16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(torch.randn(n, 16), torch.randint(0, 4, (n,))), batch_size=batch)
    engine = PrivacyEngine(accountant=accountant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
        )
    return engine, model, opt, loader


def _train(model, opt, loader, n: int) -> list[float]:
    """``n`` real steps; the seconds of each."""
    times: list[float] = []
    while len(times) < n:
        for x, y in loader:
            t = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t)
            if len(times) == n:
                break
    return times


def _pad(ledger, total: int) -> None:
    """Repeat the last release (next step each time) until the ledger holds ``total``."""
    while len(ledger) < total:
        last = ledger.last_entry
        ledger.record(last.step + 1, last.event, **last.meta)


def _clear_epsilon_caches() -> None:
    pld_module._EPSILONS.clear()
    pld_module._PARTS.clear()


def checkpoints(steps_list, workdir: Path) -> list[dict]:
    """PrivacyEngine checkpoint bytes, save seconds and load seconds (journal read included) vs releases."""
    rows = []
    for n in steps_list:
        d = workdir / f"ckpt-{n}"
        d.mkdir(parents=True, exist_ok=True)
        engine, model, opt, loader = _engine()
        _train(model, opt, loader, 3)
        engine.open_journal(d / "journal.jsonl")
        _pad(engine.ledger, n)
        path = d / "ckpt.pt"
        engine.save_checkpoint(path=path, module=model, optimizer=opt)  # the first save flushes the journal
        t = time.perf_counter()
        engine.save_checkpoint(path=path, module=model, optimizer=opt)
        save_s = time.perf_counter() - t
        fresh, model2, opt2, _ = _engine()
        t = time.perf_counter()
        fresh.load_checkpoint(path=path, module=model2, optimizer=opt2)
        load_s = time.perf_counter() - t
        assert len(fresh.ledger) == n
        rows.append(
            {
                "steps": n,
                "checkpoint_bytes": path.stat().st_size,
                "save_s": save_s,
                "load_s": load_s,
                "groups": len(engine.ledger.groups),
                "journal_bytes": (d / "journal.jsonl").stat().st_size,
            }
        )
    return rows


def epsilon_calls(steps_list) -> list[dict]:
    """Seconds of one ε call on a ledger of n identical releases (q = 0.045, σ = 1.0; dpopt train's digits
    rate): ``first`` right after the ledger grew (no cached ε; the step's PLD is built once per (σ, q) and
    kept), ``repeat`` the same ledger again."""
    engine, model, opt, loader = _engine(n=16 * 22)  # q = 16/352 ≈ 0.045
    _train(model, opt, loader, 2)
    rows = []
    epsilon(engine.ledger, DELTA, "pld")  # builds the (σ, q) step's PLD once, as a run's first row does
    for n in steps_list:
        _pad(engine.ledger, n)
        row: dict = {"steps": n}
        for acc in ("pld", "rdp"):
            _clear_epsilon_caches()
            t = time.perf_counter()
            eps = epsilon(engine.ledger, DELTA, acc)
            row[f"{acc}_first_s"] = time.perf_counter() - t
            t = time.perf_counter()
            epsilon(engine.ledger, DELTA, acc)
            row[f"{acc}_repeat_s"] = time.perf_counter() - t
            row[f"{acc}_epsilon"] = eps
        rows.append(row)
    return rows


def ledger_reads(steps_list) -> list[dict]:
    """Seconds per ``ledger.last_entry`` and ``len(ledger)`` (and, for comparison, ``ledger.entries[-1]``,
    the O(releases) copy the per-step path used to make) at n releases."""
    engine, model, opt, loader = _engine()
    _train(model, opt, loader, 2)
    ledger = engine.ledger
    rows = []
    for n in steps_list:
        _pad(ledger, n)
        reps = 20000
        last = timeit.timeit(lambda: ledger.last_entry, number=reps) / reps
        length = timeit.timeit(lambda: len(ledger), number=reps) / reps
        copies = max(3, min(200, 2_000_000 // n))
        copy = timeit.timeit(lambda: ledger.entries[-1], number=copies) / copies
        rows.append({"steps": n, "last_entry_s": last, "len_s": length, "entries_copy_s": copy})
    return rows


def with_epsilon_steps(low: int = 1000, high: int = 100_000, steps: int = 200) -> dict:
    """Median step seconds of ``make_private_with_epsilon``'s per-step path at ``low`` and at ``high`` releases.

    The ledger is padded to each length with identical releases, then ``steps`` real steps are timed (the
    target watch reads the last release and its cached budget each step)."""
    torch.manual_seed(0)
    n = 512
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(torch.randn(n, 16), torch.randint(0, 4, (n,))), batch_size=16)
    engine = PrivacyEngine(accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private_with_epsilon(
            module=model,
            optimizer=opt,
            data_loader=loader,
            target_epsilon=8.0,
            target_delta=DELTA,
            epochs=high * 16 // n + 10,
            max_grad_norm=1.0,
        )
        out = {}
        for label, total in (("low", low), ("high", high)):
            _train(model, opt, loader, 3)
            _pad(engine.ledger, total)
            _train(model, opt, loader, 20)  # warm-up (the watch's cached budget for this length)
            times = sorted(_train(model, opt, loader, steps))
            out[f"step_s_at_{label}"] = times[len(times) // 2]
            out[f"releases_{label}"] = total
    out["ratio_high_over_low"] = out["step_s_at_high"] / out["step_s_at_low"]
    return out


def measure(steps_list=(100, 1000, 10000, 100000)) -> dict:
    """Every accounting cost of :mod:`this benchmark <benchmarks.ledger_soak>` against the step count.

    Args:
        steps_list: ledger lengths (releases) to measure at, ascending.

    Returns:
        ``{"checkpoints": [{"steps", "checkpoint_bytes", "save_s", "load_s", "groups", "journal_bytes"}],
        "epsilon": [{"steps", "pld_first_s", "pld_repeat_s", "pld_epsilon", "rdp_first_s", ...}],
        "ledger_reads": [{"steps", "last_entry_s", "len_s", "entries_copy_s"}],
        "make_private_with_epsilon": {"step_s_at_low", "step_s_at_high", "releases_low", "releases_high",
        "ratio_high_over_low"}, "machine": {...}}`` — seconds (wall clock) and bytes.
    """
    steps_list = sorted(int(s) for s in steps_list)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = {
            "checkpoints": checkpoints(steps_list, Path(tmp)),
            "epsilon": epsilon_calls(steps_list),
            "ledger_reads": ledger_reads(steps_list),
            "make_private_with_epsilon": with_epsilon_steps(min(1000, steps_list[-1]), steps_list[-1]),
            "machine": {
                "cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "python": sys.version.split()[0],
            },
        }
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 1000, 10000, 100000])
    args = parser.parse_args(argv)
    result = measure(tuple(args.steps))
    if args.json:
        print(json.dumps(result))
        return
    for key, rows in result.items():
        print(key)
        for row in rows if isinstance(rows, list) else [rows]:
            print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
