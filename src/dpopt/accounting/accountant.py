"""Accountant functions: ε for a whole ledger (or DpEvent) at a given δ — the public entry.

:func:`epsilon`, :func:`epsilon_report` and :func:`dpsgd_epsilon` dispatch by
name through :mod:`dpopt.accounting.registry` to one of three leaf modules,
which read the same ledger:

* ``"pld"`` (default) — privacy-loss-distribution accounting (Koskela et al.
  2020; Meiser & Mohammadi 2018) with the *connect-the-dots* discretisation and
  pessimistic rounding (Doroshenko, Ghazi, Kamath, Kumar, Manurangsi 2022,
  "Connect the Dots: Tighter Discrete Approximations of Privacy Loss
  Distributions"), built with ``dp_accounting.pld.privacy_loss_distribution``
  (:mod:`dpopt.accounting.pld`).
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
  ``dp_accounting.rdp.RdpAccountant`` (:mod:`dpopt.accounting.rdp`); takes
  composed events as they are.
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
summarised once (:mod:`dpopt.accounting.capture`).

ε is always computed by ONE accountant over the WHOLE ledger — never a sum of
per-epoch or per-release ε (summing is loose, and invalid once later steps
depend on earlier releases).

Conventions: ε is in nats (natural log), δ is a probability in (0, 1). A
release with noise multiplier 0 is not private: ε = ``math.inf``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Optional

from .cost import DEFAULT_BUDGET, CostBudget, EpsilonReport
from .events import dpsgd_event, flatten_gaussian_terms
from .ledger import EventLike
from .pld import PLD_DISCRETIZATION, pld_epsilon
from .rdp import RDP_ORDERS, rdp_epsilon
from .registry import ACCOUNTANTS, check_accountant, get_accountant
from .validation import check_delta, check_sample_rate, check_steps

# Re-exported for existing importers: dpsgd_event (built in events), pld_epsilon / rdp_epsilon
# (the leaves), ACCOUNTANTS / check_accountant (the registry), the validators and EventLike.
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


class AccountingWarning(UserWarning):
    """ε was computed on a coarser grid than the accurate one (still an upper bound), or
    the underlying library warned (summarised once)."""


def epsilon_report(
    ledger: EventLike, delta: float, accountant: str = "pld", budget: Optional[CostBudget] = DEFAULT_BUDGET
) -> EpsilonReport:
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
    spec = get_accountant(accountant)
    delta = check_delta(delta)
    report = spec(ledger, delta, budget=budget)
    sampling = getattr(ledger, "sampling", "poisson")
    if sampling != "poisson" and not _mechanism_sampled(ledger):
        # every accountant here assumes Poisson sampling (DESIGN: warn, never silently), except for a
        # correlated-noise ledger, whose events are exact for the cyclic participation it records
        report = dataclasses.replace(
            report,
            notes=tuple(report.notes)
            + (
                f"the ledger records sampling {sampling!r}, not Poisson: this epsilon assumes Poisson sampling and "
                "may be BELOW the true epsilon of the run",
            ),
        )
    return report


def _mechanism_sampled(ledger: Any) -> bool:
    """Whether the ledger's sampling is the one its correlated-noise record requires (its events are exact
    for that cyclic participation; False without a record)."""
    from .matrix_factorization import record_sampling, same_sampling

    return same_sampling(getattr(ledger, "sampling", None), record_sampling(getattr(ledger, "mechanism", None)))


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
