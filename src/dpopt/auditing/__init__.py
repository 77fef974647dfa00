"""Empirical privacy auditing: ε lower bounds from canary scores.

Three modules, each depending only on the ones before it:

* :mod:`dpopt.auditing.stats` — **statistics, no torch, no training.** From
  scores of a mechanism's output with a canary present (``scores_in``) or
  absent (``scores_out``), :func:`epsilon_lower_bounds` returns two lower
  bounds on the ε of any (ε, δ)-DP guarantee the mechanism can have: the
  **direct** Clopper–Pearson bound (Kairouz, Oh, Viswanath 2015, Thm. 2.1;
  Jagielski, Ullman, Oprea 2020), sound for any mechanism, and the **Gaussian
  DP** bound (Dong, Roth, Su 2019; Nasr et al. 2023), a bound on μ sound for
  any mechanism whose ε is a lower bound for mechanisms with a Gaussian
  trade-off curve (what the harness runs) and far tighter at δ = 1e-5.
* :mod:`dpopt.auditing.harness` — **one-step audits of the real Privatizer**
  (:func:`audit_privatizer`, configured by :class:`HarnessConfig`, trials run
  by :class:`CanaryHarness`): run the library's
  :class:`~dpopt.privatizer.Privatizer` many times at ``sample_rate = 1`` on a
  tiny problem with a worst-case canary per-sample gradient present or
  absent, score each release along the canary direction, and compare both
  lower bounds with the accountant's one-step ε
  (``accounting.accountant.epsilon(step_event(), δ)``).
* :mod:`dpopt.auditing.suite` — **the built-in suite** of ``dpopt audit``:
  :data:`BUILTIN_MECHANISMS` (:func:`audit_mechanism`), every registered
  method (:func:`audit_method`), both (:func:`audit_all`).

False alarms: each route's two Clopper–Pearson bounds are taken at α/4, so
with probability ≥ 1 − α both reported lower bounds hold simultaneously, and
an honest mechanism is reported as LEAK with probability ≤ α (default
α = 1e-3 per mechanism).

Every name below imports from ``dpopt.auditing``; the statistics load eagerly
and import no torch, the harness and the suite (torch, the Privatizer) load on
first use, so ``import dpopt.auditing.stats`` stays torch-free.

Example::

    >>> import numpy as np
    >>> from dpopt.auditing import epsilon_lower_bounds, gdp_epsilon, audit_mechanism
    >>> rng = np.random.default_rng(0)
    >>> b = epsilon_lower_bounds(rng.normal(1, 1, 50_000), rng.normal(0, 1, 50_000), delta=1e-5)
    >>> 0.9 * gdp_epsilon(1.0, 1e-5) < b.gdp < gdp_epsilon(1.0, 1e-5)   # true ε ≈ 4.377
    True
    >>> audit_mechanism("flat", trials=20_000).verdict
    'PASS'

One-run audits of a real training run (Steinke, Nasr & Jagielski 2023;
Mahloujifar, Melis & Chaudhuri 2024): :mod:`dpopt.auditing.one_run_stats`
(the two estimators, numpy/scipy only) and :func:`one_run` (:mod:`.one_run_audit`: canaries in a
``dpopt train`` configuration).

See ``docs/auditing.md`` for the harness, the measured figures and the leak suite.
"""

from __future__ import annotations

from importlib import import_module

from .one_run_stats import OneRunBound, one_run_bounds
from .stats import (
    DEFAULT_ALPHA,
    DEFAULT_DELTA,
    EpsilonLowerBounds,
    ThresholdTest,
    clopper_pearson_upper,
    epsilon_from_error_rates,
    epsilon_lower_bounds,
    gdp_delta,
    gdp_epsilon,
    gdp_mu_from_error_rates,
)

__all__ = [
    "clopper_pearson_upper",
    "gdp_delta",
    "gdp_epsilon",
    "epsilon_from_error_rates",
    "gdp_mu_from_error_rates",
    "EpsilonLowerBounds",
    "epsilon_lower_bounds",
    "AuditResult",
    "claimed_one_step",
    "canary_scores",
    "audit_privatizer",
    "BUILTIN_MECHANISMS",
    "audit_mechanism",
    "registered_methods",
    "audit_method",
    "audit_all",
    "mechanism_seed",
    # added with the package split
    "ThresholdTest",
    "DEFAULT_ALPHA",
    "DEFAULT_DELTA",
    "ClaimedStep",
    "CanaryScores",
    "HarnessConfig",
    "CanaryHarness",
    "MechanismSpec",
    "SuiteResults",
    # one-run audits (dpopt.auditing.one_run_stats, numpy/scipy only; dpopt.auditing.one_run_audit)
    "OneRunBound",
    "one_run_bounds",
    "one_run",
    "OneRunResult",
]

# Loaded on first access (PEP 562): these modules import torch and the Privatizer.
_LAZY = {
    "DEFAULT_TRIALS": "harness",
    "AuditResult": "harness",
    "ClaimedStep": "harness",
    "CanaryScores": "harness",
    "HarnessConfig": "harness",
    "CanaryHarness": "harness",
    "claimed_one_step": "harness",
    "canary_scores": "harness",
    "audit_privatizer": "harness",
    "BUILTIN_MECHANISMS": "suite",
    "MechanismSpec": "suite",
    "SuiteResults": "suite",
    "audit_mechanism": "suite",
    "registered_methods": "suite",
    "audit_method": "suite",
    "audit_all": "suite",
    "mechanism_seed": "suite",
    "one_run": "one_run_audit",
    "OneRunResult": "one_run_audit",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
