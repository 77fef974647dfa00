"""DP matrix factorization, the accounting side: strategies (banded, BLT), their optimisation, the
sensitivity for a participation schema, the ledger events, σ calibration and the re-derivation that
``dpopt check`` runs. numpy / scipy / dp_accounting only (no torch): the noise stream that uses these
strategies is :mod:`dpopt.correlated_noise`, whose docstring states the mechanism and the accounting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional, Sequence

import numpy as np
from dp_accounting import dp_event

__all__ = [
    "MECHANISMS",
    "Participation",
    "Strategy",
    "parse_mechanism",
    "banded_strategy",
    "blt_strategy",
    "optimize_strategy",
    "SENSITIVITY_METHODS",
    "SENSITIVITY_METHOD",
    "LEGACY_SENSITIVITY_METHOD",
    "sensitivity",
    "brute_force_sensitivity",
    "prefix_sensitivities",
    "monotone_envelope",
    "toeplitz_prefix_sensitivities",
    "mechanism_event",
    "step_events",
    "amplified_banded_event",
    "amplified_step_events",
    "mixture_of_gaussians_round",
    "check_amplified",
    "strategy_from_record",
    "check_record",
    "record_sampling",
    "same_sampling",
    "amplification_label",
    "AMPLIFICATION_NONE",
    "AMPLIFICATION_BANDED",
    "AMPLIFICATION_SPECTRAL",
    "gaussian_epsilon",
    "check_horizon",
    "amplified_sensitivity",
    "participation_columns",
]

MECHANISMS = ("independent", "banded", "blt")
MAX_HORIZON = 8192  # largest T a strategy is built for
MAX_GENERAL_HORIZON = 2048  # largest T of the O(T²)-memory general sensitivity bound
SENSITIVITY_METHODS = ("general-bound", "toeplitz-monotone")
LEGACY_SENSITIVITY_METHOD = "general-bound"  # a mechanism record without ``sensitivity_method``
SENSITIVITY_METHOD = "toeplitz-monotone"  # what new runs use and record
MONOTONE_TOL = 1e-9  # how far (relative to c_0) C's coefficients may be off monotone for the exact formula


@dataclass(frozen=True)
class Participation:
    """How often and how far apart one example takes part in the T releases.

    Args:
        steps: T, the horizon (number of releases the strategy covers), ≥ 1.
        participations: k ≥ 1, the most steps any one example takes part in.
        min_separation: b ≥ 1, the fewest steps between two participations of one example
            (cyclic batches: the number of batches per epoch).

    Raises:
        ValueError: a value < 1, or (k − 1)·b ≥ T (k participations do not fit).
    """

    steps: int
    participations: int = 1
    min_separation: int = 1

    def __post_init__(self) -> None:
        for name in ("steps", "participations", "min_separation"):
            v = getattr(self, name)
            if int(v) != v or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if (self.participations - 1) * self.min_separation >= self.steps:
            raise ValueError(
                f"{self.participations} participations {self.min_separation} steps apart do not fit in "
                f"{self.steps} steps: lower participations or min_separation"
            )

    @property
    def sampling(self) -> str:
        """The ledger's ``sampling`` statement for this participation schema."""
        noun = "participation" if self.participations == 1 else "participations"
        return f"cyclic (k={self.participations} {noun}, min separation {self.min_separation})"


@dataclass(frozen=True)
class Strategy:
    """A lower-triangular Toeplitz strategy C (one of :data:`MECHANISMS` other than independent).

    Attributes:
        kind: ``"banded"`` or ``"blt"``.
        coefficients: banded: c_0 … c_{b−1} of C; blt: () (C is defined by its inverse).
        omega, theta: blt only: d_k = Σ_i ω_i θ_i^{k−1} (k ≥ 1), d_0 = 1, the coefficients of C⁻¹.
    """

    kind: str
    coefficients: tuple = ()
    omega: tuple = ()
    theta: tuple = ()

    def __post_init__(self) -> None:
        if self.kind == "banded":
            c = self.coefficients
            if not c or not all(math.isfinite(float(x)) for x in c) or not float(c[0]) > 0:
                raise ValueError(f"banded coefficients must be finite with c_0 > 0, got {c!r}")
        elif self.kind == "blt":
            if len(self.omega) != len(self.theta) or not self.omega:
                raise ValueError("blt needs as many omega as theta (one per buffer), at least one")
            if not all(0.0 <= float(t) < 1.0 for t in self.theta) or not all(math.isfinite(w) for w in self.omega):
                raise ValueError(f"blt theta must lie in [0, 1) and omega be finite, got {self.theta}, {self.omega}")
        else:
            raise ValueError(f"strategy kind must be 'banded' or 'blt', got {self.kind!r}")

    @property
    def bands(self) -> int:
        """Banded: b; blt: 0 (C has every band)."""
        return len(self.coefficients) if self.kind == "banded" else 0

    @property
    def state_vectors(self) -> int:
        """Vectors of the parameters' size the noise stream keeps: b − 1 (banded) or n buffers (blt)."""
        return self.bands - 1 if self.kind == "banded" else len(self.theta)

    def inverse_coefficients(self, steps: int) -> np.ndarray:
        """d_0 … d_{T−1}, the Toeplitz coefficients of C⁻¹ (float64 ``[T]``)."""
        if self.kind == "blt":
            p, q = _blt_polynomials(self.omega, self.theta)
            return _impulse(p, q, steps)
        return _series_inverse(self.column(steps))

    def column(self, steps: int) -> np.ndarray:
        """c_0 … c_{T−1}, the Toeplitz coefficients (first column) of C (float64 ``[T]``)."""
        if self.kind == "banded":
            c = np.zeros(steps)
            m = min(steps, len(self.coefficients))
            c[:m] = np.asarray(self.coefficients[:m], dtype=np.float64)
            return c
        p, q = _blt_polynomials(self.omega, self.theta)
        return _impulse(q, p, steps)

    def matrix(self, steps: int) -> np.ndarray:
        """C as a dense float64 ``[T, T]`` lower-triangular Toeplitz matrix."""
        return _toeplitz(self.column(steps))

    def record(self) -> dict:
        """The public parameters as a JSON-ready dict (:func:`strategy_from_record` reads it)."""
        if self.kind == "banded":
            return {"kind": "banded", "coefficients": [float(c) for c in self.coefficients]}
        return {"kind": "blt", "omega": [float(w) for w in self.omega], "theta": [float(t) for t in self.theta]}


def strategy_from_record(record: dict) -> Strategy:
    """Inverse of :meth:`Strategy.record`.

    Raises:
        ValueError: a malformed record.
    """
    try:
        if record["kind"] == "banded":
            return Strategy("banded", tuple(float(c) for c in record["coefficients"]))
        return Strategy(
            "blt", omega=tuple(float(w) for w in record["omega"]), theta=tuple(float(t) for t in record["theta"])
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed strategy record {record!r}: {exc}") from exc


def _series_inverse(a: np.ndarray) -> np.ndarray:
    """The first ``len(a)`` coefficients of 1/a(x) for a power series with a_0 ≠ 0 (the first column of
    a lower-triangular Toeplitz inverse), float64."""
    n = len(a)
    return _impulse([1.0], np.trim_zeros(np.asarray(a, dtype=np.float64), "b"), n)


def _toeplitz(col: np.ndarray) -> np.ndarray:
    n = len(col)
    idx = np.subtract.outer(np.arange(n), np.arange(n))
    return np.where(idx >= 0, col[np.clip(idx, 0, n - 1)], 0.0)


# -- sensitivity ------------------------------------------------------------------------------------


def check_horizon(steps: int) -> None:
    if steps > MAX_HORIZON:
        raise ValueError(
            f"correlated noise over {steps} steps: dpopt builds dense T×T strategies up to T = {MAX_HORIZON}; "
            "train fewer steps (fewer epochs or larger batches) or use independent noise"
        )


def _orthogonal_columns(strategy: Strategy, p: Participation) -> bool:
    """Banded with b ≤ min_separation: the columns an example touches have disjoint supports."""
    return strategy.kind == "banded" and (p.participations == 1 or strategy.bands <= p.min_separation)


def monotone_envelope(column: np.ndarray, tol: float = MONOTONE_TOL) -> Optional[np.ndarray]:
    """ĉ_s = max_{r ≥ s} |c_r| (float64 ``[T]``) when it is within ``tol``·max|c| of ``column`` everywhere
    (c nonnegative and nonincreasing up to rounding), else None.

    ĉ is nonnegative, nonincreasing and ĉ ≥ |c| entrywise, so the lower-triangular Toeplitz Ĉ dominates |C|
    entry by entry and Δ(C) ≤ Δ(Ĉ) for every participation schema and every prefix of rows (X = CᵀC has
    |X_ij| ≤ (ĈᵀĈ)_ij): McKenna's exact formula on ĉ (:func:`toeplitz_prefix_sensitivities`) is a valid
    upper bound even where float64 rounding leaves c a hair off monotone, and exact where ĉ = c.
    """
    c = np.asarray(column, dtype=np.float64)
    env = np.maximum.accumulate(np.abs(c)[::-1])[::-1]
    scale = float(env[0]) if len(env) else 0.0
    if not scale > 0 or float(np.max(env - c)) > tol * scale:
        return None
    return env


def toeplitz_prefix_sensitivities(column: np.ndarray, participation: Participation) -> np.ndarray:
    """Δ_t, t = 0 … T−1, of the first t+1 rows of the lower-triangular Toeplitz C with nonnegative,
    nonincreasing coefficients ``column`` (c_0 ≥ c_1 ≥ … ≥ 0, float64 ``[T]``), exactly, in O(T).

    McKenna 2024 (arXiv 2405.13763, Thm 2): for such C the worst (k, b)-participation pattern is the
    earliest one, u = e_0 + e_b + … + e_{(k'−1)b}, k' = min(k, ⌈T/b⌉), and Δ = ‖C u‖. Proof (also for
    prefixes): X = CᵀC has X_ij = Σ_{s=0}^{T−1−j} c_s c_{s+j−i} for i ≤ j, ≥ 0, nonincreasing in j − i
    and in max(i, j); a pattern p_1 < … < p_r (r ≤ k, gaps ≥ b) moved to q_a = (a−1)b has q_a ≤ p_a and
    q_{a'} − q_a ≤ p_{a'} − p_a, so every X_{q_a q_{a'}} ≥ X_{p_a p_{a'}}, and adding participations adds
    X ≥ 0. The first t+1 rows of C are the Toeplitz matrix of c_0 … c_t (columns > t are zero), whose
    worst pattern is the positions ≤ t of the same u: Δ_t² = Σ_{s≤t} (C u)_s². Vector contributions:
    X ≥ 0, so aligned unit gradients are the worst case, √(Σ_{i,j∈π} X_ij).

    Raises:
        ValueError: ``column`` not of length T = ``participation.steps``, or not nonnegative and
            nonincreasing (pass :func:`monotone_envelope`'s envelope, or use :func:`prefix_sensitivities`).
    """
    c = np.asarray(column, dtype=np.float64)
    T, k, b = len(c), participation.participations, participation.min_separation
    if T != participation.steps:
        raise ValueError(f"column has {T} coefficients but the participation has {participation.steps} steps")
    if not (np.all(c >= 0) and np.all(np.diff(c) <= 0)):
        raise ValueError(
            "McKenna's exact Toeplitz sensitivity needs nonnegative, nonincreasing coefficients: use "
            "prefix_sensitivities (it checks them and falls back to the general bound)"
        )
    rows = -(-T // b)
    lattice = np.zeros(rows * b)
    lattice[:T] = c
    strided = np.cumsum(lattice.reshape(rows, b), axis=0)  # strided[r, j] = Σ_{m ≤ r} c_{(r−m)b+j}
    if k < rows:
        strided[k:] -= strided[: rows - k].copy()  # keep the k most recent participations only
    v = strided.reshape(-1)[:T]  # (C u)_s = Σ_{m < k, mb ≤ s} c_{s−mb}
    return np.sqrt(np.cumsum(v * v))


def _check_method(method: str) -> str:
    if method not in SENSITIVITY_METHODS:
        raise ValueError(
            f"unknown sensitivity_method {method!r}: this dpopt knows {', '.join(SENSITIVITY_METHODS)} "
            "(a ledger from a newer dpopt? upgrade to check it)"
        )
    return method


def prefix_sensitivities(
    strategy: Strategy, participation: Participation, method: str = SENSITIVITY_METHOD
) -> np.ndarray:
    """Δ_t for t = 0 … T−1: the sensitivity of the first t+1 rows of C (exact, or an upper bound where
    stated), nondecreasing, Δ_{T−1} = :func:`sensitivity` (float64 ``[T]``).

    Exact closed forms, either method: one participation (Δ_t² = Σ_{s≤t} c_s², the first column, which
    dominates every other column of a lower-triangular Toeplitz C restricted to rows ≤ t), and banded
    with b ≤ min_separation (disjoint column supports; the earliest pattern 0, b', 2b', … maximises a
    sum of nonincreasing column norms). Otherwise:

    - ``method="toeplitz-monotone"`` (default; ledgers since the field existed): where C's Toeplitz
      coefficients are nonnegative and nonincreasing (checked on the coefficients, :func:`monotone_envelope`),
      McKenna's exact O(T) value for every prefix (:func:`toeplitz_prefix_sensitivities`); else as below.
    - ``method="general-bound"`` (ledgers without the field): the whole-run upper bound of
      :func:`sensitivity` from the first release on (conservative for prefixes, an upper bound at T;
      Choquette-Choo et al. arXiv 2306.08153, Alg. 4, by dynamic programming, T ≤ :data:`MAX_GENERAL_HORIZON`).

    Raises:
        ValueError: T > :data:`MAX_HORIZON`; the general bound over more than :data:`MAX_GENERAL_HORIZON`
            steps; an unknown ``method``.
    """
    _check_method(method)
    T = participation.steps
    check_horizon(T)
    col = strategy.column(T)
    c2 = np.cumsum(col**2)
    if participation.participations == 1:
        return np.sqrt(c2)
    if _orthogonal_columns(strategy, participation):
        out = np.zeros(T)
        for m in range(participation.participations):
            start = m * participation.min_separation
            out[start:] += c2[: T - start]
        return np.sqrt(out)
    env = monotone_envelope(col) if method == "toeplitz-monotone" else None
    if env is not None:
        return toeplitz_prefix_sensitivities(env, participation)
    return np.full(T, _general_bound(strategy, participation))


def sensitivity(strategy: Strategy, participation: Participation, method: str = SENSITIVITY_METHOD) -> float:
    """Δ(C): the L2 sensitivity of C·x for unit-norm contributions under ``participation``.

    One participation: the largest column norm (exact). Banded with b ≤ min_separation: the sum of the
    k largest b'-separated squared column norms (exact). ``method="toeplitz-monotone"`` with nonnegative,
    nonincreasing Toeplitz coefficients: ‖C(e_0 + e_b + …)‖ (exact, McKenna 2024, arXiv 2405.13763,
    Thm 2; :func:`toeplitz_prefix_sensitivities`). Otherwise (``"general-bound"``, or coefficients that are
    not monotone) the upper bound Δ² ≤ max_π Σ_{i∈π} R_i, R_i = max_{π∋i} Σ_{j∈π} |X_ij| (X = CᵀC;
    π b'-separated, |π| ≤ k; arXiv 2306.08153, Alg. 4), by dynamic programming over positions. Never below
    the true sensitivity (checked against :func:`brute_force_sensitivity` in the tests).

    Raises:
        ValueError: as :func:`prefix_sensitivities`.
    """
    return float(prefix_sensitivities(strategy, participation, method)[-1])


def _general_bound(strategy: Strategy, participation: Participation) -> float:
    """The Algorithm-4 upper bound of :func:`sensitivity` (O(T²) memory, O(k·T²) time)."""
    T, k, sep = participation.steps, participation.participations, participation.min_separation
    if T > MAX_GENERAL_HORIZON:
        raise ValueError(
            f"the sensitivity of a {strategy.kind} strategy with {k} participations over {T} steps has no closed "
            f"form here (its Toeplitz coefficients are not nonnegative and nonincreasing) and dpopt bounds it by "
            f"dynamic programming up to T = {MAX_GENERAL_HORIZON}: use banded:B with B <= the steps per epoch, "
            "one epoch, or fewer steps"
        )
    C = strategy.matrix(T)
    X = np.abs(C.T @ C)
    return float(math.sqrt(_separated_best(_row_bounds(X, k, sep), k, sep)))


def _row_bounds(X: np.ndarray, k: int, sep: int) -> np.ndarray:
    """R_i = X_ii + the best sum of X_ij over ≤ k−1 further positions j, ≥ sep from i and from each other
    (split over left and right of i), for every row i at once (X ≥ 0). Memory O(T²), time O(k·T²)."""
    T = X.shape[0]
    rows = np.arange(T)
    lpos, rpos = rows - sep, rows + sep  # the last allowed position left of i, the first right of i
    lval = [np.zeros(T)] + [np.zeros(T) for _ in range(k - 1)]  # lval[c][i]: best c picks ≤ lpos[i]
    rval = [np.zeros(T)] + [np.zeros(T) for _ in range(k - 1)]
    prev_l = np.zeros((T, T))  # best with c−1 picks among positions ≤ j (rows × j)
    prev_r = np.zeros((T, T))
    for c in range(1, k):
        cur_l = np.empty((T, T))
        for j in range(T):
            take = (prev_l[:, j - sep] if j - sep >= 0 else (0.0 if c == 1 else -np.inf)) + X[:, j]
            cur_l[:, j] = np.maximum(cur_l[:, j - 1], take) if j else take
        cur_r = np.empty((T, T))
        for j in range(T - 1, -1, -1):
            take = (prev_r[:, j + sep] if j + sep < T else (0.0 if c == 1 else -np.inf)) + X[:, j]
            cur_r[:, j] = np.maximum(cur_r[:, j + 1], take) if j + 1 < T else take
        lval[c] = np.where(lpos >= 0, cur_l[rows, np.clip(lpos, 0, T - 1)], -np.inf)
        rval[c] = np.where(rpos < T, cur_r[rows, np.clip(rpos, 0, T - 1)], -np.inf)
        prev_l, prev_r = cur_l, cur_r
    best = np.zeros(T)
    for cl in range(k):
        for cr in range(k - cl):
            best = np.maximum(best, lval[cl] + rval[cr])
    return np.diag(X) + best


def _separated_best(w: np.ndarray, k: int, sep: int) -> float:
    """max Σ_{i∈π} w_i over π ⊆ [T], |π| ≤ k, pairwise ≥ sep apart (w ≥ 0)."""
    T = len(w)
    f = np.zeros((k + 1, T))  # f[c, j]: best with ≤ c picks among positions ≤ j
    for c in range(1, k + 1):
        for j in range(T):
            take = w[j] + (f[c - 1, j - sep] if j - sep >= 0 else 0.0)
            f[c, j] = max(f[c, j - 1] if j else 0.0, take)
    return float(f[k, T - 1])


def brute_force_sensitivity(strategy: Strategy, participation: Participation) -> float:
    """max over EVERY participation pattern π (|π| ≤ k, pairwise ≥ min_separation apart) of
    √(Σ_{i,j∈π} |X_ij|), X = CᵀC — the sensitivity for vector contributions, by enumeration.

    For tests at small T only (exponential in T).

    Raises:
        ValueError: T > 24.
    """
    T, k, sep = participation.steps, participation.participations, participation.min_separation
    if T > 24:
        raise ValueError("brute force enumerates every pattern: T <= 24 only")
    X = np.abs(strategy.matrix(T).T @ strategy.matrix(T))
    best = 0.0

    def walk(start: int, chosen: list) -> None:
        nonlocal best
        if chosen:
            idx = np.array(chosen)
            best = max(best, float(X[np.ix_(idx, idx)].sum()))
        if len(chosen) == k:
            return
        for j in range(start, T):
            walk(j + sep, chosen + [j])

    walk(0, [])
    return math.sqrt(best)


# -- strategy optimisation --------------------------------------------------------------------------


def _impulse(num: Any, den: Any, steps: int) -> np.ndarray:
    """The first ``steps`` power-series coefficients of num(x)/den(x) (den_0 ≠ 0), float64, O(T·degree)
    (:func:`scipy.signal.lfilter` on an impulse)."""
    from scipy.signal import lfilter

    e = np.zeros(steps)
    e[0] = 1.0
    return np.asarray(lfilter(np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64), e))


def _blt_polynomials(omega: Any, theta: Any) -> tuple[np.ndarray, np.ndarray]:
    """(P, Q) with d(x) = 1 + Σ_i ω_i x/(1 − θ_i x) = P(x)/Q(x), Q = Π_i (1 − θ_i x) (Dvijotham et al. 2024, Sec. 3)."""
    q = np.array([1.0])
    for th in theta:
        q = np.convolve(q, [1.0, -float(th)])
    p = q.copy()
    for i, w in enumerate(omega):
        part = np.array([0.0, float(w)])
        for j, th in enumerate(theta):
            if j != i:
                part = np.convolve(part, [1.0, -float(th)])
        p = p + np.pad(part, (0, len(p) - len(part)))
    return p, q


def _error(d: np.ndarray, c: np.ndarray, objective: str) -> float:
    """Squared error of the prefix sums per unit σ²: ‖c‖² (single-participation Δ²) times the mean (or
    max) over t of ‖row t of A·C⁻¹‖², where A·C⁻¹ is Toeplitz with coefficients r = cumsum(d)
    (Dvijotham et al. 2024, eq. (3); McKenna 2024, Sec. 3)."""
    steps = len(d)
    r2 = np.cumsum(d) ** 2
    err = r2.sum() if objective == "max" else float(np.dot(np.arange(steps, 0, -1), r2)) / steps
    value = float(err * np.dot(c, c))
    return value if math.isfinite(value) else 1e300


def _sqrt_coefficients(n: int) -> np.ndarray:
    """Coefficients of (1 − x)^(−1/2): C(2j, j)/4^j (the square-root factorization, Fichtenberger et al. 2023)."""
    out = np.ones(n)
    for j in range(1, n):
        out[j] = out[j - 1] * (2 * j - 1) / (2 * j)
    return out


@lru_cache(maxsize=32)
def optimize_strategy(
    kind: str, steps: int, size: int, objective: str = "mean", participation: Optional[Participation] = None
) -> Strategy:
    """The strategy minimising the prefix-sum error for horizon T and the run's participations (cached
    per arguments).

    First minimises ‖c‖²·err(A·C⁻¹) (:func:`_error`: mean or max over steps of the squared error of the
    prefix sums, per unit noise; ‖c‖² the single-participation sensitivity²) with L-BFGS-B (scipy,
    finite-difference gradients; each evaluation is O(T·size)). With a ``participation`` of k > 1 whose
    columns overlap (blt, or banded with b > min_separation; for banded with b ≤ min_separation k
    participations scale ‖c‖² by k, the same minimiser), that optimum is then refined for the run's
    sensitivity: :func:`_tune_for_participation` minimises Δ_k²·err(A·C⁻¹), Δ_k the exact k-participation
    sensitivity of C with nonnegative nonincreasing coefficients (McKenna 2024, arXiv 2405.13763, Thm 2),
    and the refined strategy is kept only where its error per unit of its :func:`sensitivity` is lower.
    The run is always charged :func:`sensitivity` of the strategy returned, however it was found.

    Args:
        kind: ``"banded"`` (size = bands b ≥ 1; starts from the truncated square-root factorization)
            or ``"blt"`` (size = buffers n ≥ 1; θ ∈ (0, 1) through a logistic map).
        steps: T ≥ 1 (≤ :data:`MAX_HORIZON`).
        objective: ``"mean"`` or ``"max"``.
        participation: the run's (T, k, min_separation); None (or k = 1): one participation.

    Raises:
        ValueError: bad kind, size, T or objective, or a participation over another horizon.
    """
    if objective not in ("mean", "max"):
        raise ValueError(f"objective must be 'mean' or 'max', got {objective!r}")
    if int(size) != size or size < 1:
        raise ValueError(f"{'bands' if kind == 'banded' else 'buffers'} must be an integer >= 1, got {size!r}")
    check_horizon(steps)
    if participation is not None and participation.steps != int(steps):
        raise ValueError(f"participation is over {participation.steps} steps, the strategy over {steps}")
    single = _optimize_single(kind, int(steps), int(size), objective)
    if participation is None or participation.participations == 1 or _orthogonal_columns(single, participation):
        return single
    return _tune_for_participation(single, participation, objective)


def _score(strategy: Strategy, participation: Participation, objective: str) -> float:
    """Squared prefix-sum error per unit σ² at the strategy's sensitivity: Δ²·err(A·C⁻¹)."""
    T = participation.steps
    return (
        _error(strategy.inverse_coefficients(T), np.array([1.0]), objective) * sensitivity(strategy, participation) ** 2
    )


def _tune_for_participation(start: Strategy, participation: Participation, objective: str) -> Strategy:
    """``start`` refined for k > 1 participations at least b apart (Nelder–Mead from ``start``).

    Loss: Δ_k²·err(A·C⁻¹) with Δ_k = ‖C(e_0 + e_b + …)‖ (:func:`toeplitz_prefix_sensitivities`, O(T)),
    exact only for nonnegative nonincreasing coefficients of C, so coefficients outside that set score
    +∞ (without the constraint the search leaves it, where the true Δ is larger). Returns the refined
    strategy where its :func:`_score` (with its real :func:`sensitivity`) is below ``start``'s, else
    ``start``.
    """
    from scipy.optimize import minimize

    T = participation.steps

    def loss_of(d: np.ndarray, c: np.ndarray) -> float:
        if not (c[0] > 0 and np.all(c >= 0) and np.all(np.diff(c) <= 0)):
            return 1e300
        delta2 = float(toeplitz_prefix_sensitivities(c, participation)[-1] ** 2)
        return _error(d, np.array([1.0]), objective) * delta2

    if start.kind == "banded":

        def banded_loss(x: np.ndarray) -> float:
            c = np.concatenate([[1.0], x])
            return loss_of(_impulse([1.0], c, T), np.pad(c, (0, T - len(c))))

        x0 = np.array(start.coefficients[1:], dtype=np.float64) / start.coefficients[0]
        res = minimize(banded_loss, x0, method="Nelder-Mead", options={"maxiter": 4000, "xatol": 1e-10, "fatol": 1e-13})
        tuned = Strategy("banded", (1.0,) + tuple(float(v) for v in res.x))
    else:
        n = len(start.omega)

        def unpack(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return v[n:], 1.0 / (1.0 + np.exp(-np.clip(v[:n], -30.0, 30.0)))

        def blt_loss(v: np.ndarray) -> float:
            omega, theta = unpack(v)
            p, q = _blt_polynomials(omega, theta)
            with np.errstate(all="ignore"):
                value = loss_of(_impulse(p, q, T), _impulse(q, p, T))
            return value if math.isfinite(value) else 1e300

        theta0 = np.clip(np.array(start.theta), 1e-9, 1 - 1e-12)
        v0 = np.concatenate([np.log(theta0 / (1.0 - theta0)), np.array(start.omega)])
        if not blt_loss(v0) < 1e300:  # ``start`` outside the monotone set: the single optimiser's initial guess
            theta0 = 1.0 - np.logspace(-0.3, -math.log10(max(T, 4)), n)  # (inside it in every case checked)
            v0 = np.concatenate([np.log(theta0 / (1.0 - theta0)), -0.5 * (1.0 - theta0) / n])
        res = minimize(blt_loss, v0, method="Nelder-Mead", options={"maxiter": 4000, "xatol": 1e-10, "fatol": 1e-13})
        omega, theta = unpack(res.x)
        tuned = Strategy("blt", omega=tuple(float(w) for w in omega), theta=tuple(float(t) for t in theta))
    if not float(res.fun) < 1e300:
        return start
    try:
        before = _score(start, participation, objective)
    except ValueError:  # no sensitivity for ``start`` (not monotone, T past the general bound's): the tuned one has
        return tuned
    return tuned if _score(tuned, participation, objective) < before else start


@lru_cache(maxsize=32)
def _optimize_single(kind: str, T: int, size: int, objective: str) -> Strategy:
    """:func:`optimize_strategy` for one participation (arguments checked by the caller; cached)."""
    from scipy.optimize import minimize

    if kind == "banded":
        b = min(int(size), T)
        if b == 1:
            return Strategy("banded", (1.0,))

        def banded_loss(x: np.ndarray) -> float:
            c = np.concatenate([[1.0], x])
            return _error(_impulse([1.0], c, T), np.pad(c, (0, T - b)), objective)

        x0 = _sqrt_coefficients(b)[1:]
        res = minimize(banded_loss, x0, method="L-BFGS-B", options={"maxiter": 500, "ftol": 1e-15, "gtol": 1e-12})
        x = res.x if banded_loss(res.x) <= banded_loss(x0) else x0
        return Strategy("banded", (1.0,) + tuple(float(v) for v in x))
    if kind == "blt":
        n = int(size)

        def unpack(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return v[n:], 1.0 / (1.0 + np.exp(-np.clip(v[:n], -30.0, 30.0)))  # θ ≤ 1 − 1e-13

        def blt_loss(v: np.ndarray) -> float:
            omega, theta = unpack(v)
            p, q = _blt_polynomials(omega, theta)
            with np.errstate(all="ignore"):
                return _error(_impulse(p, q, T), _impulse(q, p, T), objective)

        if T > 256:  # continuation: start from the optimum at a quarter of the horizon
            warm = optimize_strategy("blt", max(256, T // 4), n, objective)  # cached, one participation
            theta0, omega0 = np.clip(np.array(warm.theta), 1e-6, 1 - 1e-9), np.array(warm.omega)
        else:
            theta0 = 1.0 - np.logspace(-0.3, -math.log10(max(T, 4)), n)  # 1 − θ spread on a log scale
            omega0 = -0.5 * (1.0 - theta0) / n
        v0 = np.concatenate([np.log(theta0 / (1.0 - theta0)), omega0])
        best = v0
        for method, options in (
            ("L-BFGS-B", {"maxiter": 200, "ftol": 1e-15, "gtol": 1e-12}),
            ("Nelder-Mead", {"maxiter": 3000, "xatol": 1e-9, "fatol": 1e-12}),  # the gradient is badly scaled
        ):
            res = minimize(blt_loss, best, method=method, options=options)
            if blt_loss(res.x) < blt_loss(best):
                best = res.x
        omega, theta = unpack(best)
        return Strategy("blt", omega=tuple(float(w) for w in omega), theta=tuple(float(t) for t in theta))
    raise ValueError(f"kind must be 'banded' or 'blt', got {kind!r}")


def banded_strategy(bands: int, steps: int, objective: str = "mean") -> Strategy:
    """:func:`optimize_strategy` for ``"banded"`` with b bands."""
    return optimize_strategy("banded", int(steps), int(bands), objective)


def blt_strategy(buffers: int, steps: int, objective: str = "mean") -> Strategy:
    """:func:`optimize_strategy` for ``"blt"`` with n buffers."""
    return optimize_strategy("blt", int(steps), int(buffers), objective)


def parse_mechanism(spec: str) -> tuple[str, int]:
    """``"independent"``, ``"banded:B"`` or ``"blt"`` / ``"blt:N"`` → (kind, size).

    Raises:
        ValueError: any other string (the message lists the accepted forms).
    """
    text = str(spec).strip().lower()
    kind, _, arg = text.partition(":")
    try:
        if kind == "independent" and not arg:
            return "independent", 0
        if kind == "banded" and arg:
            size = int(arg)
            if size >= 1:
                return "banded", size
        if kind == "blt":
            size = int(arg) if arg else 4
            if size >= 1:
                return "blt", size
    except ValueError:
        pass
    raise ValueError(
        f"noise_mechanism {spec!r} is not one of 'independent', 'banded:B' (B >= 1 bands) or 'blt' / 'blt:N' "
        "(N >= 1 buffers)"
    )


# -- accounting -------------------------------------------------------------------------------------


def _sigma(noise_multiplier: float, sens: float) -> float:
    return math.inf if sens == 0 else float(noise_multiplier) / float(sens)


def mechanism_event(noise_multiplier: float, strategy: Strategy, participation: Participation) -> dp_event.DpEvent:
    """The whole run (T releases) as ONE ``GaussianDpEvent(σ/Δ)`` (no amplification).

    Raises:
        ValueError: σ ≤ 0 (a correlated mechanism without noise is not private).
    """
    if not float(noise_multiplier) > 0:
        raise ValueError("correlated noise needs noise_multiplier > 0")
    return dp_event.GaussianDpEvent(_sigma(noise_multiplier, sensitivity(strategy, participation)))


def step_events(noise_multiplier: float, prefix: np.ndarray) -> list:
    """Per-release events whose composition up to release t is exactly Gaussian(σ/Δ_t) (module docstring).

    Raises:
        ValueError: σ ≤ 0.
    """
    if not float(noise_multiplier) > 0:
        raise ValueError("correlated noise needs noise_multiplier > 0")
    out, prev = [], 0.0
    for d in prefix:
        inc = float(d) ** 2 - prev**2
        if inc <= 1e-15 * max(1.0, float(d) ** 2):
            out.append(dp_event.NoOpDpEvent())
        else:
            out.append(dp_event.GaussianDpEvent(float(noise_multiplier) / math.sqrt(inc)))
            prev = float(d)
    return out


def amplified_banded_event(
    noise_multiplier: float, strategy: Strategy, participation: Participation, sample_rate: float
) -> dp_event.DpEvent:
    """Banded MF with cyclic Poisson sampling (Choquette-Choo et al., arXiv 2306.08153, Thm 4): the data
    are split once into b' = min_separation parts, step t Poisson-samples part t mod b' at rate q; with
    b ≤ b' bands the run is k = ⌈T/b'⌉ compositions of the sampled Gaussian with multiplier σ/‖c‖
    (‖c‖ the largest column norm). Returns ``SelfComposed(PoissonSampled(q, Gaussian(σ/‖c‖)), k)``.

    Raises:
        ValueError: not banded, b > min_separation (no amplified accountant: refused), σ ≤ 0, q ∉ (0, 1].
    """
    if strategy.kind != "banded" or strategy.bands > participation.min_separation:
        raise ValueError(
            "amplified accounting holds for banded strategies with bands <= min_separation only "
            f"(got {strategy.kind} with {strategy.bands} bands, min_separation {participation.min_separation})"
        )
    if not float(noise_multiplier) > 0 or not 0.0 < float(sample_rate) <= 1.0:
        raise ValueError("need noise_multiplier > 0 and sample_rate in (0, 1]")
    col = float(np.linalg.norm(strategy.column(participation.steps)))
    rounds = -(-participation.steps // participation.min_separation)
    inner = dp_event.PoissonSampledDpEvent(float(sample_rate), dp_event.GaussianDpEvent(float(noise_multiplier) / col))
    return dp_event.SelfComposedDpEvent(inner, int(rounds))


def check_amplified(strategy: Strategy, participation: Participation, sample_rate: float) -> None:
    """Refuse cyclic Poisson sampling where dpopt has no amplified accountant.

    Every strategy has one (:func:`~dpopt.accounting.sampled_matrix_mechanism.amplified_sensitivity`):
    banded with b ≤ min_separation exactly (arXiv 2306.08153, Thm 4), overlapping columns (BLT, b > b') by
    the spectral bound, whose dense eigenproblem dpopt solves up to T = :data:`MAX_GENERAL_HORIZON`.

    Raises:
        ValueError: q ∉ (0, 1]; overlapping columns over more than :data:`MAX_GENERAL_HORIZON` steps.
    """
    if not 0.0 < float(sample_rate) <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    amplified_sensitivity(strategy, participation.steps, participation.min_separation)


def amplified_step_events(
    noise_multiplier: float, strategy: Strategy, participation: Participation, sample_rate: float
) -> list:
    """Per-release events of MF under cyclic Poisson sampling: release t = r·b' (the first step of round r,
    b' = min_separation) carries the round's ``PoissonSampledDpEvent(q, GaussianDpEvent(σ/s))``, every other
    release a no-op, with s = :func:`~dpopt.accounting.sampled_matrix_mechanism.amplified_sensitivity`:
    ‖c‖ for banded with b ≤ b' bands (disjoint columns; Choquette-Choo et al., arXiv 2306.08153, Thm 4:
    exactly :func:`amplified_banded_event`), √λ_max(UᵀU) for overlapping columns (BLT, b > b'; the
    spectral bound, proved in that module's docstring).

    Charging the round at its first release is conservative for every prefix: an example of partition j
    takes part (with probability q) at step r·b' + j ≥ r·b', so after release t at most ⌈(t+1)/b'⌉ of its
    sampled Gaussians have happened, and the prefix of the release is a post-processing of those.

    Raises:
        ValueError: :func:`check_amplified`'s refusals; σ ≤ 0.
    """
    check_amplified(strategy, participation, sample_rate)
    if not float(noise_multiplier) > 0:
        raise ValueError("correlated noise needs noise_multiplier > 0")
    sens = amplified_sensitivity(strategy, participation.steps, participation.min_separation)
    rnd = dp_event.PoissonSampledDpEvent(float(sample_rate), dp_event.GaussianDpEvent(float(noise_multiplier) / sens))
    sep = participation.min_separation
    return [rnd if t % sep == 0 else dp_event.NoOpDpEvent() for t in range(participation.steps)]


def mixture_of_gaussians_round(noise_multiplier: float, strategy: Strategy, sample_rate: float) -> dp_event.DpEvent:
    """One round of amplified banded MF as dp_accounting's ``MixtureOfGaussiansDpEvent`` (arXiv 2310.15526,
    Sec. 3): N(0, σ²) against (1 − q)·N(0, σ²) + q·N(‖c‖, σ²). For b ≤ b' bands this is exactly the
    Poisson-sampled Gaussian of :func:`amplified_step_events` (PLD only: dp_accounting's RDP accountant
    does not take it); kept for cross-checks. Strategies with overlapping columns (BLT, b > b') are accounted
    by the spectral bound instead (:mod:`dpopt.accounting.sampled_matrix_mechanism`; MMCC is not implemented)."""
    if strategy.kind != "banded" or not 0.0 < float(sample_rate) <= 1.0:
        raise ValueError("a mixture-of-Gaussians round is built for banded strategies and q in (0, 1] only")
    col = float(np.linalg.norm(np.asarray(strategy.coefficients, dtype=np.float64)))
    q = float(sample_rate)
    return dp_event.MixtureOfGaussiansDpEvent(float(noise_multiplier), [0.0, col], [1.0 - q, q])


def gaussian_epsilon(mu: float, delta: float) -> float:
    """ε(δ) of one Gaussian mechanism with sensitivity/σ = μ > 0, exact in float64: the root of
    δ = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Balle & Wang 2018, Thm 8).

    Raises:
        ValueError: μ ≤ 0 or δ ∉ (0, 1).
    """
    from scipy.optimize import brentq
    from scipy.stats import norm

    if not mu > 0 or not 0 < delta < 1:
        raise ValueError(f"need mu > 0 and delta in (0, 1), got {mu}, {delta}")

    def gap(eps: float) -> float:
        return float(norm.cdf(-eps / mu + mu / 2) - math.exp(eps + norm.logcdf(-eps / mu - mu / 2))) - delta

    if gap(0.0) <= 0:
        return 0.0
    return float(brentq(gap, 0.0, 50.0 + mu * mu, xtol=1e-12))


def cyclic_poisson_sampling(sample_rate: float, partitions: int) -> str:
    """The ledger's ``sampling`` statement of cyclic Poisson sampling at q over b partitions."""
    return f"cyclic poisson (q={float(sample_rate):.12g} within {int(partitions)} partitions)"


#: The mechanism record's ``amplification`` statements (:func:`amplification_label`).
AMPLIFICATION_NONE = "none"
AMPLIFICATION_BANDED = "cyclic-poisson (arXiv 2306.08153, Thm 4)"
AMPLIFICATION_SPECTRAL = "cyclic-poisson spectral bound (dpopt.accounting.sampled_matrix_mechanism)"


def amplification_label(strategy: "Strategy", min_separation: int, sample_rate: Optional[float]) -> str:
    """The ``amplification`` statement a mechanism record with these fields must carry.

    :data:`AMPLIFICATION_NONE` without a sample rate (no amplification: one Gaussian for the run);
    :data:`AMPLIFICATION_BANDED` for banded with B ≤ b' = ``min_separation`` bands under cyclic Poisson
    sampling (disjoint columns, exact: Choquette-Choo et al., arXiv 2306.08153, Thm 4);
    :data:`AMPLIFICATION_SPECTRAL` otherwise (overlapping columns: the spectral bound of
    :mod:`dpopt.accounting.sampled_matrix_mechanism`).
    """
    if sample_rate is None:
        return AMPLIFICATION_NONE
    if strategy.kind == "banded" and strategy.bands <= int(min_separation):
        return AMPLIFICATION_BANDED
    return AMPLIFICATION_SPECTRAL


def same_sampling(recorded: Any, required: Optional[str]) -> bool:
    """Whether a ledger's ``sampling`` statement is the one its mechanism record requires
    (:func:`record_sampling`); ledgers written before the singular was spelled read "k=1 participations"."""
    if not isinstance(recorded, str) or required is None:
        return False
    return recorded.replace("(k=1 participations,", "(k=1 participation,") == required


def record_sampling(record: Optional[dict]) -> Optional[str]:
    """The ledger ``sampling`` statement a mechanism record requires (None without a valid record):
    the accountants' ε of such a ledger holds for that sampling, not Poisson."""
    if not isinstance(record, dict):
        return None
    if record.get("sample_rate") is not None:
        try:
            return cyclic_poisson_sampling(float(record["sample_rate"]), int(record["min_separation"]))
        except (KeyError, TypeError, ValueError):
            return None
    try:
        return Participation(
            int(record["steps"]), int(record["participations"]), int(record["min_separation"])
        ).sampling
    except (KeyError, TypeError, ValueError):
        return None


def check_record(record: dict, entries: Sequence, rtol: float = 1e-6) -> list[str]:
    """Re-derive a correlated-noise ledger from its header record alone; return the problems found.

    For every entry (``.step``, ``.event``, ``.meta``): the event must be the one
    :func:`step_events` gives for the recorded strategy, participation and σ at that step (a
    Gaussian increment or a no-op), and the recorded ``mechanism_sensitivity`` the recomputed Δ_t;
    the recorded whole-run ``sensitivity`` must be the recomputed :func:`sensitivity`. With a
    ``sample_rate`` (cyclic Poisson) the events are :func:`amplified_step_events`'s, and a recorded
    ``amplified_sensitivity`` must be the recomputed one. The record's ``amplification`` statement must be
    the one its fields imply (:func:`amplification_label`: ``"none"`` ⇔ no ``sample_rate``; the banded
    Thm-4 label ⇔ banded with B ≤ b'; the spectral-bound label otherwise).

    The sensitivities are re-derived with the record's ``sensitivity_method`` (one of
    :data:`SENSITIVITY_METHODS`; absent: :data:`LEGACY_SENSITIVITY_METHOD`, what ledgers written before the
    field existed used); an unknown method is a problem, never a silent fallback.
    """
    problems: list[str] = []
    try:
        strategy = strategy_from_record(record["strategy"])
        part = Participation(int(record["steps"]), int(record["participations"]), int(record["min_separation"]))
        sigma = float(record["noise_multiplier"])
        method = record.get("sensitivity_method", LEGACY_SENSITIVITY_METHOD)
        if not isinstance(method, str):
            raise ValueError(f"sensitivity_method must be a string, got {method!r}")
        prefix = prefix_sensitivities(strategy, part, method)
        q = record.get("sample_rate")
        events = step_events(sigma, prefix) if q is None else amplified_step_events(sigma, strategy, part, float(q))
    except (KeyError, TypeError, ValueError) as exc:
        return [f"the mechanism record cannot be re-derived: {exc}"]
    label = amplification_label(strategy, part.min_separation, None if q is None else float(q))
    if record.get("amplification") != label:
        problems.append(
            f"recorded amplification {record.get('amplification')!r} != {label!r}, what the record's fields imply "
            f"(sample_rate {q!r}, {strategy.kind} strategy, min_separation {part.min_separation})"
        )
    if abs(float(record.get("sensitivity", -1.0)) - prefix[-1]) > rtol * prefix[-1]:
        problems.append(f"recorded sensitivity {record.get('sensitivity')} != recomputed {prefix[-1]:.9g}")
    if q is not None and "amplified_sensitivity" in record:
        amp = amplified_sensitivity(strategy, part.steps, part.min_separation)
        if abs(float(record["amplified_sensitivity"]) - amp) > rtol * amp:
            problems.append(f"recorded amplified_sensitivity {record['amplified_sensitivity']} != recomputed {amp:.9g}")
    bad = []
    for e in entries:
        if not 0 <= e.step < part.steps:
            bad.append(f"step {e.step} outside the horizon {part.steps}")
            continue
        want = events[e.step]
        got = e.event
        if not _same_event(got, want, rtol):
            bad.append(f"step {e.step}: event {got} != re-derived {want}")
        ms = e.meta.get("mechanism_sensitivity")
        if ms is None or abs(float(ms) - prefix[e.step]) > rtol * prefix[e.step]:
            bad.append(f"step {e.step}: mechanism_sensitivity {ms} != re-derived {prefix[e.step]:.9g}")
    if bad:
        problems.append(f"{len(bad)} entries disagree with the mechanism record: " + "; ".join(bad[:3]))
    return problems


def _same_event(got: Any, want: dp_event.DpEvent, rtol: float) -> bool:
    """Whether ``got`` is ``want`` (a no-op, a Gaussian, or a Poisson-sampled Gaussian) up to ``rtol``."""
    if type(got) is not type(want):
        return False
    if isinstance(want, dp_event.PoissonSampledDpEvent):
        return abs(
            float(got.sampling_probability) - want.sampling_probability
        ) <= rtol * want.sampling_probability and (_same_event(got.event, want.event, rtol))
    if isinstance(want, dp_event.GaussianDpEvent):
        return abs(float(got.noise_multiplier) - want.noise_multiplier) <= rtol * want.noise_multiplier
    return True


# -- amplified (cyclic-Poisson) sensitivity: the spectral bound of dpopt.accounting.sampled_matrix_mechanism --

_SPECTRAL_MARGIN = 1e-9  # relative upward margin on the computed λ_max (eigvalsh rounding is ~1e-15·‖G‖)


def participation_columns(matrix: np.ndarray, min_separation: int, part: int = 0) -> np.ndarray:
    """U = C[:, S_r]: the columns of the T×T strategy ``matrix`` at the steps of part r (float64 ``[T, k]``).

    Raises:
        ValueError: ``matrix`` not square, b' < 1 or r ∉ [0, b').
    """
    C = np.asarray(matrix, dtype=np.float64)
    if C.ndim != 2 or C.shape[0] != C.shape[1]:
        raise ValueError(f"the strategy matrix must be square T×T, got shape {C.shape}")
    if int(min_separation) != min_separation or min_separation < 1 or not 0 <= part < min_separation:
        raise ValueError(f"need min_separation >= 1 and 0 <= part < min_separation, got {min_separation}, {part}")
    return C[:, int(part) :: int(min_separation)]


@lru_cache(maxsize=64)
def _amplified_sensitivity(strategy: object, steps: int, min_separation: int) -> float:
    assert isinstance(strategy, Strategy)
    check_horizon(steps)
    if strategy.kind == "banded" and strategy.bands <= min_separation:  # orthogonal columns: exact, closed form
        return float(np.linalg.norm(strategy.column(steps)))
    U = participation_columns(strategy.matrix(steps), min_separation, 0)
    lam = float(np.linalg.eigvalsh(U.T @ U)[-1])
    return math.sqrt(lam * (1.0 + _SPECTRAL_MARGIN))


def amplified_sensitivity(strategy: object, steps: int, min_separation: int) -> float:
    """√λ, λ ≥ λ_max(UᵀU), U = C[:, S_0] the columns of part 0's steps: the per-participation sensitivity of the
    spectral bound (module docstring) — the run is ⌈T/b'⌉ Poisson-sampled Gaussians at noise multiplier σ/√λ.

    Banded with b ≤ b' bands: ‖c‖ (the column norm; exact, Choquette-Choo et al. 2023, arXiv 2306.08153,
    Thm 4). Otherwise √(λ_max·(1 + 1e-9)) from a dense eigendecomposition (float64, the margin covers rounding).

    Args:
        strategy: a :class:`~dpopt.accounting.matrix_factorization.Strategy`.
        steps: T (≤ :data:`~dpopt.accounting.matrix_factorization.MAX_GENERAL_HORIZON` unless orthogonal).
        min_separation: b', the number of parts.

    Raises:
        ValueError: T too large for the dense bound; b' < 1.
    """
    if int(min_separation) != min_separation or min_separation < 1:
        raise ValueError(f"min_separation must be an integer >= 1, got {min_separation!r}")
    orthogonal = getattr(strategy, "kind", None) == "banded" and getattr(strategy, "bands", 0) <= min_separation
    if not orthogonal and steps > MAX_GENERAL_HORIZON:
        kind = getattr(strategy, "kind", None)
        raise ValueError(
            f"amplified accounting (sampling cyclic-poisson) of a {kind + ' ' if kind else ''}strategy over "
            f"T = {steps} steps, whose columns overlap, needs a "
            f"dense {steps}×{steps} eigenproblem; dpopt does it up to T = {MAX_GENERAL_HORIZON} steps. Train at "
            f"most {MAX_GENERAL_HORIZON} steps (fewer epochs or larger batches), or use sampling cyclic (unamplified "
            f"accounting: a strategy tuned to the run is charged its exact sensitivity up to T = {MAX_HORIZON}), "
            f"or noise_mechanism banded:B with B <= the {int(min_separation)} parts"
        )
    return _amplified_sensitivity(strategy, int(steps), int(min_separation))
