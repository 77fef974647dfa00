"""Accounting: DpEvent construction, the privacy ledger, accountants, calibration, budget split.

The PRV accountant (:mod:`dpopt.accounting.prv`) is imported lazily: it needs the
optional ``prv-accountant`` package.
"""

from .accountant import ACCOUNTANTS, dpsgd_epsilon, dpsgd_event, epsilon
from .budget import BudgetSplit, recompose, split_budget, split_for_count_noise
from .calibration import CalibrationResult, calibrate_noise_multiplier
from .events import (
    collapse_for_pld,
    effective_noise_multiplier,
    poisson_composed_step,
    poisson_gaussian_step,
)
from .ledger import PrivacyLedger

__all__ = [
    "ACCOUNTANTS",
    "epsilon",
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
]
