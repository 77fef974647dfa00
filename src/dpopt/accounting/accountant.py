"""Accountant functions: ε for a whole ledger (or DpEvent) at a given δ.

Three accountants read the same ledger:

* ``"pld"`` (default) — privacy-loss-distribution accounting (Koskela et al.
  2020; Meiser & Mohammadi 2018) with the *connect-the-dots* discretisation and
  pessimistic rounding (Doroshenko, Ghazi, Kamath, Kumar, Manurangsi 2022,
  "Connect the Dots: Tighter Discrete Approximations of Privacy Loss
  Distributions"), built with ``dp_accounting.pld.privacy_loss_distribution``.
  dpopt builds the PLD itself with ``use_connect_dots=True`` and
  ``pessimistic_estimate=True`` stated explicitly, so a change of library
  default cannot silently change the method. (In dp_accounting 0.6 the
  ``PLDAccountant`` also uses connect-the-dots for Poisson-sampled Gaussians:
  it calls ``from_gaussian_mechanism`` whose default is
  ``use_connect_dots=True``; the tests pin that both agree.) Gaussians released
  on the same Poisson batch are collapsed to one Gaussian of σ_eff first
  (exact; :func:`~dpopt.accounting.events.collapse_for_pld`).
* ``"rdp"`` — Rényi DP (Mironov 2017; Mironov, Talwar, Zhang 2019, "Rényi
  Differential Privacy of the Sampled Gaussian Mechanism") via
  ``dp_accounting.rdp.RdpAccountant``; takes composed events as they are.
* ``"prv"`` — privacy-random-variable accountant (Gopi, Lee, Wutschitz 2021,
  "Numerical Composition of Differential Privacy") via Microsoft's
  ``prv-accountant`` package (optional extra ``dpopt[prv]``); see
  :mod:`dpopt.accounting.prv`. Reports the certified upper bound.

Neighbouring relation: every accountant honours the ledger's relation for
every event kind or refuses the ledger. Under ``replace_one`` a Gaussian of
multiplier σ is an add/remove Gaussian of σ/2 (sensitivity 2C), so
ε_replace(σ) = ε_add/remove(σ/2) at q = 1. PLD models Poisson sampling under
``replace_one`` itself (dp_accounting's REPLACE adjacency); RDP and PRV refuse
Poisson-sampled steps under ``replace_one`` (no analysis in those libraries).

Cost: the ledger is reduced to counts of (q, σ) terms first (composition is
commutative), so a long ledger whose (σ, q) alternate costs as much as one
with two runs. The PLD and PRV accountants estimate their memory and time from
the grid they need (:mod:`dpopt.accounting.cost`) and, above the budget
(default 30 s or 4 GB), use a coarser grid that is still an upper bound on ε
(pessimistic PLD rounding; PRV's certified bound with a larger ε-error) and
say so (:func:`epsilon_report`; :func:`epsilon` warns with
:class:`AccountingWarning`), or refuse with advice when even the coarsest
allowed grid does not fit. dp_accounting's own warnings are captured and
summarised once.

ε is always computed by ONE accountant over the WHOLE ledger — never a sum of
per-epoch or per-release ε (summing is loose, and invalid once later steps
depend on earlier releases).

Conventions: ε is in nats (natural log), δ is a probability in (0, 1). A
release with noise multiplier 0 is not private: ε = ``math.inf``.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from typing import Optional, Union

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import rdp_privacy_accountant

from .cost import DEFAULT_BUDGET, MAX_PLD_DISCRETIZATION, CostBudget, EpsilonReport, estimate_pld_cost
from .events import flatten_gaussian_terms, ledger_event, ledger_relation, poisson_gaussian_step, summarize_event
from .ledger import PrivacyLedger
from .validation import ACCOUNTANTS, check_accountant, check_delta, check_sample_rate, check_steps

__all__ = [
    "ACCOUNTANTS",
    "AccountingWarning",
    "PLD_DISCRETIZATION",
    "RDP_ORDERS",
    "EventLike",
    "EpsilonReport",
    "check_delta",
    "check_accountant",
    "check_steps",
    "dpsgd_event",
    "epsilon",
    "epsilon_report",
    "dpsgd_epsilon",
    "pld_epsilon",
    "rdp_epsilon",
    "flatten_gaussian_terms",
]

#: Value-discretisation interval (in nats of privacy loss) of the accurate PLD.
#: 1e-4 is dp_accounting's default, so ``"pld"`` ε equals dp_accounting's.
PLD_DISCRETIZATION = 1e-4
#: Rényi orders α for the RDP accountant: a fine grid near 1 (where small ε
#: lives), the integers to 63 and a few large orders for tiny δ.
RDP_ORDERS = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
)

EventLike = Union[PrivacyLedger, dp_event.DpEvent]


class AccountingWarning(UserWarning):
    """ε was computed on a coarser grid than the accurate one (still an upper bound), or
    the underlying library warned (summarised once)."""


def dpsgd_event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_event.DpEvent:
    """The whole-run event of ``steps`` DP-SGD steps with Poisson rate q.

    Each step is :func:`~dpopt.accounting.events.poisson_gaussian_step` — the
    same builder the Privatizer's ledger entries come from — so calibrating
    and accounting see exactly the event the training run records.

    Args:
        noise_multiplier: σ ≥ 0 (noise std / L2 sensitivity).
        sample_rate: q ∈ (0, 1].
        steps: T ≥ 1.

    Raises:
        ValueError: invalid σ, q or T (see :mod:`.validation`).
    """
    step = poisson_gaussian_step(noise_multiplier, sample_rate)
    return dp_event.SelfComposedDpEvent(step, check_steps(steps))


_RELATIONS = {"add_or_remove_one": NeighboringRelation.ADD_OR_REMOVE_ONE,
              "replace_one": NeighboringRelation.REPLACE_ONE}


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _captured(fn, *args, **kwargs):
    """Call ``fn`` with warnings, absl log warnings (dp_accounting's RDP logs one per
    unconverged order) and floating-point warnings captured: (result, messages)."""
    absl = logging.getLogger("absl")
    handler, propagate = _Collect(), absl.propagate
    absl.addHandler(handler)
    absl.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught, np.errstate(all="ignore"):
            warnings.simplefilter("always")
            result = fn(*args, **kwargs)
    finally:
        absl.removeHandler(handler)
        absl.propagate = propagate
    messages = []
    texts = [str(w.message) or w.category.__name__ for w in caught]
    texts += [r.getMessage() for r in handler.records]
    for text in texts:
        text = text.strip().splitlines()[0] if text.strip() else "warning"
        if text not in messages:
            messages.append(text)
    return result, messages


def _library_note(name: str, messages: list) -> tuple:
    if not messages:
        return ()
    first = messages[0] if len(messages[0]) <= 160 else messages[0][:157] + "..."
    more = f" (and {len(messages) - 1} other message(s))" if len(messages) > 1 else ""
    return (f"{name} warned while computing epsilon: {first!r}{more}; the value reported is still "
            "the library's upper bound",)


# ---------------------------------------------------------------------------
# PLD
# ---------------------------------------------------------------------------
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
        eps, messages = _captured(_pld_terms_epsilon, terms, delta, d, _RELATIONS[relation_name])
    except MemoryError:
        raise ValueError(
            "the pld accountant ran out of memory on this ledger (a very small noise multiplier gives an "
            "enormous privacy-loss distribution, and epsilon is huge anyway); use accountant 'rdp', or a "
            "larger noise multiplier") from None
    return EpsilonReport(eps, delta, "pld", d, coarsened, est, notes + _library_note("dp_accounting", messages))


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
    delta = check_delta(delta)
    d = float(value_discretization_interval)
    if not (0.0 < d <= 1.0):
        raise ValueError(f"value_discretization_interval must be in (0, 1], got {value_discretization_interval!r}")
    return _pld_report(ledger, delta, d, budget).epsilon


# ---------------------------------------------------------------------------
# RDP
# ---------------------------------------------------------------------------
def _rdp_report(ledger: EventLike, delta: float, orders: tuple) -> EpsilonReport:
    relation_name = ledger_relation(ledger)
    replace = relation_name == "replace_one"
    event = ledger_event(ledger)
    summary = summarize_event(event)
    acc = rdp_privacy_accountant.RdpAccountant(list(orders), NeighboringRelation.ADD_OR_REMOVE_ONE)
    if summary.unsupported:
        # Not (sampled) Gaussians: dp_accounting's RDP reads the event as it is — but it does not
        # apply the replace-one relation to every event kind, so such ledgers are refused.
        if replace:
            raise ValueError(
                f"the rdp accountant cannot honour neighbouring=replace_one for these events "
                f"({', '.join(sorted(set(summary.unsupported)))}); use accountant 'pld' or an "
                "add_or_remove_one ledger")
        if not acc.supports(event):
            raise ValueError(f"the RDP accountant does not support this ledger's events: "
                             f"{', '.join(sorted(set(summary.unsupported)))}")
        _, messages = _captured(acc.compose, event)
    else:
        if not summary.terms:
            return EpsilonReport(0.0, delta, "rdp")
        if any(sigma == 0.0 for (_, sigma) in summary.terms):
            return EpsilonReport(math.inf, delta, "rdp")
        if replace and any(q < 1.0 for (q, _) in summary.terms):
            raise ValueError(
                "the rdp accountant has no analysis of Poisson-sampled releases under neighbouring="
                "replace_one (dp_accounting refuses them); use accountant 'pld', which models it")
        messages = []
        for (q, sigma), count in summary.terms.items():  # one term per distinct (q, σ): fast
            s = sigma / 2.0 if replace else sigma  # replace-one: sensitivity 2C, i.e. σ/2 at C
            ev = dp_event.GaussianDpEvent(s) if q >= 1.0 else \
                dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s))
            _, msgs = _captured(acc.compose, ev, int(count))
            messages += [m for m in msgs if m not in messages]
    eps, msgs = _captured(acc.get_epsilon, delta)
    messages += [m for m in msgs if m not in messages]
    eps = float(eps)
    eps = math.inf if math.isnan(eps) else max(0.0, eps)
    return EpsilonReport(eps, delta, "rdp", notes=_library_note("dp_accounting", messages))


def rdp_epsilon(ledger: EventLike, delta: float, orders: tuple = RDP_ORDERS) -> float:
    """ε(δ) with dp_accounting's Rényi DP accountant (an upper bound).

    The ledger is reduced to counts of (q, σ) terms first (Gaussians on one
    Poisson batch become σ_eff, which is what dp_accounting does itself), and
    each distinct term is composed once with its count — so ε of a long
    ledger whose (σ, q) alternate costs a few distinct RDP curves. Events must
    come from :mod:`dpopt.accounting.events`, whose float coercion avoids
    dp_accounting's silent drop of later Gaussians after an int multiplier.
    Under ``replace_one`` a Gaussian counts as σ/2 (dp_accounting's RDP does
    not apply the relation to ``GaussianDpEvent``).

    Raises:
        ValueError: invalid δ, or a ledger the RDP accountant cannot handle
            (Poisson sampling under ``replace_one``; unsupported event kinds).

    Source: Mironov 2017; Mironov, Talwar, Zhang 2019; conversion to (ε, δ) of
    Canonne, Kamath, Steinke 2020 as implemented in dp_accounting.
    """
    return _rdp_report(ledger, check_delta(delta), tuple(orders)).epsilon


# ---------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------
def epsilon_report(ledger: EventLike, delta: float, accountant: str = "pld",
                   budget: Optional[CostBudget] = DEFAULT_BUDGET) -> EpsilonReport:
    """ε(δ) of a whole ledger (or DpEvent) under ONE accountant, with how it was computed.

    Args:
        ledger: a :class:`PrivacyLedger` or any DpEvent built by
            :mod:`dpopt.accounting.events`.
        delta: target δ in (0, 1).
        accountant: ``"pld"`` (default, connect-the-dots at 1e-4), ``"rdp"``
            or ``"prv"`` (needs the ``prv-accountant`` package).
        budget: cost budget of one evaluation (default 30 s / 4 GB); above it
            PLD and PRV use a coarser grid (still an upper bound; recorded in
            ``coarsened`` and ``notes``) or refuse. None: no limit.

    Returns:
        :class:`~dpopt.accounting.cost.EpsilonReport`: ε ≥ 0 in nats
        (``math.inf`` if any release had noise multiplier 0; 0.0 for an
        empty ledger) and the resolution used.

    Raises:
        ValueError: on an unknown accountant, δ outside (0, 1), an event or
            neighbouring relation the accountant cannot handle, a ledger too
            large for the budget even on the coarsest grid, or a numerical
            failure inside the PRV package (message says to use ``pld``).
        ImportError: for ``"prv"`` when ``prv-accountant`` is not installed.

    Source: see the module docstring (PLD: Doroshenko et al. 2022; RDP:
    Mironov et al. 2019; PRV: Gopi et al. 2021).
    """
    name = check_accountant(accountant)
    delta = check_delta(delta)
    if name == "pld":
        return _pld_report(ledger, delta, PLD_DISCRETIZATION, budget)
    if name == "rdp":
        return _rdp_report(ledger, delta, RDP_ORDERS)
    from .prv import prv_epsilon_report  # optional dependency, imported lazily

    return prv_epsilon_report(ledger, delta, budget=budget)


def epsilon(ledger: EventLike, delta: float, accountant: str = "pld") -> float:
    """ε(δ) of a whole ledger (or DpEvent) under ONE accountant (see :func:`epsilon_report`).

    Uses the default cost budget; when a coarser grid was needed (the value
    is still an upper bound) an :class:`AccountingWarning` says so.

    Args:
        ledger: a :class:`PrivacyLedger` or a DpEvent.
        delta: δ ∈ (0, 1).
        accountant: ``"pld"`` (default), ``"rdp"`` or ``"prv"``.

    Returns:
        ε ≥ 0 (``math.inf`` if a release has σ = 0; 0.0 for an empty ledger).

    Raises:
        ValueError: invalid arguments, a ledger the accountant cannot handle
            or cannot fit in the cost budget (message gives the alternative).
        ImportError: ``"prv"`` without the ``prv-accountant`` package.
    """
    report = epsilon_report(ledger, delta, accountant)
    for note in report.notes:
        warnings.warn(note, AccountingWarning, stacklevel=2)
    return report.epsilon


def dpsgd_epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "pld"
) -> float:
    """ε(δ) of T Poisson-sampled Gaussian steps (plain DP-SGD): :func:`dpsgd_event` + :func:`epsilon`.

    Args:
        noise_multiplier: σ ≥ 0; σ = 0 gives ``math.inf``.
        sample_rate: q ∈ (0, 1].
        steps: T ≥ 1.
        delta: δ ∈ (0, 1).
        accountant: ``"pld"``, ``"rdp"`` or ``"prv"``.

    Raises:
        ValueError: invalid arguments (message names the argument).
    """
    check_sample_rate(sample_rate)
    return epsilon(dpsgd_event(noise_multiplier, sample_rate, steps), delta, accountant)
