"""Accountant functions: ε for a whole ledger (or DpEvent) at a given δ.

Three accountants read the same ledger:

* ``"pld"`` (default) — privacy-loss-distribution accounting (Koskela et al.
  2020; Meiser & Mohammadi 2018) with the *connect-the-dots* discretisation and
  pessimistic rounding (Doroshenko, Ghazi, Kamath, Kumar, Manurangsi 2022,
  "Connect the Dots: Tighter Discrete Approximations of Privacy Loss
  Distributions"), built with ``dp_accounting.pld.privacy_loss_distribution``.
  dpopt builds the PLD itself with ``use_connect_dots=True`` and
  ``pessimistic_estimate=True`` stated explicitly, so a change of library
  default cannot silently change the method. (In dp_accounting 0.6 the
  ``PLDAccountant`` also uses connect-the-dots for Poisson-sampled Gaussians:
  it calls ``from_gaussian_mechanism`` whose default is
  ``use_connect_dots=True``; the tests pin that both agree.) Gaussians released
  on the same Poisson batch are collapsed to one Gaussian of σ_eff first
  (exact; :func:`~dpopt.accounting.events.collapse_for_pld`).
* ``"rdp"`` — Rényi DP (Mironov 2017; Mironov, Talwar, Zhang 2019, "Rényi
  Differential Privacy of the Sampled Gaussian Mechanism") via
  ``dp_accounting.rdp.RdpAccountant``; takes composed events as they are.
* ``"prv"`` — privacy-random-variable accountant (Gopi, Lee, Wutschitz 2021,
  "Numerical Composition of Differential Privacy") via Microsoft's
  ``prv-accountant`` package (optional extra ``dpopt[prv]``); see
  :mod:`dpopt.accounting.prv`. Reports the certified upper bound.

ε is always computed by ONE accountant over the WHOLE ledger — never a sum of
per-epoch or per-release ε (summing is loose, and invalid once later steps
depend on earlier releases).

Conventions: ε is in nats (natural log), δ is a probability in (0, 1). A
release with noise multiplier 0 is not private: ε = ``math.inf``.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from typing import Union

from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import rdp_privacy_accountant

from .events import check_noise_multiplier, check_sample_rate, effective_noise_multiplier, poisson_gaussian_step
from .ledger import PrivacyLedger

__all__ = [
    "ACCOUNTANTS",
    "PLD_DISCRETIZATION",
    "RDP_ORDERS",
    "EventLike",
    "check_delta",
    "check_accountant",
    "check_steps",
    "dpsgd_event",
    "epsilon",
    "dpsgd_epsilon",
    "pld_epsilon",
    "rdp_epsilon",
    "flatten_gaussian_terms",
]

#: Accountants that :func:`epsilon` understands (``"prv"`` needs ``dpopt[prv]``).
ACCOUNTANTS = ("pld", "rdp", "prv")
#: Value-discretisation interval (in nats of privacy loss) of the accurate PLD.
#: 1e-4 is dp_accounting's default, so ``"pld"`` ε equals dp_accounting's.
PLD_DISCRETIZATION = 1e-4
#: Rényi orders α for the RDP accountant: a fine grid near 1 (where small ε
#: lives), the integers to 63 and a few large orders for tiny δ.
RDP_ORDERS = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
)

EventLike = Union[PrivacyLedger, dp_event.DpEvent]


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------
def check_delta(delta: float) -> float:
    """Validate δ ∈ (0, 1) and return it as a float.

    δ = 0 would need pure DP (the Gaussian mechanism has none) and δ ≥ 1 is
    no guarantee at all, so both are refused rather than answered.

    Raises:
        ValueError: if δ is not a number in (0, 1).
    """
    try:
        value = float(delta)
    except (TypeError, ValueError):
        raise ValueError(f"delta must be a number in (0, 1), got {delta!r}") from None
    if not (0.0 < value < 1.0):
        raise ValueError(
            f"delta must be in (0, 1), got {delta!r}; a common choice is 1e-5 "
            "(well below 1/N for N training examples)."
        )
    return value


def check_accountant(accountant: str) -> str:
    """Validate an accountant name (one of :data:`ACCOUNTANTS`).

    Raises:
        ValueError: on an unknown name.
    """
    name = str(accountant).lower()
    if name not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; choose one of {', '.join(ACCOUNTANTS)}")
    return name


def check_steps(steps: int) -> int:
    """Validate a number of steps (a positive integer).

    Raises:
        ValueError: if ``steps`` is not an integer ≥ 1.
    """
    try:
        value = int(steps)
    except (TypeError, ValueError):
        raise ValueError(f"steps must be a positive integer, got {steps!r}") from None
    if value != steps or value < 1:
        raise ValueError(f"steps must be a positive integer (number of noisy releases), got {steps!r}")
    return value


# ---------------------------------------------------------------------------
# events
# ---------------------------------------------------------------------------
def dpsgd_event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_event.DpEvent:
    """The whole-run event of ``steps`` DP-SGD steps with Poisson rate q.

    Each step is :func:`~dpopt.accounting.events.poisson_gaussian_step` — the
    same builder the Privatizer's ledger entries come from — so calibrating
    and accounting see exactly the event the training run records.

    Args:
        noise_multiplier: σ ≥ 0 (noise std / L2 sensitivity).
        sample_rate: q ∈ (0, 1].
        steps: T ≥ 1.

    Raises:
        ValueError: invalid σ, q or T (see the checks in :mod:`.events`).
    """
    step = poisson_gaussian_step(noise_multiplier, sample_rate)
    return dp_event.SelfComposedDpEvent(step, check_steps(steps))


def _neighbouring(ledger: EventLike) -> NeighboringRelation:
    name = getattr(ledger, "neighbouring", "add_or_remove_one")
    if name == "add_or_remove_one":
        return NeighboringRelation.ADD_OR_REMOVE_ONE
    if name == "replace_one":
        return NeighboringRelation.REPLACE_ONE
    raise ValueError(f"unknown neighbouring relation {name!r}")


def _as_event(ledger: EventLike) -> dp_event.DpEvent:
    if isinstance(ledger, PrivacyLedger):
        return ledger.composed_event()
    if isinstance(ledger, dp_event.DpEvent):
        return ledger
    raise TypeError(f"expected a PrivacyLedger or a DpEvent, got {type(ledger).__name__}")


def flatten_gaussian_terms(event: dp_event.DpEvent) -> "OrderedDict[tuple[float, float], int]":
    """Reduce an event to counts of (sampling rate q, noise multiplier σ) terms.

    Composition is commutative, so a ledger is fully described (for Gaussian
    releases) by how many times each (q, σ) pair occurs. A Poisson-sampled
    composition of Gaussians on the same batch becomes one term with
    σ_eff = (Σ σᵢ⁻²)^(−1/2) (exact: the joint release is one Gaussian on the
    stacked vector; DESIGN.md "Accounting rules"). An unsampled Gaussian has
    q = 1. ``NonPrivateDpEvent`` gives σ = 0.

    Returns:
        An ordered dict ``{(q, σ): count}`` (first-seen order).

    Raises:
        ValueError: for events outside this family (Laplace, sampling without
            replacement, ...): use ``"rdp"`` or dp_accounting directly.
    """
    terms: "OrderedDict[tuple[float, float], int]" = OrderedDict()

    def add(key: tuple[float, float], n: int) -> None:
        terms[key] = terms.get(key, 0) + n

    def gaussian_sigma(inner: dp_event.DpEvent) -> float:
        if isinstance(inner, dp_event.GaussianDpEvent):
            return check_noise_multiplier(inner.noise_multiplier)
        if isinstance(inner, dp_event.ComposedDpEvent):
            return effective_noise_multiplier([gaussian_sigma(e) for e in inner.events])
        if isinstance(inner, dp_event.SelfComposedDpEvent):
            s = gaussian_sigma(inner.event)
            return s / math.sqrt(int(inner.count)) if s > 0 else 0.0
        raise ValueError(
            f"unsupported event inside PoissonSampledDpEvent: {type(inner).__name__}; "
            "only (compositions of) Gaussians are supported"
        )

    def walk(ev: dp_event.DpEvent, n: int) -> None:
        if isinstance(ev, dp_event.NoOpDpEvent):
            return
        if isinstance(ev, dp_event.NonPrivateDpEvent):
            add((1.0, 0.0), n)
        elif isinstance(ev, dp_event.SelfComposedDpEvent):
            walk(ev.event, n * int(ev.count))
        elif isinstance(ev, dp_event.ComposedDpEvent):
            for sub in ev.events:
                walk(sub, n)
        elif isinstance(ev, dp_event.GaussianDpEvent):
            add((1.0, check_noise_multiplier(ev.noise_multiplier)), n)
        elif isinstance(ev, dp_event.PoissonSampledDpEvent):
            q = float(ev.sampling_probability)
            if not 0.0 <= q <= 1.0:
                raise ValueError(f"sampling probability must be in [0, 1], got {q}")
            if q == 0.0:
                return  # never sampled: no privacy cost
            add((q, gaussian_sigma(ev.event)), n)
        else:
            raise ValueError(
                f"the {type(ev).__name__} event is not supported by dpopt's PLD/PRV path; "
                "use accountant='rdp' or dp_accounting directly"
            )

    walk(event, 1)
    return terms


# ---------------------------------------------------------------------------
# accountants
# ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def _sampled_gaussian_pld(sigma: float, q: float, d: float, relation: NeighboringRelation):
    """One Poisson-sampled Gaussian step's PLD (cached: building it is ~70% of an ε evaluation).

    PLD objects are not mutated by ``compose``/``self_compose`` (they return new ones), so
    sharing a cached instance is safe; training loops re-score the same (σ, q) every epoch.
    """
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=sigma,
        sampling_prob=q,
        value_discretization_interval=d,
        pessimistic_estimate=True,
        use_connect_dots=True,
        neighboring_relation=relation,
    )


def pld_epsilon(
    ledger: EventLike,
    delta: float,
    value_discretization_interval: float = PLD_DISCRETIZATION,
) -> float:
    """ε(δ) with the connect-the-dots PLD accountant (pessimistic, an upper bound).

    Args:
        ledger: a :class:`PrivacyLedger` or a DpEvent.
        delta: δ ∈ (0, 1).
        value_discretization_interval: PLD grid step in nats. Coarser grids are
            faster and (being pessimistic) give larger ε; ``1e-4`` is the
            accurate setting used by :func:`epsilon`.

    Returns:
        ε ≥ 0 (``math.inf`` if any release has σ = 0; 0.0 for an empty ledger).

    Raises:
        ValueError: invalid δ, discretisation, or an unsupported event.

    Source: Doroshenko et al. 2022 (connect the dots); dp_accounting
    ``privacy_loss_distribution.from_gaussian_mechanism``.
    """
    delta = check_delta(delta)
    d = float(value_discretization_interval)
    if not (0.0 < d <= 1.0):
        raise ValueError(f"value_discretization_interval must be in (0, 1], got {value_discretization_interval!r}")
    relation = _neighbouring(ledger)
    terms = flatten_gaussian_terms(_as_event(ledger))
    if not terms:
        return 0.0
    total = None
    for (q, sigma), count in terms.items():
        if sigma == 0.0:
            return math.inf
        if q >= 1.0:
            # Gaussians compose exactly: count releases at σ = one at σ/√count.
            part = pld_lib.from_gaussian_mechanism(
                standard_deviation=sigma / math.sqrt(count),
                value_discretization_interval=d,
                pessimistic_estimate=True,
                use_connect_dots=True,
                neighboring_relation=relation,
            )
        else:
            part = _sampled_gaussian_pld(sigma, q, d, relation)
            if count > 1:
                part = part.self_compose(count)
        total = part if total is None else total.compose(part)
    eps = float(total.get_epsilon_for_delta(delta))
    return math.inf if math.isnan(eps) else max(0.0, eps)


def rdp_epsilon(ledger: EventLike, delta: float, orders: tuple = RDP_ORDERS) -> float:
    """ε(δ) with dp_accounting's Rényi DP accountant (an upper bound).

    Composed events are passed as they are (dp_accounting reduces Gaussians
    on one Poisson batch to σ_eff itself); events must come from
    :mod:`dpopt.accounting.events`, whose float coercion avoids
    dp_accounting's silent drop of later Gaussians after an int multiplier.

    Raises:
        ValueError: invalid δ, or an event the RDP accountant cannot handle
            (e.g. Poisson sampling with ``replace_one`` neighbours).

    Source: Mironov 2017; Mironov, Talwar, Zhang 2019; conversion to (ε, δ) of
    Canonne, Kamath, Steinke 2020 as implemented in dp_accounting.
    """
    delta = check_delta(delta)
    acc = rdp_privacy_accountant.RdpAccountant(list(orders), _neighbouring(ledger))
    event = _as_event(ledger)
    if isinstance(event, dp_event.NoOpDpEvent):
        return 0.0
    if not acc.supports(event):
        raise ValueError(f"the RDP accountant does not support this ledger's events "
                         f"(neighbouring={getattr(ledger, 'neighbouring', 'add_or_remove_one')}): {event}")
    acc.compose(event)
    eps = float(acc.get_epsilon(delta))
    return math.inf if math.isnan(eps) else max(0.0, eps)


def _epsilon(ledger: EventLike, delta: float, accountant: str = "pld") -> float:
    """ε(δ) of a whole ledger (or a single DpEvent) under one accountant.

    Args:
        ledger: a :class:`PrivacyLedger` or any DpEvent built by
            :mod:`dpopt.accounting.events`.
        delta: target δ in (0, 1).
        accountant: ``"pld"`` (default, connect-the-dots at 1e-4), ``"rdp"``
            or ``"prv"`` (needs the ``prv-accountant`` package).

    Returns:
        ε ≥ 0 in nats; ``math.inf`` if any release had noise multiplier 0.
        An empty ledger gives 0.0.

    Raises:
        ValueError: on an unknown accountant, δ outside (0, 1) or an event the
            accountant cannot handle.
        ImportError: for ``"prv"`` when ``prv-accountant`` is not installed.

    Source: see the module docstring (PLD: Doroshenko et al. 2022; RDP:
    Mironov et al. 2019; PRV: Gopi et al. 2021).
    """
    name = check_accountant(accountant)
    delta = check_delta(delta)
    if name == "pld":
        return pld_epsilon(ledger, delta)
    if name == "rdp":
        return rdp_epsilon(ledger, delta)
    from .prv import prv_epsilon  # optional dependency, imported lazily

    return prv_epsilon(ledger, delta)


def dpsgd_epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "pld"
) -> float:
    """ε(δ) of T Poisson-sampled Gaussian steps (plain DP-SGD): :func:`dpsgd_event` + :func:`epsilon`.

    Args:
        noise_multiplier: σ ≥ 0; σ = 0 gives ``math.inf``.
        sample_rate: q ∈ (0, 1].
        steps: T ≥ 1.
        delta: δ ∈ (0, 1).
        accountant: ``"pld"``, ``"rdp"`` or ``"prv"``.

    Raises:
        ValueError: invalid arguments (message names the argument).
    """
    check_sample_rate(sample_rate)
    return epsilon(dpsgd_event(noise_multiplier, sample_rate, steps), delta, accountant)


def epsilon(ledger: EventLike, delta: float, accountant: str = "pld") -> float:
    """ε(δ) of a whole ledger (or DpEvent) under ONE accountant (see :func:`_epsilon`).

    Args:
        ledger: a :class:`PrivacyLedger` or a DpEvent.
        delta: δ ∈ (0, 1).
        accountant: ``"pld"`` (default), ``"rdp"`` or ``"prv"``.

    Returns:
        ε ≥ 0 (``math.inf`` if a release has σ = 0; 0.0 for an empty ledger).

    Raises:
        ValueError: invalid arguments, or a ledger whose privacy-loss distribution
            does not fit in memory (tiny σ: ε is huge anyway; use ``rdp``).
    """
    try:
        return _epsilon(ledger, delta, accountant)
    except MemoryError:
        raise ValueError(
            f"the {accountant} accountant ran out of memory on this ledger (a very small noise "
            "multiplier gives an enormous privacy-loss distribution, and ε is huge anyway); use "
            "--accountant rdp, or a larger noise multiplier") from None
