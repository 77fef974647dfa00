"""The RDP accountant: dp_accounting's Rényi DP accountant.

Rényi DP (Mironov 2017; Mironov, Talwar, Zhang 2019, "Rényi Differential
Privacy of the Sampled Gaussian Mechanism") via
``dp_accounting.rdp.RdpAccountant`` at :data:`RDP_ORDERS`, converted to
(ε, δ) as in Canonne, Kamath, Steinke 2020. Takes composed events as they are.

The ledger is reduced to counts of (q, σ) terms first (Gaussians on one
Poisson batch become σ_eff, which is what dp_accounting does itself), and each
distinct term is composed once with its count, so the cost does not grow with
the number of steps. Ledgers with other event kinds are handed to
dp_accounting as they are (add/remove-one only).

Neighbouring relation: under ``replace_one`` a Gaussian of multiplier σ
counts as σ/2 (sensitivity 2C; dp_accounting's RDP does not apply the
relation to ``GaussianDpEvent``); Poisson-sampled steps under ``replace_one``
are refused (no analysis in dp_accounting's RDP).

dp_accounting's absl log warnings are captured and summarised as one note
(:mod:`dpopt.accounting.capture`).

A leaf behind :mod:`dpopt.accounting.registry`: :func:`rdp_epsilon_report`
has the registry's common signature ``(ledger, delta, *, budget)`` (the
budget is accepted and unused).
"""

from __future__ import annotations

import math
import re
from typing import Optional

from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import rdp_privacy_accountant

from .capture import captured, library_note
from .cost import CostBudget, EpsilonReport
from .events import gaussian_event, ledger_event, ledger_relation, poisson_gaussian_step, summarize_event
from .ledger import EventLike
from .validation import check_delta

__all__ = ["RDP_ORDERS", "rdp_epsilon_report", "rdp_epsilon", "unconverged_orders"]

#: Rényi orders α for the RDP accountant: a fine grid near 1 (where small ε
#: lives), the integers to 63 and a few large orders for tiny δ.
RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024])


def _rdp_report(ledger: EventLike, delta: float, orders: tuple) -> EpsilonReport:
    relation_name = ledger_relation(ledger)
    replace = relation_name == "replace_one"
    event = ledger_event(ledger)
    summary = summarize_event(event)
    acc = rdp_privacy_accountant.RdpAccountant(list(orders), NeighboringRelation.ADD_OR_REMOVE_ONE)
    if summary.invalid:
        raise ValueError(f"malformed ledger events: {', '.join(summary.invalid)}")
    if summary.unsupported:
        # Not (sampled) Gaussians: dp_accounting's RDP reads the event as it is — but it does not
        # apply the replace-one relation to every event kind, so such ledgers are refused.
        if replace:
            raise ValueError(
                f"the rdp accountant cannot honour neighbouring=replace_one for these events "
                f"({', '.join(sorted(set(summary.unsupported)))}); use accountant 'pld' or an "
                "add_or_remove_one ledger"
            )
        if not acc.supports(event):
            raise ValueError(
                f"the RDP accountant does not support this ledger's events: "
                f"{', '.join(sorted(set(summary.unsupported)))}"
            )
        _, messages = captured(acc.compose, event)
    else:
        if not summary.terms:
            return EpsilonReport(0.0, delta, "rdp")
        if any(sigma == 0.0 for (_, sigma) in summary.terms):
            return EpsilonReport(math.inf, delta, "rdp")
        if replace and any(q < 1.0 for (q, _) in summary.terms):
            raise ValueError(
                "the rdp accountant has no analysis of Poisson-sampled releases under neighbouring="
                "replace_one (dp_accounting refuses them); use accountant 'pld', which models it"
            )
        messages = []
        for (q, sigma), count in summary.terms.items():  # one term per distinct (q, σ): fast
            s = sigma / 2.0 if replace else sigma  # replace-one: sensitivity 2C, i.e. σ/2 at C
            ev = gaussian_event(s) if q >= 1.0 else poisson_gaussian_step(s, q)
            _, msgs = captured(acc.compose, ev, int(count))
            messages += [m for m in msgs if m not in messages]
    (eps, best_order), msgs = captured(acc.get_epsilon_and_optimal_order, delta)
    messages += [m for m in msgs if m not in messages]
    excluded, messages = unconverged_orders(messages)
    eps = float(eps)
    eps = math.inf if math.isnan(eps) else max(0.0, eps)
    notes = library_note("dp_accounting", messages) + _excluded_note(excluded, best_order, orders)
    return EpsilonReport(eps, delta, "rdp", notes=notes)


_UNCONVERGED = re.compile(r"_compute_log_a_frac failed to converge .*alpha=(\d+(?:\.\d+)?)")


def unconverged_orders(messages: list) -> tuple[list, list]:
    """Split dp_accounting's "failed to converge ... alpha=α. Excluding this order" warnings from the rest.

    dp_accounting's series for the log-moment at a fractional order α (Mironov, Talwar, Zhang 2019,
    Sec. 3.3) stops after 1000 terms; where it has not converged it returns ∞ for that order, which
    ``compute_epsilon`` then skips: the ε over the remaining orders is still a valid upper bound. It
    happens for ordinary settings (σ = 1.1, q = 0.083 at α = 1.1-1.3), so it is not a warning to print.

    Returns:
        ``(orders, others)``: the sorted excluded orders α, and the other messages unchanged.
    """
    orders, others = set(), []
    for m in messages:
        hit = _UNCONVERGED.search(m)
        if hit:
            orders.add(float(hit.group(1)))
        else:
            others.append(m)
    return sorted(orders), others


def _excluded_note(excluded: list, best_order: float, orders: tuple) -> tuple:
    """A note only where the left-out orders could have mattered: the best order is the nearest one kept.

    When the optimal order lies away from the excluded ones, ε (a minimum over orders of a convex
    conversion) would not have been smaller at them; nothing is said.
    """
    if not excluded:
        return ()
    kept = [a for a in orders if a not in excluded]
    edges = {
        max((a for a in kept if a < min(excluded)), default=None),
        min((a for a in kept if a > max(excluded)), default=None),
    }
    if not math.isfinite(float(best_order)) or best_order in edges:
        shown = ", ".join(f"{a:g}" for a in excluded)
        return (
            f"dp_accounting's series did not converge at Rényi order(s) α = {shown}, which were left out; the best "
            f"order kept (α = {float(best_order):g}) is next to them, so RDP's ε may be looser here (still an upper "
            "bound; accountant 'pld' is tighter)",
        )
    return ()


def rdp_epsilon_report(
    ledger: EventLike,
    delta: float,
    orders: tuple = RDP_ORDERS,
    budget: Optional[CostBudget] = None,
) -> EpsilonReport:
    """ε(δ) with dp_accounting's Rényi DP accountant (an upper bound), as a report.

    Args:
        ledger: a :class:`~dpopt.accounting.ledger.PrivacyLedger` or a DpEvent.
        delta: δ ∈ (0, 1).
        orders: Rényi orders α (default :data:`RDP_ORDERS`).
        budget: accepted for the registry's common signature and unused: the
            cost of RDP does not grow with the number of steps.

    Returns:
        :class:`~dpopt.accounting.cost.EpsilonReport` (``resolution`` None):
        ε ≥ 0, ``math.inf`` if a release has σ = 0, 0.0 for an empty ledger.

    Raises:
        ValueError: invalid δ, or a ledger the RDP accountant cannot handle
            (Poisson sampling under ``replace_one``; unsupported event kinds).
    """
    return _rdp_report(ledger, check_delta(delta), tuple(orders))


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
    return rdp_epsilon_report(ledger, delta, orders).epsilon
