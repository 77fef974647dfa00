"""The PLD accountant: connect-the-dots privacy-loss distributions (the default accountant).

Privacy-loss-distribution accounting (Koskela et al. 2020; Meiser &
Mohammadi 2018) with the *connect-the-dots* discretisation and pessimistic
rounding (Doroshenko, Ghazi, Kamath, Kumar, Manurangsi 2022, "Connect the
Dots: Tighter Discrete Approximations of Privacy Loss Distributions"), built
with ``dp_accounting.pld.privacy_loss_distribution``. dpopt builds the PLD
itself with ``use_connect_dots=True`` and ``pessimistic_estimate=True`` stated
explicitly, so a change of library default cannot silently change the method.
(In dp_accounting 0.6 the ``PLDAccountant`` also uses connect-the-dots for
Poisson-sampled Gaussians: it calls ``from_gaussian_mechanism`` whose default
is ``use_connect_dots=True``; the tests pin that both agree.)

The ledger is reduced to counts of (q, σ) terms by
:func:`~dpopt.accounting.events.flatten_gaussian_terms`; Gaussians released on
the same Poisson batch are one Gaussian of σ_eff there (exact). Unsampled
Gaussians compose exactly (``count`` releases at σ = one at σ/√count); each
sampled term is one cached PLD self-composed ``count`` times. A ledger of
unsampled Gaussians only (e.g. correlated noise on cyclic batches without
amplification: one Gaussian at the strategy's sensitivity) needs no grid: its
ε is the analytic Gaussian's (Balle & Wang 2018), exact and rounded up, so
the cost estimate and its coarser-grid note do not apply (``resolution`` None).

Neighbouring relation: the ledger's relation is passed to dp_accounting
(``REPLACE_ONE`` adjacency models Poisson sampling under ``replace_one``).

Cost: estimated from the grid (:func:`~dpopt.accounting.cost.estimate_pld_cost`);
above the budget a coarser grid (a 1-2-5 step, at most
:data:`~dpopt.accounting.cost.MAX_PLD_DISCRETIZATION`) is used — pessimistic
rounding keeps ε an upper bound — and the report says so; beyond that the
accountant refuses with advice.

A leaf behind :mod:`dpopt.accounting.registry`: :func:`pld_epsilon_report`
has the registry's common signature ``(ledger, delta, *, budget)``.

Fast construction (calibration's bisection only). dp_accounting builds a
connect-the-dots PLD by evaluating the hockey-stick divergence δ(ε_k) at every
grid point ε_k = k·d with a Python loop over the points (one scalar
``inverse_privacy_loss`` each: ~70k calls at d = 1e-4, ~0.5 s, most of an
evaluation). :func:`fast_pld_epsilon` computes the same δ(ε_k) with one
vectorised numpy expression (the same formulas, ``_vector_deltas``) and hands
them to dp_accounting's own ``create_pmf_pessimistic_connect_dots_fixed_gap``;
the result agrees with dp_accounting's to rounding (tested to 1e-9 relative in
ε). It is used only on the cheap, coarse levels of
:func:`~dpopt.accounting.calibration.calibrate_noise_multiplier`'s search: every
ε that dpopt REPORTS (``pld_epsilon``, ``epsilon``, the calibration's final
check) comes from dp_accounting's unmodified construction.

Long runs (issue 42). The ledger reaches the accountant as run-length groups
reduced to (q, σ) counts, so the cost of one ε depends on the PLD's support,
not on the number of releases. Three caches keep repeated ε calls cheap, none
of which changes a value beyond FFT rounding: (1) the Chernoff truncation
bounds of a self-composition (dp_accounting's ``compute_self_convolve_bounds``)
need 40 log-sum-exps over the single-step PLD; they are computed once per
(σ, q, grid), and :func:`_self_compose` builds dp_accounting's ``self_compose``
arrays (same bounds and FFT length; the real-input FFT, half the work); (2) each
self-composed (q, σ, count) part is kept, so a new kind of event re-composes
only its own part, not the groups before it; (3) ε of identical terms is
remembered. dp_accounting's ``get_epsilon_for_delta`` walks the PMF in a Python
loop (0.1-0.4 s on a long run's PLD); :func:`_pmf_epsilon_for_delta` is the same
scan with cumulative sums (the same sequential additions; ``np.exp`` for
``math.exp``), equal to the library's to rounding (tested to 1e-9 relative).
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any, Optional

import numpy as np
from dp_accounting.pld import pld_pmf as pmf_lib
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.privacy_accountant import NeighboringRelation
from scipy import fft as sp_fft
from scipy import special

from .capture import captured, library_note
from .cost import DEFAULT_BUDGET, MAX_PLD_DISCRETIZATION, CostBudget, EpsilonReport, estimate_pld_cost
from .events import flatten_gaussian_terms, ledger_event, ledger_relation
from .ledger import EventLike
from .validation import check_delta

__all__ = ["PLD_DISCRETIZATION", "pld_epsilon_report", "pld_epsilon", "fast_pld_epsilon"]

#: Value-discretisation interval (in nats of privacy loss) of the accurate PLD.
#: 1e-4 is dp_accounting's default, so ``"pld"`` ε equals dp_accounting's.
PLD_DISCRETIZATION = 1e-4

_RELATIONS = {
    "add_or_remove_one": NeighboringRelation.ADD_OR_REMOVE_ONE,
    "replace_one": NeighboringRelation.REPLACE_ONE,
}


@functools.lru_cache(maxsize=32)
def _sampled_gaussian_pld(sigma: float, q: float, d: float, relation: NeighboringRelation) -> Any:
    """One Poisson-sampled Gaussian step's PLD (cached: building it is ~70% of an ε evaluation).

    PLD objects are not mutated by ``compose``/``self_compose`` (they return new ones), so
    sharing a cached instance is safe; training loops re-score the same (σ, q) every epoch.
    """
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=sigma,
        sampling_prob=q,
        value_discretization_interval=d,
        pessimistic_estimate=True,
        use_connect_dots=True,
        neighboring_relation=relation,
    )


def _vector_deltas(mech: Any, eps: np.ndarray, q: float, remove: bool) -> np.ndarray:
    """δ(ε) of a Poisson-sampled Gaussian ``mech`` (dp_accounting ``GaussianPrivacyLoss``, sensitivity 1) at every
    ε of ``eps`` at once: ``mech.get_delta_for_epsilon(eps)`` without its per-point Python loop.

    The same formulas as dp_accounting 0.6 (``AdditiveNoisePrivacyLoss.get_delta_for_epsilon`` and
    ``_inverse_privacy_loss_{add,remove}``): with L(ε) = log(e^ε/q + 1 − 1/q) (REMOVE; ADD uses −L(−ε)) the
    cut-off is x = −1/2 − σ²L (REMOVE) or 1 − 1/2 − σ²L (ADD) and
    δ = μ_upper_cdf(x) − e^{ε + μ_lower_log_cdf(x)},
    clipped to [0, 1]; below log(1−q) (REMOVE) δ = 1 − e^ε, above −log(1−q) (ADD) δ = 0.
    """
    a = 1.0 / q
    log_a, log_neg_c = np.log(a), np.log(-(1.0 - a))
    bound = math.log1p(-q) if remove else -math.log1p(-q)
    deltas = np.zeros_like(eps, dtype=float)
    inside = eps > bound if remove else eps < bound
    if remove:
        deltas[~inside] = -np.expm1(eps[~inside])
    e = eps[inside]
    s2 = mech._standard_deviation**2
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        b = e if remove else -e
        dd = b + log_a  # log(a·e^b + c) = dd + log1p(−e^{log(−c) − dd}) (dp_accounting's _log_sub)
        loss = dd + np.log1p(-np.exp(log_neg_c - dd))
        loss = np.where(b == 0, np.log(a + (1.0 - a)), loss)  # its b == 0 branch: log(a + c)
        near = np.abs(e - bound) <= 1e-9 * np.maximum(np.abs(e), abs(bound))  # math.isclose: the unsampled limit
        if remove:
            x = np.where(near, math.inf, -0.5 - loss * s2)
        else:
            x = np.where(near, -math.inf, 1.0 + (-0.5 + loss * s2))
        deltas[inside] = mech.mu_upper_cdf(x) - np.exp(e + mech.mu_lower_log_cdf(x))
    return np.clip(deltas, 0, 1)


@functools.lru_cache(maxsize=32)
def _fast_sampled_gaussian_pld(sigma: float, q: float, d: float, relation: NeighboringRelation) -> Any:
    """:func:`_sampled_gaussian_pld` with the δ(ε_k) of every grid point computed at once (:func:`_vector_deltas`).

    Only for add-or-remove adjacency and q < 1 (else, or if dp_accounting's internals moved, the library's own
    construction is returned). For the calibration's cheap levels only: never for a reported ε.
    """
    if relation != NeighboringRelation.ADD_OR_REMOVE_ONE or not 0.0 < q < 1.0:
        return _sampled_gaussian_pld(sigma, q, d, relation)
    try:
        from dp_accounting.pld import pld_pmf
        from dp_accounting.pld import privacy_loss_mechanism as plm

        pmfs = []
        for adjacency in (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD):
            mech = plm.GaussianPrivacyLoss(
                sigma,
                sensitivity=1,
                pessimistic_estimate=True,
                log_mass_truncation_bound=-50,
                sampling_prob=q,
                adjacency_type=adjacency,
            )
            bounds = mech.connect_dots_bounds()
            hi, lo = math.ceil(bounds.epsilon_upper / d), math.floor(bounds.epsilon_lower / d)
            deltas = _vector_deltas(mech, np.arange(lo, hi + 1) * d, q, adjacency == plm.AdjacencyType.REMOVE)
            pmfs.append(pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(d, lo, hi, deltas))
        return pld_lib.PrivacyLossDistribution(pmfs[0], pmfs[1])
    except (AttributeError, TypeError, ImportError):  # another dp_accounting: its own (slower) construction
        return _sampled_gaussian_pld(sigma, q, d, relation)


#: Tail mass truncated by a self-composition (dp_accounting's ``self_compose`` default).
_TAIL_MASS = 1e-15


class _SelfComposer:
    """dp_accounting's ``DensePLDPmf.self_compose(n, 1e-15)`` with the truncation bounds' log-MGFs computed once.

    ``compose(n)`` returns the library's PMF: the same Chernoff truncation bounds (the 40 log-sum-exps
    over the single-step PMF, which do not depend on ``n``, are cached), the same FFT length, the same
    offsets and infinity mass; the convolution power is taken with the real-input FFT
    (``irfft(rfft(x)**n)``, half the work of ``real(ifft(fft(x)**n))``), which differs from the
    library's probabilities by FFT rounding only (about 1e-17 absolute, below the 1e-15 of mass the
    library truncates; tested to 1e-15).
    """

    def __init__(self, pmf: Any) -> None:
        self.pmf = pmf
        x = pmf._probs
        self.orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / len(x)
        self.log_mgfs = [special.logsumexp(np.arange(len(x)) * order, b=x) for order in self.orders]

    def _bounds(self, n: int) -> tuple[int, int]:
        upper, lower = (len(self.pmf._probs) - 1) * n, 0
        for order, log_mgf in zip(self.orders, self.log_mgfs):  # as common.compute_self_convolve_bounds
            bound = (n * log_mgf + math.log(2 / _TAIL_MASS)) / order
            if not math.isfinite(bound):
                continue
            if order > 0:
                upper = min(upper, math.ceil(bound))
            if order < 0:
                lower = max(lower, math.floor(bound))
        return lower, upper

    def compose(self, n: int) -> Any:
        pmf, x = self.pmf, self.pmf._probs
        lo, hi = self._bounds(n)
        out_len = hi - lo + 1
        fast_len = sp_fft.next_fast_len(max(out_len, len(x)))
        conv = sp_fft.irfft(sp_fft.rfft(x, fast_len) ** n, fast_len)  # the real part of ifft(fft(x)**n)
        probs = np.array(np.roll(conv, -lo)[:out_len])
        inf_prob = _TAIL_MASS - math.expm1(n * math.log1p(-pmf._infinity_mass))
        return pmf_lib.DensePLDPmf(
            pmf._discretization, pmf._lower_loss * n + lo, probs, inf_prob, pmf._pessimistic_estimate
        )


@functools.lru_cache(maxsize=32)
def _composer(sigma: float, q: float, d: float, relation: NeighboringRelation, fast: bool = False) -> Optional[tuple]:
    """The :class:`_SelfComposer` of each PMF (remove, add) of one sampled step's PLD; None if not dense.

    ``fast``: of :func:`_fast_sampled_gaussian_pld`'s PLD (the calibration's cheap levels)."""
    pld = (_fast_sampled_gaussian_pld if fast else _sampled_gaussian_pld)(sigma, q, d, relation)
    pmfs = (pld._pmf_remove,) if pld._symmetric else (pld._pmf_remove, pld._pmf_add)
    if not all(type(p) is pmf_lib.DensePLDPmf for p in pmfs):
        return None
    return tuple(_SelfComposer(p) for p in pmfs)


def _self_compose(
    sigma: float, q: float, d: float, relation: NeighboringRelation, count: int, fast: bool = False
) -> Any:
    """``_sampled_gaussian_pld(sigma, q, d, relation).self_compose(count)``, the same PLD (class docstring)."""
    composers = _composer(sigma, q, d, relation, fast)
    if composers is None:
        return (_fast_sampled_gaussian_pld if fast else _sampled_gaussian_pld)(sigma, q, d, relation).self_compose(
            count
        )
    return pld_lib.PrivacyLossDistribution(*(c.compose(count) for c in composers))


#: Self-composed parts by (σ, q, grid, relation, count): a new kind of event re-composes its own part only.
_PARTS: "collections.OrderedDict" = collections.OrderedDict()
_PARTS_MAX = 2  # each can be tens of MB on a long run: a constant, never growing, retention
#: ε by (terms, δ, grid, relation): an unchanged ledger is not scored twice.
_EPSILONS: "collections.OrderedDict" = collections.OrderedDict()
_EPSILONS_MAX = 256


def _part(sigma: float, q: float, d: float, relation: NeighboringRelation, count: int, fast: bool = False) -> Any:
    key = (sigma, q, d, relation, count, fast)
    if key in _PARTS:
        _PARTS.move_to_end(key)
        return _PARTS[key]
    part = (_fast_sampled_gaussian_pld if fast else _sampled_gaussian_pld)(sigma, q, d, relation)
    if count > 1:
        part = _self_compose(sigma, q, d, relation, count, fast)
    _PARTS[key] = part
    while len(_PARTS) > _PARTS_MAX:
        _PARTS.popitem(last=False)
    return part


def _pmf_epsilon_for_delta(pmf: Any, delta: float) -> float:
    """dp_accounting's ``DensePLDPmf.get_epsilon_for_delta`` as one vectorised scan (module docstring).

    The library walks the losses from the largest down, adding each probability to the upper mass and
    ``e^{-loss}``·probability to the lower one, and stops before the first loss ≤ log((upper − δ)/lower).
    Here the running masses are ``np.cumsum`` (sequential additions, as the loop's) and the stop is the
    first index where that holds; the losses are accumulated the same way (``itertools.count``).
    """
    inf_mass = pmf._infinity_mass
    if inf_mass > delta:
        return math.inf
    d, probs = pmf._discretization, np.flip(pmf._probs)
    m = len(probs)
    upper_loss = (pmf._lower_loss + m - 1) * d
    losses = np.cumsum(np.concatenate(([upper_loss], np.full(m - 1, -d))))  # itertools.count's additions
    upper = np.cumsum(np.concatenate(([inf_mass], probs)))  # upper[i]: before adding probs[i]
    lower = np.cumsum(np.concatenate(([0.0], np.exp(-losses) * probs)))
    with np.errstate(divide="ignore", invalid="ignore"):
        stop = (upper[:-1] > delta) & (lower[:-1] > 0) & (np.log((upper[:-1] - delta) / lower[:-1]) >= losses)
    done = (upper[1:] >= delta) & (lower[1:] == 0)  # the loop returns max(0, loss) after adding i
    i_stop = int(np.argmax(stop)) if stop.any() else m
    i_done = int(np.argmax(done)) if done.any() else m
    if i_done < i_stop:
        return max(0.0, float(losses[i_done]))
    mass_upper, mass_lower = float(upper[i_stop]), float(lower[i_stop])
    if mass_upper <= mass_lower + delta:
        return 0.0
    return math.log((mass_upper - delta) / mass_lower)


def _pld_epsilon_for_delta(pld: Any, delta: float) -> float:
    """``pld.get_epsilon_for_delta(delta)`` with :func:`_pmf_epsilon_for_delta` for dense PMFs."""
    pmfs = (pld._pmf_remove,) if pld._symmetric else (pld._pmf_remove, pld._pmf_add)
    if not all(type(p) is pmf_lib.DensePLDPmf for p in pmfs):
        return pld.get_epsilon_for_delta(delta)
    return max(_pmf_epsilon_for_delta(p, delta) for p in pmfs)


def _pld_terms_epsilon(terms: dict, delta: float, d: float, relation: NeighboringRelation, fast: bool = False) -> float:
    key = (tuple(sorted(terms.items())), delta, d, relation, fast)
    if key in _EPSILONS:
        _EPSILONS.move_to_end(key)
        return _EPSILONS[key]
    eps = _pld_terms_epsilon_uncached(terms, delta, d, relation, fast)
    _EPSILONS[key] = eps
    while len(_EPSILONS) > _EPSILONS_MAX:
        _EPSILONS.popitem(last=False)
    return eps


def _pld_terms_epsilon_uncached(
    terms: dict, delta: float, d: float, relation: NeighboringRelation, fast: bool = False
) -> float:
    total: Any = None
    for (q, sigma), count in terms.items():
        if q >= 1.0:
            # Gaussians compose exactly: count releases at σ = one at σ/√count.
            part = pld_lib.from_gaussian_mechanism(
                standard_deviation=sigma / math.sqrt(count),
                value_discretization_interval=d,
                pessimistic_estimate=True,
                use_connect_dots=True,
                neighboring_relation=relation,
            )
        else:
            part = _part(sigma, q, d, relation, int(count), fast)
        total = part if total is None else total.compose(part)
    eps = float(_pld_epsilon_for_delta(total, delta))
    return math.inf if math.isnan(eps) else max(0.0, eps)


def _gaussian_log_delta(mu: float, eps: float) -> float:
    """log δ(ε) of the Gaussian mechanism N(0, 1) vs N(μ, 1), μ = sensitivity/σ > 0.

    Balle & Wang 2018 ("Improving the Gaussian mechanism", Thm 8; dp_accounting ``gaussian_mechanism``):
    δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ), evaluated in log space (``log_ndtr``); −inf where δ = 0.
    """
    x = float(special.log_ndtr(mu / 2.0 - eps / mu))
    y = eps + float(special.log_ndtr(-mu / 2.0 - eps / mu))
    return x + math.log1p(-math.exp(y - x)) if y < x else -math.inf


def _unsampled_gaussian_epsilon(terms: dict, delta: float, replace: bool) -> float:
    """Exact ε(δ) of a composition of unsampled Gaussians (every term q = 1), rounded up: an upper bound.

    ``count`` releases at noise multipliers σᵢ compose to one Gaussian with σ_eff = (Σ countᵢ/σᵢ²)^(−1/2)
    (the stacked release; Dong, Roth & Su 2019, Cor. 3.3), whose ε(δ) is the analytic Gaussian's
    (Balle & Wang 2018, Thm 8) at μ = Δ/σ_eff, Δ = 1 (add/remove) or 2 (replace-one, as dp_accounting's REPLACE
    adjacency). :func:`~dpopt.accounting.matrix_factorization.gaussian_epsilon` finds the root to 1e-12; the result is raised until
    δ(ε) ≤ δ holds at it, so it is never below the true ε. No grid: the connect-the-dots PLD of the same
    Gaussian would need ~ (μ²/2 + 20μ)/1e-4 grid points (millions for σ_eff ≲ 0.3) for the same number.
    """
    from .matrix_factorization import gaussian_epsilon  # the project's analytic-Gaussian root (1e-12)

    mu = (2.0 if replace else 1.0) * math.sqrt(sum(count / sigma**2 for (_, sigma), count in terms.items()))
    eps = gaussian_epsilon(mu, delta)
    if eps <= 0.0:
        return 0.0
    log_delta, step = math.log(delta), 1e-12 * max(1.0, eps)
    eps += step
    while _gaussian_log_delta(mu, eps) > log_delta:
        step *= 2.0
        eps += step
    return eps


def _nice_up(x: float) -> float:
    """x rounded up to 1, 2 or 5 times a power of ten (readable grid steps)."""
    e = math.floor(math.log10(x))
    for m in (1.0, 2.0, 5.0, 10.0):
        if m * 10.0**e >= x * (1 - 1e-12):
            return m * 10.0**e
    return 10.0 ** (e + 1)


def _pld_report(
    ledger: EventLike, delta: float, d: float, budget: Optional[CostBudget], fast: bool = False
) -> EpsilonReport:
    relation_name = ledger_relation(ledger)
    terms = flatten_gaussian_terms(ledger_event(ledger))
    if not terms:
        return EpsilonReport(0.0, delta, "pld", d)
    if any(sigma == 0.0 for (_, sigma) in terms):
        return EpsilonReport(math.inf, delta, "pld", d)
    replace = relation_name == "replace_one"
    if all(q >= 1.0 for (q, _) in terms):
        return EpsilonReport(_unsampled_gaussian_epsilon(terms, delta, replace), delta, "pld", None)
    est = estimate_pld_cost(terms, d, replace)
    notes: tuple = ()
    coarsened = False
    if budget is not None and not est.within(budget):
        needed = _nice_up(d * est.scale_to(budget))
        if needed > MAX_PLD_DISCRETIZATION:
            raise ValueError(
                f"the pld accountant would need {est.describe()} for this ledger (grid {d:g} nats), and even "
                f"its coarsest allowed grid ({MAX_PLD_DISCRETIZATION:g} nats) exceeds the budget of "
                f"{budget.seconds:g} s / {budget.memory_bytes / 1e9:g} GB; use accountant 'rdp' (its cost does "
                "not grow with the number of steps), or a larger noise multiplier"
            )
        coarse = estimate_pld_cost(terms, needed, replace)
        notes = (
            f"pld: the accurate grid ({d:g} nats) would need {est.describe()}; used a coarser grid of "
            f"{needed:g} nats ({coarse.describe()}); pessimistic rounding keeps epsilon an upper bound",
        )
        d, est, coarsened = needed, coarse, True
    try:
        eps, messages = captured(_pld_terms_epsilon, terms, delta, d, _RELATIONS[relation_name], fast)
    except MemoryError:
        raise ValueError(
            "the pld accountant ran out of memory on this ledger (a very small noise multiplier gives an "
            "enormous privacy-loss distribution, and epsilon is huge anyway); use accountant 'rdp', or a "
            "larger noise multiplier"
        ) from None
    return EpsilonReport(eps, delta, "pld", d, coarsened, est, notes + library_note("dp_accounting", messages))


def pld_epsilon_report(
    ledger: EventLike,
    delta: float,
    value_discretization_interval: float = PLD_DISCRETIZATION,
    budget: Optional[CostBudget] = DEFAULT_BUDGET,
) -> EpsilonReport:
    """ε(δ) with the connect-the-dots PLD accountant, with the grid used (an upper bound).

    Args:
        ledger: a :class:`~dpopt.accounting.ledger.PrivacyLedger` or a DpEvent.
        delta: δ ∈ (0, 1).
        value_discretization_interval: PLD grid step in nats (default 1e-4,
            the accurate setting of :func:`~dpopt.accounting.accountant.epsilon`).
        budget: cost budget (default 30 s / 4 GB): a grid whose estimated cost
            exceeds it is replaced by a coarser one (still an upper bound;
            recorded in ``coarsened`` and ``notes``); None uses the grid as given.

    Returns:
        :class:`~dpopt.accounting.cost.EpsilonReport` (``resolution`` = the grid
        step used; None for a ledger of unsampled Gaussians only, whose ε is
        the analytic Gaussian's, no grid): ε ≥ 0 (``math.inf`` if any release
        has σ = 0; 0.0 for an empty ledger).

    Raises:
        ValueError: invalid δ, discretisation, an unsupported event, or (with
            a budget) a ledger too large even for the coarsest grid.

    Source: Doroshenko et al. 2022 (connect the dots); dp_accounting
    ``privacy_loss_distribution.from_gaussian_mechanism``.
    """
    delta = check_delta(delta)
    d = float(value_discretization_interval)
    if not (0.0 < d <= 1.0):
        raise ValueError(f"value_discretization_interval must be in (0, 1], got {value_discretization_interval!r}")
    return _pld_report(ledger, delta, d, budget)


def pld_epsilon(
    ledger: EventLike,
    delta: float,
    value_discretization_interval: float = PLD_DISCRETIZATION,
    budget: Optional[CostBudget] = None,
) -> float:
    """ε(δ) with the connect-the-dots PLD accountant (pessimistic, an upper bound).

    Args:
        ledger: a :class:`PrivacyLedger` or a DpEvent.
        delta: δ ∈ (0, 1).
        value_discretization_interval: PLD grid step in nats. Coarser grids are
            faster and (being pessimistic) give larger ε; ``1e-4`` is the
            accurate setting used by :func:`epsilon`.
        budget: if given, a grid whose estimated cost exceeds it is replaced
            by a coarser one (still an upper bound); None uses the grid as given.

    Returns:
        ε ≥ 0 (``math.inf`` if any release has σ = 0; 0.0 for an empty ledger).

    Raises:
        ValueError: invalid δ, discretisation, an unsupported event, or (with
            a budget) a ledger too large even for the coarsest grid.

    Source: Doroshenko et al. 2022 (connect the dots); dp_accounting
    ``privacy_loss_distribution.from_gaussian_mechanism``.
    """
    return pld_epsilon_report(ledger, delta, value_discretization_interval, budget).epsilon


def fast_pld_epsilon(
    ledger: EventLike,
    delta: float,
    value_discretization_interval: float,
    budget: Optional[CostBudget] = None,
) -> float:
    """:func:`pld_epsilon` with the vectorised construction of the sampled-Gaussian PLDs (module docstring).

    Agrees with :func:`pld_epsilon` to rounding (a few ulps of each δ(ε_k); tested to 1e-9 relative in ε), and
    is ~10x faster to build at fine grids. A search aid for
    :func:`~dpopt.accounting.calibration.calibrate_noise_multiplier`'s cheap levels: not an accountant, never
    a reported ε (which always comes from dp_accounting's own construction).

    Args, returns and raises: as :func:`pld_epsilon`.
    """
    delta = check_delta(delta)
    d = float(value_discretization_interval)
    if not (0.0 < d <= 1.0):
        raise ValueError(f"value_discretization_interval must be in (0, 1], got {value_discretization_interval!r}")
    return _pld_report(ledger, delta, d, budget, fast=True).epsilon
