"""One-run audit of a real training run: m canaries, one ``dpopt train`` configuration, one ε lower bound.

:func:`one_run` trains a :class:`~dpopt.training.TrainConfig` once with m
canaries, each included independently with probability ½ (Steinke, Nasr &
Jagielski 2023, arXiv 2305.08846), scores every canary and turns the scores
into both lower bounds of :mod:`dpopt.auditing.one_run_stats`, next to the ε
the run's own ledger claims.

* **White box** (``mode="white"``; Dirac gradient canaries on dedicated
  coordinates, Nasr et al. 2023 arXiv 2302.07956 / Steinke et al. §5): the
  optimizer trains the model's parameters plus one extra vector ``canary`` of
  m coordinates that no loss touches. Canary j is an example whose per-sample
  gradient is zero on the model and A·e_j on ``canary`` in the clip space
  (A = 10⁴·C, so an honest privatizer clips it to exactly C). Included
  canaries are Poisson-sampled at the run's rate q like every other example
  and enter the Privatizer as one more per-sample source of the step: they
  are clipped, summed, noised and charged by the library's real code. The
  auditor sees every release (white box); canary j's score is the
  likelihood-ratio statistic Σ_t log(1 − q + q·exp((x_t − ½)/σ²)) of its
  coordinate's released values x_t, in units of the sensitivity
  (x_t = (g̃_t[j] − shift)/scale · B̄ / S_t): Neyman–Pearson optimal for the
  honest step, and any score gives a valid bound.
* **Correlated noise** (``cfg.noise_mechanism`` banded or BLT; :mod:`dpopt.correlated_noise`): the
  white-box run holds a fresh stream of the run's strategy C, σ and participation, so its ledger is the
  mechanism's (ε of ONE Gaussian at the strategy's sensitivity, or the amplified rounds of cyclic
  Poisson sampling) — not independent noise's. The real examples come from the run's cyclic (Poisson)
  batches, and canary j sits in batch (part) j mod b, public like the run's partition: it takes part
  at every step of that batch (cyclic), or at each step of its part with probability q (cyclic
  Poisson). The score is the likelihood ratio of C·x (x the canary coordinate's T releases, C·x =
  C·p + σz): :func:`_mf_scores`. A cyclic-batch run is one Gaussian mechanism, μ-GDP with μ = Δ/σ
  (the ledger's ``mechanism`` record), so its f-DP μ bound is judged as at full batch.
* **Black box** (``mode="black"``): m input canaries — random inputs with the
  training data's shape and scale, each with a random label — are appended to
  the training set when included; the run is the ordinary training loop
  (:func:`dpopt.training.loop.run_steps`) on that set; a canary's score is
  minus the final model's loss on it.

Verdict (at confidence 1 − β): ``"EXCEEDS"`` when Steinke et al.'s bound (sound
for any (ε, δ)-DP run) is above the claimed ε, or — for a run whose trade-off
curve is Gaussian (``sample_rate = 1``: T composed Gaussians, μ-GDP exactly; or
correlated noise over cyclic batches: one Gaussian, μ = Δ/σ) — when the f-DP μ bound
is above the claimed μ. With q < 1 the f-DP figure is
reported but not judged: the claimed subsampled mechanism is not μ-GDP for
the μ that matches its ε, so a Gaussian-shaped claim is not what the
accountant promised.

The audit's own randomness (canary inclusion, directions, labels) comes from
``seed`` (``None``: fresh OS entropy, never recorded); the run's noise and Poisson
masks are the run's (secret unless the configuration asks for reproducible noise;
``dpopt audit --one-run --seed S`` asks for both, without it both are secret). Everything here is an experiment
on canaries, not on anyone's data: the scores are of canaries only.

Example::

    >>> from dpopt.training import TrainConfig
    >>> from dpopt.auditing import one_run
    >>> r = one_run(TrainConfig(method="dp-sgd", epochs=1, noise_multiplier=1.0), canaries=200)
    >>> r.verdict, r.m
    ('PASS', 200)
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from .one_run_stats import OneRunBound, one_run_bounds
from .stats import gdp_epsilon

__all__ = ["OneRunResult", "one_run", "MODES", "CANARY_FACTOR", "REPRODUCIBLE_AUDIT_WARNING"]

MODES = ("white", "black")

#: Warned (once) by :func:`one_run` for a ``reproducible_noise`` configuration, in place of the training
#: build's warning: the audit keeps no run directory, so there is no ledger for ``dpopt check`` to fail.
REPRODUCIBLE_AUDIT_WARNING = (
    "reproducible_noise: the audited run's Gaussian noise and Poisson masks are seeded from the published "
    "seed, so anyone who knows it can replay them: NO privacy guarantee (research reruns only)"
)
#: clip-space size of a white-box canary in units of the clip bound (clipped to exactly C)
CANARY_FACTOR = 1e4


@dataclass
class OneRunResult:
    """A one-run audit.

    Attributes:
        mode: ``"white"`` or ``"black"``; method: the training method.
        m: canaries; included: bool ``[m]`` (which were in the training set);
            scores: ``[m]`` (higher: more likely included).
        epsilon: the ε the run's ledger claims at ``delta`` (its accountant).
        epsilon_lower: the bound judged (``estimator``'s), at confidence 1 − β.
        estimator: ``"steinke"`` or ``"fdp"`` — the larger of the bounds judged.
        bounds: the :class:`~dpopt.auditing.one_run_stats.OneRunBound` (both estimators).
        claimed_mu: μ of the run when it is exactly μ-GDP (``sample_rate`` 1; or correlated noise over cyclic
            batches: Δ/σ from the ledger's ``mechanism`` record), else None.
        verdict: ``"PASS"`` or ``"EXCEEDS"``.
        delta, beta: as used; confidence = 1 − β.
        details: public facts of the run (steps, q, σ, clip bound, clipping; with correlated noise also
            ``noise_mechanism``, ``sampling``, ``participations``, ``min_separation``, ``mechanism_sensitivity``).
    """

    mode: str
    method: str
    m: int
    included: np.ndarray
    scores: np.ndarray
    epsilon: float
    epsilon_lower: float
    estimator: str
    bounds: OneRunBound
    claimed_mu: Optional[float]
    verdict: str
    delta: float
    beta: float
    details: dict = field(default_factory=dict)

    @property
    def confidence(self) -> float:
        """1 − β."""
        return 1.0 - self.beta

    def to_dict(self) -> dict:
        """JSON-ready summary (no per-canary arrays): the ``--json`` document of ``dpopt audit --one-run``."""
        return {
            "mode": self.mode,
            "method": self.method,
            "m": self.m,
            "epsilon_lower": self.epsilon_lower,
            "epsilon": self.epsilon,
            "estimator": self.estimator,
            "confidence": self.confidence,
            "delta": self.delta,
            "verdict": self.verdict,
            "claimed_mu": self.claimed_mu,
            "epsilon_lower_steinke": self.bounds.steinke,
            "epsilon_lower_fdp": self.bounds.fdp,
            "mu_lower_fdp": self.bounds.mu,
            "bounds": asdict(self.bounds),
            "details": dict(self.details),
        }


# --------------------------------------------------------------------------- white-box sources
def _split_geometry(geometry, n_model: int):
    """(geometry of the model's parameters, (shift, scale) of the canary vector or Nones)."""
    from ..types import ClipGeometry

    shift, scale = geometry.shift, geometry.scale
    model_geo = ClipGeometry(
        None if shift is None else tuple(shift[:n_model]), None if scale is None else tuple(scale[:n_model])
    )
    return model_geo, (None if shift is None else shift[n_model]), (None if scale is None else scale[n_model])


def _base_w(shift, scale, like: torch.Tensor) -> torch.Tensor:
    """Clip-space image (0 − shift)/scale of a zero gradient (zeros for the identity geometry)."""
    if shift is None:
        return torch.zeros_like(like)
    return -shift / (scale if scale is not None else 1.0)


class _WithCanaryVector:
    """A real micro-batch source extended by the canary vector, on which its examples' gradient is 0."""

    def __init__(self, source, canary: nn.Parameter):
        self.source, self.canary = source, canary
        self.num_params = source.num_params + 1
        self.batch_size = getattr(source, "batch_size", 0)
        self.nonfinite = getattr(source, "nonfinite", 0)
        params = getattr(source, "params", None)
        self.params = None if params is None else tuple(params) + (canary,)
        self.points = getattr(source, "points", None)

    def sq_norms(self, geometry, groups, num_groups):
        model_geo, shift, scale = _split_geometry(geometry, self.num_params - 1)
        sq = self.source.sq_norms(model_geo, list(groups)[:-1], num_groups)
        base = _base_w(shift, scale, self.canary)
        if shift is not None:
            sq = sq.clone()
            sq[:, groups[-1]] += float((base.double() ** 2).sum())
        return sq

    def weighted_sum(self, weights, geometry, groups):
        model_geo, shift, scale = _split_geometry(geometry, self.num_params - 1)
        out = list(self.source.weighted_sum(weights, model_geo, list(groups)[:-1]))
        base = _base_w(shift, scale, self.canary)
        out.append(base * weights[:, groups[-1]].sum().to(base.dtype))
        return out


class _CanaryRows:
    """The sampled canaries of one step: example i has clip-space image base + A·e_{j_i} on the canary vector.

    Zero gradient on the model's parameters (their clip-space image is the
    geometry's base, as for any zero gradient).
    """

    def __init__(
        self, rows: torch.Tensor, model_params: Sequence[torch.Tensor], canary: nn.Parameter, size: float, points
    ):
        self.rows, self.model_params, self.canary, self.size = rows, list(model_params), canary, float(size)
        self.num_params = len(self.model_params) + 1
        self.batch_size = int(rows.numel())
        self.nonfinite = 0
        self.params = tuple(self.model_params) + (canary,)
        self.points = points

    def _bases(self, geometry):
        shift, scale = geometry.shift, geometry.scale
        return [
            _base_w(None if shift is None else shift[i], None if scale is None else scale[i], p)
            for i, p in enumerate(self.params)
        ]

    def sq_norms(self, geometry, groups, num_groups):
        bases = self._bases(geometry)
        per_group = torch.zeros(num_groups, dtype=torch.float64)
        for g, b in zip(groups, bases):
            per_group[g] += float((b.double() ** 2).sum())
        sq = per_group.repeat(self.batch_size, 1)
        c = bases[-1].double()[self.rows]
        sq[:, groups[-1]] += (c + self.size) ** 2 - c**2
        return sq

    def weighted_sum(self, weights, geometry, groups):
        bases = self._bases(geometry)
        out = [b * weights[:, g].sum().to(b.dtype) for g, b in zip(groups, bases)]
        w = weights[:, groups[-1]].to(out[-1].dtype)
        out[-1] = out[-1].index_add(0, self.rows, w * self.size)
        return out


def _lr_score(x: torch.Tensor, q: float, sigma: float) -> torch.Tensor:
    """log(1 − q + q·exp((x − ½)/σ²)): one step's log-likelihood ratio, canary sampled-at-q vs absent."""
    a = (x - 0.5) / (sigma * sigma)
    if q >= 1.0:
        return a
    return torch.logaddexp(torch.full_like(a, math.log1p(-q)), math.log(q) + a)


def _canary_slots(m: int, separation: int) -> np.ndarray:
    """Canary j's batch (cyclic batches) or part (cyclic Poisson) j mod b: public, like the run's partition."""
    return np.arange(m) % int(separation)


def _sampled_canaries(
    members: torch.Tensor, slots: torch.Tensor, step: int, mechanism, q: float, gen: torch.Generator
) -> torch.Tensor:
    """The included canaries that take part in ``step``, as the run's sampler treats an example.

    Independent noise: Poisson at q. Correlated noise: cyclic batches (the canaries of batch ``step mod b``,
    every time), or cyclic Poisson (those of part ``step mod b'``, each with probability q).
    """
    if mechanism is None:
        return members[torch.rand(members.numel(), generator=gen) < q] if q < 1 else members
    part = members[slots[members] == step % mechanism.participation.min_separation]
    rate = mechanism.sample_rate
    if rate is None or rate >= 1.0:
        return part
    return part[torch.rand(part.numel(), generator=gen) < rate]


def _mf_scores(
    x: np.ndarray, strategy_matrix: np.ndarray, slots: np.ndarray, separation: int, sigma: float, sample_rate
) -> np.ndarray:
    """Likelihood-ratio scores of canaries under correlated noise (DP matrix factorization).

    ``x`` ``[T, m]`` holds each canary coordinate's releases in sensitivity units, x = p + σ·C⁻¹z
    (p ∈ {0, 1}^T the canary's participations, z ~ N(0, I)), so y = C·x = C·p + σz: the Gaussian mechanism
    on C·p the accountant charges (Denisov et al. 2022, arXiv 2202.08312). Cyclic batches (``sample_rate``
    None): p is the fixed pattern of the canary's batch r (steps ≡ r mod b) and the score is the exact log
    likelihood ratio (⟨y, C·p⟩ − ½‖C·p‖²)/σ². Cyclic Poisson (banded, bands ≤ b'): the columns C·e_t of one
    part's steps have disjoint supports, so u_t = ⟨y, C·e_t⟩ are independent given p and the log likelihood
    ratio is Σ_{t ≡ r} log(1 − q + q·exp((u_t − ½‖C·e_t‖²)/σ²)) (Choquette-Choo et al., arXiv 2306.08153,
    Thm 4). With C = I these are the independent-noise scores. Returns float64 ``[m]``.
    """
    steps = x.shape[0]
    y = strategy_matrix @ x
    t = np.arange(steps)
    if sample_rate is None:
        patterns = np.zeros((steps, separation))
        patterns[t, t % separation] = 1.0
        v = strategy_matrix @ patterns  # [T, b]: C·p_r
        inner = np.einsum("tj,tj->j", y, v[:, slots])
        return (inner - 0.5 * (v**2).sum(0)[slots]) / sigma**2
    u = strategy_matrix.T @ y  # [T, m]: ⟨y, C·e_t⟩
    a = (u - 0.5 * (strategy_matrix**2).sum(0)[:, None]) / sigma**2
    q = float(sample_rate)
    lr = a if q >= 1.0 else np.logaddexp(math.log1p(-q), math.log(q) + a)
    return np.where((t[:, None] % separation) == slots[None, :], lr, 0.0).sum(0)


def _white_box(cfg, data, included: np.ndarray, gen: torch.Generator) -> tuple[np.ndarray, float, dict]:
    from ..accounting.incremental import EpsilonTracker
    from ..accounting.ledger import PrivacyLedger
    from ..correlated_noise import CorrelatedNoise
    from ..distributed import DistributedContext
    from ..engine import iter_per_sample_sources
    from ..methods import build_optimizer, get_method
    from ..sampling import PoissonSampler
    from ..training.build import build_run, privacy_options, run_sampler

    if cfg.clipping == "per-layer":
        raise ValueError(
            "the white-box one-run audit adds a canary vector to the clipped parameters, which "
            "per-layer clipping has no bound for; audit clipping 'flat' or 'quantile', or use "
            "mode='black'"
        )
    run = build_run(cfg, data, stacklevel=4)
    model = run.model
    params = [p for p in model.parameters() if p.requires_grad]
    m = included.size
    canary = nn.Parameter(torch.zeros(m, device=run.device))
    privacy, _ = privacy_options(cfg, model, run.noise_multiplier, float(run.hparams["max_grad_norm"]))
    built = run.optimizer.privatizer.mechanism
    mech = None
    if built is not None:  # correlated noise: a fresh stream of the run's strategy, σ and participation
        mech = CorrelatedNoise(built.strategy, built.participation, built.noise_multiplier, built.sample_rate)
        privacy["mechanism"] = mech
    ledger = PrivacyLedger(dataset_size="unused" if cfg.sample_rate is not None else "public")
    bbar = float(run.optimizer.privatizer.expected_batch_size)  # B̄, or N/b (cyclic), q·N/b' (cyclic Poisson)
    opt = build_optimizer(
        get_method(cfg.method),
        params + [canary],
        run.hparams,
        expected_batch_size=bbar,
        sample_rate=run.sample_rate,
        ledger=ledger,
        noise=run.noise,
        model=model,
        **privacy,
    )
    q, steps, dist = run.sample_rate, run.steps, DistributedContext()
    sigma = float(opt.privatizer.noise_multiplier)
    # the real examples: Poisson at q, or the cyclic (Poisson) batches the mechanism is accounted for
    sampler = PoissonSampler(run.data.n_train, q, steps, noise=run.noise) if mech is None else run_sampler(run, dist)
    members = torch.as_tensor(np.flatnonzero(included), dtype=torch.long)
    separation = 1 if mech is None else mech.participation.min_separation
    slots = _canary_slots(m, separation)
    scores = torch.zeros(m, dtype=torch.float64)
    released = []  # correlated noise: every release of the canary coordinates, scored at the end

    def loss_fn(out, target):
        return nn.functional.cross_entropy(out, target)

    for step in range(steps):
        idx = sampler.sample()
        x, y = run.data.x_train[idx].to(run.device), run.data.y_train[idx].to(run.device)
        points = opt.evaluation_points()
        sampled = _sampled_canaries(members, torch.as_tensor(slots), step, mech, q, gen)
        bound = float(opt.privatizer.bounds[0])  # flat or quantile: one group (this step's bound)
        sens = float(opt.privatizer.sensitivity)  # before the step: quantile clipping moves it after
        real = (
            _WithCanaryVector(s, canary)
            for s in iter_per_sample_sources(model, loss_fn, x, y, cfg.physical_batch_size, points)
        )
        rows = _CanaryRows(sampled.to(run.device), params, canary, CANARY_FACTOR * bound, tuple(points))
        release = opt.step(_chain(real, rows))
        g = release.grads[-1].detach().double().cpu()
        geo = release.geometry
        if geo.shift is not None:
            g = g - geo.shift[-1].double().cpu()
        if geo.scale is not None:
            g = g / geo.scale[-1].double().cpu()
        if mech is None:
            scores += _lr_score(g * bbar / sens, q, sigma)
        else:
            released.append((g * bbar / sens).numpy())
    if mech is not None:
        matrix = mech.strategy.matrix(mech.participation.steps)[:steps, :steps]
        scores = torch.from_numpy(_mf_scores(np.stack(released), matrix, slots, separation, sigma, mech.sample_rate))
    eps = EpsilonTracker(cfg.delta, cfg.accountant).epsilon(ledger)
    details = {
        "steps": steps,
        "sample_rate": q if mech is None else mech.sample_rate,
        "noise_multiplier": sigma,
        "expected_batch_size": bbar,
        "clipping": cfg.clipping,
        "score": "likelihood ratio of the released canary coordinate"
        if mech is None
        else "likelihood ratio of C·(the released canary coordinates) (correlated noise)",
        **_mechanism_details(ledger),
    }
    return scores.numpy(), eps, details


def _mechanism_details(ledger) -> dict:
    """The public facts of a correlated-noise ledger the verdict reads (none for independent noise).

    ``claimed_mu``: a mechanism over cyclic batches is ONE Gaussian mechanism with multiplier σ/Δ (its
    ledger events compose to exactly that, docs/correlated-noise.md), so it is μ-GDP with μ = Δ/σ, read
    from the ledger's ``mechanism`` record; amplified (cyclic Poisson) runs are not μ-GDP for that μ.
    """
    rec = ledger.mechanism
    if rec is None:
        return {}
    amplified = rec.get("sample_rate") is not None
    return {
        "noise_mechanism": rec["kind"],
        "sampling": ledger.sampling,
        "participations": rec["participations"],
        "min_separation": rec["min_separation"],
        "mechanism_sensitivity": rec["sensitivity"],
        "claimed_mu": None if amplified else float(rec["sensitivity"]) / float(rec["noise_multiplier"]),
    }


def _chain(real, rows):
    yield from real
    yield rows


# --------------------------------------------------------------------------- black box
def _black_box(cfg, data, included: np.ndarray, gen: torch.Generator) -> tuple[np.ndarray, float, dict]:
    from dataclasses import replace

    from ..training.build import build_run
    from ..training.loop import run_steps

    m = included.size
    shape = tuple(data.x_train.shape[1:])
    mean, std = float(data.x_train.mean()), float(data.x_train.std())
    xc = (mean + std * torch.randn((m,) + shape, generator=gen)).to(data.x_train.dtype)
    yc = torch.randint(0, data.num_classes, (m,), generator=gen)
    keep = torch.as_tensor(included)
    aug = replace(data, x_train=torch.cat([data.x_train, xc[keep]]), y_train=torch.cat([data.y_train, yc[keep]]))
    run = build_run(replace(cfg, out=None), aug, stacklevel=4)
    run_steps(run)
    run.model.eval()
    with torch.no_grad():
        out = run.model(xc.to(run.device))
        loss = nn.functional.cross_entropy(out, yc.to(run.device), reduction="none")
    run.model.train()
    from ..accounting.incremental import EpsilonTracker

    eps = EpsilonTracker(cfg.delta, cfg.accountant).epsilon(run.ledger)
    details = {
        "steps": run.steps,
        "sample_rate": run.sample_rate,
        "noise_multiplier": run.noise_multiplier,
        "expected_batch_size": float(cfg.batch_size),
        "clipping": cfg.clipping,
        "score": "minus the final model's loss on the canary (random input, random label)",
        **_mechanism_details(run.ledger),
    }
    mech = run.optimizer.privatizer.mechanism
    if mech is not None:  # correlated noise: q is the within-part rate of cyclic Poisson, or none (cyclic)
        details["sample_rate"] = mech.sample_rate
    return (-loss).double().cpu().numpy(), eps, details


# --------------------------------------------------------------------------- the audit
def _claimed_mu(epsilon: float, delta: float) -> float:
    """μ of the μ-GDP mechanism whose ε(δ) is ``epsilon`` (the claim, read as Gaussian)."""
    from scipy import optimize

    if epsilon <= 0:
        return 0.0
    hi = 1.0
    while gdp_epsilon(hi, delta) < epsilon:
        hi *= 2.0
    return float(optimize.brentq(lambda mu: gdp_epsilon(mu, delta) - epsilon, 0.0, hi, xtol=1e-10))


def one_run(
    cfg=None,
    *,
    canaries: int = 1000,
    mode: str = "white",
    beta: float = 0.05,
    seed: Optional[int] = 0,
    data=None,
    guess_counts=None,
) -> OneRunResult:
    """Train ``cfg`` once with ``canaries`` canaries (each in w.p. ½) and bound its ε from their scores.

    Args:
        cfg: a :class:`~dpopt.training.TrainConfig` (default: DP-SGD on digits,
            the config's other defaults). Its ``out`` is ignored: an audit writes no run directory.
        canaries: m ≥ 10.
        mode: ``"white"`` (gradient canaries on dedicated coordinates, scored
            on the releases) or ``"black"`` (mislabelled input canaries, scored
            on the final model's loss).
        beta: 1 − confidence, in (0, 1).
        seed: the audit's randomness (inclusion, canaries); None draws it from OS entropy (secret, not
            recorded: ``details["seed"]`` is None). The run's noise is the run's (``cfg.reproducible_noise``).
        data: a loaded :class:`~dpopt.data.Dataset` (default: ``cfg.dataset`` loaded).
        guess_counts: as for :func:`~dpopt.auditing.one_run_stats.one_run_bounds`.

    Returns:
        :class:`OneRunResult`.

    Raises:
        ValueError: m < 10, unknown mode, β outside (0, 1), per-layer clipping
            in white box; the configuration's own errors (named fields).

    Warns:
        UserWarning: :data:`REPRODUCIBLE_AUDIT_WARNING`, once, when ``cfg.reproducible_noise`` (the
            training build's own warning, which names ``dpopt check``, is not shown: no run directory is kept).
    """
    from ..data import load_dataset
    from ..training import TrainConfig
    from ..training.build import REPRODUCIBLE_NOISE_WARNING

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    m = int(canaries)
    if m < 10:
        raise ValueError(f"canaries must be >= 10 (use 1e3-1e4 for a useful bound), got {canaries}")
    if not 0.0 < float(beta) < 1.0:
        raise ValueError(f"beta must be in (0, 1) (1 - confidence), got {beta}; e.g. 0.05")
    cfg = cfg if cfg is not None else TrainConfig(method="dp-sgd")
    data = data if data is not None else load_dataset(cfg.dataset, cfg.data_dir)
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    if getattr(cfg, "reproducible_noise", False):
        warnings.warn(REPRODUCIBLE_AUDIT_WARNING, UserWarning, stacklevel=2)
    with warnings.catch_warnings():  # the build's own warning names `dpopt check`: this run keeps no ledger
        warnings.filterwarnings("ignore", message=re.escape(REPRODUCIBLE_NOISE_WARNING), category=UserWarning)
        scores, eps, details = (_white_box if mode == "white" else _black_box)(cfg, data, included, gen)
    bounds = one_run_bounds(scores[included], scores[~included], cfg.delta, beta, guess_counts=guess_counts)
    if "claimed_mu" in details:  # correlated noise: μ = Δ/σ of the ledger's mechanism record (cyclic batches)
        claimed_mu = details["claimed_mu"]
    else:  # independent noise: exactly μ-GDP at full batch (T composed Gaussians)
        claimed_mu = _claimed_mu(eps, cfg.delta) if float(details["sample_rate"]) >= 1.0 else None
    gaussian = claimed_mu is not None
    judged = {"steinke": bounds.steinke}
    if gaussian:
        judged["fdp"] = bounds.fdp
    estimator = max(judged, key=judged.get)  # type: ignore[arg-type]
    exceeds = bounds.steinke > eps or (gaussian and bounds.mu > claimed_mu)
    details = dict(details, fdp_judged=gaussian, seed=seed)
    if "noise_mechanism" in details:  # correlated noise: named with its parameter, as the user spells it
        from ..accounting.matrix_factorization import parse_mechanism

        kind, size = parse_mechanism(cfg.noise_mechanism)
        details["noise_mechanism"] = f"{kind}:{size}"
    return OneRunResult(
        mode=mode,
        method=cfg.method,
        m=m,
        included=included,
        scores=scores,
        epsilon=float(eps),
        epsilon_lower=float(judged[estimator]),
        estimator=estimator,
        bounds=bounds,
        claimed_mu=claimed_mu,
        verdict="EXCEEDS" if exceeds else "PASS",
        delta=float(cfg.delta),
        beta=float(beta),
        details=details,
    )
