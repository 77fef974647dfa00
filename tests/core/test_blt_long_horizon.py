"""``noise_mechanism="blt"`` over T = 3006 > 2048 steps (digits, batches of 16: b = 90 cyclic batches per epoch,
33.4 epochs), through ``dpopt train``'s build (:func:`dpopt.training.build.build_run`).

* Cyclic batches (unamplified): a correct result, no refusal and no fallback. The strategy tuned to the run's
  k = 34 participations 90 apart has nonnegative nonincreasing coefficients, so the mechanism is charged
  McKenna's exact sensitivity ‖C·(e_0 + e_90 + …)‖, recomputed here from shifted copies of C's first column.
* Cyclic Poisson (amplified): refused with a ConfigError that says why (the dense eigenproblem of the spectral
  bound, up to T = 2048) and what to change: fewer steps, ``--sampling cyclic``, or banded with B ≤ b'.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from dpopt.accounting.matrix_factorization import MAX_GENERAL_HORIZON, monotone_envelope
from dpopt.cli.train import train_flags
from dpopt.data import load_dataset
from dpopt.errors import ConfigError, translate
from dpopt.training import TrainConfig
from dpopt.training.build import build_run

pytestmark = pytest.mark.slow  # the BLT strategy is optimised for T = 3006 (≈ 8 s CPU on one core)

FLAGS = dict(dataset="digits", method="dp-sgd", batch_size=16, epochs=33.4, noise_mechanism="blt", noise_multiplier=1.0)


def _build(**extra):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_run(TrainConfig(**FLAGS, **extra), load_dataset("digits"))


def test_blt_past_2048_steps_on_cyclic_batches_is_charged_its_exact_sensitivity():
    run = _build()
    mech = run.optimizer.privatizer.mechanism
    T, sep, k = run.steps, mech.participation.min_separation, mech.participation.participations
    assert T == 3006 > MAX_GENERAL_HORIZON and (sep, k) == (90, 34) and mech.strategy.kind == "blt"
    c = mech.strategy.column(T)
    assert monotone_envelope(c) is not None  # the exact formula's hypothesis holds (not the refused general bound)
    v = sum(np.concatenate([np.zeros(m * sep), c[: T - m * sep]]) for m in range(k))  # C·(e_0 + e_90 + …)
    assert mech.sensitivity == pytest.approx(float(np.linalg.norm(v)), rel=1e-10)
    assert mech.prefix[-1] == pytest.approx(mech.sensitivity, rel=1e-12)


def test_amplified_blt_past_2048_steps_is_refused_saying_what_to_change():
    with pytest.raises(ConfigError, match="up to T = 2048") as info:
        _build(sampling="cyclic-poisson", sample_rate=0.5)
    assert set(info.value.arguments) == {"noise_mechanism", "sampling"}
    text = translate(info.value, train_flags())  # as `dpopt train` prints it
    assert "3006×3006" in text and "Train at most 2048 steps" in text
    assert "--sampling cyclic (unamplified" in text and "--noise-mechanism banded:B with B <= the" in text
