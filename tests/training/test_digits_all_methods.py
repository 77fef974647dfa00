"""Every registered optimizer trains the digits default to ≥ 0.80 test accuracy within 20 epochs.

Settings (all methods): dataset ``digits`` (1,437 train / 360 test), model
``mlp-small`` (64-64-10, 4,810 parameters), noise_multiplier σ = 1.0,
expected batch size B̄ = 64 (Poisson, q = 64/1437), δ = 1e-5, seed 0, and
each method's default hyperparameters for digits (``dpopt methods`` lists
them, including the per-dataset learning rates and docs/methods.md the
measurements behind them).

Every method trains the full 20 epochs and must END at ≥ 0.80 (stronger
than reaching it at some epoch: no late divergence). ``FIRST_080`` records
the epoch at which each method first reached 0.80 with this seed (from
``metrics.jsonl``), and the test checks that it is no more than ``SLACK``
epochs later, so a regression in speed of learning shows up too.

The noise is reproducible (``reproducible_noise=True``, seeded from the seed):
a test, unlike a run, must give the same numbers every time; with secret noise
the epochs below would vary from run to run.

For speed, ε is computed with the RDP accountant. The PLD accountant, which
``train`` runs after every epoch, costs more than training this small model,
and the accountant does not affect training. Torch also uses one thread:
results are identical, and two threads on two shared cores are about 2×
slower for a 4,810-parameter model.
"""

import json
import math

import pytest
import torch

from dpopt.data import load_dataset
from dpopt.training import TrainConfig, train

EPOCHS = 20
SLACK = 3  # epochs of tolerance on FIRST_080 (numerics of another per-sample engine, BLAS, ...)
FIRST_080 = {  # first epoch with test accuracy ≥ 0.80 (seed 0, reproducible noise), measured
    # re-measured 2026-12-06 after issue 34's CPU sampler (numpy's ziggurat on per-chunk SFC64 streams, the tail
    # redrawn exactly) changed the seeded noise stream; all 16 in one run
    "dp-sgd": 7,
    "dp-adam": 6,
    "dp-adambc": 4,
    "adaclip": 6,
    "dp-macadam": 6,
    "dp-macadambc": 8,
    "dp-muon": 6,
    "dp-muon-s": 6,
    "disk-sgd": 3,
    "doppler-sgd": 2,
    "disk-muon": 6,
    "doppler-muon": 6,
    "dp-muon-auto": 7,
    "dp-muon-bc": 6,
    "disk-muon-bc": 5,
    "doppler-muon-bc": 5,
}


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_every_method_is_covered():
    from dpopt.methods import list_methods

    assert sorted(FIRST_080) == sorted(s.name for s in list_methods())
    assert max(FIRST_080.values()) <= EPOCHS == 20


@pytest.mark.slow
@pytest.mark.parametrize("method", list(FIRST_080))
def test_digits_reaches_080(method, digits, tmp_path):
    cfg = TrainConfig(
        dataset="digits",
        model="mlp-small",
        method=method,
        noise_multiplier=1.0,
        batch_size=64.0,
        epochs=EPOCHS,
        seed=0,
        accountant="rdp",
        out=str(tmp_path / method),
        reproducible_noise=True,
    )
    with pytest.warns(UserWarning, match="reproducible"):
        summary = train(cfg, data=digits)
    curve = [json.loads(line)["test_accuracy"] for line in open(tmp_path / method / "metrics.jsonl")]
    assert len(curve) == EPOCHS
    assert summary["test_accuracy"] >= 0.80, (method, curve)
    first = next(i for i, a in enumerate(curve, start=1) if a >= 0.80)
    print(method, "first >= 0.80 at epoch", first, "curve", " ".join(f"{a:.3f}" for a in curve))
    assert first <= FIRST_080[method] + SLACK, (method, first, curve)
    # one release per step, all of it charged
    assert summary["privatizer_releases"] == summary["steps"] == round(EPOCHS * 1437 / 64)
    assert math.isfinite(summary["epsilon"]) and summary["epsilon"] > 0
