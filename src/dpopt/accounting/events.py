"""The one place where dpopt builds ``dp_accounting`` events.

Every numeric field is coerced with :func:`float` (or :func:`int` for counts)
before it reaches ``dp_accounting``: its RDP accountant silently drops later
Gaussians of a composed event when the first multiplier is an ``int``,
``np.float32`` or a tensor (see DESIGN.md, "Accounting rules").

Events are plain data. They are serialised to JSON with :func:`event_to_dict`
and read back with :func:`event_from_dict`; the format is stable: a dict with a
``"type"`` key naming the ``dp_accounting`` class and its fields.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from dp_accounting import dp_event

__all__ = [
    "gaussian_event",
    "poisson_gaussian_step",
    "poisson_composed_step",
    "effective_noise_multiplier",
    "collapse_for_pld",
    "event_to_dict",
    "event_from_dict",
    "check_noise_multiplier",
    "check_sample_rate",
]


def check_noise_multiplier(noise_multiplier: Any, name: str = "noise_multiplier") -> float:
    """Validate and coerce a noise multiplier to a Python float.

    Raises:
        ValueError: if it is negative or not finite (NaN, or ``inf``).
    """
    value = float(noise_multiplier)
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{name} must be a finite number >= 0, got {noise_multiplier!r}; "
            "use e.g. --noise-multiplier 1.0 (0 means no privacy: epsilon = inf)."
        )
    return value


def check_sample_rate(sample_rate: Any) -> float:
    """Validate and coerce a Poisson sampling rate q to a float in (0, 1].

    Raises:
        ValueError: if q is not in (0, 1].
    """
    value = float(sample_rate)
    if not (0.0 < value <= 1.0):
        raise ValueError(
            f"sample_rate must be in (0, 1], got {sample_rate!r}; it is "
            "expected_batch_size / dataset_size."
        )
    return value


def gaussian_event(noise_multiplier: Any) -> dp_event.GaussianDpEvent:
    """A Gaussian mechanism with noise std = ``noise_multiplier`` × sensitivity."""
    return dp_event.GaussianDpEvent(check_noise_multiplier(noise_multiplier))


def poisson_gaussian_step(noise_multiplier: Any, sample_rate: Any) -> dp_event.DpEvent:
    """One DP-SGD step: the Gaussian mechanism on a Poisson-sampled batch.

    Source: Abadi et al. 2016 (sampled Gaussian mechanism); Mironov et al. 2019.
    """
    return dp_event.PoissonSampledDpEvent(
        check_sample_rate(sample_rate), gaussian_event(noise_multiplier)
    )


def poisson_composed_step(
    noise_multipliers: Sequence[Any], sample_rate: Any
) -> dp_event.DpEvent:
    """One step that releases several Gaussians computed on the same Poisson batch.

    Used by quantile clipping (gradient sum and clipped count; Andrew et al.
    2021, Algorithm 1): ``PoissonSampled(q, Composed([Gaussian(σ_1), ...]))``.
    A single multiplier gives :func:`poisson_gaussian_step`.
    """
    sigmas = [check_noise_multiplier(s) for s in noise_multipliers]
    if not sigmas:
        raise ValueError("poisson_composed_step needs at least one noise multiplier")
    if len(sigmas) == 1:
        return poisson_gaussian_step(sigmas[0], sample_rate)
    inner = dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(s) for s in sigmas])
    return dp_event.PoissonSampledDpEvent(check_sample_rate(sample_rate), inner)


def effective_noise_multiplier(noise_multipliers: Sequence[Any]) -> float:
    """σ_eff = (Σ_i σ_i⁻²)^(−1/2): Gaussians on the same data compose to one Gaussian.

    A zero multiplier gives 0 (no privacy). Source: ALGORITHMS.md, quantile
    clipping, "joint mechanism"; Dong, Roth, Su 2019 (GDP composition).
    """
    sigmas = [check_noise_multiplier(s) for s in noise_multipliers]
    if any(s == 0.0 for s in sigmas):
        return 0.0
    return float(sum(s**-2 for s in sigmas) ** -0.5)


def collapse_for_pld(event: dp_event.DpEvent) -> dp_event.DpEvent:
    """Rewrite Poisson-sampled compositions of Gaussians as one Gaussian.

    dp_accounting's PLD accountant does not accept ``PoissonSampled(Composed(...))``.
    Gaussians released on the same sampled batch are exactly one Gaussian with
    σ_eff = (Σ σᵢ⁻²)^(−1/2) (their joint privacy loss is that of the stacked
    vector), so this rewrite loses nothing.
    """
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        inner = event.event
        if isinstance(inner, dp_event.ComposedDpEvent) and all(
            isinstance(e, dp_event.GaussianDpEvent) for e in inner.events
        ):
            sigma = effective_noise_multiplier([e.noise_multiplier for e in inner.events])
            return dp_event.PoissonSampledDpEvent(
                float(event.sampling_probability), dp_event.GaussianDpEvent(sigma)
            )
        return event
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return dp_event.SelfComposedDpEvent(collapse_for_pld(event.event), int(event.count))
    if isinstance(event, dp_event.ComposedDpEvent):
        return dp_event.ComposedDpEvent([collapse_for_pld(e) for e in event.events])
    return event


_EVENT_TYPES = {
    "GaussianDpEvent": dp_event.GaussianDpEvent,
    "LaplaceDpEvent": dp_event.LaplaceDpEvent,
    "PoissonSampledDpEvent": dp_event.PoissonSampledDpEvent,
    "ComposedDpEvent": dp_event.ComposedDpEvent,
    "SelfComposedDpEvent": dp_event.SelfComposedDpEvent,
    "NoOpDpEvent": dp_event.NoOpDpEvent,
    "NonPrivateDpEvent": dp_event.NonPrivateDpEvent,
}


def event_to_dict(event: dp_event.DpEvent) -> dict:
    """Serialise a (nested) DpEvent to a JSON-ready dict; numbers become floats/ints."""
    name = type(event).__name__
    if name not in _EVENT_TYPES:
        raise TypeError(f"cannot serialise {name}; supported: {sorted(_EVENT_TYPES)}")
    if isinstance(event, dp_event.GaussianDpEvent):
        return {"type": name, "noise_multiplier": float(event.noise_multiplier)}
    if isinstance(event, dp_event.LaplaceDpEvent):
        return {"type": name, "noise_multiplier": float(event.noise_multiplier)}
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        return {
            "type": name,
            "sampling_probability": float(event.sampling_probability),
            "event": event_to_dict(event.event),
        }
    if isinstance(event, dp_event.ComposedDpEvent):
        return {"type": name, "events": [event_to_dict(e) for e in event.events]}
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return {"type": name, "count": int(event.count), "event": event_to_dict(event.event)}
    return {"type": name}


def event_from_dict(data: dict) -> dp_event.DpEvent:
    """Inverse of :func:`event_to_dict`.

    Raises:
        ValueError: on an unknown ``type`` or a malformed entry.
    """
    try:
        name = data["type"]
        if name == "GaussianDpEvent":
            return dp_event.GaussianDpEvent(float(data["noise_multiplier"]))
        if name == "LaplaceDpEvent":
            return dp_event.LaplaceDpEvent(float(data["noise_multiplier"]))
        if name == "PoissonSampledDpEvent":
            return dp_event.PoissonSampledDpEvent(
                float(data["sampling_probability"]), event_from_dict(data["event"])
            )
        if name == "ComposedDpEvent":
            return dp_event.ComposedDpEvent([event_from_dict(e) for e in data["events"]])
        if name == "SelfComposedDpEvent":
            return dp_event.SelfComposedDpEvent(event_from_dict(data["event"]), int(data["count"]))
        if name in ("NoOpDpEvent", "NonPrivateDpEvent"):
            return _EVENT_TYPES[name]()
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed event entry {data!r}: {exc}") from exc
    raise ValueError(f"unknown event type {data.get('type')!r}; known: {sorted(_EVENT_TYPES)}")
