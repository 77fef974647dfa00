"""Poisson sampler: batch sizes are Binomial(N, q); empty batches occur and are yielded."""

import pytest
import torch

from dpopt.sampling import PoissonSampler


def test_batch_sizes_are_binomial():
    n, q, steps = 1000, 0.05, 2000
    sizes = torch.tensor(
        [len(i) for i in PoissonSampler(n, q, steps, torch.Generator().manual_seed(0))], dtype=torch.float64
    )
    # mean of 2000 Binomial(1000, .05) draws: sd of the mean = sqrt(47.5/2000) ≈ 0.154; ±5 sd window
    # has a false-alarm rate < 1e-6.
    assert abs(float(sizes.mean()) - n * q) < 5 * (n * q * (1 - q) / steps) ** 0.5
    assert float(sizes.var()) == pytest.approx(n * q * (1 - q), rel=0.15)


def test_empty_batches_are_yielded():
    batches = list(PoissonSampler(3, 0.01, 50, torch.Generator().manual_seed(1)))
    assert len(batches) == 50
    assert sum(len(b) == 0 for b in batches) > 40


def test_indices_are_unique_and_in_range():
    for idx in PoissonSampler(100, 0.3, 20, torch.Generator().manual_seed(2)):
        assert len(set(idx.tolist())) == len(idx) and (idx.numel() == 0 or 0 <= int(idx.min()) <= int(idx.max()) < 100)


@pytest.mark.parametrize("args", [(0, 0.1, 1), (10, 0.0, 1), (10, 1.1, 1), (10, 0.1, -1)])
def test_invalid(args):
    with pytest.raises(ValueError):
        PoissonSampler(*args)


# -- the O(expected batch) sampler (issue 43): the law of independent Bernoulli(q) records, exactly --------

from scipy import stats  # noqa: E402

import dpopt.sampling as sampling  # noqa: E402
from dpopt.noise import NoiseSource  # noqa: E402
from dpopt.sampling import poisson_indices  # noqa: E402

_ALPHA = 1e-6  # false-alarm rate of each chi-square test below


def _joint_chi2(n: int, q: float, draws: int, seed: int) -> float:
    """p-value of the chi-square test of the sampled subsets of range(n) against the product law
    P(S) = q^|S| (1 - q)^(n - |S|) (independence of every record, hence pairwise too)."""
    src = NoiseSource("reproducible", seed=seed)
    counts = torch.zeros(2**n, dtype=torch.float64)
    for _ in range(draws):
        code = int(sum(1 << int(i) for i in poisson_indices(src, n, q)))
        counts[code] += 1
    sizes = torch.tensor([bin(code).count("1") for code in range(2**n)], dtype=torch.float64)
    expected = q**sizes * (1 - q) ** (n - sizes) * draws
    return float(stats.chisquare(counts.numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("q", [0.3, 0.05])
def test_subsets_follow_the_product_law(q):
    # 16 subsets of 4 records, 10,000 draws: chi-square with 15 df at error rate 1e-6
    assert _joint_chi2(4, q, 10_000, seed=11) > _ALPHA


def test_subsets_follow_the_product_law_when_chunks_fall_short(monkeypatch):
    # no margin: the first chunk of gaps often ends before N, the loop continues from the last index
    monkeypatch.setattr(sampling, "_MARGIN_SD", 0.0)
    monkeypatch.setattr(sampling, "_MARGIN", 1)
    assert _joint_chi2(5, 0.4, 10_000, seed=12) > _ALPHA


def test_inclusion_frequencies_and_batch_size_law():
    n, q, draws = 40, 0.25, 5000
    src = NoiseSource("reproducible", seed=13)
    hits = torch.zeros(n, dtype=torch.float64)
    sizes = torch.zeros(n + 1, dtype=torch.float64)
    for _ in range(draws):
        idx = poisson_indices(src, n, q)
        assert torch.equal(idx, torch.unique(idx)) and (idx.numel() == 0 or (0 <= int(idx[0]) and int(idx[-1]) < n))
        hits[idx] += 1
        sizes[idx.numel()] += 1
    # every record's count ~ Binomial(draws, q): chi-square of the 40 standardized counts, 40 df
    z2 = float((((hits - draws * q) ** 2) / (draws * q * (1 - q))).sum())
    assert stats.chi2.sf(z2, n) > _ALPHA
    # batch sizes ~ Binomial(n, q): bins 4..16 and the two tails pooled (expected counts >= 5)
    pmf = torch.tensor(stats.binom.pmf(range(n + 1), n, q)) * draws
    obs = torch.cat([sizes[:4].sum().view(1), sizes[4:17], sizes[17:].sum().view(1)])
    exp = torch.cat([pmf[:4].sum().view(1), pmf[4:17], pmf[17:].sum().view(1)])
    assert float(stats.chisquare(obs.numpy(), exp.numpy()).pvalue) > _ALPHA


def test_q_one_takes_every_record_and_tiny_q_stays_exact():
    src = NoiseSource("secret")
    assert torch.equal(poisson_indices(src, 7, 1.0), torch.arange(7))
    assert poisson_indices(src, 0, 0.5).numel() == 0
    # q = 1e-8 over 10^7 records: 0.1 expected per draw; 3000 draws give Poisson(300) in total:
    # a +-6 sd window (sd 17.3) fails with probability < 1e-8. A float32 comparison would give 357.
    total, positions = 0, []
    for _ in range(3000):
        idx = poisson_indices(src, 10**7, 1e-8)
        total += idx.numel()
        positions += idx.tolist()
    assert abs(total - 300) < 6 * 300**0.5
    # included records are uniform over the range: mean position N/2 within 6 sd (sd N/sqrt(12 total))
    assert abs(sum(positions) / total - 5e6) < 6 * 1e7 / (12 * total) ** 0.5


@pytest.mark.parametrize("mode", ["secret", "secure"])
def test_a_step_draws_order_expected_batch_uniforms(mode, monkeypatch):
    # the sampler never touches every record: at N = 10^9, q = 256 / N it draws a few hundred uniforms
    src = NoiseSource(mode)
    drawn = []
    real = src.uniform
    monkeypatch.setattr(src, "uniform", lambda n, device="cpu": drawn.append(n) or real(n, device))
    idx = poisson_indices(src, 10**9, 256 / 10**9)
    assert sum(drawn) <= 256 + 6 * 17 + 8 + 200 and idx.numel() < sum(drawn)
    assert int(idx[-1]) < 10**9
