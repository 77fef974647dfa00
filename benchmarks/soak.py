"""Soak benchmark: memory growth per step and step time over long runs, through every door (issue 42).

Each door runs in its own fresh subprocess (so one door's memory cannot
blur another's) for ``--steps`` steps after ``--warmup`` steps, and reports

* ``rss_kib_per_step`` — the least-squares slope of the resident set size
  (``/proc/self/statm``) against the step number, read every ``--every``
  steps after ``gc.collect()`` and glibc's ``malloc_trim(0)`` (freed memory
  glibc keeps is not growth; anything still reachable is);
* ``ledger_kib_per_step`` — the ledger's own share of it (a deep
  ``sys.getsizeof`` of its entries, first and last reading): the one record
  that grows by design (DESIGN.md, "Step 100,000 costs what step 100
  costs"); ``beyond_ledger_kib_per_step`` is the difference, the target
  being ≤ 1 KiB;
* ``cuda_kib_per_step`` — the same slope of ``torch.cuda.memory_allocated``
  (``--device cuda``; None on CPU);
* ``step_ms_at_100`` and ``step_ms_late`` — median step time over steps
  90–110 and over the last 50 steps (the step time must not grow);

side by side with Opacus 1.6 (``from opacus import PrivacyEngine``) where it
runs the same model (``opacus-*`` rows). The doors:

=============  =================================================================
``pe-mlp``     ``PrivacyEngine.make_private``, plain loop, MLP 64-256-10, B 64, SGD
``pe-gpt2``    the same on GPT-2 (4 layers, 4 heads, d 128, vocab 512), B 16, T 64, AdamW (``--gpt2-steps``)
``bmm``        ``PrivacyEngine`` + ``BatchMemoryManager``, MLP, logical 64 in chunks of 16 (a step = a release)
``lstm``       ``PrivacyEngine``, ``nn.LSTM`` (tapped layer) + linear head, B 32
``dptrainer``  ``dpopt.hf.DPTrainer`` on a 1-layer GPT-2 (d 32), B 8 (callback readings)
``train``      ``dpopt.training.train`` (``dpopt train``'s loop), digits, mlp-small, dp-sgd, ``--accountant rdp``
``engines``    a sweep: an engine made on a new MLP, 3 steps, deleted (no ``detach``); a "step" is one engine
=============  =================================================================

The ledger's accounting cost (ε per call, checkpoint bytes vs steps) is a
separate benchmark; :func:`ledger_section` is where it plugs in.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/soak.py --json                 # every door, 500 steps after 50
    python benchmarks/soak.py --doors pe-mlp,bmm --steps 1000 --json
    python benchmarks/soak.py --device cuda --json                     # + torch.cuda.memory_allocated

The last line of ``--json`` output is one JSON object ``{"doors": {...}, "ledger": ..., "config": ...}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared CPUs: see benchmarks/step_time.py

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from typing import Callable, Optional  # noqa: E402

DOORS = ("pe-mlp", "pe-gpt2", "bmm", "lstm", "dptrainer", "train", "engines")
# Opacus runs the same model there (not nn.LSTM: it needs its DPLSTM; not HF GPT-2: its Poisson loader fails on
# the token batches and its hooks have no sampler for transformers' Conv1D)
OPACUS_DOORS = ("pe-mlp", "bmm", "engines")


def rss_kib() -> float:
    """Resident set size of this process in KiB (``/proc/self/statm``), after gc and ``malloc_trim``."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1024


def slope(xs: list, ys: list) -> Optional[float]:
    """Least-squares slope of ys on xs (None with fewer than 2 points)."""
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None


def deep_kib(obj) -> float:
    """A deep ``sys.getsizeof`` of ``obj`` in KiB (containers, ``__dict__`` and ``__slots__``; each object once)."""
    seen, stack, total = set(), [obj], 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, type):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack += list(o.keys()) + list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack += list(o)
        else:
            if hasattr(o, "__dict__"):
                stack.append(vars(o))
            for s in getattr(type(o), "__slots__", ()):
                if hasattr(o, s):
                    stack.append(getattr(o, s))
    return total / 1024


class Meter:
    """Step times and memory readings of one door (:meth:`tick` after every step)."""

    def __init__(self, warmup: int, steps: int, every: int, cuda: bool, ledger: Callable[[], object] = None):
        self.warmup, self.steps, self.every, self.cuda, self.ledger = warmup, steps, every, cuda, ledger
        self.n, self.times, self.reads, self.cuda_reads = 0, [], [], []
        self.ledger_reads: list = []
        self.t = time.perf_counter()

    def tick(self) -> None:
        """One step done: its time; a memory reading every ``every`` steps after the warm-up (and at the last)."""
        now = time.perf_counter()
        self.times.append(now - self.t)
        self.n += 1
        k = self.n - self.warmup
        if k >= 0 and (k % self.every == 0 or self.n == self.warmup + self.steps):
            self.read()
        self.t = time.perf_counter()

    def read(self) -> None:
        """Read RSS (after gc and ``malloc_trim``), CUDA memory and, first and last, the ledger's deep size."""
        self.reads.append((self.n, rss_kib()))
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.cuda_reads.append((self.n, torch.cuda.memory_allocated() / 1024))
        if self.ledger is not None and (len(self.ledger_reads) == 0 or self.n == self.warmup + self.steps):
            self.ledger_reads.append((self.n, deep_kib(list(self.ledger().entries))))

    @property
    def done(self) -> bool:
        """Whether the warm-up and the measured steps have run."""
        return self.n >= self.warmup + self.steps

    def result(self) -> dict:
        """The door's figures (module docstring): slopes in KiB per step, step times in ms."""
        ms = [1e3 * t for t in self.times]
        rss = slope([n for n, _ in self.reads], [r for _, r in self.reads])
        cuda = slope([n for n, _ in self.cuda_reads], [r for _, r in self.cuda_reads]) if self.cuda else None
        led = None
        if len(self.ledger_reads) == 2:
            (n0, k0), (n1, k1) = self.ledger_reads
            led = (k1 - k0) / (n1 - n0) if n1 > n0 else None
        out = {
            "steps": self.n - self.warmup,
            "warmup": self.warmup,
            "rss_kib_per_step": rss,
            "rss_mib_start": self.reads[0][1] / 1024 if self.reads else None,
            "rss_mib_end": self.reads[-1][1] / 1024 if self.reads else None,
            "ledger_kib_per_step": led,
            "beyond_ledger_kib_per_step": None if rss is None else rss - (led or 0.0),
            "cuda_kib_per_step": cuda,
            "step_ms_at_100": statistics.median(ms[90:110]) if len(ms) >= 110 else None,
            "step_ms_late": statistics.median(ms[-50:]) if ms else None,
        }
        return out


# --------------------------------------------------------------------------- models and data
def _mlp():
    from torch import nn

    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def _gpt2(layers=4, heads=4, d=128, vocab=512, positions=64):
    import transformers as T

    cfg = T.GPT2Config(
        n_layer=layers,
        n_head=heads,
        n_embd=d,
        vocab_size=vocab,
        n_positions=positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return T.GPT2LMHeadModel(cfg)


class _LSTMNet:
    """A factory for the ``lstm`` door's model (nn.LSTM, batch_first, + a linear head)."""

    def __new__(cls):
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.rnn, self.head = nn.LSTM(16, 32, batch_first=True), nn.Linear(32, 10)

            def forward(self, x):
                return self.head(self.rnn(x)[0][:, -1])

        return Net()


def _loader(x, y, batch_size):
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _make_private(kind: str, model, optimizer, loader, ledger_box: list):
    if kind == "opacus":
        from opacus import PrivacyEngine as OpacusEngine

        engine = OpacusEngine(accountant="rdp")
    else:
        from dpopt import PrivacyEngine

        engine = PrivacyEngine(accountant="rdp")
        ledger_box.append(engine)
    return engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=True,
    )


def _loop(meter: Meter, loader, step: Callable) -> None:
    while not meter.done:
        for batch in loader:
            step(batch)
            meter.tick()
            if meter.done:
                return


# --------------------------------------------------------------------------- doors
def door_pe(args, kind: str, model_name: str) -> dict:
    """``PrivacyEngine`` (dpopt or Opacus) in a plain loop on the MLP or GPT-2."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    dev = torch.device(args.device)
    if model_name == "mlp":
        model = _mlp().to(dev)
        x, y = torch.randn(64 * 40, 64), torch.randint(0, 10, (64 * 40,))
        loader, opt = _loader(x, y, 64), torch.optim.SGD(model.parameters(), lr=0.05)
        steps = args.steps
    else:
        model = _gpt2().to(dev)
        x = torch.randint(0, 512, (16 * 40, 64))
        loader, opt = _loader(x, x, 16), torch.optim.AdamW(model.parameters(), lr=1e-4)
        steps = args.gpt2_steps
    box: list = []
    model, opt, loader = _make_private(kind, model, opt, loader, box)
    meter = Meter(
        args.warmup if model_name == "mlp" else min(args.warmup, 10),
        steps,
        max(1, steps // 25),
        dev.type == "cuda",
        (lambda: box[0].ledger) if box else None,
    )

    def step(batch):
        xb, yb = batch[0].to(dev), batch[1].to(dev)
        opt.zero_grad()
        if model_name == "mlp":
            loss = nn.functional.cross_entropy(model(xb), yb)
        else:
            loss = model(input_ids=xb, labels=yb).loss if kind == "opacus" else _lm_loss(model, xb)
        loss.backward()
        opt.step()

    _loop(meter, loader, step)
    return meter.result()


def _lm_loss(model, ids):
    """Mean over the batch of each sequence's mean next-token loss (HF's .loss is a batch-token mean: refused)."""
    from dpopt.losses import per_example_lm_loss

    return per_example_lm_loss(model(input_ids=ids).logits, ids).mean()


def door_bmm(args, kind: str) -> dict:
    """``PrivacyEngine`` + ``BatchMemoryManager``: logical batches of 64 in physical chunks of 16."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = _mlp().to(dev)
    x, y = torch.randn(64 * 40, 64), torch.randint(0, 10, (64 * 40,))
    box: list = []
    model, opt, loader = _make_private(
        kind, model, torch.optim.SGD(model.parameters(), lr=0.05), _loader(x, y, 64), box
    )
    if kind == "opacus":
        from opacus.utils.batch_memory_manager import BatchMemoryManager
    else:
        from dpopt.utils.batch_memory_manager import BatchMemoryManager
    meter = Meter(
        args.warmup, args.steps, max(1, args.steps // 25), dev.type == "cuda", (lambda: box[0].ledger) if box else None
    )
    released = 0
    while not meter.done:
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=16, optimizer=opt) as small:
            for xb, yb in small:
                opt.zero_grad()
                nn.functional.cross_entropy(model(xb.to(dev)), yb.to(dev)).backward()
                opt.step()
                skipped = opt._is_last_step_skipped
                if not skipped:
                    released += 1
                    meter.tick()
                    if meter.done:
                        break
    return meter.result()


def door_lstm(args) -> dict:
    """``PrivacyEngine`` on an ``nn.LSTM`` model (its tapped forward records the gate maps)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = _LSTMNet().to(dev)
    x, y = torch.randn(32 * 40, 8, 16), torch.randint(0, 10, (32 * 40,))
    box: list = []
    model, opt, loader = _make_private(
        "dpopt", model, torch.optim.SGD(model.parameters(), lr=0.05), _loader(x, y, 32), box
    )
    meter = Meter(args.warmup, args.steps, max(1, args.steps // 25), dev.type == "cuda", lambda: box[0].ledger)

    def step(batch):
        opt.zero_grad()
        nn.functional.cross_entropy(model(batch[0].to(dev)), batch[1].to(dev)).backward()
        opt.step()

    _loop(meter, loader, step)
    return meter.result()


def door_dptrainer(args) -> dict:
    """``dpopt.hf.DPTrainer`` on a 1-layer GPT-2; readings from a ``TrainerCallback``."""
    import torch
    import transformers as T

    from dpopt.hf import DPTrainer

    torch.manual_seed(0)
    model = _gpt2(layers=1, heads=2, d=32, vocab=64, positions=16)

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.randint(1, 64, (2048, 16))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "attention_mask": torch.ones(16, dtype=torch.long), "labels": self.x[i]}

    holder: dict = {}
    meter = Meter(args.warmup, args.steps, max(1, args.steps // 25), args.device == "cuda", lambda: holder["tr"].ledger)

    class Tick(T.TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            meter.tick()

    targs = T.TrainingArguments(
        os.path.join(args.tmp, "dptrainer"),
        per_device_train_batch_size=8,
        max_steps=args.warmup + args.steps,
        learning_rate=1e-3,
        logging_steps=10**9,
        save_strategy="no",
        report_to=[],
        use_cpu=args.device == "cpu",
        disable_tqdm=True,
    )
    tr = DPTrainer(
        model=model, args=targs, train_dataset=Data(), noise_multiplier=1.0, max_grad_norm=1.0, callbacks=[Tick()]
    )
    holder["tr"] = tr
    tr.train()
    return meter.result()


def door_train(args) -> dict:
    """``dpopt.training.train`` (``dpopt train``): digits, mlp-small, dp-sgd, RDP accountant, ``on_step`` readings."""
    from dpopt.training import TrainConfig, train

    n, b = 1437, 64
    epochs = (args.warmup + args.steps + 2) * b / n
    from dpopt.accounting.ledger import PrivacyLedger

    def ledger():  # the run's ledger (train keeps it to itself): found once, at the first reading
        if "ledger" not in holder:
            holder["ledger"] = next(o for o in gc.get_objects() if isinstance(o, PrivacyLedger) and len(o))
        return holder["ledger"]

    holder: dict = {}
    meter = Meter(args.warmup, args.steps, max(1, args.steps // 25), args.device == "cuda", ledger)

    def on_step(row):
        if not meter.done:
            meter.tick()

    train(
        TrainConfig(
            method="dp-sgd",
            batch_size=b,
            epochs=epochs,
            out=os.path.join(args.tmp, "train"),
            seed=0,
            accountant="rdp",
            device=args.device,
        ),
        on_step=on_step,
    )
    holder.clear()
    return meter.result()


def door_engines(args, kind: str = "dpopt") -> dict:
    """Engines made and deleted in one process (a sweep, a notebook): RSS growth per engine (``--steps // 10``)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    x, y = torch.randn(64 * 4, 64), torch.randint(0, 10, (64 * 4,))
    n = max(20, args.steps // 10)
    meter = Meter(min(args.warmup, 5), n, max(1, n // 25), args.device == "cuda", None)
    while not meter.done:
        model = _mlp().to(args.device)
        box: list = []
        model, opt, loader = _make_private(
            kind, model, torch.optim.SGD(model.parameters(), lr=0.05), _loader(x, y, 64), box
        )
        for i, (xb, yb) in enumerate(loader):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb.to(args.device)), yb.to(args.device)).backward()
            opt.step()
            if i == 2:
                break
        del model, opt, loader, box
        meter.tick()
    out = meter.result()
    out["unit"] = "per engine"
    return out


def ledger_section(args) -> dict | None:
    """The ledger's accounting cost vs steps (ε seconds per call, checkpoint bytes and save/load seconds).

    Measured by ``benchmarks/ledger_soak.py``'s ``measure()`` (checkpoint bytes and save/load seconds,
    ε seconds per call, ``last_entry`` cost, vs the number of releases) at ``--ledger-steps``; None with
    ``--ledger-steps 0``.
    """
    if not args.ledger_steps:
        return None
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ledger_soak import measure

    return measure(tuple(args.ledger_steps))


def run_door(name: str, args) -> dict:
    """One door in this process: ``name`` is a door of :data:`DOORS`, or ``opacus-`` + one of :data:`OPACUS_DOORS`."""
    warnings.simplefilter("ignore")
    kind = "opacus" if name.startswith("opacus-") else "dpopt"
    base = name.removeprefix("opacus-")
    if base in ("pe-mlp", "pe-gpt2"):
        return door_pe(args, kind, base[3:])
    if base == "bmm":
        return door_bmm(args, kind)
    if base == "engines":
        return door_engines(args, kind)
    return {"lstm": door_lstm, "dptrainer": door_dptrainer, "train": door_train}[base](args)


def main(argv=None) -> None:
    """Run every requested door in a fresh subprocess; print a table (and the JSON line with ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--doors", default=",".join(DOORS))
    ap.add_argument("--steps", type=int, default=500, help="steps measured after the warm-up (MLP-sized doors)")
    ap.add_argument("--gpt2-steps", type=int, default=60, help="steps measured on pe-gpt2")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--no-opacus", action="store_true")
    ap.add_argument(
        "--ledger-steps",
        type=int,
        nargs="*",
        default=[100, 1000, 10000, 100000],
        help="release counts for the ledger's accounting cost (benchmarks/ledger_soak.py); none: skip",
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            args.tmp = tmp
            print("SOAK " + json.dumps(run_door(args.child, args)), flush=True)
        return
    names = [d for d in args.doors.split(",") if d]
    if not args.no_opacus:
        try:
            import opacus  # noqa: F401

            names += [f"opacus-{d}" for d in names if d in OPACUS_DOORS]
        except ImportError:
            pass
    results = {}
    for name in names:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            name,
            "--steps",
            str(args.steps),
            "--gpt2-steps",
            str(args.gpt2_steps),
            "--warmup",
            str(args.warmup),
            "--device",
            args.device,
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SOAK ")]
        if proc.returncode or not lines:
            results[name] = {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
        else:
            results[name] = json.loads(lines[-1][5:])
        results[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        r = results[name]
        fmt = lambda v, f="{:.2f}": "—" if v is None else f.format(v)  # noqa: E731
        print(
            f"{name:16s} rss {fmt(r.get('rss_kib_per_step'))} KiB/step (beyond ledger "
            f"{fmt(r.get('beyond_ledger_kib_per_step'))}), ledger {fmt(r.get('ledger_kib_per_step'), '{:.3f}')}, "
            f"cuda {fmt(r.get('cuda_kib_per_step'))}, step ms @100 {fmt(r.get('step_ms_at_100'))} late "
            f"{fmt(r.get('step_ms_late'))}, {r.get('steps', 0)} steps, {r['wall_s']} s"
            + (f"  ERROR {r['error']}" if "error" in r else ""),
            flush=True,
        )
    out = {
        "doors": results,
        "ledger": ledger_section(args),
        "config": {
            "steps": args.steps,
            "gpt2_steps": args.gpt2_steps,
            "warmup": args.warmup,
            "device": args.device,
            "threads": os.environ.get("OMP_NUM_THREADS"),
        },
    }
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
