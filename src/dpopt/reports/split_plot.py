"""The budget split explorer's PNG: gradient noise multiplier against batch size (needs matplotlib).

Two panels over B̄ (log axes) at the table's target ε. Left: σ without
adaptive clipping, σ_grad under the B̄/20 rule (crosses mark batch sizes where
it has no solution), σ_grad with the budget share r, and σ_grad at the best
share r*. Right: the same σ_grad divided by σ (the inflation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

__all__ = ["write_split_png"]


def write_split_png(table, path: Union[str, Path]) -> Path:
    """Draw the plot of a :class:`~dpopt.accounting.split.SplitTable` into ``path`` (PNG).

    Raises:
        ImportError: matplotlib is not installed (``pip install dpopt[plots]``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the PNG plot needs matplotlib: pip install 'dpopt[plots]'") from exc

    from matplotlib.ticker import ScalarFormatter

    rows = [r for r in table.rows if r.noise_multiplier is not None]
    b = [r.batch_size for r in rows]
    ok = [r for r in rows if r.b20_solvable]
    bad = [r for r in rows if not r.b20_solvable]
    fig, (ax, rel) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=110)
    for axis, ratio in ((ax, False), (rel, True)):
        def y(r, value):
            return value / r.noise_multiplier if ratio else value

        if not ratio:
            axis.plot(b, [r.noise_multiplier for r in rows], "k-o", label="σ, no adaptive clipping")
        axis.plot([r.batch_size for r in ok], [y(r, r.b20_grad_noise_multiplier) for r in ok], "-s",
                  color="tab:red", label="σ_grad, σ_b = B̄/20 rule")
        if bad:
            low = min([y(r, r.noise_multiplier) for r in rows]) * (0.9 if not ratio else 1.0)
            axis.plot([r.batch_size for r in bad], [low] * len(bad), "x", color="tab:red", markersize=11, mew=2.5,
                      label="B̄/20 rule: no solution")
        axis.plot(b, [y(r, r.share_grad_noise_multiplier) for r in rows], "-^", color="tab:blue",
                  label=f"σ_grad, budget share r = {table.count_share:g}")
        axis.plot(b, [y(r, r.best_grad_noise_multiplier) for r in rows], "--", color="tab:green",
                  label="σ_grad, best share r*")
        axis.set_xscale("log")
        if not ratio:
            axis.set_yscale("log")
            axis.yaxis.set_major_formatter(ScalarFormatter())
            axis.yaxis.set_minor_formatter(ScalarFormatter())
        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.set_xticks(b)
        axis.set_xlabel("expected batch size B̄")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    ax.set_ylabel("gradient noise multiplier")
    rel.set_ylabel("σ_grad / σ (gradient noise inflation)")
    fig.suptitle(f"ε = {table.target_epsilon:g}, δ = {table.delta:g}, N = {table.dataset_size}, "
                 f"{table.epochs:g} epochs, steps = ceil(epochs·N/B̄) ({table.accountant})", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
