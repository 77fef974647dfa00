"""Correlated noise across steps: DP matrix factorization (banded MF and BLT) as a noise mechanism.

The prefix-sum workload A (T×T lower-triangular ones: the model after t steps of SGD is a prefix
sum of the released gradients) is factored as A = B·C with C lower-triangular Toeplitz. The
mechanism releases the gradients x̃ = x + σ·S·C⁻¹z (z_t ~ N(0, I_d) fresh every step, S the clip
bound), i.e. C·x̃ = C·x + σS·z: the Gaussian mechanism on C·x, whose L2 sensitivity is S·Δ(C) for
the participation pattern of the sampler (Denisov et al. 2022, arXiv 2202.08312; Choquette-Choo et
al. 2023, "Multi-epoch matrix factorization", arXiv 2211.06530, Thm 2.1, also for adaptively chosen
gradients). Independent noise is C = I.

Strategies (the Toeplitz coefficients of C, :class:`Strategy`):

``banded`` (b bands; Choquette-Choo et al., arXiv 2306.08153; McKenna, arXiv 2405.13763)
    C_{t,s} = c_{t−s} for 0 ≤ t−s < b. The noise stream solves C·w = z:
    w_t = (z_t − Σ_{j=1}^{b−1} c_j w_{t−j}) / c_0, state: the last b−1 noise vectors.
``blt`` (n buffers; Dvijotham et al., arXiv 2404.16706)
    C⁻¹ is a buffered linear Toeplitz matrix: (C⁻¹)_{t,s} = d_{t−s}, d_0 = 1,
    d_k = Σ_i ω_i θ_i^{k−1} (k ≥ 1), so w_t = z_t + Σ_i ω_i s_{i,t}, s_{i,t+1} = θ_i s_{i,t} + z_t,
    state: the n buffers s_i.

Either state holds (bands − 1 or buffers) × parameters float64 values, and is as sensitive as the
noise: whoever knows it subtracts the correlated part of all later noise. It is held in memory only
(:class:`CorrelatedNoise`): a pickle, copy or forked child carries none of it, and a stream whose
state is absent refuses to continue (resume is refused; docs/correlated-noise.md).

Participation (:class:`Participation`): every example takes part in at most k of the T steps, any two
of them at least ``min_separation`` steps apart (cyclic batches: one fixed partition of the data into
b batches, step t uses batch t mod b, so k = epochs and min_separation = b). Its sensitivity is
Δ² = max_π ‖C·1_π‖²; for vector-valued contributions (clipped gradients g_j, ‖g_j‖ ≤ 1)
sup ‖Σ_{j∈π} C_{:,j} g_jᵀ‖²_F ≤ Σ_{i,j∈π} |X_ij|, X = CᵀC, with equality when X ≥ 0 on π
(:func:`sensitivity`; Choquette-Choo et al. arXiv 2211.06530, Sec. 2). Where C's Toeplitz coefficients
are nonnegative and nonincreasing the worst π is 0, b, 2b, … for the run and every prefix (exact;
McKenna 2024, arXiv 2405.13763, Thm 2); elsewhere a general upper bound (arXiv 2306.08153, Alg. 4).
The ledger record names the method (``sensitivity_method``) so ``dpopt check`` re-derives with it.

Accounting (no amplification): the whole run is ONE Gaussian mechanism with noise multiplier σ/Δ.
The ledger stores it as one Gaussian per release whose compositions are exact: release t carries
``GaussianDpEvent(σ / √(Δ_t² − Δ_{t−1}²))`` (``NoOpDpEvent`` when Δ_t = Δ_{t−1}), with Δ_t the
sensitivity of the first t+1 rows of C — Gaussians compose exactly (μ-GDP: μ² adds; Dong, Roth, Su
2019), so the ledger after t+1 releases scores as Gaussian(σ/Δ_t), the true privacy of that prefix,
and after T releases as Gaussian(σ/Δ). Amplified accounting (opt-in, ``sampling="cyclic-poisson"``):
banded MF with b ≤ b' bands over cyclic Poisson sampling (:class:`dpopt.cyclic_batches.CyclicPoissonLoader`:
b' fixed partitions, partition t mod b' Poisson-sampled at rate q at step t) is k = ⌈T/b'⌉ rounds of the
Poisson-sampled Gaussian at σ/‖c‖ (Choquette-Choo et al., arXiv 2306.08153, Thm 4;
:func:`amplified_step_events`, :func:`amplified_banded_event`); BLT and banded with b > b' (overlapping
columns) are k rounds at σ/√λ_max(UᵀU), U the columns of one part's steps (the spectral bound,
:mod:`dpopt.accounting.sampled_matrix_mechanism`).
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Optional

import numpy as np
import torch
from dp_accounting import dp_event
from torch import Tensor

from .accounting.calibration import calibrate_correlated_noise_multiplier as calibrate_noise_multiplier
from .accounting.matrix_factorization import (
    LEGACY_SENSITIVITY_METHOD,
    MECHANISMS,
    SENSITIVITY_METHOD,
    SENSITIVITY_METHODS,
    Participation,
    Strategy,
    amplification_label,
    amplified_banded_event,
    amplified_sensitivity,
    amplified_step_events,
    banded_strategy,
    blt_strategy,
    brute_force_sensitivity,
    check_horizon,
    check_record,
    cyclic_poisson_sampling,
    gaussian_epsilon,
    mechanism_event,
    monotone_envelope,
    optimize_strategy,
    parse_mechanism,
    prefix_sensitivities,
    record_sampling,
    sensitivity,
    step_events,
    strategy_from_record,
    toeplitz_prefix_sensitivities,
)

__all__ = [
    "CorrelatedNoise",
    "make_mechanism",
    "MECHANISMS",
    "SENSITIVITY_METHOD",
    "SENSITIVITY_METHODS",
    "LEGACY_SENSITIVITY_METHOD",
    "Participation",
    "Strategy",
    "amplified_banded_event",
    "amplified_step_events",
    "banded_strategy",
    "blt_strategy",
    "brute_force_sensitivity",
    "calibrate_noise_multiplier",
    "check_record",
    "gaussian_epsilon",
    "mechanism_event",
    "optimize_strategy",
    "parse_mechanism",
    "prefix_sensitivities",
    "record_sampling",
    "sensitivity",
    "monotone_envelope",
    "toeplitz_prefix_sensitivities",
    "step_events",
    "strategy_from_record",
]


# -- the stream -------------------------------------------------------------------------------------

_LIVE: "weakref.WeakSet[CorrelatedNoise]" = weakref.WeakSet()


class CorrelatedNoise:
    """The noise mechanism a :class:`~dpopt.privatizer.Privatizer` holds: turns each release's fresh
    independent normals (already × σS, float64) into the correlated noise w_t = (C⁻¹z)_t, streamed.

    Args:
        strategy: the :class:`Strategy` C.
        participation: the run's :class:`Participation` (its ``steps`` is the horizon T).
        noise_multiplier: σ (for the ledger's events; the Privatizer scales z by σS itself).
        sample_rate: None (default): cyclic batches, unamplified events (:func:`step_events`); q: cyclic
            Poisson sampling at rate q within each of the ``min_separation`` partitions, amplified events
            (:func:`amplified_step_events`: exact for banded with bands ≤ min_separation, the spectral bound
            of :mod:`dpopt.accounting.sampled_matrix_mechanism` for BLT and banded with more bands).
        sensitivity_method: how Δ_t is derived (:func:`prefix_sensitivities`; one of
            :data:`SENSITIVITY_METHODS`, default the exact Toeplitz form where it holds); written to the
            record as ``sensitivity_method`` so :func:`check_record` re-derives with the same method.

    State: per key (one per device / block of the flat noise vector) the last b−1 noise vectors
    (banded) or n buffers (blt), float64, in memory only. :meth:`correlate` for release t checks that
    the key's state is at release t (t = 0: fresh); a pickle, ``copy``/``deepcopy`` or forked child
    has no state, so it refuses to continue a stream (it would replay the correlated part of the
    original's noise) — resume from a checkpoint is refused the same way (docs/correlated-noise.md).

    Raises:
        ValueError: σ ≤ 0; T > :data:`MAX_HORIZON`; a sample_rate without an amplified accountant; an
            unknown ``sensitivity_method``.
    """

    def __init__(
        self,
        strategy: Strategy,
        participation: Participation,
        noise_multiplier: float,
        sample_rate: Optional[float] = None,
        sensitivity_method: str = SENSITIVITY_METHOD,
    ):
        if not float(noise_multiplier) > 0:
            raise ValueError("correlated noise needs noise_multiplier > 0 (σ = 0 is independent, non-private)")
        self.strategy, self.participation = strategy, participation
        self.noise_multiplier = float(noise_multiplier)
        T = participation.steps
        self.sensitivity_method = sensitivity_method
        self.prefix = prefix_sensitivities(strategy, participation, sensitivity_method)
        self.sensitivity = float(self.prefix[-1])
        self.sample_rate = None if sample_rate is None else float(sample_rate)
        self._events = (
            step_events(self.noise_multiplier, self.prefix)
            if sample_rate is None
            else amplified_step_events(self.noise_multiplier, strategy, participation, float(sample_rate))
        )
        d = strategy.inverse_coefficients(T)
        self._marginal = np.sqrt(np.cumsum(d**2))  # std of w_t per unit σS: √(Σ_{s≤t} d_s²)
        self._coef = [float(c) for c in strategy.coefficients]
        self._state: dict = {}  # key -> (next release index, list of float64 tensors)
        _LIVE.add(self)

    @property
    def kind(self) -> str:
        return self.strategy.kind

    @property
    def horizon(self) -> int:
        return self.participation.steps

    @property
    def sampling(self) -> str:
        """The ledger's ``sampling`` statement the events hold for (cyclic batches, or cyclic Poisson at q)."""
        if self.sample_rate is None:
            return self.participation.sampling
        return cyclic_poisson_sampling(self.sample_rate, self.participation.min_separation)

    def marginal_std(self, step: int) -> float:
        """std of w_t per unit σS (√(Σ_{s≤t} d_s²), d the coefficients of C⁻¹): what the variance-correcting
        transforms read from the Release's ``noise_std``."""
        return float(self._marginal[self._index(step)])

    def step_event(self, step: int) -> dp_event.DpEvent:
        """The ledger event of release ``step`` (:func:`step_events`)."""
        return self._events[self._index(step)]

    def _index(self, step: int) -> int:
        if not 0 <= int(step) < self.horizon:
            raise RuntimeError(
                f"step {int(step) + 1} (1-based) is past the {self.horizon}-step correlated-noise horizon the "
                "strategy was built (and accounted) for: give the run's true length (epochs / total_steps)"
            )
        return int(step)

    def check_position(self, step: int, drawn_here: bool = True) -> None:
        """Refuse release ``step`` unless it is within the horizon and every key's stream is at it: the
        Privatizer asks before the release's ledger entry is written, so that a stream that cannot continue
        is refused without charging a release it cannot make.

        Args:
            step: the 0-based release index.
            drawn_here: this process draws every release's noise (no data-parallel ``reduce`` hook, where
                one rank may draw for all): a stream with no state at all is then at release 0.

        Raises:
            RuntimeError: as :meth:`correlate`.
        """
        self._index(step)
        positions = [t for t, _ in self._state.values()] or ([0] if drawn_here else [])
        for t in positions:
            self._check_at(t, step)

    @staticmethod
    def _check_at(t: int, step: int) -> None:
        if t != step:
            raise RuntimeError(
                f"correlated noise stream at release {t} but asked for release {step}: its state (as secret as "
                "the noise) is never copied, pickled, inherited by a fork or saved, so a copied or resumed "
                "correlated-noise run cannot continue (nor one whose noise failed to draw after its release was "
                "charged); start a new run (docs/correlated-noise.md)"
            )

    def correlate(self, z: Tensor, step: int, key: Any = "cpu") -> Tensor:
        """w_t for release ``step`` from this release's fresh float64 noise ``z`` (any shape; returned as a
        new float64 tensor of that shape); advances the key's state.

        Raises:
            RuntimeError: ``step`` is not the key's next release (a copy, fork, resumed or skipped
                stream), or past the horizon.
        """
        self._index(step)
        t, buf = self._state.get(key, (0, []))
        self._check_at(t, step)
        z = z.to(torch.float64)
        if self.kind == "banded":
            w = z.clone()
            for j, prev in enumerate(reversed(buf), start=1):  # buf holds w_{t−b+1} … w_{t−1}
                w.sub_(prev, alpha=self._coef[j])
            if self._coef[0] != 1.0:
                w.div_(self._coef[0])
            buf = (buf + [w.clone()])[-(len(self._coef) - 1) :] if len(self._coef) > 1 else []
        else:
            if not buf:
                buf = [torch.zeros_like(z) for _ in self.strategy.theta]
            w = z.clone()
            for s, om, th in zip(buf, self.strategy.omega, self.strategy.theta):
                w.add_(s, alpha=float(om))
                s.mul_(float(th)).add_(z)
        self._state[key] = (t + 1, buf)
        return w

    def record(self) -> dict:
        """The ledger header's ``mechanism`` record: everything :func:`check_record` needs to re-derive
        the sensitivity and every release's event from the file alone (no state, no secret)."""
        p = self.participation
        return {
            "kind": self.kind,
            "strategy": self.strategy.record(),
            "steps": p.steps,
            "participations": p.participations,
            "min_separation": p.min_separation,
            "noise_multiplier": self.noise_multiplier,
            "sensitivity": self.sensitivity,
            "sensitivity_method": self.sensitivity_method,
            "amplification": self._amplification(),
            **(
                {}
                if self.sample_rate is None
                else {
                    "sample_rate": self.sample_rate,
                    "amplified_sensitivity": amplified_sensitivity(self.strategy, p.steps, p.min_separation),
                }
            ),
            "resume": "refused (the stream state is never saved)",
        }

    def _amplification(self) -> str:
        """The record's ``amplification`` statement: none, the banded analysis, or the spectral bound."""
        return amplification_label(self.strategy, self.participation.min_separation, self.sample_rate)

    def forget(self) -> None:
        """Drop every key's stream state (a forked child; a copy): the stream cannot continue."""
        self._state = {}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_state"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        _LIVE.add(self)


def _forget_after_fork() -> None:
    for mech in list(_LIVE):
        mech.forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def make_mechanism(
    spec: str, noise_multiplier: float, participation: Participation, sample_rate: Optional[float] = None
) -> Optional[CorrelatedNoise]:
    """The :class:`CorrelatedNoise` of a ``noise_mechanism`` string (None for ``"independent"``); ``sample_rate``:
    cyclic Poisson sampling (:class:`CorrelatedNoise`).

    Raises:
        ValueError: a bad spec (:func:`parse_mechanism`), σ ≤ 0, T too long.
    """
    kind, size = parse_mechanism(spec)
    if kind == "independent":
        return None
    if not float(noise_multiplier) > 0:
        raise ValueError(f"noise_mechanism {spec!r} needs noise_multiplier > 0")
    check_horizon(participation.steps)
    # unamplified: the strategy is tuned for the run's participations; amplified runs are charged per round
    # (‖c‖ or the spectral bound), which the single-participation optimum targets
    tuned_for = participation if sample_rate is None else None
    strategy = optimize_strategy(kind, participation.steps, size, participation=tuned_for)
    return CorrelatedNoise(strategy, participation, noise_multiplier, sample_rate)
