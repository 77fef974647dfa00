"""Accountant functions: ε for a whole ledger (or DpEvent) at a given δ.

A thin layer over ``dp_accounting``:

* ``"pld"`` (default) — privacy-loss-distribution accountant with
  connect-the-dots discretisation (Doroshenko et al. 2022), via
  ``dp_accounting.pld.PLDAccountant``. Poisson-sampled compositions of
  Gaussians are collapsed to one Gaussian first (exact; see
  :func:`~dpopt.accounting.events.collapse_for_pld`).
* ``"rdp"`` — Rényi DP accountant (Mironov 2017; Mironov, Talwar, Zhang 2019)
  via ``dp_accounting.rdp.RdpAccountant``; takes composed events as they are.

ε is always computed by ONE accountant over the WHOLE ledger — never a sum of
per-epoch or per-release ε.
"""

from __future__ import annotations

import math
from typing import Union

from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from .events import collapse_for_pld
from .ledger import PrivacyLedger

__all__ = ["ACCOUNTANTS", "epsilon", "check_delta", "PLD_DISCRETIZATION"]

ACCOUNTANTS = ("pld", "rdp")
PLD_DISCRETIZATION = 1e-4
_RDP_ORDERS = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
)

EventLike = Union[PrivacyLedger, dp_event.DpEvent]


def check_delta(delta: float) -> float:
    """Validate δ ∈ (0, 1).

    Raises:
        ValueError: if δ is outside (0, 1).
    """
    value = float(delta)
    if not (0.0 < value < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}; a common choice is 1e-5 (below 1/N).")
    return value


def _neighbouring(ledger: EventLike) -> NeighboringRelation:
    name = getattr(ledger, "neighbouring", "add_or_remove_one")
    if name == "add_or_remove_one":
        return NeighboringRelation.ADD_OR_REMOVE_ONE
    return NeighboringRelation.REPLACE_ONE


def _as_event(ledger: EventLike) -> dp_event.DpEvent:
    return ledger.composed_event() if isinstance(ledger, PrivacyLedger) else ledger


def epsilon(ledger: EventLike, delta: float, accountant: str = "pld") -> float:
    """ε(δ) of a whole ledger (or a single DpEvent) under one accountant.

    Args:
        ledger: a :class:`PrivacyLedger` or any DpEvent built by
            :mod:`dpopt.accounting.events`.
        delta: target δ in (0, 1).
        accountant: ``"pld"`` (default), ``"rdp"`` or ``"prv"``.

    Returns:
        ε ≥ 0 as a float; ``math.inf`` if any release had noise_multiplier 0.
        An empty ledger gives 0.0.

    Raises:
        ValueError: on an unknown accountant or δ outside (0, 1).
    """
    delta = check_delta(delta)
    event = _as_event(ledger)
    if isinstance(event, dp_event.NoOpDpEvent):
        return 0.0
    if accountant == "pld":
        acc = pld_privacy_accountant.PLDAccountant(
            _neighbouring(ledger), value_discretization_interval=PLD_DISCRETIZATION
        )
        acc.compose(collapse_for_pld(event))
    elif accountant == "rdp":
        acc = rdp_privacy_accountant.RdpAccountant(list(_RDP_ORDERS), _neighbouring(ledger))
        acc.compose(event)
    elif accountant == "prv":
        from .prv import prv_epsilon  # optional dependency

        return prv_epsilon(event, delta)
    else:
        raise ValueError(f"unknown accountant {accountant!r}; choose one of {ACCOUNTANTS + ('prv',)}")
    eps = float(acc.get_epsilon(delta))
    return max(0.0, eps) if not math.isnan(eps) else math.inf
