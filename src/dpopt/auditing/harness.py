"""The canary harness: one-step empirical audits of the real Privatizer.

:func:`audit_privatizer` runs the library's :class:`~dpopt.privatizer.Privatizer`
(or any subclass) many times on a tiny problem with a worst-case canary
per-sample gradient present or absent, scores each release along the canary
direction (:class:`CanaryHarness`), computes the two lower bounds of
:func:`~dpopt.auditing.stats.epsilon_lower_bounds`, and compares them with the
accountant's one-step ε (:func:`claimed_one_step`).

Which claimed ε is compared: audits run with ``sample_rate = 1`` (the canary
is in the batch, or not, deterministically), so the mechanism actually run is
the unsampled (composed) Gaussian and the claim is
``epsilon(privatizer.step_event(), δ)`` for that q = 1 event — the plain
Gaussian's ε at σ_eff = (Σ σᵢ⁻²)^(−1/2). Privacy amplification by Poisson
sampling is not audited here (at q < 1 the one-step ε at δ = 1e-5 is too
small to resolve with 10⁵ trials, and the harness would have to sample the
whole batch, not only the canary); a privatizer with q < 1 is refused.

An honest mechanism is reported as LEAK with probability ≤ α (default
α = 1e-3 per mechanism).

Example::

    >>> import torch
    >>> from dpopt.privatizer import Privatizer
    >>> from dpopt.auditing import audit_privatizer
    >>> gen = torch.Generator().manual_seed(0)   # reproducible noise: an audit is an experiment
    >>> r = audit_privatizer(lambda: Privatizer(1.0, 1.0, 8.0, 1.0, generator=gen), [(2, 3), (2,)],
    ...                      trials=20_000)
    >>> r.verdict, round(r.claimed_epsilon, 2)
    ('PASS', 4.38)
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch
from dp_accounting import dp_event

from ..accounting.accountant import epsilon
from ..accounting.events import collapse_for_pld
from ..engine.reference import PerSampleGrads
from ..privatizer import Privatizer
from ..types import ClipGeometry
from .stats import DEFAULT_ALPHA, DEFAULT_DELTA, _check_alpha, _check_delta, epsilon_lower_bounds

__all__ = [
    "DEFAULT_TRIALS",
    "AuditResult",
    "ClaimedStep",
    "CanaryScores",
    "HarnessConfig",
    "CanaryHarness",
    "claimed_one_step",
    "canary_scores",
    "audit_privatizer",
]

DEFAULT_TRIALS = 100_000


# --------------------------------------------------------------------------- results
@dataclass
class AuditResult:
    """One mechanism's audit.

    Attributes:
        name: mechanism or method name.
        claimed_epsilon: accountant's one-step ε (PLD) of ``privatizer.step_event()`` at δ.
        claimed_mu: 1/σ_eff when the claimed event is an unsampled (composed)
            Gaussian, else ``None`` (then the GDP route is informational only).
        epsilon_direct, epsilon_gdp, mu_lower: the lower bounds (see
            :class:`~dpopt.auditing.stats.EpsilonLowerBounds`).
        mu_point: point estimate (mean_in − mean_out)/std_out of the scores (diagnostic only).
        verdict: ``"PASS"`` (every applicable lower bound ≤ claim) or ``"LEAK"``.
        trials: total releases (in + out); delta, alpha: as used.
        mode: ``"vectorised"`` (one release carries many trials, exact for the
            plain Privatizer) or ``"loop"`` (one fresh privatizer and one
            release per trial).
        seconds: wall time of the audit.
        details: the chosen tests, evaluation sizes and score moments (JSON-ready).
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
        """The fields as a JSON-ready dict (``inf`` written as the string ``"inf"``)."""
        out = asdict(self)
        for k, v in out.items():
            if isinstance(v, float) and math.isinf(v):
                out[k] = "inf"
        return out


class ClaimedStep(NamedTuple):
    """What the accountant claims for one step (unpacks as ``eps, mu = ...``).

    Attributes:
        epsilon: ε at δ of ``privatizer.step_event()`` (PLD).
        mu: 1/σ_eff when that event is an unsampled (composed) Gaussian, else ``None``.
    """

    epsilon: float
    mu: Optional[float]


class CanaryScores(NamedTuple):
    """Scores of the releases (unpacks as ``s_in, s_out, mode = ...``).

    Attributes:
        scores_in: shape ``[n_in]``, canary in the batch.
        scores_out: shape ``[n_out]``, canary absent.
        mode: ``"vectorised"`` or ``"loop"`` (see :class:`AuditResult`).
    """

    scores_in: np.ndarray
    scores_out: np.ndarray
    mode: str


class _ScoreWeights(NamedTuple):
    """Weights of the likelihood-ratio score: (gradient·X + count·Y) / norm."""

    gradient: float
    count: float  # type: ignore[assignment]
    norm: float


# --------------------------------------------------------------------------- the claim
def claimed_one_step(privatizer, delta: float) -> ClaimedStep:
    """The ε a privatizer's accountant claims for one step, and its μ if Gaussian.

    Args:
        privatizer: a :class:`~dpopt.privatizer.Privatizer` (or subclass).
        delta: δ in (0, 1).

    Returns:
        :class:`ClaimedStep` ``(epsilon, mu)``: ε = ``accountant.epsilon(privatizer.step_event(), δ)``
        (PLD); μ = 1/σ_eff when the event is ``PoissonSampled(1, Gaussian)`` or
        ``PoissonSampled(1, Composed(Gaussians))``, else ``None``.

    Raises:
        ValueError: δ outside (0, 1).
    """
    event = privatizer.step_event()
    eps = epsilon(event, _check_delta(delta))
    flat = collapse_for_pld(event)
    mu = None
    if isinstance(flat, dp_event.PoissonSampledDpEvent) and float(flat.sampling_probability) == 1.0:
        flat = flat.event
    if isinstance(flat, dp_event.GaussianDpEvent):
        sigma = float(flat.noise_multiplier)
        mu = math.inf if sigma == 0 else 1.0 / sigma
    return ClaimedStep(eps, mu)


# --------------------------------------------------------------------------- the harness
@dataclass(frozen=True)
class HarnessConfig:
    """How the canary trials are built and run (public, synthetic choices only).

    Attributes:
        geometry: the :class:`~dpopt.transforms.base.ClipGeometry` the
            privatizer clips in (``None``: identity, shift 0 and scale 1).
        canary_factor: canary w-space norm in units of C_k (≥ 1, so an honest
            privatizer clips it to exactly C_k).
        background_norms: the fixed background examples' w-space norms in units of C_k.
        vectorize: ``None`` = automatic (vectorised exactly when the
            privatizer is a plain ``Privatizer`` without quantile clipping);
            ``True`` on another privatizer is refused; ``False`` forces loop mode.
        chunk: trials per release in vectorised mode (≥ 1; memory ∝ chunk²).
        seed: seeds the canary/background directions and torch's global RNG
            during the trials (the privatizer's own noise is seeded by the
            ``generator=`` it was built with, if any).

    Raises:
        ValueError: ``canary_factor < 1`` or ``chunk < 1``.
    """

    geometry: Optional[ClipGeometry] = None
    canary_factor: float = 1000.0
    background_norms: Sequence[float] = (0.5, 2.0, 1.5)
    vectorize: Optional[bool] = None
    chunk: int = 32
    seed: int = 0

    def __post_init__(self):
        if not float(self.canary_factor) >= 1.0:
            raise ValueError(
                f"canary_factor must be >= 1 (the canary must reach the clip bound), got {self.canary_factor}"
            )
        if int(self.chunk) < 1:
            raise ValueError(f"chunk must be >= 1 (trials per release), got {self.chunk}")


@dataclass
class _Canary:
    """The fixed examples of every trial, in w-space (w = (g − shift)/scale) and as gradients.

    All tensors float64 and param-shaped (lists over parameters).
    """

    shapes: list
    groups: list  # group index per parameter
    bounds: list  # C_k per group
    shift: list
    scale: list
    canary_w: list  # w-space canary: norm canary_factor × C_k per group
    delta_w: list  # the clipped canary (the sensitivity vector)
    sens_sq: float  # Σ_k C_k² over the groups present
    background_w: list  # list over examples of lists over params

    def to_grad(self, w: list) -> list:
        """Per-sample gradient whose w-space image is ``w``: g = shift + scale ⊙ w."""
        return [s + c * x for s, c, x in zip(self.shift, self.scale, w)]


def _vectorisable(privatizer) -> bool:
    """True when one release can carry many independent trials exactly.

    Holds for the plain :class:`Privatizer` without quantile clipping: its only
    cross-example operation is the clipped sum, and its noise is i.i.d. per
    coordinate, so trials embedded in disjoint coordinate blocks are
    independent copies of the one-step mechanism. Not for quantile clipping
    (one scalar count noise per release) or any subclass (it may do anything).
    """
    return type(privatizer) is Privatizer and privatizer.quantile is None


def _build_canary(privatizer, shapes, config: HarnessConfig) -> _Canary:
    """Draw the canary and background directions (seeded by ``config.seed``)."""
    shapes = [tuple(int(d) for d in s) for s in shapes]
    groups = privatizer.groups if privatizer.groups is not None else [0] * len(shapes)
    if len(groups) != len(shapes):
        raise ValueError(
            f"the privatizer's groups list has {len(groups)} entries (one per parameter) but "
            f"{len(shapes)} shapes were given"
        )
    bounds = list(privatizer.bounds)
    gen = torch.Generator().manual_seed(int(config.seed))
    f64 = torch.float64
    geometry = config.geometry

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
    canary_w = [float(config.canary_factor) * x for x in delta_w]
    sens_sq = sum(bounds[k] ** 2 for k in sorted(set(groups)))
    background = []
    for factor in config.background_norms:
        u = unit_per_group()
        background.append([factor * bounds[k] * x for x, k in zip(u, groups)])
    return _Canary(shapes, groups, bounds, shift, scale, canary_w, delta_w, sens_sq, background)


def _score_weights(template) -> _ScoreWeights:
    """Weights of the likelihood-ratio score of a privatizer's release.

    Gradient projection X (shift 1, std σ_g) and count Y (shift 1, std σ_c):
    the Neyman–Pearson statistic is X/σ_g² + Y/σ_c²; dividing by
    μ² = σ_g⁻² + σ_c⁻² puts the canary shift at 1 and the std at σ_eff.
    """
    sg = float(template.noise_multiplier)
    quant = getattr(template, "quantile", None)
    if sg == 0:
        return _ScoreWeights(1.0, 0.0, 1.0)
    wg = 1.0 / sg**2
    wc = 0.0
    if quant is not None:
        wc = 1.0 / float(quant.count_noise_multiplier) ** 2
    return _ScoreWeights(wg, wc, wg + wc)


class _RepeatedBatch:
    """The same private batch, asked the same questions in every loop-mode trial.

    Wraps a :class:`~dpopt.engine.reference.PerSampleGrads` and memoises its two
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
            if geo is geometry and grp == tuple(groups) and w.shape == weights.shape and torch.equal(w, weights):
                return [t.clone() for t in out]
        out = self.inner.weighted_sum(weights, geometry, groups)
        self._sums.append((geometry, tuple(groups), weights.clone(), out))
        if len(self._sums) > 64:  # weights that change every trial: keep memory bounded
            self._sums.pop(0)
        return [t.clone() for t in out]


def _stack_examples(grads_per_example: list, num_params: int) -> list:
    """[B, *shape] per parameter from a list over examples of lists over parameters."""
    return [torch.stack([ex[i] for ex in grads_per_example]) for i in range(num_params)]


class CanaryHarness:
    """Trials of one privatizer step with a canary example in or out of the batch.

    The batch of every trial holds ``len(config.background_norms)`` fixed
    background examples (random directions, per-group w-space norms
    ``factor × C_k``; the same in every trial) and, in "in" trials, the
    canary: per group k a w-space vector of norm ``canary_factor × C_k`` (so
    an honest privatizer clips it to exactly C_k and it moves the clipped sum
    by the full sensitivity √(Σ_k C_k²); an outlier this large also exposes
    any bound or noise level that reacts to the data). Gradients are
    g = shift + scale ⊙ w in ``config.geometry``.

    Score (normalised so that an honest mechanism gives in − out mean shift 1
    and std σ_eff): X = ⟨B̄·w̃, Δ⟩/‖Δ‖² with w̃ = (g̃ − shift)/scale the released
    gradient in w-space and Δ the clipped canary; with quantile clipping,
    combined with the released count Y = −2·(b̃ − ½)·B̄ (the canary's clipped
    bit moves the centred count by −½) as (X/σ² + Y/σ_c²)/(σ⁻² + σ_c⁻²), the
    Neyman–Pearson statistic of the composed release. σ, σ_c are read from a
    fresh privatizer (its public configuration); the count from the ledger
    entry's ``released_fraction``.

    Two ways to run the trials (``mode``):

    * ``"vectorised"`` (plain ``Privatizer`` without quantile clipping): one
      release carries ``chunk`` trials; trial t owns row t of every parameter
      ([T, *shape]). Example j of trial t has gradient ``shift`` everywhere
      except row t (its w-space image is zero outside row t), so its per-group
      norms, clip factors and contribution to the sum are exactly those of a
      one-trial batch; the noise on row t is i.i.d. N(0, (σS)²) as in a
      one-trial release. Chunks are all-in or all-out, so out-trials have no
      canary row at all (true add/remove).
    * ``"loop"`` (anything else): one fresh privatizer (``make_privatizer()``)
      and one release per trial, so adaptive state never carries over.

    Args:
        make_privatizer: ``() -> Privatizer``, a fresh privatizer with
            ``sample_rate == 1``; called once here (the template, whose public
            configuration sets the score) and once per trial in loop mode.
        shapes: parameter shapes (one per parameter of the privatizer's groups).
        config: :class:`HarnessConfig`.

    Raises:
        ValueError: q ≠ 1, bad shapes/geometry, or ``vectorize=True`` for a
            privatizer that cannot be vectorised.
    """

    def __init__(
        self,
        make_privatizer: Callable[[], Any],
        shapes: Sequence[Sequence[int]],
        config: HarnessConfig = HarnessConfig(),
    ):
        self.make_privatizer = make_privatizer
        self.config = config
        template = make_privatizer()
        if float(template.sample_rate) != 1.0:
            raise ValueError(
                f"audits run the unsampled mechanism: build the privatizer with sample_rate=1.0 (got "
                f"{template.sample_rate}); the claimed ε is then that of the q = 1 step event"
            )
        can_vec = _vectorisable(template)
        if config.vectorize and not can_vec:
            raise ValueError(
                "vectorize=True needs a plain Privatizer without quantile clipping "
                "(trials embedded in one release must be independent)"
            )
        self.template = template
        self.mode = "vectorised" if (can_vec if config.vectorize is None else bool(config.vectorize)) else "loop"
        self.canary = _build_canary(template, shapes, config)
        self.expected_batch_size = float(template.expected_batch_size)
        self.weights = _score_weights(template)
        self._background_grads = [self.canary.to_grad(w) for w in self.canary.background_w]
        self._canary_grad = self.canary.to_grad(self.canary.canary_w)
        self._dvec = [d / self.canary.sens_sq for d in self.canary.delta_w]  # so that ⟨Δ, dvec⟩ = 1

    def project(self, grads: Sequence[torch.Tensor], lead: int) -> torch.Tensor:
        """Scores ⟨B̄ w̃, Δ⟩/‖Δ‖² of released grads with ``lead`` leading (trial) dims.

        Returns:
            float64 tensor of shape ``grads[0].shape[:lead]``.
        """
        c = self.canary
        total = 0.0
        for g, s, sc, d in zip(grads, c.shift, c.scale, self._dvec):
            w = (g.to(torch.float64) - s) / sc * self.expected_batch_size
            total = total + (w * d).reshape(*w.shape[:lead], -1).sum(-1)
        return total  # type: ignore[return-value]

    def scores(self, n_in: int, n_out: int) -> CanaryScores:
        """Run ``n_in`` canary-in and ``n_out`` canary-out trials and score each release.

        Raises:
            ValueError: fewer than one trial per arm, or as the privatizer raises.
        """
        if int(n_in) < 1 or int(n_out) < 1:
            raise ValueError(f"need at least one trial per arm, got n_in={n_in}, n_out={n_out}")
        threads = torch.get_num_threads()
        # The tensors are tiny: one intra-op thread avoids thread hand-off costs that
        # dominate (10-20x) on a busy 2-core machine. Restored on exit.
        torch.set_num_threads(1)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(self.config.seed) + 1)
                run = self._vectorised if self.mode == "vectorised" else self._loop
                s_in, s_out = run(int(n_in), int(n_out))
        finally:
            torch.set_num_threads(threads)
        return CanaryScores(s_in, s_out, self.mode)

    def _vectorised(self, n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
        """Many trials per release of the template privatizer (see the class docstring)."""
        c = self.canary
        chunk = max(1, min(int(self.config.chunk), max(n_in, n_out)))

        def embedded(examples, t):
            n_s = len(examples)
            rows = torch.arange(t)
            tensors = []
            for i, shape in enumerate(c.shapes):
                e = c.shift[i].expand(n_s * t, t, *shape).clone()
                for j, ex in enumerate(examples):
                    e[rows * n_s + j, rows] = ex[i]
                tensors.append(e)
            return PerSampleGrads(tensors)

        geometry = ClipGeometry(
            tuple(s.expand(chunk, *s.shape) for s in c.shift), tuple(sc.expand(chunk, *sc.shape) for sc in c.scale)
        )
        out = []
        for n, examples in (
            (n_in, self._background_grads + [self._canary_grad]),
            (n_out, list(self._background_grads)),
        ):
            src = embedded(examples, chunk)
            scores = []
            done = 0
            while done < n:
                release = self.template.privatize(src, geometry)
                scores.append(self.project(release.grads, 1))
                done += chunk
            out.append(torch.cat(scores)[:n].numpy().copy())
        return out[0], out[1]

    def _loop(self, n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
        """One fresh privatizer and one release per trial (any privatizer, any adaptivity)."""
        c = self.canary
        wts = self.weights
        geometry = ClipGeometry(tuple(c.shift), tuple(c.scale))
        num = len(c.shapes)
        bg = self._background_grads
        src_in = _RepeatedBatch(PerSampleGrads(_stack_examples(bg + [self._canary_grad], num)))
        src_out = _RepeatedBatch(PerSampleGrads(_stack_examples(bg, num))) if bg else None
        zeros = [torch.zeros(s, dtype=torch.float64) for s in c.shapes]
        out = []
        for n, src in ((n_in, src_in), (n_out, src_out)):
            buf = [torch.empty(n, *s, dtype=torch.float64) for s in c.shapes]
            counts = np.zeros(n)
            for t in range(n):
                priv = self.make_privatizer()
                if src is None:
                    release = priv.privatize([], geometry, params_like=zeros)
                else:
                    release = priv.privatize(src, geometry)
                for b, g in zip(buf, release.grads):
                    b[t] = g
                if wts.count:
                    frac = priv.ledger.last_entry.meta.get("released_fraction")
                    if frac is None:
                        raise ValueError("quantile privatizer recorded no released_fraction; cannot score the count")
                    counts[t] = -2.0 * (float(frac) - 0.5) * self.expected_batch_size
            x = self.project(buf, 1).numpy()
            out.append((wts.gradient * x + wts.count * counts) / wts.norm)
        return out[0], out[1]


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
) -> CanaryScores:
    """Run one privatizer step per trial, canary in or out, and score each release.

    Shorthand for ``CanaryHarness(make_privatizer, shapes, HarnessConfig(...)).scores(n_in, n_out)``;
    the trials and the score are described in :class:`CanaryHarness`.

    Args:
        make_privatizer: ``() -> Privatizer``, a fresh privatizer with
            ``sample_rate == 1``; called once (vectorised mode) or once per
            trial (loop mode, so adaptive state never carries over), plus once
            for the template.
        shapes: parameter shapes (one per parameter of the privatizer's groups).
        n_in, n_out: numbers of trials with and without the canary (≥ 1).
        geometry, canary_factor, background_norms, vectorize, chunk, seed:
            the fields of :class:`HarnessConfig`.

    Returns:
        :class:`CanaryScores` ``(scores_in [n_in], scores_out [n_out], mode)``.

    Raises:
        ValueError: q ≠ 1, bad counts/shapes/geometry, ``canary_factor < 1``,
            or ``vectorize=True`` for a privatizer that cannot be vectorised.
    """
    if int(n_in) < 1 or int(n_out) < 1:
        raise ValueError(f"need at least one trial per arm, got n_in={n_in}, n_out={n_out}")
    config = HarnessConfig(
        geometry=geometry,
        canary_factor=canary_factor,
        background_norms=tuple(background_norms),
        vectorize=vectorize,
        chunk=chunk,
        seed=seed,
    )
    return CanaryHarness(make_privatizer, shapes, config).scores(n_in, n_out)


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

    Runs the :class:`CanaryHarness` with ``trials // 2`` canary-in and the
    rest canary-out trials, computes
    :func:`~dpopt.auditing.stats.epsilon_lower_bounds` (held-out selection),
    and compares with :func:`claimed_one_step`:

    * LEAK if the direct bound exceeds the claimed ε (sound for every mechanism);
    * LEAK if the claim is an unsampled (composed) Gaussian with parameter
      μ_claim and the GDP route's μ_lower exceeds μ_claim (for such a claim
      μ_lower ≤ μ_claim holds with probability ≥ 1 − α/2). Compared in μ, not
      in ε, so that the PLD discretisation of the claimed ε cannot cause a
      false alarm; since ε(μ) is increasing this is "GDP-route ε > claimed ε";
    * PASS otherwise. An honest mechanism is reported LEAK with probability ≤ α.

    Args:
        make_privatizer: ``() -> Privatizer`` with ``sample_rate == 1`` (see :class:`CanaryHarness`).
        shapes: parameter shapes.
        name: label for the result.
        geometry: clip geometry (``None``: identity).
        trials: total releases, ≥ 40 (10⁵ for the CLI default).
        delta: δ in (0, 1); alpha: false-alarm probability in (0, 1).
        canary_factor, background_norms, vectorize, seed: see :class:`HarnessConfig`.

    Returns:
        :class:`AuditResult`.

    Raises:
        ValueError: as :class:`CanaryHarness` and
            :func:`~dpopt.auditing.stats.epsilon_lower_bounds`, or ``trials < 40``.
    """
    delta = _check_delta(delta)
    alpha = _check_alpha(alpha)
    trials = int(trials)
    if trials < 40:
        raise ValueError(f"trials must be >= 40 (10 per arm and half), got {trials}; use ~1e5")
    start = time.perf_counter()
    claim = claimed_one_step(make_privatizer(), delta)
    config = HarnessConfig(
        geometry=geometry,
        canary_factor=canary_factor,
        background_norms=tuple(background_norms),
        vectorize=vectorize,
        seed=seed,
    )
    n_in = trials // 2
    s_in, s_out, mode = CanaryHarness(make_privatizer, shapes, config).scores(n_in, trials - n_in)
    bounds = epsilon_lower_bounds(s_in, s_out, delta, alpha, seed=seed)
    leak = bounds.direct > claim.epsilon or (claim.mu is not None and bounds.mu > claim.mu)
    sd = float(np.std(s_out))
    mu_point = float((np.mean(s_in) - np.mean(s_out)) / sd) if sd > 0 else math.inf
    return AuditResult(
        name=name,
        claimed_epsilon=claim.epsilon,
        claimed_mu=claim.mu,
        epsilon_direct=bounds.direct,
        epsilon_gdp=bounds.gdp,
        mu_lower=bounds.mu,
        mu_point=mu_point,
        verdict="LEAK" if leak else "PASS",
        trials=trials,
        delta=delta,
        alpha=alpha,
        mode=mode,
        seconds=time.perf_counter() - start,
        details={
            "direct_test": list(bounds.direct_test),
            "gdp_test": list(bounds.gdp_test),
            "n_eval_in": bounds.n_eval_in,
            "n_eval_out": bounds.n_eval_out,
            "score_mean_in": float(np.mean(s_in)),
            "score_mean_out": float(np.mean(s_out)),
            "score_std_in": float(np.std(s_in)),
            "score_std_out": sd,
        },
    )
