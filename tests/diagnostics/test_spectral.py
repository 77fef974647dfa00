"""Spectral diagnostics on synthetic matrices: BBP cosine prediction, effective rank, B* scaling."""

from __future__ import annotations

import math

import pytest
import torch

from dpopt.diagnostics.spectral import (
    diagnose_matrix,
    effective_rank,
    momentum_noise_factor,
    monte_carlo_cosines,
    noise_edge,
    noise_std,
    predicted_cosines,
    predicted_top_singular_value,
    recovery_batch_size,
    singular_values,
    spectral_snr,
    stable_rank,
    threshold_ratio,
)

SHAPES = [(100, 300), (200, 200), (300, 100), (64, 576)]


def _spike(m, n, theta, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(m, generator=g, dtype=torch.float64)
    v = torch.randn(n, generator=g, dtype=torch.float64)
    return theta * torch.outer(u / u.norm(), v / v.norm()), g


@pytest.mark.parametrize("shape", SHAPES)
def test_monte_carlo_cosine_matches_bbp_prediction(shape):
    """At 1.25x, 2x, 5x the threshold s(mn)^{1/4}: |MC - prediction| within 4 standard errors plus a
    finite-size allowance (convergence to the limit is slow right above the transition: 0.3/sqrt(p)
    at 1.25x, 0.005 further out); at 0.5x the cosine is near 0 (O(p^{-1/2}) at finite size)."""
    m, n = shape
    s, p, trials = 0.7, min(shape), 40
    seen = {}
    for mult in (0.5, 1.25, 2.0, 5.0):
        theta = mult * s * (m * n) ** 0.25
        clean, gen = _spike(m, n, theta, seed=int(10 * mult))
        assert threshold_ratio(theta, s, m, n) == pytest.approx(mult)
        est = monte_carlo_cosines(clean, s, trials, gen)
        pl, pr = predicted_cosines(theta, s, m, n)
        if mult < 1:
            assert (pl, pr) == (0.0, 0.0)
            assert est.left < 0.25 and est.right < 0.25
        else:
            allow = 0.3 / math.sqrt(p) if mult == 1.25 else 0.005
            assert abs(est.left - pl) <= 4 * est.left_se + allow, (mult, est, pl)
            assert abs(est.right - pr) <= 4 * est.right_se + allow, (mult, est, pr)
        seen[mult] = est.product
    assert seen[0.5] < seen[1.25] < seen[2.0] < seen[5.0]


def test_prediction_formula_limits():
    m, n, s = 100, 400, 1.0
    thr = s * (m * n) ** 0.25
    assert predicted_cosines(thr, s, m, n) == pytest.approx((0.0, 0.0), abs=1e-6)  # zero at the threshold
    assert predicted_cosines(0.999 * thr, s, m, n) == (0.0, 0.0)
    assert predicted_cosines(1e6 * thr, s, m, n)[0] == pytest.approx(1.0, abs=1e-9)
    assert predicted_cosines(thr, 0.0, m, n) == (1.0, 1.0)
    # square case: cos^2 = 1 - 1/theta~^2 on both sides
    left, r = predicted_cosines(2.0 * math.sqrt(30) * s, s, 30, 30)  # theta~ = sigma1 / (s sqrt(q)) = 2
    assert left == r == pytest.approx(math.sqrt(0.75))
    # transposing swaps left and right
    assert predicted_cosines(3 * thr, s, m, n) == predicted_cosines(3 * thr, s, n, m)[::-1]
    # the top noisy singular value leaves the bulk edge above the threshold, continuously
    assert predicted_top_singular_value(thr, s, m, n) == pytest.approx(noise_edge(s, m, n))
    assert predicted_top_singular_value(0.5 * thr, s, m, n) == noise_edge(s, m, n)


def test_top_singular_value_of_noise_and_spike():
    m, n, s = 150, 300, 0.5
    theta = 3 * s * (m * n) ** 0.25
    clean, gen = _spike(m, n, theta)
    noisy = clean + s * torch.randn(m, n, generator=gen, dtype=torch.float64)
    assert float(singular_values(noisy)[0]) == pytest.approx(predicted_top_singular_value(theta, s, m, n), rel=0.02)
    pure = s * torch.randn(m, n, generator=gen, dtype=torch.float64)
    assert float(singular_values(pure)[0]) == pytest.approx(noise_edge(s, m, n), rel=0.03)


def test_effective_and_stable_rank_by_hand():
    s = torch.tensor([3.0, 2.0, 1.0, 0.0])
    p = [0.5, 1 / 3, 1 / 6]
    hand = math.exp(-sum(x * math.log(x) for x in p))  # H = ln2/2 + ln3/3 + ln6/6 = 1.01140, exp = 2.74946
    assert effective_rank(s) == pytest.approx(hand, rel=1e-12)
    assert hand == pytest.approx(2.74946, abs=1e-5)
    assert stable_rank(s) == pytest.approx((9 + 4 + 1) / 9)
    assert effective_rank(torch.ones(7)) == pytest.approx(7.0)
    assert effective_rank(torch.zeros(3)) == 0.0
    # from a matrix: diag(3, 2, 1) rotated has the same spectrum
    q, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    mat = q[:, :3] @ torch.diag(torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64))
    assert effective_rank(mat) == pytest.approx(hand, rel=1e-10)


def test_b_star_scaling():
    base = recovery_batch_size(2.0, 1.0, 1.0, 64, 576)
    assert base == pytest.approx(1.0 * 1.0 * (64 * 576) ** 0.25 / 2.0)
    assert recovery_batch_size(2.0, 3.0, 1.0, 64, 576) == pytest.approx(3 * base)  # linear in sigma
    assert recovery_batch_size(2.0, 1.0, 0.5, 64, 576) == pytest.approx(0.5 * base)  # linear in C
    assert recovery_batch_size(4.0, 1.0, 1.0, 64, 576) == pytest.approx(0.5 * base)  # 1 / sigma_1
    assert recovery_batch_size(2.0, 1.0, 1.0, 64 * 16, 576) == pytest.approx(2 * base)  # (mn)^{1/4}
    beta = 0.9
    assert recovery_batch_size(2.0, 1.0, 1.0, 64, 576, beta) == pytest.approx(base * math.sqrt((1 - beta) / (1 + beta)))
    assert recovery_batch_size(0.0, 1.0, 1.0, 4, 4) == math.inf
    # B* is where the threshold ratio crosses 1
    sigma, c = 1.3, 0.8
    b = recovery_batch_size(2.0, sigma, c, 64, 576)
    assert threshold_ratio(2.0, noise_std(sigma, c, b), 64, 576) == pytest.approx(1.0)


def test_momentum_noise_factor_is_the_ema_noise_std():
    beta, s = 0.9, 1.0
    gen = torch.Generator().manual_seed(0)
    m = torch.zeros(20000, dtype=torch.float64)
    for _ in range(200):
        m = beta * m + (1 - beta) * s * torch.randn(20000, generator=gen, dtype=torch.float64)
    assert float(m.std()) == pytest.approx(momentum_noise_factor(beta) * s, rel=0.03)


def test_spectral_snr_and_diagnose_matrix():
    clean, gen = _spike(64, 128, 5.0)
    s = noise_std(2.0, 1.0, 100)
    assert spectral_snr(clean, s) == pytest.approx(5.0 / (s * math.sqrt(64 * 128)))
    d = diagnose_matrix(
        clean, noise_multiplier=2.0, max_grad_norm=1.0, batch_size=100, momentum=0.9, trials=5, generator=gen
    )
    assert d.shape == (64, 128) and d.sigma1 == pytest.approx(5.0)
    assert d.effective_rank == pytest.approx(1.0, abs=1e-6) and d.noisy_effective_rank > 10
    assert d.recoverable == (100 >= d.b_star) and d.b_star_momentum < d.b_star
    assert d.mc is not None and d.to_dict()["shape"] == [64, 128]
