"""``curves.png`` of a run directory: test accuracy, test loss and ε against step and epoch.

With a validation split (``validation_fraction``) the accuracy and loss panels
also show the validation records' curves.

Reads the run's ``metrics.jsonl`` (public values only: test-set metrics of the
released model and accountant output). Needs matplotlib; without it (or with
no metrics rows) nothing is written.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional, Union

from ..atomic import atomic_savefig
from ..jsonio import loads

__all__ = ["CURVES_NAME", "write_curves", "curves_figure"]

CURVES_NAME = "curves.png"


def _title(run_dir: Path) -> str:
    """``method on dataset (model), σ, B̄`` from the run's ``config.json`` (public configuration); "" if unreadable."""
    try:
        cfg = loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(cfg, dict) or not cfg.get("method"):
        return ""
    parts = [f"{cfg['method']} on {cfg.get('dataset', '?')}" + (f" ({cfg['model']})" if cfg.get("model") else "")]
    if cfg.get("noise_multiplier") is not None:
        parts.append(f"σ = {float(cfg['noise_multiplier']):.4g}")
    if cfg.get("batch_size") is not None:
        parts.append(f"B̄ = {float(cfg['batch_size']):g}")
    if cfg.get("delta") is not None:
        parts.append(f"ε at δ = {float(cfg['delta']):g}")
    return ", ".join(parts)


def curves_figure(rows: list[dict], title: str = ""):
    """The figure of :func:`write_curves` for metrics rows (matplotlib ``Figure``).

    Three panels against the step, each with the epoch on a secondary top axis and the quantity
    on its y axis (test accuracy, test loss, ε spent; validation curves beside the test ones
    when the rows have them); ``title`` above them all.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12.5, 3.9), dpi=90)
    last = rows[-1]
    ratio = float(last["epoch"]) / float(last["step"]) if last.get("step") and last.get("epoch") else None
    for ax, key, label in zip(
        axes, ("test_accuracy", "test_loss", "epsilon"), ("test accuracy", "test loss", "ε spent")
    ):
        ax.plot(steps, [r.get(key) for r in rows], marker="o", markersize=3, label="test")
        val = key.replace("test_", "val_")
        if val != key and any(r.get(val) is not None for r in rows):  # a validation split (validation_fraction)
            ax.plot(steps, [r.get(val) for r in rows], marker="s", markersize=3, label="validation")
            label = label.replace("test ", "test / validation ")
            ax.legend(fontsize=7)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(
            MaxNLocator(integer=True, min_n_ticks=1)
        )  # a sub-epoch run: steps 1, 2, not 0.5, 1.5
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ratio:  # epoch = step × q
            sec = ax.secondary_xaxis("top", functions=(lambda s, r=ratio: s * r, lambda e, r=ratio: e / r))
            sec.set_xlabel("epoch", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def write_curves(run_dir: Union[str, Path]) -> Optional[Path]:
    """Draw ``run_dir/curves.png`` from ``run_dir/metrics.jsonl``; return its path (None if not drawn).

    Three panels against the step (epoch on a secondary axis of each): test accuracy,
    test loss and ε spent (:func:`curves_figure`), titled with the run's method,
    dataset, σ and B̄ from ``config.json``. Never raises: a plot must not fail a
    finished run (a failure is a warning).
    """
    run_dir = Path(run_dir)
    try:
        rows = []
        path = run_dir / "metrics.jsonl"
        if not path.is_file():
            return None
        for line in path.read_text().splitlines():
            try:
                row = loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("test_accuracy") is not None and row.get("step") is not None:
                rows.append(row)
        if not rows:
            return None
        try:
            import matplotlib.pyplot as plt

            fig = curves_figure(rows, _title(run_dir))
        except ImportError:  # pragma: no cover - depends on the environment
            return None
        out = run_dir / CURVES_NAME
        try:
            atomic_savefig(fig, out)
        finally:
            plt.close(fig)
        return out
    except Exception as exc:  # noqa: BLE001 - a plot never fails the run
        warnings.warn(f"could not draw {run_dir / CURVES_NAME}: {exc}", RuntimeWarning, stacklevel=2)
        return None
