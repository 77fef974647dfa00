"""Plots for people (issue 39): every report plot has a title with δ; spectrum.png's log axis stops at machine
precision; sub-epoch runs are drawn against integer steps with visible markers.

Before (main 7967c13): ``metric_vs_x.png`` and ``curves_by_epoch.png`` had no title and no δ; a rank-1 gradient's
spectrum ran down to 1e-28 (``clamp_min(1e-30)``); a sweep of 0.5-epoch runs drew one dot per line at epoch 0.5
with ticks 0.40, 0.45, ...
"""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from dpopt.diagnostics.report import plot_spectrum, spectrum_floor  # noqa: E402
from dpopt.experiments.report import write_report  # noqa: E402
from dpopt.reports.curves import _title  # noqa: E402


@pytest.fixture
def figures(monkeypatch):
    """Every figure a plotting function closes, kept open for inspection."""
    kept = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    yield kept
    for fig in kept:
        close(fig)


def _sweep(tmp_path, epochs_rows):
    """A results JSONL of 2 methods × 2 σ whose runs' metrics rows are at ``epochs_rows`` [(epoch, step)]."""
    lines = []
    for i, (method, sigma) in enumerate([("dp-sgd", 0.5), ("dp-sgd", 1.0), ("dp-adam", 0.5), ("dp-adam", 1.0)]):
        run = tmp_path / f"run{i}"
        run.mkdir()
        rows = [
            {"epoch": e, "step": s, "test_accuracy": 0.1 + 0.1 * k, "test_loss": 2.0, "epsilon": 0.3 * (k + 1)}
            for k, (e, s) in enumerate(epochs_rows)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        lines.append(
            {
                "method": method,
                "label": method,
                "noise_multiplier": sigma,
                "delta": 1e-6,
                "test_accuracy": 0.5 + 0.1 * i,
                "epsilon": 2.0 / sigma,
                "run_dir": str(run),
                "point": {"noise_multiplier": sigma, "label": method},
            }
        )
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_report_plots_have_a_title_with_delta(tmp_path, figures):
    done = write_report(_sweep(tmp_path, [(1, 10), (2, 20)]), tmp_path / "out")
    names = sorted(p.name for p in done["files"] if p.suffix == ".png")
    assert names == ["curves_by_epoch.png", "test_accuracy_vs_epsilon.png", "test_accuracy_vs_noise_multiplier.png"]
    assert len(figures) == 3
    for fig in figures:
        titles = [ax.get_title() for ax in fig.axes] + [fig._suptitle.get_text() if fig._suptitle else ""]
        assert any("δ = 1e-06" in t for t in titles), titles
    curves = figures[-1]
    assert curves.axes[-1].get_xlabel() == "epoch"  # whole epochs: the epoch axis


def test_sub_epoch_runs_are_drawn_against_integer_steps_with_markers(tmp_path, figures):
    write_report(_sweep(tmp_path, [(0.5, 11)]), tmp_path / "out")
    curves = figures[-1]
    for ax in curves.axes:
        (line, *_) = ax.get_lines()
        assert list(line.get_xdata()) == [11] and line.get_marker() == "o"
        assert ax.get_xlabel() in ("", "step (the runs are shorter than one epoch)")
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_run_curves_title_names_delta(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"method": "dp-sgd", "dataset": "digits", "noise_multiplier": 1.0, "batch_size": 64, "delta": 1e-5})
    )
    assert _title(tmp_path).endswith("ε at δ = 1e-05")


def test_spectrum_floor_is_machine_precision_relative_to_the_top():
    sv = torch.tensor([2.0, 1e-3, 1e-30, 0.0], dtype=torch.float64)
    assert spectrum_floor(sv, 10, 40) == pytest.approx(2.0 * torch.finfo(torch.float32).eps * 40)
    assert spectrum_floor(torch.zeros(3), 3, 3) == torch.finfo(torch.float32).tiny


def test_spectrum_png_log_axis_stops_at_machine_precision(tmp_path, figures):
    from dpopt.diagnostics.model import diagnose_model

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 6, bias=False))
    x = torch.ones(16, 1) * torch.randn(1, 8)  # one input direction: a rank-1 gradient, 5 zero singular values
    y = torch.randint(0, 6, (16,))
    diag = diagnose_model(
        net,
        nn.functional.cross_entropy,
        x,
        y,
        batch_sizes=[64.0],
        noise_multipliers={64.0: 1.0},
        max_grad_norm=1.0,
        trials=0,
    )
    layer = diag.layers[0]
    floor = spectrum_floor(layer.singular_values, 6, 8)
    # the 5 exact zeros come out of float32 as ~1e-8 (rounding): all below the floor, the true direction above
    assert float(layer.singular_values[0]) > 1e3 * floor and float(layer.singular_values[1:].max()) < floor
    plot_spectrum(diag, layer, tmp_path / "spectrum.png")
    (ax,) = figures[-1].axes
    assert ax.get_yscale() == "log"
    assert ax.get_ylim()[0] == pytest.approx(floor / 2) and floor > 1e-9  # it ran to 1e-28
    assert "floor" in ax.get_ylabel()
