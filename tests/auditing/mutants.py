"""Privacy mutants: one known privacy bug at a time, switched on by ``DPOPT_MUTANT=<name>``.

Each mutant patches the library at the seam where the real bug would live
(a method of the Privatizer, the sampler, the ledger, the engine's check,
the noise source, ...). Nothing in ``src/`` reads the variable: the patch is
applied by ``tests/auditing/mutant_site/sitecustomize.py`` when that folder
is on ``PYTHONPATH`` (so the mutant reaches every subprocess a test starts:
the CLI, gloo ranks), or in-process by :func:`activate`.

Kill table (not a test; minutes per mutant)::

    OMP_NUM_THREADS=1 nice -n 19 python tests/auditing/mutants.py [--mutants a,b] [--out table.md]

runs the CI subset :data:`KILL_SUBSET` once per mutant (pytest, ``-m "not slow"``,
``--maxfail`` :data:`MAX_CAUGHT`) and prints mutant → the tests that failed.
``tests/auditing/test_mutations.py`` checks in CI that each mutant's seam
changes behaviour (:func:`probe`), in-process and through a subprocess.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ENV = "DPOPT_MUTANT"
HERE = Path(__file__).resolve().parent
SITE = HERE / "mutant_site"
ROOT = HERE.parent.parent

#: The CI subset run under each mutant to build the kill table (paths relative to the repository root).
KILL_SUBSET = [
    "tests/core/test_privatizer.py",
    "tests/core/test_sampling.py",
    "tests/core/test_noise_tail.py",
    "tests/core/test_private_outputs.py",
    "tests/core/test_engine_state_ledger.py",
    "tests/core/test_engine_state_privatizer.py",
    "tests/accounting/test_ledger.py",
    "tests/accounting/test_ledger_check.py",
    "tests/engine/test_train_mode_check.py",
    "tests/engine/test_sensitivity.py",
    "tests/integration/test_privacy_engine_state.py",
    "tests/integration/test_validator.py",
    "tests/methods/test_shared_suite.py",
    "tests/auditing/test_auditing.py",
    "tests/auditing/test_one_run.py",
]
#: Extra files for mutants whose seam only a tier outside KILL_SUBSET exercises.
EXTRA_SUBSET = {"noise_per_rank_unscaled": ["tests/distributed/test_ddp_equivalence.py"]}
#: Tests that fail under EVERY mutant for a reason that is not the bug: sitecustomize imports torch and dpopt
#: at interpreter start, which a test of what an import loads sees. Left out of the table.
ARTIFACTS = ("tests/auditing/test_auditing.py::test_stats_module_imports_no_torch",)
MAX_CAUGHT = 5  # pytest --maxfail: the first tests that catch a mutant are enough for the table


@dataclass(frozen=True)
class Mutant:
    """A privacy bug: what it is, the seam it patches, and how to apply it (returns an undo)."""

    name: str
    bug: str
    seam: str
    apply: Callable[[], Callable[[], None]]


def _patch(owner, attr: str, value) -> Callable[[], None]:
    """Set ``owner.attr`` (and every loaded ``dpopt.*`` module's alias of the same object); return the undo."""
    old = getattr(owner, attr)
    undo = [(owner, attr, old)]
    setattr(owner, attr, value)
    if isinstance(owner, type(sys)):  # a module-level function: rebind the names other modules imported
        for mod in list(sys.modules.values()):
            if (
                mod is not owner
                and getattr(mod, "__name__", "").startswith("dpopt")
                and getattr(mod, attr, None) is old
            ):
                undo.append((mod, attr, old))
                setattr(mod, attr, value)

    def restore() -> None:
        for o, a, v in undo:
            setattr(o, a, v)

    return restore


def _wrap_draw(scale_of: Callable) -> Callable[[], None]:
    """Privatizer._draw with every gradient-noise tensor passed through ``scale_of(self, z)``."""
    from dpopt.privatizer import Privatizer

    draw = Privatizer._draw

    def mutated(self, std, rounded=False, **kw):  # kw: scaled=False (z unscaled, × σS in the release's pass)
        # passed through, as a wrapper should; one that dropped it would still be scaled once (_draw leaves the
        # multiplier it did not apply in self._unapplied, which the release's pass uses)
        noise, count = draw(self, std, rounded, **kw)
        return [scale_of(self, z) for z in noise], count

    return _patch(Privatizer, "_draw", mutated)


# --------------------------------------------------------------------------- the mutants
def _clip_skipped():
    from dpopt.privatizer import Privatizer

    accumulate = Privatizer.accumulate

    def mutated(self, source):
        saved = self.bounds
        self.bounds = [math.inf] * len(saved)  # weights min(1, C/‖w‖) = 1: nothing clipped
        try:
            return accumulate(self, source)
        finally:
            self.bounds = saved

    return _patch(Privatizer, "accumulate", mutated)


def _noise_half():
    return _wrap_draw(lambda self, z: z * 0.5)


def _noise_div_bbar_twice():
    return _wrap_draw(lambda self, z: z / float(self.expected_batch_size))


def _noise_bf16():
    import torch

    return _wrap_draw(lambda self, z: z.to(torch.bfloat16).to(z.dtype))


def _noise_per_rank_unscaled():
    from dpopt.distributed import AllReduceRelease

    call = AllReduceRelease.__call__

    def mutated(self, sums, count, draw):
        if not self.ctx.is_main:  # every rank adds its own full-size noise: sqrt(W) sigma S in the total
            noise, _ = draw()
            sums = [s + z.to(s.dtype) for s, z in zip(sums, noise)]
        return call(self, sums, count, draw)

    return _patch(AllReduceRelease, "__call__", mutated)


def _poisson_shuffled():
    import torch

    from dpopt.sampling import PoissonSampler

    def mutated(self):
        self.position += 1
        k = int(round(self.sample_rate * self.dataset_size))
        return torch.randperm(self.dataset_size)[:k]  # fixed-size shuffled batches, accounted as Poisson

    return _patch(PoissonSampler, "sample", mutated)


def _ledger_missing_step():
    from dpopt.accounting.ledger import LedgerEntry, PrivacyLedger

    record = PrivacyLedger.record

    def mutated(self, step, event, **meta):
        self._mutant_calls = getattr(self, "_mutant_calls", 0) + 1
        if self._mutant_calls == 2:  # the second release is never written down
            return LedgerEntry(int(step), event, dict(meta))
        return record(self, step, event, **meta)

    return _patch(PrivacyLedger, "record", mutated)


def _microbatch_several_steps():
    from dp_accounting import dp_event

    from dpopt.accounting.events import poisson_composed_step
    from dpopt.privatizer import Privatizer

    def mutated(self):
        sigmas = [self.noise_multiplier] + ([self.quantile.count_noise_multiplier] if self.quantile else [])
        half = poisson_composed_step(sigmas, self.sample_rate / 2.0)  # 2 micro-batches = 2 steps at q/2
        return dp_event.ComposedDpEvent([half, half])

    return _patch(Privatizer, "step_event", mutated)


def _batchnorm_kept():
    from torch import nn

    import dpopt.models
    import dpopt.training.build  # noqa: F401  (imports check_model by name: rebound too)

    check = dpopt.models.check_model

    def mutated(model):
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            return None  # BatchNorm let through
        return check(model)

    return _patch(dpopt.models, "check_model", mutated)


def _nonfinite_clipped_large():
    import torch

    from dpopt.engine.reference import PerSampleGrads

    init = PerSampleGrads.__init__

    def mutated(self, grads, *args, **kwargs):
        grads = [torch.nan_to_num(g, nan=1e6, posinf=1e6, neginf=-1e6) for g in grads]
        return init(self, grads, *args, **kwargs)

    return _patch(PerSampleGrads, "__init__", mutated)


def _quantile_count_uncharged():
    from dpopt.accounting.events import poisson_composed_step
    from dpopt.privatizer import Privatizer

    def mutated(self):
        return poisson_composed_step([self.noise_multiplier], self.sample_rate)  # the count's Gaussian dropped

    return _patch(Privatizer, "step_event", mutated)


def _private_loss_printed():
    from dpopt.training.results import RunFiles

    metric = RunFiles.metric

    def mutated(self, row):
        return metric(self, dict(row, train_loss=0.6931))  # the private batch loss in metrics.jsonl

    return _patch(RunFiles, "metric", mutated)


def _train_mode_only_mixing():
    import dpopt.engine.check as check
    import dpopt.engine.fast  # noqa: F401
    import dpopt.engine.hooks  # noqa: F401

    in_modes = check.in_modes

    @contextlib.contextmanager
    def mutated(model, signature=None):
        with in_modes(model, [False] * len(list(model.modules()))):  # the check runs in eval mode
            yield

    return _patch(check, "in_modes", mutated)


def _tail_cut_gaussian():
    import dpopt.noise

    sampler, ziggurat = dpopt.noise.gaussian_from_words, dpopt.noise.ziggurat_normals

    def mutated(*args, **kwargs):
        return sampler(*args, **kwargs).clamp_(-5.77, 5.77)  # torch's float32 Box-Muller radius

    def mutated_ziggurat(*args, **kwargs):  # the CPU sampler of secret and reproducible noise
        out = ziggurat(*args, **kwargs)
        return out.clip(-5.77, 5.77, out=out)

    undo = _patch(dpopt.noise, "gaussian_from_words", mutated)
    undo_ziggurat = _patch(dpopt.noise, "ziggurat_normals", mutated_ziggurat)

    def undo_both():
        undo_ziggurat()
        undo()

    return undo_both


def _ledger_dropped_from_checkpoint():
    from dpopt.privatizer import Privatizer

    state_dict = Privatizer.state_dict

    def mutated(self, *, include_ledger=True):
        return state_dict(self, include_ledger=False)

    return _patch(Privatizer, "state_dict", mutated)


MUTANTS = {
    m.name: m
    for m in [
        Mutant("clip_skipped", "clipping skipped", "Privatizer.accumulate", _clip_skipped),
        Mutant("noise_half", "noise x0.5", "Privatizer._draw", _noise_half),
        Mutant(
            "noise_per_rank_unscaled",
            "noise drawn per rank, not scaled",
            "distributed.AllReduceRelease.__call__",
            _noise_per_rank_unscaled,
        ),
        Mutant(
            "poisson_shuffled",
            "Poisson sampling replaced by shuffled fixed batches",
            "PoissonSampler.sample",
            _poisson_shuffled,
        ),
        Mutant("ledger_missing_step", "ledger missing a step", "PrivacyLedger.record", _ledger_missing_step),
        Mutant(
            "microbatch_several_steps",
            "micro-batches charged as several steps of a smaller batch",
            "Privatizer.step_event",
            _microbatch_several_steps,
        ),
        Mutant("noise_div_bbar_twice", "noise divided by B-bar twice", "Privatizer._draw", _noise_div_bbar_twice),
        Mutant("batchnorm_kept", "BatchNorm left in the model", "models.check_model", _batchnorm_kept),
        Mutant("noise_bf16", "noise drawn in bf16", "Privatizer._draw", _noise_bf16),
        Mutant(
            "nonfinite_clipped_large",
            "non-finite gradient clipped to a large finite value instead of zeroed",
            "engine.reference.PerSampleGrads.__init__",
            _nonfinite_clipped_large,
        ),
        Mutant(
            "quantile_count_uncharged", "quantile count not charged", "Privatizer.step_event", _quantile_count_uncharged
        ),
        Mutant(
            "private_loss_printed",
            "a loss on private data printed (metrics.jsonl)",
            "training.results.RunFiles.metric",
            _private_loss_printed,
        ),
        Mutant(
            "train_mode_only_mixing",
            "train-mode-only mixing: the per-sample check runs in eval mode",
            "engine.check.in_modes",
            _train_mode_only_mixing,
        ),
        Mutant(
            "tail_cut_gaussian",
            "a tail-cut Gaussian (|z| <= 5.77)",
            "noise.gaussian_from_words, noise.ziggurat_normals",
            _tail_cut_gaussian,
        ),
        Mutant(
            "ledger_dropped_from_checkpoint",
            "the ledger dropped from a checkpoint",
            "Privatizer.state_dict",
            _ledger_dropped_from_checkpoint,
        ),
    ]
}


def activate(name: str) -> Callable[[], None]:
    """Apply mutant ``name`` in this process; return the function that removes it.

    Raises:
        KeyError: unknown name (the message lists the mutants).
    """
    if name not in MUTANTS:
        raise KeyError(f"unknown mutant {name!r}; choose one of {', '.join(MUTANTS)}")
    return MUTANTS[name].apply()


def activate_from_env() -> str | None:
    """Apply the mutant named by ``$DPOPT_MUTANT`` (if any); return its name."""
    name = os.environ.get(ENV)
    if name:
        activate(name)
    return name or None


# --------------------------------------------------------------------------- probes (the seam changes behaviour)
def _privatizer(**kw):
    import torch

    from dpopt.privatizer import Privatizer

    return Privatizer(
        kw.pop("sigma", 1.0), 1.0, 4.0, kw.pop("q", 1.0), generator=torch.Generator().manual_seed(0), **kw
    )


def _release_of(grads, **kw):
    from dpopt.engine.reference import PerSampleGrads

    p = _privatizer(**kw)
    r = p.privatize(PerSampleGrads(grads))
    return p, r


def probe(name: str):
    """A small, deterministic observable that mutant ``name`` changes (compare with and without it)."""
    import torch

    if name in ("clip_skipped",):
        _, r = _release_of([torch.full((2, 3), 10.0)], sigma=0.0)
        return round(float(r.grads[0].sum()), 6)
    if name in ("noise_half", "noise_div_bbar_twice", "noise_bf16"):
        _, r = _release_of([torch.zeros(1, 4000)], sigma=1.0)
        z = r.grads[0].double() * 4.0  # sigma S z / B-bar * B-bar
        return (round(float(z.std()), 2), int(torch.unique(z.to(torch.float32)).numel() < 4000))
    if name == "tail_cut_gaussian":
        import dpopt.noise
        from dpopt.noise import _SLOT_WORDS

        words = torch.zeros(2, 1, dtype=torch.int64)  # all-zero words: the sampler's largest radius, 37.64
        z = dpopt.noise.gaussian_from_words(words, torch.zeros(1, _SLOT_WORDS, dtype=torch.int64))
        return round(float(z[0]), 2)
    if name == "poisson_shuffled":
        from dpopt.sampling import PoissonSampler

        s = PoissonSampler(1000, 0.1, 20)
        return sorted({int(s.sample().numel()) for _ in range(20)}) == [100]
    if name == "ledger_missing_step":
        p = _privatizer()
        from dpopt.engine.reference import PerSampleGrads

        for _ in range(3):
            p.privatize(PerSampleGrads([torch.zeros(1, 2)]))
        return len(p.ledger.entries)
    if name in ("microbatch_several_steps", "quantile_count_uncharged"):
        from dpopt.accounting.accountant import epsilon
        from dpopt.privatizer import QuantileClipping

        p = _privatizer(q=0.01, quantile=QuantileClipping(2.0, 0.5, 0.2, initial_clip=1.0))
        return round(epsilon(p.step_event(), 1e-5), 4)
    if name == "batchnorm_kept":
        from torch import nn

        from dpopt.models import check_model

        try:
            check_model(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
        except ValueError:
            return "refused"
        return "accepted"
    if name == "nonfinite_clipped_large":
        from dpopt.engine.reference import PerSampleGrads

        return int(PerSampleGrads([torch.tensor([[float("nan"), 1.0], [1.0, 1.0]])]).nonfinite)
    if name == "private_loss_printed":
        return _metric_row_keys()
    if name == "train_mode_only_mixing":
        from torch import nn

        from dpopt.engine.check import in_modes

        m = nn.Sequential(nn.Linear(2, 2))
        m.train()
        with in_modes(m):
            return bool(m.training)
    if name == "ledger_dropped_from_checkpoint":
        return "ledger" in _privatizer().state_dict()
    if name == "noise_per_rank_unscaled":
        from dpopt.distributed import AllReduceRelease

        class _Ctx:
            is_main = False

            def all_reduce(self, t, op="sum"):
                return t

        sums = [torch.zeros(3)]
        out = AllReduceRelease(_Ctx())(sums, None, lambda: ([torch.ones(3, dtype=torch.float64)], None))
        return float(out[0][0].sum()) if isinstance(out, tuple) else float(out[0].sum())
    raise KeyError(name)


def _metric_row_keys():
    """The keys RunFiles.metric writes to metrics.jsonl for the row {"step": 1} (a stub run in a temporary dir)."""
    import json
    import tempfile
    from types import SimpleNamespace

    from dpopt.training.results import RunFiles

    with tempfile.TemporaryDirectory() as d:
        stub = SimpleNamespace(run_dir=Path(d), tensorboard=None, flush=lambda: None)
        RunFiles.metric(stub, {"step": 1})
        return sorted(json.loads((Path(d) / "metrics.jsonl").read_text().splitlines()[0]))


# --------------------------------------------------------------------------- the kill table
def _failures(output: str) -> list[str]:
    return sorted(
        set(re.findall(r"^FAILED (\S+)", output, flags=re.M) + re.findall(r"^ERROR (\S+)", output, flags=re.M))
    )


def run_subset(name: str | None, files=None, timeout: int = 1800) -> tuple[list[str], str, float]:
    """Run the kill subset under mutant ``name`` (None: unmutated); return (failed test ids, pytest's summary, seconds)."""
    env = dict(os.environ)
    env.pop(ENV, None)
    if name:
        env[ENV] = name
        env["PYTHONPATH"] = os.pathsep.join([str(SITE)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    files = list(files or KILL_SUBSET) + (EXTRA_SUBSET.get(name, []) if name else [])
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "not slow and not hf",
        "-p",
        "no:cacheprovider",
        "-rfE",
        *files,
    ] + ([f"--maxfail={MAX_CAUGHT}"] if name else [])
    t = time.time()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = res.stdout + res.stderr
    summary = (out.strip().splitlines() or [""])[-1]
    return _failures(out), summary, time.time() - t


def main(argv=None) -> int:
    """Build and print the kill table (``--out``: also write it); exit 1 if any mutant survived."""
    ap = argparse.ArgumentParser(description="Build the mutation kill table (mutant -> tests that caught it).")
    ap.add_argument("--mutants", default=",".join(MUTANTS), help="comma-separated names (default: all)")
    ap.add_argument("--out", default=None, help="also write the markdown table to this file")
    ap.add_argument("--files", default=None, help="comma-separated test files instead of KILL_SUBSET")
    args = ap.parse_args(argv)
    files = args.files.split(",") if args.files else None
    rows = ["| mutant | bug | seam | caught by (first failing tests) |", "|---|---|---|---|"]
    survived = []
    base_failed, base_summary, base_secs = run_subset(None, files)  # failures without any mutant do not count
    print(f"unmutated: {len(base_failed)} failing ({base_secs:.0f} s) {base_summary}", flush=True)
    for name in args.mutants.split(","):
        failed, summary, secs = run_subset(name, files)
        failed = [f for f in failed if f not in base_failed and f not in ARTIFACTS]
        m = MUTANTS[name]
        caught = "<br>".join(f"`{f}`" for f in failed) if failed else "**SURVIVED**"
        if not failed:
            survived.append(name)
        rows.append(f"| `{name}` | {m.bug} | `{m.seam}` | {caught} |")
        print(f"{name}: {len(failed)} failing ({secs:.0f} s) {summary}", flush=True)
    if base_failed:
        rows.append(f"\nFailing without any mutant (not counted): {', '.join(base_failed)}")
    table = "\n".join(rows)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n", encoding="utf-8")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
