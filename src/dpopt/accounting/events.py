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

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from dp_accounting import dp_event

from .validation import check_noise_multiplier, check_sample_rate, check_steps

__all__ = [
    "gaussian_event",
    "poisson_gaussian_step",
    "poisson_composed_step",
    "effective_noise_multiplier",
    "collapse_for_pld",
    "EventSummary",
    "summarize_event",
    "sampled_gaussians",
    "dpsgd_event",
    "flatten_gaussian_terms",
    "ledger_event",
    "ledger_relation",
    "NEIGHBOURING",
    "event_to_dict",
    "event_from_dict",
    "check_noise_multiplier",
    "check_sample_rate",
]


def gaussian_event(noise_multiplier: Any) -> dp_event.GaussianDpEvent:
    """A Gaussian mechanism with noise std = ``noise_multiplier`` × sensitivity."""
    return dp_event.GaussianDpEvent(check_noise_multiplier(noise_multiplier))


def poisson_gaussian_step(noise_multiplier: Any, sample_rate: Any) -> dp_event.DpEvent:
    """One DP-SGD step: the Gaussian mechanism on a Poisson-sampled batch.

    Source: Abadi et al. 2016 (sampled Gaussian mechanism); Mironov et al. 2019.
    """
    return dp_event.PoissonSampledDpEvent(check_sample_rate(sample_rate), gaussian_event(noise_multiplier))


def poisson_composed_step(noise_multipliers: Sequence[Any], sample_rate: Any) -> dp_event.DpEvent:
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


def dpsgd_event(noise_multiplier: Any, sample_rate: Any, steps: Any) -> dp_event.DpEvent:
    """The whole-run event of ``steps`` DP-SGD steps with Poisson rate q.

    Each step is :func:`poisson_gaussian_step` — the same builder the
    Privatizer's ledger entries come from — so calibrating and accounting see
    exactly the event the training run records.

    Args:
        noise_multiplier: σ ≥ 0 (noise std / L2 sensitivity).
        sample_rate: q ∈ (0, 1].
        steps: T ≥ 1.

    Raises:
        ValueError: invalid σ, q or T (see :mod:`.validation`).
    """
    step = poisson_gaussian_step(noise_multiplier, sample_rate)
    return dp_event.SelfComposedDpEvent(step, check_steps(steps))


def effective_noise_multiplier(noise_multipliers: Sequence[Any]) -> float:
    """σ_eff = (Σ_i σ_i⁻²)^(−1/2): Gaussians on the same data compose to one Gaussian.

    A zero multiplier gives 0 (no privacy). Source: docs/algorithms.md, quantile
    clipping, "joint mechanism"; Dong, Roth, Su 2019 (GDP composition).
    """
    sigmas = [check_noise_multiplier(s) for s in noise_multipliers]
    if any(s == 0.0 for s in sigmas):
        return 0.0
    return float(sum(s**-2 for s in sigmas) ** -0.5)


@dataclass
class EventSummary:
    """What an accountant or a check needs to know about a (nested) DpEvent.

    Built by :func:`summarize_event`, the one walker of DpEvent trees in dpopt
    (the accountants, ``dpopt check`` and ``dpopt ledger`` all read it).

    Attributes:
        terms: ``{(q, σ): count}`` in first-seen order. Composition is
            commutative, so for Gaussian releases this is the whole ledger:
            a Poisson-sampled group of Gaussians on one batch is one term with
            σ_eff = (Σ σᵢ⁻²)^(−1/2); an unsampled Gaussian has q = 1; a
            ``NonPrivateDpEvent`` is σ = 0 (ε = ∞); q = 0 costs nothing and is
            left out.
        gaussians: every Gaussian noise multiplier in recorded order, repeated
            by its multiplicity (gradient first, then count, per step).
        rates: the Poisson sampling rates seen.
        nonprivate: a ``NonPrivateDpEvent`` occurs.
        unsupported: descriptions of the parts that are not (Poisson-sampled)
            Gaussians, e.g. ``"LaplaceDpEvent"``; empty when ``terms`` is complete.
        invalid: malformed parts no accountant may score (a self-composition
            count that is negative or fractional would LOWER ε); also listed
            in ``unsupported``.
    """

    terms: "OrderedDict[tuple[float, float], int]" = field(default_factory=OrderedDict)
    gaussians: list = field(default_factory=list)
    rates: set = field(default_factory=set)
    nonprivate: bool = False
    unsupported: list = field(default_factory=list)
    invalid: list = field(default_factory=list)

    def add(self, key: tuple[float, float], count: int) -> None:
        self.terms[key] = self.terms.get(key, 0) + int(count)


def summarize_event(event: dp_event.DpEvent) -> EventSummary:
    """Walk a DpEvent tree once (see :class:`EventSummary`); never raises.

    Unsupported kinds and invalid numbers (a negative or NaN noise multiplier,
    a sampling probability outside [0, 1]) are listed in ``unsupported``.
    """
    out = EventSummary()
    _walk(event, 1, out)
    return out


class _NotGaussians(Exception):
    """Raised by :func:`_walk` inside a sampled event when it holds anything but Gaussians."""


def _count(value) -> Optional[int]:
    """A self-composition count as an int ≥ 0, or None if it is not one (negative, fractional, NaN)."""
    try:
        count = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return count if count >= 0 and count == value else None


def _walk(ev: dp_event.DpEvent, n: int, out: EventSummary, inner: bool = False) -> None:
    """THE DpEvent walker: adds ``n`` copies of ``ev`` to ``out``.

    Top level (``inner=False``): fills every field of :class:`EventSummary`
    and never raises. Inside a Poisson-sampled event (``inner=True``): only
    ``gaussians`` is filled (multiplicities as repeated blocks); anything other
    than Gaussians, compositions and self-compositions raises
    :class:`_NotGaussians`, an invalid noise multiplier ``ValueError``.
    """
    if isinstance(ev, dp_event.SelfComposedDpEvent):
        count = _count(ev.count)
        if count is None:  # a negative or fractional count would LOWER ε: never accept it
            if inner:
                raise _NotGaussians(f"SelfComposedDpEvent with count {ev.count!r}")
            out.invalid.append(f"SelfComposedDpEvent with count {ev.count!r} (not an integer >= 0)")
            out.unsupported.append(out.invalid[-1])
            return
        if inner:
            part = EventSummary()
            _walk(ev.event, 1, part, inner=True)
            out.gaussians.extend(part.gaussians * (n * count))
        else:
            _walk(ev.event, n * count, out)
    elif isinstance(ev, dp_event.ComposedDpEvent):
        for sub in ev.events:
            _walk(sub, n, out, inner)
    elif inner:
        if not isinstance(ev, dp_event.GaussianDpEvent):
            raise _NotGaussians(type(ev).__name__)
        out.gaussians.extend([check_noise_multiplier(ev.noise_multiplier)] * n)
    elif isinstance(ev, dp_event.NoOpDpEvent):
        return
    elif isinstance(ev, dp_event.NonPrivateDpEvent):
        out.nonprivate = True
        out.add((1.0, 0.0), n)
    elif isinstance(ev, dp_event.GaussianDpEvent):
        try:
            sigma = check_noise_multiplier(ev.noise_multiplier)
        except ValueError:
            out.unsupported.append(f"GaussianDpEvent with invalid noise multiplier {ev.noise_multiplier!r}")
            return
        out.gaussians.extend([sigma] * n)
        out.add((1.0, sigma), n)
    elif isinstance(ev, dp_event.PoissonSampledDpEvent):
        q = float(ev.sampling_probability)
        if not 0.0 <= q <= 1.0:
            out.unsupported.append(f"PoissonSampledDpEvent with sampling probability {q} outside [0, 1]")
            return
        out.rates.add(q)
        if isinstance(ev.event, dp_event.NonPrivateDpEvent):
            out.nonprivate = True
            if q > 0.0:
                out.add((q, 0.0), n)
            return
        try:
            sigmas = sampled_gaussians(ev)
        except ValueError:
            out.unsupported.append("PoissonSampledDpEvent with an invalid noise multiplier")
            return
        if sigmas is None:
            out.unsupported.append(f"PoissonSampledDpEvent({type(ev.event).__name__})")
            return
        out.gaussians.extend(sigmas * n)
        if q > 0.0 and sigmas:  # q = 0: never sampled, no privacy cost
            out.add((q, effective_noise_multiplier(sigmas)), n)
    else:
        out.unsupported.append(type(ev).__name__)


def sampled_gaussians(event: dp_event.PoissonSampledDpEvent) -> Optional[list[float]]:
    """Noise multipliers of the Gaussians released on one Poisson batch (with multiplicity), or None.

    ``None`` when the sampled event is not built only of Gaussians,
    compositions and self-compositions (then no single σ_eff describes it).
    Walks with :func:`summarize_event`'s walker.

    Raises:
        ValueError: a Gaussian inside has an invalid noise multiplier.
    """
    part = EventSummary()
    try:
        _walk(event.event, 1, part, inner=True)
    except _NotGaussians:
        return None
    return part.gaussians


def flatten_gaussian_terms(event: dp_event.DpEvent) -> "OrderedDict[tuple[float, float], int]":
    """Reduce an event to counts of (sampling rate q, noise multiplier σ) terms.

    See :class:`EventSummary` ``terms`` (σ_eff for Gaussians on one Poisson
    batch is exact: their joint release is one Gaussian on the stacked vector;
    DESIGN.md "Accounting rules").

    Returns:
        An ordered dict ``{(q, σ): count}`` (first-seen order).

    Raises:
        ValueError: for events outside this family (Laplace, sampling without
            replacement, ...): use accountant ``"rdp"`` or dp_accounting directly.
    """
    summary = summarize_event(event)
    if summary.unsupported:
        raise ValueError(
            f"events not supported by dpopt's Gaussian accounting: {', '.join(sorted(set(summary.unsupported)))}; "
            "only (Poisson-sampled compositions of) Gaussians are; use accountant 'rdp' or dp_accounting directly"
        )
    return summary.terms


def collapse_for_pld(event: dp_event.DpEvent) -> dp_event.DpEvent:
    """Rewrite Poisson-sampled compositions of Gaussians as one Gaussian.

    dp_accounting's PLD accountant does not accept ``PoissonSampled(Composed(...))``.
    Gaussians released on the same sampled batch are exactly one Gaussian with
    σ_eff = (Σ σᵢ⁻²)^(−1/2) (their joint privacy loss is that of the stacked
    vector), so this rewrite loses nothing. Other parts are left as they are.
    """
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        sigmas = sampled_gaussians(event)
        if sigmas and not isinstance(event.event, dp_event.GaussianDpEvent):
            return dp_event.PoissonSampledDpEvent(
                float(event.sampling_probability), dp_event.GaussianDpEvent(effective_noise_multiplier(sigmas))
            )
        return event
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return dp_event.SelfComposedDpEvent(collapse_for_pld(event.event), int(event.count))
    if isinstance(event, dp_event.ComposedDpEvent):
        return dp_event.ComposedDpEvent([collapse_for_pld(e) for e in event.events])
    return event


#: Neighbouring relations a ledger may declare.
NEIGHBOURING = ("add_or_remove_one", "replace_one")


def ledger_event(ledger: Any) -> dp_event.DpEvent:
    """The whole ledger as one DpEvent (a DpEvent is returned as it is).

    Raises:
        TypeError: if ``ledger`` is neither a PrivacyLedger nor a DpEvent.
    """
    if isinstance(ledger, dp_event.DpEvent):
        return ledger
    if hasattr(ledger, "composed_event"):
        return ledger.composed_event()
    raise TypeError(f"expected a PrivacyLedger or a DpEvent, got {type(ledger).__name__}")


def ledger_relation(ledger: Any) -> str:
    """The neighbouring relation of a ledger (a bare DpEvent is add/remove-one).

    Raises:
        ValueError: on an unknown relation.
    """
    name = getattr(ledger, "neighbouring", "add_or_remove_one")
    if name not in NEIGHBOURING:
        raise ValueError(f"unknown neighbouring relation {name!r}; expected one of {NEIGHBOURING}")
    return name


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
            return dp_event.PoissonSampledDpEvent(float(data["sampling_probability"]), event_from_dict(data["event"]))
        if name == "ComposedDpEvent":
            return dp_event.ComposedDpEvent([event_from_dict(e) for e in data["events"]])
        if name == "SelfComposedDpEvent":
            count = _count(data["count"])
            if count is None:
                raise ValueError(f"SelfComposedDpEvent count must be an integer >= 0, got {data['count']!r}")
            return dp_event.SelfComposedDpEvent(event_from_dict(data["event"]), count)
        if name in ("NoOpDpEvent", "NonPrivateDpEvent"):
            return _EVENT_TYPES[name]()
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed event entry {data!r}: {exc}") from exc
    raise ValueError(f"unknown event type {data.get('type')!r}; known: {sorted(_EVENT_TYPES)}")
