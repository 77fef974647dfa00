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
sampled term is one cached PLD self-composed ``count`` times.

Neighbouring relation: the ledger's relation is passed to dp_accounting
(``REPLACE_ONE`` adjacency models Poisson sampling under ``replace_one``).

Cost: estimated from the grid (:func:`~dpopt.accounting.cost.estimate_pld_cost`);
above the budget a coarser grid (a 1-2-5 step, at most
:data:`~dpopt.accounting.cost.MAX_PLD_DISCRETIZATION`) is used — pessimistic
rounding keeps ε an upper bound — and the report says so; beyond that the
accountant refuses with advice.

A leaf behind :mod:`dpopt.accounting.registry`: :func:`pld_epsilon_report`
has the registry's common signature ``(ledger, delta, *, budget)``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.privacy_accountant import NeighboringRelation

from .capture import captured, library_note
from .cost import DEFAULT_BUDGET, MAX_PLD_DISCRETIZATION, CostBudget, EpsilonReport, estimate_pld_cost
from .events import flatten_gaussian_terms, ledger_event, ledger_relation
from .ledger import EventLike
from .validation import check_delta

__all__ = ["PLD_DISCRETIZATION", "pld_epsilon_report", "pld_epsilon"]

#: Value-discretisation interval (in nats of privacy loss) of the accurate PLD.
#: 1e-4 is dp_accounting's default, so ``"pld"`` ε equals dp_accounting's.
PLD_DISCRETIZATION = 1e-4

_RELATIONS = {"add_or_remove_one": NeighboringRelation.ADD_OR_REMOVE_ONE,
              "replace_one": NeighboringRelation.REPLACE_ONE}


@functools.lru_cache(maxsize=32)
def _sampled_gaussian_pld(sigma: float, q: float, d: float, relation: NeighboringRelation):
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


def _pld_terms_epsilon(terms, delta: float, d: float, relation: NeighboringRelation) -> float:
    total = None
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
            part = _sampled_gaussian_pld(sigma, q, d, relation)
            if count > 1:
                part = part.self_compose(count)
        total = part if total is None else total.compose(part)
    eps = float(total.get_epsilon_for_delta(delta))
    return math.inf if math.isnan(eps) else max(0.0, eps)


def _nice_up(x: float) -> float:
    """x rounded up to 1, 2 or 5 times a power of ten (readable grid steps)."""
    e = math.floor(math.log10(x))
    for m in (1.0, 2.0, 5.0, 10.0):
        if m * 10.0**e >= x * (1 - 1e-12):
            return m * 10.0**e
    return 10.0 ** (e + 1)


def _pld_report(ledger: EventLike, delta: float, d: float, budget: Optional[CostBudget]) -> EpsilonReport:
    relation_name = ledger_relation(ledger)
    terms = flatten_gaussian_terms(ledger_event(ledger))
    if not terms:
        return EpsilonReport(0.0, delta, "pld", d)
    if any(sigma == 0.0 for (_, sigma) in terms):
        return EpsilonReport(math.inf, delta, "pld", d)
    replace = relation_name == "replace_one"
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
                "not grow with the number of steps), or a larger noise multiplier")
        coarse = estimate_pld_cost(terms, needed, replace)
        notes = (f"pld: the accurate grid ({d:g} nats) would need {est.describe()}; used a coarser grid of "
                 f"{needed:g} nats ({coarse.describe()}); pessimistic rounding keeps epsilon an upper bound",)
        d, est, coarsened = needed, coarse, True
    try:
        eps, messages = captured(_pld_terms_epsilon, terms, delta, d, _RELATIONS[relation_name])
    except MemoryError:
        raise ValueError(
            "the pld accountant ran out of memory on this ledger (a very small noise multiplier gives an "
            "enormous privacy-loss distribution, and epsilon is huge anyway); use accountant 'rdp', or a "
            "larger noise multiplier") from None
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
        step used): ε ≥ 0 (``math.inf`` if any release has σ = 0; 0.0 for an
        empty ledger).

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
