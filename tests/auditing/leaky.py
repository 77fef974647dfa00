"""Deliberately leaky mechanisms: the five defects of ``papers/adaptive-clipping-accounting.txt``.

TEST-ONLY. Nothing here is exported by ``dpopt`` or registered as a method;
each class exists so that the test suite can show the empirical audit
(:mod:`dpopt.auditing`) or a ledger check flags it.

=====  =======================================================  ==========================
 #     defect (the post's "move")                                caught by
=====  =======================================================  ==========================
 1     clip bound = mean per-sample norm of the current batch,   empirical audit
       never released or charged (:class:`MeanNormClipPrivatizer`)
 2     noise multiplier scaled by a data-dependent               empirical audit
       "uncertainty"; each step's event records the σ it used
       (:class:`UncertaintyNoisePrivatizer`)
 3     per-group bounds, noise sized to the smallest bound       empirical audit (and the
       (:class:`SmallestBoundNoisePrivatizer`)                   static check's noise item)
 4     ε reported as a sum of per-epoch ε of an adaptive run     ledger check: reported ε vs
       (:func:`epsilon_as_sum_of_parts`)                         one accountant, whole ledger
 5     clipped-count release the ledger does not record          ledger check: reads vs
       (:class:`UnrecordedCountPrivatizer`)                      Gaussians recorded (the audit
                                                                 only when the count's share is large)
=====  =======================================================  ==========================

The ledger checks here (:func:`recorded_gaussians`, :func:`check_reads_recorded`,
:func:`check_reported_epsilon`) implement the two principles directly, so the
leak tests do not depend on another module; ``tests/test_leaks.py`` also runs
``dpopt.accounting.ledger_check.check_ledger`` on the same ledgers when it imports.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from dp_accounting import dp_event

from dpopt.accounting.accountant import epsilon
from dpopt.accounting.events import poisson_gaussian_step
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.privatizer import Privatizer


def _norms(privatizer: Privatizer, source) -> torch.Tensor:
    """Per-sample norms in the step's geometry, as one flat group: shape [B]."""
    sq = source.sq_norms(privatizer._geometry, [0] * source.num_params, 1)
    return sq[:, 0].clamp_min(0).sqrt()


class MeanNormClipPrivatizer(Privatizer):
    """Defect 1: C_t = mean per-sample norm of the current batch (no release, no charge).

    The noise is σ·C_t, "calibrated" to the bound actually applied, and the
    ledger metadata is self-consistent; but C_t is a function of the private
    batch, so the noise *scale* reveals the data: one outlier multiplies it.
    The claimed ε is that of the configured Gaussian(σ).
    """

    def accumulate(self, source) -> None:
        norms = _norms(self, source)
        if norms.numel():
            self.bounds = [float(norms.mean())]  # a read of private data that no one pays for
        super().accumulate(source)


class UncertaintyNoisePrivatizer(Privatizer):
    """Defect 2: σ_t = σ·(1 + u), u = Var(per-sample norms)/C², a "model uncertainty".

    Every step records the σ_t it used (so the ledger is self-consistent and
    even looks conservative, σ_t ≥ σ), but σ_t itself is read from the batch:
    the amount of noise encodes the data.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.base_noise_multiplier = self.noise_multiplier

    def accumulate(self, source) -> None:
        norms = _norms(self, source)
        u = float(norms.var(unbiased=False)) / self.bounds[0] ** 2 if norms.numel() > 1 else 0.0
        self.noise_multiplier = self.base_noise_multiplier * (1.0 + u)
        super().accumulate(source)


class SmallestBoundNoisePrivatizer(Privatizer):
    """Defect 3: per-group bounds C_k but noise σ·min_k C_k instead of σ·√(Σ_k C_k²).

    One record can move the clipped sum by √(Σ C_k²); with bounds (1, 2, 2)
    the noise is 3× too small, so the mechanism is (3/σ)-GDP, not (1/σ)-GDP.
    """

    @property
    def sensitivity(self) -> float:
        return float(min(self.bounds))


class UnrecordedCountPrivatizer(Privatizer):
    """Defect 5: quantile clipping whose step event charges only the gradient Gaussian.

    The clipped count is still read, noised and released (it sets the next
    bound and appears in the entry's metadata), but ``step_event`` — what the
    ledger and every accountant see — has one Gaussian: two releases, one bill.
    """

    def step_event(self) -> dp_event.DpEvent:
        return poisson_gaussian_step(self.noise_multiplier, self.sample_rate)


# --------------------------------------------------------------------------- defect 4
def epsilon_as_sum_of_parts(ledger: PrivacyLedger, steps_per_part: int, delta: float, accountant: str = "pld") -> float:
    """Defect 4: ε of each consecutive block of ``steps_per_part`` entries, summed.

    Each block is scored alone at δ and the ε's are added at the same δ. Basic
    composition would give (Σ ε_i, Σ δ_i), so the pair (Σ ε_i, δ) is not what
    any composition theorem states; it is usually loose (Σ ε_i above the whole
    ledger's ε), and it understates ε when the blocks' ε are near 0 (each
    block's privacy loss hides inside its own δ). The post adds that with
    adaptively chosen per-block parameters the pieces are not independent;
    either way the only number to report is one accountant over the whole
    ledger.
    """
    entries = list(ledger.entries)
    total = 0.0
    for start in range(0, len(entries), steps_per_part):
        part = PrivacyLedger(ledger.neighbouring, ledger.sampling)
        for e in entries[start : start + steps_per_part]:
            part.record(e.step, e.event, **e.meta)
        total += epsilon(part, delta, accountant)
    return total


# --------------------------------------------------------------------------- ledger checks
def recorded_gaussians(event: dp_event.DpEvent) -> int:
    """Number of Gaussian releases inside a (nested) DpEvent; SelfComposed counts multiply."""
    if isinstance(event, dp_event.GaussianDpEvent):
        return 1
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        return recorded_gaussians(event.event)
    if isinstance(event, dp_event.ComposedDpEvent):
        return sum(recorded_gaussians(e) for e in event.events)
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return int(event.count) * recorded_gaussians(event.event)
    return 0


def check_reads_recorded(privatizer: Privatizer) -> list[str]:
    """Principle "every read has a line in the budget": ``privatizer.reads`` must equal
    the Gaussians recorded in its ledger. Returns the problems found (empty = pass)."""
    recorded = sum(recorded_gaussians(e.event) for e in privatizer.ledger.entries)
    if privatizer.reads != recorded:
        return [
            f"{privatizer.reads} reads of private data but {recorded} Gaussian releases recorded "
            f"in the ledger ({privatizer.reads - recorded} unpaid)"
        ]
    return []


def check_reported_epsilon(
    reported: float, ledger: PrivacyLedger, delta: float, rtol: float = 1e-6, accountant: str = "pld"
) -> list[str]:
    """Principle "compose the whole adaptive procedure": the reported ε must be one
    accountant's ε over the whole ledger at the same δ. Returns problems (empty = pass)."""
    whole = epsilon(ledger, delta, accountant)
    if math.isclose(reported, whole, rel_tol=rtol, abs_tol=1e-12):
        return []
    if reported < whole:
        return [
            f"reported ε {reported:.6g} is below the whole-ledger ε {whole:.6g} at δ={delta:g}: "
            "under-reported (invalid)"
        ]
    return [
        f"reported ε {reported:.6g} differs from the whole-ledger ε {whole:.6g} at δ={delta:g}: "
        "not composed over the whole ledger"
    ]


def run_quantile_epochs(
    privatizer: Privatizer, dataset: Sequence[torch.Tensor], steps: int, generator: torch.Generator
) -> None:
    """Drive a privatizer for ``steps`` Poisson-sampled steps on a fixed per-example dataset.

    ``dataset`` is one tensor ``[N, *shape]`` per parameter (synthetic, public
    stand-ins for per-sample gradients). Used to build a realistic adaptive
    (quantile-clipping) ledger for defect 4.
    """
    from dpopt.engine.reference import PerSampleGrads

    n = dataset[0].shape[0]
    for _ in range(steps):
        mask = torch.rand(n, generator=generator) < privatizer.sample_rate
        privatizer.privatize(PerSampleGrads([d[mask] for d in dataset]))
