"""CLI commands: ``account``, ``calibrate``, ``ledger``, ``check``.

None of these import torch: the accounting modules need only dp_accounting
(and prv-accountant for ``--accountant prv``), and they are imported inside
the command bodies so that ``dpopt --help`` stays fast.

Examples::

    dpopt account --noise-multiplier 1.0 --sample-rate 0.01 --steps 1000 --delta 1e-5
    dpopt calibrate --target-epsilon 4 --sample-rate 0.00512 --steps 9750 --delta 1e-5 --json
    dpopt ledger runs/mnist-dp-sgd
    dpopt check runs/mnist-dp-sgd        # exit code 1 if any of the checks fails

Errors are one ``error: ...`` line on stderr and exit code 2 (never a
traceback); Ctrl-C during ``calibrate`` prints what was interrupted and exits
with 130. When an accountant had to use a coarser grid to stay within its
cost budget (the ε printed is still an upper bound), a ``note:`` line says so.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer

_ACCOUNTANT_HELP = "Accountant: pld (connect-the-dots PLD, default), rdp, or prv (needs prv-accountant)."


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


#: Failures of an accountant or a calibration shown as ``error: ...`` (never a traceback).
_ACCOUNTING_ERRORS = (ValueError, ImportError, RuntimeError, ArithmeticError, MemoryError)


def _cli_message(exc: BaseException) -> str:
    """The library's message, with argument names translated to this CLI's flags."""
    text = str(exc) or type(exc).__name__
    if not isinstance(exc, (ValueError, ImportError, KeyboardInterrupt)):
        text = f"{type(exc).__name__}: {text}"
    for name in ("noise_multiplier", "target_epsilon", "sample_rate"):
        text = text.replace(f"set {name} directly", f"pass --{name.replace('_', '-')} directly")
    for name in ("pld", "rdp", "prv"):
        text = text.replace(f"accountant '{name}'", f"--accountant {name}")
    return text


def _notes(notes) -> None:
    for note in notes:
        typer.echo(f"note: {note}", err=True)


def _json_num(x: float):
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def account(
    noise_multiplier: float = typer.Option(..., "--noise-multiplier", help="σ: noise std / L2 sensitivity (0 → ε = inf)."),
    sample_rate: float = typer.Option(..., "--sample-rate", help="Poisson sampling rate q = expected batch size / N, in (0, 1]."),
    steps: int = typer.Option(..., "--steps", help="Number of noisy steps T (≥ 1)."),
    delta: float = typer.Option(..., "--delta", help="δ in (0, 1), e.g. 1e-5."),
    accountant: str = typer.Option("pld", "--accountant", help=_ACCOUNTANT_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (key 'epsilon')."),
) -> None:
    """ε of T Poisson-sampled Gaussian steps (DP-SGD) at noise multiplier σ."""
    from .accounting.accountant import dpsgd_event, epsilon_report
    from .accounting.validation import check_sample_rate

    try:
        check_sample_rate(sample_rate)
        report = epsilon_report(dpsgd_event(noise_multiplier, sample_rate, steps), delta, accountant)
    except _ACCOUNTING_ERRORS as exc:
        _fail(_cli_message(exc))
    eps = report.epsilon
    _notes(report.notes)
    if as_json:
        typer.echo(json.dumps({"epsilon": _json_num(eps), "delta": delta, "noise_multiplier": noise_multiplier,
                               "sample_rate": sample_rate, "steps": steps, "accountant": accountant.lower(),
                               "resolution": report.resolution, "coarsened": report.coarsened,
                               "notes": list(report.notes)}))
    else:
        typer.echo(f"epsilon = {eps:.6g}  (delta = {delta:g}, accountant = {accountant.lower()}, "
                   f"noise_multiplier = {noise_multiplier:g}, sample_rate = {sample_rate:g}, steps = {steps})")


def calibrate(
    target_epsilon: float = typer.Option(..., "--target-epsilon", help="Target ε (> 0)."),
    sample_rate: float = typer.Option(..., "--sample-rate", help="Poisson sampling rate q in (0, 1]."),
    steps: int = typer.Option(..., "--steps", help="Number of noisy steps T (≥ 1)."),
    delta: float = typer.Option(..., "--delta", help="δ in (0, 1), e.g. 1e-5."),
    accountant: str = typer.Option("pld", "--accountant", help=_ACCOUNTANT_HELP),
    count_share: Optional[float] = typer.Option(
        None, "--count-share", help="Also print the quantile-clipping split of σ with this budget share r in (0, 1)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (key 'noise_multiplier')."),
) -> None:
    """Smallest σ with ε(σ) ≤ target (checked with the accurate accountant)."""
    from .accounting.budget import split_budget
    from .accounting.calibration import CalibrationInterrupted, calibrate_noise_multiplier

    status = _Status()
    try:
        result = calibrate_noise_multiplier(target_epsilon, delta, sample_rate, steps, accountant,
                                            progress=status.update)
        split = split_budget(result.noise_multiplier, count_share) if count_share is not None else None
    except CalibrationInterrupted as exc:
        status.stop()
        _fail(_cli_message(exc), code=130)
    except KeyboardInterrupt:
        status.stop()
        _fail("calibration interrupted; no noise multiplier was chosen", code=130)
    except _ACCOUNTING_ERRORS as exc:
        status.stop()
        _fail(_cli_message(exc))
    status.stop()
    out = result.to_dict()
    if split is not None:
        out.update({"count_share": split.count_share, "grad_noise_multiplier": split.grad_noise_multiplier,
                    "count_noise_multiplier": split.count_noise_multiplier,
                    "count_noise_std": split.count_noise_std})
    if as_json:
        typer.echo(json.dumps(out))
        return
    typer.echo(f"noise_multiplier = {result.noise_multiplier!r}")
    typer.echo(f"epsilon = {result.epsilon:.6g} <= target {result.target_epsilon:g}  (delta = {result.delta:g}, "
               f"accountant = {result.accountant}, sample_rate = {result.sample_rate:g}, steps = {result.steps}; "
               f"{result.seconds:.2f} s)")
    if split is not None:
        typer.echo(f"split (count_share = {split.count_share:g}): grad noise_multiplier = "
                   f"{split.grad_noise_multiplier:.6g}, count_noise_multiplier = {split.count_noise_multiplier:.6g} "
                   f"(count noise std {split.count_noise_std:.6g})")


class _Status:
    """A one-line progress display on stderr for long calibrations (only on a terminal, after 1 s)."""

    def __init__(self):
        import sys

        self._tty = sys.stderr.isatty()
        self._status = None

    def update(self, p) -> None:
        if not self._tty or p.seconds < 1.0:
            return
        text = (f"calibrating: {p.level} epsilon = {p.epsilon:.5g} at noise_multiplier = {p.noise_multiplier:.6g} "
                f"({p.evaluations} evaluations, {p.seconds:.1f} s)")
        if self._status is None:
            from rich.console import Console

            self._status = Console(stderr=True).status(text)
            self._status.start()
        else:
            self._status.update(text)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def _runs(ledger) -> list[dict]:
    """Consecutive entries with the same event, with their step range and clip-bound range."""
    from .accounting.events import summarize_event

    runs: list[dict] = []
    for entry in ledger.entries:
        sens = entry.meta.get("sensitivity")
        if runs and runs[-1]["_event"] == entry.event:
            run = runs[-1]
            run["count"] += 1
            run["last_step"] = entry.step
        else:
            parsed = summarize_event(entry.event)
            run = {"_event": entry.event, "first_step": entry.step, "last_step": entry.step, "count": 1,
                   "sample_rates": sorted(parsed.rates), "noise_multipliers": parsed.gaussians,
                   "sigma_eff": [s for (_, s) in parsed.terms], "unsupported": sorted(set(parsed.unsupported)),
                   "sensitivity_min": None, "sensitivity_max": None}
            runs.append(run)
        if isinstance(sens, (int, float)):
            run["sensitivity_min"] = sens if run["sensitivity_min"] is None else min(run["sensitivity_min"], sens)
            run["sensitivity_max"] = sens if run["sensitivity_max"] is None else max(run["sensitivity_max"], sens)
    for run in runs:
        del run["_event"]
    return runs


def ledger(
    run_dir: Path = typer.Argument(..., help="Run directory with ledger.json (and summary.json)."),
    accountant: Optional[str] = typer.Option(
        None, "--accountant", help="Headline accountant (default: the run's, from summary.json, else pld). "
                                   "Every available accountant is always listed."),
    delta: Optional[float] = typer.Option(None, "--delta", help="δ (default: the run's, from summary.json)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """List a run's releases (compacted) and re-score the whole ledger with every accountant."""
    from .accounting.accountant import ACCOUNTANTS, check_accountant, epsilon_report
    from .accounting.ledger import PrivacyLedger
    from .accounting.prv import prv_available

    try:
        book = PrivacyLedger.load(run_dir)
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    summary_path = Path(run_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    delta = delta if delta is not None else summary.get("delta")
    if delta is None:
        _fail("no delta: pass --delta (the run directory has no summary.json with 'delta')")
    if not 0.0 < float(delta) < 1.0:
        _fail(f"delta must be in (0, 1), got {delta!r}; e.g. --delta 1e-5")
    try:
        headline = check_accountant(accountant or summary.get("accountant") or "pld")
    except ValueError as exc:
        _fail(str(exc))
    scores: dict[str, object] = {}
    notes: dict[str, list] = {}
    for name in ACCOUNTANTS:
        if name == "prv" and not prv_available():
            scores[name] = "n.a.: unavailable (pip install prv-accountant)"
            continue
        try:
            report = epsilon_report(book, delta, name)
        except _ACCOUNTING_ERRORS as exc:  # one accountant's failure is that column's n.a., not a crash
            scores[name] = f"n.a.: {_cli_message(exc)}"
            continue
        scores[name] = _json_num(report.epsilon)
        if report.notes:
            notes[name] = list(report.notes)
    runs = _runs(book)
    out = {"run_dir": str(run_dir), "neighbouring": book.neighbouring, "sampling": book.sampling,
           "noise": book.noise, "dataset_size": book.dataset_size, "notes": notes,
           "releases": len(book), "delta": delta, "accountant": headline,
           "epsilon": scores.get(headline), "epsilon_by_accountant": scores,
           "epsilon_summary": summary.get("epsilon"), "runs": runs}
    if as_json:
        typer.echo(json.dumps(out))
        return
    typer.echo(f"ledger {run_dir}: {len(book)} releases, neighbouring = {book.neighbouring}, "
               f"sampling = {book.sampling}, noise = {book.noise}, dataset_size = {book.dataset_size}")
    for run in runs:
        steps = (f"step {run['first_step']}" if run["count"] == 1
                 else f"steps {run['first_step']}-{run['last_step']}")
        sigmas = " + ".join(f"{s:.6g}" for s in run["noise_multipliers"])
        q = ", ".join(f"{r:g}" for r in run["sample_rates"]) or "1 (no sampling)"
        eff = ", ".join(f"{s:.6g}" for s in run["sigma_eff"])
        sens = ""
        if run["sensitivity_min"] is not None:
            lo, hi = run["sensitivity_min"], run["sensitivity_max"]
            sens = f", sensitivity {lo:.4g}" + (f"-{hi:.4g}" if hi != lo else "")
        typer.echo(f"  {steps} ({run['count']}x): q = {q}, Gaussians sigma = {sigmas} -> sigma_eff = {eff}{sens}")
    typer.echo(f"epsilon at delta = {delta:g} (one accountant over the whole ledger):")
    for name, value in scores.items():
        mark = " *" if name == headline else ""
        shown = f"{value:.6g}" if isinstance(value, float) else value
        typer.echo(f"  {name}: {shown}{mark}")
        for note in notes.get(name, []):
            typer.echo(f"      note: {note}")
    if "epsilon" in summary:
        typer.echo(f"summary.json epsilon = {summary['epsilon']} (accountant {summary.get('accountant')})")


def check(
    run_dir: Path = typer.Argument(..., help="Run directory with ledger.json and summary.json."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The ledger checks (a-e); exit code 1 if any fails (2 if the run cannot be read)."""
    from .check import check_run

    try:
        result = check_run(run_dir)
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    typer.echo(json.dumps(result.to_dict(), default=_json_num) if as_json else result.format())
    if not result.passed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add this module's commands (account, calibrate, ledger, check) to the dpopt app."""
    app.command("account")(account)
    app.command("calibrate")(calibrate)
    app.command("ledger")(ledger)
    app.command("check")(check)
