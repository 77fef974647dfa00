"""Budget-share split for quantile adaptive clipping (Andrew et al. 2021).

Quantile clipping releases two Gaussians per step on the same Poisson batch:
the clipped gradient sum (sensitivity C, noise multiplier σ_grad) and the
centred clipped count Σ_i (1[‖g_i‖ ≤ C] − ½) (sensitivity ½, noise std σ_b,
i.e. noise multiplier 2σ_b). Together they are one Gaussian mechanism with

    σ_eff = (σ_grad⁻² + (2σ_b)⁻²)^(−1/2)

(Andrew et al. 2021, "Differentially Private Learning with Adaptive
Clipping", Theorem 1; docs/algorithms.md "Quantile adaptive clipping"). To be
charged exactly the σ you calibrated, give the count a share r ∈ (0, 1) of the
budget in σ⁻² units:

    σ_grad = σ / √(1 − r),     2σ_b = σ / √r     ⇒   σ_eff = σ exactly.

r = 0.05 (the default) inflates the gradient noise by 1/√0.95 − 1 ≈ 2.6 %.
This split always has a solution. Fixing σ_b instead (Andrew et al.'s
σ_b = B̄/20, tuned for federated rounds of thousands of records) needs
2σ_b > σ — i.e. B̄ > 10σ — and otherwise no gradient noise can make up the
budget: it is refused with advice.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

from .events import effective_noise_multiplier
from .validation import check_noise_multiplier

__all__ = [
    "DEFAULT_COUNT_SHARE",
    "COUNT_SENSITIVITY",
    "BudgetSplit",
    "split_budget",
    "split_for_count_noise",
    "default_count_noise_std",
    "recompose",
    "count_share_of",
]

#: Default share r of the budget (in σ⁻²) given to the clipped-count release.
DEFAULT_COUNT_SHARE = 0.05
#: L2 sensitivity of the centred count Σ_i (b_i − ½): one record moves it by ½.
COUNT_SENSITIVITY = 0.5


class BudgetSplit(NamedTuple):
    """A split of one noise multiplier σ between gradient and count releases.

    Unpacks as ``(grad_noise_multiplier, count_noise_multiplier, count_share)``.

    Attributes:
        grad_noise_multiplier: σ_grad = σ/√(1−r) (gradient noise std / C).
        count_noise_multiplier: 2σ_b = σ/√r (count noise std / ½), what
            :class:`~dpopt.privatizer.QuantileClipping` takes.
        count_share: r ∈ (0, 1).
    """

    grad_noise_multiplier: float
    count_noise_multiplier: float
    count_share: float

    @property
    def count_noise_std(self) -> float:
        """σ_b = count_noise_multiplier × ½, the std of the noise added to the count."""
        return self.count_noise_multiplier * COUNT_SENSITIVITY

    @property
    def noise_multiplier(self) -> float:
        """The recomposed σ_eff (see :func:`recompose`)."""
        return recompose(self.grad_noise_multiplier, self.count_noise_multiplier)


def _check_total(noise_multiplier: float) -> float:
    sigma = check_noise_multiplier(noise_multiplier)
    if sigma == 0.0:
        raise ValueError("a budget split needs noise_multiplier > 0 (σ = 0 is no privacy; nothing to split)")
    return sigma


def _check_share(count_share: float) -> float:
    try:
        r = float(count_share)
    except (TypeError, ValueError):
        raise ValueError(f"count_share must be a number in (0, 1), got {count_share!r}") from None
    if not (0.0 < r < 1.0):
        raise ValueError(
            f"count_share must be in (0, 1), got {count_share!r}; the default "
            f"{DEFAULT_COUNT_SHARE} gives the count 5% of the budget (gradient noise +2.6%)."
        )
    return r


def split_budget(noise_multiplier: float, count_share: float = DEFAULT_COUNT_SHARE) -> BudgetSplit:
    """Split σ into (σ_grad, count noise multiplier 2σ_b, r) with σ_eff = σ.

    σ_grad = σ/√(1−r) and 2σ_b = σ/√r, so σ_grad⁻² + (2σ_b)⁻² = σ⁻² (exact up
    to float rounding).

    Args:
        noise_multiplier: total σ > 0 (e.g. from
            :func:`~dpopt.accounting.calibration.calibrate_noise_multiplier`).
        count_share: r ∈ (0, 1), default 0.05.

    Returns:
        :class:`BudgetSplit` ``(grad_noise_multiplier, count_noise_multiplier, count_share)``.

    Raises:
        ValueError: σ ≤ 0 or not finite; r outside (0, 1).

    Source: docs/algorithms.md "Quantile adaptive clipping"; Andrew et al. 2021, Thm 1.
    """
    sigma = _check_total(noise_multiplier)
    r = _check_share(count_share)
    return BudgetSplit(sigma / math.sqrt(1.0 - r), sigma / math.sqrt(r), r)


def default_count_noise_std(expected_batch_size: float) -> float:
    """Andrew et al.'s default count noise std σ_b = B̄/20 (records per round / 20).

    Args:
        expected_batch_size: B̄ > 0 (records per step/round).

    Raises:
        ValueError: if B̄ ≤ 0.
    """
    b = float(expected_batch_size)
    if not (b > 0 and math.isfinite(b)):
        raise ValueError(f"expected_batch_size must be > 0, got {expected_batch_size!r}")
    return b / 20.0


def split_for_count_noise(
    noise_multiplier: float,
    *,
    count_noise_std: Optional[float] = None,
    count_noise_multiplier: Optional[float] = None,
    expected_batch_size: Optional[float] = None,
) -> BudgetSplit:
    """Split σ given a FIXED count noise (σ_b, or 2σ_b); refuse when impossible.

    With 2σ_b fixed, the share is r = (σ/(2σ_b))² and σ_grad = σ/√(1−r).
    A solution exists only if 2σ_b > σ: otherwise the count alone would spend
    the whole budget (or more).

    Give exactly one of ``count_noise_std`` (σ_b) or ``count_noise_multiplier``
    (2σ_b); with neither, σ_b = B̄/20 (:func:`default_count_noise_std`) is used
    and ``expected_batch_size`` is required.

    Args:
        noise_multiplier: total σ > 0.
        count_noise_std: σ_b > 0, the std of the noise added to the count.
        count_noise_multiplier: 2σ_b > 0.
        expected_batch_size: B̄ (public); used for the B̄/20 default and for
            the advice in the error message.

    Returns:
        :class:`BudgetSplit` ``(grad_noise_multiplier, count_noise_multiplier, count_share)``.

    Raises:
        ValueError: if 2σ_b ≤ σ (no split exists). The message gives the
            equivalent fix with a budget share (e.g. r = 0.05 and its σ_grad,
            2σ_b) and, for the B̄/20 rule, the smallest batch size B̄ > 10σ
            that would work; also on invalid or conflicting arguments.

    Source: docs/algorithms.md "Quantile adaptive clipping"; Andrew et al. 2021,
    Section 3 (σ_b = B̄/20 default).
    """
    sigma = _check_total(noise_multiplier)
    if count_noise_std is not None and count_noise_multiplier is not None:
        raise ValueError("give count_noise_std (σ_b) or count_noise_multiplier (2σ_b), not both")
    rule = ""
    if count_noise_multiplier is not None:
        c = check_noise_multiplier(count_noise_multiplier, "count_noise_multiplier")
    else:
        if count_noise_std is None:
            if expected_batch_size is None:
                raise ValueError(
                    "give count_noise_std, count_noise_multiplier or expected_batch_size (for the σ_b = B̄/20 default)"
                )
            count_noise_std = default_count_noise_std(expected_batch_size)
            rule = f" (σ_b = B̄/20 with B̄ = {float(expected_batch_size):g})"
        c = 2.0 * check_noise_multiplier(count_noise_std, "count_noise_std")
    if c == 0.0:
        raise ValueError("the count noise must be > 0: the clipped count is a release of private data")
    if c <= sigma:
        alt = split_budget(sigma, DEFAULT_COUNT_SHARE)
        advice = (
            f"use a budget share instead, e.g. count_share={DEFAULT_COUNT_SHARE} "
            f"(σ_grad = {alt.grad_noise_multiplier:.4g}, count noise multiplier 2σ_b = "
            f"{alt.count_noise_multiplier:.4g}, σ_b = {alt.count_noise_std:.4g})"
        )
        min_b = math.floor(10.0 * sigma) + 1
        batch_hint = f"; or an expected batch size B̄ ≥ {min_b} (B̄ > 10σ) for the σ_b = B̄/20 rule"
        raise ValueError(
            f"no budget split exists: count noise multiplier 2σ_b = {c:.4g}{rule} must exceed the "
            f"total noise multiplier σ = {sigma:.4g} (the count alone would cost σ_eff = {c:.4g} ≤ σ). "
            f"{advice}{batch_hint}."
        )
    r = (sigma / c) ** 2
    return BudgetSplit(sigma / math.sqrt(1.0 - r), c, r)


def recompose(grad_noise_multiplier: float, count_noise_multiplier: Optional[float] = None) -> float:
    """σ_eff = (σ_grad⁻² + (2σ_b)⁻²)^(−1/2); just σ_grad without a count release.

    This is the σ the joint per-step mechanism is charged at; for a split made
    by :func:`split_budget` it equals the total σ.

    Raises:
        ValueError: negative or non-finite multipliers.

    Source: docs/algorithms.md "Quantile adaptive clipping" (joint mechanism).
    """
    if count_noise_multiplier is None:
        return check_noise_multiplier(grad_noise_multiplier)
    return effective_noise_multiplier([grad_noise_multiplier, count_noise_multiplier])


def count_share_of(grad_noise_multiplier: float, count_noise_multiplier: float) -> float:
    """The share r = (σ_eff / 2σ_b)² implied by a pair of multipliers.

    Raises:
        ValueError: if a multiplier is ≤ 0 or not finite.
    """
    g = check_noise_multiplier(grad_noise_multiplier, "grad_noise_multiplier")
    c = check_noise_multiplier(count_noise_multiplier, "count_noise_multiplier")
    if g == 0.0 or c == 0.0:
        raise ValueError("count_share_of needs both multipliers > 0")
    return (recompose(g, c) / c) ** 2
