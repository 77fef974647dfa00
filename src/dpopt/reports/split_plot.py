"""The budget split explorer's PNG: gradient noise multiplier against batch size (needs matplotlib).

Two panels over B̄ (log axes) at the table's target ε. Left: σ without
adaptive clipping, σ_grad under the B̄/20 rule (crosses mark batch sizes where
it has no solution), σ_grad with the budget share r, and σ_grad at the best
share r*. Right: the same σ_grad divided by σ (the inflation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

from ..atomic import atomic_savefig

__all__ = ["write_split_png", "split_figure", "log_ticks"]


def log_ticks(low: float, high: float, target: int = 6) -> list[float]:
    """Tick values for a log axis over data in [low, high] (both > 0), at most about ``target`` + 2 of them.

    Within a decade and a half (high/low ≤ 30) the ticks are "nice" linear values (steps of
    1, 2, 2.5 or 5 × 10^k, :class:`matplotlib.ticker.MaxNLocator`) so that σ between 0.82
    and 1.13 gets 0.85, 0.9, ... 1.1 rather than 0.9 and 1.0 only; over wider ranges 1, 2
    and 5 × 10^k, thinned to every other decade when there are still too many. Always at
    least two ticks: the rounded ends when nothing else falls inside.

    Raises:
        ValueError: ``low`` ≤ 0 or ``high`` < ``low``.
    """
    import math

    from matplotlib.ticker import MaxNLocator

    if not (low > 0 and high >= low):
        raise ValueError(f"log ticks need 0 < low <= high, got {low}, {high}")
    if high / low <= 30:
        ticks = [float(t) for t in MaxNLocator(nbins=target, steps=[1, 2, 2.5, 5, 10]).tick_values(low, high)]
    else:
        first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
        subs = (1, 2, 5) if last - first <= 3 else (1,)
        ticks = [m * 10.0**k for k in range(first, last + 1) for m in subs]
    ticks = [t for t in ticks if low * (1 - 1e-9) <= t <= high * (1 + 1e-9)]
    if len(ticks) < 2:
        ticks = sorted({float(f"{low:.2g}"), float(f"{high:.2g}")})
    return ticks


def _tick_text(value: float, _pos=None) -> str:
    """A tick label: an integer as it is (``4096``), other values with up to 3 significant digits."""
    if value == round(value) and abs(value) < 1e7:
        return str(int(round(value)))
    return f"{value:.3g}"


def split_figure(table):
    """The explorer's figure for a :class:`~dpopt.accounting.split.SplitTable` (matplotlib ``Figure``).

    Both x axes (log B̄) are labelled at the table's batch sizes only, minor ticks unlabelled
    (matplotlib's default labels its log minor ticks on a short range: "2×10¹" printed over "16");
    the left panel's log σ axis gets :func:`log_ticks` over its data.

    Raises:
        ImportError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the PNG plot needs matplotlib: pip install 'dpopt[plots]'") from exc

    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    rows = [r for r in table.rows if r.noise_multiplier is not None]
    b = [r.batch_size for r in rows]
    ok = [r for r in rows if r.b20_solvable]
    bad = [r for r in rows if not r.b20_solvable]
    fig, (ax, rel) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=110)
    for axis, ratio in ((ax, False), (rel, True)):

        def y(r, value, ratio=ratio):
            return value / r.noise_multiplier if ratio else value

        values = []
        if not ratio:
            values += [r.noise_multiplier for r in rows]
            axis.plot(b, values, "k-o", label="σ, no adaptive clipping")
        b20 = [y(r, r.b20_grad_noise_multiplier) for r in ok]
        values += b20
        axis.plot([r.batch_size for r in ok], b20, "-s", color="tab:red", label="σ_grad, σ_b = B̄/20 rule")
        if bad:
            low = min([y(r, r.noise_multiplier) for r in rows]) * (0.9 if not ratio else 1.0)
            values.append(low)
            axis.plot(
                [r.batch_size for r in bad],
                [low] * len(bad),
                "x",
                color="tab:red",
                markersize=11,
                mew=2.5,
                label="B̄/20 rule: no solution",
            )
        share = [y(r, r.share_grad_noise_multiplier) for r in rows]
        best = [y(r, r.best_grad_noise_multiplier) for r in rows]
        values += share + best
        axis.plot(b, share, "-^", color="tab:blue", label=f"σ_grad, budget share r = {table.count_share:g}")
        axis.plot(b, best, "--", color="tab:green", label="σ_grad, best share r*")
        axis.set_xscale("log")
        axis.xaxis.set_major_locator(FixedLocator(b))
        axis.xaxis.set_major_formatter(FuncFormatter(_tick_text))
        axis.xaxis.set_minor_formatter(NullFormatter())
        if not ratio and values:
            axis.set_yscale("log")
            axis.yaxis.set_major_locator(FixedLocator(log_ticks(min(values), max(values))))
            axis.yaxis.set_major_formatter(FuncFormatter(_tick_text))
            axis.yaxis.set_minor_formatter(NullFormatter())
        axis.set_xlabel("expected batch size B̄")
        axis.grid(True, which="major", alpha=0.3)
        axis.grid(True, which="minor", alpha=0.1)
        axis.legend(fontsize=8)
    ax.set_ylabel("gradient noise multiplier")
    rel.set_ylabel("σ_grad / σ (gradient noise inflation)")
    fig.suptitle(
        f"ε = {table.target_epsilon:g}, δ = {table.delta:g}, N = {table.dataset_size}, "
        f"{table.epochs:g} epochs, steps = ceil(epochs·N/B̄) ({table.accountant})",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def write_split_png(table, path: Union[str, Path]) -> Path:
    """Draw :func:`split_figure` of a :class:`~dpopt.accounting.split.SplitTable` into ``path`` (PNG).

    Raises:
        ImportError: matplotlib is not installed (``pip install dpopt[plots]``).
    """
    import matplotlib.pyplot as plt

    fig = split_figure(table)
    path = Path(path)
    atomic_savefig(fig, path, format="png")
    plt.close(fig)
    return path
