"""Opacus's own examples, unchanged but for one import, next to real Opacus: accuracy, ε and step time.

Runs ``examples/cifar10.py`` and ``examples/char-lstm-classification.py`` of an
Opacus checkout twice per seed: as written (real Opacus), and with the single
line ``from opacus import PrivacyEngine`` replaced by ``from dpopt import
PrivacyEngine`` (their other ``opacus`` imports — ``opacus.layers.DPLSTM``,
``opacus.grad_sample.functorch`` — stay, so Opacus must be installed: the
``bench`` extra). Nothing of the examples is copied here: each file is read
from the checkout, the import switched in memory, and executed in a fresh
subprocess with its own command line (reduced epochs and data).

What the harness adds around the example, the same for both libraries:

* **data from local files.** ``cifar10.py`` reads CIFAR-10 through
  ``torchvision.datasets.CIFAR10(download=True)``; a stand-in ``torchvision``
  module (``CIFAR10`` over ``<data-dir>/cifar10.npz``, NHWC uint8, the first
  ``--cifar-train`` training images; ``ToTensor``/``Normalize``/
  ``RandomCrop``/``RandomHorizontalFlip``/``Compose``) is put in
  ``sys.modules`` (also where torchvision is installed: no download is ever
  tried). ``char-lstm-classification.py`` reads one ``<language>.txt`` file of
  names per class; a synthetic corpus is generated (:func:`write_names_corpus`:
  8 made-up languages, each a syllable inventory drawn from a shared pool, so
  the classes overlap).
* **seeds.** ``torch.manual_seed(seed)`` (and numpy's, Python's) before the
  example's ``main()``: both libraries start from the same model and split.
  Opacus draws its noise from torch's global generator (seeded); dpopt's is
  secret (OS entropy), so dpopt's runs differ between repetitions even at the
  same seed — the spread over seeds is the comparison.
* **observation only.** The example's ``train``/``test`` functions are
  wrapped to record the privacy engine and optimizer they receive, the last
  test accuracy, and a timestamp after every ``optimizer.step()``. Step time
  = the median interval between consecutive steps within an epoch (forward,
  backward, step, data loading, the example's own printing; epoch ends and
  evaluation excluded), wall and process CPU time.
* **ε, same accountant on both sides.** Each engine's own accountant
  (Opacus: PRV by default; dpopt: PLD), and then the SAME accountants applied
  to both runs' histories ``[(σ, q, steps)]``: Opacus's ``RDPAccountant``
  and dpopt's PLD (:func:`dpopt.accounting.accountant.epsilon`). Equal
  histories give equal ε there by construction; the script checks that the
  histories are equal. Own-accountant ε differ by PRV's vs PLD's discretisation
  (both upper bounds; PRV's default ``eps_error`` is 0.01).

Usage (resumable: finished (example, library, seed) rows in
``<out>/results.jsonl`` are skipped; run under ``nice``)::

    nice -n 19 python benchmarks/opacus_examples.py --examples ~/src/opacus/examples \\
        --data-dir data --out runs/opacus-examples --seeds 0 1
    python benchmarks/opacus_examples.py --out runs/opacus-examples --table   # the table of what is done

``char-lstm+nn.LSTM`` (dpopt only) changes one more line of char-lstm,
``rnn_type = DPLSTM`` → ``rnn_type = nn.LSTM`` (Opacus refuses ``nn.LSTM``;
dpopt runs both: ``DPLSTM``'s parameters, registered on the cell's ``Linear``
layers and renamed on the ``DPLSTM`` module, are one parameter each,
:mod:`dpopt.engine.aliases`; ``nn.LSTM`` has dpopt's faster recurrent rule).
``--only cifar10`` / ``--only char-lstm`` runs one example. Reduced settings
(defaults): CIFAR-10 10,000 training images, batch 500 (q 0.05), 2 epochs
(40 steps), the example's σ 1.5, C 10, lr 0.1 (cosine), momentum 0.9;
char-lstm 2,000 names (1,600 train), batch 64, 3 epochs (75 steps), the example's σ 1.0,
C 1.5, lr 2.0, δ 8e-5.

Writes ``<out>/results.jsonl`` (one row per run: accuracy, ε, steps, step
times, or the error of a run that failed) and ``<out>/table.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

EXAMPLES = {
    "cifar10": "cifar10.py",
    "char-lstm": "char-lstm-classification.py",
    "char-lstm+nn.LSTM": "char-lstm-classification.py",
}
SWITCH = ("from opacus import PrivacyEngine\n", "from dpopt import PrivacyEngine\n")
#: the one more line changed in the "char-lstm+nn.LSTM" variant (dpopt only: Opacus refuses nn.LSTM)
LSTM_SWITCH = ("        rnn_type = DPLSTM\n", "        rnn_type = nn.LSTM\n")
LIBS = {"char-lstm+nn.LSTM": ("dpopt",)}


# -- local data ---------------------------------------------------------------------------------
def write_names_corpus(root: Path, languages: int = 8, per_language: int = 250, seed: int = 0) -> Path:
    """Write ``languages`` files ``<name>.txt`` of ``per_language`` made-up names each; returns ``root``.

    Every language draws 8 onsets, 5 vowels and 3 endings from pools shared by
    all of them, and a name is 2-3 (onset, vowel) syllables plus an ending, so
    languages share letters and overlap (the task is not trivially separable).
    Deterministic in ``seed``.
    """
    onsets = [
        "b",
        "br",
        "ch",
        "d",
        "dr",
        "f",
        "g",
        "gr",
        "h",
        "j",
        "k",
        "kr",
        "l",
        "m",
        "n",
        "p",
        "pr",
        "r",
        "s",
        "sh",
        "st",
        "t",
        "tr",
        "v",
        "w",
        "z",
        "zh",
        "ts",
        "kh",
        "sk",
    ]
    vowels = ["a", "e", "i", "o", "u", "ai", "ei", "ou", "ia", "y", "ae", "oo"]
    endings = ["", "n", "s", "r", "ski", "ov", "ez", "son", "ini", "ou", "ak", "berg", "escu", "ic", "ata"]
    root.mkdir(parents=True, exist_ok=True)
    for k in range(languages):
        rng = random.Random(seed * 1000 + k)
        on, vo, en = rng.sample(onsets, 8), rng.sample(vowels, 5), rng.sample(endings, 3)
        names = set()
        while len(names) < per_language:
            body = "".join(rng.choice(on) + rng.choice(vo) for _ in range(rng.choice((2, 2, 3))))
            names.add((body + rng.choice(en)).capitalize())
        (root / f"Lang{k}.txt").write_text("\n".join(sorted(names)) + "\n")
    return root


def install_torchvision_standin(data_dir: str, n_train: int, n_test: int) -> None:
    """Put a minimal ``torchvision`` (CIFAR10 over ``cifar10.npz``, five transforms) in ``sys.modules``.

    ``CIFAR10(root, train, download, transform)`` reads ``<data_dir>/cifar10.npz``
    (``x_train`` [N, 32, 32, 3] uint8, ``y_train``, ``x_test``, ``y_test``);
    ``root`` and ``download`` are ignored (no download). Items are
    ``(transform(image HWC uint8), label int)``, as torchvision's.
    """
    import numpy as np
    import torch

    class Compose:
        def __init__(self, transforms):
            self.transforms = list(transforms)

        def __call__(self, x):
            for t in self.transforms:
                x = t(x)
            return x

    class ToTensor:
        def __call__(self, img):
            return torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).float().div_(255.0)

    class Normalize:
        def __init__(self, mean, std):
            self.mean = torch.tensor(mean).view(-1, 1, 1)
            self.std = torch.tensor(std).view(-1, 1, 1)

        def __call__(self, x):
            return (x - self.mean) / self.std

    class RandomCrop:
        def __init__(self, size, padding=0):
            self.size, self.padding = int(size), int(padding)

        def __call__(self, img):
            p = self.padding
            padded = np.pad(img, ((p, p), (p, p), (0, 0)))
            i, j = (int(v) for v in torch.randint(0, 2 * p + 1, (2,)))
            return padded[i : i + self.size, j : j + self.size]

    class RandomHorizontalFlip:
        def __init__(self, p=0.5):
            self.p = float(p)

        def __call__(self, img):
            return img[:, ::-1] if float(torch.rand(())) < self.p else img

    class CIFAR10(torch.utils.data.Dataset):
        def __init__(self, root=None, train=True, download=False, transform=None):  # noqa: ARG002
            with np.load(Path(data_dir) / "cifar10.npz") as d:
                x, y = (d["x_train"], d["y_train"]) if train else (d["x_test"], d["y_test"])
            n = n_train if train else n_test
            self.data, self.targets = x[:n], [int(v) for v in y[:n]]
            self.transform = transform

        def __len__(self):
            return len(self.targets)

        def __getitem__(self, i):
            img = self.data[i]
            return (self.transform(img) if self.transform else img), self.targets[i]

    tv, tr, ds = (types.ModuleType(n) for n in ("torchvision", "torchvision.transforms", "torchvision.datasets"))
    for cls in (Compose, ToTensor, Normalize, RandomCrop, RandomHorizontalFlip):
        setattr(tr, cls.__name__, cls)
    ds.CIFAR10 = CIFAR10
    tv.transforms, tv.datasets = tr, ds
    sys.modules.update({"torchvision": tv, "torchvision.transforms": tr, "torchvision.datasets": ds})


# -- one run (child process) ----------------------------------------------------------------------
def _history_epsilons(history, delta: float) -> dict:
    """ε of a history [(σ, q, steps)] under Opacus's RDPAccountant and dpopt's PLD (the same for both libraries)."""
    from dp_accounting import dp_event

    from dpopt.accounting.accountant import epsilon

    out = {}
    try:
        from opacus.accountants import RDPAccountant

        acc = RDPAccountant()
        acc.history = [tuple(h) for h in history]
        out["eps_rdp_opacus"] = float(acc.get_epsilon(delta=delta))
    except ImportError:
        out["eps_rdp_opacus"] = None
    event = dp_event.ComposedDpEvent(
        [
            dp_event.SelfComposedDpEvent(
                dp_event.PoissonSampledDpEvent(float(q), dp_event.GaussianDpEvent(float(s))), int(n)
            )
            for s, q, n in history
        ]
    )
    out["eps_pld_dpopt"] = float(epsilon(event, delta, "pld"))
    return out


def run_child(spec: dict) -> dict:
    """Run one example with one library (``spec``: example, lib, seed, path, argv, delta, data settings)."""
    import inspect

    import numpy as np
    import torch

    seed = int(spec["seed"])
    if spec["example"] == "cifar10":
        install_torchvision_standin(spec["data_dir"], spec["cifar_train"], spec["cifar_test"])
    source = Path(spec["path"]).read_text()
    if spec["lib"] == "dpopt":
        if source.count(SWITCH[0]) != 1:
            raise RuntimeError(f"{spec['path']}: expected exactly one line {SWITCH[0]!r}")
        source = source.replace(*SWITCH)
    if spec["example"] == "char-lstm+nn.LSTM":
        if source.count(LSTM_SWITCH[0]) != 1:
            raise RuntimeError(f"{spec['path']}: expected exactly one line {LSTM_SWITCH[0]!r}")
        source = source.replace(*LSTM_SWITCH)
    namespace = {"__name__": "opacus_example", "__file__": spec["path"]}
    exec(compile(source, spec["path"], "exec"), namespace)  # the example's module body (not its __main__)

    seen = {"engine": None, "optimizer": None, "accuracy": None, "epoch": 0}
    stamps: list[tuple[int, float, float]] = []
    train, test = namespace["train"], namespace["test"]

    def timed_train(*args, **kwargs):
        bound = inspect.signature(train).bind(*args, **kwargs)
        seen["engine"] = bound.arguments.get("privacy_engine")
        opt = bound.arguments["optimizer"]
        if seen["optimizer"] is not opt:
            seen["optimizer"] = opt
            step = opt.step

            def stamped_step(*a, **k):
                out = step(*a, **k)
                stamps.append((seen["epoch"], time.perf_counter(), time.process_time()))
                return out

            opt.step = stamped_step
        seen["epoch"] += 1
        return train(*args, **kwargs)

    def recorded_test(*args, **kwargs):
        seen["accuracy"] = float(test(*args, **kwargs))
        return seen["accuracy"]

    namespace["train"], namespace["test"] = timed_train, recorded_test
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    sys.argv = [spec["path"]] + [str(a) for a in spec["argv"]]
    t0 = time.perf_counter()
    namespace["main"]()
    wall = time.perf_counter() - t0
    engine = seen["engine"]
    history = [tuple(h) for h in engine.accountant.history]
    walls = [b[1] - a[1] for a, b in zip(stamps, stamps[1:]) if a[0] == b[0]]
    cpus = [b[2] - a[2] for a, b in zip(stamps, stamps[1:]) if a[0] == b[0]]
    delta = float(spec["delta"])
    row = {
        "accuracy": seen["accuracy"],
        "steps": sum(int(h[2]) for h in history),
        "history": history,
        "accountant": str(getattr(engine.accountant, "mechanism", lambda: "?")()),
        "eps_own": float(engine.accountant.get_epsilon(delta=delta)),
        "delta": delta,
        "step_wall_s": statistics.median(walls) if walls else None,
        "step_cpu_s": statistics.median(cpus) if cpus else None,
        "run_wall_s": wall,
    }
    row.update(_history_epsilons(history, delta))
    return row


# -- the parent: runs, table ----------------------------------------------------------------------
def example_argv(example: str, args, workdir: Path) -> list:
    """The example's own command line (reduced settings; module docstring)."""
    if example == "cifar10":
        return [
            "--epochs",
            args.cifar_epochs,
            "--batch-size",
            args.cifar_batch,
            "--batch-size-test",
            500,
            "-j",
            0,
            "--print-freq",
            10**6,
            "--device",
            "cpu",
            "--data-root",
            workdir,
            "--checkpoint-file",
            workdir / "checkpoint",
        ]
    names = write_names_corpus(workdir / "names", per_language=args.names_per_language)
    return ["--data-root", names, "--device", "cpu", "--batch-size", args.lstm_batch, "--epochs", args.lstm_epochs]


def run_one(example: str, lib: str, seed: int, args) -> dict:
    """One run in a fresh subprocess (cwd a temporary directory: the examples write checkpoints there)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "example": example,
            "lib": lib,
            "seed": seed,
            "path": str(Path(args.examples) / EXAMPLES[example]),
            "argv": [str(a) for a in example_argv(example, args, Path(tmp))],
            "delta": 1e-5 if example == "cifar10" else 8e-5,
            "data_dir": str(Path(args.data_dir).resolve()),
            "cifar_train": args.cifar_train,
            "cifar_test": args.cifar_test,
        }
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
        env = dict(os.environ, PYTHONWARNINGS="ignore", TQDM_DISABLE="1")
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=args.timeout)
    row = {"example": example, "lib": lib, "seed": seed}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode == 0 and lines:
        row.update(json.loads(lines[-1][len("RESULT ") :]))
    else:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        row["error"] = next((ln for ln in reversed(tail) if "Error" in ln), tail[-1] if tail else "no output")[:2000]
    return row


def _mean_sd(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.4g}"
    return f"{statistics.mean(values):.4g} ± {statistics.stdev(values):.2g}"


def table(rows: list) -> str:
    """Markdown table: per example and library, mean ± sd over seeds (or the error of failed runs)."""
    out = [
        "| example | library | runs | test accuracy | ε own accountant | ε Opacus RDP (same) "
        "| ε dpopt PLD (same) | steps | step wall s | step CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for example in EXAMPLES:
        for lib in LIBS.get(example, ("opacus", "dpopt")):
            group = [r for r in rows if r["example"] == example and r["lib"] == lib]
            if not group:
                continue
            ok = [r for r in group if "error" not in r]
            if not ok:
                out.append(f"| {example} | {lib} | 0/{len(group)} | failed: {group[-1]['error'][:300]} |||||||")
                continue
            acc = {r.get("accountant") for r in ok}
            out.append(
                f"| {example} | {lib} | {len(ok)}/{len(group)} | {_mean_sd([r['accuracy'] for r in ok])} | "
                f"{_mean_sd([r['eps_own'] for r in ok])} ({'/'.join(sorted(acc))}) | "
                f"{_mean_sd([r['eps_rdp_opacus'] for r in ok])} | "
                f"{_mean_sd([r['eps_pld_dpopt'] for r in ok])} | "
                f"{_mean_sd([r['steps'] for r in ok])} | {_mean_sd([r['step_wall_s'] for r in ok])} | "
                f"{_mean_sd([r['step_cpu_s'] for r in ok])} |"
            )
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", help="the examples/ folder of an Opacus checkout")
    p.add_argument("--data-dir", default="data", help="folder with cifar10.npz")
    p.add_argument("--out", default="runs/opacus-examples")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--only", choices=sorted(EXAMPLES), action="append")
    p.add_argument("--table", action="store_true", help="print the table of the results so far, run nothing")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--cifar-train", type=int, default=10000)
    p.add_argument("--cifar-test", type=int, default=1000)
    p.add_argument("--cifar-batch", type=int, default=500)
    p.add_argument("--cifar-epochs", type=int, default=2)
    p.add_argument("--names-per-language", type=int, default=250)
    p.add_argument("--lstm-batch", type=int, default=64)
    p.add_argument("--lstm-epochs", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_child(json.loads(args.child))), flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    rows = [json.loads(ln) for ln in results.read_text().splitlines() if ln.strip()] if results.exists() else []
    if not args.table:
        if not args.examples or not (Path(args.examples) / "cifar10.py").exists():
            p.error("--examples must be the examples/ folder of an Opacus checkout (with cifar10.py)")
        done = {(r["example"], r["lib"], r["seed"]) for r in rows if "error" not in r}
        for seed in args.seeds:
            for example in args.only or list(EXAMPLES):
                for lib in LIBS.get(example, ("opacus", "dpopt")):
                    if (example, lib, seed) in done:
                        continue
                    t = time.perf_counter()
                    row = run_one(example, lib, seed, args)
                    rows = [r for r in rows if (r["example"], r["lib"], r["seed"]) != (example, lib, seed)] + [row]
                    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
                    status = row.get("error") or (
                        f"accuracy {row['accuracy']:.4f}, eps {row['eps_own']:.4f} "
                        f"({row['accountant']}), {row['steps']} steps"
                    )
                    print(f"{example} {lib} seed {seed}: {status} [{time.perf_counter() - t:.0f} s]", flush=True)
    text = table(rows)
    for example in EXAMPLES:  # equal histories: the same-accountant epsilons are equal by construction
        hist = {r["lib"]: r["history"] for r in rows if r["example"] == example and "error" not in r}
        if len(hist) == 2:
            same = [list(map(list, h)) for h in hist.values()]
            text += f"\n\n{example}: histories {'equal' if same[0] == same[1] else 'DIFFER'}: {same[0]}"
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
