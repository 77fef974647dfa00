"""Argument checks shared by every accounting module (imports only :mod:`dpopt.errors`).

Each check coerces a value to a plain Python number and raises
:class:`~dpopt.errors.ConfigError` (a ``ValueError``) with a message that names
the argument (library names such as ``noise_multiplier``, never command-line
flags; the CLI maps the declared argument to its flag) and says what to pass instead.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError

__all__ = [
    "check_delta",
    "check_noise_multiplier",
    "check_sample_rate",
    "check_steps",
    "check_target_epsilon",
    "check_rtol",
]

# The accountant-name check (``check_accountant``) is a registry lookup and lives with the
# registry (:mod:`dpopt.accounting.registry`); every numeric argument is checked here.


def check_delta(delta: Any) -> float:
    """Validate δ ∈ (0, 1) and return it as a float.

    δ = 0 would need pure DP (the Gaussian mechanism has none) and δ ≥ 1 is
    no guarantee at all, so both are refused rather than answered.

    Raises:
        ConfigError: if δ is not a number in (0, 1).
    """
    try:
        value = float(delta)
    except (TypeError, ValueError):
        raise ConfigError(f"delta must be a number in (0, 1), got {delta!r}", "delta") from None
    if not (0.0 < value < 1.0):
        raise ConfigError(
            f"delta must be in (0, 1), got {delta!r}; a common choice is 1e-5 "
            "(well below 1/N for N training examples).",
            "delta",
        )
    return value


def check_steps(steps: Any) -> int:
    """Validate a number of steps (a positive integer).

    Raises:
        ConfigError: if ``steps`` is not an integer ≥ 1.
    """
    try:
        value = int(steps)
    except (TypeError, ValueError):
        raise ConfigError(f"steps must be a positive integer, got {steps!r}", "steps") from None
    if value != steps or value < 1:
        raise ConfigError(f"steps must be a positive integer (number of noisy releases), got {steps!r}", "steps")
    return value


def check_noise_multiplier(noise_multiplier: Any, name: str = "noise_multiplier") -> float:
    """Validate and coerce a noise multiplier σ (noise std / L2 sensitivity) to a float.

    Raises:
        ConfigError: if it is negative or not finite (NaN, or ``inf``).
    """
    try:
        value = float(noise_multiplier)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a finite number >= 0, got {noise_multiplier!r}", name) from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"{name} must be a finite number >= 0, got {noise_multiplier!r}; "
            f"e.g. {name} = 1.0 (0 means no privacy: epsilon = inf).",
            name,
        )
    return value


def check_sample_rate(sample_rate: Any) -> float:
    """Validate and coerce a Poisson sampling rate q to a float in (0, 1].

    Raises:
        ConfigError: if q is not a number in (0, 1].
    """
    try:
        value = float(sample_rate)
    except (TypeError, ValueError):
        raise ConfigError(f"sample_rate must be a number in (0, 1], got {sample_rate!r}", "sample_rate") from None
    if not (0.0 < value <= 1.0):
        raise ConfigError(
            f"sample_rate must be in (0, 1], got {sample_rate!r}; it is expected_batch_size / dataset_size.",
            "sample_rate",
        )
    return value


def check_target_epsilon(target_epsilon: Any) -> float:
    """Validate a target ε (nats): a finite number > 0, returned as a float.

    Raises:
        ConfigError: if it is not a number, not finite, or ≤ 0.
    """
    try:
        value = float(target_epsilon)
    except (TypeError, ValueError):
        raise ConfigError(f"target_epsilon must be a number > 0, got {target_epsilon!r}", "target_epsilon") from None
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}", "target_epsilon")
    return value


def check_rtol(rtol: Any) -> float:
    """Validate a relative tolerance in (0, 0.1] (calibration's σ tolerance, the ledger check's
    comparisons), returned as a float.

    Raises:
        ConfigError: if it is not in (0, 0.1].
    """
    if not (0.0 < float(rtol) <= 0.1):
        raise ConfigError(f"rtol must be in (0, 0.1], got {rtol!r}", "rtol")
    return float(rtol)
