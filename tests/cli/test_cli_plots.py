"""The PNGs dpopt draws are readable (issue 22): no tick labels printed over each other, y labels over the
whole data range. split.png's x ticks printed "16" over matplotlib's minor "2×10¹" ("162×10¹") and its
log σ axis had no label above 1.0 when σ ran from 0.82 to 1.13; curves.png stacked its first panel's
title onto the epoch axis label."""

import json

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dpopt.accounting.split import SplitTable, split_row  # noqa: E402
from dpopt.reports.curves import CURVES_NAME, curves_figure, write_curves  # noqa: E402
from dpopt.reports.split_plot import log_ticks, split_figure, write_split_png  # noqa: E402


def _visible(ticks, renderer):
    out = []
    for tick in ticks:
        for label in (tick.label1, tick.label2):
            if label.get_visible() and label.get_text().strip():
                out.append((label.get_text(), label.get_window_extent(renderer)))
    return out


def axis_labels(axis) -> list[str]:
    """The visible, non-empty tick labels (major and minor) of a matplotlib ``axis`` (x or y)."""
    fig = axis.axes.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ticks = axis.get_major_ticks() + axis.get_minor_ticks()
    lo, hi = sorted(axis.get_view_interval())
    keep = [t for t in ticks if lo - 1e-12 * abs(hi) <= t.get_loc() <= hi + 1e-12 * abs(hi)]
    return [text for text, _ in _visible(keep, renderer)]


def overlapping_labels(fig) -> list[tuple[str, str]]:
    """Pairs of tick labels that overlap on the canvas, per axis of every subplot of ``fig``."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bad = []
    for ax in fig.axes + [child for a in fig.axes for child in a.child_axes]:  # secondary axes too
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            ticks = [
                t
                for t in axis.get_major_ticks() + axis.get_minor_ticks()
                if lo - 1e-9 * abs(hi) <= t.get_loc() <= hi + 1e-9 * abs(hi)
            ]
            boxes = _visible(ticks, renderer)
            for i in range(len(boxes)):
                for j in range(i + 1, len(boxes)):
                    if boxes[i][1].overlaps(boxes[j][1]):
                        bad.append((boxes[i][0], boxes[j][0]))
    return bad


def _table(batch_sizes, sigmas, n=60000):
    rows = [split_row(s, b, b / n, 100) for b, s in zip(batch_sizes, sigmas)]
    return SplitTable(1.0, 1e-5, n, 10, "pld", 0.05, 0.2, list(batch_sizes), rows, [1.0])


@pytest.mark.parametrize(
    "batch_sizes,sigmas",
    [
        ([16, 32, 64], [0.7, 0.8, 0.95]),  # less than a decade of B̄: matplotlib labelled the minor ticks
        ([100, 150, 200, 300], [0.82, 0.9, 0.98, 1.13]),
        ([8, 32, 64, 128, 256, 1024, 4096], [0.5, 0.58, 0.63, 0.7, 0.79, 1.13, 1.9]),  # dpopt split's default B̄
        ([8, 64, 512, 4096], [0.4, 1.2, 5.0, 30.0]),  # σ over two decades
    ],
)
def test_split_png_labels_do_not_overlap(batch_sizes, sigmas):
    fig = split_figure(_table(batch_sizes, sigmas))
    try:
        assert overlapping_labels(fig) == []
        for ax in fig.axes:  # B̄ labelled at the table's batch sizes only, as integers
            assert axis_labels(ax.xaxis) == [str(b) for b in batch_sizes]
    finally:
        plt.close(fig)


def test_split_png_sigma_axis_is_labelled_above_one():
    """σ from 0.82 to 1.13 (and σ_grad a little higher): the log axis showed 0.9 and 1.0 only."""
    fig = split_figure(_table([100, 150, 200, 300], [0.82, 0.9, 0.98, 1.13]))
    try:
        values = [float(t) for t in axis_labels(fig.axes[0].yaxis)]
        assert len(values) >= 3 and max(values) > 1.0 and min(values) <= 0.9
    finally:
        plt.close(fig)


def test_log_ticks():
    ticks = log_ticks(0.82, 1.16)
    assert 1.0 in ticks and 1.1 in ticks and all(0.82 <= t <= 1.16 for t in ticks) and len(ticks) >= 3
    assert log_ticks(0.4, 30.0) == [0.5, 1.0, 2.0, 5.0, 10.0, 20.0]
    narrow = log_ticks(1.001, 1.002)
    assert len(narrow) >= 2 and all(1.001 * (1 - 1e-9) <= t <= 1.002 * (1 + 1e-9) for t in narrow)
    with pytest.raises(ValueError):
        log_ticks(0.0, 1.0)


def test_write_split_png_writes_a_png(tmp_path):
    path = write_split_png(_table([16, 32, 64], [0.7, 0.8, 0.95]), tmp_path / "split.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _rows(validation: bool):
    rows = []
    for i, step in enumerate([5, 10, 15, 20, 21, 25, 30, 35, 40, 41]):
        row = {
            "epoch": round(step / 20.5, 6),
            "step": step,
            "test_accuracy": 0.1 + 0.02 * i,
            "test_loss": 2.3 - 0.02 * i,
            "epsilon": 1.4 + 0.1 * i,
        }
        if validation:
            row.update(val_accuracy=0.12 + 0.02 * i, val_loss=2.31 - 0.02 * i)
        rows.append(row)
    return rows


@pytest.mark.parametrize("validation", [False, True])
def test_curves_panels_are_labelled_and_do_not_overlap(validation):
    fig = curves_figure(_rows(validation), "dp-sgd on digits (mlp-small), σ = 1, B̄ = 64")
    try:
        assert overlapping_labels(fig) == []
        main = [ax for ax in fig.axes if ax.get_xlabel() == "step"]
        assert [ax.get_ylabel() for ax in main] == (
            ["test / validation accuracy", "test / validation loss", "ε spent"]
            if validation
            else ["test accuracy", "test loss", "ε spent"]
        )
        epoch_axes = [child for ax in main for child in ax.child_axes if child.get_xlabel() == "epoch"]
        assert len(epoch_axes) == 3  # every panel shows the epoch (it was the first one only)
        fig.canvas.draw()
        for ax, sec in zip(main, epoch_axes):  # the epoch axis is step × q: steps 5..41 are epochs 0.24..2
            lo, hi = ax.get_xlim()
            assert sorted(sec.get_xlim()) == pytest.approx(sorted([lo / 20.5, hi / 20.5]))
    finally:
        plt.close(fig)


def test_write_curves_titles_the_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(False)))
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"method": "dp-adam", "dataset": "mnist", "model": "mlp", "noise_multiplier": 1.5, "batch_size": 256.0}
        )
    )
    assert write_curves(tmp_path) == tmp_path / CURVES_NAME
    assert (tmp_path / CURVES_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
