"""σ calibration: the smallest noise multiplier meeting a target (ε, δ).

:func:`calibrate_noise_multiplier` returns σ such that T Poisson-sampled
Gaussian steps at rate q satisfy ε(σ) ≤ target under the requested accountant,
and it CHECKS that inequality with the accurate accountant (exactly what
:func:`~dpopt.accounting.accountant.epsilon` computes) before returning. The
events are built by :func:`~dpopt.accounting.accountant.dpsgd_event`, i.e. by
:func:`~dpopt.accounting.events.poisson_gaussian_step`, the same builder the
Privatizer's ledger entries come from.

Search (coarse to fine). Write u = ln σ and h(u) = ln ε(e^u) − ln ε_target;
h is decreasing and nearly linear in u, so a safeguarded secant method
(bracketing with bisection fallback) converges in a few evaluations. The
search runs over a ladder of approximations of the accurate accountant, each
level starting from the previous level's root and slope:

* ``pld``: connect-the-dots PLD on a coarse grid (3e-3 nats), then 1e-3, then
  the accurate 1e-4 (grids shrink in proportion for targets ε < 1).
  Pessimistic PLDs on coarser grids over-estimate ε, so the 1e-3 root is
  slightly conservative and the accurate evaluation there usually confirms
  ε ≤ target at once.
* ``rdp``: the RDP accountant itself (each evaluation is cheap).
* ``prv``: coarse PLD (3e-3), then the PRV estimate at ε_error = 0.1 plus the final
  ε_error, then the accurate PRV upper bound (ε_error = 0.01).

The first rung is free: the central-limit Gaussian-DP approximation (Bu et
al. 2020) gives a starting σ without any PLD. On the accurate level, when the
first point is not yet acceptable, the second comes from defect correction:
the ratio ρ = ε_accurate/ε_model measured there rescales the previous (cheap)
level, whose root is then found with cheap evaluations; after that the secant
uses the accurate values. The accurate level accepts a σ with ε(σ) ≤ target
once the secant step towards its exact root is within ``rtol`` (relative),
so the result has at most about ``rtol`` more noise than necessary, never
less. dp_accounting's own ``calibrate_dp_mechanism`` evaluates the accurate
PLD 10–20 times (seconds to tens of seconds); this ladder evaluates it once
or twice.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from .accountant import (
    PLD_DISCRETIZATION,
    check_accountant,
    check_delta,
    check_steps,
    dpsgd_event,
    pld_epsilon,
    rdp_epsilon,
)
from .events import check_sample_rate

__all__ = ["CalibrationResult", "calibrate_noise_multiplier", "DEFAULT_RTOL"]

#: Relative tolerance on σ: the result is within ~rtol above the optimum.
DEFAULT_RTOL = 1e-3
_MAX_EVALS_PER_LEVEL = 40
_MAX_LOG_STEP = 1.0  # largest step in ln σ on the first level (factor e ≈ 2.7)
_LATER_MAX_LOG_STEP = 0.25  # after the first level the root is near: smaller steps
_SIGNIFICANT_DIGITS = 6  # the returned σ has at most this many significant digits


def _round_up(x: float, digits: int = _SIGNIFICANT_DIGITS) -> float:
    """x rounded UP to ``digits`` significant digits (so printing it loses nothing)."""
    if x <= 0 or not math.isfinite(x):
        return x
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(x)))
    y = math.ceil(x * scale - 1e-9) / scale
    return y if y >= x else math.ceil(x * scale + 1) / scale


@dataclass(frozen=True)
class CalibrationResult:
    """Outcome of :func:`calibrate_noise_multiplier`.

    Attributes:
        noise_multiplier: σ (noise std / L2 sensitivity), the value to use.
        epsilon: ε(σ) at ``delta`` under the accurate ``accountant`` (≤ target).
        target_epsilon, delta, sample_rate, steps, accountant: the inputs.
        evaluations: number of ε evaluations per search level.
        seconds: wall time of the search (s).
    """

    noise_multiplier: float
    epsilon: float
    target_epsilon: float
    delta: float
    sample_rate: float
    steps: int
    accountant: str
    evaluations: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        """JSON-ready dict (keys as in the CLI's ``--json`` output)."""
        return {
            "noise_multiplier": self.noise_multiplier,
            "epsilon": self.epsilon,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
            "accountant": self.accountant,
            "evaluations": dict(self.evaluations),
            "seconds": self.seconds,
        }


class _Level:
    """One approximation of ε(σ), with an evaluation counter and a cache."""

    def __init__(self, name: str, fn: Callable[[float], float]):
        self.name = name
        self.fn = fn
        self.count = 0
        self._cache: dict[float, float] = {}

    def __call__(self, sigma: float) -> float:
        if sigma not in self._cache:
            self.count += 1
            self._cache[sigma] = self.fn(sigma)
        return self._cache[sigma]


def _h(eps: float, target: float) -> float:
    if eps <= 0.0:
        return -math.inf
    if math.isinf(eps):
        return math.inf
    return math.log(eps) - math.log(target)


def _search(level: _Level, target: float, u0: float, slope: float, xtol: float,
            must_succeed: bool = False, model: Optional[_Level] = None,
            max_step: float = _MAX_LOG_STEP) -> tuple[float, float, float]:
    """Safeguarded secant on h(u) = ln ε(e^u) − ln target at one level.

    Returns ``(u, eps, slope)`` for a point with ε ≤ target (``h ≤ 0``) whose
    distance to the root is ≤ xtol: either a bracket of width ≤ xtol, or a
    secant step from it of ≤ xtol/2. Without ``must_succeed`` the best point
    so far is returned after the evaluation budget; with it the search goes
    on until a point with ε ≤ target is found, or raises RuntimeError.

    With a ``model`` (a cheaper level), the second point is proposed by
    defect correction instead of a secant step: ρ = ε(u0)/model(u0) is
    measured at the first point and model(σ)·ρ = target is solved with the
    model (cheap evaluations). Later points come from the secant on this
    level's own values (superlinear even when the model's slope is off).
    """
    lo: Optional[tuple[float, float]] = None  # h > 0: not enough noise
    hi: Optional[tuple[float, float, float]] = None  # h <= 0: (u, h, eps)
    prev: Optional[tuple[float, float]] = None
    u, evals = u0, 0
    budget = _MAX_EVALS_PER_LEVEL * (3 if must_succeed else 1)
    while True:
        eps = level(math.exp(u))
        evals += 1
        h = _h(eps, target)
        if h > 0:
            if lo is None or u > lo[0]:
                lo = (u, h)
        elif hi is None or u < hi[0]:
            hi = (u, h, eps)
        if prev is not None and math.isfinite(h) and math.isfinite(prev[1]) and u != prev[0]:
            s = (h - prev[1]) / (u - prev[0])
            if s < 0:
                slope = s
        prev = (u, h)
        if lo is not None and hi is not None and hi[0] - lo[0] <= xtol:
            return hi[0], hi[2], slope
        if math.isinf(h):
            step = max_step if h > 0 else -max_step
        else:
            step = -h / slope
        if h <= 0 and abs(step) <= xtol / 2:
            return u, eps, slope  # the root is within xtol/2 below: accept
        if model is not None and evals == 1 and math.isfinite(h):
            m = model(math.exp(u))
            if 0.0 < m < math.inf:
                u_model, _, _ = _search(model, target * m / eps, u, slope, xtol / 4, max_step=max_step)
                step = u_model - u
        if h > 0 and abs(step) < xtol / 2:
            step = xtol / 2  # land just on the safe side to close the bracket
        u_new = u + max(-max_step, min(max_step, step))
        if lo is not None and hi is not None and not (lo[0] < u_new < hi[0]):
            u_new = 0.5 * (lo[0] + hi[0])
        u = u_new
        if evals >= budget:
            if hi is not None:
                return hi[0], hi[2], slope
            if not must_succeed:
                return u, math.inf, slope
            raise RuntimeError(f"calibration did not find a noise multiplier meeting the target at level {level.name}")


def _gdp_clt_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    """Analytic estimate of ε: the CLT's μ-GDP for Poisson-sampled Gaussians, converted at δ.

    μ = q·√(T·(e^{1/σ²} − 1)) (Bu, Dong, Long, Su 2020, "Deep Learning with
    Gaussian Differential Privacy", Cor. 5.4), and δ(ε) = Φ(−ε/μ + μ/2) −
    e^ε Φ(−ε/μ − μ/2) (Dong, Roth, Su 2019, Cor. 2.13), inverted by bisection.
    An approximation (not a bound), used only as the free first rung of the
    search ladder.
    """
    if sigma <= 0 or 1.0 / sigma**2 > 700:
        return math.inf
    mu = q * math.sqrt(steps * math.expm1(1.0 / sigma**2))
    if mu == 0.0:
        return 0.0

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2.0))

    def delta_of(eps: float) -> float:
        return phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2)

    lo, hi = 0.0, 1.0
    if delta_of(0.0) <= delta:
        return 0.0
    while delta_of(hi) > delta:
        lo, hi = hi, 2 * hi
        if hi > 500:
            return math.inf
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if delta_of(mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def _levels(accountant: str, target: float, delta: float, q: float, steps: int) -> list[tuple[_Level, float]]:
    def pld_at(d: float) -> Callable[[float], float]:
        return lambda s: pld_epsilon(dpsgd_event(s, q, steps), delta, d)

    clt = (_Level("gdp-clt", lambda s: _gdp_clt_epsilon(s, q, steps, delta)), 1e-3)
    # Grids scale down for small targets so the cheap roots stay informative.
    scale = min(1.0, target)
    coarse = (_Level("pld@%g" % (3e-3 * scale), pld_at(3e-3 * scale)), 1e-2)
    if accountant == "pld":
        accurate = (_Level("pld", pld_at(PLD_DISCRETIZATION)), 0.0)
        medium_d = 1e-3 * scale
        if medium_d < 3 * PLD_DISCRETIZATION:  # tiny targets: the medium grid would cost as much
            return [clt, coarse, accurate]
        return [clt, coarse, (_Level("pld@%g" % medium_d, pld_at(medium_d)), 2e-4), accurate]
    if accountant == "rdp":
        return [clt, (_Level("rdp", lambda s: rdp_epsilon(dpsgd_event(s, q, steps), delta)), 0.0)]
    from .prv import PRV_EPS_ERROR, prv_epsilon

    def prv_rough(s: float) -> float:
        return prv_epsilon(dpsgd_event(s, q, steps), delta, eps_error=0.1, estimate=True) + PRV_EPS_ERROR

    return [clt, coarse,
            (_Level("prv@0.1", prv_rough), 2e-4),
            (_Level("prv", lambda s: prv_epsilon(dpsgd_event(s, q, steps), delta)), 0.0)]


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "pld",
    rtol: float = DEFAULT_RTOL,
) -> CalibrationResult:
    """Smallest σ (within ``rtol``) with ε(σ) ≤ ``target_epsilon`` for T DP-SGD steps.

    The mechanism is T compositions of the Poisson-sampled Gaussian
    (Abadi et al. 2016) at rate q with noise multiplier σ, built by
    :func:`~dpopt.accounting.events.poisson_gaussian_step`. The returned σ is
    guaranteed conservative: its ε under the accurate ``accountant`` (the value
    :func:`~dpopt.accounting.accountant.epsilon` reports) was computed and is
    ≤ the target; the result carries that ε. For quantile clipping, the σ
    returned is the TOTAL σ to be split with :mod:`dpopt.accounting.budget`.

    Args:
        target_epsilon: ε target in nats, > 0.
        delta: δ ∈ (0, 1).
        sample_rate: Poisson rate q ∈ (0, 1] (expected_batch_size / N).
        steps: T ≥ 1 (number of noisy releases).
        accountant: ``"pld"`` (default), ``"rdp"`` or ``"prv"``.
        rtol: relative tolerance on σ in (0, 0.1]: the result is at most about
            rtol above the smallest σ meeting the target.

    Returns:
        :class:`CalibrationResult` with ``noise_multiplier`` and its ``epsilon``.

    Raises:
        ValueError: invalid arguments (the message names the one to change).
        RuntimeError: if no σ meeting the target was found (does not happen
            for finite targets > 0: ε → 0 as σ → ∞).

    Source: secant search in (ln σ, ln ε); accurate accountants as in
    :mod:`dpopt.accounting.accountant` (Doroshenko et al. 2022; Mironov et al.
    2019; Gopi et al. 2021).
    """
    start = time.perf_counter()
    try:
        target = float(target_epsilon)
    except (TypeError, ValueError):
        raise ValueError(f"target_epsilon must be a number > 0, got {target_epsilon!r}") from None
    if not (target > 0 and math.isfinite(target)):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    delta = check_delta(delta)
    q = check_sample_rate(sample_rate)
    steps = check_steps(steps)
    name = check_accountant(accountant)
    if not (0.0 < float(rtol) <= 0.1):
        raise ValueError(f"rtol must be in (0, 0.1], got {rtol!r}")
    rtol = float(rtol)

    u, slope, eps = 0.0, -1.5, None  # start at σ = 1 with a typical slope
    levels = _levels(name, target, delta, q, steps)
    accurate = levels[-1][0]
    evaluate = accurate.fn
    accurate.fn = lambda s: evaluate(_round_up(s))  # the accurate level sees printable σ only
    for i, (level, xtol) in enumerate(levels):
        final = i == len(levels) - 1
        model = levels[i - 1][0] if final and i > 0 else None
        u, eps, slope = _search(level, target, u, slope, 2 * rtol if final else xtol,
                                must_succeed=final, model=model,
                                max_step=_MAX_LOG_STEP if i == 0 else _LATER_MAX_LOG_STEP)
    sigma = _round_up(math.exp(u))
    if not eps <= target:  # defensive: the final level only returns checked points
        raise RuntimeError(f"internal error: calibrated epsilon {eps} exceeds target {target}")
    return CalibrationResult(
        noise_multiplier=sigma,
        epsilon=float(eps),
        target_epsilon=target,
        delta=delta,
        sample_rate=q,
        steps=steps,
        accountant=name,
        evaluations={lvl.name: lvl.count for lvl, _ in levels},
        seconds=time.perf_counter() - start,
    )
