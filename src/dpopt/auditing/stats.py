"""Statistics of the auditor: ε lower bounds from canary scores (numpy/scipy only).

Given scores of a mechanism's output on neighbouring inputs — ``scores_in``
(canary present) and ``scores_out`` (canary absent) — :func:`epsilon_lower_bounds`
returns two lower bounds on the ε of any (ε, δ)-DP guarantee the mechanism
can have:

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
  several composed — exactly what :func:`dpopt.auditing.audit_privatizer`
  runs). It is far tighter than the direct route at δ = 1e-5.

False alarms: each route's two Clopper–Pearson bounds are taken at α/4, so
with probability ≥ 1 − α both reported lower bounds hold simultaneously.

This module imports neither torch nor any other part of dpopt (a test checks
it), so the bounds can be computed from scores produced anywhere.

Example::

    >>> import numpy as np
    >>> from dpopt.auditing.stats import epsilon_lower_bounds, gdp_epsilon
    >>> rng = np.random.default_rng(0)
    >>> b = epsilon_lower_bounds(rng.normal(1, 1, 50_000), rng.normal(0, 1, 50_000), delta=1e-5)
    >>> 0.9 * gdp_epsilon(1.0, 1e-5) < b.gdp < gdp_epsilon(1.0, 1e-5)   # true ε ≈ 4.377
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np
from scipy import optimize, stats

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_DELTA",
    "clopper_pearson_upper",
    "gdp_delta",
    "gdp_epsilon",
    "epsilon_from_error_rates",
    "gdp_mu_from_error_rates",
    "ThresholdTest",
    "EpsilonLowerBounds",
    "epsilon_lower_bounds",
]

DEFAULT_ALPHA = 1e-3
DEFAULT_DELTA = 1e-5

# Loosest level of the Wilson ranking used in held-out selection: the fallback when every
# candidate scores 0 at the stricter levels (small trial counts). See epsilon_lower_bounds.
_LOOSEST_RANK_LEVEL = 0.05
# Most candidate thresholds kept at each extreme of the pooled scores (the rest is a quantile grid).
_MAX_EXTREME_THRESHOLDS = 64


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


class ThresholdTest(NamedTuple):
    """One threshold test and its error-rate upper bounds (a tuple, so it unpacks and serialises as one).

    Attributes:
        tail: ``"upper"`` (guess *in* iff score > threshold) or ``"lower"`` (iff score < threshold).
        threshold: τ, in score units.
        fpr_ub, fnr_ub: Clopper–Pearson upper bounds of its false-positive and
            false-negative rates, on the trials the bound was computed from.
    """

    tail: str
    threshold: float
    fpr_ub: float
    fnr_ub: float


@dataclass(frozen=True)
class EpsilonLowerBounds:
    """Result of :func:`epsilon_lower_bounds`.

    Attributes:
        direct: ε lower bound from the Clopper–Pearson route.
        gdp: ε at δ implied by ``mu`` (Gaussian trade-off assumed, see module doc).
        mu: lower bound on the GDP parameter μ (sound for any mechanism).
        delta, alpha: the δ and total false-alarm probability used.
        direct_test, gdp_test: the chosen :class:`ThresholdTest` of each route.
        n_in, n_out: trials per arm; n_eval_in, n_eval_out: those used for the bound.
        selection: ``"holdout"`` or ``"bonferroni"``; tests: number of tests
            the Bonferroni correction covers per route.
        direct_rank_level, gdp_rank_level: held-out selection only (else
            ``None``): the level of the Wilson ranking that chose each route's
            test — α/4 (direct) and (α/4)² (GDP) normally, a looser level when
            every candidate scored 0 at the stricter ones.
    """

    direct: float
    gdp: float
    mu: float
    delta: float
    alpha: float
    direct_test: ThresholdTest
    gdp_test: ThresholdTest
    n_in: int
    n_out: int
    n_eval_in: int
    n_eval_out: int
    selection: str
    tests: int
    direct_rank_level: Optional[float] = None
    gdp_rank_level: Optional[float] = None


class _TestTable(NamedTuple):
    """Threshold tests in both tails: arrays of one length (2 × number of thresholds)."""

    tails: np.ndarray  # "upper" / "lower"
    thresholds: np.ndarray
    false_positives: np.ndarray  # counts on the out-arm
    false_negatives: np.ndarray  # counts on the in-arm


class _RouteBounds(NamedTuple):
    """Clopper–Pearson rate bounds of tests and the two routes' bounds they imply (arrays)."""

    fpr: np.ndarray
    fnr: np.ndarray
    epsilon: np.ndarray
    mu: np.ndarray


class _Pick(NamedTuple):
    """One route's held-out choice, evaluated on the evaluation part."""

    test: ThresholdTest
    epsilon: float
    mu: float
    rank_level: float


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


def _tests(sin: np.ndarray, sout: np.ndarray, taus: np.ndarray) -> _TestTable:
    """Both tails' tests at each threshold τ, with their error counts (``sin``, ``sout`` sorted)."""
    # upper tail: guess in iff x > τ; FP = out > τ, FN = in ≤ τ.
    fp_u = _counts_above(sout, taus)
    fn_u = sin.size - _counts_above(sin, taus)
    # lower tail: guess in iff x < τ; FP = out < τ, FN = in ≥ τ.
    fp_l = np.searchsorted(sout, taus, side="left")
    fn_l = sin.size - np.searchsorted(sin, taus, side="left")
    tails = np.array(["upper"] * taus.size + ["lower"] * taus.size)
    return _TestTable(tails, np.concatenate([taus, taus]), np.concatenate([fp_u, fp_l]), np.concatenate([fn_u, fn_l]))


def _check_max_thresholds(max_thresholds) -> int:
    value = int(max_thresholds)
    if value != max_thresholds or value < 1:
        raise ValueError(
            f"max_thresholds must be a positive integer (the most candidate thresholds ranked "
            f"during selection), got {max_thresholds!r}; e.g. 100000"
        )
    return value


def _candidate_thresholds(pooled_sorted: np.ndarray, max_thresholds: int) -> np.ndarray:
    """Candidate thresholds: midpoints between consecutive distinct pooled values (a
    threshold in a gap generalises better than one on a data point).

    Above ``max_thresholds`` (m ≥ 1) midpoints, keeps the min(64, ⌊m/4⌋) most extreme
    at each end (where the tests of large ε live) and a quantile grid of the rest,
    which always includes both ends; at most m in all.
    """
    values = np.unique(pooled_sorted)
    if values.size < 2:
        return values
    values = 0.5 * (values[:-1] + values[1:])
    if values.size <= max_thresholds:
        return values
    n = values.size
    per_end = min(_MAX_EXTREME_THRESHOLDS, max_thresholds // 4)  # ≤ m/4: leaves ≥ m/2 for the grid
    ends = np.unique(np.concatenate([np.arange(per_end), n - 1 - np.arange(per_end)])).astype(int)
    grid = np.unique(np.round(np.linspace(0, n - 1, max_thresholds - ends.size)).astype(int))
    return values[np.unique(np.concatenate([ends, grid]))]


def _route_bounds(fp, fn, n_in, n_out, delta, level) -> _RouteBounds:
    fpr = clopper_pearson_upper(fp, np.full(fp.shape, n_out), level)
    fnr = clopper_pearson_upper(fn, np.full(fn.shape, n_in), level)
    return _RouteBounds(fpr, fnr, epsilon_from_error_rates(fpr, fnr, delta), gdp_mu_from_error_rates(fpr, fnr))


def _wilson_upper(k: np.ndarray, n: int, level: float) -> np.ndarray:
    """Closed-form (Wilson score) upper bound, used only to *rank* candidate tests
    during selection (fast for 10⁵ candidates; the reported bound is Clopper–Pearson)."""
    z = float(stats.norm.isf(level))
    p = k / n
    centre = p + z * z / (2 * n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return np.minimum(1.0, (centre + half) / (1 + z * z / n))


def _rank(
    table: _TestTable, n_in: int, n_out: int, route: str, levels: Sequence[float], delta: float
) -> tuple[int, float]:
    """Index of the best candidate test of ``route`` and the ranking level that chose it.

    Ranks by the route's criterion (ε or μ) computed from Wilson upper bounds of
    the error rates at the first of ``levels`` (strictest first) at which some
    candidate scores > 0. Without the fallback, a too strict level for the
    trial count scores every candidate 0 and ``argmax`` returns the first
    (extreme) threshold, whose held-out bound is 0 however large the true ε.
    """
    for level in levels:
        fpr = _wilson_upper(table.false_positives, n_out, level)
        fnr = _wilson_upper(table.false_negatives, n_in, level)
        crit = epsilon_from_error_rates(fpr, fnr, delta) if route == "direct" else gdp_mu_from_error_rates(fpr, fnr)
        i = int(np.argmax(crit))
        if crit[i] > 0:
            break
    return i, float(level)


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
      per route is evaluated, so no Bonferroni factor is paid. When every
      candidate scores 0 at a route's ranking level (few trials: at 1,000
      scores per arm the (α/4)² ranking of N(1, 1) vs N(0, 1) does), the
      ranking falls back to α/4 and then to 0.05 (GDP), or to 0.05 (direct),
      instead of taking the first threshold. The selection only ever sees the
      selection part, so the evaluated bounds stay valid at α whatever rule
      chooses the test.
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
        max_thresholds: most candidate thresholds scored during selection
            (a positive integer; up to ⌊m/4⌋, at most 64, are kept at each
            extreme and the rest spread as a quantile grid).
        seed: shuffling seed for the split (results are deterministic given it).

    Returns:
        :class:`EpsilonLowerBounds`.

    Raises:
        ValueError: non-1-D, non-finite or too few scores; δ, α or
            ``selection_fraction`` outside (0, 1); ``max_thresholds`` not a
            positive integer; an empty or non-finite ``thresholds``.

    Sources: Kairouz et al. 2015 (Thm. 2.1); Jagielski et al. 2020 (Clopper–
    Pearson auditing); Dong, Roth, Su 2019 (GDP); Nasr et al. 2023 ("Tight
    auditing of DP-SGD", GDP-based ε from one test).
    """
    sin = _as_scores(scores_in, "scores_in")
    sout = _as_scores(scores_out, "scores_out")
    delta = _check_delta(delta)
    alpha = _check_alpha(alpha)
    max_thresholds = _check_max_thresholds(max_thresholds)
    per_route = alpha / 2.0
    if thresholds is not None:
        taus = np.asarray(thresholds, dtype=float).ravel()
        if taus.size == 0 or not np.all(np.isfinite(taus)):
            raise ValueError("thresholds must be a non-empty list of finite numbers")
        table = _tests(np.sort(sin), np.sort(sout), taus)
        level = per_route / 2.0 / table.thresholds.size
        b = _route_bounds(table.false_positives, table.false_negatives, sin.size, sout.size, delta, level)

        def chosen(i: int) -> ThresholdTest:
            return ThresholdTest(str(table.tails[i]), float(table.thresholds[i]), float(b.fpr[i]), float(b.fnr[i]))

        i, j = int(np.argmax(b.epsilon)), int(np.argmax(b.mu))
        return EpsilonLowerBounds(
            direct=float(b.epsilon[i]),
            gdp=gdp_epsilon(float(b.mu[j]), delta),
            mu=float(b.mu[j]),
            delta=delta,
            alpha=alpha,
            direct_test=chosen(i),
            gdp_test=chosen(j),
            n_in=sin.size,
            n_out=sout.size,
            n_eval_in=sin.size,
            n_eval_out=sout.size,
            selection="bonferroni",
            tests=int(table.thresholds.size),
        )

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
    table = _tests(sel_in, sel_out, taus)
    # Rank candidates roughly as they will be scored (upper bounds of the rates). For the GDP
    # route the ranking level is squared (z ≈ 5 instead of 3.5): μ(τ) is flat around its
    # optimum and its estimate is noisiest in the tails, so the maximum over ~10⁴ correlated
    # candidates otherwise drifts to lucky tail thresholds that evaluate worse (winner's curse).
    # With few trials a strict level scores every candidate 0; _rank then loosens it.
    # Any rule applied to the selection part alone keeps the evaluated bound valid.
    ranking = {"direct": (level, _LOOSEST_RANK_LEVEL), "gdp": (level**2, level, _LOOSEST_RANK_LEVEL)}
    picks: dict[str, _Pick] = {}
    for route, levels in ranking.items():
        i, rank_level = _rank(table, sel_in.size, sel_out.size, route, levels, delta)
        tail, tau = str(table.tails[i]), float(table.thresholds[i])
        ev = _tests(ev_in, ev_out, np.array([tau]))
        row = 0 if tail == "upper" else 1
        b = _route_bounds(
            ev.false_positives[row : row + 1], ev.false_negatives[row : row + 1], ev_in.size, ev_out.size, delta, level
        )
        picks[route] = _Pick(
            ThresholdTest(tail, tau, float(b.fpr[0]), float(b.fnr[0])), float(b.epsilon[0]), float(b.mu[0]), rank_level
        )
    d, g = picks["direct"], picks["gdp"]
    return EpsilonLowerBounds(
        direct=d.epsilon,
        gdp=gdp_epsilon(g.mu, delta),
        mu=g.mu,
        delta=delta,
        alpha=alpha,
        direct_test=d.test,
        gdp_test=g.test,
        n_in=sin.size,
        n_out=sout.size,
        n_eval_in=ev_in.size,
        n_eval_out=ev_out.size,
        selection="holdout",
        tests=1,
        direct_rank_level=d.rank_level,
        gdp_rank_level=g.rank_level,
    )
