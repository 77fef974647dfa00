"""Tables (Markdown) and figures (PNG) of :class:`~dpopt.diagnostics.model.ModelDiagnostics`.

NON-PRIVATE research output: computed from clean gradients (see
:mod:`dpopt.diagnostics.gradients`); every file written starts with (or
carries in its title) that notice.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..atomic import atomic_savefig
from .model import LayerReport, ModelDiagnostics
from .spectral import noise_edge, noise_std, predicted_cosines

__all__ = ["recovery_table", "snr_table", "cosine_table", "plot_spectrum", "plot_recovery", "spectrum_floor"]


def _b(b: float) -> str:
    return f"{int(b)}" if float(b).is_integer() else f"{b:g}"


def recovery_table(diag: ModelDiagnostics) -> str:
    """Paper-style per-layer recovery table: ✓ where B̄ ≥ B* (σ₁(Ḡ) > s(mn)^{1/4}), with ρ = σ₁/(s(mn)^{1/4})."""
    bs = diag.batch_sizes
    head = (
        "| layer | (m, n) | σ₁(Ḡ) | eff. rank | stable rank | "
        + " | ".join(f"B̄={_b(b)} (σ={diag.noise_multipliers[b]:.3g})" for b in bs)
        + " |"
    )
    lines = [head, "|" + "---|" * (5 + len(bs))]
    for lay in diag.layers:
        first = lay.rows[bs[0]]
        cells = []
        for b in bs:
            r = lay.rows[b]
            cells.append(f"{'✓' if r.recoverable else '–'} ρ={r.threshold_ratio:.2f}, B*={r.b_star:,.0f}")
        lines.append(
            f"| {lay.name} | ({lay.shape[0]}, {lay.shape[1]}) | {first.sigma1:.3g} | "
            f"{first.effective_rank:.1f} | {first.stable_rank:.2f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def snr_table(diag: ModelDiagnostics) -> str:
    """Spectral SNR ‖Ḡ‖_F / (s√(mn)) per layer and batch size."""
    bs = diag.batch_sizes
    lines = ["| layer | (m, n) | " + " | ".join(f"B̄={_b(b)}" for b in bs) + " |", "|" + "---|" * (2 + len(bs))]
    for lay in diag.layers:
        lines.append(
            f"| {lay.name} | ({lay.shape[0]}, {lay.shape[1]}) | "
            + " | ".join(f"{lay.rows[b].spectral_snr:.3f}" for b in bs)
            + " |"
        )
    return "\n".join(lines)


def cosine_table(diag: ModelDiagnostics) -> str:
    """Monte Carlo |cos| of the leading left/right singular vectors vs the BBP prediction, and B* with momentum."""
    bs = diag.batch_sizes
    lines = [
        f"| layer | B̄ | σ | s = σC/B̄ | ρ | MC left ± se | pred. left | MC right ± se | pred. right | "
        f"noisy eff. rank | B* | B* (β={diag.momentum:g}) |",
        "|" + "---|" * 12,
    ]
    for lay in diag.layers:
        for b in bs:
            r = lay.rows[b]
            mc_l = f"{r.mc.left:.3f} ± {r.mc.left_se:.3f}" if r.mc else "n/a"
            mc_r = f"{r.mc.right:.3f} ± {r.mc.right_se:.3f}" if r.mc else "n/a"
            lines.append(
                f"| {lay.name} | {_b(b)} | {r.noise_multiplier:.3g} | {r.noise_std:.3g} | "
                f"{r.threshold_ratio:.2f} | {mc_l} | {r.predicted_left:.3f} | {mc_r} | "
                f"{r.predicted_right:.3f} | {r.noisy_effective_rank:.1f} | {r.b_star:,.0f} | "
                f"{r.b_star_momentum:,.0f} |"
            )
    return "\n".join(lines)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def spectrum_floor(singular_values: torch.Tensor, m: int, n: int) -> float:
    """The smallest singular value worth drawing: σ₁ · ε · max(m, n), ε the float32 machine precision.

    The clean gradient is computed in float32; singular values below this (the numerical-rank
    tolerance of Golub & Van Loan, §5.4.1, as ``numpy.linalg.matrix_rank``) are rounding noise, and a
    log axis running down to them (1e-28) hid the spectrum's shape. An all-zero spectrum gets the
    float32 ``tiny`` so that the log axis still has a positive floor.
    """
    top = float(singular_values.max()) if singular_values.numel() else 0.0
    floor = top * torch.finfo(torch.float32).eps * max(m, n)
    return floor if floor > 0 else float(torch.finfo(torch.float32).tiny)


def plot_spectrum(diag: ModelDiagnostics, layer: LayerReport, path: Path, seed: int = 0) -> Path:
    """Singular values of one layer's clean gradient vs one simulated noisy release per batch size."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    k = torch.arange(1, len(layer.singular_values) + 1)
    m, n = layer.shape
    floor = spectrum_floor(layer.singular_values, m, n)
    ax.semilogy(k, layer.singular_values.clamp_min(floor), "k-", lw=2, label="clean Ḡ")
    gen = torch.Generator().manual_seed(seed)
    for b in diag.batch_sizes:
        s = noise_std(diag.noise_multipliers[b], diag.max_grad_norm, b)
        noisy = layer.clean + s * torch.randn(layer.clean.shape, generator=gen, dtype=torch.float64)  # type: ignore[operator, union-attr]
        sv = torch.linalg.svdvals(noisy)
        (line,) = ax.semilogy(k, sv, lw=1, label=f"Ḡ + N, B̄={_b(b)}")
        ax.axhline(noise_edge(s, m, n), color=line.get_color(), ls=":", lw=1)
    ax.set_ylim(bottom=floor / 2)  # below: numerically zero (it ran to 1e-28 before)
    ax.set_xlabel("index i")
    ax.set_ylabel("singular value σᵢ (log; floor σ₁·ε_mach·max(m, n))")
    ax.set_title(
        f"{layer.name} ({m}×{n}): clean vs noisy (dotted: noise edge s(√m+√n))\n"
        "NON-PRIVATE diagnostic (clean gradient)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)
    return path


def plot_recovery(
    diag: ModelDiagnostics,
    path: Path,
    sigma_of_b: Callable[[float], float],
    layers: Optional[Sequence[LayerReport]] = None,
    grid: int = 24,
) -> Path:
    """|cos| of the leading right singular vector vs B̄: theory curve (BBP, σ(B̄) from ``sigma_of_b``)
    and the Monte Carlo points (mean ± 2 se) at the diagnosed batch sizes."""
    plt = _plt()
    layers = list(layers or diag.layers)
    lo, hi = min(diag.batch_sizes) / 4, max(diag.batch_sizes) * 4
    bgrid = [lo * (hi / lo) ** (i / (grid - 1)) for i in range(grid)]
    sig = [sigma_of_b(b) for b in bgrid]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for lay in layers:
        m, n = lay.shape
        s1 = float(lay.singular_values[0])
        curve = [predicted_cosines(s1, noise_std(sg, diag.max_grad_norm, b), m, n)[1] for b, sg in zip(bgrid, sig)]
        (line,) = ax.semilogx(bgrid, curve, lw=1.2, label=f"{lay.name} ({m}×{n})")
        pts = [(b, lay.rows[b].mc) for b in diag.batch_sizes if lay.rows[b].mc is not None]
        if pts:
            ax.errorbar(
                [b for b, _ in pts],
                [mc.right for _, mc in pts],
                yerr=[2 * mc.right_se for _, mc in pts],
                fmt="o",
                color=line.get_color(),
                ms=4,
                capsize=2,
            )
    ax.set_xlabel("expected batch size B̄")
    ax.set_ylabel("|cos(v₁(Ḡ), v₁(Ḡ+N))|")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(
        "leading right singular vector recovery: BBP theory (lines) vs Monte Carlo (points)\n"
        "NON-PRIVATE diagnostic (clean gradient)",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)
    return path


def finite(x: float) -> float:
    return x if math.isfinite(x) else float("nan")
