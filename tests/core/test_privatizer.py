"""The Privatizer: exact clipping, noise std, B̄ denominator, empty batches, non-finite grads."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy import stats

from dpopt.accounting.events import poisson_gaussian_step
from dpopt.engine.reference import PerSampleGrads
from dpopt.privatizer import Privatizer
from dpopt.types import ClipGeometry


def _batch_of_is(b: int, shapes=((2, 2), (3,))) -> PerSampleGrads:
    """Example i has every coordinate equal to i (i = 0..b-1)."""
    return PerSampleGrads(
        [torch.arange(b, dtype=torch.float64).view(-1, *[1] * len(s)).expand(b, *s).clone() for s in shapes]
    )


def test_exact_clipping_values_flat():
    # d = 7 coordinates, example i has norm i*sqrt(7); C = 3.
    src = _batch_of_is(4)
    priv = Privatizer(0.0, 3.0, expected_batch_size=8.0, sample_rate=0.5)
    rel = priv.privatize(src)
    # clipped example i: i * min(1, 3/(i*sqrt 7)); each coordinate of example i is i*factor_i.
    per_coord = sum(i * min(1.0, 3.0 / (i * math.sqrt(7))) if i else 0.0 for i in range(4))
    for g in rel.grads:
        assert torch.allclose(g, torch.full_like(g, per_coord / 8.0))
    assert per_coord == pytest.approx(1 + 3 / math.sqrt(7) * 2)  # i=1 unclipped (norm 2.65 < 3), 2 and 3 clipped


def test_exact_clipping_in_geometry():
    src = _batch_of_is(3, shapes=((3,),))
    shift = (torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64),)
    scale = (torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64),)
    priv = Privatizer(0.0, 1.0, expected_batch_size=2.0, sample_rate=0.1)
    rel = priv.privatize(src, ClipGeometry(shift, scale))
    expected = torch.zeros(3, dtype=torch.float64)
    for i in range(3):
        w = (torch.full((3,), float(i), dtype=torch.float64) - shift[0]) / scale[0]
        expected += w * min(1.0, 1.0 / float(w.norm())) if float(w.norm()) > 0 else w
    # map back: g = scale * (sum / B̄) + shift
    assert torch.allclose(rel.grads[0], scale[0] * expected / 2.0 + shift[0])
    # noise std reported in released coordinates is σ·C/B̄·scale (σ = 0 here → zeros)
    assert torch.all(rel.noise_std[0] == 0)


def test_divides_by_expected_not_realised_batch_size():
    src = PerSampleGrads([torch.ones(5, 2)])
    rel = Privatizer(0.0, 100.0, expected_batch_size=10.0, sample_rate=0.1).privatize(src)
    assert torch.allclose(rel.grads[0], torch.full((2,), 0.5))  # 5 / 10, not 5 / 5


def test_noise_std_matches_configuration():
    """Empirical std of 40,000 noise coordinates vs σC/B̄ = 0.75.

    Chi-square two-sided test at α = 1e-4 (false-alarm rate 1 in 10,000 runs);
    the seed is fixed, so the test is deterministic.
    """
    sigma, c, bbar, d = 1.5, 2.0, 4.0, 40_000
    gen = torch.Generator().manual_seed(1234)
    priv = Privatizer(sigma, c, expected_batch_size=bbar, sample_rate=0.01, generator=gen)
    rel = priv.privatize(PerSampleGrads([torch.zeros(3, d, dtype=torch.float64)]))
    x = rel.grads[0].numpy()
    expected = sigma * c / bbar
    assert float(rel.noise_std[0]) == pytest.approx(expected)
    stat = float(np.sum(x**2) / expected**2)  # ~ chi2(d) under H0 (mean is exactly 0)
    lo, hi = stats.chi2.ppf([0.5e-4, 1 - 0.5e-4], d)
    assert lo < stat < hi
    # and a wrong std (5% off) would be rejected by the same test
    assert not (lo < float(np.sum(x**2) / (1.05 * expected) ** 2) < hi)


def test_empty_batch_adds_noise_and_is_charged():
    gen = torch.Generator().manual_seed(0)
    priv = Privatizer(1.0, 1.0, expected_batch_size=4.0, sample_rate=0.01, generator=gen)
    rel = priv.privatize(PerSampleGrads([torch.zeros(0, 1000)]))
    assert rel.grads[0].abs().sum() > 0
    assert float(rel.grads[0].std()) == pytest.approx(0.25, rel=0.1)
    assert len(priv.ledger) == 1
    assert priv.ledger.entries[0].event == poisson_gaussian_step(1.0, 0.01)


def test_nonfinite_per_sample_gradients_are_zeroed():
    g = torch.ones(3, 4)
    g[1, 2] = float("nan")
    g[2, 0] = float("inf")
    src = PerSampleGrads([g])
    assert src.nonfinite == 2
    priv = Privatizer(0.0, 10.0, expected_batch_size=1.0, sample_rate=0.1)
    rel = priv.privatize(src)
    assert torch.allclose(rel.grads[0], torch.ones(4))  # only example 0 contributes
    assert priv.nonfinite_steps == 1


def test_micro_batches_make_one_release():
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    g = torch.randn(10, 5, dtype=torch.float64)
    a = Privatizer(1.0, 0.5, 10.0, 0.1, generator=gen_a)
    b = Privatizer(1.0, 0.5, 10.0, 0.1, generator=gen_b)
    ra = a.privatize(PerSampleGrads([g]))
    rb = b.privatize([PerSampleGrads([g[:3]]), PerSampleGrads([g[3:]])])
    assert torch.allclose(ra.grads[0], rb.grads[0])
    assert len(a.ledger) == len(b.ledger) == 1


def test_per_layer_noise_uses_total_bound():
    priv = Privatizer(1.0, [1.0, 2.0, 2.0], 1.0, 0.1, groups=[0, 1, 2])
    assert priv.sensitivity == pytest.approx(3.0)
    rel = priv.privatize(PerSampleGrads([torch.zeros(0, 2)] * 3))
    assert priv.ledger.entries[0].meta["noise_std"] == pytest.approx(3.0)
    assert float(rel.noise_std[0]) == pytest.approx(3.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(expected_batch_size=0.0), "expected_batch_size"),
        (dict(sample_rate=1.5), "sample_rate"),
    ],
)
def test_invalid_configuration(kwargs, match):
    base = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4.0, sample_rate=0.1)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Privatizer(**base)


# Every field of Release, classified as PUBLIC: a released (noised) value, public configuration,
# or accountant input. A new field must be added here deliberately, after checking that it
# carries nothing private (no batch size, indices, per-sample norms/gradients, un-noised sums).
RELEASE_PUBLIC_FIELDS = {
    "grads": "the privatized gradient g~ (noise added, divided by the public expected batch size)",
    "noise_std": "sigma * sensitivity / expected_batch_size (times the public scale): public constants",
    "geometry": "the clip geometry: a function of earlier releases only",
    "step": "index of the logical step (public: steps are fixed in advance)",
    "event": "the DpEvent recorded in the ledger (public sigma, q)",
    "noise_multiplier": "sigma (public configuration)",
    "expected_batch_size": "q * N, the public denominator",
    "max_grad_norm": "bounds applied: configured, or adapted from the noisy released count",
}


def test_release_never_carries_private_fields():
    """Release carries only fields classified as public (an allow-list, not a list of known leaks)."""
    rel = Privatizer(1.0, 1.0, 4.0, 0.1).privatize(PerSampleGrads([torch.ones(3, 2)]))
    fields = {f.name for f in dataclasses.fields(rel)}
    unclassified = fields - set(RELEASE_PUBLIC_FIELDS)
    assert not unclassified, (
        f"Release has fields not classified as public: {sorted(unclassified)}; a Release "
        "may carry only released (noised) values and public configuration. Add each to "
        "RELEASE_PUBLIC_FIELDS with the reason it is public, or keep it in the Privatizer."
    )
    stale = set(RELEASE_PUBLIC_FIELDS) - fields
    assert not stale, f"allow-list entries that are no longer Release fields: {sorted(stale)}"
    # frozen: no value can be attached to a Release after it left the Privatizer
    assert rel.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        rel.step = 1  # type: ignore[misc]


def test_bound_types_are_coerced():
    assert Privatizer(1.0, np.float32(2.0), 4.0, 0.1).bounds == [2.0]
    assert Privatizer(1.0, torch.tensor(3.0), 4.0, 0.1).bounds == [3.0]
    with pytest.raises(ValueError, match="max_grad_norm must be a number"):
        Privatizer(1.0, "x", 4.0, 0.1)


def test_infinite_bound_needs_zero_noise():
    with pytest.raises(ValueError, match="finite when noise_multiplier > 0"):
        Privatizer(1.0, float("inf"), expected_batch_size=4.0, sample_rate=0.1)
    rel = Privatizer(0.0, float("inf"), expected_batch_size=4.0, sample_rate=0.1).privatize(
        PerSampleGrads([torch.full((2, 3), 10.0)])
    )
    assert torch.equal(rel.grads[0], torch.full((3,), 5.0))  # σ = 0, C = ∞: the plain sum / B̄


def test_cli_refuses_infinite_bound_with_noise(tmp_path):
    from typer.testing import CliRunner

    from dpopt.cli import app

    res = CliRunner().invoke(app, ["train", "--max-grad-norm", "inf", "--epochs", "0.1", "--out", str(tmp_path / "r")])
    assert res.exit_code == 2 and "--max-grad-norm must be finite" in res.output
    assert not (tmp_path / "r").exists()  # refused before anything was written


# --- state_dict / load_state_dict (issue 10) ------------------------------------------------------
def test_privatizer_state_round_trip_never_holds_the_secret_generator():
    from dpopt.engine.reference import PerSampleGrads
    from dpopt.privatizer import Privatizer, QuantileClipping

    grads = PerSampleGrads([torch.randn(6, 4)])
    p = Privatizer(1.0, 1.0, 4.0, 0.1, quantile=QuantileClipping(2.0))
    for _ in range(3):
        p.privatize(grads)
    state = p.state_dict()
    assert "noise_state" not in state and state["steps"] == 3 and len(state["clip_history"]) == 3
    assert "nonfinite_steps" not in state and sum(g["count"] for g in state["ledger"]["groups"]) == 3
    q = Privatizer(1.0, 1.0, 4.0, 0.1, quantile=QuantileClipping(2.0))
    q.load_state_dict(state)
    assert q.steps == 3 and q.bounds == p.bounds and len(q.ledger) == 3 and q.ledger.noise == "secret"
    with pytest.raises(ValueError, match="other clipping"):
        Privatizer(1.0, 1.0, 4.0, 0.1).load_state_dict(state)


def test_reproducible_optimizer_state_round_trip_continues_identically():
    import copy

    from dpopt.engine.reference import PerSampleGrads
    from dpopt.methods import make_optimizer

    for method in ("dp-macadam", "disk-sgd", "doppler-sgd"):
        torch.manual_seed(0)
        w = [torch.nn.Parameter(torch.randn(3, 2))]
        a = make_optimizer(
            method,
            w,
            noise_multiplier=1.0,
            expected_batch_size=4.0,
            sample_rate=0.1,
            generator=torch.Generator().manual_seed(1),
        )
        g = [torch.randn(5, 3, 2) for _ in range(4)]
        for x in g[:2]:
            a.step(PerSampleGrads([x.clone()], params=w, points=a.evaluation_points()))
        saved, w_saved = a.state_dict(), w[0].detach().clone()
        w2 = [torch.nn.Parameter(w_saved.clone())]
        b = make_optimizer(
            method,
            w2,
            noise_multiplier=1.0,
            expected_batch_size=4.0,
            sample_rate=0.1,
            generator=torch.Generator().manual_seed(99),
        )
        b.load_state_dict(copy.deepcopy(saved))  # torch's state_dict holds references to the live state
        assert b.privatizer.steps == 2 and len(b.privatizer.ledger) == 2
        for x in g[2:]:
            a.step(PerSampleGrads([x.clone()], params=w, points=a.evaluation_points()))
            b.step(PerSampleGrads([x.clone()], params=w2, points=b.evaluation_points()))
        assert torch.equal(w[0], w2[0]), method


def test_sampler_position_draws_exactly_the_remaining_steps():
    from dpopt.noise import NoiseSource
    from dpopt.sampling import PoissonSampler

    full = [b.tolist() for b in PoissonSampler(50, 0.2, 6, noise=NoiseSource("reproducible", seed=3))]
    s = PoissonSampler(50, 0.2, 6, noise=NoiseSource("reproducible", seed=3))
    first = [s.sample().tolist() for _ in range(2)]
    state = s.state_dict()
    t = PoissonSampler(50, 0.2, 6, noise=NoiseSource("reproducible", seed=0))
    t.load_state_dict(state)
    assert t.position == 2 and first + [b.tolist() for b in t] == full
    assert "noise_state" not in PoissonSampler(50, 0.2, 6).state_dict()
