"""One-run audit statistics: ε lower bounds from k membership guesses over m canaries (numpy/scipy only).

Setting (Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1)
training run", arXiv 2305.08846): m canaries, each included in the training
set independently with probability ½; one training run; the auditor scores
every canary and guesses "in" for the k canaries it is surest of (it abstains
on the rest); c of the k guesses are correct. Two estimators turn (m, k, c)
into a lower bound at confidence 1 − β:

* **Steinke et al. (ε, δ)** — :func:`steinke_p_value`, :func:`steinke_epsilon`.
  For an (ε, δ)-DP training run the number W of correct guesses satisfies
  (their Thm. 3.1 / Prop. 5.2 with δ > 0) P[W ≥ c] ≤ P[Bin(k, p) ≥ c] +
  2mδ · max_{1≤i≤c} P[c − i ≤ Bin(k, p) < c] / i, with p = e^ε/(1 + e^ε).
  The bound is the largest ε whose p-value is ≤ β. Sound for any (ε, δ)-DP
  mechanism.
* **f-DP (Mahloujifar, Melis & Chaudhuri 2024, "Auditing f-differential
  privacy in one run", arXiv 2410.22235)** — :func:`fdp_slack`,
  :func:`fdp_mu`, :func:`fdp_epsilon`. For an f-DP run, the probability of c
  correct among k guesses is bounded through a recursion on the trade-off
  curve (their Thm. 9 / Alg. 3 "with cap"); here f = G_μ, the Gaussian
  trade-off, whose inverse blow-up is x ↦ Φ(Φ⁻¹(x) − μ). The bound is the
  largest μ whose claim the guesses refute at level β, reported also as the ε
  at δ of a μ-GDP mechanism (Dong, Roth & Su 2019, Cor. 2.13). It is a lower
  bound on ε(δ) for runs whose trade-off curve is Gaussian (full-batch
  DP-SGD: T composed Gaussians) and much tighter than Steinke's at large ε.

**Choosing the guesses on the same scores.** A bound computed for the one k
that looks best on these very scores is optimistic. :func:`one_run_bounds`
tries every k in a grid fixed from m alone before the scores are seen
(:func:`default_guess_counts`, or ``guess_counts=``), or every threshold on the
pooled scores (``guess_counts="all"``), and divides β by the number of tries
(Bonferroni), so the reported maximum holds at confidence 1 − β.

This module imports neither torch nor the rest of dpopt.

Example::

    >>> import numpy as np
    >>> from dpopt.auditing.one_run_stats import one_run_bounds
    >>> rng = np.random.default_rng(0)
    >>> inc = rng.random(1000) < 0.5
    >>> scores = rng.normal(0, 1, 1000) + 4.0 * inc          # mu = 4: eps(1e-5) = 16.6
    >>> b = one_run_bounds(scores[inc], scores[~inc], delta=1e-5, beta=0.05)
    >>> 0 < b.steinke < b.fdp < 16.6
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence, Union

import numpy as np
from scipy import optimize, special, stats

from .stats import gdp_epsilon

__all__ = [
    "steinke_p_value",
    "steinke_epsilon",
    "fdp_slack",
    "fdp_mu",
    "fdp_epsilon",
    "default_guess_counts",
    "OneRunBound",
    "one_run_bounds",
]

_STD = NormalDist()


def _check_counts(m: int, guesses: int, correct: int) -> tuple[int, int, int]:
    m, k, c = int(m), int(guesses), int(correct)
    if not (m >= 1 and 0 <= c <= k <= m):
        raise ValueError(f"need 0 <= correct <= guesses <= m and m >= 1, got m={m}, guesses={k}, correct={c}")
    return m, k, c


def _check_level(beta: float, name: str = "beta") -> float:
    value = float(beta)
    if not (0.0 < value < 1.0):
        raise ValueError(f"{name} must be in (0, 1) (1 - confidence), got {beta!r}; e.g. 0.05")
    return value


def _check_delta(delta: float) -> float:
    value = float(delta)
    if not (0.0 <= value < 1.0):
        raise ValueError(f"delta must be in [0, 1), got {delta!r}; e.g. 1e-5")
    return value


# --------------------------------------------------------------------------- Steinke et al.
def steinke_p_value(m: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """P-value of "the run is (ε, δ)-DP" given ``correct`` right among ``guesses`` guesses over m canaries.

    p = P[Bin(k, q) ≥ c] + 2mδ · max_{1≤i≤c} P[c − i ≤ Bin(k, q) < c] / i,
    q = e^ε / (1 + e^ε), capped at 1.

    Args:
        m: canaries (each included with probability ½); guesses: k ≤ m;
            correct: c ≤ k; epsilon ≥ 0; delta in [0, 1).

    Raises:
        ValueError: counts out of order, negative ε, δ outside [0, 1).

    Source: Steinke, Nasr & Jagielski 2023 (arXiv 2305.08846), Thm. 3.1 and
    its δ > 0 form (Prop. 5.2 / Alg. 1 there).
    """
    m, k, c = _check_counts(m, guesses, correct)
    delta = _check_delta(delta)
    if not float(epsilon) >= 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    q = float(special.expit(float(epsilon)))
    tail = float(stats.binom.sf(c - 1, k, q))  # P[W >= c]
    if delta == 0.0 or c == 0:
        return min(tail, 1.0)
    i = np.arange(1, c + 1)
    window = stats.binom.sf(c - 1 - i, k, q) - tail  # P[c - i <= W < c]
    return float(min(tail + 2.0 * m * delta * float(np.max(window / i)), 1.0))


def _largest_refuted(refutes, lo: float) -> float:
    """Largest x ≥ lo with ``refutes(x) > 0`` for a decreasing ``refutes`` (lo if none)."""
    if refutes(lo) <= 0:
        return lo
    hi = max(1.0, 2.0 * lo)
    while refutes(hi) > 0:
        lo, hi = hi, 2.0 * hi
        if hi > 1e4:
            return math.inf
    return float(optimize.brentq(refutes, lo, hi, xtol=1e-9, rtol=1e-12))


def steinke_epsilon(m: int, guesses: int, correct: int, delta: float, beta: float, *, lower: float = 0.0) -> float:
    """Largest ε that (m, k, c) refutes at level β with Steinke et al.'s test (≥ ``lower``; ``lower`` if none).

    Args:
        m, guesses, correct: as in :func:`steinke_p_value`.
        delta: δ in [0, 1); beta: level in (0, 1) (confidence 1 − β).
        lower: answer at least this (a bound already found elsewhere: the search starts there).

    Returns:
        ε ≥ 0 (``inf`` when even ε = 10⁴ is refuted).

    Source: Steinke, Nasr & Jagielski 2023, Alg. 2 (the ε search).
    """
    beta = _check_level(beta)
    _check_counts(m, guesses, correct)
    return _largest_refuted(lambda e: beta - steinke_p_value(m, guesses, correct, e, delta), float(lower))


# --------------------------------------------------------------------------- f-DP (Gaussian trade-off)
def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _inverse_blow_up(mu: float, x: float) -> float:
    """Φ(Φ⁻¹(x) − μ): the smallest mass an event of mass x under one neighbour has under the other, G_μ."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    return _phi(_STD.inv_cdf(x) - mu)


def fdp_slack(mu: float, m: int, guesses: int, correct: int, beta: float) -> float:
    """How far (m, k, c) is from being possible at level β under μ-GDP (> 0: the μ-GDP claim is refuted).

    The recursion of Mahloujifar et al.: start with r = βc/m (mass of the
    correct guesses), h = β(k − c)/m (of the wrong ones); for i = c − 1 … 0,
    h' = max(h, Φ(Φ⁻¹(r) − μ)), r ← min(r + i/(k − i)·(h' − h), 1), h ← h';
    stop early once h stops growing. The claim is refuted when r + h > k/m.

    Args:
        mu: μ ≥ 0 of the claimed Gaussian trade-off G_μ.
        m, guesses, correct: canaries, guesses k, correct guesses c.
        beta: level in (0, 1).

    Returns:
        r + h − k/m (decreasing in μ).

    Source: Mahloujifar, Melis & Chaudhuri 2024 (arXiv 2410.22235), Thm. 9 and
    the capped numerical procedure (Alg. 3) for membership guesses with abstention.
    """
    m, k, c = _check_counts(m, guesses, correct)
    beta = _check_level(beta)
    r, h = beta * c / m, beta * (k - c) / m
    for i in range(c - 1, -1, -1):
        h_next = max(h, _inverse_blow_up(mu, r))
        if h_next == h:
            break
        r = min(r + i / (k - i) * (h_next - h), 1.0)
        h = h_next
    return r + h - k / m


def fdp_mu(m: int, guesses: int, correct: int, beta: float, *, lower: float = 0.0) -> float:
    """Largest μ whose μ-GDP claim (m, k, c) refutes at level β (≥ ``lower``; ``lower`` if none).

    Source: as :func:`fdp_slack`.
    """
    return _largest_refuted(lambda mu: fdp_slack(mu, m, guesses, correct, beta), float(lower))


def fdp_epsilon(m: int, guesses: int, correct: int, delta: float, beta: float) -> float:
    """ε at δ of the largest refuted μ-GDP claim: ``gdp_epsilon(fdp_mu(...), δ)``.

    A lower bound on the run's ε(δ) when its trade-off curve is Gaussian.

    Raises:
        ValueError: δ outside (0, 1) (the μ → ε conversion needs δ > 0).
    """
    return gdp_epsilon(fdp_mu(m, guesses, correct, beta), delta)


# --------------------------------------------------------------------------- from scores
def default_guess_counts(m: int) -> np.ndarray:
    """The k tried by default: a grid fixed by m alone (before any score is seen).

    k = round(m·f) for 24 fractions f geometric from min(1, 10/m) to ½ (k ≥ 1,
    duplicates removed). Guessing more than half of the canaries cannot beat
    guessing half of them by much and costs tries.

    Raises:
        ValueError: m < 1.
    """
    m = int(m)
    if m < 1:
        raise ValueError(f"m (the number of canaries) must be >= 1, got {m}")
    lo = min(1.0, 10.0 / m)
    fractions = np.geomspace(lo, 0.5, 24) if lo < 0.5 else np.array([0.5])
    return np.unique(np.clip(np.round(m * fractions).astype(int), 1, m))


@dataclass(frozen=True)
class OneRunBound:
    """Result of :func:`one_run_bounds`.

    Attributes:
        steinke: Steinke et al.'s ε lower bound (any (ε, δ)-DP run).
        fdp: ε(δ) of the largest refuted μ-GDP claim (runs with a Gaussian trade-off).
        mu: that μ.
        m: canaries scored (n_in + n_out); delta, beta: as used (confidence 1 − β).
        tries: thresholds the correction covers (β / tries per try).
        sides: ``"both"`` or ``"upper"`` (see :func:`one_run_bounds`).
        steinke_guesses, steinke_correct, fdp_guesses, fdp_correct: the (k, c)
            that gave each bound (0, 0 when no bound above 0).
    """

    steinke: float
    fdp: float
    mu: float
    m: int
    delta: float
    beta: float
    tries: int
    sides: str
    steinke_guesses: int
    steinke_correct: int
    fdp_guesses: int
    fdp_correct: int


def _as_scores(x, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=float).ravel()
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or inf; scores must be finite")
    return arr


def _guess_table(sin: np.ndarray, sout: np.ndarray, guess_counts, sides: str) -> tuple[np.ndarray, np.ndarray]:
    """(k, c) for each try (ties broken against the auditor).

    ``sides="upper"``: guess "in" for the k highest scores; ``"both"``: "in"
    for the ⌊k/2⌋ highest and "out" for the ⌊k/2⌋ lowest (k rounded down to even).
    """
    m = sin.size + sout.size
    scores = np.concatenate([sin, sout])
    member = np.concatenate([np.ones(sin.size, bool), np.zeros(sout.size, bool)])
    # descending score; among equal scores the non-members first (a tie cannot help the bound)
    order = np.lexsort((member, -scores))
    correct_at = np.cumsum(member[order])  # c when guessing the first j+1
    if isinstance(guess_counts, str):
        if guess_counts != "all":
            raise ValueError(f"guess_counts must be 'all', None or a list of counts, got {guess_counts!r}")
        # every threshold "score >= tau" on the distinct pooled scores
        ranked = scores[order]
        last_of_value = np.flatnonzero(np.r_[ranked[1:] != ranked[:-1], True])
        ks = last_of_value + 1
        cs = correct_at[last_of_value]
        return ks.astype(int), np.asarray(cs, dtype=int)
    ks = default_guess_counts(m) if guess_counts is None else np.unique(np.asarray(guess_counts, dtype=int))
    if ks.size == 0 or ks.min() < 1 or ks.max() > m:
        raise ValueError(f"guess_counts must lie in [1, m={m}], got {guess_counts!r}")
    if sides == "upper":
        return ks, correct_at[ks - 1]
    half = np.unique(np.maximum(ks // 2, 1))
    half = half[2 * half <= m]
    # ascending score; among equal scores the members first (guessing "out" on a tie cannot help)
    low_order = np.lexsort((~member, scores))
    out_at = np.cumsum(~member[low_order])
    return 2 * half, correct_at[half - 1] + out_at[half - 1]


def one_run_bounds(
    scores_in,
    scores_out,
    delta: float = 1e-5,
    beta: float = 0.05,
    *,
    guess_counts: Union[None, str, Sequence[int]] = None,
    sides: str = "both",
    estimators: Sequence[str] = ("steinke", "fdp"),
) -> OneRunBound:
    """Both one-run ε lower bounds from the scores of included and excluded canaries.

    A higher score means "more likely included". For each k tried, the guesses
    are "in" for the highest scores (and, with ``sides="both"``, "out" for
    as many lowest scores); the rest abstain; c counts the right guesses. Each try is tested at β / (number of tries) — the Bonferroni
    correction for choosing k on these scores — so the maximum over tries holds
    at confidence 1 − β.

    Args:
        scores_in: scores of the included canaries (any shape, flattened).
        scores_out: scores of the excluded canaries. m = n_in + n_out ≥ 1.
        delta: δ in (0, 1).
        beta: 1 − confidence, in (0, 1).
        guess_counts: None (:func:`default_guess_counts` of m), ``"all"``
            (every distinct pooled score as a threshold "score ≥ τ", m tries at
            most), or the k values to try (chosen without these scores).
        sides: ``"both"`` (default: half the guesses "in" for the highest
            scores, half "out" for the lowest; both theorems cover guesses of
            either kind) or ``"upper"`` ("in" guesses only, as jax-privacy;
            the only choice with ``guess_counts="all"``).
        estimators: which of ``"steinke"``, ``"fdp"`` to compute (the other is
            reported as 0).

    Returns:
        :class:`OneRunBound`.

    Raises:
        ValueError: non-finite scores, no canary, δ or β outside (0, 1), bad
            ``guess_counts``, unknown estimator.

    Sources: Steinke, Nasr & Jagielski 2023 (arXiv 2305.08846); Mahloujifar,
    Melis & Chaudhuri 2024 (arXiv 2410.22235); Bonferroni over the thresholds as
    jax-privacy's ``CanaryScoreAuditor.epsilon_one_run(_fdp)`` do by default.
    """
    sin, sout = _as_scores(scores_in, "scores_in"), _as_scores(scores_out, "scores_out")
    m = sin.size + sout.size
    if m < 1:
        raise ValueError("no canary scores: give at least one included or excluded canary")
    delta = float(delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    beta = _check_level(beta)
    unknown = set(estimators) - {"steinke", "fdp"}
    if unknown:
        raise ValueError(f"unknown estimator(s) {sorted(unknown)}; choose among 'steinke', 'fdp'")
    if sides not in ("both", "upper"):
        raise ValueError(f"sides must be 'both' or 'upper', got {sides!r}")
    if guess_counts == "all":
        sides = "upper"
    ks, cs = _guess_table(sin, sout, guess_counts, sides)
    level = beta / ks.size
    # most precise tries first: later ones are mostly ruled out by one evaluation at the best so far
    order = np.argsort(-(cs / np.maximum(ks, 1)), kind="stable")
    eps, eps_kc = 0.0, (0, 0)
    mu, mu_kc = 0.0, (0, 0)
    for j in order:
        k, c = int(ks[j]), int(cs[j])
        if c == 0:
            continue
        if "steinke" in estimators and c / k > special.expit(eps):
            if steinke_p_value(m, k, c, eps, delta) <= level:
                eps, eps_kc = steinke_epsilon(m, k, c, delta, level, lower=eps), (k, c)
        if "fdp" in estimators and fdp_slack(mu, m, k, c, level) > 0:
            mu, mu_kc = fdp_mu(m, k, c, level, lower=mu), (k, c)
    return OneRunBound(
        steinke=eps,
        fdp=gdp_epsilon(mu, delta),
        mu=mu,
        m=m,
        delta=delta,
        beta=beta,
        tries=int(ks.size),
        sides=sides,
        steinke_guesses=eps_kc[0],
        steinke_correct=eps_kc[1],
        fdp_guesses=mu_kc[0],
        fdp_correct=mu_kc[1],
    )
