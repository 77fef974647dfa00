"""Resumable grids of ``dpopt train`` runs (``dpopt sweep CONFIG.toml``).

A sweep config is TOML (read with the standard library's ``tomllib``; the
``tomli`` package on Python 3.10)::

    [sweep]
    name = "macadam-mnist"          # default: the file's stem
    out = "runs/sweeps/macadam-mnist"  # run directories go under OUT/runs/ (default runs/sweeps/NAME)
    results = "results.jsonl"       # relative to OUT (default OUT/results.jsonl)
    threads = 1                     # torch CPU threads per run (default: torch's choice)

    [base]                          # fixed TrainConfig options for every run
    dataset = "mnist"
    data_dir = "data"               # mnist.npz / cifar10.npz, relative to where dpopt runs
    batch_size = 256
    epochs = 5

    [grid]                          # every list is an axis; the runs are the cartesian product
    noise_multiplier = [0.5, 1.0, 1.5, 2.0]
    seed = [0, 1, 2]

    [[variant]]                     # optional: the grid is crossed with each variant in turn;
    method = ["dp-sgd", "dp-adam"]  # a list here is one more axis, a scalar fixes the option
    [[variant]]
    method = "dp-macadam"
    hparams = { variance_update = "unbiased" }
    label = "dp-macadam-unbiased"   # the row name in `dpopt report` (default: the method)

Keys are :class:`~dpopt.training.TrainConfig` field names (``method``,
``noise_multiplier``, ``target_epsilon``, ``batch_size``, ``lr``, ``seed``,
``dataset``, ``model``, ``hparams``, ``validation_fraction``, ...) plus ``label``.
``validation_fraction`` holds out the same training records in every run (a
fixed public permutation), so ``dpopt report --metric val_accuracy`` compares
runs on one validation set; the choice it supports is not charged to any ε. ``out`` and
``overwrite`` belong to the sweep. Relative paths are relative to the
current directory.

**Seeds fix initialisation only.** The noise and Poisson masks of every run
come from a secret generator seeded from OS entropy, as for ``dpopt train``;
two runs with the same seed differ. ``reproducible_noise = true`` (in
``[base]``) seeds them from ``seed`` for research reruns — such runs have no
privacy guarantee and their ledgers fail ``dpopt check``.

Every finished run (completed, or stopped at its ``max_epsilon`` budget) is
appended to the results JSONL as one line: the run's public summary (the same
fields as its ``summary.json``) plus ``run_id``, ``label``, ``sweep`` and
``point`` (the grid point: the options that vary). Running the same sweep again
skips the runs already in the results file; a run whose directory has a
finished ``summary.json`` is appended without training; a run with a
checkpoint is continued with :func:`dpopt.training.resume` (its releases
before the interruption stay charged); any other partial run directory is
started afresh (its files replaced; the discarded run's releases are not
part of the new run's ε).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Union, cast

from ..atomic import append_whole
from ..errors import ConfigError
from ..jsonio import dumps, loads

__all__ = ["SweepPoint", "Sweep", "load_sweep", "parse_sweep", "read_results", "run_sweep", "FINISHED"]

#: Summary statuses that count as finished (not re-run).
FINISHED = ("completed", "budget_exhausted")
_RESERVED = {"label"}
_SWEEP_KEYS = {"name", "out", "results", "threads"}
_NOT_IN_GRID = {"out", "overwrite"}


def _toml_load(path: Path) -> dict:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    """One run of a sweep: its options (TrainConfig fields), label and identity."""

    options: dict
    label: str
    point: dict  # the options that vary across the sweep (plus label)
    run_id: str

    @property
    def slug(self) -> str:
        parts = [self.label]
        for key, value in self.point.items():
            if (
                key in ("method", "label")
                or value is None
                or (key == "hparams" and self.label != self.options.get("method"))
            ):
                continue
            short = {
                "noise_multiplier": "nm",
                "target_epsilon": "eps",
                "batch_size": "b",
                "seed": "s",
                "lr": "lr",
                "dataset": "",
                "model": "",
                "epochs": "ep",
            }.get(key, key)
            text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
            parts.append(f"{short}{text}")
        slug = "-".join(parts)
        slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in slug)[:80]
        return f"{slug}-{self.run_id[:8]}"


@dataclasses.dataclass
class Sweep:
    """A parsed sweep: name, output directory, results file, threads and the points in order."""

    name: str
    out: Path
    results: Path
    threads: Optional[int]
    points: list

    def run_dir(self, point: SweepPoint) -> Path:
        return self.out / "runs" / point.slug


def _fields() -> set:
    from ..training import TrainConfig

    return {f.name for f in dataclasses.fields(TrainConfig)}


def _check_keys(table: dict, where: str, fields: set) -> None:
    bad = sorted(set(table) - fields - _RESERVED)
    if bad:
        raise ConfigError(
            f"{where}: unknown option(s) {', '.join(bad)}; use TrainConfig fields "
            f"({', '.join(sorted(fields))}) or label"
        )
    given = sorted(set(table) & _NOT_IN_GRID)
    if given:
        raise ConfigError(f"{where}: {', '.join(given)} is set by the sweep ([sweep] out), not per run")


def _check_method(method: Any, label: str) -> None:
    """Refuse an unknown method when the config is read (a dry run listed it as "todo" before).

    Raises:
        ConfigError: naming the run's label and every method there is.
    """
    from ..methods import get_method

    if method is None:
        return
    try:
        get_method(str(method))
    except ConfigError as exc:
        raise ConfigError(f"run {label!r}: {exc}") from None


def _run_id(options: dict) -> str:
    text = json.dumps(options, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def parse_sweep(
    raw: dict,
    *,
    name: str = "sweep",
    out: Optional[Union[str, Path]] = None,
    results: Optional[Union[str, Path]] = None,
    data_dir: Optional[str] = None,
) -> Sweep:
    """Build a :class:`Sweep` from a parsed TOML document.

    ``data_dir`` (if given) replaces every run's ``data_dir`` — where the files
    are read from, not part of a run's identity: run ids stay those of the
    config, so finished runs are still recognised.

    Raises:
        ConfigError: unknown tables or options, an empty axis, or no runs.
    """
    unknown = sorted(set(raw) - {"sweep", "base", "grid", "variant"})
    if unknown:
        raise ConfigError(f"unknown table(s) {', '.join(unknown)}; a sweep has [sweep], [base], [grid] and [[variant]]")
    meta = dict(raw.get("sweep", {}))
    bad = sorted(set(meta) - _SWEEP_KEYS)
    if bad:
        raise ConfigError(f"[sweep]: unknown key(s) {', '.join(bad)}; use {', '.join(sorted(_SWEEP_KEYS))}")
    fields = _fields()
    base, grid = dict(raw.get("base", {})), dict(raw.get("grid", {}))
    variants = [dict(v) for v in raw.get("variant", [])] or [{}]
    _check_keys(base, "[base]", fields)
    _check_keys(grid, "[grid]", fields)
    for i, v in enumerate(variants):
        _check_keys(v, f"[[variant]] {i + 1}", fields)
    name = str(meta.get("name", name))
    out_dir = Path(out if out is not None else meta.get("out", Path("runs") / "sweeps" / name))
    res = Path(results) if results is not None else out_dir / str(meta.get("results", "results.jsonl"))
    threads = meta.get("threads")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"[sweep] threads must be an integer >= 1, got {threads!r}")

    points: list[SweepPoint] = []
    seen: set = set()
    all_axes: list[dict] = []
    for v in variants:
        merged = {**grid, **v}
        axes = {k: (val if isinstance(val, list) else [val]) for k, val in merged.items()}
        for k, val in axes.items():
            if not val:
                raise ConfigError(f"option {k!r} has an empty list of values")
        all_axes.append(axes)
    # the options that vary: an axis with more than one value anywhere, or a key not in every variant
    varying: list[str] = []
    for axes in all_axes:
        for k in axes:
            if k in varying:
                continue
            values = {json.dumps(x, sort_keys=True) for a in all_axes for x in a.get(k, [None])}
            if len(values) > 1:
                varying.append(k)
    for axes in all_axes:
        keys = list(axes)
        for combo in itertools.product(*(axes[k] for k in keys)):
            chosen = dict(zip(keys, combo))
            options = {**base, **{k: val for k, val in chosen.items() if k != "label"}}
            if "hparams" in base and "hparams" in chosen:  # merge the method hyperparameters
                options["hparams"] = {**base["hparams"], **chosen["hparams"]}
            label = str(chosen.get("label", base.get("label", options.get("method", "dp-macadam"))))
            options.pop("label", None)
            _check_method(options.get("method"), label)
            rid = _run_id(options)
            if rid in seen:
                continue
            if data_dir is not None:
                options["data_dir"] = str(data_dir)
            seen.add(rid)
            point = {k: chosen.get(k, options.get(k)) for k in varying if k != "label"}
            point["label"] = label
            points.append(SweepPoint(options=options, label=label, point=point, run_id=rid))
    if not points:
        raise ConfigError("the sweep has no runs")
    return Sweep(name=name, out=out_dir, results=res, threads=threads, points=points)


def load_sweep(
    path: Union[str, Path],
    *,
    out: Optional[Union[str, Path]] = None,
    results: Optional[Union[str, Path]] = None,
    data_dir: Optional[str] = None,
) -> Sweep:
    """Read a sweep config (TOML) — see the module docstring for the format.

    Raises:
        FileNotFoundError: no such file. ConfigError: an invalid config.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no sweep config at {path}")
    return parse_sweep(_toml_load(path), name=path.stem, out=out, results=results, data_dir=data_dir)


def read_results(path: Union[str, Path]) -> list[dict]:
    """The records of a results JSONL (a torn last line, from a killed writer, is ignored)."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _append(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    append_whole(path, (dumps(record, default=str) + "\n").encode())  # a whole line or none (a full disk)


def _record(sweep: Sweep, point: SweepPoint, summary: dict) -> dict:
    return {**summary, "run_id": point.run_id, "label": point.label, "sweep": sweep.name, "point": point.point}


_DATA_CACHE: dict = {}


def _data(options: dict):
    from ..data import load_dataset

    key = (options.get("dataset", "digits"), options.get("data_dir"))
    if key not in _DATA_CACHE:
        _DATA_CACHE.clear()  # one dataset in memory at a time
        _DATA_CACHE[key] = load_dataset(*key)
    return _DATA_CACHE[key]


def execute(
    point_options: dict, run_dir: str, threads: Optional[int] = None, on_step: Optional[Callable[[dict], None]] = None
) -> dict:
    """Run (or resume, or collect) one sweep point in this process; return its summary."""
    import warnings

    import torch

    from ..training import CHECKPOINT_NAME, TrainConfig, resume, train
    from ..training.results import finished_summary

    if threads is not None:
        torch.set_num_threads(threads)
    path = Path(run_dir)
    done = finished_summary(path, FINISHED)
    if done is not None:
        return done
    options = dict(point_options)
    data = _data(options)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="reproducible_noise", category=UserWarning)
        if (path / CHECKPOINT_NAME).is_file() and (path / "ledger.jsonl").is_file():
            return resume(path, data=data, on_step=on_step)
        cfg = TrainConfig(**options)
        cfg.out, cfg.overwrite = str(path), True
        return train(cfg, data=data, on_step=on_step)


def _worker(args: tuple) -> dict:  # a --jobs process
    options, run_dir, threads = args
    return execute(options, run_dir, threads)


def run_sweep(
    sweep: Sweep,
    *,
    jobs: int = 1,
    threads: Optional[int] = None,
    on_event: Optional[Callable[[str, dict], None]] = None,
) -> dict:
    """Run every point not yet in the results file; append each finished run's record.

    Args:
        sweep: from :func:`load_sweep`.
        jobs: parallel worker processes (1: in this process, with per-step progress).
        threads: torch threads per run (default ``sweep.threads``).
        on_event: ``on_event(kind, info)`` for a display; kinds ``"start"``
            (``{"total", "done", "todo"}``), ``"run"`` (``{"point", "index"}``), ``"step"``
            (train's on_step dict plus ``"point"``), ``"finished"`` (``{"point", "record"}``),
            ``"stopped"`` (``{"point", "summary"}``: interrupted; the sweep stops).

    Returns:
        ``{"total", "skipped", "ran", "interrupted"}`` (counts; ``interrupted`` a bool).
    """
    threads = threads if threads is not None else sweep.threads
    emit = on_event or (lambda kind, info: None)
    done_ids = {r.get("run_id") for r in read_results(sweep.results)}
    todo = [p for p in sweep.points if p.run_id not in done_ids]
    emit("start", {"total": len(sweep.points), "done": len(sweep.points) - len(todo), "todo": len(todo)})
    ran, interrupted = 0, False

    def finish(point: SweepPoint, summary: dict) -> bool:
        nonlocal ran
        if summary.get("status", "completed") not in FINISHED:
            emit("stopped", {"point": point, "summary": summary})
            return False
        record = _record(sweep, point, summary)
        _append(sweep.results, record)
        ran += 1
        emit("finished", {"point": point, "record": record})
        return True

    if jobs <= 1:
        for i, point in enumerate(todo):
            emit("run", {"point": point, "index": i})
            summary = execute(
                point.options,
                str(sweep.run_dir(point)),
                threads,
                on_step=cast(Callable, lambda info, p=point: emit("step", {**info, "point": p})),
            )
            if not finish(point, summary):
                interrupted = True
                break
    else:
        import concurrent.futures as cf
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {}
            for i, point in enumerate(todo):
                futures[pool.submit(_worker, (point.options, str(sweep.run_dir(point)), threads))] = point
                emit("run", {"point": point, "index": i})
            try:
                for fut in cf.as_completed(futures):
                    if not finish(futures[fut], fut.result()):
                        interrupted = True
            except KeyboardInterrupt:
                for fut in futures:
                    fut.cancel()
                raise
    return {
        "total": len(sweep.points),
        "skipped": len(sweep.points) - len(todo),
        "ran": ran,
        "interrupted": interrupted,
    }


def describe(point: SweepPoint) -> str:
    """A short human-readable name of a point: ``label k=v ...``."""
    rest = " ".join(f"{k}={v}" for k, v in point.point.items() if k not in ("label", "method") and v is not None)
    return f"{point.label} {rest}".strip()


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `dpopt sweep CONFIG.toml`")
