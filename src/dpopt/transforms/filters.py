"""Temporal denoising of released gradients: DiSK (simplified Kalman) and DOPPLER (low-pass).

docs/algorithms.md "DiSK and DOPPLER"; the spectral paper (Shanmugam, Barnes, Taylor 2026; docs/algorithms.md)
Tables 4 and 15.

**DiSK** (Zhang et al. 2024, "DiSK: Differentially private optimizer with
simplified Kalman filter"). With d_t = θ_t − θ_{t−1} and c = (1−κ)/(κγ), the
per-example vector handed to the Privatizer is::

    h_i = c · ∇ℓ(θ_t + γ d_t; x_i) + (1 − c) · ∇ℓ(θ_t; x_i)

clipped ONCE as one vector (sensitivity C, noise σC — σ is not rescaled);
ĝ_t is its privatized mean, and the filter output is::

    g_t = (1−κ) g_{t−1} + κ ĝ_t ,   g_0 = ĝ_0

which the base optimizer (SGD, Muon, ...) then consumes. h_i ≈ ∇ℓ(θ_t) +
((1−κ)/κ) ∇²ℓ(θ_t) d_t, a finite-difference Hessian-vector correction of the
stale filter state. When γ = (1−κ)/κ, c = 1 and ONE gradient is evaluated,
at θ_t + γ d_t. The extrapolated point is declared by
:meth:`DiSK.evaluation_points` — feedback from released state (the filter's
stored θ_{t−1}) to where the next per-sample gradients are computed — not by
a special case in the training loop.

**DOPPLER** (Zhang et al. 2024, "DOPPLER: Differentially private optimizers
with low-pass filter for privacy noise reduction"). An IIR filter on g̃::

    m_t = Σ_{τ=0}^{nb−1} b_τ g̃_{t−τ} − Σ_{τ=1}^{na−1} a_τ m_{t−τ}      (a_0 = 1, g̃_{≤0} = m_{≤0} = 0)
    u_t = the same recursion on a unit step (g̃_τ = 1 for τ ≥ 1)
    output m_t / u_t                                                 (bias correction)

Presets (``DOPPLER_PRESETS``): ``"ema"`` a = (1, −0.9), b = (0.1,) — the
spectral paper's "EMA β = 0.9"; ``"second-order"`` a = (1, −1.98343,
0.98550), b ∝ (1, 2, 1) scaled to unit DC gain. Pure post-processing.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from .base import EvaluationPoint, StepContext, Transform

__all__ = ["DiSK", "DISK_PRESETS", "LowPassFilter", "DOPPLER_PRESETS", "doppler_coefficients"]

#: (κ, γ): the authors' code default (c = 6/7) and the single-evaluation preset (c = 1).
DISK_PRESETS = {"authors": (0.7, 0.5), "single-eval": (0.4, 1.5)}


class DiSK(Transform):
    """DiSK's simplified Kalman filter; declares its extrapolated evaluation point.

    Args:
        kappa: κ ∈ (0, 1], weight of the new release (κ = 1: no filtering).
        gamma: γ > 0, extrapolation length along d_t = θ_t − θ_{t−1}.

    Attributes:
        c: (1−κ)/(κγ), the weight of the gradient at θ_t + γ d_t (set to
            exactly 1.0 when within 1e-12 of it, so c = 1 gives one evaluation).

    State per parameter: ``filtered`` (g_{t−1}, param-shaped; None before the
    first step) and ``prev_param`` (θ_{t−1}, param-shaped copy; None before
    the first step).

    Raises:
        ValueError: κ ∉ (0, 1] or γ ≤ 0. (The spectral paper's "κ = 1.5" is not
            a valid filter weight; docs/algorithms.md.)
    """

    name = "disk"

    def __init__(self, kappa: float = 0.7, gamma: float = 0.5):
        kappa, gamma = float(kappa), float(gamma)
        if not 0.0 < kappa <= 1.0:
            raise ValueError(f"kappa must be in (0, 1] (a filter weight), got {kappa}; presets: {DISK_PRESETS}")
        if not (gamma > 0 and math.isfinite(gamma)):
            raise ValueError(f"gamma must be > 0, got {gamma}")
        self.kappa, self.gamma = kappa, gamma
        c = (1.0 - kappa) / (kappa * gamma)
        self.c = 1.0 if math.isclose(c, 1.0, rel_tol=1e-12, abs_tol=0.0) else c

    def init(self, param):
        return {"filtered": None, "prev_param": None}

    def evaluation_points(self, states, params) -> Optional[list[EvaluationPoint]]:
        """[(c, γ d_t), (1−c, 0)] (zero-weight points dropped); None (at θ_t) before the first step.

        d_t = θ_t − θ_{t−1} is the current parameters minus the copy stored at
        the last update; both are released/public values.
        """
        if not states or any(st["prev_param"] is None for st in states) or self.c == 0.0:
            return None
        offset = tuple(self.gamma * (p.detach() - st["prev_param"]) for p, st in zip(params, states))
        points = [EvaluationPoint(self.c, offset)]
        if self.c != 1.0:
            points.append(EvaluationPoint(1.0 - self.c, None))
        return points

    def update(self, updates, states, params, ctx: StepContext):
        k = self.kappa
        out = []
        for g, st, p in zip(updates, states, params):
            st["prev_param"] = p.detach().clone()  # θ_t: the update is applied after the chain
            f = g.clone() if st["filtered"] is None else (1.0 - k) * st["filtered"] + k * g
            st["filtered"] = f
            out.append(f)
        return out


def _second_order() -> tuple[tuple[float, ...], tuple[float, ...]]:
    a = (1.0, -1.98343, 0.98550)
    gain = sum(a) / 4.0  # b = gain·(1, 2, 1) has Σb = Σa: unit DC gain
    return a, (gain, 2.0 * gain, gain)


DOPPLER_PRESETS = {"ema": ((1.0, -0.9), (0.1,)), "second-order": _second_order(), "none": ((1.0,), (1.0,))}


def doppler_coefficients(
    filter: str = "ema", a: Optional[Sequence[float]] = None, b: Optional[Sequence[float]] = None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Filter coefficients (a, b): a preset's, unless both ``a`` and ``b`` are given.

    Raises:
        ValueError: unknown preset, or only one of ``a`` / ``b`` given.
    """
    if (a is None) != (b is None):
        raise ValueError("give both filter coefficient lists a and b, or neither (to use a preset)")
    if a is not None:
        return tuple(float(x) for x in a), tuple(float(x) for x in b)  # type: ignore[union-attr]
    if filter not in DOPPLER_PRESETS:
        raise ValueError(f"unknown DOPPLER filter {filter!r}; presets: {sorted(DOPPLER_PRESETS)}")
    return DOPPLER_PRESETS[filter]


class LowPassFilter(Transform):
    """DOPPLER's IIR low-pass filter with unit-step bias correction.

    Args:
        a: denominator (feedback) coefficients (a_0, a_1, …); a_0 ≠ 0 (all
            coefficients are divided by a_0). The filter must be stable: all
            roots of Σ a_τ z^{na−1−τ} strictly inside the unit circle.
        b: numerator (feed-forward) coefficients (b_0, b_1, …), Σb ≠ 0.
        bias_correction: divide by the unit-step response u_t (default True).

    State per parameter: ``step``, ``inputs`` (last nb−1 releases, newest
    first), ``outputs`` (last na−1 filter outputs m, newest first) and
    ``unit`` (the matching history of the unit-step response, floats).

    Raises:
        ValueError: empty lists, a_0 = 0, Σb = 0 (zero DC gain), an unstable
            filter, or a unit-step response that vanishes (bias correction
            undefined).
    """

    name = "doppler"

    def __init__(self, a: Sequence[float] = (1.0, -0.9), b: Sequence[float] = (0.1,), bias_correction: bool = True):
        a, b = [float(x) for x in a], [float(x) for x in b]
        if not a or not b:
            raise ValueError("filter coefficient lists a and b must be non-empty")
        if a[0] == 0.0:
            raise ValueError("a_0 must be non-zero")
        a, b = [x / a[0] for x in a], [x / a[0] for x in b]
        if abs(sum(b)) < 1e-15:
            raise ValueError(f"the filter has zero DC gain (Σb = 0), it would remove the gradient: b={b}")
        if len(a) > 1 and np.max(np.abs(np.roots(a))) >= 1.0:
            raise ValueError(f"unstable filter: a root of a={a} lies on or outside the unit circle")
        if bias_correction and not b[0] != 0.0:
            raise ValueError("with bias_correction, b_0 must be non-zero (u_1 = b_0)")
        self.a, self.b, self.bias_correction = tuple(a), tuple(b), bool(bias_correction)

    def init(self, param):
        return {"step": 0, "inputs": [], "outputs": [], "unit": []}

    def update(self, updates, states, params, ctx: StepContext):
        a, b = self.a, self.b
        out = []
        for g, st in zip(updates, states):
            st["step"] += 1
            m = b[0] * g
            for bt, x in zip(b[1:], st["inputs"]):
                m = m + bt * x
            for at, y in zip(a[1:], st["outputs"]):
                m = m - at * y
            unit = sum(b[: st["step"]]) - sum(at * y for at, y in zip(a[1:], st["unit"]))
            st["inputs"] = ([g] + st["inputs"])[: len(b) - 1]
            st["outputs"] = ([m] + st["outputs"])[: len(a) - 1]
            st["unit"] = ([unit] + st["unit"])[: len(a) - 1]
            if self.bias_correction:
                if abs(unit) < 1e-12:
                    raise ValueError(
                        f"unit-step response vanished at step {st['step']}; use bias_correction=False for this filter"
                    )
                out.append(m / unit)
            else:
                out.append(m)
        return out
