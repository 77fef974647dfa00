"""σ calibration: the smallest noise multiplier meeting a target (ε, δ).

:func:`calibrate_noise_multiplier` returns σ such that T Poisson-sampled
Gaussian steps at rate q satisfy ε(σ) ≤ target under the requested accountant,
and it CHECKS that inequality with the accurate accountant (exactly what
:func:`~dpopt.accounting.accountant.epsilon` computes) before returning. The
events are built by :func:`~dpopt.accounting.events.dpsgd_event`, i.e. by
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
  ε ≤ target at once. The coarse levels build their PLDs with
  :func:`~dpopt.accounting.pld.fast_pld_epsilon` (vectorised; equal to
  dp_accounting's construction to rounding); the accurate level, whose ε is
  reported, is dp_accounting's own construction.
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
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

from ..errors import ConfigError
from .accountant import AccountingWarning, epsilon, epsilon_report
from .cost import CostBudget
from .events import dpsgd_event
from .pld import PLD_DISCRETIZATION, fast_pld_epsilon
from .prv import PRV_EPS_ERROR, prv_epsilon
from .rdp import rdp_epsilon
from .registry import check_accountant
from .validation import check_delta, check_rtol, check_sample_rate, check_steps, check_target_epsilon

__all__ = [
    "CalibrationResult",
    "CalibrationProgress",
    "CalibrationInterrupted",
    "calibrate_noise_multiplier",
    "calibrate_correlated_noise_multiplier",
    "calibrate_amplified_noise_multiplier",
    "warn_if_amplification_costs",
    "AMPLIFICATION_CHECK_DELTA",
    "DEFAULT_RTOL",
    "MIN_NOISE_MULTIPLIER",
    "MAX_NOISE_MULTIPLIER",
]

#: The search bracket for σ. Below 0.1 a Gaussian step's own ε is ~100 nats: no
#: meaningful privacy, and PLD/PRV grids grow like 1/σ². Above 1e4 ε is below what
#: the accountants resolve at their default grids (PLD rounds losses up to 1e-4 nats;
#: RDP cannot certify ε < ln(1/δ)/1023).
MIN_NOISE_MULTIPLIER = 0.1
MAX_NOISE_MULTIPLIER = 1e4
#: Cost budget of one evaluation on the cheap (non-final) levels of the search.
_LEVEL_BUDGET = CostBudget(seconds=5.0, memory_bytes=2e9)


class CalibrationProgress(NamedTuple):
    """One ε evaluation of the search, as passed to ``progress`` callbacks.

    Attributes:
        level: the approximation evaluated (``"gdp-clt"``, ``"pld@0.003"``, ``"pld"``, ...).
        noise_multiplier: σ evaluated.
        epsilon: ε(σ) at that level (nats).
        evaluations: evaluations so far (all levels).
        seconds: wall time since the search started (s).
    """

    level: str
    noise_multiplier: float
    epsilon: float
    evaluations: int
    seconds: float


class CalibrationInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`calibrate_noise_multiplier`; the message says where the search was.

    A ``KeyboardInterrupt`` subclass, so code that handles Ctrl-C keeps working.
    No noise multiplier was chosen.
    """


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

    def __init__(self, name: str, fn: Callable[[float], float], tracker: Optional["_Tracker"] = None):
        self.name = name
        self.fn = fn
        self.count = 0
        self.tracker = tracker
        self._cache: dict[float, float] = {}

    def __call__(self, sigma: float) -> float:
        if sigma not in self._cache:
            if self.tracker is not None:
                self.tracker.current = (self.name, sigma)
            self.count += 1
            self._cache[sigma] = self.fn(sigma)
            if self.tracker is not None:
                self.tracker.report(self.name, sigma, self._cache[sigma])
        return self._cache[sigma]


class _Tracker:
    """Counts evaluations, remembers where the search is and forwards progress."""

    def __init__(self, progress: Optional[Callable[[CalibrationProgress], None]]):
        self.progress = progress
        self.start = time.perf_counter()
        self.evaluations = 0
        self.current: Optional[tuple[str, float]] = None
        self.last: Optional[CalibrationProgress] = None

    def report(self, level: str, sigma: float, eps: float) -> None:
        self.evaluations += 1
        self.last = CalibrationProgress(
            level, float(sigma), float(eps), self.evaluations, time.perf_counter() - self.start
        )
        if self.progress is not None:
            self.progress(self.last)


def _h(eps: float, target: float) -> float:
    if eps <= 0.0:
        return -math.inf
    if math.isinf(eps):
        return math.inf
    return math.log(eps) - math.log(target)


def _search(
    level: _Level,
    target: float,
    u0: float,
    slope: float,
    xtol: float,
    must_succeed: bool = False,
    model: Optional[_Level] = None,
    max_step: float = _MAX_LOG_STEP,
    bounds: tuple[float, float] = (-math.inf, math.inf),
) -> tuple[float, float, float]:
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
    u_min, u_max = bounds
    u, evals = min(max(u0, u_min), u_max), 0
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
                u_model, _, _ = _search(model, target * m / eps, u, slope, xtol / 4, max_step=max_step, bounds=bounds)
                step = u_model - u
        if h > 0 and abs(step) < xtol / 2:
            step = xtol / 2  # land just on the safe side to close the bracket
        u_new = min(max(u + max(-max_step, min(max_step, step)), u_min), u_max)
        if lo is not None and hi is not None and not (lo[0] < u_new < hi[0]):
            u_new = 0.5 * (lo[0] + hi[0])
        if u_new == u:  # pinned at an end of the bracket
            if h <= 0:
                return u, eps, slope
            if u == u_max and not must_succeed:
                return u, math.inf, slope
            if u == u_max:
                raise RuntimeError(
                    f"calibration found no noise multiplier <= {math.exp(u_max):g} meeting the "
                    f"target at level {level.name}"
                )
            u_new = min(u + xtol, u_max)
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


def _accurate(accountant: str, delta: float, q: float, steps: int) -> Callable[[float], float]:
    """ε(σ) exactly as :func:`~dpopt.accounting.accountant.epsilon` reports it (default cost budget)."""
    return lambda s: epsilon_report(dpsgd_event(s, q, steps), delta, accountant).epsilon


def _levels(
    accountant: str,
    target: float,
    delta: float,
    q: float,
    steps: int,
    tracker: Optional[_Tracker] = None,
    accurate: Optional[_Level] = None,
) -> list[tuple[_Level, float]]:
    def pld_at(d: float) -> Callable[[float], float]:
        # the cheap levels build their PLDs vectorised (equal to dp_accounting's to rounding); the final,
        # reported level is the accurate accountant itself (dp_accounting's own construction)
        return lambda s: fast_pld_epsilon(dpsgd_event(s, q, steps), delta, d, budget=_LEVEL_BUDGET)

    def level(name, fn):
        return _Level(name, fn, tracker)

    accurate = accurate or level(accountant, _accurate(accountant, delta, q, steps))
    clt = (level("gdp-clt", lambda s: _gdp_clt_epsilon(s, q, steps, delta)), 1e-3)
    # Grids scale down for small targets so the cheap roots stay informative.
    scale = min(1.0, target)
    coarse = (level("pld@%g" % (3e-3 * scale), pld_at(3e-3 * scale)), 1e-2)
    if accountant == "pld":
        medium_d = 1e-3 * scale
        if medium_d < 3 * PLD_DISCRETIZATION:  # tiny targets: the medium grid would cost as much
            return [clt, coarse, (accurate, 0.0)]
        return [clt, coarse, (level("pld@%g" % medium_d, pld_at(medium_d)), 2e-4), (accurate, 0.0)]
    if accountant == "rdp":
        return [clt, (accurate, 0.0)]

    def prv_rough(s: float) -> float:
        return (
            prv_epsilon(dpsgd_event(s, q, steps), delta, eps_error=0.1, estimate=True, budget=_LEVEL_BUDGET)
            + PRV_EPS_ERROR
        )

    return [clt, coarse, (level("prv@0.1", prv_rough), 2e-4), (accurate, 0.0)]


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "pld",
    rtol: float = DEFAULT_RTOL,
    progress: Optional[Callable[[CalibrationProgress], None]] = None,
    *,
    sigma_name: str = "noise_multiplier",
    unit: str = "steps",
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
        progress: called with a :class:`CalibrationProgress` after every ε
            evaluation (for a status line on long searches); None: silent.
        sigma_name, unit: how the refusals name σ and T (cyclic Poisson MF: σ/s and "rounds").

    The search stays in σ ∈ [:data:`MIN_NOISE_MULTIPLIER`,
    :data:`MAX_NOISE_MULTIPLIER`]. Targets outside what that bracket can
    give are recognised with two cheap evaluations before any search: a
    target at or above the RDP upper bound on ε at σ = 0.1 (no meaningful
    privacy; any σ ≥ 0.1 meets it) and a target below the accurate ε at
    σ = 1e4 (below what the accountant can certify) are refused. Each PLD/PRV
    evaluation is cost-bounded (coarser, still pessimistic grids above the
    budget; see :mod:`dpopt.accounting.cost`).

    Returns:
        :class:`CalibrationResult` with ``noise_multiplier`` and its ``epsilon``.

    Raises:
        ValueError: invalid arguments (the message names the one to change),
            a target outside the bracket (see above), or an accountant failure.
        CalibrationInterrupted: Ctrl-C during the search (a
            ``KeyboardInterrupt``; the message says which level and σ were
            being evaluated, and that no σ was chosen).
        RuntimeError: if no σ meeting the target was found inside the bracket.

    Source: secant search in (ln σ, ln ε); accurate accountants as in
    :mod:`dpopt.accounting.accountant` (Doroshenko et al. 2022; Mironov et al.
    2019; Gopi et al. 2021).
    """
    start = time.perf_counter()
    target = check_target_epsilon(target_epsilon)
    delta = check_delta(delta)
    q = check_sample_rate(sample_rate)
    steps = check_steps(steps)
    name = check_accountant(accountant)
    rtol = check_rtol(rtol)

    tracker = _Tracker(progress)
    try:
        return _calibrate(target, delta, q, steps, name, rtol, tracker, start, sigma_name, unit)
    except KeyboardInterrupt as exc:
        if isinstance(exc, CalibrationInterrupted):
            raise
        where = ""
        if tracker.current is not None:
            where = (
                f" while evaluating the {tracker.current[0]} accountant at noise_multiplier = {tracker.current[1]:.6g}"
            )
        last = ""
        if tracker.last is not None:
            last = (
                f"; last result: epsilon = {tracker.last.epsilon:.6g} at noise_multiplier = "
                f"{tracker.last.noise_multiplier:.6g} ({tracker.last.level})"
            )
        raise CalibrationInterrupted(
            f"calibration interrupted{where} after {tracker.evaluations} evaluations and "
            f"{time.perf_counter() - start:.1f} s (target_epsilon = {target:g}, delta = {delta:g}, "
            f"sample_rate = {q:g}, steps = {steps}, accountant = {name}){last}; no noise multiplier was chosen"
        ) from None


def _fmt_eps(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.6g}"


def _calibrate(
    target: float,
    delta: float,
    q: float,
    steps: int,
    name: str,
    rtol: float,
    tracker: _Tracker,
    start: float,
    sigma_name: str = "noise_multiplier",
    unit: str = "steps",
) -> CalibrationResult:
    # Bracket checks: two cheap evaluations recognise absurd targets before any search.
    eps_lo = rdp_epsilon(dpsgd_event(MIN_NOISE_MULTIPLIER, q, steps), delta)
    tracker.report("rdp (bracket)", MIN_NOISE_MULTIPLIER, eps_lo)
    if eps_lo <= target:
        raise ConfigError(
            f"target_epsilon = {target:g} cannot be reached as a calibration target: it is looser than the "
            f"smallest noise the search considers, {sigma_name} = {MIN_NOISE_MULTIPLIER:g}, where epsilon <= "
            f"{_fmt_eps(eps_lo)} already (rdp upper bound; delta = {delta:g}, sample_rate = {q:g}, {unit} = "
            f"{steps}): any {sigma_name} >= {MIN_NOISE_MULTIPLIER:g} meets it and such a target gives no "
            "meaningful privacy; choose a smaller target_epsilon or set noise_multiplier directly",
            "target_epsilon",
        )
    accurate = _Level(name, _accurate(name, delta, q, steps), tracker)
    evaluate = accurate.fn
    accurate.fn = lambda s: evaluate(_round_up(s))  # the accurate level sees printable σ only
    eps_hi = accurate(MAX_NOISE_MULTIPLIER)
    if eps_hi > target:
        raise ConfigError(
            f"target_epsilon = {target:g} is below what the {name} accountant can certify here: even "
            f"{sigma_name} = {MAX_NOISE_MULTIPLIER:g} gives epsilon = {_fmt_eps(eps_hi)} (delta = {delta:g}, "
            f"sample_rate = {q:g}, {unit} = {steps}); choose a larger target_epsilon"
            + ("" if name == "pld" else " or accountant 'pld'"),
            "target_epsilon",
        )
    bounds = (math.log(MIN_NOISE_MULTIPLIER), math.log(MAX_NOISE_MULTIPLIER))
    u, slope, eps = 0.0, -1.5, None  # start at σ = 1 with a typical slope
    levels = _levels(name, target, delta, q, steps, tracker, accurate)
    for i, (level, xtol) in enumerate(levels):
        final = i == len(levels) - 1
        model = levels[i - 1][0] if final and i > 0 else None
        u, eps, slope = _search(
            level,
            target,
            u,
            slope,
            2 * rtol if final else xtol,
            must_succeed=final,
            model=model,
            max_step=_MAX_LOG_STEP if i == 0 else _LATER_MAX_LOG_STEP,
            bounds=bounds,
        )
    sigma = _round_up(math.exp(u))
    if not eps <= target:  # type: ignore[operator]  # defensive: the final level only returns checked points
        raise RuntimeError(f"internal error: calibrated epsilon {eps} exceeds target {target}")
    return CalibrationResult(
        noise_multiplier=sigma,
        epsilon=float(eps),  # type: ignore[arg-type]
        target_epsilon=target,
        delta=delta,
        sample_rate=q,
        steps=steps,
        accountant=name,
        evaluations={lvl.name: lvl.count for lvl, _ in levels},
        seconds=time.perf_counter() - start,
    )


def calibrate_correlated_noise_multiplier(
    target_epsilon: float, delta: float, strategy: Any, participation: Any, accountant: str = "pld"
) -> float:
    """The σ whose correlated-noise run (T releases) the ledger scores at ε ≤ ``target_epsilon``
    (``strategy``, ``participation``: :mod:`dpopt.accounting.matrix_factorization`'s Strategy and
    Participation).

    σ = Δ/μ* with μ* the Gaussian μ of ε = target (:func:`~dpopt.accounting.matrix_factorization.gaussian_epsilon`, bisection), then raised by
    0.1 % steps until dpopt's accountant on the run's per-release events (:func:`~dpopt.accounting.matrix_factorization.step_events`) is at or
    below the target (PLD's connect-the-dots grid is pessimistic by a little).

    The search bracket is μ ∈ [1e-6, 1/:data:`dpopt.noise.MIN_NOISE_MULTIPLIER`]: σ/Δ no smaller than the
    Gaussian sampler serves (0.0383, :func:`dpopt.noise.check_tail_reach`), so σ ≥ 0.0383·Δ.

    Raises:
        ValueError: target ε ≤ 0, δ ∉ (0, 1); (:class:`~dpopt.errors.ConfigError` naming ``target_epsilon``)
            a target looser than ε at σ/Δ = 0.0383 (the smallest noise the search considers) or tighter than
            ε at μ = 1e-6.
    """
    from dp_accounting import dp_event
    from scipy.optimize import brentq

    from ..noise import MIN_NOISE_MULTIPLIER as SAMPLER_MIN
    from .matrix_factorization import gaussian_epsilon, prefix_sensitivities, step_events

    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}")
    prefix = prefix_sensitivities(strategy, participation)
    sens = float(prefix[-1])
    mu_lo, mu_hi = 1e-6, 1.0 / SAMPLER_MIN
    where = f"delta = {delta:g}, steps = {participation.steps}, participations = {participation.participations}"
    eps_hi = gaussian_epsilon(mu_hi, delta)
    if eps_hi <= target_epsilon:
        raise ConfigError(
            f"target_epsilon = {target_epsilon:g} cannot be reached as a calibration target: it is looser than the "
            f"smallest noise the search considers, noise_multiplier / sensitivity = {SAMPLER_MIN:.4f} (the "
            f"smallest the Gaussian sampler serves; noise_multiplier = {SAMPLER_MIN * sens:.4g} at sensitivity "
            f"{sens:.4g}), where epsilon = {_fmt_eps(eps_hi)} already ({where}); choose a smaller target_epsilon "
            "or set noise_multiplier directly",
            "target_epsilon",
        )
    if gaussian_epsilon(mu_lo, delta) >= target_epsilon:
        raise ConfigError(
            f"target_epsilon = {target_epsilon:g} is tighter than the search considers (noise_multiplier / "
            f"sensitivity = {1 / mu_lo:g}; {where}); choose a larger target_epsilon",
            "target_epsilon",
        )
    mu = float(brentq(lambda m: gaussian_epsilon(m, delta) - target_epsilon, mu_lo, mu_hi, xtol=1e-12))
    sigma = sens / mu
    for _ in range(200):
        event = dp_event.ComposedDpEvent(
            [e for e in step_events(sigma, prefix) if not isinstance(e, dp_event.NoOpDpEvent)]
        )
        if epsilon(event, delta, accountant) <= target_epsilon:
            return sigma
        sigma *= 1.001
    raise RuntimeError("could not calibrate the noise multiplier (the accountant never reached the target)")


def calibrate_amplified_noise_multiplier(
    target_epsilon: float,
    delta: float,
    strategy: Any,
    steps: int,
    parts: int,
    sample_rate: float,
    accountant: str = "pld",
) -> float:
    """The σ of a cyclic-Poisson MF run (``sampling="cyclic-poisson"``) at ε ≤ ``target_epsilon``.

    Such a run over T = ``steps`` releases and b' = ``parts`` parts is accounted as k = ⌈T/b'⌉ rounds of the
    Poisson-sampled Gaussian at noise multiplier σ/s, s =
    :func:`~dpopt.accounting.sampled_matrix_mechanism.amplified_sensitivity` (‖c‖ for banded with b ≤ b'
    bands, Choquette-Choo et al. 2023, arXiv 2306.08153, Thm 4; √λ_max(UᵀU) for BLT and banded with b > b',
    the spectral bound), so σ = DP-SGD's σ for k steps at q = ``sample_rate`` (:func:`calibrate_noise_multiplier`)
    times s. The one rule of ``make_private_with_epsilon``, ``dpopt train`` and ``DPTrainer``.

    Raises:
        ValueError: as :func:`calibrate_noise_multiplier`; as ``amplified_sensitivity`` (overlapping columns
            over more than 2048 steps).
    """
    from .matrix_factorization import amplified_sensitivity

    scale = amplified_sensitivity(strategy, int(steps), int(parts))
    rounds = -(-int(steps) // int(parts))
    sigma = calibrate_noise_multiplier(
        target_epsilon,
        delta,
        float(sample_rate),
        rounds,
        accountant,
        sigma_name=f"noise_multiplier / amplified sensitivity {scale:.4g}",
        unit="rounds",
    )
    return float(sigma.noise_multiplier) * scale


AMPLIFICATION_CHECK_DELTA = 1e-5
"""The δ of :func:`warn_if_amplification_costs` where the run's δ is not known yet (``make_private``)."""


def warn_if_amplification_costs(
    strategy: Any,
    steps: int,
    batches: int,
    parts: int,
    sample_rate: float,
    noise_multiplier: float,
    delta: float,
    accountant: str = "pld",
) -> Optional[tuple[float, float]]:
    """Warn (:class:`~dpopt.accounting.accountant.AccountingWarning`) when cyclic-Poisson accounting of a
    correlated-noise run scores a LARGER ε than cyclic batches would for the same run; nothing is switched.

    The same ``strategy``, T = ``steps`` releases and σ = ``noise_multiplier``, at ``delta``:

    * unamplified (``sampling="cyclic"``: ``batches`` = b cyclic batches, k = ⌈T/b⌉ participations b apart):
      one Gaussian of noise multiplier σ/Δ, Δ the strategy's sensitivity
      (:func:`~dpopt.accounting.matrix_factorization.prefix_sensitivities`);
    * amplified (b' = ``parts`` parts Poisson-sampled at q = ``sample_rate``): ⌈T/b'⌉ rounds of the
      Poisson-sampled Gaussian at σ/s, s = :func:`~dpopt.accounting.matrix_factorization.amplified_sensitivity`
      (Choquette-Choo et al. 2023, arXiv 2306.08153, Thm 4; the spectral bound for BLT), as the ledger scores it.

    The amplified bound can lose (a large q with few parts: more rounds, each barely amplified, and a
    larger s); then the σ calibrated for a target ε is larger too. Cost: two ε evaluations, at planning.

    Returns:
        ``(amplified ε, unamplified ε)`` when it warned, else None.

    Raises:
        ValueError: as ``amplified_sensitivity`` (overlapping columns over more than 2048 steps).
    """
    from dp_accounting import dp_event

    from .matrix_factorization import Participation, amplified_sensitivity, prefix_sensitivities

    steps, batches, parts, sigma = int(steps), int(batches), int(parts), float(noise_multiplier)
    plain = Participation(steps, -(-steps // batches), batches)
    sens = float(prefix_sensitivities(strategy, plain)[-1])
    eps_plain = epsilon(dp_event.GaussianDpEvent(sigma / sens), delta, accountant)
    scale = amplified_sensitivity(strategy, steps, parts)
    rounds = -(-steps // parts)
    round_event = dp_event.PoissonSampledDpEvent(float(sample_rate), dp_event.GaussianDpEvent(sigma / scale))
    eps_amp = epsilon(dp_event.SelfComposedDpEvent(round_event, rounds), delta, accountant)
    if not eps_amp > eps_plain:
        return None
    warnings.warn(
        f"sampling='cyclic-poisson' at sample_rate={sample_rate:g} ({parts} parts) scores this run at "
        f"epsilon={eps_amp:.4g}, MORE than the unamplified accounting of cyclic batches ({batches} batches): "
        f"epsilon={eps_plain:.4g} (sigma={sigma:.4g}, delta={delta:g}, {steps} steps; a sigma calibrated to a "
        "target epsilon is larger for the same reason); use sampling='cyclic' (the default), or a smaller sample_rate",
        AccountingWarning,
        stacklevel=3,
    )
    return eps_amp, eps_plain
