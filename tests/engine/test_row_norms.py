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


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 33, 70])
@pytest.mark.parametrize("n", [5, 27, 864, 5000])
def test_row_blocks_cover_the_rows_once_with_at_least_two_each(rows, n):
    from dpopt.engine.row_norms import _row_blocks

    columns = 4096
    blocks = _row_blocks(rows, min(n, columns), columns)
    assert blocks[0][0] == 0 and blocks[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))  # contiguous, in order, no overlap
    if len(blocks) > 1:
        assert all(t - s >= 2 for s, t in blocks)
        step = max(2, columns // n)
        assert all(t - s <= step + 1 for s, t in blocks)  # only a last row may join a block


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "rows,n,columns", [(33, 18432, 1 << 15), (16, 36864, 1 << 15), (70, 864, 1 << 15), (9, 300, 64)]
)
def test_row_blocking_is_bit_identical_to_one_call(rows, n, columns, threads):
    """Blocks of rows give each row the very bits of one reduction over all rows (same column slices, same
    order of additions), whatever torch's thread count."""
    from dpopt.engine.row_norms import _row_blocks, _sliced

    assert len(_row_blocks(rows, min(n, columns), columns)) > 1  # the blocked path is the one under test
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-4, 4, rows).view(-1, 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, whole = row_sq_norms64(x, columns), _sliced(x, columns)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, whole)
    torch.testing.assert_close(got, (x.double() ** 2).sum(1), rtol=1e-14, atol=0.0)
