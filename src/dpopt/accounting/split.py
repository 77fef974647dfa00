"""The budget split explorer: what quantile clipping's count release costs in gradient noise, by batch size.

Quantile adaptive clipping releases a noisy clipped count next to every noisy
gradient (docs/algorithms.md, "Quantile adaptive clipping"). The joint
mechanism is charged at σ_eff = (σ_grad⁻² + (2σ_b)⁻²)^(−1/2), so for a target
(ε, δ) — which fixes the total σ — the gradient noise must grow. This module
tabulates, for each expected batch size B̄ (with N and the number of epochs
fixed, so q = B̄/N and T = ⌈epochs·N/B̄⌉ change with B̄):

* ``noise_multiplier`` σ: the calibrated σ without adaptive clipping;
* the **B̄/20 rule** (Andrew et al. 2021, arXiv:1905.03871, Section 3): the
  count noise std σ_b = B̄/20, i.e. 2σ_b = B̄/10; a split exists only if
  B̄/10 > σ, and then σ_grad = σ/√(1 − r) with r = (10σ/B̄)²; otherwise
  there is **no solution** (the count alone would spend the whole budget);
* a **budget share** r (:func:`~dpopt.accounting.budget.split_budget`):
  σ_grad = σ/√(1 − r), 2σ_b = σ/√r — always a solution;
* the **best share** r* (dpopt's choice, not from a paper): the r minimising
  the relative gradient-noise inflation plus the per-step relative jitter of
  the clip bound, f(r) = 1/√(1 − r) + η_C·σ/(2B̄√r). The clip bound moves by
  exp(−η_C(b̃ − γ)) and the noisy clipped fraction b̃ has std σ_b/B̄ =
  σ/(2B̄√r), so the second term is the std of ln C's step caused by the count
  noise. Setting f′(r) = 0 gives the closed form r* = a/(1 + a) with
  a = (η_C·σ/(2B̄))^(2/3).

Everything after the calibration of σ(ε, B̄) is closed form, which is what the
HTML explorer (:mod:`dpopt.reports.split_html`) exploits: it is given σ on a
small (ε, B̄) grid and recomputes the rest in the browser.

Example::

    >>> from dpopt.accounting.split import best_count_share, steps_for_epochs
    >>> steps_for_epochs(60000, 256, 5)           # TF Privacy's convention: ceil(epochs·N/B)
    (0.004266666666666667, 1172)
    >>> round(best_count_share(1.0, 8), 4)
    0.0512

Plain data only: no plotting and no I/O here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

from ..errors import ConfigError
from .budget import DEFAULT_COUNT_SHARE, default_count_noise_std, split_budget
from .calibration import calibrate_noise_multiplier
from .registry import check_accountant
from .validation import check_delta, check_target_epsilon

__all__ = [
    "DEFAULT_QUANTILE_LR",
    "SplitRow",
    "SplitTable",
    "best_count_share",
    "b20_split",
    "default_epsilon_grid",
    "split_row",
    "split_table",
    "steps_for_epochs",
]

#: η_C, the geometric step of the quantile clip-bound update (Andrew et al.'s default 0.2).
DEFAULT_QUANTILE_LR = 0.2


def steps_for_epochs(dataset_size: int, batch_size: float, epochs: float) -> tuple[float, int]:
    """``(sample_rate, steps)`` for ``epochs`` passes over N records at expected batch size B̄.

    q = B̄/N and T = ⌈epochs·N/B̄⌉ — TF Privacy's ``compute_dp_sgd_privacy``
    convention (rounding up: never fewer steps than the epochs ask for).
    ``dpopt train`` rounds epochs/q to the nearest integer instead; the two
    differ by at most one step.

    Raises:
        ConfigError: naming ``dataset_size``, ``batch_size`` or ``epochs``.
    """
    n = _check_dataset_size(dataset_size)
    b = float(batch_size)
    if not (math.isfinite(b) and 0 < b <= n):
        raise ConfigError(f"batch_size must be in (0, N = {n}] (the dataset size), got {b:g}", "batch_size")
    e = float(epochs)
    if not (math.isfinite(e) and e > 0):
        raise ConfigError(f"epochs must be > 0, got {epochs!r}", "epochs")
    q = b / n
    return q, max(1, math.ceil(e * n / b - 1e-9))


def _check_dataset_size(dataset_size) -> int:
    try:
        n = int(dataset_size)
        ok = n == dataset_size and n >= 1
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ConfigError(f"dataset_size must be a positive integer, got {dataset_size!r}", "dataset_size")
    return n


def best_count_share(
    noise_multiplier: float, expected_batch_size: float, quantile_lr: float = DEFAULT_QUANTILE_LR
) -> float:
    """r* = a/(1 + a), a = (η_C·σ/(2B̄))^(2/3): the share minimising 1/√(1−r) + η_C·σ/(2B̄√r).

    See the module docstring for the objective (gradient-noise inflation plus
    the clip bound's per-step log-jitter from the count noise).
    """
    sigma, b, lr = float(noise_multiplier), float(expected_batch_size), float(quantile_lr)
    if not (sigma > 0 and b > 0 and lr > 0):
        raise ValueError("best_count_share needs noise_multiplier, expected_batch_size and quantile_lr > 0")
    a = (lr * sigma / (2.0 * b)) ** (2.0 / 3.0)
    return a / (1.0 + a)


def b20_split(noise_multiplier: float, expected_batch_size: float) -> Optional[tuple[float, float]]:
    """``(grad_noise_multiplier, count_share)`` under the σ_b = B̄/20 rule, or None (no solution).

    2σ_b = B̄/10 must exceed σ; then r = (σ/(2σ_b))² and σ_grad = σ/√(1−r).
    """
    sigma = float(noise_multiplier)
    c = 2.0 * default_count_noise_std(expected_batch_size)
    if c <= sigma:
        return None
    r = (sigma / c) ** 2
    return sigma / math.sqrt(1.0 - r), r


@dataclass(frozen=True)
class SplitRow:
    """One batch size of the explorer's table (all values public configuration or accountant output).

    Attributes:
        batch_size: expected batch size B̄.
        sample_rate: q = B̄/N.
        steps: T = ⌈epochs·N/B̄⌉.
        noise_multiplier: calibrated σ without adaptive clipping (None: the
            target cannot be met in the calibration bracket; ``error`` says why).
        b20_count_noise_std: σ_b = B̄/20.
        b20_grad_noise_multiplier: σ_grad under the B̄/20 rule; None = no solution.
        b20_count_share: the share the B̄/20 rule implies; None = no solution.
        count_share: the requested share r.
        share_grad_noise_multiplier: σ/√(1−r).
        share_count_noise_std: σ_b = σ/(2√r).
        best_count_share: r* (see :func:`best_count_share`).
        best_grad_noise_multiplier: σ/√(1−r*).
        error: why σ could not be calibrated, else None.
    """

    batch_size: float
    sample_rate: float
    steps: int
    noise_multiplier: Optional[float]
    b20_count_noise_std: float
    b20_grad_noise_multiplier: Optional[float] = None
    b20_count_share: Optional[float] = None
    count_share: float = DEFAULT_COUNT_SHARE
    share_grad_noise_multiplier: Optional[float] = None
    share_count_noise_std: Optional[float] = None
    best_count_share: Optional[float] = None
    best_grad_noise_multiplier: Optional[float] = None
    error: Optional[str] = None

    @property
    def b20_solvable(self) -> bool:
        """Whether the B̄/20 rule has a split (B̄/10 > σ)."""
        return self.b20_grad_noise_multiplier is not None

    def inflation(self, grad_noise_multiplier: Optional[float]) -> Optional[float]:
        """σ_grad/σ − 1 (None where either is missing)."""
        if grad_noise_multiplier is None or not self.noise_multiplier:
            return None
        return grad_noise_multiplier / self.noise_multiplier - 1.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["b20_solvable"] = self.b20_solvable
        out["b20_inflation"] = self.inflation(self.b20_grad_noise_multiplier)
        out["share_inflation"] = self.inflation(self.share_grad_noise_multiplier)
        out["best_inflation"] = self.inflation(self.best_grad_noise_multiplier)
        return out


def split_row(
    noise_multiplier: Optional[float],
    batch_size: float,
    sample_rate: float,
    steps: int,
    count_share: float = DEFAULT_COUNT_SHARE,
    quantile_lr: float = DEFAULT_QUANTILE_LR,
    error: Optional[str] = None,
) -> SplitRow:
    """The closed-form part of a row, given the calibrated σ (None: only the B̄/20 σ_b is filled in)."""
    row = SplitRow(
        batch_size=float(batch_size),
        sample_rate=sample_rate,
        steps=steps,
        noise_multiplier=noise_multiplier,
        b20_count_noise_std=default_count_noise_std(batch_size),
        count_share=count_share,
        error=error,
    )
    if noise_multiplier is None:
        return row
    b20 = b20_split(noise_multiplier, batch_size)
    share = split_budget(noise_multiplier, count_share)
    r_best = best_count_share(noise_multiplier, batch_size, quantile_lr)
    return SplitRow(
        batch_size=row.batch_size,
        sample_rate=sample_rate,
        steps=steps,
        noise_multiplier=noise_multiplier,
        b20_count_noise_std=row.b20_count_noise_std,
        b20_grad_noise_multiplier=None if b20 is None else b20[0],
        b20_count_share=None if b20 is None else b20[1],
        count_share=share.count_share,
        share_grad_noise_multiplier=share.grad_noise_multiplier,
        share_count_noise_std=share.count_noise_std,
        best_count_share=r_best,
        best_grad_noise_multiplier=split_budget(noise_multiplier, r_best).grad_noise_multiplier,
    )


@dataclass(frozen=True)
class SplitTable:
    """The explorer's result: one :class:`SplitRow` per batch size and the σ(ε, B̄) grid.

    ``grid[i][j]`` is the calibrated σ for ``epsilon_grid[i]`` and
    ``batch_sizes[j]`` (None where the target is outside the calibration
    bracket); ``target_epsilon`` is one of ``epsilon_grid``.
    """

    target_epsilon: float
    delta: float
    dataset_size: int
    epochs: float
    accountant: str
    count_share: float
    quantile_lr: float
    batch_sizes: list
    rows: list
    epsilon_grid: list
    grid: list = field(default_factory=list)

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "rows"}
        out["rows"] = [r.to_dict() for r in self.rows]
        out["steps"] = [r.steps for r in self.rows]
        out["sample_rates"] = [r.sample_rate for r in self.rows]
        return out


def default_epsilon_grid(target_epsilon: float) -> list[float]:
    """ε·{¼, ½, 1, 2, 4}: the sliders' ε range around the target (five calibrations per batch size)."""
    e = check_target_epsilon(target_epsilon)
    return [e * f for f in (0.25, 0.5, 1.0, 2.0, 4.0)]


def _parse_batch_sizes(batch_sizes: Sequence[float], dataset_size: int) -> list[float]:
    out = []
    for b in batch_sizes:
        try:
            v = float(b)
        except (TypeError, ValueError):
            raise ConfigError(f"batch_sizes must be numbers, got {b!r}", "batch_sizes") from None
        if not (math.isfinite(v) and 0 < v <= dataset_size):
            raise ConfigError(
                f"every batch size must be in (0, N = {dataset_size}] (the dataset size), got {b!r}", "batch_sizes"
            )
        out.append(v)
    if not out:
        raise ConfigError("give at least one batch size", "batch_sizes")
    return sorted(set(out))


def split_table(
    target_epsilon: float,
    dataset_size: int,
    epochs: float,
    batch_sizes: Sequence[float],
    *,
    delta: float = 1e-5,
    accountant: str = "pld",
    count_share: float = DEFAULT_COUNT_SHARE,
    quantile_lr: float = DEFAULT_QUANTILE_LR,
    epsilon_grid: Optional[Sequence[float]] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> SplitTable:
    """Calibrate σ for every (ε, B̄) of the grid and tabulate the three splits at ``target_epsilon``.

    Args:
        target_epsilon: the ε of the printed table (added to ``epsilon_grid`` if missing).
        dataset_size: N (treated as public, as everywhere in dpopt).
        epochs: passes over the data; T = ⌈epochs·N/B̄⌉ per batch size.
        batch_sizes: expected batch sizes B̄ (sorted, duplicates dropped).
        delta: δ.
        accountant: ``"pld"`` (default; ~1–2 s per calibration) or ``"rdp"`` (~0.1 s), ``"prv"``.
        count_share: the share r of the "budget share" column (default 0.05).
        quantile_lr: η_C, used by the best share r*.
        epsilon_grid: the ε values of the sliders' grid (default :func:`default_epsilon_grid`).
        progress: called as ``progress(done, total)`` after each calibration.

    Returns:
        :class:`SplitTable`. A grid point whose target cannot be met (outside
        the calibration bracket) is None; its row carries the error message.

    Raises:
        ConfigError: invalid arguments (the argument named).
    """
    target = check_target_epsilon(target_epsilon)
    delta = check_delta(delta)
    accountant = check_accountant(accountant)
    n = _check_dataset_size(dataset_size)
    try:
        split_budget(1.0, count_share)
    except ValueError as exc:
        raise ConfigError(str(exc), "count_share") from None
    if not (float(quantile_lr) > 0):
        raise ConfigError(f"quantile_lr must be > 0, got {quantile_lr!r}", "quantile_lr")
    sizes = _parse_batch_sizes(batch_sizes, n)
    schedule = [steps_for_epochs(n, b, epochs) for b in sizes]
    grid_eps = sorted({check_target_epsilon(e) for e in (epsilon_grid or default_epsilon_grid(target))} | {target})
    total, done = len(grid_eps) * len(sizes), 0
    grid: list[list[Optional[float]]] = []
    errors: dict[int, str] = {}
    for eps in grid_eps:
        line = []
        for j, (q, steps) in enumerate(schedule):
            try:
                line.append(calibrate_noise_multiplier(eps, delta, q, steps, accountant).noise_multiplier)
            except (ValueError, RuntimeError) as exc:  # a target outside the calibration bracket
                line.append(None)  # type: ignore[arg-type]
                if eps == target:
                    errors[j] = str(exc)
            done += 1
            if progress is not None:
                progress(done, total)
        grid.append(line)  # type: ignore[arg-type]
    at_target = grid[grid_eps.index(target)]
    rows = [
        split_row(sigma, b, q, steps, count_share, quantile_lr, errors.get(j))
        for j, (sigma, b, (q, steps)) in enumerate(zip(at_target, sizes, schedule))
    ]
    return SplitTable(
        target_epsilon=target,
        delta=delta,
        dataset_size=n,
        epochs=float(epochs),
        accountant=accountant,
        count_share=float(count_share),
        quantile_lr=float(quantile_lr),
        batch_sizes=sizes,
        rows=rows,
        epsilon_grid=grid_eps,
        grid=grid,
    )
