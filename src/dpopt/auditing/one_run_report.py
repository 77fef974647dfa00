"""The one-run audit's report: a short markdown page and one plot (scores in vs out; bounds vs the claim).

:func:`write_report` writes ``one-run-audit.md`` and ``one-run-audit.png`` into a
directory. Both hold canary scores and public run facts only (the canaries are
the auditor's own examples; no training record's score or loss is written).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..atomic import atomic_savefig, atomic_write_text

__all__ = ["write_report", "report_markdown", "REPORT_NAME", "PLOT_NAME"]

REPORT_NAME = "one-run-audit.md"
PLOT_NAME = "one-run-audit.png"


def _f(x) -> str:
    if x is None:
        return "n/a"
    return "inf" if math.isinf(float(x)) else f"{float(x):.3f}"


def report_markdown(result, plot_name: str = PLOT_NAME) -> str:
    """The markdown page of a :class:`~dpopt.auditing.one_run_audit.OneRunResult` (text only)."""
    b, d = result.bounds, result.details
    judged = (
        "Steinke et al. and f-DP (the run is exactly μ-GDP: full batch, or correlated noise over cyclic batches)"
        if d.get("fdp_judged")
        else "Steinke et al. only (with q < 1 the claim is not μ-GDP; the f-DP figure is informational)"
    )
    lines = [
        f"# One-run privacy audit: {result.method}, {result.mode} box — {result.verdict}",
        "",
        f"{result.m} canaries, each in the training set with probability ½ "
        f"({int(result.included.sum())} in); one training run of {d.get('steps')} steps at q = "
        f"{_f(d.get('sample_rate'))}, σ = {_f(d.get('noise_multiplier'))}, clipping {d.get('clipping')}"
        + (f", noise {d['noise_mechanism']} over {d['sampling']}" if d.get("noise_mechanism") else "")
        + ". "
        f"Score: {d.get('score')}.",
        "",
        f"| | ε at δ = {result.delta:g} |",
        "|---|---|",
        f"| claimed (the run's ledger) | {_f(result.epsilon)} |",
        f"| lower bound, Steinke et al. 2023 | {_f(b.steinke)} |",
        f"| lower bound, f-DP (Mahloujifar et al. 2024), μ ≥ {_f(b.mu)} | {_f(b.fdp)} |",
        "",
        f"Confidence {1 - result.beta:.3g} (β = {result.beta:g}), Bonferroni over {b.tries} guess counts fixed "
        f"from m before the scores were seen ({b.sides} sides). Judged: {judged}. "
        f"Verdict **{result.verdict}**: "
        + (
            "no lower bound exceeds the claim."
            if result.verdict == "PASS"
            else "a lower bound exceeds the claimed ε — the run leaks more than it reports."
        ),
        "",
        f"![scores and bounds]({plot_name})",
        "",
    ]
    return "\n".join(lines)


def write_report(result, directory) -> tuple[Path, Path]:
    """Write the markdown page and the plot of ``result`` into ``directory`` (created if needed).

    Returns:
        (markdown path, png path).

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    md, png = out / REPORT_NAME, out / PLOT_NAME
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    s, inc = np.asarray(result.scores), np.asarray(result.included)
    bins = np.linspace(float(s.min()), float(s.max()), 60) if s.max() > s.min() else 10
    ax1.hist(s[~inc], bins=bins, alpha=0.6, label=f"excluded ({int((~inc).sum())})")
    ax1.hist(s[inc], bins=bins, alpha=0.6, label=f"included ({int(inc.sum())})")
    ax1.set_xlabel("canary score")
    ax1.set_ylabel("canaries")
    ax1.set_title(f"{result.method}, {result.mode} box, m = {result.m}")
    ax1.legend()
    names = ["claimed", "Steinke LB", "f-DP LB"]
    vals = [result.epsilon, result.bounds.steinke, result.bounds.fdp]
    ax2.bar(names, [v if math.isfinite(v) else 0 for v in vals], color=["grey", "C0", "C1"])
    ax2.axhline(result.epsilon, color="k", ls="--", lw=1)
    ax2.set_ylabel(f"ε at δ = {result.delta:g}")
    ax2.set_title(f"{result.verdict} at confidence {1 - result.beta:.3g}")
    fig.tight_layout()
    atomic_savefig(fig, png, dpi=110)
    plt.close(fig)
    atomic_write_text(md, report_markdown(result, png.name))
    return md, png
