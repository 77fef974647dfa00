"""The method registry: one short factory per named DP optimizer.

Each :class:`MethodSpec` says what the method is (one line), where it comes
from (paper, equation/algorithm), its default hyperparameters, and how to
build its post-processing chain. The Privatizer is the same for every method
(flat clipping, or the clip geometry the chain feeds back); quantile and
per-layer clipping are Privatizer options usable with any flat-clipping method.

Add a method by calling :func:`register` with a new spec — never by
subclassing an optimizer per combination of options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .accounting.ledger import PrivacyLedger
from .optim import DPOptimizer
from .privatizer import Privatizer, QuantileClipping
from .transforms.adam import ScaleByAdam
from .transforms.base import Transform, chain
from .transforms.macadam import MacAdam
from .transforms.sgd import Momentum, scale_by_lr

__all__ = ["MethodSpec", "register", "get_method", "list_methods", "make_optimizer", "PRIVATIZER_KEYS"]


@dataclass(frozen=True)
class MethodSpec:
    """A named DP optimizer.

    Attributes:
        name: registry key (``dp-sgd``, ...).
        description: one line for ``dpopt methods``.
        reference: paper and algorithm/equation implemented.
        defaults: default hyperparameters, including ``lr`` and ``max_grad_norm``.
        build: ``build(hparams) -> Transform`` (the post-processing chain,
            ending with the −lr scaling).
        geometry: ``"identity"`` (flat clipping of raw gradients) or
            ``"shift-scale"`` (the chain feeds back a coordinate-wise geometry;
            quantile / per-layer clipping do not apply).
    """

    name: str
    description: str
    reference: str
    defaults: dict
    build: Callable[[dict], Transform]
    geometry: str = "identity"
    dataset_defaults: dict = field(default_factory=dict)

    def hparams(self, dataset: Optional[str] = None, **overrides: Any) -> dict:
        """Defaults (with dataset-specific ones) updated by non-None overrides.

        Raises:
            ValueError: an override that this method does not take.
        """
        hp = dict(self.defaults)
        hp.update(self.dataset_defaults.get(dataset, {}))
        unknown = sorted(k for k, v in overrides.items() if v is not None and k not in hp)
        if unknown:
            raise ValueError(f"method {self.name!r} does not take {unknown}; its hyperparameters are "
                             f"{sorted(hp)}")
        hp.update({k: v for k, v in overrides.items() if v is not None})
        return hp


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
        ValueError: unknown name (the message lists every method).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(_REGISTRY)}") from None


PRIVATIZER_KEYS = ("max_grad_norm",)


def make_optimizer(
    name: str,
    params,
    *,
    noise_multiplier: float,
    expected_batch_size: float,
    sample_rate: float,
    ledger: Optional[PrivacyLedger] = None,
    generator: Optional[torch.Generator] = None,
    groups: Optional[Sequence[int]] = None,
    group_bounds: Optional[Sequence[float]] = None,
    quantile: Optional[QuantileClipping] = None,
    dataset: Optional[str] = None,
    **overrides: Any,
) -> DPOptimizer:
    """Build the :class:`~dpopt.optim.DPOptimizer` of a registered method.

    Args:
        name: method name (see :func:`list_methods`).
        params: the model's trainable parameters (iterable of tensors).
        noise_multiplier, expected_batch_size, sample_rate: privacy settings.
        groups, group_bounds: per-layer clipping (group index per parameter,
            one bound per group); noise is calibrated to √(Σ C_k²).
        quantile: quantile adaptive clipping config (flat-clipping methods only).
        dataset: selects dataset-specific defaults (e.g. MacAdam's h1/h2).
        **overrides: hyperparameters (``lr``, ``max_grad_norm``, ``betas``...).

    Raises:
        ValueError: unknown method / hyperparameter, or a clipping option the
            method cannot use.
    """
    spec = get_method(name)
    hp = spec.hparams(dataset, **overrides)
    if spec.geometry != "identity" and (quantile is not None or group_bounds is not None):
        raise ValueError(f"{name} clips in its own shift/scale geometry; quantile and per-layer clipping "
                         "apply to flat-clipping methods only (e.g. dp-sgd, dp-adam, dp-muon)")
    bound = list(group_bounds) if group_bounds is not None else float(hp["max_grad_norm"])
    privatizer = Privatizer(noise_multiplier, bound, expected_batch_size, sample_rate, ledger=ledger,
                            groups=groups, quantile=quantile, generator=generator)
    chain_hp = {k: v for k, v in hp.items() if k not in PRIVATIZER_KEYS and k != "lr"}
    return DPOptimizer(list(params), privatizer, spec.build(chain_hp), lr=hp["lr"])


# --------------------------------------------------------------------------- methods
def _sgd(hp: dict) -> Transform:
    mom = float(hp["momentum"])
    return chain(Momentum(mom), scale_by_lr()) if mom > 0 else scale_by_lr()


def _adam(hp: dict) -> Transform:
    return chain(ScaleByAdam(hp["betas"], hp["eps"]), scale_by_lr())


def _macadam(hp: dict) -> Transform:
    return chain(MacAdam(hp["betas"], hp["gamma"], hp["h1"], hp["h2"], hp["variance_update"],
                         b_warmup_steps=hp["b_warmup_steps"]), scale_by_lr())


_MACADAM_DATA = {"mnist": {"h1": 1e-9, "h2": 1e-6}, "cifar10": {"h1": 5e-5, "h2": 1.0}}

register(MethodSpec(
    "dp-sgd", "DP-SGD: flat L2 clipping, Gaussian noise, (momentum) SGD",
    "Abadi et al. 2016, Algorithm 1",
    {"lr": 0.1, "max_grad_norm": 1.0, "momentum": 0.0}, _sgd))
register(MethodSpec(
    "dp-adam", "DP-Adam: DP-SGD privatizer, Adam on the released gradient",
    "Kingma & Ba 2015 Alg. 1 on DP-SGD releases; dp-macadam.txt eqs. (4)-(5)",
    {"lr": 1e-3, "max_grad_norm": 1.0, "betas": (0.9, 0.999), "eps": 1e-8}, _adam))
register(MethodSpec(
    "dp-macadam", "DP-MacAdam: AdaClip shift/scale clipping driven by Adam's moments",
    "dp-macadam.txt, Algorithm 1 (t = 1 and variance decisions in ALGORITHMS.md)",
    {"lr": 1e-3, "max_grad_norm": 1.0, "betas": (0.9, 0.999), "gamma": 1e-8, "h1": 1e-9, "h2": 1e-6,
     "variance_update": "paper", "b_warmup_steps": 0},
    _macadam, geometry="shift-scale", dataset_defaults=_MACADAM_DATA))
