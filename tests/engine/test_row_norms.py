"""``layers.row_sq_norms64``: per-row squared norms in float64 without a float64 copy of the whole input."""

import pytest
import torch

from dpopt.engine.layers import row_sq_norms64


@pytest.mark.parametrize("n", [1, 7, 100, 1000, 4096 + 3])
@pytest.mark.parametrize("columns", [16, 1024, 1 << 15])
def test_equals_float64_reduction(n, columns):
    """Same squares and float64 accumulation as vector_norm(dtype=float64): equal to 1e-14 relative."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=g) * torch.logspace(-3, 3, 5).view(-1, 1)
    ref = (x.double() ** 2).sum(1)
    got = row_sq_norms64(x, columns)
    assert got.dtype == torch.float64 and got.shape == (5,)
    torch.testing.assert_close(got, ref, rtol=1e-14, atol=0.0)


def test_float64_input_and_no_rows():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    assert row_sq_norms64(x, 1).tolist() == [25.0, 0.0]
    assert row_sq_norms64(torch.zeros(0, 40), 16).shape == (0,)


def test_float32_rows_exceeding_float32_range_of_sums():
    """Squares beyond float32's range still add up exactly in float64 (a float32 accumulation would give inf)."""
    x = torch.full((2, 40), 1e20)
    got = row_sq_norms64(x, 16)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(
        got, torch.full((2,), 40 * float(x[0, 0]) ** 2, dtype=torch.float64), rtol=1e-12, atol=0.0
    )
