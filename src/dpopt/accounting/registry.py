"""The accountant registry: one entry per accountant name, each a leaf module.

====================  =============================================  ==============================
name                  leaf module                                    report function
====================  =============================================  ==============================
``"pld"`` (default)   :mod:`dpopt.accounting.pld` (connect the dots)  :func:`~.pld.pld_epsilon_report`
``"rdp"``             :mod:`dpopt.accounting.rdp` (Rényi DP)          :func:`~.rdp.rdp_epsilon_report`
``"prv"``             :mod:`dpopt.accounting.prv` (optional package)  :func:`~.prv.prv_epsilon_report`
====================  =============================================  ==============================

Every report function has the common signature ``report(ledger, delta, *,
budget) -> EpsilonReport``: ``ledger`` a
:class:`~dpopt.accounting.ledger.PrivacyLedger` or a DpEvent, ``delta`` in
(0, 1), ``budget`` a :class:`~dpopt.accounting.cost.CostBudget` or None (no
limit), and the result an :class:`~dpopt.accounting.cost.EpsilonReport` whose
ε is an upper bound. :func:`dpopt.accounting.accountant.epsilon_report` (the
public entry) dispatches through :func:`get_accountant`; :data:`ACCOUNTANTS`
is derived from the registry. The leaves know nothing of the registry or of
each other (as dp_accounting's ``pld/`` and ``rdp/`` packages, and Opacus's
``accountants/registry.py``).

The PRV leaf imports its optional package (``prv-accountant``) only when it
computes, so the registry always lists it; :meth:`Accountant.available` says
whether it can run here.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

from . import pld, prv, rdp
from .cost import CostBudget, EpsilonReport
from .ledger import EventLike

__all__ = ["Accountant", "ReportFn", "REGISTRY", "ACCOUNTANTS", "get_accountant", "check_accountant"]

#: ``report(ledger, delta, *, budget) -> EpsilonReport``.
ReportFn = Callable[..., EpsilonReport]


@dataclass(frozen=True)
class Accountant:
    """One registered accountant.

    Attributes:
        name: the name users pass (``accountant="pld"``, ``--accountant pld``).
        report: the leaf's report function, ``report(ledger, delta, *, budget)``.
        description: one line for listings.
        requires: the optional package it needs (None: always available).
        is_available: returns whether the accountant can run in this environment.
    """

    name: str
    report: ReportFn
    description: str
    requires: Optional[str] = None
    is_available: Callable[[], bool] = lambda: True

    def available(self) -> bool:
        """True if the accountant can run here (its optional package, if any, imports)."""
        return bool(self.is_available())

    def __call__(self, ledger: EventLike, delta: float, *, budget: Optional[CostBudget]) -> EpsilonReport:
        """``self.report(ledger, delta, budget=budget)``."""
        return self.report(ledger, delta, budget=budget)


#: name -> :class:`Accountant`, in the order listed to users (the default first).
REGISTRY: Mapping[str, Accountant] = MappingProxyType(
    {
        "pld": Accountant(
            "pld",
            pld.pld_epsilon_report,
            "privacy-loss distribution, connect-the-dots, pessimistic (Doroshenko et al. 2022)",
        ),
        "rdp": Accountant("rdp", rdp.rdp_epsilon_report, "Renyi DP of the sampled Gaussian (Mironov et al. 2019)"),
        "prv": Accountant(
            "prv",
            prv.prv_epsilon_report,
            "privacy random variables, certified upper bound (Gopi et al. 2021)",
            requires="prv-accountant",
            is_available=prv.prv_available,
        ),
    }
)

#: Accountant names that :func:`dpopt.accounting.accountant.epsilon` understands
#: (``"prv"`` needs the optional ``prv-accountant`` package).
ACCOUNTANTS = tuple(REGISTRY)


def check_accountant(accountant: Any) -> str:
    """Validate an accountant name (one of :data:`ACCOUNTANTS`), lower-cased.

    Raises:
        ValueError: on an unknown name.
    """
    name = str(accountant).lower()
    if name not in REGISTRY:
        raise ValueError(f"unknown accountant {accountant!r}; choose one of {', '.join(ACCOUNTANTS)}")
    return name


def get_accountant(accountant: Any) -> Accountant:
    """The registered :class:`Accountant` for a name (case-insensitive).

    Raises:
        ValueError: on an unknown name (the message lists the known ones).
    """
    return REGISTRY[check_accountant(accountant)]
