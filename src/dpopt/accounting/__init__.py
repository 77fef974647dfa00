"""Accounting: DpEvent construction, the privacy ledger, accountants, calibration, budget split,
and the ledger check.

Layout (each module imports only those above it; no cycles):

* :mod:`.validation` — argument checks (δ, σ, q, steps, target ε, rtol); a leaf.
* :mod:`.events` — the one place DpEvents are built, and the one DpEvent walker
  (:func:`~.events.summarize_event`); JSON (de)serialisation.
* :mod:`.ledger` — :class:`PrivacyLedger`, the append-only record of releases.
* :mod:`.cost`, :mod:`.capture` — cost estimates / :class:`~.cost.EpsilonReport`;
  capturing library warnings.
* :mod:`.pld`, :mod:`.rdp`, :mod:`.prv` — the accountants, leaf modules with one
  common signature ``report(ledger, delta, *, budget) -> EpsilonReport``.
* :mod:`.registry` — name → accountant; :data:`ACCOUNTANTS` is derived from it.
* :mod:`.accountant` — the public entry: :func:`epsilon`, :func:`epsilon_report`,
  :func:`dpsgd_epsilon`, dispatching through the registry.
* :mod:`.calibration`, :mod:`.budget` — σ for a target ε; the quantile-clipping split.
* :mod:`.ledger_check` — ``dpopt check``: the five questions asked of a run's ledger.

The PRV accountant needs the optional ``prv-accountant`` package, which
:mod:`.prv` imports only when it computes.
"""

from .accountant import ACCOUNTANTS, dpsgd_epsilon, dpsgd_event, epsilon, epsilon_report
from .budget import BudgetSplit, recompose, split_budget, split_for_count_noise
from .calibration import CalibrationResult, calibrate_noise_multiplier
from .cost import CostBudget, EpsilonReport
from .events import (
    collapse_for_pld,
    effective_noise_multiplier,
    poisson_composed_step,
    poisson_gaussian_step,
)
from .ledger import PrivacyLedger
from .ledger_check import check_ledger, check_run
from .registry import get_accountant

__all__ = [
    "ACCOUNTANTS",
    "epsilon",
    "epsilon_report",
    "EpsilonReport",
    "CostBudget",
    "get_accountant",
    "dpsgd_epsilon",
    "dpsgd_event",
    "calibrate_noise_multiplier",
    "CalibrationResult",
    "BudgetSplit",
    "split_budget",
    "split_for_count_noise",
    "recompose",
    "collapse_for_pld",
    "effective_noise_multiplier",
    "poisson_composed_step",
    "poisson_gaussian_step",
    "PrivacyLedger",
    "check_ledger",
    "check_run",
]
