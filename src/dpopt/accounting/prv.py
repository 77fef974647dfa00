"""PRV accountant adapter (optional dependency ``prv-accountant``).

The privacy-random-variable accountant of Gopi, Lee and Wutschitz (NeurIPS
2021, "Numerical Composition of Differential Privacy", arXiv:2106.02848),
implemented by Microsoft in the ``prv-accountant`` package
(https://github.com/microsoft/prv_accountant, MIT licence; tested with 0.2.0).
Install with ``pip install 'dpopt[prv]'`` or ``pip install prv-accountant``;
the package is imported only when ε is computed, so this module always
imports (:func:`prv_available` says whether it can run).

A leaf behind :mod:`dpopt.accounting.registry`: :func:`prv_epsilon_report`
has the registry's common signature ``(ledger, delta, *, budget)``.

The ledger is reduced to counts of (q, σ) terms by
:func:`~dpopt.accounting.events.flatten_gaussian_terms` (the same
reduction the PLD path uses); each distinct term becomes one PRV —
``PoissonSubsampledGaussianMechanism(q, σ)`` or ``GaussianMechanism(σ)`` for
q = 1 — self-composed ``count`` times (Fourier composition) and the terms are
convolved together (heterogeneous composition).

ε reported is the package's certified UPPER bound: the estimate plus the
ε-error, evaluated at δ − δ_error (Gopi et al. 2021, Theorem 5.5). With the
defaults ε_error = 0.01 and δ_error = δ/1000 this is what Opacus reports for its
PRV accountant.

Neighbouring relation: the package's subsampled-Gaussian PRV models
add/remove-one. Under ``replace_one`` an unsampled Gaussian of multiplier σ is
exactly an add/remove Gaussian of σ/2 and is accounted so; Poisson-sampled
steps under ``replace_one`` are refused (use ``pld``).

Cost: the package's grid has mesh ε_error/√(T/2·ln(12/δ_error)) over
[−L, L], so memory and time grow with √T (10⁶ steps at q = 0.01, σ = 1 pass
18 GB at ε_error = 0.01). When the estimate (:mod:`dpopt.accounting.cost`)
exceeds the budget, ε_error is raised until it fits — the certified upper
bound (estimate + ε_error) stays an upper bound, only looser — and the report
says so; above ε_error = 1 nat the accountant refuses with advice.

Numerical failures inside the package (e.g. ``RuntimeError: Discrete mean
differs from continuous mean significantly`` at q = 0.2, σ = 1, 600 steps)
become ``ValueError`` with the advice to use ``pld``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional

from .cost import (
    DEFAULT_BUDGET,
    MAX_PRV_EPS_ERROR,
    CostBudget,
    EpsilonReport,
    estimate_prv_cost,
    prv_domain,
    prv_mechanisms,
)
from .events import flatten_gaussian_terms, ledger_event, ledger_relation
from .ledger import EventLike
from .validation import check_delta

__all__ = ["prv_epsilon", "prv_epsilon_report", "PRV_EPS_ERROR", "prv_available"]

#: Default additive error in ε of the PRV accountant (nats).
PRV_EPS_ERROR = 0.01
_ADVICE = "use accountant 'pld' (connect-the-dots PLD, also an upper bound)"


def prv_available() -> bool:
    """True if the optional ``prv-accountant`` package can be imported."""
    try:
        import prv_accountant  # noqa: F401
    except ImportError:
        return False
    return True


def prv_epsilon_report(
    ledger: EventLike,
    delta: float,
    eps_error: float = PRV_EPS_ERROR,
    delta_error: Optional[float] = None,
    estimate: bool = False,
    budget: Optional[CostBudget] = DEFAULT_BUDGET,
) -> EpsilonReport:
    """ε(δ) of a ledger (or DpEvent) with the PRV accountant, with the ε-error used.

    Args:
        ledger: a :class:`~dpopt.accounting.ledger.PrivacyLedger` or a DpEvent
            made of (Poisson-sampled) Gaussians.
        delta: δ ∈ (0, 1).
        eps_error: allowed additive error of ε (nats), > 0. Smaller is slower
            (the grid step shrinks with eps_error/√T).
        delta_error: allowed error of δ; default δ/1000.
        estimate: return the point estimate instead of the certified upper
            bound (for calibration searches only; never for a reported ε).
        budget: cost budget (default 30 s / 4 GB): above it ``eps_error`` is
            raised until the estimate fits (recorded in the report), up to
            1 nat; None: no limit.

    Returns:
        :class:`~dpopt.accounting.cost.EpsilonReport` (``resolution`` = the
        ε-error used): ε ≥ 0 (upper bound unless ``estimate``); ``math.inf``
        if a release has σ = 0; 0.0 for an empty ledger.

    Raises:
        ImportError: if ``prv-accountant`` is not installed (message says how).
        ValueError: invalid δ / errors, Poisson-sampled ``replace_one``
            ledgers, unsupported events, a ledger too large for the budget,
            or a numerical failure inside the package (all say to use ``pld``).

    Source: Gopi, Lee, Wutschitz 2021, Algorithm 1 and Theorem 5.5.
    """
    delta = check_delta(delta)
    if not eps_error > 0:
        raise ValueError(f"eps_error must be > 0, got {eps_error!r}")
    eps_error = float(eps_error)
    delta_error = delta / 1000.0 if delta_error is None else float(delta_error)
    if not 0.0 < delta_error < delta:
        raise ValueError(f"delta_error must be in (0, delta), got {delta_error!r}")
    replace = ledger_relation(ledger) == "replace_one"
    try:
        from prv_accountant import PRVAccountant
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "accountant 'prv' needs the optional package prv-accountant: "
            "pip install 'dpopt[prv]' (or pip install prv-accountant)"
        ) from exc

    terms = flatten_gaussian_terms(ledger_event(ledger))
    if not terms:
        return EpsilonReport(0.0, delta, "prv", eps_error)
    if any(sigma == 0.0 for (_, sigma) in terms):
        return EpsilonReport(math.inf, delta, "prv", eps_error)
    if replace and any(q < 1.0 for (q, _) in terms):
        raise ValueError(
            "the prv accountant has no model of Poisson-sampled releases under neighbouring="
            f"replace_one (prv-accountant models add/remove-one); {_ADVICE}"
        )
    counts = [int(c) for c in terms.values()]
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:  # the package's IntegrationWarnings
            warnings.simplefilter("always")
            lower, est_eps, upper, est, eps_error, coarsened, notes = _compute(
                terms, delta, eps_error, delta_error, replace, budget, counts, PRVAccountant
            )
    except ValueError as exc:
        if "prv accountant" in str(exc):
            raise
        raise ValueError(f"the prv accountant failed on this ledger at delta={delta:g} ({exc}); {_ADVICE}") from None
    except (RuntimeError, ArithmeticError, AssertionError) as exc:
        # e.g. "Discrete mean differs from continuous mean significantly" (q = 0.2, σ = 1, T = 600)
        raise ValueError(
            f"the prv accountant failed numerically on this ledger at delta={delta:g} "
            f"({type(exc).__name__}: {exc}); {_ADVICE}"
        ) from None
    except MemoryError:
        raise ValueError(f"the prv accountant ran out of memory on this ledger; {_ADVICE}") from None
    messages = sorted({str(w.message).splitlines()[0] for w in caught if str(w.message).strip()})
    if messages:
        notes = notes + (
            f"prv-accountant warned while computing epsilon: {messages[0]!r}"
            + (f" (and {len(messages) - 1} other message(s))" if len(messages) > 1 else "")
            + "; the certified bound is reported as computed",
        )
    value = float(est_eps if estimate else upper)
    value = math.inf if math.isnan(value) else max(0.0, value)
    return EpsilonReport(value, delta, "prv", eps_error, coarsened, est, notes)


def _compute(
    terms: Any,
    delta: float,
    eps_error: float,
    delta_error: float,
    replace: bool,
    budget: Any,
    counts: Any,
    PRVAccountant: Any,
) -> tuple:
    """Cost estimate, coarsening (if over budget) and the package's (lower, estimate, upper)."""
    notes: tuple = ()
    coarsened = False
    est = estimate_prv_cost(
        terms, eps_error, delta_error, replace, domain=prv_domain(terms, eps_error, delta_error, replace)
    )
    if budget is not None and not est.within(budget):
        needed = eps_error * est.scale_to(budget) * 1.05
        needed = float(f"{needed:.2g}") if float(f"{needed:.2g}") >= needed else float(f"{needed * 1.1:.2g}")
        if needed > MAX_PRV_EPS_ERROR:
            raise ValueError(
                f"the prv accountant would need {est.describe()} for this ledger (eps_error {eps_error:g}), "
                f"and even eps_error = {MAX_PRV_EPS_ERROR:g} exceeds the budget of {budget.seconds:g} s / "
                f"{budget.memory_bytes / 1e9:g} GB; {_ADVICE}, or 'rdp'"
            )
        coarse = estimate_prv_cost(
            terms, needed, delta_error, replace, domain=prv_domain(terms, needed, delta_error, replace)
        )
        notes = (
            f"prv: eps_error {eps_error:g} would need {est.describe()}; used eps_error {needed:g} "
            f"({coarse.describe()}); the certified upper bound stays an upper bound",
        )
        eps_error, est, coarsened = needed, coarse, True
    acc = PRVAccountant(
        prvs=prv_mechanisms(terms, replace), eps_error=eps_error, delta_error=delta_error, max_self_compositions=counts
    )
    lower, est_eps, upper = acc.compute_epsilon(delta=delta, num_self_compositions=counts)
    return lower, est_eps, upper, est, eps_error, coarsened, notes


def prv_epsilon(
    ledger: EventLike,
    delta: float,
    eps_error: float = PRV_EPS_ERROR,
    delta_error: Optional[float] = None,
    estimate: bool = False,
    budget: Optional[CostBudget] = DEFAULT_BUDGET,
) -> float:
    """ε(δ) of a ledger (or DpEvent) with the PRV accountant: :func:`prv_epsilon_report`'s ε.

    Raises:
        ImportError, ValueError: as :func:`prv_epsilon_report`.
    """
    return prv_epsilon_report(ledger, delta, eps_error, delta_error, estimate, budget).epsilon
