"""The built-in audit suite: what ``dpopt audit`` and ``dpopt audit --all`` run.

* :data:`BUILTIN_MECHANISMS` — five Privatizer configurations (flat, shift/scale
  geometry, per-layer bounds, quantile clipping, automatic clipping), audited by :func:`audit_mechanism`;
* every method of the registry :mod:`dpopt.methods`, audited in the geometry it
  would use next by :func:`audit_method`;
* :func:`audit_all` runs both, each with its own :func:`mechanism_seed`.

Every audit here seeds the privatizer's noise on purpose (``generator=``, the
reproducible research mode): an audit is an experiment whose numbers must be
re-runnable; the false-alarm rate α is then the chance that a given seed fails.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, NamedTuple, Optional

import torch

from ..engine.reference import PerSampleGrads
from ..privatizer import Privatizer, QuantileClipping
from ..types import ClipGeometry
from .harness import DEFAULT_TRIALS, AuditResult, _vectorisable, audit_privatizer
from .stats import DEFAULT_ALPHA, DEFAULT_DELTA

__all__ = [
    "BUILTIN_MECHANISMS",
    "MechanismSpec",
    "audit_mechanism",
    "registered_methods",
    "audit_method",
    "mechanism_seed",
    "SuiteResults",
    "audit_all",
]


class MechanismSpec(NamedTuple):
    """What :func:`~dpopt.auditing.audit_privatizer` needs to audit one mechanism.

    Attributes:
        make_privatizer: ``() -> Privatizer`` with ``sample_rate == 1``.
        shapes: parameter shapes.
        geometry: the clip geometry, or ``None`` for identity.
    """

    make_privatizer: Callable[[], Any]
    shapes: list
    geometry: Optional[ClipGeometry]


_BUILTINS: dict[str, Callable[[int], MechanismSpec]] = {}


def _builtin(name: str):
    """Register a built-in mechanism: a function ``seed -> MechanismSpec``."""

    def register(fn: Callable[[int], MechanismSpec]):
        _BUILTINS[name] = fn
        return fn

    return register


def _noise(seed: int) -> torch.Generator:
    """The reproducible noise generator of a built-in audit (see the module docstring)."""
    return torch.Generator().manual_seed(int(seed) + 7)


@_builtin("flat")
def _flat(seed: int) -> MechanismSpec:
    gen = _noise(seed)
    return MechanismSpec(lambda: Privatizer(1.0, 1.0, 8.0, 1.0, generator=gen), [(2, 3), (2,)], None)


@_builtin("shift-scale")
def _shift_scale(seed: int) -> MechanismSpec:
    gen = _noise(seed)
    shapes = [(2, 3), (2,)]
    g = torch.Generator().manual_seed(int(seed) + 11)
    shift = tuple(0.1 * torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    scale = tuple(0.05 + 0.3 * torch.rand(s, generator=g, dtype=torch.float64) for s in shapes)
    return MechanismSpec(lambda: Privatizer(1.0, 1.0, 8.0, 1.0, generator=gen), shapes, ClipGeometry(shift, scale))


@_builtin("per-layer")
def _per_layer(seed: int) -> MechanismSpec:
    gen = _noise(seed)
    return MechanismSpec(
        lambda: Privatizer(1.0, [1.0, 2.0, 2.0], 8.0, 1.0, groups=[0, 1, 2], generator=gen), [(2, 2), (3,), (2,)], None
    )


@_builtin("quantile")
def _quantile(seed: int) -> MechanismSpec:
    # σ_grad 1.2 and count multiplier 2 compose to σ_eff ≈ 1.03; B̄ = 50 keeps the
    # released fraction away from its clamp to [0, 1].
    gen = _noise(seed)
    return MechanismSpec(
        lambda: Privatizer(1.2, 1.0, 50.0, 1.0, quantile=QuantileClipping(2.0), generator=gen), [(2, 3), (2,)], None
    )


@_builtin("auto")
def _auto(seed: int) -> MechanismSpec:
    # automatic clipping (AUTO-S, dpopt.auto_clipping): C·g/(‖g‖ + γ), sensitivity C = 1, σ = 1;
    # a subclass of the Privatizer, audited in loop mode
    from ..auto_clipping import AutoClipping, AutoClipPrivatizer

    gen = _noise(seed)
    return MechanismSpec(
        lambda: AutoClipPrivatizer(1.0, 1.0, 8.0, 1.0, generator=gen, auto=AutoClipping(0.01)), [(2, 3), (2,)], None
    )


BUILTIN_MECHANISMS = tuple(_BUILTINS)
"""Privatizer configurations audited by ``dpopt audit``:

* ``flat`` — DP-SGD family: one L2 bound C = 1, σ = 1;
* ``shift-scale`` — AdaClip / DP-MacAdam geometry: unit bound in w = (g − m)/b space;
* ``per-layer`` — per-group bounds (1, 2, 2), noise σ·√(Σ C_k²) = 3σ;
* ``quantile`` — quantile clipping: gradient Gaussian (σ = 1.2) and clipped-count
  Gaussian (multiplier 2) on the same batch, audited as one composed release;
* ``auto`` — automatic clipping (AUTO-S, Bu et al. 2023): C·g/(‖g‖ + γ), C = 1, γ = 0.01, σ = 1.
"""


def _builtin_spec(name: str, seed: int) -> MechanismSpec:
    """The :class:`MechanismSpec` of a built-in mechanism (all q = 1).

    Raises:
        ValueError: unknown name (the message lists the built-ins).
    """
    if name not in _BUILTINS:
        raise ValueError(f"unknown built-in mechanism {name!r}; choose one of {', '.join(BUILTIN_MECHANISMS)}")
    return _BUILTINS[name](seed)


def audit_mechanism(
    name: str,
    *,
    trials: int = DEFAULT_TRIALS,
    delta: float = DEFAULT_DELTA,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
) -> AuditResult:
    """Audit one of :data:`BUILTIN_MECHANISMS` (see :func:`~dpopt.auditing.audit_privatizer`).

    Raises:
        ValueError: unknown name (the message lists the built-ins), or invalid δ/α/trials.
    """
    make, shapes, geometry = _builtin_spec(name, seed)
    return audit_privatizer(
        make, shapes, name=name, geometry=geometry, trials=trials, delta=delta, alpha=alpha, seed=seed
    )


# --------------------------------------------------------------------------- registered methods
def registered_methods() -> list[str]:
    """Names of the methods in :mod:`dpopt.methods`.

    Raises:
        ImportError: when the method registry cannot be imported.
    """
    from .. import methods  # optional for the auditor: audit_all reports why it is missing

    return [spec.name for spec in methods.list_methods()]


def _method_params(dtype) -> list:
    """A 2-D weight (Muon-type methods route matrices specially) and a bias, zeros."""
    return [torch.nn.Parameter(torch.zeros(3, 4, dtype=dtype)), torch.nn.Parameter(torch.zeros(4, dtype=dtype))]


def audit_method(
    name: str,
    *,
    trials: int = DEFAULT_TRIALS,
    delta: float = DEFAULT_DELTA,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    noise_multiplier: float = 1.0,
    expected_batch_size: float = 8.0,
    warmup_steps: int = 3,
    **options: Any,
) -> AuditResult:
    """Audit the privatizer of a registered method, in the geometry it would use next.

    Builds ``dpopt.methods.make_optimizer(name, params, noise_multiplier=σ,
    expected_batch_size=B̄, sample_rate=1.0, **options)`` on a tiny model (a
    3×4 weight and a bias), takes ``warmup_steps`` optimizer steps on random
    (public, synthetic) per-sample gradients so that adaptive geometries
    (AdaClip, DP-MacAdam) move away from their initial value, then audits one
    step of ``optimizer.privatizer`` in ``optimizer.geometry()`` with a canary
    of w-space norm ≫ C (see :func:`~dpopt.auditing.audit_privatizer`).
    Privatizers that cannot be vectorised (quantile clipping) are audited in
    loop mode with a freshly built optimizer per trial (slow).

    Args:
        name: a registered method name (see :func:`registered_methods`).
        trials, delta, alpha, seed: see :func:`~dpopt.auditing.audit_privatizer`.
        noise_multiplier, expected_batch_size: privacy settings of the audited step.
        warmup_steps: optimizer steps before the audited one (≥ 0).
        **options: passed to ``make_optimizer`` (e.g. ``max_grad_norm``, ``quantile``).

    Returns:
        :class:`~dpopt.auditing.AuditResult` named after the method.

    Raises:
        ImportError: if :mod:`dpopt.methods` does not import.
        ValueError: unknown method / options (from the registry), or as
            :func:`~dpopt.auditing.audit_privatizer`.
    """
    from .. import methods  # optional for the auditor (see registered_methods)

    if int(warmup_steps) < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")

    # The audited noise is seeded (as this module's docstring promises), from ONE generator that every
    # optimizer built here shares, so loop mode's fresh optimizer per trial still gets fresh draws.
    options.setdefault("generator", _noise(seed))

    def build():
        params = _method_params(torch.float64)
        opt = methods.make_optimizer(
            name,
            params,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            sample_rate=1.0,
            **options,
        )
        return opt, params

    opt, params = build()
    gen = torch.Generator().manual_seed(int(seed) + 3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed) + 5)
        for _ in range(int(warmup_steps)):
            grads = [0.5 + torch.randn(6, *p.shape, generator=gen, dtype=p.dtype) for p in params]
            # synthetic (public) stand-ins "evaluated" where the method asks (DiSK's points)
            opt.step(PerSampleGrads(grads, params=params, points=opt.evaluation_points()))
    geometry = opt.geometry()
    priv = opt.privatizer
    shapes = [tuple(p.shape) for p in params]
    if _vectorisable(priv):
        make = lambda: priv  # noqa: E731 - vectorised mode builds it once
    else:
        make = lambda: build()[0].privatizer  # noqa: E731 - fresh optimizer per trial
    return audit_privatizer(
        make, shapes, name=name, geometry=geometry, trials=trials, delta=delta, alpha=alpha, seed=seed
    )


def mechanism_seed(seed: int, name: str) -> int:
    """A per-mechanism seed (stable across runs) so that audits of different
    mechanisms use independent noise and splits: their false alarms are then
    independent events, each of probability ≤ α."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**31 - 1)


class SuiteResults(NamedTuple):
    """Result of :func:`audit_all` (unpacks as ``results, note = ...``).

    Attributes:
        results: one :class:`~dpopt.auditing.AuditResult` per mechanism, built-ins first.
        note: why the registered methods were skipped, else ``None``.
    """

    results: list
    note: Optional[str]


def audit_all(
    *,
    trials: int = DEFAULT_TRIALS,
    delta: float = DEFAULT_DELTA,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    methods: bool = True,
) -> SuiteResults:
    """Audit every built-in mechanism and (if importable) every registered method.

    Args:
        trials, delta, alpha: see :func:`~dpopt.auditing.audit_privatizer`.
        seed: base seed; each mechanism runs with ``mechanism_seed(seed, name)``.
        methods: also audit the registered methods (``dpopt audit --all``).

    Returns:
        :class:`SuiteResults` ``(results, note)``.

    Raises:
        ValueError: invalid δ/α/trials.
    """
    results = [
        audit_mechanism(n, trials=trials, delta=delta, alpha=alpha, seed=mechanism_seed(seed, n))
        for n in BUILTIN_MECHANISMS
    ]
    note = None
    if methods:
        try:
            names = registered_methods()
        except ImportError as exc:  # the registry is optional for the auditor
            names, note = [], f"method registry not importable ({exc}); audited built-in mechanisms only"
        results += [
            audit_method(n, trials=trials, delta=delta, alpha=alpha, seed=mechanism_seed(seed, n)) for n in names
        ]
    return SuiteResults(results, note)
