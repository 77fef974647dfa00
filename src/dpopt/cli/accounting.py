"""Commands ``dpopt account``, ``calibrate``, ``ledger`` and ``check``.

None of these import torch: the accounting modules need only dp_accounting
(and prv-accountant for ``--accountant prv``), and they are imported inside
the command bodies so that ``dpopt --help`` stays fast.

Examples::

    dpopt account --noise-multiplier 1.0 --sample-rate 0.01 --steps 1000 --delta 1e-5
    dpopt account --noise-multiplier 1.0 --dataset-size 60000 --batch-size 256 --epochs 5   # ε ≈ 0.784 (δ = 1e-5)
    dpopt calibrate --target-epsilon 4 --sample-rate 0.00512 --steps 9750 --delta 1e-5 --json
    dpopt ledger runs/mnist-dp-sgd
    dpopt check runs/mnist-dp-sgd        # exit code 1 if any of the checks fails

Errors and interrupts are handled as in every command (:mod:`dpopt.cli.common`):
one ``error: ...`` line on stderr and exit code 2 (never a traceback), also
when an accountant fails; a ledger or summary.json that cannot be read is named
(``error: runs/x/ledger.json: is not valid JSON (...)``); Ctrl-C during ``calibrate`` says what was
interrupted and exits with 130. ``ledger``'s table is built by
:func:`dpopt.accounting.report.ledger_report`; the command only prints it. When an accountant had to use a coarser grid to stay within its
cost budget (the ε printed is still an upper bound), a ``note:`` line says so.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Optional, cast

import typer

from ..jsonio import dumps
from .common import (
    ACCOUNTING_ERRORS,
    accountant_option,
    cli_errors,
    delta_option,
    fail,
    flag_text,
    flags_for,
    json_option,
)

group = typer.Typer()

#: Argument names of the accounting library, shown as this group's flags.
ACCOUNTING_FLAGS = flags_for(
    [
        "noise_multiplier",
        "sample_rate",
        "steps",
        "delta",
        "accountant",
        "target_epsilon",
        "count_share",
        "dataset_size",
        "batch_size",
        "epochs",
    ]
)


def _run_files(run_dir: Path, summary: bool) -> list[tuple[Path, str]]:
    """The files ``ledger``/``check`` read: the ledger (the path itself if a file) and summary.json."""
    from ..accounting.ledger_check import run_paths

    if run_dir.is_file():
        return [(run_dir, "ledger")]
    ledger, summary_path = run_paths(run_dir)
    return [(ledger, "ledger")] + ([(summary_path, "summary")] if summary else [])


def _unreadable(path: Path, kind: str) -> Optional[str]:
    """Why ``path`` cannot be read as dpopt wants it (None: it can, or it is absent).

    A ledger is read by :meth:`~dpopt.accounting.ledger.PrivacyLedger.load`, the one reader of both ledger
    formats (``ledger.json``; the journal ``ledger.jsonl``, JSON lines, by its suffix).
    """
    from ..accounting.ledger import JournalDamaged, PrivacyLedger

    if not path.exists():
        return None
    try:
        if kind == "summary":
            data = json.loads(path.read_text(encoding="utf-8"))
            return None if isinstance(data, dict) else "must hold a JSON object"
        PrivacyLedger.load(path)
    except JournalDamaged as exc:  # its message starts with the path: fail() names it already
        return str(exc).removeprefix(f"{path}, ")
    except json.JSONDecodeError as exc:
        return f"is not valid JSON ({exc})"
    except UnicodeDecodeError:
        return (
            "is a binary file, not a ledger (a `dpopt train` checkpoint.pt?): pass the run directory, or its "
            "ledger.jsonl"
        )
    except OSError as exc:
        return f"cannot be read ({exc})"
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        return f"is {detail}" if detail.startswith("not a ") else f"is not a readable dpopt ledger ({detail})"
    return None


def _read_run(run_dir: Path, summary: bool) -> None:
    """Fail with an ``error:`` line naming the file when a run's ledger or summary cannot be read."""
    for path, kind in _run_files(run_dir, summary):
        why = _unreadable(path, kind)
        if why is not None:
            fail(f"{path}: {why}")


def _notes(notes) -> None:
    for note in notes:
        typer.echo(f"note: {note}", err=True)


def _schedule_options():
    return dict(
        sample_rate=typer.Option(
            None, "--sample-rate", help="Poisson sampling rate q = expected batch size / N, in (0, 1]; with --steps."
        ),
        steps=typer.Option(None, "--steps", help="Number of noisy steps T (≥ 1); with --sample-rate."),
        dataset_size=typer.Option(
            None, "--dataset-size", help="N (instead of --sample-rate/--steps, as TF Privacy): q = B/N."
        ),
        batch_size=typer.Option(None, "--batch-size", help="Expected batch size B (with --dataset-size, --epochs)."),
        epochs=typer.Option(None, "--epochs", help="Epochs: T = ceil(epochs·N/B) (with --dataset-size)."),
    )


_SCHEDULE = _schedule_options()


def _schedule(
    sample_rate: Optional[float],
    steps: Optional[int],
    dataset_size: Optional[int],
    batch_size: Optional[float],
    epochs: Optional[float],
) -> tuple[float, int]:
    """(q, T) from --sample-rate/--steps or from --dataset-size/--batch-size/--epochs (never a mix)."""
    from ..accounting.split import steps_for_epochs

    direct = {"--sample-rate": sample_rate, "--steps": steps}
    field = {"--dataset-size": dataset_size, "--batch-size": batch_size, "--epochs": epochs}
    given_direct = [k for k, v in direct.items() if v is not None]
    given_field = [k for k, v in field.items() if v is not None]
    if given_direct and given_field:
        fail(
            f"give either --sample-rate and --steps, or --dataset-size, --batch-size and --epochs; "
            f"not both ({', '.join(given_direct + given_field)} given)"
        )
    if given_field:
        missing = [k for k, v in field.items() if v is None]
        if missing:
            fail(
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required with "
                f"{', '.join(given_field)} (q = B/N, steps = ceil(epochs·N/B))"
            )
        with cli_errors(ACCOUNTING_FLAGS):
            return steps_for_epochs(dataset_size, batch_size, epochs)  # type: ignore[arg-type]
    missing = [k for k, v in direct.items() if v is None]
    if missing:
        fail(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required "
            f"(or give --dataset-size, --batch-size and --epochs instead of --sample-rate and --steps)"
        )
    return sample_rate, steps  # type: ignore[return-value]


@group.command("account")
def account(
    noise_multiplier: float = typer.Option(
        ..., "--noise-multiplier", help="σ: noise std / L2 sensitivity (0 → ε = inf)."
    ),
    sample_rate: Optional[float] = _SCHEDULE["sample_rate"],
    steps: Optional[int] = _SCHEDULE["steps"],
    dataset_size: Optional[int] = _SCHEDULE["dataset_size"],
    batch_size: Optional[float] = _SCHEDULE["batch_size"],
    epochs: Optional[float] = _SCHEDULE["epochs"],
    delta: float = delta_option(1e-5, help="δ in (0, 1)."),
    accountant: str = accountant_option(),
    as_json: bool = json_option("Print one JSON object (key 'epsilon')."),
) -> None:
    """ε of T Poisson-sampled Gaussian steps (DP-SGD) at noise multiplier σ.

    The schedule is --sample-rate q and --steps T, or (as TF Privacy's
    compute_dp_sgd_privacy) --dataset-size N, --batch-size B and --epochs E:
    q = B/N, T = ceil(E·N/B).
    """
    from ..accounting.accountant import dpsgd_event, epsilon_report
    from ..accounting.validation import check_sample_rate

    sample_rate, steps = _schedule(sample_rate, steps, dataset_size, batch_size, epochs)
    with cli_errors(ACCOUNTING_FLAGS, errors=ACCOUNTING_ERRORS):
        check_sample_rate(sample_rate)
        report = epsilon_report(dpsgd_event(noise_multiplier, sample_rate, steps), delta, accountant)
    eps = report.epsilon
    _notes(report.notes)
    if as_json:
        typer.echo(
            dumps(
                {
                    "epsilon": eps,
                    "delta": delta,
                    "noise_multiplier": noise_multiplier,
                    "sample_rate": sample_rate,
                    "steps": steps,
                    "accountant": accountant.lower(),
                    "resolution": report.resolution,
                    "coarsened": report.coarsened,
                    "notes": list(report.notes),
                }
            )
        )
    else:
        typer.echo(
            f"epsilon = {eps:.6g}  (delta = {delta:g}, accountant = {accountant.lower()}, "
            f"noise_multiplier = {noise_multiplier:g}, sample_rate = {sample_rate:g}, steps = {steps})"
        )


@group.command("calibrate")
def calibrate(
    target_epsilon: float = typer.Option(..., "--target-epsilon", help="Target ε (> 0)."),
    sample_rate: Optional[float] = _SCHEDULE["sample_rate"],
    steps: Optional[int] = _SCHEDULE["steps"],
    dataset_size: Optional[int] = _SCHEDULE["dataset_size"],
    batch_size: Optional[float] = _SCHEDULE["batch_size"],
    epochs: Optional[float] = _SCHEDULE["epochs"],
    delta: float = delta_option(1e-5, help="δ in (0, 1)."),
    accountant: str = accountant_option(),
    count_share: Optional[float] = typer.Option(
        None, "--count-share", help="Also print the quantile-clipping split of σ with this budget share r in (0, 1)."
    ),
    as_json: bool = json_option("Print one JSON object (key 'noise_multiplier')."),
) -> None:
    """Smallest σ with ε(σ) ≤ target (checked with the accurate accountant).

    The schedule is --sample-rate/--steps or --dataset-size/--batch-size/--epochs (as in ``account``).
    """
    from ..accounting.budget import split_budget
    from ..accounting.calibration import calibrate_noise_multiplier

    sample_rate, steps = _schedule(sample_rate, steps, dataset_size, batch_size, epochs)

    status = _Status()
    with cli_errors(
        ACCOUNTING_FLAGS,
        errors=ACCOUNTING_ERRORS,
        interrupted="calibration interrupted; no noise multiplier was chosen",
    ):
        try:
            result = calibrate_noise_multiplier(
                target_epsilon, delta, sample_rate, steps, accountant, progress=status.update
            )
            split = split_budget(result.noise_multiplier, count_share) if count_share is not None else None
        finally:
            status.stop()
    out = result.to_dict()
    if split is not None:
        out.update(
            {
                "count_share": split.count_share,
                "grad_noise_multiplier": split.grad_noise_multiplier,
                "count_noise_multiplier": split.count_noise_multiplier,
                "count_noise_std": split.count_noise_std,
            }
        )
    if as_json:
        typer.echo(dumps(out))
        return
    typer.echo(f"noise_multiplier = {result.noise_multiplier!r}")
    typer.echo(
        f"epsilon = {result.epsilon:.6g} <= target {result.target_epsilon:g}  (delta = {result.delta:g}, "
        f"accountant = {result.accountant}, sample_rate = {result.sample_rate:g}, steps = {result.steps}; "
        f"{result.seconds:.2f} s)"
    )
    if split is not None:
        typer.echo(
            f"split (count_share = {split.count_share:g}): grad noise_multiplier = "
            f"{split.grad_noise_multiplier:.6g}, count_noise_multiplier = {split.count_noise_multiplier:.6g} "
            f"(count noise std {split.count_noise_std:.6g})"
        )


class _Status:
    """A one-line progress display on stderr for long calibrations (only on a terminal, after 1 s)."""

    def __init__(self):
        import sys

        self._tty = sys.stderr.isatty()
        self._status = None

    def update(self, p) -> None:
        if not self._tty or p.seconds < 1.0:
            return
        text = (
            f"calibrating: {p.level} epsilon = {p.epsilon:.5g} at noise_multiplier = {p.noise_multiplier:.6g} "
            f"({p.evaluations} evaluations, {p.seconds:.1f} s)"
        )
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


@group.command("ledger")
def ledger(
    run_dir: Path = typer.Argument(..., help="Run directory with ledger.json (and summary.json)."),
    accountant: Optional[str] = accountant_option(
        None,
        help="Headline accountant (default: the run's, from summary.json, else pld). "
        "Every available accountant is always listed.",
    ),
    delta: Optional[float] = delta_option(
        None,
        help="δ (default: the run's, from the summary beside the ledger "
        "or the ledger header; required when the run records none).",
    ),
    as_json: bool = json_option(),
) -> None:
    """List a run's releases (compacted) and re-score the whole ledger with every accountant.

    A run directory's releases are read from its journal ledger.jsonl when present (else ledger.json); the
    first line names the file. If ledger.json contradicts the journal, a warning names the first difference
    and the journal is scored (`dpopt check` fails such a run). Correlated noise: the header names the
    mechanism (kind, bands/buffers, σ, Δ; step t's σ is σ/√(Δ_t² − Δ_{t−1}²)); steps that recorded a no-op
    use their batches, but their cost was charged in advance by the earlier releases ("no added cost").
    """
    from ..accounting.report import ledger_report

    _read_run(run_dir, summary=True)
    with cli_errors(ACCOUNTING_FLAGS):
        report = ledger_report(run_dir, accountant=accountant, delta=delta)
    # an accountant's failure is that accountant's "n.a.: ..." (its advice in this CLI's flags)
    report = replace(
        report,
        epsilon_by_accountant={
            name: flag_text(value, ACCOUNTING_FLAGS) if isinstance(value, str) else value
            for name, value in report.epsilon_by_accountant.items()
        },
    )
    if as_json:
        typer.echo(dumps(report.to_dict()))
        return
    if report.disagreement is not None:
        typer.echo(
            f"warning: {report.disagreement}; scored the journal (`dpopt check {run_dir}` fails this run)", err=True
        )
    if report.mechanism_problem is not None:
        typer.echo(
            f"warning: the releases contradict the ledger's correlated-noise mechanism record ({report.mechanism_problem}); "
            f"scored the releases as written (`dpopt check {run_dir}` fails this run)",
            err=True,
        )
    typer.echo(
        f"ledger {run_dir} (read {report.ledger_file}): {report.releases} releases, neighbouring = {report.neighbouring}, "
        f"sampling = {report.sampling}, noise = {report.noise}, dataset_size = {report.dataset_size}"
    )
    if report.mechanism is not None:
        typer.echo(_mechanism_line(report.mechanism))
    for run in report.runs:
        steps = f"step {run.first_step}" if run.count == 1 else f"steps {run.first_step}-{run.last_step}"
        sigmas = " + ".join(f"{s:.6g}" for s in run.noise_multipliers)
        q = ", ".join(f"{r:g}" for r in run.sample_rates) or "1 (no sampling)"
        eff = ", ".join(f"{s:.6g}" for s in run.sigma_eff)
        if run.no_op:  # a NoOpDpEvent: the batches are used, their cost was charged by the earlier releases
            typer.echo(f"  {steps} ({run.count}x): no-op, no added cost: charged in advance by the earlier releases")
            continue
        sens = ""
        if run.sensitivity_min is not None:
            lo, hi = run.sensitivity_min, run.sensitivity_max
            sens = f", sensitivity {lo:.4g}" + (f"-{hi:.4g}" if hi != lo else "")
        typer.echo(f"  {steps} ({run.count}x): q = {q}, Gaussians sigma = {sigmas} -> sigma_eff = {eff}{sens}")
    if report.run_delta is not None and report.run_delta != report.delta:
        typer.echo(
            f"note: scored at --delta {report.delta:g}, not at the run's own delta {report.run_delta:g}: "
            "the run's guarantee is its epsilon at its own delta",
            err=True,
        )
    own = "the run's" if report.run_delta == report.delta else ("--delta" if report.run_delta is not None else "given")
    typer.echo(f"epsilon at delta = {report.delta:g} ({own}; one accountant over the whole ledger):")
    for name, value in report.epsilon_by_accountant.items():
        mark = " *" if name == report.accountant else ""
        shown = f"{value:.6g}" if isinstance(value, float) else value
        typer.echo(f"  {name}: {shown}{mark}")
        for note in report.notes.get(name, []):
            typer.echo(f"      note: {note}")
    if report.summary_epsilon is not None:
        typer.echo(f"summary.json epsilon = {report.summary_epsilon} (accountant {report.summary_accountant})")


def _mechanism_line(brief: dict) -> str:
    """``dpopt ledger``'s line naming a correlated-noise mechanism (:func:`~dpopt.accounting.report.mechanism_brief`)."""
    kind = str(brief.get("kind"))
    if "bands" in brief:
        kind += f":{brief['bands']} ({brief['bands']} bands)"
    elif "buffers" in brief:
        kind += f" ({brief['buffers']} buffers)"
    parts = [f"mechanism {kind}"]
    for key, name in (("noise_multiplier", "sigma"), ("sensitivity", "Delta"), ("sample_rate", "q")):
        if isinstance(brief.get(key), (int, float)):
            parts.append(f"{name} = {brief[key]:.6g}")
    if isinstance(brief.get("sample_rate"), (int, float)):  # amplified: rounds, not the prefix sensitivities
        return ", ".join(parts) + (
            "; each round of b' steps charges one Poisson-sampled Gaussian at sigma / (the per-round "
            "sensitivity: a column norm, or sqrt(lambda_max) of a part's columns); its other steps are no-ops"
        )
    return ", ".join(parts) + "; step t's sigma = sigma / sqrt(Delta_t^2 - Delta_{t-1}^2)"


@group.command("check")
def check(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories with ledger.json and summary.json (one or more)."),
    as_json: bool = json_option(),
) -> None:
    """The ledger checks (a-e), and (f) ledger.json agrees with the journal; exit code 1 if any fails (2 if a
    run cannot be read).

    (a)-(e) read the journal ledger.jsonl when the run has one, else ledger.json; the first line names the
    file(s) read. When both exist, (f) compares them (header, mechanism record, sampling, every entry in
    order) and fails with "ledger.json disagrees with ledger.jsonl: ..." naming the first difference; a
    ledger.json that is the prefix written at an earlier stop (dated by summary.json's steps) is a note.

    Given several run directories, each is checked, and ledgers that share a run id are reported: they
    are copies of one run. If they DIVERGE (a copied run directory resumed in both places), each one
    passes alone although the data was used by every branch: that is a failure (exit 1), and the ε of
    the shared releases plus every branch's own is printed.
    """
    from ..accounting.ledger_check import check_run, load_run, repeated_run_ids

    for run_dir in run_dirs:
        _read_run(run_dir, summary=True)
    with cli_errors(errors=ACCOUNTING_ERRORS):  # the combined ε of diverged copies runs an accountant
        results = {str(d): check_run(d) for d in run_dirs}
        groups = []
        if len(run_dirs) > 1:
            runs = {str(d): load_run(d) for d in run_dirs}
            first = runs[str(run_dirs[0])][1]
            groups = repeated_run_ids(
                {name: book for name, (book, _) in runs.items()},
                delta=first.get("delta"),
                accountant=str(first.get("accountant", "pld")),
                segments={name: cast(list, s.get("segments")) for name, (_, s) in runs.items()},
            )
    passed = all(r.passed for r in results.values()) and not any(g.diverged for g in groups)
    if as_json:
        if len(run_dirs) == 1:
            typer.echo(dumps(next(iter(results.values())).to_dict()))
        else:
            typer.echo(
                dumps(
                    {
                        "passed": passed,
                        "runs": {k: r.to_dict() for k, r in results.items()},
                        "repeated_run_ids": [g.to_dict() for g in groups],
                    }
                )
            )
    else:
        for name, result in results.items():
            if len(run_dirs) > 1:
                typer.echo(f"== {name}")
            typer.echo(result.format())
        for g in groups:
            typer.echo(f"{'FAIL' if g.diverged else 'note'}: {g.message()}")
    if not passed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``account``, ``calibrate``, ``ledger`` and ``check`` to ``app``."""
    app.add_typer(group)
