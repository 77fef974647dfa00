"""Accounting: DpEvent construction, the privacy ledger, and accountants."""

from .accountant import ACCOUNTANTS, epsilon
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
    "collapse_for_pld",
    "effective_noise_multiplier",
    "poisson_composed_step",
    "poisson_gaussian_step",
    "PrivacyLedger",
]
