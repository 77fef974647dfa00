"""The sampled matrix mechanism under cyclic Poisson sampling: an exact float64 reference curve for small T,
and the spectral bound dpopt accounts with for strategies whose columns overlap (BLT; banded with more bands
than partitions).

Setting (``sampling="cyclic-poisson"``, :class:`dpopt.cyclic_batches.CyclicPoissonLoader`): the data are
split once into b' parts; step t Poisson-samples part t mod b' at rate q. An example of part r takes part at
the steps S_r = {r, r + b', r + 2b', …} ∩ [0, T), at step s with an independent coin B_s ~ Bernoulli(q),
contributing B_s·g_s (‖g_s‖ ≤ 1, the clipped gradient in units of the clip bound, chosen adaptively).
The mechanism releases Y = C·X + σZ (C the T×T lower-triangular strategy, rows of Z iid N(0, I_d)).
Neighbouring: with and without the example (add/remove).

**Spectral bound** (:func:`amplified_sensitivity`; used by the ledger, calibration and ``dpopt check``).
Let U = C[:, S_r] (T × k) and λ ≥ λ_max(UᵀU). Then the release is a post-processing of the k adaptively
composed Poisson-sampled Gaussians a_s = B_s·g_s + (σ/√λ)·ζ_s, s ∈ S_r (ζ_s iid N(0, I_d)), so the run is
dominated by ``SelfComposed(PoissonSampled(q, Gaussian(σ/√λ)), k)``. Proof: W = C⁻¹Y = X + σξ with
ξ = C⁻¹Z, whose rows are jointly Gaussian in time with precision CᵀC (each coordinate of d independently).
Split the rows into S = S_r and N (the rest): ξ_S = A·ξ_N + η with η ~ N(0, (CᵀC)_SS⁻¹) = N(0, (UᵀU)⁻¹)
independent of ξ_N (a Gaussian's conditional covariance is the inverse of its precision block). Since
(UᵀU)⁻¹ ⪰ I/λ, η = ζ/√λ + η' with η' ~ N(0, (UᵀU)⁻¹ − I/λ) independent of ζ. A post-processor draws ξ_N and
η' itself (they do not depend on the data) and, release by release, outputs W_t = σξ_t (t ∈ N) or
W_t = a_t + σ(Aξ_N + η')_t (t ∈ S); the example's contributions at N are zero, so this is W exactly, and
the adversary's choice of g_t may depend on W_{<t}, a function of a_{<t} and the post-processor's own
draws — the adaptive composition of the k sampled Gaussians (dominating pairs compose adaptively). Y = C·W.
The same holds for every prefix Y_{≤t} (a function of a_{s ≤ t}), so charging participation s at release s
keeps every prefix honest. Parts r > 0 need no separate bound: U_r is U_0 with its last r rows and
possibly its last columns removed, so λ_max(U_rᵀU_r) ≤ λ_max(U_0ᵀU_0). For banded C with b ≤ b' bands the
columns are orthogonal, λ = ‖c‖² and the bound is exactly Choquette-Choo et al. 2023 (arXiv 2306.08153,
Thm 4); for C = I it is DP-SGD's Poisson-sampled Gaussian. It never beats the unamplified Gaussian at
q = 1 (k·λ ≥ 1ᵀUᵀU1 = Δ²), which is why dpopt offers it only as an opt-in sampler.

This is NOT MMCC (Choquette-Choo, Ganesh, Steinke, Thakurta, arXiv 2310.15526): MMCC conditions each row on
the earlier ones and is tighter as ε → 0; its per-row dominance and conditional δ' are not implemented.

**Exact reference** (:func:`sampled_mm_delta`, :func:`sampled_mm_epsilon`; tests only, k ≤ 7). For the
adversary whose contributions are all g_s = e_1 (aligned, full norm; the worst case for C = I and for
orthogonal columns, and the adversary MMCC's analysis fixes for non-negative C), Y is a mixture over the
coin patterns b ∈ {0,1}^k of N(U·b, σ²I) against N(0, σ²I). Projecting onto the column space of U (a
sufficient statistic: the rest is N(0, σ²) under every pattern), U = QR, gives means R·b/σ in R^k with unit
noise. Rotate so that the last axis is e = R1/‖R1‖: the component means along e are β_b = 1ᵀUᵀUb/(σ‖R1‖)
≥ 0 (C ≥ 0), so the likelihood ratio L(v, t) is increasing in t and {L > e^ε} is a half-line [t*(v), ∞):
the t-integral of the hockey-stick divergence is closed-form in Φ, and the remaining smooth integral over
v ∈ R^{k−1} is done by tensor Gauss–Hermite quadrature. Both directions (remove and add) are computed and
the larger δ returned. The tests check it against dp_accounting's PLD for C = I and against
:func:`~dpopt.accounting.matrix_factorization.amplified_step_events` for banded b ≤ b', and check that the
spectral bound lies above it on every small case.
"""

from __future__ import annotations

import itertools
import math
from typing import Optional

import numpy as np

from .matrix_factorization import amplified_sensitivity, participation_columns

__all__ = [
    "participation_columns",
    "amplified_sensitivity",
    "sampled_mm_delta",
    "sampled_mm_epsilon",
]

MAX_REFERENCE_PARTICIPATIONS = 7


# -- exact reference --------------------------------------------------------------------------------------


def _reduced_means(U: np.ndarray, noise_multiplier: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(β [2^k], Γ [2^k, k−1], patterns [2^k, k]): the unit-noise component means along e = R1/‖R1‖ and in
    its orthogonal complement, for every coin pattern b (U = QR)."""
    k = U.shape[1]
    R = np.asarray(np.linalg.qr(U, mode="r"), dtype=np.float64)
    pats = np.array(list(itertools.product((0.0, 1.0), repeat=k)))  # 2^k × k, row 0 all zeros
    means = pats @ R.T / float(noise_multiplier)  # R·b / σ
    e = R.sum(axis=1)
    e = e / np.linalg.norm(e)
    basis, _ = np.linalg.qr(np.column_stack([e, np.eye(k)]))  # first column ±e, the rest ⊥ e
    V = basis[:, 1:k]
    beta = means @ e
    return beta, means @ V, pats


def _root(a: np.ndarray, beta: np.ndarray, level: float) -> np.ndarray:
    """t solving logsumexp_b(a_b + β_b t) = level per row of ``a`` ([n, m]), β ≥ 0, β_b > 0 for the last
    column; −inf where the infimum (the β = 0 terms) already exceeds ``level``. Newton from the right
    (convex increasing: monotone convergence)."""
    from scipy.special import logsumexp

    flat = beta <= 0
    floor = logsumexp(a[:, flat], axis=1) if flat.any() else np.full(a.shape[0], -np.inf)
    out = np.full(a.shape[0], -np.inf)
    live = floor < level - 1e-12
    if not live.any():
        return out
    al = a[live]
    t = (level - al[:, -1]) / beta[-1]  # the last term alone reaches the level here: f(t) ≥ 0
    for _ in range(2000):
        z = al + np.outer(t, beta)
        m = z.max(axis=1, keepdims=True)
        w = np.exp(z - m)
        s = w.sum(axis=1)
        f = m[:, 0] + np.log(s) - level
        fp = (w @ beta) / s
        step = f / fp
        t = t - step
        if np.all(np.abs(step) <= 1e-12 * (1.0 + np.abs(t))):
            break
    else:
        raise RuntimeError("the quadrature's root finding did not converge")
    out[live] = t
    return out


def _gauss_hermite(dim: int, nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Tensor Gauss–Hermite rule for E over N(0, I_dim): (points [n^dim, dim], weights [n^dim])."""
    x, w = np.polynomial.hermite_e.hermegauss(nodes)
    w = w / math.sqrt(2.0 * math.pi)
    if dim == 0:
        return np.zeros((1, 0)), np.ones(1)
    pts = np.array(list(itertools.product(x, repeat=dim)))
    wts = np.prod(np.array(list(itertools.product(w, repeat=dim))), axis=1)
    return pts, wts


def sampled_mm_delta(
    matrix: np.ndarray,
    noise_multiplier: float,
    sample_rate: float,
    min_separation: int,
    epsilon: float,
    part: int = 0,
    nodes: Optional[int] = None,
) -> float:
    """δ(ε) = max(H_ε(P‖Q), H_ε(Q‖P)) of the sampled matrix mechanism for one example of part r, in float64
    (the exact reference of the module docstring; aligned contributions g_s = e_1).

    P = Σ_b q^{|b|}(1−q)^{k−|b|} N(U·b, σ²I), Q = N(0, σ²I), U = C[:, S_r] (k columns), H_ε(A‖B) =
    ∫ (a − e^ε b)_+.

    Args:
        matrix: C, float64 ``[T, T]``, lower-triangular with every entry ≥ 0 (monotone likelihood ratio).
        noise_multiplier: σ > 0 (noise std per unit clip bound).
        sample_rate: q ∈ (0, 1].
        min_separation: b' ≥ 1 parts.
        epsilon: ε ≥ 0.
        part: r ∈ [0, b').
        nodes: Gauss–Hermite nodes per dimension (default: 64, 40, 20, 12, 8, 6 for k − 1 = 1 … 6; against
            dp_accounting's PLD for C = I the ε agrees to 1e-5 relative for k ≤ 4 at σ ≥ 0.7).

    Raises:
        ValueError: C with a negative entry, k > 7, σ ≤ 0, q ∉ (0, 1] or ε < 0.
    """
    from scipy.special import log_ndtr, logsumexp

    C = np.asarray(matrix, dtype=np.float64)
    if (C < 0).any():
        raise ValueError("the exact reference needs a strategy with every entry >= 0")
    U = participation_columns(C, min_separation, part)
    k = U.shape[1]
    if not 1 <= k <= MAX_REFERENCE_PARTICIPATIONS:
        raise ValueError(f"the exact reference enumerates 2^k patterns: k <= {MAX_REFERENCE_PARTICIPATIONS}, got {k}")
    if not float(noise_multiplier) > 0 or not 0 < float(sample_rate) <= 1 or not float(epsilon) >= 0:
        raise ValueError("need noise_multiplier > 0, sample_rate in (0, 1] and epsilon >= 0")
    q, eps = float(sample_rate), float(epsilon)
    beta, gamma, pats = _reduced_means(U, noise_multiplier)
    ones = pats.sum(axis=1)
    off = k - ones
    logpi = ones * math.log(q) + (off * math.log1p(-q) if q < 1 else np.where(off > 0, -np.inf, 0.0))
    keep = np.isfinite(logpi)
    beta, gamma, logpi = beta[keep], gamma[keep], logpi[keep]
    n = nodes or {0: 1, 1: 64, 2: 40, 3: 20, 4: 12, 5: 8, 6: 6}[k - 1]
    pts, wts = _gauss_hermite(k - 1, n)
    # a_b(v) + β_b t − β_b²/2: the log of component b's density ratio at (v, t) (unit noise)
    a_v = logpi[None, :] + pts @ gamma.T - 0.5 * np.sum(gamma**2, axis=1)[None, :]  # [n, m]: v-part, log
    a = a_v - 0.5 * beta[None, :] ** 2
    t_hi = _root(a, beta, eps)  # L > e^ε ⇔ t > t_hi
    t_lo = _root(a, beta, -eps)  # L < e^{−ε} ⇔ t < t_lo
    # H(P‖Q) = E_v[Σ_b e^{a_v,b} Φ̄(t_hi − β_b) − e^ε Φ̄(t_hi)]; H(Q‖P) = E_v[Φ(t_lo) − e^ε Σ_b e^{a_v,b} Φ(t_lo − β_b)]
    pq = np.exp(logsumexp(a_v + log_ndtr(beta[None, :] - t_hi[:, None]), axis=1)) - np.exp(eps + log_ndtr(-t_hi))
    qp = np.exp(log_ndtr(t_lo)) - np.exp(eps + logsumexp(a_v + log_ndtr(t_lo[:, None] - beta[None, :]), axis=1))
    return max(0.0, float(wts @ pq), float(wts @ qp))


def sampled_mm_epsilon(
    matrix: np.ndarray,
    noise_multiplier: float,
    sample_rate: float,
    min_separation: int,
    delta: float,
    nodes: Optional[int] = None,
) -> float:
    """The smallest ε with :func:`sampled_mm_delta` ≤ δ, worst part r ∈ [0, b') (the exact reference).

    Raises:
        ValueError: as :func:`sampled_mm_delta`; δ ∉ (0, 1).
    """
    from scipy.optimize import brentq

    if not 0 < float(delta) < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    T = np.asarray(matrix).shape[0]
    worst = 0.0
    for r in range(min(int(min_separation), T)):

        def gap(e: float, r: int = r) -> float:
            return sampled_mm_delta(matrix, noise_multiplier, sample_rate, min_separation, e, r, nodes) - delta

        if gap(0.0) <= 0:
            continue
        hi = 1.0
        while gap(hi) > 0:
            hi *= 2.0
            if hi > 1e3:
                raise ValueError("epsilon above 1000: the reference does not resolve it")
        worst = max(worst, float(brentq(gap, 0.0, hi, xtol=1e-9, rtol=1e-10)))
    return worst
