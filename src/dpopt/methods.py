"""The method registry: one short factory per named DP optimizer.

Each :class:`MethodSpec` says what the method is (one line), where it comes
from (paper, equation/algorithm), its default hyperparameters, and how to
build its post-processing chain. The Privatizer is the same for every method
(flat clipping, or the clip geometry the chain feeds back); quantile and
per-layer clipping are Privatizer options usable with any flat-clipping method.

Add a method by calling :func:`register` with a new spec — never by
subclassing an optimizer per combination of options.

Hyperparameters are resolved in ONE place, :meth:`MethodSpec.hparams`
(defaults, then the dataset's defaults, then the caller's non-None
overrides). Every key a factory reads is declared in the method's
``defaults``; factories read ``hp["key"]`` and never carry a second default.
:func:`make_optimizer` resolves and builds in one call; a caller that has
already resolved the hyperparameters (the training loop records them in the
run's config) passes them to :func:`build_optimizer`, which does not
resolve them again.

Registered (``dpopt methods``): dp-sgd, dp-adam, dp-adambc, adaclip,
dp-macadam, dp-macadambc, dp-muon, dp-muon-s, disk-sgd, doppler-sgd,
disk-muon, doppler-muon. Learning rates: ``lr`` is the param-group learning
rate (``--lr``, LR schedulers); for the Muon methods it is Muon's, and the
non-matrix parameters run at ``other_lr`` (a fixed multiplier of ``lr``).
Per-dataset defaults (``dataset_defaults``) are documented, with the
measurements behind them, in ``docs/methods.md``.

Example::

    opt = make_optimizer("dp-muon", model.parameters(), noise_multiplier=1.0,
                         expected_batch_size=256, sample_rate=256 / 60000)
    for x, y in batches:
        opt.step(per_sample_gradients(model, loss_fn, x, y, opt.evaluation_points()))
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, cast

import torch
from torch import nn

from .accounting.ledger import PrivacyLedger
from .errors import ConfigError
from .noise import NoiseSource
from .optim import DPOptimizer, is_frozen
from .privatizer import Privatizer, QuantileClipping
from .transforms.adaclip import AdaClip
from .transforms.adam import ScaleByAdam
from .transforms.base import Transform, chain
from .transforms.filters import DiSK, LowPassFilter, doppler_coefficients
from .transforms.macadam import MacAdam
from .transforms.muon import ScaleByMuon, embedding_parameters, hidden_matrix_labels, muon_partition
from .transforms.sgd import Momentum, scale_by_lr
from .transforms.weight_decay import DecoupledWeightDecay

if TYPE_CHECKING:
    from .auto_clipping import AutoClipping
    from .correlated_noise import CorrelatedNoise

__all__ = [
    "MethodSpec",
    "register",
    "get_method",
    "list_methods",
    "make_optimizer",
    "build_optimizer",
    "PRIVATIZER_KEYS",
    "COMMON_DEFAULTS",
]

#: Hyperparameters every method takes, declared once here and merged into each spec's ``defaults``
#: (so ``dpopt methods`` lists them); applied by :func:`build_optimizer`, never read by a factory.
#: ``weight_decay``: decoupled (AdamW-style) decay λ appended to the chain, u ← u − lr·λ·θ
#: (:class:`~dpopt.transforms.weight_decay.DecoupledWeightDecay`; post-processing of public θ).
COMMON_DEFAULTS = {"weight_decay": 0.0}


@dataclass(frozen=True)
class MethodSpec:
    """A named DP optimizer.

    Attributes:
        name: registry key (``dp-sgd``, ...).
        description: one line for ``dpopt methods``.
        reference: paper and algorithm/equation implemented.
        defaults: default hyperparameters, including ``lr`` and
            ``max_grad_norm``: every key ``build`` reads, declared once (the
            one place a default lives; the factory reads ``hp[key]``).
        build: ``build(hparams, params=None, model=None) -> Transform`` (the
            post-processing chain, ending with the −lr scaling). ``hparams``
            are resolved (:meth:`hparams`) and include ``lr`` (so a secondary
            learning rate can be expressed as a multiplier of it); ``params``
            are the trainable parameters in model order (methods that route
            parameters, e.g. DP-Muon, need them).
        dataset_defaults: ``{dataset: {key: value}}`` overriding ``defaults``
            on that dataset (e.g. a learning rate the paper tuned for another
            task).
        geometry: ``"identity"`` (flat clipping of raw gradients) or
            ``"shift-scale"`` (the chain feeds back a coordinate-wise geometry;
            quantile / per-layer clipping do not apply).
    """

    name: str
    description: str
    reference: str
    defaults: dict
    build: Callable[..., Transform]  # build(hp, params, model=None)
    geometry: str = "identity"
    dataset_defaults: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the hyperparameters every method takes (COMMON_DEFAULTS), unless the spec declares its own default
        object.__setattr__(
            self, "defaults", {**self.defaults, **{k: v for k, v in COMMON_DEFAULTS.items() if k not in self.defaults}}
        )

    def hparams(self, dataset: Optional[str] = None, **overrides: Any) -> dict:
        """Defaults (with dataset-specific ones) updated by non-None overrides.

        This is the one place hyperparameters are resolved; the result holds
        exactly the keys of ``defaults`` and is what ``build`` receives.

        Raises:
            ConfigError: an override that this method does not take, or one whose type does not
                fit its default (a number, an integer, True/False, a tuple of numbers; the
                hyperparameter named, e.g. ``momentum must be a number ..., got 'abc'``).
        """
        hp = dict(self.defaults)
        hp.update(self.dataset_defaults.get(dataset, {}))
        unknown = sorted(k for k, v in overrides.items() if v is not None and k not in hp)
        if unknown:
            raise ConfigError(f"method {self.name!r} does not take {unknown}; its hyperparameters are {sorted(hp)}")
        for key, value in overrides.items():
            if value is not None:
                _check_hparam_type(key, value, hp[key])
        hp.update({k: v for k, v in overrides.items() if v is not None})
        return hp


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_hparam_type(key: str, value: Any, default: Any) -> None:
    """Refuse an override whose type does not fit the default's (numbers, integers, booleans, tuples).

    Raises:
        ConfigError: naming ``key`` and the expected type (e.g. ``--hp momentum=abc`` reads
            "momentum must be a number (default 0.0), got 'abc'").
    """
    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "True or False"
    elif isinstance(default, int):
        ok, kind = isinstance(value, numbers.Integral) and not isinstance(value, bool), "an integer"
    elif isinstance(default, float):
        ok, kind = _is_number(value), "a number"
    elif isinstance(default, tuple):
        ok = isinstance(value, (tuple, list)) and len(value) == len(default) and all(_is_number(v) for v in value)
        kind = f"a tuple of {len(default)} numbers"
    else:
        return
    if not ok:
        raise ConfigError(f"{key} must be {kind} (default {default!r}), got {value!r}", key)


_REGISTRY: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    """Add a method to the registry (names must be unique)."""
    if spec.name in _REGISTRY:
        raise ValueError(f"method {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def list_methods() -> list[MethodSpec]:
    """All registered methods, in registration order."""
    return list(_REGISTRY.values())


def get_method(name: str) -> MethodSpec:
    """Look up a method by name.

    Raises:
        ConfigError: unknown name (the message lists every method).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown method {name!r}; choose one of: {', '.join(_REGISTRY)}") from None


PRIVATIZER_KEYS = ("max_grad_norm",)


def make_optimizer(
    name: str,
    params: Any,
    *,
    noise_multiplier: float,
    expected_batch_size: float,
    sample_rate: float,
    ledger: Optional[PrivacyLedger] = None,
    generator: Optional[torch.Generator] = None,
    secure_mode: bool = False,
    noise: Optional[NoiseSource] = None,
    groups: Optional[Sequence[int]] = None,
    group_bounds: Optional[Sequence[float]] = None,
    quantile: Optional[QuantileClipping] = None,
    dataset: Optional[str] = None,
    model: Optional[nn.Module] = None,
    auto_clip: Optional["AutoClipping"] = None,
    mechanism: Optional["CorrelatedNoise"] = None,
    **overrides: Any,
) -> DPOptimizer:
    """Build the :class:`~dpopt.optim.DPOptimizer` of a registered method.

    Args:
        name: method name (see :func:`list_methods`).
        params: the model's parameters (iterable of tensors, e.g.
            ``model.parameters()``); frozen ``nn.Parameter`` objects (``requires_grad=False``) are
            skipped (never updated; :func:`~dpopt.optim.is_frozen`), the rest are matched to per-sample
            gradients by identity.
        noise_multiplier, expected_batch_size, sample_rate: privacy settings.
        noise, generator, secure_mode: where the noise comes from (see
            :class:`~dpopt.privatizer.Privatizer`): secret by default; a
            ``generator`` makes it reproducible (no privacy against whoever
            knows its seed; recorded in the ledger).
        groups, group_bounds: per-layer clipping (group index per parameter,
            one bound per group); noise is calibrated to √(Σ C_k²).
        quantile: quantile adaptive clipping config (flat-clipping methods only).
        auto_clip: automatic clipping (AUTO-S, :mod:`dpopt.auto_clipping`): per-example
            C·g/(‖g‖ + γ) instead of min(1, C/‖g‖)·g; flat-clipping methods only.
        mechanism: correlated noise (:class:`~dpopt.correlated_noise.CorrelatedNoise`); None: independent.
        dataset: selects dataset-specific defaults (e.g. MacAdam's h1/h2).
        model: the module the parameters belong to (optional): lets the Muon
            methods route its embedding tables to the non-Muon branch by
            module type (a plain parameter list cannot tell an embedding
            from a linear weight).
        **overrides: hyperparameters (``lr``, ``max_grad_norm``, ``betas``...;
            ``weight_decay`` for every method: decoupled decay, see :data:`COMMON_DEFAULTS`).

    Raises:
        ValueError: unknown method / hyperparameter, or a clipping option the
            method cannot use.
    """
    spec = get_method(name)
    return build_optimizer(
        spec,
        params,
        spec.hparams(dataset, **overrides),
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        sample_rate=sample_rate,
        ledger=ledger,
        generator=generator,
        secure_mode=secure_mode,
        noise=noise,
        groups=groups,
        group_bounds=group_bounds,
        quantile=quantile,
        model=model,
        auto_clip=auto_clip,
        mechanism=mechanism,
    )


def build_optimizer(
    spec: MethodSpec,
    params: Any,
    hparams: dict,
    *,
    noise_multiplier: float,
    expected_batch_size: float,
    sample_rate: float,
    ledger: Optional[PrivacyLedger] = None,
    generator: Optional[torch.Generator] = None,
    secure_mode: bool = False,
    noise: Optional[NoiseSource] = None,
    groups: Optional[Sequence[int]] = None,
    group_bounds: Optional[Sequence[float]] = None,
    quantile: Optional[QuantileClipping] = None,
    model: Optional[nn.Module] = None,
    auto_clip: Optional["AutoClipping"] = None,
    mechanism: Optional["CorrelatedNoise"] = None,
) -> DPOptimizer:
    """Build ``spec``'s :class:`~dpopt.optim.DPOptimizer` from RESOLVED hyperparameters.

    :func:`make_optimizer` is ``build_optimizer(spec, params, spec.hparams(dataset, **overrides), ...)``;
    call this directly when the hyperparameters are already resolved (e.g. to
    record them before building), so they are resolved once.

    Args:
        spec: the method (:func:`get_method`).
        params: as for :func:`make_optimizer`.
        hparams: the output of ``spec.hparams(...)``: exactly the keys of
            ``spec.defaults``.
        noise_multiplier, ..., model: as for :func:`make_optimizer`.

    Raises:
        ValueError: ``hparams`` not resolved for ``spec`` (keys missing or
            foreign), or a clipping option the method cannot use.
    """
    hp = dict(hparams)
    if set(hp) != set(spec.defaults):
        missing, extra = sorted(set(spec.defaults) - set(hp)), sorted(set(hp) - set(spec.defaults))
        raise ValueError(
            f"hyperparameters of {spec.name!r} must be resolved by get_method({spec.name!r})"
            f".hparams(...): missing {missing}, foreign {extra}"
        )
    if spec.geometry != "identity" and (quantile is not None or group_bounds is not None):
        raise ValueError(
            f"{spec.name} clips in its own shift/scale geometry; quantile and per-layer clipping "
            "apply to flat-clipping methods only (e.g. dp-sgd, dp-adam, dp-muon)"
        )
    bound = list(group_bounds) if group_bounds is not None else float(hp["max_grad_norm"])
    cls: type[Privatizer] = Privatizer
    options: dict[str, Any] = {}
    if auto_clip is not None:  # AUTO-S (dpopt.auto_clipping): flat scale C, identity geometry only
        from .auto_clipping import AutoClipPrivatizer

        if spec.geometry != "identity" or quantile is not None or group_bounds is not None:
            raise ValueError(
                f"automatic clipping normalises raw per-sample gradients against one flat scale: "
                f"it applies to flat-clipping methods without quantile or per-layer clipping "
                f"(e.g. dp-sgd, dp-adam, dp-muon), not to {spec.name} with these options"
                + (
                    f" ({spec.name} clips in its own shifted/scaled geometry): choose one of those methods "
                    "(CLI: --method dp-sgd)"
                    if spec.geometry != "identity"
                    else ": drop the quantile / per-layer option"
                )
            )
        cls, options = AutoClipPrivatizer, {"auto": auto_clip}
    privatizer = cls(
        noise_multiplier,
        bound,
        expected_batch_size,
        sample_rate,
        ledger=ledger,
        groups=groups,
        quantile=quantile,
        generator=generator,
        secure_mode=secure_mode,
        noise=noise,
        mechanism=mechanism,
        **options,
    )
    params = [p for p in params if not (isinstance(p, torch.Tensor) and is_frozen(p))]
    chain_hp = {k: v for k, v in hp.items() if k not in PRIVATIZER_KEYS and k not in COMMON_DEFAULTS}
    transform = spec.build(chain_hp, params, model=model)
    if float(hp["weight_decay"]) != 0:  # decoupled decay after the method's (−lr-scaled) update
        transform = chain(transform, DecoupledWeightDecay(hp["weight_decay"]))
    return DPOptimizer(params, privatizer, transform, lr=hp["lr"])


# --------------------------------------------------------------------------- factories
# Each factory maps the method's resolved hyperparameters (and the parameters, in model order) to
# its post-processing chain; the Privatizer is built by build_optimizer. Factories read keys by
# name (hp["key"]): every default lives in the method's spec below, never here.


def _sgd_tail(hp: dict) -> list[Transform]:
    """[Momentum(μ)] + [−lr]: heavy-ball SGD, or plain SGD when μ = 0."""
    mom = float(hp["momentum"])
    return [Momentum(mom), scale_by_lr()] if mom > 0 else [scale_by_lr()]


def _sgd(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    return chain(*_sgd_tail(hp))


def _adam(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    return chain(ScaleByAdam(hp["betas"], hp["eps"]), scale_by_lr())


def _adambc(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    return chain(ScaleByAdam(hp["betas"], noise_correction=True, gamma_prime=hp["gamma_prime"]), scale_by_lr())


def _adaclip(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    return chain(AdaClip(hp["betas"], hp["h1"], hp["h2"]), scale_by_lr())


def _macadam(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    return chain(
        MacAdam(
            hp["betas"],
            hp["gamma"],
            hp["h1"],
            hp["h2"],
            hp["variance_update"],
            b_warmup_steps=hp["b_warmup_steps"],
            center_shrinkage=hp["center_shrinkage"],
            noise_subtraction=hp["noise_subtraction"],
        ),
        scale_by_lr(),
    )


def _macadambc(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    """DP-MacAdam with the AdamBC update (the noise variance removed from v̂, floor ``gamma_prime``)."""
    return chain(
        MacAdam(
            hp["betas"],
            hp["gamma"],
            hp["h1"],
            hp["h2"],
            hp["variance_update"],
            bias_correction=True,
            gamma_prime=hp["gamma_prime"],
            b_warmup_steps=hp["b_warmup_steps"],
            center_shrinkage=hp["center_shrinkage"],
            noise_subtraction=hp["noise_subtraction"],
        ),
        scale_by_lr(),
    )


def _muon_body(hp: dict, params: Any, scaling: str, model: Optional[nn.Module] = None) -> Transform:
    """Partition: hidden matrices → Muon at ``lr``; everything else → Adam/SGD at ``other_lr``.

    The param-group learning rate (``--lr``, LR schedulers) is Muon's. The
    other part is scaled by ``scale_by_lr(other_lr / lr)``: it runs at
    ``other_lr`` with the default schedule and follows any schedule applied
    to the group lr proportionally. Routing: ``hp["label_fn"]`` if given, else
    :func:`~dpopt.transforms.muon.hidden_matrix_labels` on ``params``, with the
    embedding tables of ``model`` (when given) routed to the other branch. The
    σ₁ power iteration (``power_iters``) is DP-Muon-S's only (``scaling="spectral"``).

    Raises:
        ConfigError: no ``params`` and no ``label_fn``; non-positive lrs;
            ``other`` not ``"adam"`` / ``"sgd"``.
    """
    spectral = {"power_iters": hp["power_iters"]} if scaling == "spectral" else {}
    return _muon_partition(
        hp,
        params,
        model,
        lambda: ScaleByMuon(hp["momentum"], hp["nesterov"], hp["ns_steps"], scaling, hp["orthogonalizer"], **spectral),
    )


def _muon_partition(hp: dict, params: Any, model: Optional[nn.Module], hidden: Callable[[], Transform]) -> Transform:
    """The Muon methods' partition: ``hidden()`` (then the group lr) on the hidden matrices, Adam/SGD at
    ``other_lr`` on the rest (routing, lrs and errors as :func:`_muon_body` describes)."""
    if params is None and hp["label_fn"] is None:
        raise ConfigError(
            "Muon methods route parameters by their position in the model: build them with "
            "make_optimizer (which passes the parameters) or give hparams['label_fn']",
            "params",
            "label_fn",
        )
    label_fn = hp["label_fn"] or hidden_matrix_labels(
        params,
        hp["exclude_first"],
        hp["exclude_last"],
        embeddings=embedding_parameters(model) if model is not None else None,
    )
    lr, other_lr = float(hp["lr"]), float(hp["other_lr"])
    if not (lr > 0 and other_lr > 0):
        raise ConfigError(f"lr and other_lr must be > 0, got lr={lr}, other_lr={other_lr}", "lr", "other_lr")
    muon = chain(hidden(), scale_by_lr())
    if hp["other"] == "adam":
        other = chain(ScaleByAdam(hp["betas"], hp["eps"]), scale_by_lr(other_lr / lr))
    elif hp["other"] == "sgd":
        other = scale_by_lr(other_lr / lr)
    else:
        raise ConfigError(f"other must be 'adam' or 'sgd', got {hp['other']!r}", "other")
    return muon_partition(muon, other, label_fn)


def _muon(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    return _muon_body(hp, params, "shape", model)


def _muon_s(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    return _muon_body(hp, params, "spectral", model)


def _disk(hp: dict) -> DiSK:
    return DiSK(hp["kappa"], hp["gamma"])


def _doppler(hp: dict) -> LowPassFilter:
    return LowPassFilter(*doppler_coefficients(hp["filter"], hp["filter_a"], hp["filter_b"]))


def _disk_sgd(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    return chain(_disk(hp), *_sgd_tail(hp))


def _doppler_sgd(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    return chain(_doppler(hp), *_sgd_tail(hp))


def _disk_muon(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    # the filter sits before the partition: it declares the evaluation points for all parameters
    return chain(_disk(hp), _muon(hp, params, model))


def _doppler_muon(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    return chain(_doppler(hp), _muon(hp, params, model))


# --------------------------------------------------------------------------- defaults
_ADAM = {"betas": (0.9, 0.999), "eps": 1e-8}
_MACADAM_DATA = {"mnist": {"h1": 1e-9, "h2": 1e-6}, "cifar10": {"h1": 5e-5, "h2": 1.0}}
_MACADAM = {
    "betas": (0.9, 0.999),
    "gamma": 1e-8,
    "h1": 1e-9,
    "h2": 1e-6,
    "variance_update": "paper",
    "b_warmup_steps": 0,
    "center_shrinkage": False,
    "noise_subtraction": "last",
}
# center_shrinkage, noise_subtraction: dpopt's options, not the paper's (MacAdam docstring; docs/results/macadam-high-noise)
_MUON = {
    "max_grad_norm": 1.0,
    "ns_steps": 5,
    "orthogonalizer": "newton-schulz",
    "other": "adam",
    "other_lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "exclude_first": "conv",
    "exclude_last": True,
    "label_fn": None,
}
_DISK = {"kappa": 0.7, "gamma": 0.5}
_DOPPLER = {"filter": "ema", "filter_a": None, "filter_b": None}
_SPECTRAL = "Shanmugam, Barnes, Taylor 2026 (spectral orthogonalization)"
_MUON_REF = (
    f"{_SPECTRAL} Table 15 and docs/algorithms.md; Keller Jordan's Muon (2024): EMA momentum, "
    "NS5 with (a,b,c) = (3.4445, -4.7750, 2.0315)"
)

# Per-dataset learning rates (see docs/methods.md for the measurements behind each): the papers'
# values are for MNIST's 1,170 steps (arXiv:2606.05435 §IV) or CIFAR-scale WRNs (spectral Table 15);
# digits (1,437 examples, 22 steps per epoch at B̄ = 64) needs larger steps for some methods.
_DIGITS_LR = {"dp-adam": 3e-3, "dp-adambc": 3e-4, "adaclip": 30.0, "disk-sgd": 1.0}
_MNIST_LR = {"disk-sgd": 1.0, "dp-adambc": 1e-4, "dp-macadambc": 1e-4}


def _data(name: str, base: Optional[dict] = None) -> dict:
    out = {k: dict(v) for k, v in (base or {}).items()}
    for dataset, table in (("digits", _DIGITS_LR), ("mnist", _MNIST_LR)):
        if name in table:
            out.setdefault(dataset, {})["lr"] = table[name]
    return out


# --------------------------------------------------------------------------- registry
register(
    MethodSpec(
        "dp-sgd",
        "DP-SGD: flat L2 clipping, Gaussian noise, (momentum) SGD",
        "Abadi et al. 2016, Algorithm 1",
        {"lr": 0.1, "max_grad_norm": 1.0, "momentum": 0.0},
        _sgd,
        dataset_defaults=_data("dp-sgd"),
    )
)
register(
    MethodSpec(
        "dp-adam",
        "DP-Adam: DP-SGD privatizer, Adam on the released gradient",
        "Kingma & Ba 2015 Alg. 1 on DP-SGD releases; arXiv:2606.05435 eqs. (4)-(5)",
        {"lr": 1e-3, "max_grad_norm": 1.0, **_ADAM},
        _adam,
        dataset_defaults=_data("dp-adam"),
    )
)
register(
    MethodSpec(
        "dp-adambc",
        "DP-AdamBC: Adam with the DP-noise variance Φ = noise_std² removed from v̂ (floor γ′, no ε)",
        "Tang, Shpilevskiy & Lécuyer, AAAI 2024; arXiv:2606.05435 eq. (8)",
        {"lr": 1e-3, "max_grad_norm": 1.0, "betas": (0.9, 0.999), "gamma_prime": 1e-8},
        _adambc,
        dataset_defaults=_data("dp-adambc"),
    )
)
register(
    MethodSpec(
        "adaclip",
        "AdaClip: coordinate-wise shift/scale clipping from running mean/variance, plain SGD",
        "Pichapati et al. 2019 (arXiv:1908.07643) Alg. 1; arXiv:2606.05435 eqs. (6)-(7); docs/algorithms.md",
        {"lr": 1.0, "max_grad_norm": 1.0, "betas": (0.9, 0.99), "h1": 1e-9, "h2": 1e-6},
        _adaclip,
        geometry="shift-scale",
        dataset_defaults=_data("adaclip", _MACADAM_DATA),
    )
)
register(
    MethodSpec(
        "dp-macadam",
        "DP-MacAdam: AdaClip shift/scale clipping driven by Adam's moments",
        "arXiv:2606.05435, Algorithm 1 (t = 1 and variance decisions in docs/algorithms.md)",
        {"lr": 1e-3, "max_grad_norm": 1.0, **_MACADAM},
        _macadam,
        geometry="shift-scale",
        dataset_defaults=_data("dp-macadam", _MACADAM_DATA),
    )
)
register(
    MethodSpec(
        "dp-macadambc",
        "DP-MacAdamBC: DP-MacAdam with the AdamBC update, Φ = b²σ²/B̄² per coordinate",
        "arXiv:2606.05435 §III-D with Algorithm 1 (docs/algorithms.md)",
        {"lr": 1e-3, "max_grad_norm": 1.0, **_MACADAM, "gamma_prime": 1e-8},
        _macadambc,
        geometry="shift-scale",
        dataset_defaults=_data("dp-macadambc", _MACADAM_DATA),
    )
)
register(
    MethodSpec(
        "dp-muon",
        "DP-Muon: one global DP-SGD release; Newton-Schulz polar factor of the Nesterov momentum "
        "for hidden matrices (lr), Adam for the rest (other_lr)",
        _MUON_REF,
        {"lr": 0.02, **_MUON, "momentum": 0.95, "nesterov": True},
        _muon,
        dataset_defaults=_data("dp-muon"),
    )
)
register(
    MethodSpec(
        "dp-muon-s",
        "DP-Muon-S: as DP-Muon with β 0.9, no Nesterov, step σ₁(U)·NS5(U) (power iteration)",
        _MUON_REF,
        {"lr": 0.3, **_MUON, "momentum": 0.9, "nesterov": False, "power_iters": 2},
        _muon_s,
        dataset_defaults=_data("dp-muon-s"),
    )
)
register(
    MethodSpec(
        "disk-sgd",
        "DiSK-SGD: Kalman filter g = (1-κ)g + κĝ on releases of c∇ℓ(θ+γd) + (1-c)∇ℓ(θ), then SGD",
        f"Zhang et al. 2024 (DiSK); {_SPECTRAL} Tables 4, 15; docs/algorithms.md (κ, γ)",
        {"lr": 0.01, "max_grad_norm": 1.0, **_DISK, "momentum": 0.0},
        _disk_sgd,
        dataset_defaults=_data("disk-sgd"),
    )
)
register(
    MethodSpec(
        "doppler-sgd",
        "DOPPLER-SGD: bias-corrected low-pass IIR filter (ema / second-order) on releases, then SGD",
        f"Zhang et al. 2024 (DOPPLER); {_SPECTRAL} Tables 4, 15; docs/algorithms.md",
        {"lr": 3.0, "max_grad_norm": 1.0, **_DOPPLER, "momentum": 0.0},
        _doppler_sgd,
        dataset_defaults=_data("doppler-sgd"),
    )
)
register(
    MethodSpec(
        "disk-muon",
        "DiSK-Muon: DiSK filter, then DP-Muon's routing (Muon on hidden matrices, Adam on the rest)",
        f"{_SPECTRAL} Table 4 (DiSK [40] + Muon); docs/algorithms.md",
        {"lr": 0.02, **_MUON, "momentum": 0.95, "nesterov": True, **_DISK},
        _disk_muon,
        dataset_defaults=_data("disk-muon"),
    )
)
register(
    MethodSpec(
        "doppler-muon",
        "DOPPLER-Muon: low-pass filter, then DP-Muon's routing",
        f"{_SPECTRAL} Table 4 (DOPPLER [41] + Muon); docs/algorithms.md",
        {"lr": 0.02, **_MUON, "momentum": 0.95, "nesterov": True, **_DOPPLER},
        _doppler_muon,
        dataset_defaults=_data("doppler-muon"),
    )
)


# --------------------------------------------------------------------------- dp-muon-auto (issue 12)
# Appended region: the factory and registration of dp-muon-auto. Routing as DP-Muon's
# (hidden matrices; embeddings and the head go to Adam); the per-layer on/off choice is made
# each step from released values only (dpopt.transforms.muon_auto).
from .transforms.muon_auto import ScaleByMuonAuto  # noqa: E402


def _muon_auto(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    """DP-Muon-Auto: Muon where the released momentum's σ₁ clears the noise edge, plain momentum elsewhere.

    Hidden matrices → :class:`~dpopt.transforms.muon_auto.ScaleByMuonAuto` at ``lr`` (its off branch,
    plain EMA momentum, runs at ``off_lr``); everything else → Adam at ``other_lr``. ``model``
    (optional) lets the routing find embedding tables by module type.

    Raises:
        ConfigError: as DP-Muon's factory; non-positive ``off_lr``.
    """
    if params is None and model is None and hp["label_fn"] is None:
        raise ConfigError(
            "dp-muon-auto routes parameters by their position in the model: build it with "
            "make_optimizer (which passes the parameters) or give hparams['label_fn']",
            "params",
            "label_fn",
        )
    label_fn = hp["label_fn"] or hidden_matrix_labels(
        params if params is not None else cast(nn.Module, model),
        hp["exclude_first"],
        hp["exclude_last"],
        embeddings=embedding_parameters(model) if model is not None else None,
    )
    lr, other_lr, off_lr = float(hp["lr"]), float(hp["other_lr"]), float(hp["off_lr"])
    if not (lr > 0 and other_lr > 0 and off_lr > 0):
        raise ConfigError(
            f"lr, other_lr and off_lr must be > 0, got lr={lr}, other_lr={other_lr}, off_lr={off_lr}",
            "lr",
            "other_lr",
            "off_lr",
        )
    auto = ScaleByMuonAuto(
        hp["momentum"],
        hp["nesterov"],
        hp["ns_steps"],
        hp["orthogonalizer"],
        on_ratio=hp["on_ratio"],
        off_ratio=hp["off_ratio"],
        off_scale=off_lr / lr,
        power_iters=hp["power_iters"],
    )
    if hp["other"] == "adam":
        other = chain(ScaleByAdam(hp["betas"], hp["eps"]), scale_by_lr(other_lr / lr))
    elif hp["other"] == "sgd":
        other = scale_by_lr(other_lr / lr)
    else:
        raise ConfigError(f"other must be 'adam' or 'sgd', got {hp['other']!r}", "other")
    return muon_partition(chain(auto, scale_by_lr()), other, label_fn)


register(
    MethodSpec(
        "dp-muon-auto",
        "DP-Muon-Auto: per layer and step, Muon if the released momentum's top singular value "
        "clears the known noise edge (hysteresis), else plain momentum (off_lr); Adam for the rest",
        f"{_SPECTRAL} (phase transition); Benaych-Georges & Nadakuditi 2012 (noise edge); docs/algorithms.md "
        "'Spectral diagnostics'; docs/methods.md",
        {
            "lr": 0.02,
            **_MUON,
            "momentum": 0.95,
            "nesterov": True,
            "on_ratio": 1.1,
            "off_ratio": 1.03,
            "off_lr": 0.1,
            "power_iters": 3,
        },
        _muon_auto,
        dataset_defaults=_data("dp-muon-auto"),
    )
)


# --------------------------------------------------------------------------- dp-muon-bc (issue 40)
# Appended region: DP-MuonBC and its DiSK/DOPPLER combinations. Routing as DP-Muon's; the hidden
# matrices get ScaleByMuonBC (dpopt.transforms.muon_bc), whose heat-smoothing bias correction reads
# only released values (the release's noise std and the public filter/momentum coefficients).
from .transforms.muon_bc import ScaleByMuonBC  # noqa: E402

_MUON_BC_REF = (
    "Kim & Fan, arXiv:2605.12994 (2026), DP-MuonBC: the output-level heat-smoothing bias of "
    "Newton-Schulz under DP noise; correction formulas (D1)-(D6) are dpopt's own leading-order "
    "derivation (the paper's equations could not be consulted): dpopt.transforms.muon_bc, "
    "docs/methods.md"
)


def _muon_bc_body(hp: dict, params: Any, model: Optional[nn.Module], input_filter: dict) -> Transform:
    """Partition: hidden matrices → :class:`~dpopt.transforms.muon_bc.ScaleByMuonBC` at ``lr``;
    the rest → Adam/SGD at ``other_lr`` (as DP-Muon). ``input_filter``: the filter before the
    partition (its coefficients, for the noise-variance propagation (D6)).

    Raises:
        ConfigError: as DP-Muon's factory.
    """
    return _muon_partition(
        hp,
        params,
        model,
        lambda: ScaleByMuonBC(
            hp["momentum"],
            hp["nesterov"],
            hp["ns_steps"],
            hp["orthogonalizer"],
            correction=hp["bias_correction"],
            max_correction=hp["max_correction"],
            **input_filter,
        ),
    )


def _muon_bc(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    return _muon_bc_body(hp, params, model, {})


def _disk_muon_bc(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    return chain(_disk(hp), _muon_bc_body(hp, params, model, {"input_filter": "disk", "filter_kappa": hp["kappa"]}))


def _doppler_muon_bc(hp: dict, params: Any = None, model: Optional[nn.Module] = None) -> Transform:
    """DOPPLER-MuonBC: first-order DOPPLER filters only (the ``"ema"`` preset), whose noise
    propagation (D6) is exact with O(1) state.

    Raises:
        ConfigError: a filter of order > 1 (e.g. ``"second-order"``).
    """
    a0, b0 = doppler_coefficients(hp["filter"], hp["filter_a"], hp["filter_b"])
    a, b = [x / a0[0] for x in a0], [x / a0[0] for x in b0]  # as LowPassFilter normalises them
    if len(a) > 2 or len(b) > 1:
        raise ConfigError(
            f"doppler-muon-bc propagates the noise variance of first-order filters only "
            f"(a = (1, a1), b = (b0,)); got a={tuple(a)}, b={tuple(b)}",
            "filter",
        )
    a1 = a[1] if len(a) == 2 else 0.0
    return chain(
        _doppler(hp), _muon_bc_body(hp, params, model, {"input_filter": "iir1", "filter_a1": a1, "filter_b0": b[0]})
    )


_MUON_BC = {"lr": 0.02, **_MUON, "momentum": 0.95, "nesterov": True, "bias_correction": True, "max_correction": 0.5}
register(
    MethodSpec(
        "dp-muon-bc",
        "DP-MuonBC: DP-Muon plus the leading heat-smoothing bias correction of the polar factor, "
        "O + P·diag(min(s²κ_i, max_correction))·Qᵀ (s² the released noise variance of U; dpopt's derivation)",
        _MUON_BC_REF,
        dict(_MUON_BC),
        _muon_bc,
        dataset_defaults=_data("dp-muon-bc"),
    )
)
register(
    MethodSpec(
        "disk-muon-bc",
        "DiSK-MuonBC: DiSK filter, then DP-MuonBC (noise variance propagated through the filter)",
        f"{_MUON_BC_REF}; DiSK (Zhang et al. 2024)",
        {**_MUON_BC, **_DISK},
        _disk_muon_bc,
        dataset_defaults=_data("disk-muon-bc"),
    )
)
register(
    MethodSpec(
        "doppler-muon-bc",
        "DOPPLER-MuonBC: first-order low-pass filter (ema), then DP-MuonBC",
        f"{_MUON_BC_REF}; DOPPLER (Zhang et al. 2024)",
        {**_MUON_BC, **_DOPPLER},
        _doppler_muon_bc,
        dataset_defaults=_data("doppler-muon-bc"),
    )
)
