"""dpopt.accounting.split: the explorer's table (closed forms, the B/20 rule's domain, the schedule convention)."""

import math

import pytest

from dpopt.accounting.budget import recompose
from dpopt.accounting.calibration import calibrate_noise_multiplier
from dpopt.accounting.split import b20_split, best_count_share, split_row, split_table, steps_for_epochs
from dpopt.errors import ConfigError


def test_steps_for_epochs_is_tf_privacys_ceil():
    assert steps_for_epochs(60000, 256, 5) == (256 / 60000, 1172)  # 1171.875 -> 1172
    assert steps_for_epochs(100, 30, 1) == (0.3, 4)  # 3.33 -> 4 (round would give 3)
    assert steps_for_epochs(100, 25, 2)[1] == 8  # exact: no extra step
    for args, name in [
        ((0, 1, 1), "dataset_size"),
        ((10.5, 1, 1), "dataset_size"),
        ((10, 11, 1), "batch_size"),
        ((10, 0, 1), "batch_size"),
        ((10, 1, 0), "epochs"),
        ((10, 1, float("nan")), "epochs"),
    ]:
        with pytest.raises(ConfigError) as info:
            steps_for_epochs(*args)
        assert info.value.arguments == (name,)


def test_best_share_minimises_the_stated_objective():
    for sigma, b in [(1.0, 8), (0.5, 256), (3.0, 16)]:
        r_star = best_count_share(sigma, b)
        f = lambda r, sigma=sigma, b=b: 1 / math.sqrt(1 - r) + 0.2 * sigma / (2 * b * math.sqrt(r))  # noqa: E731
        grid = [i / 10000 for i in range(1, 9999)]
        r_num = min(grid, key=f)
        assert r_star == pytest.approx(r_num, abs=2e-4)
    assert best_count_share(1.0, 8) == pytest.approx(0.0512, abs=1e-4)


def test_b20_rule_exists_only_when_b_over_10_exceeds_sigma():
    assert b20_split(0.8, 8) is None and b20_split(1.0, 8) is None  # 2 sigma_b = 0.8
    grad, r = b20_split(0.5, 8)
    assert r == pytest.approx((0.5 / 0.8) ** 2)
    assert recompose(grad, 0.8) == pytest.approx(0.5)  # the split recomposes to sigma


def test_row_splits_recompose_to_sigma():
    row = split_row(1.2, 64, 64 / 6000, 100, count_share=0.1)
    assert recompose(row.share_grad_noise_multiplier, 2 * row.share_count_noise_std) == pytest.approx(1.2)
    assert recompose(row.b20_grad_noise_multiplier, 64 / 10) == pytest.approx(1.2)
    assert row.inflation(row.share_grad_noise_multiplier) == pytest.approx(1 / math.sqrt(0.9) - 1)
    assert row.to_dict()["b20_solvable"] is True
    assert not split_row(7.0, 64, 0.01, 10).b20_solvable


def test_split_table_uses_the_calibrated_sigma():
    table = split_table(2.0, 6000, 3, [256, 16, 16], accountant="rdp", epsilon_grid=[1.0, 4.0])
    assert table.batch_sizes == [16.0, 256.0] and table.epsilon_grid == [1.0, 2.0, 4.0]
    for row in table.rows:
        q, steps = steps_for_epochs(6000, row.batch_size, 3)
        assert (row.sample_rate, row.steps) == (q, steps)
        assert row.noise_multiplier == calibrate_noise_multiplier(2.0, 1e-5, q, steps, "rdp").noise_multiplier
    assert table.grid[1] == [r.noise_multiplier for r in table.rows]
    assert all(a > b for a, b in zip(table.grid[0], table.grid[2]))  # more epsilon, less noise


def test_split_table_errors_name_arguments():
    with pytest.raises(ConfigError) as info:
        split_table(1.0, 100, 1, [8, 200], accountant="rdp")
    assert info.value.arguments == ("batch_sizes",)
    with pytest.raises(ConfigError) as info:
        split_table(1.0, 100, 1, [8], count_share=0, accountant="rdp")
    assert info.value.arguments == ("count_share",)
    with pytest.raises(ValueError, match="unknown accountant"):
        split_table(1.0, 100, 1, [8], accountant="foo")
