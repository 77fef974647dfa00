"""Command ``dpopt audit``: empirical one-step privacy audits.

The audits are :mod:`dpopt.auditing`'s; the command chooses which to run from
its options and prints the results. Heavy modules (torch, the privatizer,
scipy) are imported inside the command body so that ``dpopt --help`` and the
accounting commands stay fast.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Optional

import typer

from ..atomic import check_writable_dir
from ..jsonio import dumps
from .common import cli_errors, delta_option, fail, flags_for, json_option
from .faults import clean_warnings

group = typer.Typer()

#: Argument names of the auditing library, shown as this command's flags.
_AUDIT_NAMES = ["trials", "delta", "alpha", "seed", "method"]
AUDIT_FLAGS = flags_for(_AUDIT_NAMES)
#: ... and those of ``--one-run`` (TrainConfig fields it sets, one_run's arguments)
_ONE_RUN_NAMES = [
    "delta",
    "seed",
    "method",
    "canaries",
    "mode",
    "beta",
    "dataset",
    "epochs",
    "batch_size",
    "sample_rate",
    "noise_multiplier",
    "target_epsilon",
    "max_grad_norm",
    "clipping",
    "noise_mechanism",
    "sampling",
]
ONE_RUN_FLAGS = flags_for(_ONE_RUN_NAMES)

_HELP = (
    "Empirically audit one privatizer step against the accountant's ε.\n\n"
    "For each mechanism, runs the real Privatizer TRIALS times (sample_rate 1) with a worst-case "
    "canary per-sample gradient present or absent, scores each release along the canary direction, "
    "and prints the claimed one-step ε, two ε lower bounds (Clopper–Pearson direct; Gaussian-DP "
    "route) and PASS or LEAK. An honest mechanism shows LEAK with probability ≤ ALPHA.\n\n"
    "Without --method or --all, the built-in privatizers are audited. "
    "Exit code 1 if any mechanism LEAKs, 2 on bad arguments.\n\n"
    "With --one-run: audit a real training run instead (Steinke, Nasr & Jagielski 2023): train the "
    "configuration (--method, default dp-sgd; --dataset, --epochs, --batch-size, ...) once with --canaries "
    "canaries, each included with probability 1/2 (--mode white: gradient canaries on dedicated coordinates "
    "scored on the released gradients; black: mislabelled input canaries scored on the final model's loss), "
    "and print the epsilon lower bounds of Steinke et al. and of the f-DP estimator beside the run's claimed "
    "epsilon. Exit code 1 if a bound exceeds the claim at confidence 1 - BETA. --report DIR writes a "
    "markdown page and a plot."
)


#: Parameters that only ``--one-run`` reads, and those that only the one-step audits read: typed in the
#: other mode they would be silently ignored, so they are refused.
ONE_RUN_ONLY = frozenset(_ONE_RUN_NAMES).difference(_AUDIT_NAMES) | {"report"}
ONE_STEP_ONLY = frozenset({"all_", "trials", "alpha"})


def _refuse_other_mode(ctx: typer.Context, one_run: bool) -> None:
    """Fail (one ``error:`` line, exit 2) on options typed for the mode not chosen (they would be ignored)."""
    other = ONE_STEP_ONLY if one_run else ONE_RUN_ONLY

    def typed(name: str) -> bool:
        source = ctx.get_parameter_source(name)
        return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")

    given = [p.opts[0] for p in ctx.command.params if p.name in other and typed(str(p.name))]
    if not given:
        return
    names, one = ", ".join(given), len(given) == 1
    if one_run:
        fail(f"{names} {'does' if one else 'do'} not apply to --one-run (only to the one-step audits); drop it")
    fail(f"{names} {'applies' if one else 'apply'} to --one-run only (a training-run audit): add --one-run or drop it")


def _fmt(x) -> str:
    if x is None:
        return "n/a"
    x = float(x)
    return "inf" if math.isinf(x) else f"{x:.3f}"


@group.command("audit", help=_HELP)
def audit(
    ctx: typer.Context,
    method: Optional[str] = typer.Option(
        None,
        "--method",
        "-m",
        help="Audit one mechanism: a built-in privatizer (flat, shift-scale, per-layer, quantile, auto) "
        "or a registered method name (see `dpopt methods`).",
    ),
    all_: bool = typer.Option(False, "--all", help="Audit every built-in privatizer and every registered method."),
    trials: int = typer.Option(
        100_000, "--trials", "-n", min=40, help="Releases per mechanism (half with the canary)."
    ),
    delta: float = delta_option(1e-5, help="δ at which ε is bounded and claimed."),
    alpha: float = typer.Option(1e-3, "--alpha", help="False-alarm probability per mechanism (honest → LEAK)."),
    seed: Optional[int] = typer.Option(
        None,
        "--seed",
        help="Seed of canaries, noise and the held-out split (default 0). --one-run: seeds the canaries and the "
        "run's noise (reproducible, no privacy: research only); without it both are secret.",
    ),
    json_out: bool = json_option("Print one JSON document instead of a table."),
    one_run_: bool = typer.Option(False, "--one-run", help="Audit one real training run with canaries (see above)."),
    mode: str = typer.Option("white", "--mode", help="--one-run: white (gradient canaries) or black (input canaries)."),
    canaries: int = typer.Option(1000, "--canaries", help="--one-run: number of canaries m (1e3-1e4)."),
    beta: float = typer.Option(0.05, "--beta", help="--one-run: 1 - confidence of the lower bounds."),
    dataset: str = typer.Option("digits", "--dataset", help="--one-run: the training configuration's dataset."),
    epochs: float = typer.Option(10.0, "--epochs", help="--one-run: epochs of the run."),
    batch_size: float = typer.Option(64.0, "--batch-size", help="--one-run: expected batch size B̄."),
    sample_rate: Optional[float] = typer.Option(
        None, "--sample-rate", help="--one-run: Poisson rate q (1: full batch)."
    ),
    noise_multiplier: float = typer.Option(1.0, "--noise-multiplier", help="--one-run: σ."),
    target_epsilon: Optional[float] = typer.Option(None, "--target-epsilon", help="--one-run: calibrate σ for this ε."),
    max_grad_norm: Optional[float] = typer.Option(None, "--max-grad-norm", help="--one-run: clip bound C."),
    clipping: str = typer.Option("flat", "--clipping", help="--one-run: flat or quantile (per-layer: black box)."),
    noise_mechanism: str = typer.Option(
        "independent", "--noise-mechanism", help="--one-run: independent, banded:B or blt[:N] (correlated noise)."
    ),
    sampling: Optional[str] = typer.Option(
        None, "--sampling", help="--one-run, correlated noise: cyclic (default) or cyclic-poisson (amplified)."
    ),
    report: Optional[str] = typer.Option(None, "--report", help="--one-run: write one-run-audit.md and .png here."),
) -> None:
    """Run the audits (help text above); exit code 1 on any LEAK."""
    _refuse_other_mode(ctx, one_run_)
    if one_run_:
        _one_run_command(
            method=method or "dp-sgd",
            mode=mode,
            canaries=canaries,
            beta=beta,
            seed=seed,
            json_out=json_out,
            report=report,
            delta=delta,
            dataset=dataset,
            epochs=epochs,
            batch_size=batch_size,
            sample_rate=sample_rate,
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            max_grad_norm=max_grad_norm,
            clipping=clipping,
            noise_mechanism=noise_mechanism,
            sampling=sampling,
        )
        return
    if method is not None and all_:
        fail("give either --method NAME or --all, not both")
    if not (0.0 < delta < 1.0):
        fail(f"--delta must be in (0, 1), got {delta}")
    if not (0.0 < alpha < 1.0):
        fail(f"--alpha must be in (0, 1), got {alpha}")
    with cli_errors(AUDIT_FLAGS):
        results, note = _run_audits(method, all_, trials=trials, delta=delta, alpha=alpha, seed=seed or 0)

    leaks = [r.name for r in results if r.verdict == "LEAK"]
    if json_out:
        doc = {
            "delta": delta,
            "alpha": alpha,
            "false_alarm_rate_per_mechanism": alpha,
            "trials": trials,
            "results": [r.to_dict() for r in results],
            "leaks": leaks,
            "note": note,
        }
        typer.echo(dumps(doc))  # one line, as every other --json
    else:
        typer.echo(
            f"One-step audit at δ = {delta:g}, {trials} trials per mechanism; false-alarm rate "
            f"α = {alpha:g} per mechanism (probability that an honest mechanism shows LEAK)."
        )
        typer.echo(
            "Claimed ε: accountant (PLD) for the step event at sample_rate 1 (the mechanism run). "
            "LEAK if a lower bound exceeds it."
        )
        width = max([14] + [len(r.name) for r in results])  # the longest name (doppler-muon-bc: 15) sets it
        header = (
            f"{'mechanism':<{width}} {'claimed ε':>10} {'direct LB':>10} {'GDP LB':>10} "
            f"{'μ LB':>7} {'μ claim':>8} {'mode':>10} {'sec':>6}  verdict"
        )
        typer.echo(header)
        typer.echo("-" * len(header))
        for r in results:
            typer.echo(
                f"{r.name:<{width}} {_fmt(r.claimed_epsilon):>10} {_fmt(r.epsilon_direct):>10} "
                f"{_fmt(r.epsilon_gdp):>10} {_fmt(r.mu_lower):>7} {_fmt(r.claimed_mu):>8} "
                f"{r.mode:>10} {r.seconds:>6.1f}  {r.verdict}"
            )
        if note:
            typer.echo(f"note: {note}")
        typer.echo(f"{len(results) - len(leaks)} PASS, {len(leaks)} LEAK" + (f": {', '.join(leaks)}" if leaks else ""))
    if leaks:
        raise typer.Exit(code=1)


def _one_run_command(*, method, mode, canaries, beta, seed, json_out, report, delta, **train) -> None:
    """``dpopt audit --one-run``: one training run with canaries; exit 1 if a bound exceeds the claim."""
    if not (0.0 < beta < 1.0):
        fail(f"--beta must be in (0, 1), got {beta}")
    if not (0.0 < delta < 1.0):
        fail(f"--delta must be in (0, 1), got {delta}")
    with cli_errors(ONE_RUN_FLAGS):
        if report is not None:  # an unwritable --report is refused before the audit runs
            check_writable_dir(report)
        from ..auditing import one_run
        from ..auditing.one_run_audit import REPRODUCIBLE_AUDIT_WARNING
        from ..training import TrainConfig

        if seed is not None:  # asked for: the run's noise and masks from the same seed (TrainConfig's research mode)
            train = dict(train, seed=seed, reproducible_noise=True)
        cfg = TrainConfig(method=method, delta=delta, **train)
        with clean_warnings(lambda line: typer.echo(line, err=True)), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=re.escape(REPRODUCIBLE_AUDIT_WARNING), category=UserWarning)
            if cfg.reproducible_noise:  # asked for with --seed: a note, not a warning with a source line
                typer.echo(f"note: {REPRODUCIBLE_AUDIT_WARNING}", err=True)
            result = one_run(cfg, canaries=canaries, mode=mode, beta=beta, seed=seed)
    paths = None
    if report is not None:
        from ..auditing.one_run_report import write_report

        with cli_errors(ONE_RUN_FLAGS):
            paths = [str(p) for p in write_report(result, report)]
    if json_out:
        doc = result.to_dict()
        if paths:
            doc["report"] = paths
        typer.echo(dumps(doc))  # one line, as every other --json
    else:
        b = result.bounds
        noise = result.details.get("noise_mechanism", "independent")
        typer.echo(
            f"One-run {result.mode}-box audit of {method} on {train['dataset']}, noise {noise}: m = {result.m} "
            f"canaries, confidence {1 - beta:g}, δ = {delta:g}"
        )
        claimed_mu = "" if result.claimed_mu is None else f", μ {_fmt(result.claimed_mu)}"
        typer.echo(
            f"claimed ε {_fmt(result.epsilon)}{claimed_mu} | lower bounds: Steinke {_fmt(b.steinke)}, "
            f"f-DP {_fmt(b.fdp)} (μ ≥ {_fmt(b.mu)}{'' if result.details.get('fdp_judged') else ', not judged: q < 1'})"
            f" | {result.verdict}"
        )
        if paths:
            typer.echo(f"report: {paths[0]}")
    if result.verdict != "PASS":
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
        fail(
            f"{method!r} is not a built-in mechanism ({', '.join(auditing.BUILTIN_MECHANISMS)}) "
            f"and the method registry does not import: {exc}"
        )
    if method not in known:
        fail(
            f"unknown mechanism {method!r}; built-ins: {', '.join(auditing.BUILTIN_MECHANISMS)}; "
            f"methods: {', '.join(known)}"
        )
    return [auditing.audit_method(method, **kwargs)], None


def register(app: typer.Typer) -> None:
    """Add ``audit`` to ``app``."""
    app.add_typer(group)
