"""A run's ledger as a report: its releases grouped into runs, re-scored with every accountant.

What ``dpopt ledger`` prints, as plain data, so that Python users get the same
numbers without the command line::

    from dpopt.accounting.report import ledger_report

    report = ledger_report("runs/mnist-dp-sgd")          # δ and accountant from summary.json
    report.epsilon_by_accountant                           # {"pld": 1.93, "rdp": 2.11, "prv": ...}
    [(r.first_step, r.last_step, r.sigma_eff) for r in report.runs]

Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from ..errors import ConfigError
from ..jsonio import json_safe, loads
from .accountant import epsilon_report
from .events import summarize_event
from .ledger import JOURNAL_NAME, PrivacyLedger, run_ledger_file
from .ledger_files import compare_ledger_files
from .registry import REGISTRY, check_accountant
from .validation import check_delta

__all__ = [
    "LedgerReport",
    "ReleaseRun",
    "ledger_report",
    "ledger_runs",
    "mechanism_brief",
    "score_ledger",
    "DEFAULT_DELTA",
]

DEFAULT_DELTA = 1e-5  # the δ of every dpopt command when neither the user nor the run gives one

#: An accountant's failure on one ledger is that accountant's "n.a.", never a crash of the report.
_ACCOUNTANT_FAILURES = (ValueError, ImportError, RuntimeError, ArithmeticError, MemoryError)


@dataclass
class ReleaseRun:
    """Consecutive ledger entries that recorded the same DpEvent.

    Attributes:
        first_step, last_step: the steps of the first and last entry.
        count: the number of entries.
        sample_rates: the Poisson sampling rates in the event, sorted (empty: no sampling).
        noise_multipliers: every Gaussian noise multiplier of one entry, in recorded order.
        sigma_eff: the effective σ of each (q, σ) term of one entry.
        unsupported: event parts that are not (Poisson-sampled) Gaussians.
        sensitivity_min, sensitivity_max: the range of the recorded ``sensitivity``
            (the clip bound actually applied), ``None`` if not recorded.
        no_op: the entries recorded a no-op event (correlated noise: these steps use their batches, but
            their cost was charged in advance by the earlier releases, the worst case over participation
            patterns; docs/correlated-noise.md).
    """

    first_step: int
    last_step: int
    count: int
    sample_rates: list
    noise_multipliers: list
    sigma_eff: list
    unsupported: list
    sensitivity_min: Optional[float] = None
    sensitivity_max: Optional[float] = None
    no_op: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def ledger_runs(ledger: Any) -> list[ReleaseRun]:
    """Group a :class:`~dpopt.accounting.ledger.PrivacyLedger`'s entries into :class:`ReleaseRun` s."""
    runs: list[ReleaseRun] = []
    last_event = None
    for entry in ledger.groups:  # run-length groups: O(groups)
        if runs and last_event == entry.event:
            run = runs[-1]
            run.count += entry.count
            run.last_step = entry.step + entry.count - 1
        else:
            parsed = summarize_event(entry.event)
            run = ReleaseRun(
                first_step=entry.step,
                last_step=entry.step + entry.count - 1,
                count=entry.count,
                sample_rates=sorted(parsed.rates),
                noise_multipliers=parsed.gaussians,
                sigma_eff=[s for (_, s) in parsed.terms],
                unsupported=sorted(set(parsed.unsupported)),
                no_op=not parsed.gaussians and not parsed.unsupported,
            )
            runs.append(run)
            last_event = entry.event
        sens = entry.meta.get("sensitivity")
        if isinstance(sens, (int, float)):
            run.sensitivity_min = sens if run.sensitivity_min is None else min(run.sensitivity_min, sens)
            run.sensitivity_max = sens if run.sensitivity_max is None else max(run.sensitivity_max, sens)
    return runs


def score_ledger(ledger: Any, delta: float) -> tuple[dict, dict]:
    """ε of the whole ledger with every accountant.

    Returns:
        ``(scores, notes)``: ``scores[name]`` is ε (a float, possibly ``inf``)
        or ``"n.a.: <reason>"`` when that accountant is unavailable or fails
        on this ledger; ``notes[name]`` lists the accountant's notes (e.g. a
        coarsened grid; the ε is still an upper bound), only where there are any.
    """
    scores: dict[str, Union[float, str]] = {}
    notes: dict[str, list] = {}
    for name, accountant in REGISTRY.items():
        if not accountant.available():
            scores[name] = f"n.a.: unavailable (pip install {accountant.requires})"
            continue
        try:
            report = epsilon_report(ledger, delta, name)
        except _ACCOUNTANT_FAILURES as exc:
            text = str(exc) or type(exc).__name__
            if not isinstance(exc, (ValueError, ImportError)):
                text = f"{type(exc).__name__}: {text}"
            scores[name] = f"n.a.: {text}"
            continue
        scores[name] = float(report.epsilon)
        if report.notes:
            notes[name] = list(report.notes)
    return scores, notes


@dataclass
class LedgerReport:
    """A run's ledger, grouped and re-scored (see :func:`ledger_report`).

    Attributes:
        run_dir: the run directory as given.
        neighbouring, sampling, noise, dataset_size: the ledger's header.
        releases: the number of ledger entries.
        delta: δ at which every accountant was asked.
        accountant: the headline accountant.
        epsilon_by_accountant: ε per accountant (float) or ``"n.a.: <reason>"``.
        notes: per accountant, its notes (only accountants with notes).
        runs: the entries grouped into :class:`ReleaseRun` s.
        summary_epsilon, summary_accountant: what the run's summary.json claimed (``None`` without one).
        run_delta: the δ the run itself records (its summary, else its ledger header; ``None``: none);
            differs from ``delta`` only when the caller asked for another δ.
        ledger_file: the file the releases were read from (``ledger.jsonl``, ``ledger.json``, ``privacy_ledger.json``
            or the file given).
        disagreement: when a run directory's ``ledger.json`` contradicts its journal, the first difference
            (:func:`~dpopt.accounting.ledger_files.compare_ledger_files`); the journal is what was scored.
        mechanism_problem: a correlated-noise ledger whose releases (or header) contradict its own mechanism
            record, re-derived from the record alone (:func:`~dpopt.accounting.matrix_factorization.check_record`,
            what ``dpopt check`` fails): the problems found, joined; None when they agree or there is no record.
            The entries as written are still what was scored.
        mechanism: a correlated-noise ledger's mechanism in brief (:func:`mechanism_brief`: kind, bands or
            buffers, σ, Δ, sample rate); None for independent noise.
    """

    run_dir: str
    neighbouring: str
    sampling: str
    noise: str
    dataset_size: str
    releases: int
    delta: float
    accountant: str
    epsilon_by_accountant: dict
    notes: dict = field(default_factory=dict)
    runs: list = field(default_factory=list)
    summary_epsilon: Any = None
    summary_accountant: Optional[str] = None
    run_delta: Optional[float] = None
    ledger_file: Optional[str] = None
    disagreement: Optional[str] = None
    mechanism_problem: Optional[str] = None
    mechanism: Optional[dict] = None

    @property
    def epsilon(self) -> Union[float, str, None]:
        """The headline accountant's ε (or its ``"n.a.: ..."``)."""
        return self.epsilon_by_accountant.get(self.accountant)

    def to_dict(self) -> dict:
        """JSON-ready dict (keys as in ``dpopt ledger --json``; ``inf`` as the string ``"inf"``)."""
        scores = json_safe(dict(self.epsilon_by_accountant))
        return {
            "run_dir": self.run_dir,
            "neighbouring": self.neighbouring,
            "sampling": self.sampling,
            "noise": self.noise,
            "dataset_size": self.dataset_size,
            "notes": self.notes,
            "releases": self.releases,
            "delta": self.delta,
            "run_delta": self.run_delta,
            "ledger_file": self.ledger_file,
            "disagreement": self.disagreement,
            "mechanism_problem": self.mechanism_problem,
            "mechanism": self.mechanism,
            "accountant": self.accountant,
            "epsilon": scores.get(self.accountant),
            "epsilon_by_accountant": scores,
            "epsilon_summary": self.summary_epsilon,
            "runs": [r.to_dict() for r in self.runs],
        }


def _ledger_and_summary(path: Path) -> tuple[PrivacyLedger, Optional[Path], Path]:
    """The ledger at ``path`` (a run directory, a DPTrainer checkpoint or a ledger file), its summary's path and
    the file the ledger was read from."""
    from .ledger_check import ENGINE_RUN_FILES, run_paths

    if path.is_dir():
        ledger_path, summary_path = run_paths(path)
        own = [path / "ledger.json", path / "ledger.jsonl"]
        if ledger_path.name != ENGINE_RUN_FILES[0] and not any(p.exists() for p in own):
            if (path / ENGINE_RUN_FILES[0]).exists():  # a DPTrainer checkpoint without its summary: the header's δ
                ledger_path, summary_path = path / ENGINE_RUN_FILES[0], path / ENGINE_RUN_FILES[1]
        if ledger_path.name != ENGINE_RUN_FILES[0]:
            ledger_path = run_ledger_file(path)  # the journal: every release, also of a run killed before ledger.json
        return PrivacyLedger.load(ledger_path), summary_path, ledger_path
    book = PrivacyLedger.load(path)
    pair = ENGINE_RUN_FILES[1] if path.name == ENGINE_RUN_FILES[0] else "summary.json"
    candidates = [path.parent / pair, path.parent / "summary.json", path.parent / ENGINE_RUN_FILES[1]]
    return book, next((c for c in candidates if c.exists()), None), path


def ledger_report(
    run_dir: Union[str, Path], accountant: Optional[str] = None, delta: Optional[float] = None
) -> LedgerReport:
    """Load a run's ledger, group its releases and score it with every accountant.

    Args:
        run_dir: a run directory with ``ledger.json`` (and, optionally, ``summary.json``),
            a DPTrainer checkpoint (``privacy_ledger.json``, ``privacy_summary.json``),
            or a ledger file (JSON or journal) itself: its summary is looked for beside it.
        accountant: the headline accountant; default the run's (from
            summary.json), else ``"pld"``. Every available accountant is scored anyway.
        delta: δ; default the run's: the summary's (``summary.json`` /
            ``privacy_summary.json`` beside the ledger), else the ledger header's
            ``delta``, else the run directory's ``config.json`` (a ``dpopt train`` run
            killed before its summary was written). There is no silent default: scoring at another δ than the
            run's misstates ε.

    A run directory's releases are read from its journal ``ledger.jsonl`` when it has one (else
    ``ledger.json``); the report names the file (``ledger_file``) and, when ``ledger.json`` contradicts the
    journal, the first difference (``disagreement``; ``dpopt ledger`` warns, ``dpopt check`` fails the run).

    Raises:
        FileNotFoundError, ValueError: the ledger cannot be read.
        ConfigError: a ``delta`` outside (0, 1), or no δ given and none recorded
            by the run (the argument named: pass ``delta`` / ``--delta``).
        ValueError: an unknown ``accountant``.
    """
    book, summary_path, ledger_path = _ledger_and_summary(Path(run_dir))
    summary = loads(summary_path.read_text()) if summary_path is not None and summary_path.exists() else {}
    disagreement = None
    if Path(run_dir).is_dir() and ledger_path.name == JOURNAL_NAME:
        steps = summary.get("steps")
        disagreement = compare_ledger_files(
            run_dir, steps if isinstance(steps, int) else None, journal=book
        ).disagreement  # the journal as read above (parsed once)
    run_delta = summary.get("delta", book.delta)
    if run_delta is None:  # a killed `dpopt train` run: no summary yet; its config.json holds the δ it trains at
        run_delta = _config_delta(Path(run_dir))
    if delta is None:
        delta = run_delta
    if delta is None:
        raise ConfigError(
            f"{run_dir}: the run records no δ (no summary.json or privacy_summary.json beside the "
            "ledger, none in its header); pass the run's delta (ε at another δ is not the run's ε)",
            "delta",
        )
    try:
        check_delta(delta)
    except ValueError as exc:
        raise ConfigError(str(exc), "delta") from None
    headline = check_accountant(accountant or summary.get("accountant") or "pld")
    scores, notes = score_ledger(book, delta)
    return LedgerReport(
        run_dir=str(run_dir),
        neighbouring=book.neighbouring,
        sampling=book.sampling,
        noise=book.noise,
        dataset_size=book.dataset_size,
        releases=len(book),
        delta=delta,
        accountant=headline,
        epsilon_by_accountant=scores,
        notes=notes,
        runs=ledger_runs(book),
        summary_epsilon=summary.get("epsilon"),
        summary_accountant=summary.get("accountant"),
        run_delta=run_delta,
        ledger_file=ledger_path.name,
        disagreement=disagreement,
        mechanism_problem=_mechanism_problem(book),
        mechanism=mechanism_brief(book.mechanism),
    )


def mechanism_brief(record: Optional[dict]) -> Optional[dict]:
    """A correlated-noise mechanism record (the ledger header's ``mechanism``) in brief, to relate the
    per-step σ_t = σ / √(Δ_t² − Δ_{t−1}²) of the releases to the run (Choquette-Choo et al. 2023).

    Returns:
        ``{"kind", "bands" or "buffers", "noise_multiplier", "sensitivity", "sample_rate"}`` (a value
        ``None`` where the record lacks it), or None when ``record`` is not a dict (independent noise).
    """
    if not isinstance(record, dict):
        return None
    found = record.get("strategy")
    strategy: dict = found if isinstance(found, dict) else {}
    brief: dict = {"kind": record.get("kind", strategy.get("kind"))}
    if isinstance(strategy.get("coefficients"), list):
        brief["bands"] = len(strategy["coefficients"])
    elif isinstance(strategy.get("omega"), list):
        brief["buffers"] = len(strategy["omega"])
    for key in ("noise_multiplier", "sensitivity", "sample_rate"):
        brief[key] = record.get(key)
    return brief


def _mechanism_problem(book: PrivacyLedger) -> Optional[str]:
    """What :func:`~dpopt.accounting.matrix_factorization.check_record` finds wrong with a correlated-noise
    ledger's entries against its own mechanism record (None: no record, or they agree)."""
    if book.mechanism is None:
        return None
    from .matrix_factorization import check_record

    problems = check_record(dict(book.mechanism), book.entries)
    return "; ".join(problems) if problems else None


def _config_delta(run_dir: Path) -> Optional[float]:
    """The ``delta`` of a ``dpopt train`` run directory's ``config.json`` (None: no such file or field)."""
    path = run_dir / "config.json" if run_dir.is_dir() else run_dir.parent / "config.json"
    try:
        value = loads(path.read_text()).get("delta")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
