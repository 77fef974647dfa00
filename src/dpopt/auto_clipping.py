"""Automatic clipping (AUTO-S): per-example normalisation instead of clipping at a tuned C.

Bu, Wang, Zha, Karypis, "Automatic Clipping: Differentially Private Deep Learning Made Easier
and Stronger" (NeurIPS 2023, arXiv:2206.07136), Eq. (3.3) "AUTO-S"::

    clip_AUTO-S(g_i) = g_i / (‖g_i‖ + γ)          γ > 0 the stability constant (0.01 in the paper)

Every normalised example has norm ‖g_i‖/(‖g_i‖ + γ) < 1, so the sum has L2 sensitivity 1 under
add/remove, whatever the data: no bound is tuned. dpopt keeps the clip scale C of the method
(``max_grad_norm``) as a public multiplier of that rule — the weight of example i is::

    w_i = C / (‖g_i‖ + γ)            so  ‖w_i g_i‖ = C·‖g_i‖/(‖g_i‖ + γ) < C

and the release's sensitivity is C (= 1 at C = 1, the paper's setting; any other C only rescales
the release and its noise together, which the learning rate absorbs — Bu et al. Thm. 1). The
Gaussian noise std is σ·C, exactly as for flat clipping at C, and the ledger records the same
DpEvent plus ``clipping="auto"`` and ``gamma`` (public).

This is a Privatizer rule (it sees per-sample norms): :class:`AutoClipPrivatizer` overrides only
:meth:`~dpopt.privatizer.Privatizer._clip_weights`; every other step (sum, noise, ÷ B̄, ledger) is
the flat Privatizer's. It applies to flat-clipping methods in the identity geometry (dp-sgd,
dp-adam, dp-adambc, dp-muon and its variants, the DiSK/DOPPLER methods); quantile clipping
(which adapts C) and per-layer bounds are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

from torch import Tensor

from .privatizer import Privatizer, clip_factors

__all__ = ["AutoClipping", "AutoClipPrivatizer", "DEFAULT_GAMMA"]

#: γ of AUTO-S in Bu et al. (arXiv:2206.07136), §3 ("we use γ = 0.01 throughout").
DEFAULT_GAMMA = 0.01


@dataclass(frozen=True)
class AutoClipping:
    """Configuration of automatic clipping (public).

    Attributes:
        gamma: γ > 0 of g/(‖g‖ + γ) (units of the gradient norm; default 0.01).

    Raises:
        ValueError: γ not a finite number > 0.
    """

    gamma: float = DEFAULT_GAMMA

    def __post_init__(self) -> None:
        g = float(self.gamma)
        if not (g > 0 and math.isfinite(g)):
            raise ValueError(f"automatic clipping's gamma must be a finite number > 0, got {self.gamma!r}")
        object.__setattr__(self, "gamma", g)


class AutoClipPrivatizer(Privatizer):
    """A :class:`~dpopt.privatizer.Privatizer` whose clip rule is AUTO-S (Bu et al. 2023, Eq. 3.3).

    Per example i (norm ‖w_i‖ in the release's geometry)::

        weight_i = C / (‖w_i‖ + γ)       ‖weight_i · w_i‖ < C   (= 1·C: the normalised bound)

    Args:
        *args, **kwargs: those of :class:`~dpopt.privatizer.Privatizer` (one flat bound C).
        auto: the :class:`AutoClipping` config (γ); default γ = 0.01.

    Raises:
        ValueError: per-group bounds or quantile clipping (AUTO-S normalises against one flat
            scale; the noise is calibrated to it), and those of the Privatizer.
    """

    def __init__(self, *args, auto: AutoClipping = AutoClipping(), **kwargs):
        super().__init__(*args, **kwargs)
        if len(self.bounds) != 1 or self.groups is not None:
            raise ValueError("automatic clipping takes one flat scale max_grad_norm (no per-layer bounds)")
        if self.quantile is not None:
            raise ValueError("automatic clipping has no bound to adapt: quantile clipping does not apply")
        if not math.isfinite(self.bounds[0]):
            raise ValueError("automatic clipping needs a finite scale max_grad_norm (its sensitivity)")
        self.auto = auto if isinstance(auto, AutoClipping) else AutoClipping(float(auto))

    @property
    def gamma(self) -> float:
        """γ of the normalisation (public)."""
        return self.auto.gamma

    def _clip_weights(self, sq: Tensor, bounds: Union[Tensor, Sequence[float]]) -> Tensor:
        """AUTO-S weights C/(‖w_i‖ + γ), ``[B, 1]`` from the squared norms ``sq``; every weighted norm is < C.

        Evaluated by :func:`~dpopt.privatizer.clip_factors` without the cap at 1 (float64, rounded down
        into ``sq``'s dtype: never above the real C/(‖w_i‖ + γ), so the weighted norm stays < C in real
        arithmetic, whatever the rounding of √, + γ and ÷).
        """
        return clip_factors(sq, bounds, self.auto.gamma, cap=False)

    def _clip_meta(self) -> dict:
        return {"clipping": "auto", "gamma": self.auto.gamma}

    def state_dict(self, *, include_ledger: bool = True) -> dict:
        """The Privatizer's state plus ``auto_gamma`` (refused on load into another γ)."""
        state = super().state_dict(include_ledger=include_ledger)
        state["auto_gamma"] = self.auto.gamma
        return state

    def load_state_dict(self, state: dict) -> None:
        """Load a state saved by an AutoClipPrivatizer with the same γ.

        Raises:
            ValueError: a state of a Privatizer without automatic clipping, or with another γ.
        """
        if float(state.get("auto_gamma", float("nan"))) != self.auto.gamma:
            raise ValueError(
                f"this state is not of automatic clipping with gamma={self.auto.gamma} "
                f"(saved: {state.get('auto_gamma')!r})"
            )
        super().load_state_dict({k: v for k, v in state.items() if k != "auto_gamma"})


def split_gamma(hparams: dict, method_keys) -> tuple[float, dict]:
    """AUTO-S's γ from a run's method hyperparameters (``dpopt train --clipping auto --hp gamma=…``).

    ``auto_gamma`` is always automatic clipping's; ``gamma`` is too when the method has no
    hyperparameter of that name (DiSK's and DP-MacAdam's ``gamma`` stay theirs: give
    ``auto_gamma`` there). Default :data:`DEFAULT_GAMMA`.

    Args:
        hparams: the user's method hyperparameters (not modified).
        method_keys: the hyperparameter names the method takes.

    Returns:
        ``(gamma, rest)``: γ and the hyperparameters left for the method.

    Raises:
        ValueError: γ not a finite number > 0 (:class:`AutoClipping`).
    """
    rest = dict(hparams)
    gamma = rest.pop("auto_gamma", None)
    if gamma is None and "gamma" in rest and "gamma" not in set(method_keys):
        gamma = rest.pop("gamma")
    return AutoClipping(DEFAULT_GAMMA if gamma is None else float(gamma)).gamma, rest
