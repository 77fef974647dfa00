"""Command ``dpopt audit``: empirical one-step privacy audits.

The audits are :mod:`dpopt.auditing`'s; the command chooses which to run from
its options and prints the results. Heavy modules (torch, the privatizer,
scipy) are imported inside the command body so that ``dpopt --help`` and the
accounting commands stay fast.
"""

from __future__ import annotations

import math
from typing import Optional

import typer

from ..jsonio import dumps
from .common import cli_errors, delta_option, fail, flags_for, json_option

group = typer.Typer()

#: Argument names of the auditing library, shown as this command's flags.
AUDIT_FLAGS = flags_for(["trials", "delta", "alpha", "seed", "method"])

_HELP = (
    "Empirically audit one privatizer step against the accountant's ε.\n\n"
    "For each mechanism, runs the real Privatizer TRIALS times (sample_rate 1) with a worst-case "
    "canary per-sample gradient present or absent, scores each release along the canary direction, "
    "and prints the claimed one-step ε, two ε lower bounds (Clopper–Pearson direct; Gaussian-DP "
    "route) and PASS or LEAK. An honest mechanism shows LEAK with probability ≤ ALPHA.\n\n"
    "Without --method or --all, the built-in privatizers are audited. "
    "Exit code 1 if any mechanism LEAKs, 2 on bad arguments."
)


def _fmt(x) -> str:
    if x is None:
        return "n/a"
    x = float(x)
    return "inf" if math.isinf(x) else f"{x:.3f}"


@group.command("audit", help=_HELP)
def audit(
    method: Optional[str] = typer.Option(
        None, "--method", "-m",
        help="Audit one mechanism: a built-in privatizer (flat, shift-scale, per-layer, quantile) "
             "or a registered method name (see `dpopt methods`)."),
    all_: bool = typer.Option(False, "--all",
                              help="Audit every built-in privatizer and every registered method."),
    trials: int = typer.Option(100_000, "--trials", "-n", min=40,
                               help="Releases per mechanism (half with the canary)."),
    delta: float = delta_option(1e-5, help="δ at which ε is bounded and claimed."),
    alpha: float = typer.Option(1e-3, "--alpha",
                                help="False-alarm probability per mechanism (honest → LEAK)."),
    seed: int = typer.Option(0, "--seed", help="Seed of canaries, noise and the held-out split."),
    json_out: bool = json_option("Print one JSON document instead of a table."),
) -> None:
    """Run the audits (help text above); exit code 1 on any LEAK."""
    if method is not None and all_:
        fail("give either --method NAME or --all, not both")
    if not (0.0 < delta < 1.0):
        fail(f"--delta must be in (0, 1), got {delta}")
    if not (0.0 < alpha < 1.0):
        fail(f"--alpha must be in (0, 1), got {alpha}")
    with cli_errors(AUDIT_FLAGS):
        results, note = _run_audits(method, all_, trials=trials, delta=delta, alpha=alpha, seed=seed)

    leaks = [r.name for r in results if r.verdict == "LEAK"]
    if json_out:
        doc = {"delta": delta, "alpha": alpha, "false_alarm_rate_per_mechanism": alpha,
               "trials": trials, "results": [r.to_dict() for r in results], "leaks": leaks,
               "note": note}
        typer.echo(dumps(doc, indent=2))
    else:
        typer.echo(f"One-step audit at δ = {delta:g}, {trials} trials per mechanism; false-alarm rate "
                   f"α = {alpha:g} per mechanism (probability that an honest mechanism shows LEAK).")
        typer.echo("Claimed ε: accountant (PLD) for the step event at sample_rate 1 (the mechanism run). "
                   "LEAK if a lower bound exceeds it.")
        header = f"{'mechanism':<14} {'claimed ε':>10} {'direct LB':>10} {'GDP LB':>10} " \
                 f"{'μ LB':>7} {'μ claim':>8} {'mode':>10} {'sec':>6}  verdict"
        typer.echo(header)
        typer.echo("-" * len(header))
        for r in results:
            typer.echo(f"{r.name:<14} {_fmt(r.claimed_epsilon):>10} {_fmt(r.epsilon_direct):>10} "
                       f"{_fmt(r.epsilon_gdp):>10} {_fmt(r.mu_lower):>7} {_fmt(r.claimed_mu):>8} "
                       f"{r.mode:>10} {r.seconds:>6.1f}  {r.verdict}")
        if note:
            typer.echo(f"note: {note}")
        typer.echo(f"{len(results) - len(leaks)} PASS, {len(leaks)} LEAK"
                   + (f": {', '.join(leaks)}" if leaks else ""))
    if leaks:
        raise typer.Exit(code=1)


def _run_audits(method: Optional[str], all_: bool, **kwargs) -> tuple[list, Optional[str]]:
    """The audit results for the command's choice of mechanisms, and the suite's note (or None)."""
    from .. import auditing

    if method is None:
        return auditing.audit_all(methods=all_, **kwargs)
    kwargs["seed"] = auditing.mechanism_seed(kwargs["seed"], method)  # same numbers as the --all row
    if method in auditing.BUILTIN_MECHANISMS:
        return [auditing.audit_mechanism(method, **kwargs)], None
    try:
        known = auditing.registered_methods()
    except ImportError as exc:
        fail(f"{method!r} is not a built-in mechanism ({', '.join(auditing.BUILTIN_MECHANISMS)}) "
             f"and the method registry does not import: {exc}")
    if method not in known:
        fail(f"unknown mechanism {method!r}; built-ins: {', '.join(auditing.BUILTIN_MECHANISMS)}; "
             f"methods: {', '.join(known)}")
    return [auditing.audit_method(method, **kwargs)], None


def register(app: typer.Typer) -> None:
    """Add ``audit`` to ``app``."""
    app.add_typer(group)
