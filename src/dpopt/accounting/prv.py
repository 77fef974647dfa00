"""PRV accountant adapter (optional dependency ``prv-accountant``).

The privacy-random-variable accountant of Gopi, Lee and Wutschitz (NeurIPS
2021, "Numerical Composition of Differential Privacy", arXiv:2106.02848),
implemented by Microsoft in the ``prv-accountant`` package
(https://github.com/microsoft/prv_accountant, MIT licence; tested with 0.2.0).
Install with ``pip install 'dpopt[prv]'`` or ``pip install prv-accountant``.

The ledger is reduced to counts of (q, σ) terms by
:func:`~dpopt.accounting.accountant.flatten_gaussian_terms` (the same
reduction the PLD path uses); each distinct term becomes one PRV —
``PoissonSubsampledGaussianMechanism(q, σ)`` or ``GaussianMechanism(σ)`` for
q = 1 — self-composed ``count`` times (Fourier composition) and the terms are
convolved together (heterogeneous composition).

ε reported is the package's certified UPPER bound: the estimate plus the
ε-error, evaluated at δ − δ_error (Gopi et al. 2021, Theorem 5.5). With the
defaults ε_error = 0.01 and δ_error = δ/1000 this is what Opacus reports for its
PRV accountant.

Only the add/remove-one neighbouring relation is supported (that is what the
package's subsampled-Gaussian PRV models).
"""

from __future__ import annotations

import math

from .accountant import EventLike, _as_event, check_delta, flatten_gaussian_terms

__all__ = ["prv_epsilon", "PRV_EPS_ERROR", "prv_available"]

#: Default additive error in ε of the PRV accountant (nats).
PRV_EPS_ERROR = 0.01


def prv_available() -> bool:
    """True if the optional ``prv-accountant`` package can be imported."""
    try:
        import prv_accountant  # noqa: F401
    except ImportError:
        return False
    return True


def prv_epsilon(
    ledger: EventLike,
    delta: float,
    eps_error: float = PRV_EPS_ERROR,
    delta_error: float | None = None,
    estimate: bool = False,
) -> float:
    """ε(δ) of a ledger (or DpEvent) with the PRV accountant.

    Args:
        ledger: a :class:`~dpopt.accounting.ledger.PrivacyLedger` or a DpEvent
            made of (Poisson-sampled) Gaussians.
        delta: δ ∈ (0, 1).
        eps_error: allowed additive error of ε (nats), > 0. Smaller is slower
            (the grid step shrinks with eps_error/√T).
        delta_error: allowed error of δ; default δ/1000.
        estimate: return the point estimate instead of the certified upper
            bound (for calibration searches only; never for a reported ε).

    Returns:
        ε ≥ 0 (upper bound unless ``estimate``); ``math.inf`` if a release has
        σ = 0; 0.0 for an empty ledger.

    Raises:
        ImportError: if ``prv-accountant`` is not installed (message says how).
        ValueError: invalid δ / errors, ``replace_one`` ledgers, unsupported
            events, or a δ too small for the package's floating-point range.

    Source: Gopi, Lee, Wutschitz 2021, Algorithm 1 and Theorem 5.5.
    """
    delta = check_delta(delta)
    if not eps_error > 0:
        raise ValueError(f"eps_error must be > 0, got {eps_error!r}")
    delta_error = delta / 1000.0 if delta_error is None else float(delta_error)
    if not 0.0 < delta_error < delta:
        raise ValueError(f"delta_error must be in (0, delta), got {delta_error!r}")
    if getattr(ledger, "neighbouring", "add_or_remove_one") != "add_or_remove_one":
        raise ValueError("the PRV accountant supports only add_or_remove_one ledgers; use 'pld' for replace_one")
    try:
        from prv_accountant import GaussianMechanism, PoissonSubsampledGaussianMechanism, PRVAccountant
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "accountant 'prv' needs the optional package prv-accountant: "
            "pip install 'dpopt[prv]' (or pip install prv-accountant)"
        ) from exc

    terms = flatten_gaussian_terms(_as_event(ledger))
    if not terms:
        return 0.0
    prvs, counts = [], []
    for (q, sigma), count in terms.items():
        if sigma == 0.0:
            return math.inf
        if q >= 1.0:
            prvs.append(GaussianMechanism(noise_multiplier=sigma))
        else:
            prvs.append(PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=sigma))
        counts.append(int(count))
    acc = PRVAccountant(prvs=prvs, eps_error=float(eps_error), delta_error=delta_error,
                        max_self_compositions=counts)
    try:
        lower, est, upper = acc.compute_epsilon(delta=delta, num_self_compositions=counts)
    except RuntimeError as exc:  # the package's "Cannot compute epsilon"
        raise ValueError(f"PRV accountant could not compute epsilon at delta={delta}: {exc}") from exc
    value = float(est if estimate else upper)
    return math.inf if math.isnan(value) else max(0.0, value)
