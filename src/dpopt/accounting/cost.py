"""Cost estimates for the PLD and PRV accountants, and the budget they must fit.

Both numerical accountants hold the privacy-loss distribution of the whole
ledger on a uniform grid, so their memory and time grow with the number of
grid points: (width of the composed privacy loss, in nats) / (grid step).
The width grows with the number of steps and with 1/σ (the privacy loss of a
Gaussian step has mean 1/(2σ²) and variance 1/σ² per unit sensitivity), so a
long run at a small noise multiplier can need tens of GB. These estimates are
computed in milliseconds from the ledger's (q, σ) terms, before any PLD is
built; the accountants use them to pick a coarser grid that still gives an
upper bound on ε (pessimistic rounding; PRV's certified bound) or to refuse.

Width model (nats), per distinct term (q, σ) occurring n times, with the
privacy loss L of one step under the two neighbouring distributions P and Q:
``Σ n·(E_P L − E_Q L) + 24·√(Σ n·Var L) + Σ w₁``, where w₁ is the width of one
step's loss over x ∈ [−10σ, 1 + 10σ]. Constants were fitted on this project's
2-core reference machine (dp_accounting 0.6, prv-accountant 0.2): the PLD
holds about 200 bytes and 2.5 µs per grid point (σ = 0.5, q = 1, 100 steps at
1e-4: 7.9 M points, 7.8 s, 1.4 GB), the PRV about 400 bytes and 4 µs per point
(q = 0.01, σ = 1, 10⁵ steps: 7.5 M points, 27 s, 2.7 GB). They are estimates
(within about a factor 2 on the cases measured), not guarantees.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

__all__ = [
    "CostBudget",
    "CostEstimate",
    "EpsilonReport",
    "DEFAULT_BUDGET",
    "MAX_PLD_DISCRETIZATION",
    "MAX_PRV_EPS_ERROR",
    "estimate_pld_cost",
    "estimate_prv_cost",
    "pld_loss_width",
]

#: PLD: estimated bytes and seconds per grid point (see the module docstring).
PLD_BYTES_PER_POINT = 200.0
PLD_SECONDS_PER_POINT = 2.5e-6
#: PRV: estimated bytes and seconds per grid point.
PRV_BYTES_PER_POINT = 400.0
PRV_SECONDS_PER_POINT = 4e-6
#: Coarsest PLD grid (nats) the accountants will use; beyond it they refuse.
MAX_PLD_DISCRETIZATION = 0.05
#: Largest PRV ε-error (nats) the accountants will accept; beyond it they refuse.
MAX_PRV_EPS_ERROR = 1.0


@dataclass(frozen=True)
class CostBudget:
    """The most one ε evaluation may cost before a coarser grid is used.

    Attributes:
        seconds: wall-time budget (s), > 0.
        memory_bytes: memory budget (bytes), > 0.
    """

    seconds: float = 30.0
    memory_bytes: float = 4e9

    def __post_init__(self):
        if not (self.seconds > 0 and self.memory_bytes > 0):
            raise ValueError(f"a cost budget needs seconds > 0 and memory_bytes > 0, got {self}")


#: The default budget of :func:`dpopt.accounting.accountant.epsilon`: 30 s or 4 GB.
DEFAULT_BUDGET = CostBudget()


@dataclass(frozen=True)
class CostEstimate:
    """Estimated cost of one ε evaluation.

    Attributes:
        accountant: ``"pld"`` or ``"prv"``.
        grid_points: number of grid points of the composed distribution.
        seconds: estimated wall time (s).
        memory_bytes: estimated peak memory (bytes).
        resolution: grid step (PLD, nats) or ε-error (PRV, nats) it was made for.
    """

    accountant: str
    grid_points: float
    seconds: float
    memory_bytes: float
    resolution: float

    def within(self, budget: CostBudget) -> bool:
        """True if both time and memory fit ``budget``."""
        return self.seconds <= budget.seconds and self.memory_bytes <= budget.memory_bytes

    def scale_to(self, budget: CostBudget) -> float:
        """Factor (≥ 1) by which the grid must be coarsened to fit ``budget``."""
        return max(1.0, self.seconds / budget.seconds, self.memory_bytes / budget.memory_bytes)

    def describe(self) -> str:
        return (
            f"about {self.grid_points:.3g} grid points, {_fmt_seconds(self.seconds)} and "
            f"{self.memory_bytes / 1e9:.3g} GB"
        )


def _fmt_seconds(s: float) -> str:
    return f"{s:.3g} s" if s < 120 else f"{s / 60:.3g} min"


@functools.lru_cache(maxsize=256)
def _term_moments(sigma: float, q: float) -> tuple[float, float, float]:
    """(E_P L − E_Q L, max Var L, one-step width) of one Poisson-sampled Gaussian step (sensitivity 1)."""
    if q >= 1.0:
        return 1.0 / sigma**2, 1.0 / sigma**2, (1.0 + 20.0 * sigma) / sigma**2
    x = np.linspace(-14.0 * sigma, 1.0 + 14.0 * sigma, 20001)
    p0 = np.exp(-(x**2) / (2 * sigma**2))
    p1 = np.exp(-((x - 1.0) ** 2) / (2 * sigma**2))
    p0, p1 = p0 / p0.sum(), p1 / p1.sum()
    mix = (1.0 - q) * p0 + q * p1
    loss = np.logaddexp(math.log1p(-q), math.log(q) + (2.0 * x - 1.0) / (2.0 * sigma**2))
    means, variances = [], []
    for w in (mix, p0):
        m = float((w * loss).sum())
        means.append(m)
        variances.append(float((w * (loss - m) ** 2).sum()))
    inside = (x >= -10.0 * sigma) & (x <= 1.0 + 10.0 * sigma)
    width = float(loss[inside].max() - loss[inside].min())
    return max(0.0, means[0] - means[1]), max(variances), width


def pld_loss_width(terms: Mapping[tuple[float, float], int], replace_one: bool = False) -> float:
    """Estimated width (nats) of the composed privacy-loss distribution of ``terms``.

    Args:
        terms: ``{(q, σ): count}`` as from :func:`~dpopt.accounting.events.flatten_gaussian_terms`;
            σ > 0.
        replace_one: the replace-one relation (sensitivity 2: σ is halved).
    """
    shift = var = single = 0.0
    for (q, sigma), count in terms.items():
        s = sigma / 2.0 if replace_one else sigma
        dm, v, w = _term_moments(float(s), float(min(q, 1.0)))
        shift += count * dm
        var += count * v
        single += w
    return shift + 24.0 * math.sqrt(var) + single


def estimate_pld_cost(
    terms: Mapping[tuple[float, float], int], discretization: float, replace_one: bool = False
) -> CostEstimate:
    """Estimated cost of the PLD accountant on ``terms`` at grid step ``discretization`` (nats)."""
    points = pld_loss_width(terms, replace_one) / float(discretization)
    k = max(1, len(terms))
    return CostEstimate(
        "pld", points, PLD_SECONDS_PER_POINT * points * k, PLD_BYTES_PER_POINT * points, float(discretization)
    )


def estimate_prv_cost(
    terms: Mapping[tuple[float, float], int],
    eps_error: float,
    delta_error: float,
    replace_one: bool = False,
    domain: Optional[float] = None,
) -> CostEstimate:
    """Estimated cost of the PRV accountant (prv-accountant 0.2) on ``terms``.

    The package discretises [−L, L] with mesh ``eps_error / √(T/2 · ln(12/δ_error))``
    (T = total compositions; Gopi et al. 2021, Sec. 5), L from an RDP bound
    (its ``compute_safe_domain_size``); pass ``domain`` = L if already known.
    """
    total = sum(int(c) for c in terms.values())
    if domain is None:
        domain = prv_domain(terms, eps_error, delta_error, replace_one)
    mesh = float(eps_error) / math.sqrt(max(total, 1) / 2.0 * math.log(12.0 / delta_error))
    points = 2.0 * domain / mesh
    k = max(1, len(terms))
    return CostEstimate(
        "prv", points, PRV_SECONDS_PER_POINT * points * k, PRV_BYTES_PER_POINT * points, float(eps_error)
    )


def prv_mechanisms(terms: Mapping[tuple[float, float], int], replace_one: bool = False) -> list:
    """One prv-accountant PRV per term (σ halved for replace-one, q = 1 only)."""
    from prv_accountant import GaussianMechanism, PoissonSubsampledGaussianMechanism

    out = []
    for q, sigma in terms:
        s = sigma / 2.0 if replace_one else sigma
        if q >= 1.0:
            out.append(GaussianMechanism(noise_multiplier=s))
        else:
            out.append(PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=s))
    return out


def prv_domain(
    terms: Mapping[tuple[float, float], int], eps_error: float, delta_error: float, replace_one: bool = False
) -> float:
    """The half-width L of the PRV grid, as prv-accountant computes it (an RDP bound + 3)."""
    from prv_accountant.accountant import compute_safe_domain_size

    return float(
        compute_safe_domain_size(
            prv_mechanisms(terms, replace_one),
            [int(c) for c in terms.values()],
            eps_error=eps_error,
            delta_error=delta_error,
        )
    )


@dataclass(frozen=True)
class EpsilonReport:
    """ε of a ledger with the details of how it was computed.

    Attributes:
        epsilon: ε ≥ 0 in nats (an upper bound; ``math.inf`` for σ = 0).
        delta: δ.
        accountant: ``"pld"``, ``"rdp"`` or ``"prv"``.
        resolution: the PLD grid step (nats) or the PRV ε-error used; None for rdp.
        coarsened: True when the accurate resolution would have exceeded the
            cost budget and a coarser one (still an upper bound) was used.
        estimate: the cost estimate at the resolution used (None for rdp).
        notes: human-readable remarks (coarsening, accountant warnings).
    """

    epsilon: float
    delta: float
    accountant: str
    resolution: Optional[float] = None
    coarsened: bool = False
    estimate: Optional[CostEstimate] = None
    notes: tuple = ()

    def to_dict(self) -> dict:
        eps = self.epsilon if math.isfinite(self.epsilon) else "inf"
        return {
            "epsilon": eps,
            "delta": self.delta,
            "accountant": self.accountant,
            "resolution": self.resolution,
            "coarsened": self.coarsened,
            "notes": list(self.notes),
        }
