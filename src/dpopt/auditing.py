"""Empirical privacy auditing: ε lower bounds from canary scores.

Two parts, in this order:

1. **Statistics (no torch, no training).** Given scores of a mechanism's
   output on neighbouring inputs — ``scores_in`` (canary present) and
   ``scores_out`` (canary absent) — :func:`epsilon_lower_bounds` returns two
   lower bounds on the ε of any (ε, δ)-DP guarantee the mechanism can have:

   * **direct** (Kairouz, Oh, Viswanath 2015, Thm. 2.1; Jagielski, Ullman,
     Oprea 2020): every test "guess *in* iff score > τ" of an (ε, δ)-DP
     mechanism satisfies FPR + e^ε FNR ≥ 1 − δ and FNR + e^ε FPR ≥ 1 − δ, so
     ε ≥ max(ln((1 − δ − FNR̄)/FPR̄), ln((1 − δ − FPR̄)/FNR̄)) with
     Clopper–Pearson upper confidence bounds FPR̄, FNR̄.
   * **Gaussian DP** (Dong, Roth, Su 2019; Nasr et al. 2023): a μ-GDP
     mechanism has FNR ≥ Φ(Φ⁻¹(1 − FPR) − μ) for every test, so
     μ ≥ Φ⁻¹(1 − FPR̄) − Φ⁻¹(FNR̄); this μ is converted to ε at δ with the exact
     μ-GDP ↔ (ε, δ) relation (DRS 2019, Cor. 2.13). The μ bound is sound for
     any mechanism; the ε it implies is a lower bound on ε(δ) for mechanisms
     whose trade-off curve is Gaussian (an unsampled Gaussian mechanism, or
     several composed — exactly what :func:`audit_privatizer` runs). It is
     far tighter than the direct route at δ = 1e-5.

2. **One-step audits of the real Privatizer** (:func:`audit_privatizer`,
   :func:`audit_mechanism`, :func:`audit_method`): run the library's
   :class:`~dpopt.privatizer.Privatizer` many times on a tiny problem with a
   worst-case canary per-sample gradient present or absent, score each release
   along the canary direction, and compare both lower bounds with the
   accountant's one-step ε (``accounting.accountant.epsilon(step_event(), δ)``).

Which claimed ε is compared: audits run with ``sample_rate = 1`` (the canary
is in the batch, or not, deterministically), so the mechanism actually run is
the unsampled (composed) Gaussian and the claim is
``epsilon(privatizer.step_event(), δ)`` for that q = 1 event — the plain
Gaussian's ε at σ_eff = (Σ σᵢ⁻²)^(−1/2). Privacy amplification by Poisson
sampling is not audited here (at q < 1 the one-step ε at δ = 1e-5 is too
small to resolve with 10⁵ trials, and the harness would have to sample the
whole batch, not only the canary); a privatizer with q < 1 is refused.

False alarms: each route's two Clopper–Pearson bounds are taken at α/4, so
with probability ≥ 1 − α both reported lower bounds hold simultaneously, and
an honest mechanism is reported as LEAK with probability ≤ α (default
α = 1e-3 per mechanism).

Example::

    >>> import numpy as np
    >>> from dpopt.auditing import epsilon_lower_bounds, gdp_epsilon, audit_mechanism
    >>> rng = np.random.default_rng(0)
    >>> b = epsilon_lower_bounds(rng.normal(1, 1, 50_000), rng.normal(0, 1, 50_000), delta=1e-5)
    >>> 0.9 * gdp_epsilon(1.0, 1e-5) < b.gdp < gdp_epsilon(1.0, 1e-5)   # true ε ≈ 4.377
    True
    >>> audit_mechanism("flat", trials=20_000).verdict
    'PASS'

See ``docs/auditing.md`` for the harness, the measured figures and the leak suite.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
from scipy import optimize, stats

__all__ = [
    "clopper_pearson_upper",
    "gdp_delta",
    "gdp_epsilon",
    "epsilon_from_error_rates",
    "gdp_mu_from_error_rates",
    "EpsilonLowerBounds",
    "epsilon_lower_bounds",
    "AuditResult",
    "claimed_one_step",
    "canary_scores",
    "audit_privatizer",
    "BUILTIN_MECHANISMS",
    "audit_mechanism",
    "registered_methods",
    "audit_method",
    "audit_all",
    "mechanism_seed",
]

DEFAULT_ALPHA = 1e-3
DEFAULT_DELTA = 1e-5
DEFAULT_TRIALS = 100_000


# =========================================================================== statistics
def _check_alpha(alpha: float, name: str = "alpha") -> float:
    value = float(alpha)
    if not (0.0 < value < 1.0):
        raise ValueError(f"{name} must be in (0, 1) (a false-alarm probability), got {alpha!r}; e.g. 1e-3")
    return value


def _check_delta(delta: float) -> float:
    value = float(delta)
    if not (0.0 < value < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}; e.g. 1e-5")
    return value


def clopper_pearson_upper(successes, trials, alpha: float):
    """One-sided Clopper–Pearson upper confidence bound of a binomial proportion.

    p̄ solves P(Bin(n, p̄) ≤ k) = α, i.e. p̄ = Beta⁻¹(1 − α; k + 1, n − k), and
    p̄ = 1 when k = n. P(p ≤ p̄) ≥ 1 − α for every true p.

    Args:
        successes: k, integer count(s) (scalar or array), 0 ≤ k ≤ n.
        trials: n ≥ 1, same shape as ``successes`` or scalar.
        alpha: one-sided error probability in (0, 1).

    Returns:
        float or ndarray of upper bounds in (0, 1].

    Raises:
        ValueError: α outside (0, 1), n < 1, or k outside [0, n].

    Source: Clopper & Pearson 1934.
    """
    alpha = _check_alpha(alpha)
    k = np.asarray(successes, dtype=float)
    n = np.asarray(trials, dtype=float)
    if np.any(n < 1) or np.any(k < 0) or np.any(k > n) or np.any(k != np.floor(k)):
        raise ValueError("clopper_pearson_upper needs integer counts 0 <= successes <= trials, trials >= 1")
    k, n = np.broadcast_arrays(k, n)
    out = np.ones(k.shape)
    inner = k < n
    out[inner] = stats.beta.ppf(1.0 - alpha, k[inner] + 1.0, n[inner] - k[inner])
    return float(out) if out.ndim == 0 else out


def gdp_delta(mu: float, epsilon: float) -> float:
    """δ(ε) of a μ-GDP mechanism: Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2).

    Args:
        mu: μ ≥ 0 (μ = sensitivity / noise std for one Gaussian release).
        epsilon: ε ≥ 0.

    Returns:
        δ in [0, 1) (0 for μ = 0).

    Raises:
        ValueError: negative or NaN μ or ε.

    Source: Dong, Roth, Su 2019, "Gaussian Differential Privacy", Cor. 2.13
    (equivalently Balle & Wang 2018, Thm. 8, the analytic Gaussian mechanism).
    """
    mu, epsilon = float(mu), float(epsilon)
    if not (mu >= 0) or not (epsilon >= 0):
        raise ValueError(f"gdp_delta needs mu >= 0 and epsilon >= 0, got mu={mu!r}, epsilon={epsilon!r}")
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    a = stats.norm.cdf(-epsilon / mu + mu / 2.0)
    # e^ε Φ(−ε/μ − μ/2) in logs: e^ε overflows long before the product does.
    b = math.exp(epsilon + stats.norm.logcdf(-epsilon / mu - mu / 2.0))
    return float(max(0.0, a - b))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest ε with δ(ε) ≤ δ for a μ-GDP mechanism (inverse of :func:`gdp_delta`).

    Args:
        mu: μ ≥ 0 (``inf`` allowed: returns ``inf``).
        delta: δ in (0, 1).

    Returns:
        ε ≥ 0 (0 when δ(0) = 2Φ(μ/2) − 1 ≤ δ). Solved with
        ``scipy.optimize.brentq`` to absolute tolerance 1e-10.

    Raises:
        ValueError: μ < 0 / NaN, or δ outside (0, 1).

    Source: Dong, Roth, Su 2019, Cor. 2.13. For μ = 1 (σ = 1, sensitivity 1)
    and δ = 1e-5 this gives ε ≈ 4.377, the one-step DP-SGD ε without sampling.
    """
    delta = _check_delta(delta)
    mu = float(mu)
    if not (mu >= 0):
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    if math.isinf(mu):
        return math.inf
    if mu == 0.0 or gdp_delta(mu, 0.0) <= delta:
        return 0.0
    hi = max(1.0, mu * mu)
    while gdp_delta(mu, hi) > delta:
        hi *= 2.0
    return float(optimize.brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, hi, xtol=1e-10, rtol=1e-12))


def epsilon_from_error_rates(fpr, fnr, delta: float):
    """Direct ε lower bound from one test's (upper-bounded) error rates.

    ε ≥ max(ln((1 − δ − FNR)/FPR), ln((1 − δ − FPR)/FNR)), clamped at 0. Pass
    upper confidence bounds FPR̄, FNR̄ to get a high-confidence bound (the
    expression decreases in both rates).

    Args:
        fpr, fnr: rates in [0, 1] (scalars or arrays of one shape).
        delta: δ in (0, 1).

    Returns:
        float or ndarray, ε ≥ 0 (``inf`` when a rate is exactly 0 and the other < 1 − δ).

    Raises:
        ValueError: δ outside (0, 1) or rates outside [0, 1].

    Source: Kairouz, Oh, Viswanath 2015, Thm. 2.1 (hypothesis-testing view of DP).
    """
    delta = _check_delta(delta)
    fpr = np.asarray(fpr, dtype=float)
    fnr = np.asarray(fnr, dtype=float)
    if np.any(~((fpr >= 0) & (fpr <= 1))) or np.any(~((fnr >= 0) & (fnr <= 1))):
        raise ValueError("error rates must lie in [0, 1]")
    with np.errstate(divide="ignore", invalid="ignore"):
        e1 = np.log(np.clip(1.0 - delta - fnr, 0.0, None)) - np.log(fpr)
        e2 = np.log(np.clip(1.0 - delta - fpr, 0.0, None)) - np.log(fnr)
    eps = np.nan_to_num(np.maximum(e1, e2), nan=0.0, posinf=np.inf, neginf=0.0)
    eps = np.maximum(eps, 0.0)
    return float(eps) if eps.ndim == 0 else eps


def gdp_mu_from_error_rates(fpr, fnr):
    """μ lower bound from one test's error rates: Φ⁻¹(1 − FPR) − Φ⁻¹(FNR), clamped at 0.

    A μ-GDP mechanism's tests all satisfy FNR ≥ Φ(Φ⁻¹(1 − FPR) − μ), hence this
    bound (symmetric in the two rates). Pass upper confidence bounds.

    Args:
        fpr, fnr: rates in [0, 1] (scalars or arrays).

    Returns:
        μ ≥ 0 (``inf`` if a rate is 0 and the other < 1).

    Source: Dong, Roth, Su 2019, Def. 2.4 / Eq. (6) (the Gaussian trade-off function G_μ).
    """
    fpr = np.asarray(fpr, dtype=float)
    fnr = np.asarray(fnr, dtype=float)
    with np.errstate(invalid="ignore"):
        mu = stats.norm.isf(fpr) - stats.norm.ppf(fnr)
    mu = np.maximum(np.nan_to_num(mu, nan=0.0, posinf=np.inf, neginf=0.0), 0.0)
    return float(mu) if mu.ndim == 0 else mu


@dataclass(frozen=True)
class EpsilonLowerBounds:
    """Result of :func:`epsilon_lower_bounds`.

    Attributes:
        direct: ε lower bound from the Clopper–Pearson route.
        gdp: ε at δ implied by ``mu`` (Gaussian trade-off assumed, see module doc).
        mu: lower bound on the GDP parameter μ (sound for any mechanism).
        delta, alpha: the δ and total false-alarm probability used.
        direct_test, gdp_test: the chosen test ``(tail, threshold, fpr_ub, fnr_ub)``
            (tail ``"upper"``: guess *in* iff score > threshold; ``"lower"``: iff < threshold).
        n_in, n_out: trials per arm; n_eval_in, n_eval_out: those used for the bound.
        selection: ``"holdout"`` or ``"bonferroni"``; tests: number of tests
            the Bonferroni correction covers per route.
    """

    direct: float
    gdp: float
    mu: float
    delta: float
    alpha: float
    direct_test: tuple
    gdp_test: tuple
    n_in: int
    n_out: int
    n_eval_in: int
    n_eval_out: int
    selection: str
    tests: int


def _as_scores(x, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of scores, got shape {arr.shape}")
    if arr.size < 10:
        raise ValueError(f"{name} needs at least 10 scores, got {arr.size}; use ~1e5 trials for a useful bound")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or inf; scores must be finite")
    return arr


def _counts_above(sorted_x: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """Number of entries strictly greater than each threshold."""
    return sorted_x.size - np.searchsorted(sorted_x, taus, side="right")


def _tests(sin: np.ndarray, sout: np.ndarray, taus: np.ndarray):
    """(tail, τ, false positives, false negatives) for both tails at each τ (inputs sorted)."""
    # upper tail: guess in iff x > τ; FP = out > τ, FN = in ≤ τ.
    fp_u = _counts_above(sout, taus)
    fn_u = sin.size - _counts_above(sin, taus)
    # lower tail: guess in iff x < τ; FP = out < τ, FN = in ≥ τ.
    fp_l = np.searchsorted(sout, taus, side="left")
    fn_l = sin.size - np.searchsorted(sin, taus, side="left")
    tails = np.array(["upper"] * taus.size + ["lower"] * taus.size)
    return tails, np.concatenate([taus, taus]), np.concatenate([fp_u, fp_l]), np.concatenate([fn_u, fn_l])


def _candidate_thresholds(pooled_sorted: np.ndarray, max_thresholds: int) -> np.ndarray:
    """Midpoints between consecutive distinct pooled values (a threshold in a gap generalises
    better than one on a data point); above ``max_thresholds``, a quantile grid of them plus
    both extreme ends."""
    values = np.unique(pooled_sorted)
    if values.size < 2:
        return values
    values = 0.5 * (values[:-1] + values[1:])
    if values.size <= max_thresholds:
        return values
    n = values.size
    ends = np.unique(np.concatenate([np.arange(min(64, n)), n - 1 - np.arange(min(64, n))]))
    grid = np.unique(np.round(np.linspace(0, n - 1, max_thresholds - ends.size)).astype(int))
    return values[np.unique(np.concatenate([ends, grid]))]


def _route_bounds(fp, fn, n_in, n_out, delta, level):
    fpr = clopper_pearson_upper(fp, np.full(fp.shape, n_out), level)
    fnr = clopper_pearson_upper(fn, np.full(fn.shape, n_in), level)
    eps = epsilon_from_error_rates(fpr, fnr, delta)
    mu = gdp_mu_from_error_rates(fpr, fnr)
    return fpr, fnr, eps, mu


def _wilson_upper(k: np.ndarray, n: int, level: float) -> np.ndarray:
    """Closed-form (Wilson score) upper bound, used only to *rank* candidate tests
    during selection (fast for 10⁵ candidates; the reported bound is Clopper–Pearson)."""
    z = float(stats.norm.isf(level))
    p = k / n
    centre = p + z * z / (2 * n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return np.minimum(1.0, (centre + half) / (1 + z * z / n))


def epsilon_lower_bounds(
    scores_in,
    scores_out,
    delta: float = DEFAULT_DELTA,
    alpha: float = DEFAULT_ALPHA,
    *,
    thresholds: Optional[Sequence[float]] = None,
    selection_fraction: float = 0.2,
    max_thresholds: int = 100_000,
    seed: int = 0,
) -> EpsilonLowerBounds:
    """ε lower bounds (direct and GDP route) from canary-in / canary-out scores.

    Tests are threshold tests on the score in both tails ("guess *in* iff
    score > τ" and "iff score < τ"), each read in both directions of the DP
    inequality. Two ways to pick the test, both sound:

    * ``thresholds=None`` (default, **held-out selection**): the trials of each
      arm are shuffled (``seed``) and split; on the first ``selection_fraction``
      every candidate threshold (midpoints between consecutive distinct pooled
      scores, at most ``max_thresholds``) and tail is ranked by closed-form
      (Wilson) upper bounds of its error rates — at level α/4 for the direct
      route and (α/4)² for the GDP route, whose flat optimum otherwise lets
      noisy tail thresholds win — the best test *per route* is kept, and its
      error rates are counted on the other, independent part. Only one test
      per route is evaluated, so no Bonferroni factor is paid.
    * ``thresholds`` given (chosen without looking at these scores): all
      trials are used and the confidence level is Bonferroni-corrected over
      the 2·len(thresholds) tests.

    Confidence: each route's FPR̄ and FNR̄ are Clopper–Pearson bounds at α/4
    (divided by the number of tests for Bonferroni), so with probability
    ≥ 1 − α both returned bounds are valid at once.

    Args:
        scores_in: shape ``[n_in]``, scores of outputs with the canary (finite, n ≥ 10).
        scores_out: shape ``[n_out]``, scores without the canary.
        delta: δ in (0, 1) at which ε is bounded.
        alpha: total false-alarm probability in (0, 1).
        thresholds: optional fixed thresholds (see above).
        selection_fraction: share of each arm used to choose the tests, in (0, 1).
        max_thresholds: most candidate thresholds scored during selection.
        seed: shuffling seed for the split (results are deterministic given it).

    Returns:
        :class:`EpsilonLowerBounds`.

    Raises:
        ValueError: non-1-D, non-finite or too few scores; δ, α or
            ``selection_fraction`` outside (0, 1); an empty or non-finite
            ``thresholds``.

    Sources: Kairouz et al. 2015 (Thm. 2.1); Jagielski et al. 2020 (Clopper–
    Pearson auditing); Dong, Roth, Su 2019 (GDP); Nasr et al. 2023 ("Tight
    auditing of DP-SGD", GDP-based ε from one test).
    """
    sin = _as_scores(scores_in, "scores_in")
    sout = _as_scores(scores_out, "scores_out")
    delta = _check_delta(delta)
    alpha = _check_alpha(alpha)
    per_route = alpha / 2.0
    if thresholds is not None:
        taus = np.asarray(thresholds, dtype=float).ravel()
        if taus.size == 0 or not np.all(np.isfinite(taus)):
            raise ValueError("thresholds must be a non-empty list of finite numbers")
        sin_s, sout_s = np.sort(sin), np.sort(sout)
        tails, ts, fp, fn = _tests(sin_s, sout_s, taus)
        level = per_route / 2.0 / ts.size
        fpr, fnr, eps, mu = _route_bounds(fp, fn, sin.size, sout.size, delta, level)
        i, j = int(np.argmax(eps)), int(np.argmax(mu))
        return EpsilonLowerBounds(
            direct=float(eps[i]), gdp=gdp_epsilon(float(mu[j]), delta), mu=float(mu[j]), delta=delta,
            alpha=alpha, direct_test=(str(tails[i]), float(ts[i]), float(fpr[i]), float(fnr[i])),
            gdp_test=(str(tails[j]), float(ts[j]), float(fpr[j]), float(fnr[j])), n_in=sin.size,
            n_out=sout.size, n_eval_in=sin.size, n_eval_out=sout.size, selection="bonferroni",
            tests=int(ts.size))

    frac = float(selection_fraction)
    if not (0.0 < frac < 1.0):
        raise ValueError(f"selection_fraction must be in (0, 1), got {selection_fraction!r}")
    rng = np.random.default_rng(seed)
    pin, pout = rng.permutation(sin), rng.permutation(sout)
    k_in = min(max(1, int(round(frac * sin.size))), sin.size - 1)
    k_out = min(max(1, int(round(frac * sout.size))), sout.size - 1)
    sel_in, ev_in = np.sort(pin[:k_in]), np.sort(pin[k_in:])
    sel_out, ev_out = np.sort(pout[:k_out]), np.sort(pout[k_out:])
    taus = _candidate_thresholds(np.sort(np.concatenate([sel_in, sel_out])), max_thresholds)
    level = per_route / 2.0
    tails, ts, fp, fn = _tests(sel_in, sel_out, taus)
    # Rank candidates roughly as they will be scored (upper bounds of the rates). For the GDP
    # route the ranking level is squared (z ≈ 5 instead of 3.5): μ(τ) is flat around its
    # optimum and its estimate is noisiest in the tails, so the maximum over ~10⁴ correlated
    # candidates otherwise drifts to lucky tail thresholds that evaluate worse (winner's curse).
    # Any rule applied to the selection half alone keeps the evaluated bound valid.
    fpr_sel, fnr_sel = _wilson_upper(fp, sel_out.size, level), _wilson_upper(fn, sel_in.size, level)
    eps_sel = epsilon_from_error_rates(fpr_sel, fnr_sel, delta)
    mu_sel = gdp_mu_from_error_rates(_wilson_upper(fp, sel_out.size, level**2),
                                     _wilson_upper(fn, sel_in.size, level**2))
    picks = {}
    for route, crit in (("direct", eps_sel), ("gdp", mu_sel)):
        i = int(np.argmax(crit))
        t, tau = str(tails[i]), float(ts[i])
        _, _, efp, efn = _tests(ev_in, ev_out, np.array([tau]))
        row = 0 if t == "upper" else 1
        fpr, fnr, eps, mu = _route_bounds(efp[row:row + 1], efn[row:row + 1], ev_in.size, ev_out.size,
                                          delta, level)
        picks[route] = (t, tau, float(fpr[0]), float(fnr[0]), float(eps[0]), float(mu[0]))
    d, g = picks["direct"], picks["gdp"]
    return EpsilonLowerBounds(
        direct=d[4], gdp=gdp_epsilon(g[5], delta), mu=g[5], delta=delta, alpha=alpha,
        direct_test=d[:4], gdp_test=g[:4], n_in=sin.size, n_out=sout.size, n_eval_in=ev_in.size,
        n_eval_out=ev_out.size, selection="holdout", tests=1)


# =========================================================================== privatizer audits
@dataclass
class AuditResult:
    """One mechanism's audit.

    Attributes:
        name: mechanism or method name.
        claimed_epsilon: accountant's one-step ε (PLD) of ``privatizer.step_event()`` at δ.
        claimed_mu: 1/σ_eff when the claimed event is an unsampled (composed)
            Gaussian, else ``None`` (then the GDP route is informational only).
        epsilon_direct, epsilon_gdp, mu_lower: the lower bounds (see :class:`EpsilonLowerBounds`).
        mu_point: point estimate (mean_in − mean_out)/std_out of the scores (diagnostic only).
        verdict: ``"PASS"`` (every applicable lower bound ≤ claim) or ``"LEAK"``.
        trials: total releases (in + out); delta, alpha: as used.
        mode: ``"vectorised"`` (one release carries many trials, exact for the
            plain Privatizer) or ``"loop"`` (one fresh privatizer and one
            release per trial).
        seconds: wall time of the audit.
    """

    name: str
    claimed_epsilon: float
    claimed_mu: Optional[float]
    epsilon_direct: float
    epsilon_gdp: float
    mu_lower: float
    mu_point: float
    verdict: str
    trials: int
    delta: float
    alpha: float
    mode: str
    seconds: float
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = asdict(self)
        for k, v in out.items():
            if isinstance(v, float) and math.isinf(v):
                out[k] = "inf"
        return out


def claimed_one_step(privatizer, delta: float) -> tuple[float, Optional[float]]:
    """The ε a privatizer's accountant claims for one step, and its μ if Gaussian.

    Args:
        privatizer: a :class:`~dpopt.privatizer.Privatizer` (or subclass).
        delta: δ in (0, 1).

    Returns:
        ``(epsilon, mu)``: ε = ``accountant.epsilon(privatizer.step_event(), δ)``
        (PLD); μ = 1/σ_eff when the event is ``PoissonSampled(1, Gaussian)`` or
        ``PoissonSampled(1, Composed(Gaussians))``, else ``None``.

    Raises:
        ValueError: δ outside (0, 1).
    """
    from dp_accounting import dp_event

    from .accounting.accountant import epsilon
    from .accounting.events import collapse_for_pld

    event = privatizer.step_event()
    eps = epsilon(event, _check_delta(delta))
    flat = collapse_for_pld(event)
    mu = None
    if isinstance(flat, dp_event.PoissonSampledDpEvent) and float(flat.sampling_probability) == 1.0:
        flat = flat.event
    if isinstance(flat, dp_event.GaussianDpEvent):
        sigma = float(flat.noise_multiplier)
        mu = math.inf if sigma == 0 else 1.0 / sigma
    return eps, mu


def _vectorisable(privatizer) -> bool:
    """True when one release can carry many independent trials exactly.

    Holds for the plain :class:`Privatizer` without quantile clipping: its only
    cross-example operation is the clipped sum, and its noise is i.i.d. per
    coordinate, so trials embedded in disjoint coordinate blocks are
    independent copies of the one-step mechanism. Not for quantile clipping
    (one scalar count noise per release) or any subclass (it may do anything).
    """
    from .privatizer import Privatizer

    return type(privatizer) is Privatizer and privatizer.quantile is None


@dataclass
class _Setup:
    shapes: list
    groups: list
    bounds: list
    shift: list  # float64 tensors, param-shaped
    scale: list
    canary_w: list  # w-space canary, param-shaped
    delta_w: list  # clipped canary (the sensitivity vector), param-shaped
    sens_sq: float
    background_w: list  # list over examples of lists over params


def _setup(privatizer, shapes, geometry, canary_factor, background_norms, seed):
    import torch

    shapes = [tuple(int(d) for d in s) for s in shapes]
    groups = privatizer.groups if privatizer.groups is not None else [0] * len(shapes)
    if len(groups) != len(shapes):
        raise ValueError(f"the privatizer's groups list has {len(groups)} entries (one per parameter) but "
                         f"{len(shapes)} shapes were given")
    bounds = list(privatizer.bounds)
    gen = torch.Generator().manual_seed(int(seed))
    f64 = torch.float64

    def geo_part(part, default):
        if part is None:
            return [torch.full(s, default, dtype=f64) for s in shapes]
        if len(part) != len(shapes):
            raise ValueError("geometry has one tensor per parameter; got a different count")
        return [torch.as_tensor(t, dtype=f64).detach().clone().expand(s).clone() for t, s in zip(part, shapes)]

    shift = geo_part(geometry.shift if geometry is not None else None, 0.0)
    scale = geo_part(geometry.scale if geometry is not None else None, 1.0)
    if any(not bool((s > 0).all()) for s in scale):
        raise ValueError("geometry scale must be > 0 everywhere")

    def unit_per_group():
        raw = [torch.randn(s, generator=gen, dtype=f64) for s in shapes]
        norms = [0.0] * len(bounds)
        for r, k in zip(raw, groups):
            norms[k] += float(r.pow(2).sum())
        return [r / math.sqrt(norms[k]) for r, k in zip(raw, groups)]

    direction = unit_per_group()
    delta_w = [bounds[k] * d for d, k in zip(direction, groups)]
    canary_w = [canary_factor * x for x in delta_w]
    present = sorted(set(groups))
    sens_sq = sum(bounds[k] ** 2 for k in present)
    background = []
    for factor in background_norms:
        u = unit_per_group()
        background.append([factor * bounds[k] * x for x, k in zip(u, groups)])
    return _Setup(shapes, groups, bounds, shift, scale, canary_w, delta_w, sens_sq, background)


def _to_grad(setup: _Setup, w: list) -> list:
    """Per-sample gradient whose w-space image is ``w``: g = shift + scale ⊙ w."""
    return [s + c * x for s, c, x in zip(setup.shift, setup.scale, w)]


def _score_weights(template) -> tuple[float, float, float]:
    """(gradient weight, count weight, normaliser) of the likelihood-ratio score.

    Gradient projection X (shift 1, std σ_g) and count Y (shift 1, std σ_c):
    the Neyman–Pearson statistic is X/σ_g² + Y/σ_c²; dividing by
    μ² = σ_g⁻² + σ_c⁻² puts the canary shift at 1 and the std at σ_eff.
    """
    sg = float(template.noise_multiplier)
    quant = getattr(template, "quantile", None)
    if sg == 0:
        return 1.0, 0.0, 1.0
    wg = 1.0 / sg**2
    wc = 0.0
    if quant is not None:
        wc = 1.0 / float(quant.count_noise_multiplier) ** 2
    return wg, wc, wg + wc


def canary_scores(
    make_privatizer: Callable[[], Any],
    shapes: Sequence[Sequence[int]],
    n_in: int,
    n_out: int,
    *,
    geometry=None,
    canary_factor: float = 1000.0,
    background_norms: Sequence[float] = (0.5, 2.0, 1.5),
    vectorize: Optional[bool] = None,
    chunk: int = 32,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, str]:
    """Run one privatizer step per trial, canary in or out, and score each release.

    The batch of every trial holds ``len(background_norms)`` fixed background
    examples (random directions, per-group w-space norms ``factor × C_k``;
    the same in every trial) and, in "in" trials, the canary: per group k a
    w-space vector of norm ``canary_factor × C_k`` (so an honest privatizer
    clips it to exactly C_k and it moves the clipped sum by the full
    sensitivity √(Σ_k C_k²); an outlier this large also exposes any bound or
    noise level that reacts to the data). Gradients are g = shift + scale ⊙ w
    in the given ``geometry``.

    Score (normalised so that an honest mechanism gives in − out mean shift 1
    and std σ_eff): X = ⟨B̄·w̃, Δ⟩/‖Δ‖² with w̃ = (g̃ − shift)/scale the released
    gradient in w-space and Δ the clipped canary; with quantile clipping,
    combined with the released count Y = −2·(b̃ − ½)·B̄ (the canary's clipped
    bit moves the centred count by −½) as (X/σ² + Y/σ_c²)/(σ⁻² + σ_c⁻²), the
    Neyman–Pearson statistic of the composed release. σ, σ_c are read from a
    fresh privatizer (its public configuration); the count from the ledger
    entry's ``released_fraction``.

    Args:
        make_privatizer: ``() -> Privatizer``, a fresh privatizer with
            ``sample_rate == 1``; called once (vectorised mode) or once per
            trial (loop mode, so adaptive state never carries over).
        shapes: parameter shapes (one per parameter of the privatizer's groups).
        n_in, n_out: numbers of trials with and without the canary (≥ 1).
        geometry: a :class:`~dpopt.transforms.base.ClipGeometry` or ``None``.
        canary_factor: canary w-space norm in units of C_k (≥ 1).
        background_norms: background examples' norms in units of C_k.
        vectorize: ``None`` = automatic (vectorised exactly when the
            privatizer is a plain ``Privatizer`` without quantile clipping).
            Forcing ``True`` on another privatizer is refused.
        chunk: trials per release in vectorised mode (memory ∝ chunk²).
        seed: seeds the canary/background directions and the noise.

    Returns:
        ``(scores_in [n_in], scores_out [n_out], mode)``.

    Raises:
        ValueError: q ≠ 1, bad counts/shapes/geometry, ``canary_factor < 1``,
            or ``vectorize=True`` for a privatizer that cannot be vectorised.
    """
    import torch

    if int(n_in) < 1 or int(n_out) < 1:
        raise ValueError(f"need at least one trial per arm, got n_in={n_in}, n_out={n_out}")
    if not float(canary_factor) >= 1.0:
        raise ValueError(f"canary_factor must be >= 1 (the canary must reach the clip bound), got {canary_factor}")
    template = make_privatizer()
    if float(template.sample_rate) != 1.0:
        raise ValueError(
            f"audits run the unsampled mechanism: build the privatizer with sample_rate=1.0 (got "
            f"{template.sample_rate}); the claimed ε is then that of the q = 1 step event")
    can_vec = _vectorisable(template)
    if vectorize and not can_vec:
        raise ValueError("vectorize=True needs a plain Privatizer without quantile clipping "
                         "(trials embedded in one release must be independent)")
    vec = can_vec if vectorize is None else bool(vectorize)
    setup = _setup(template, shapes, geometry, float(canary_factor), background_norms, seed)
    bbar = float(template.expected_batch_size)
    wg, wc, norm = _score_weights(template)
    bg_grads = [_to_grad(setup, w) for w in setup.background_w]
    canary_grad = _to_grad(setup, setup.canary_w)
    dvec = [d / setup.sens_sq for d in setup.delta_w]  # so that ⟨Δ, dvec⟩ = 1

    def project(grads, lead):
        """⟨B̄ w̃, Δ⟩/‖Δ‖² for released grads with ``lead`` leading dims."""
        total = 0.0
        for g, s, c, d in zip(grads, setup.shift, setup.scale, dvec):
            w = (g.to(torch.float64) - s) / c * bbar
            total = total + (w * d).reshape(*w.shape[:lead], -1).sum(-1)
        return total

    threads = torch.get_num_threads()
    # The tensors are tiny: one intra-op thread avoids thread hand-off costs that
    # dominate (10-20x) on a busy 2-core machine. Restored on exit.
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed) + 1)
            scores, mode = _run_trials(vec, make_privatizer, template, setup, bg_grads, canary_grad,
                                       int(n_in), int(n_out), int(chunk), project, wg, wc, norm, bbar)
    finally:
        torch.set_num_threads(threads)
    return scores[0], scores[1], mode


def _run_trials(vec, make_privatizer, template, setup, bg_grads, canary_grad, n_in, n_out, chunk, project,
                wg, wc, norm, bbar):
    if vec:
        return _vectorised_scores(template, setup, bg_grads, canary_grad, n_in, n_out, chunk,
                                  project), "vectorised"
    return _loop_scores(make_privatizer, setup, bg_grads, canary_grad, n_in, n_out, project,
                        wg, wc, norm, bbar), "loop"


class _RepeatedBatch:
    """The same private batch, asked the same questions in every loop-mode trial.

    Wraps a :class:`~dpopt.per_sample.PerSampleGrads` and memoises its two
    answers (``sq_norms`` per geometry/groups, ``weighted_sum`` per identical
    weights): the batch never changes between trials, so the privatizer
    receives exactly the values PerSampleGrads computes, at a fraction of the
    cost. Returned tensors are fresh clones.
    """

    def __init__(self, inner):
        self.inner = inner
        self.num_params = inner.num_params
        self.nonfinite = inner.nonfinite
        self._norms: dict = {}
        self._sums: list = []

    def sq_norms(self, geometry, groups, num_groups):
        key = (id(geometry), tuple(groups), int(num_groups))
        if key not in self._norms:
            self._norms[key] = (geometry, self.inner.sq_norms(geometry, groups, num_groups))
        return self._norms[key][1].clone()

    def weighted_sum(self, weights, geometry, groups):
        for geo, grp, w, out in self._sums:
            if geo is geometry and grp == tuple(groups) and w.shape == weights.shape and _torch_equal(w, weights):
                return [t.clone() for t in out]
        out = self.inner.weighted_sum(weights, geometry, groups)
        self._sums.append((geometry, tuple(groups), weights.clone(), out))
        if len(self._sums) > 64:  # weights that change every trial: keep memory bounded
            self._sums.pop(0)
        return [t.clone() for t in out]


def _torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def _stack_examples(grads_per_example: list, num_params: int):
    import torch

    return [torch.stack([ex[i] for ex in grads_per_example]) for i in range(num_params)]


def _vectorised_scores(priv, setup, bg_grads, canary_grad, n_in, n_out, chunk, project):
    """Many trials per release: trial t owns row t of every parameter ([T, *shape]).

    Example j of trial t has gradient ``shift`` everywhere except row t (its
    w-space image is zero outside row t), so its per-group norms, clip factors
    and contribution to the sum are exactly those of a one-trial batch; the
    noise on row t is i.i.d. N(0, (σS)²) as in a one-trial release. Chunks are
    all-in or all-out, so out-trials have no canary row at all (true add/remove).
    """
    import torch

    from .per_sample import PerSampleGrads
    from .transforms.base import ClipGeometry

    chunk = max(1, min(chunk, max(n_in, n_out)))

    def embedded(examples, t):
        n_s = len(examples)
        rows = torch.arange(t)
        tensors = []
        for i, shape in enumerate(setup.shapes):
            e = setup.shift[i].expand(n_s * t, t, *shape).clone()
            for j, ex in enumerate(examples):
                e[rows * n_s + j, rows] = ex[i]
            tensors.append(e)
        return PerSampleGrads(tensors)

    geometry = ClipGeometry(tuple(s.expand(chunk, *s.shape) for s in setup.shift),
                            tuple(c.expand(chunk, *c.shape) for c in setup.scale))
    out = []
    for n, examples in ((n_in, bg_grads + [canary_grad]), (n_out, list(bg_grads))):
        src = embedded(examples, chunk)
        scores = []
        done = 0
        while done < n:
            release = priv.privatize(src, geometry)
            scores.append(project(release.grads, 1))
            done += chunk
        out.append(torch.cat(scores)[:n].numpy().copy())
    return out


def _loop_scores(make_privatizer, setup, bg_grads, canary_grad, n_in, n_out, project, wg, wc, norm, bbar):
    """One fresh privatizer and one release per trial (any privatizer, any adaptivity)."""
    import torch

    from .per_sample import PerSampleGrads
    from .transforms.base import ClipGeometry

    geometry = ClipGeometry(tuple(setup.shift), tuple(setup.scale))
    num = len(setup.shapes)
    src_in = _RepeatedBatch(PerSampleGrads(_stack_examples(bg_grads + [canary_grad], num)))
    src_out = _RepeatedBatch(PerSampleGrads(_stack_examples(bg_grads, num))) if bg_grads else None
    zeros = [torch.zeros(s, dtype=torch.float64) for s in setup.shapes]
    out = []
    for n, src in ((n_in, src_in), (n_out, src_out)):
        buf = [torch.empty(n, *s, dtype=torch.float64) for s in setup.shapes]
        counts = np.zeros(n)
        for t in range(n):
            priv = make_privatizer()
            if src is None:
                release = priv.privatize([], geometry, params_like=zeros)
            else:
                release = priv.privatize(src, geometry)
            for b, g in zip(buf, release.grads):
                b[t] = g
            if wc:
                frac = priv.ledger.entries[-1].meta.get("released_fraction")
                if frac is None:
                    raise ValueError("quantile privatizer recorded no released_fraction; cannot score the count")
                counts[t] = -2.0 * (float(frac) - 0.5) * bbar
        x = project(buf, 1).numpy()
        out.append((wg * x + wc * counts) / norm)
    return out


def audit_privatizer(
    make_privatizer: Callable[[], Any],
    shapes: Sequence[Sequence[int]],
    *,
    name: str = "privatizer",
    geometry=None,
    trials: int = DEFAULT_TRIALS,
    delta: float = DEFAULT_DELTA,
    alpha: float = DEFAULT_ALPHA,
    canary_factor: float = 1000.0,
    background_norms: Sequence[float] = (0.5, 2.0, 1.5),
    vectorize: Optional[bool] = None,
    seed: int = 0,
) -> AuditResult:
    """One-step empirical audit of a privatizer against its accountant's claim.

    Runs :func:`canary_scores` with ``trials // 2`` canary-in and the rest
    canary-out trials, computes :func:`epsilon_lower_bounds` (held-out
    selection), and compares with :func:`claimed_one_step`:

    * LEAK if the direct bound exceeds the claimed ε (sound for every mechanism);
    * LEAK if the claim is an unsampled (composed) Gaussian with parameter
      μ_claim and the GDP route's μ_lower exceeds μ_claim (for such a claim
      μ_lower ≤ μ_claim holds with probability ≥ 1 − α/2). Compared in μ, not
      in ε, so that the PLD discretisation of the claimed ε cannot cause a
      false alarm; since ε(μ) is increasing this is "GDP-route ε > claimed ε";
    * PASS otherwise. An honest mechanism is reported LEAK with probability ≤ α.

    Args:
        make_privatizer: ``() -> Privatizer`` with ``sample_rate == 1`` (see :func:`canary_scores`).
        shapes: parameter shapes.
        name: label for the result.
        geometry: clip geometry (``None``: identity).
        trials: total releases, ≥ 40 (10⁵ for the CLI default).
        delta: δ in (0, 1); alpha: false-alarm probability in (0, 1).
        canary_factor, background_norms, vectorize, seed: see :func:`canary_scores`.

    Returns:
        :class:`AuditResult`.

    Raises:
        ValueError: as :func:`canary_scores` and :func:`epsilon_lower_bounds`,
            or ``trials < 40``.
    """
    delta = _check_delta(delta)
    alpha = _check_alpha(alpha)
    trials = int(trials)
    if trials < 40:
        raise ValueError(f"trials must be >= 40 (10 per arm and half), got {trials}; use ~1e5")
    start = time.perf_counter()
    template = make_privatizer()
    claimed, claimed_mu = claimed_one_step(template, delta)
    n_in = trials // 2
    s_in, s_out, mode = canary_scores(make_privatizer, shapes, n_in, trials - n_in, geometry=geometry,
                                      canary_factor=canary_factor, background_norms=background_norms,
                                      vectorize=vectorize, seed=seed)
    bounds = epsilon_lower_bounds(s_in, s_out, delta, alpha, seed=seed)
    leak = bounds.direct > claimed or (claimed_mu is not None and bounds.mu > claimed_mu)
    sd = float(np.std(s_out))
    mu_point = float((np.mean(s_in) - np.mean(s_out)) / sd) if sd > 0 else math.inf
    return AuditResult(
        name=name, claimed_epsilon=claimed, claimed_mu=claimed_mu, epsilon_direct=bounds.direct,
        epsilon_gdp=bounds.gdp, mu_lower=bounds.mu, mu_point=mu_point, verdict="LEAK" if leak else "PASS",
        trials=trials, delta=delta, alpha=alpha, mode=mode, seconds=time.perf_counter() - start,
        details={"direct_test": list(bounds.direct_test), "gdp_test": list(bounds.gdp_test),
                 "n_eval_in": bounds.n_eval_in, "n_eval_out": bounds.n_eval_out,
                 "score_mean_in": float(np.mean(s_in)), "score_mean_out": float(np.mean(s_out)),
                 "score_std_in": float(np.std(s_in)), "score_std_out": sd})


# --------------------------------------------------------------------------- built-in mechanisms
def _builtin_spec(name: str, seed: int):
    """(make_privatizer, shapes, geometry) of a built-in mechanism (all q = 1)."""
    import torch

    from .privatizer import Privatizer, QuantileClipping
    from .transforms.base import ClipGeometry

    gen = torch.Generator().manual_seed(int(seed) + 7)
    if name == "flat":
        return (lambda: Privatizer(1.0, 1.0, 8.0, 1.0, generator=gen)), [(2, 3), (2,)], None
    if name == "shift-scale":
        shapes = [(2, 3), (2,)]
        g = torch.Generator().manual_seed(int(seed) + 11)
        shift = tuple(0.1 * torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
        scale = tuple(0.05 + 0.3 * torch.rand(s, generator=g, dtype=torch.float64) for s in shapes)
        return (lambda: Privatizer(1.0, 1.0, 8.0, 1.0, generator=gen)), shapes, ClipGeometry(shift, scale)
    if name == "per-layer":
        return ((lambda: Privatizer(1.0, [1.0, 2.0, 2.0], 8.0, 1.0, groups=[0, 1, 2], generator=gen)),
                [(2, 2), (3,), (2,)], None)
    if name == "quantile":
        # σ_grad 1.2 and count multiplier 2 compose to σ_eff ≈ 1.03; B̄ = 50 keeps the
        # released fraction away from its clamp to [0, 1].
        return ((lambda: Privatizer(1.2, 1.0, 50.0, 1.0, quantile=QuantileClipping(2.0), generator=gen)),
                [(2, 3), (2,)], None)
    raise ValueError(f"unknown built-in mechanism {name!r}; choose one of {', '.join(BUILTIN_MECHANISMS)}")


BUILTIN_MECHANISMS = ("flat", "shift-scale", "per-layer", "quantile")
"""Privatizer configurations audited by ``dpopt audit``:

* ``flat`` — DP-SGD family: one L2 bound C = 1, σ = 1;
* ``shift-scale`` — AdaClip / DP-MacAdam geometry: unit bound in w = (g − m)/b space;
* ``per-layer`` — per-group bounds (1, 2, 2), noise σ·√(Σ C_k²) = 3σ;
* ``quantile`` — quantile clipping: gradient Gaussian (σ = 1.2) and clipped-count
  Gaussian (multiplier 2) on the same batch, audited as one composed release.
"""


def audit_mechanism(name: str, *, trials: int = DEFAULT_TRIALS, delta: float = DEFAULT_DELTA,
                    alpha: float = DEFAULT_ALPHA, seed: int = 0) -> AuditResult:
    """Audit one of :data:`BUILTIN_MECHANISMS` (see :func:`audit_privatizer`).

    Raises:
        ValueError: unknown name (the message lists the built-ins), or invalid δ/α/trials.
    """
    make, shapes, geometry = _builtin_spec(name, seed)
    return audit_privatizer(make, shapes, name=name, geometry=geometry, trials=trials, delta=delta,
                            alpha=alpha, seed=seed)


# --------------------------------------------------------------------------- registered methods
def registered_methods() -> list[str]:
    """Names of the methods in :mod:`dpopt.methods`.

    Raises:
        ImportError: when the method registry cannot be imported.
    """
    from . import methods

    return [spec.name for spec in methods.list_methods()]


def _method_params(dtype):
    import torch

    # A 2-D weight (Muon-type methods route matrices specially) and a bias.
    return [torch.nn.Parameter(torch.zeros(3, 4, dtype=dtype)), torch.nn.Parameter(torch.zeros(4, dtype=dtype))]


def audit_method(
    name: str,
    *,
    trials: int = DEFAULT_TRIALS,
    delta: float = DEFAULT_DELTA,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    noise_multiplier: float = 1.0,
    expected_batch_size: float = 8.0,
    warmup_steps: int = 3,
    **options: Any,
) -> AuditResult:
    """Audit the privatizer of a registered method, in the geometry it would use next.

    Builds ``dpopt.methods.make_optimizer(name, params, noise_multiplier=σ,
    expected_batch_size=B̄, sample_rate=1.0, **options)`` on a tiny model (a
    3×4 weight and a bias), takes ``warmup_steps`` optimizer steps on random
    (public, synthetic) per-sample gradients so that adaptive geometries
    (AdaClip, DP-MacAdam) move away from their initial value, then audits one
    step of ``optimizer.privatizer`` in ``optimizer.geometry()`` with a canary
    of w-space norm ≫ C (see :func:`audit_privatizer`). Privatizers that cannot
    be vectorised (quantile clipping) are audited in loop mode with a freshly
    built optimizer per trial (slow).

    Args:
        name: a registered method name (see :func:`registered_methods`).
        trials, delta, alpha, seed: see :func:`audit_privatizer`.
        noise_multiplier, expected_batch_size: privacy settings of the audited step.
        warmup_steps: optimizer steps before the audited one (≥ 0).
        **options: passed to ``make_optimizer`` (e.g. ``max_grad_norm``, ``quantile``).

    Returns:
        :class:`AuditResult` named after the method.

    Raises:
        ImportError: if :mod:`dpopt.methods` does not import.
        ValueError: unknown method / options (from the registry), or as :func:`audit_privatizer`.
    """
    import torch

    from . import methods
    from .per_sample import PerSampleGrads

    if int(warmup_steps) < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")

    def build():
        params = _method_params(torch.float64)
        opt = methods.make_optimizer(name, params, noise_multiplier=noise_multiplier,
                                     expected_batch_size=expected_batch_size, sample_rate=1.0, **options)
        return opt, params

    opt, params = build()
    gen = torch.Generator().manual_seed(int(seed) + 3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed) + 5)
        for _ in range(int(warmup_steps)):
            grads = [0.5 + torch.randn(6, *p.shape, generator=gen, dtype=p.dtype) for p in params]
            opt.step(PerSampleGrads(grads))
    geometry = opt.geometry()
    priv = opt.privatizer
    shapes = [tuple(p.shape) for p in params]
    if _vectorisable(priv):
        make = lambda: priv  # noqa: E731 - vectorised mode builds it once
    else:
        make = lambda: build()[0].privatizer  # noqa: E731 - fresh optimizer per trial
    return audit_privatizer(make, shapes, name=name, geometry=geometry, trials=trials, delta=delta,
                            alpha=alpha, seed=seed)


def mechanism_seed(seed: int, name: str) -> int:
    """A per-mechanism seed (stable across runs) so that audits of different
    mechanisms use independent noise and splits: their false alarms are then
    independent events, each of probability ≤ α."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**31 - 1)


def audit_all(*, trials: int = DEFAULT_TRIALS, delta: float = DEFAULT_DELTA, alpha: float = DEFAULT_ALPHA,
              seed: int = 0, methods: bool = True) -> tuple[list[AuditResult], Optional[str]]:
    """Audit every built-in mechanism and (if importable) every registered method.

    Returns:
        ``(results, note)``; ``note`` says why methods were skipped, else ``None``.
    """
    results = [audit_mechanism(n, trials=trials, delta=delta, alpha=alpha, seed=mechanism_seed(seed, n))
               for n in BUILTIN_MECHANISMS]
    note = None
    if methods:
        try:
            names = registered_methods()
        except ImportError as exc:  # the registry is optional for the auditor
            names, note = [], f"method registry not importable ({exc}); audited built-in mechanisms only"
        results += [audit_method(n, trials=trials, delta=delta, alpha=alpha, seed=mechanism_seed(seed, n))
                    for n in names]
    return results, note
