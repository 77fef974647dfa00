"""Spectral diagnostics of gradient matrices: the math, on matrices you give it.

NON-PRIVATE RESEARCH TOOL. These functions take a *clean* gradient matrix
(e.g. the clipped mean gradient of :mod:`dpopt.diagnostics.gradients`, which
reads private data without noise and without the ledger) and say how well its
singular directions survive the DP noise of a given setting. Nothing here is
released, charged or fed into training.

Setting (the spectral paper (Shanmugam, Barnes, Taylor 2026; docs/algorithms.md); docs/algorithms.md
"Spectral diagnostics"): a weight block of shape m×n (conv kernels flattened
to out × in·kh·kw), clean clipped mean gradient Ḡ, DP-SGD release
Ḡ + N with N_ij iid N(0, s²), s = σC/B̄ (noise multiplier σ, clip norm C,
expected batch size B̄). Write p = min(m, n), q = max(m, n), c = p/q.

* spectral SNR = ‖Ḡ‖_F / ‖N‖_F with ‖N‖_F ≈ s√(mn)           (:func:`spectral_snr`)
* effective rank = exp(H(σ_i / Σ_j σ_j)) (Roy & Vetterli 2007)  (:func:`effective_rank`)
* stable rank = ‖Ḡ‖_F² / σ₁²                                   (:func:`stable_rank`)
* threshold ratio ρ = σ₁(Ḡ) / (s (mn)^{1/4}); the leading singular
  vectors are recoverable iff ρ > 1 (BBP transition)             (:func:`threshold_ratio`)
* recovery batch size B* = σ C (mn)^{1/4} / σ₁(Ḡ); with EMA momentum β the
  noise std of the momentum is s √((1−β)/(1+β)), so B* is multiplied by
  √((1−β)/(1+β))                                                 (:func:`recovery_batch_size`)
* Monte Carlo cosine between the leading singular vectors of Ḡ and Ḡ + N
                                                                 (:func:`monte_carlo_cosines`)

Random-matrix prediction (:func:`predicted_cosines`). Rank-one spike plus
Gaussian noise, Y = θ u vᵀ + N, normalised so the noise entries have variance
1/q: θ̃ = θ / (s√q). Benaych-Georges & Nadakuditi, "The singular values and
vectors of low rank perturbations of large rectangular random matrices",
J. Multivariate Anal. 111 (2012), §3.1 (Gaussian rectangular example): for
θ̃ > c^{1/4} (equivalently θ > s (mn)^{1/4}, i.e. ρ > 1)::

    |⟨û, u⟩|²  → 1 − c (1 + θ̃²) / (θ̃² (θ̃² + c))      (the p-dimensional, short side)
    |⟨v̂, v⟩|²  → 1 − (c + θ̃²) / (θ̃² (θ̃² + 1))        (the q-dimensional, long side)
    σ₁(Y)      → s √q · √((1 + θ̃²)(c + θ̃²)) / θ̃

and both cosines → 0, σ₁(Y) → s (√m + √n) (the Marchenko–Pastur edge) for
θ̃ ≤ c^{1/4}. For a gradient of higher rank the same formulas hold for its
leading direction when σ₁ is separated from σ₂ (the spikes do not interact
in the limit; same reference, Theorem 2.9/2.10).

Cost. :func:`singular_values` uses ``torch.linalg.svdvals`` (O(mn·p) time)
when p ≤ ``FULL_SVD_MAX`` and ``torch.svd_lowrank`` (randomized, O(mn·k·(niter+2)))
for the top k otherwise. :func:`monte_carlo_cosines` needs the leading
singular pair of ``trials`` noisy matrices: full SVD (O(trials·mn·p)) up to
``FULL_SVD_MAX``, randomized above.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "FULL_SVD_MAX",
    "as_matrix",
    "noise_std",
    "singular_values",
    "effective_rank",
    "stable_rank",
    "spectral_snr",
    "threshold_ratio",
    "momentum_noise_factor",
    "recovery_batch_size",
    "noise_edge",
    "predicted_cosines",
    "predicted_top_singular_value",
    "leading_singular_vectors",
    "monte_carlo_cosines",
    "CosineEstimate",
    "MatrixDiagnostics",
    "diagnose_matrix",
]

#: Largest min(m, n) for which exact SVDs are used (above: torch.svd_lowrank).
FULL_SVD_MAX = 1024


def as_matrix(t: Tensor) -> Tensor:
    """A weight-shaped tensor as ``[shape[0], prod(shape[1:])]`` (conv kernels: out × in·kh·kw).

    Raises:
        ValueError: fewer than 2 dimensions.
    """
    if t.dim() < 2:
        raise ValueError(f"spectral diagnostics need a matrix (>= 2-D tensor), got shape {tuple(t.shape)}")
    return t.reshape(t.shape[0], -1)


def noise_std(noise_multiplier: float, max_grad_norm: float, batch_size: float) -> float:
    """Per-entry noise std s = σ C / B̄ of a DP-SGD release (flat clipping, sum ÷ B̄)."""
    if not batch_size > 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    return float(noise_multiplier) * float(max_grad_norm) / float(batch_size)


def singular_values(
    g: Tensor, k: Optional[int] = None, niter: int = 4, generator: Optional[torch.Generator] = None
) -> Tensor:
    """Singular values of a matrix, descending (the top ``k`` if given).

    Exact (``torch.linalg.svdvals``, O(mn·min(m,n))) when ``k`` is None or
    min(m, n) ≤ :data:`FULL_SVD_MAX`; otherwise randomized
    (``torch.svd_lowrank`` with q = k + 8 and ``niter`` power iterations,
    O(mn(k+8)(niter+2))), accurate for the top values of a decaying spectrum.
    """
    m = as_matrix(g).double()
    p = min(m.shape)
    if k is None or p <= FULL_SVD_MAX:
        s = torch.linalg.svdvals(m)
        return s if k is None else s[:k]
    state = torch.random.get_rng_state()
    if generator is not None:
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
    try:
        _, s, _ = torch.svd_lowrank(m, q=min(p, k + 8), niter=niter)
    finally:
        torch.random.set_rng_state(state)
    return s[:k]


def effective_rank(s: Tensor) -> float:
    """Roy–Vetterli effective rank exp(H(p)), p_i = σ_i / Σ_j σ_j (0·log 0 = 0).

    Takes singular values (1-D) or a matrix (its singular values are used).
    Equals r for r equal non-zero singular values; 0 for the zero matrix.
    Source: Roy & Vetterli, "The effective rank", EUSIPCO 2007, Def. 1.
    """
    s = s if s.dim() == 1 else singular_values(s)
    s = s.double().abs()
    total = float(s.sum())
    if total == 0.0:
        return 0.0
    p = s / total
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def stable_rank(s: Tensor) -> float:
    """Stable rank ‖G‖_F² / σ₁² = Σσ_i² / σ₁² (singular values or a matrix); 0 for zero."""
    s = s if s.dim() == 1 else singular_values(s)
    s = s.double().abs()
    top = float(s.max()) if s.numel() else 0.0
    return float((s**2).sum()) / top**2 if top > 0 else 0.0


def spectral_snr(clean: Tensor, s: float) -> float:
    """‖Ḡ‖_F / ‖N‖_F with the expected noise norm ‖N‖_F = s √(mn) (∞ when s = 0)."""
    m, n = as_matrix(clean).shape
    num = float(torch.linalg.matrix_norm(as_matrix(clean).double()))
    return num / (s * math.sqrt(m * n)) if s > 0 else math.inf


def threshold_ratio(sigma1: float, s: float, m: int, n: int) -> float:
    """ρ = σ₁ / (s (mn)^{1/4}): the leading direction is recoverable (BBP) iff ρ > 1."""
    return float(sigma1) / (s * (m * n) ** 0.25) if s > 0 else math.inf


def momentum_noise_factor(momentum: float = 0.0) -> float:
    """√((1−β)/(1+β)): stationary noise std of an EMA momentum M ← βM + (1−β)g, per unit of g's noise.

    (Var = (1−β)² Σ_k β^{2k} s² = s² (1−β)/(1+β); the signal of a constant
    gradient is unchanged.)
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    return math.sqrt((1.0 - momentum) / (1.0 + momentum))


def recovery_batch_size(
    sigma1: float, noise_multiplier: float, max_grad_norm: float, m: int, n: int, momentum: float = 0.0
) -> float:
    """B* = σ C (mn)^{1/4} / σ₁(Ḡ) · √((1−β)/(1+β)): smallest B̄ with σ₁ > s (mn)^{1/4}.

    Linear in σ and C, grows as (mn)^{1/4} with the shape, inversely
    proportional to σ₁. ``momentum`` β = 0 gives the plain DP-SGD value.
    ∞ when σ₁ = 0 (nothing to recover); 0 when σ = 0.
    """
    if sigma1 <= 0:
        return math.inf
    return (
        float(noise_multiplier)
        * float(max_grad_norm)
        * (m * n) ** 0.25
        / float(sigma1)
        * momentum_noise_factor(momentum)
    )


def noise_edge(s: float, m: int, n: int) -> float:
    """s(√m + √n): the top singular value of an m×n matrix of iid N(0, s²) entries (large m, n)."""
    return float(s) * (math.sqrt(m) + math.sqrt(n))


def predicted_cosines(sigma1: float, s: float, m: int, n: int) -> tuple[float, float]:
    """Limiting |cos| of the leading (left, right) singular vectors of Ḡ vs Ḡ + N (BBP / spiked model).

    Left vectors live in R^m (rows, the layer's outputs), right in R^n. See
    the module docstring for the formulas and source (Benaych-Georges &
    Nadakuditi 2012). Both are 0 at or below the threshold ρ ≤ 1; 1 when s = 0.
    """
    if s <= 0:
        return 1.0, 1.0
    p, q = min(m, n), max(m, n)
    c = p / q
    t2 = (float(sigma1) / (s * math.sqrt(q))) ** 2
    if t2 * t2 <= c:
        return 0.0, 0.0
    short = 1.0 - c * (1.0 + t2) / (t2 * (t2 + c))
    long = 1.0 - (c + t2) / (t2 * (t2 + 1.0))
    short, long = math.sqrt(max(short, 0.0)), math.sqrt(max(long, 0.0))
    return (short, long) if m <= n else (long, short)


def predicted_top_singular_value(sigma1: float, s: float, m: int, n: int) -> float:
    """Limiting σ₁(Ḡ + N): s√q √((1+θ̃²)(c+θ̃²))/θ̃ above the threshold, the noise edge below it."""
    if s <= 0:
        return float(sigma1)
    p, q = min(m, n), max(m, n)
    c = p / q
    t = float(sigma1) / (s * math.sqrt(q))
    if t**4 <= c:
        return noise_edge(s, m, n)
    return s * math.sqrt(q) * math.sqrt((1 + t * t) * (c + t * t)) / t


def leading_singular_vectors(g: Tensor, niter: int = 6) -> tuple[Tensor, float, Tensor]:
    """(u₁, σ₁, v₁) of a matrix: exact SVD up to :data:`FULL_SVD_MAX`, randomized (q = 8) above."""
    m = as_matrix(g)
    if min(m.shape) <= FULL_SVD_MAX:
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        return u[:, 0], float(s[0]), vh[0]
    u, s, v = torch.svd_lowrank(m, q=8, niter=niter)
    return u[:, 0], float(s[0]), v[:, 0]


@dataclass(frozen=True)
class CosineEstimate:
    """Monte Carlo |cos| of leading singular vectors: means and standard errors over ``trials``.

    ``product`` is |⟨u,û⟩|·|⟨v,v̂⟩| = |⟨u vᵀ, û v̂ᵀ⟩_F|, the alignment of the
    rank-one directions (what a polar-factor update keeps of the leading one).
    """

    left: float
    right: float
    product: float
    left_se: float
    right_se: float
    product_se: float
    trials: int


def monte_carlo_cosines(
    clean: Tensor, s: float, trials: int = 20, generator: Optional[torch.Generator] = None
) -> CosineEstimate:
    """|cos| between the leading singular vectors of Ḡ and Ḡ + N, N_ij iid N(0, s²), over ``trials`` draws.

    Computed in float64. Cost: ``trials`` SVDs of an m×n matrix (see module
    docstring). The noise is simulated here (research use; it is not DP noise
    and nothing here is released).
    """
    if trials < 2:
        raise ValueError(f"trials must be >= 2 (for a standard error), got {trials}")
    g = as_matrix(clean).double()
    u, _, v = leading_singular_vectors(g)
    gen = generator or torch.Generator().manual_seed(0)
    left, right = [], []
    for _ in range(int(trials)):
        noisy = g + s * torch.randn(g.shape, generator=gen, dtype=torch.float64)
        uh, _, vh = leading_singular_vectors(noisy)
        left.append(abs(float(u @ uh)))
        right.append(abs(float(v @ vh)))
    lt, rt = torch.tensor(left), torch.tensor(right)
    pt = lt * rt
    se = lambda x: float(x.std(unbiased=True) / math.sqrt(len(x)))  # noqa: E731
    return CosineEstimate(float(lt.mean()), float(rt.mean()), float(pt.mean()), se(lt), se(rt), se(pt), int(trials))


@dataclass(frozen=True)
class MatrixDiagnostics:
    """All diagnostics of one matrix at one setting (σ, C, B̄, β); plain floats (JSON-ready via ``to_dict``)."""

    shape: tuple[int, int]
    batch_size: float
    noise_multiplier: float
    max_grad_norm: float
    momentum: float
    noise_std: float
    sigma1: float
    frobenius: float
    effective_rank: float
    stable_rank: float
    noisy_effective_rank: float
    noisy_stable_rank: float
    spectral_snr: float
    threshold_ratio: float
    b_star: float
    b_star_momentum: float
    recoverable: bool
    predicted_left: float
    predicted_right: float
    mc: Optional[CosineEstimate]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


def diagnose_matrix(
    clean: Tensor,
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    batch_size: float,
    momentum: float = 0.0,
    trials: int = 0,
    generator: Optional[torch.Generator] = None,
    clean_singular_values: Optional[Tensor] = None,
) -> MatrixDiagnostics:
    """Every diagnostic of one clean gradient matrix for a DP-SGD setting (σ, C, B̄), optional β.

    ``recoverable`` is B̄ ≥ B* (plain, no momentum), as in the paper's tables.
    ``trials`` > 0 adds the Monte Carlo cosines; the noisy spectrum
    statistics use one simulated draw (``generator``).
    """
    g = as_matrix(clean).double()
    m, n = g.shape
    s = noise_std(noise_multiplier, max_grad_norm, batch_size)
    sv = clean_singular_values if clean_singular_values is not None else singular_values(g)
    sigma1 = float(sv[0]) if sv.numel() else 0.0
    gen = generator or torch.Generator().manual_seed(0)
    noisy = g + s * torch.randn(g.shape, generator=gen, dtype=torch.float64)
    nsv = singular_values(noisy)
    b_star = recovery_batch_size(sigma1, noise_multiplier, max_grad_norm, m, n)
    pl, pr = predicted_cosines(sigma1, s, m, n)
    mc = monte_carlo_cosines(g, s, trials, gen) if trials else None
    return MatrixDiagnostics(
        shape=(int(m), int(n)),
        batch_size=float(batch_size),
        noise_multiplier=float(noise_multiplier),
        max_grad_norm=float(max_grad_norm),
        momentum=float(momentum),
        noise_std=s,
        sigma1=sigma1,
        frobenius=float(torch.linalg.matrix_norm(g)),
        effective_rank=effective_rank(sv),
        stable_rank=stable_rank(sv),
        noisy_effective_rank=effective_rank(nsv),
        noisy_stable_rank=stable_rank(nsv),
        spectral_snr=spectral_snr(g, s),
        threshold_ratio=threshold_ratio(sigma1, s, m, n),
        b_star=b_star,
        b_star_momentum=recovery_batch_size(sigma1, noise_multiplier, max_grad_norm, m, n, momentum),
        recoverable=bool(batch_size >= b_star),
        predicted_left=pl,
        predicted_right=pr,
        mc=mc,
    )
