"""``layers.row_sq_norms64``: per-row squared norms in float64 without a float64 copy of the whole input."""

import numpy as np
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
    """The torch path (other devices): blocks of rows give each row the very bits of one reduction over all
    rows (same column slices, same order of additions), whatever torch's thread count."""
    from dpopt.engine.row_norms import _row_blocks, _sliced, _torch_row_sq_norms64

    assert len(_row_blocks(rows, min(n, columns), columns)) > 1  # the blocked path is the one under test
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-4, 4, rows).view(-1, 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, whole = _torch_row_sq_norms64(x, columns), _sliced(x, columns)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, whole)
    torch.testing.assert_close(got, (x.double() ** 2).sum(1), rtol=1e-14, atol=0.0)


# --------------------------------------------------------------------------- the compiled CPU kernel (issue 34)
def _exact_sq_norms(x: torch.Tensor) -> list[float]:
    """Σ_j x_rj² per row, correctly rounded (math.fsum of the float64 squares, each exact for float32 x)."""
    import math

    return [math.fsum(v * v for v in row) for row in x.double().tolist()]


@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 16, 17, 100, 864, 18432 + 5])
def test_kernel_equals_the_correctly_rounded_sum(n):
    """float64 accumulation of exact squares: within n·2⁻⁵³ relative of the correctly rounded sum; and exact on
    integers (every partial sum representable), whichever accumulator and tail column an element falls in."""
    from dpopt.engine.row_norms import row_sq_norms64_cpu

    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, n, generator=g) * torch.logspace(-20, 20, 6).view(-1, 1)
    got = row_sq_norms64_cpu(x)
    assert got.dtype == torch.float64 and got.shape == (6,)
    want = torch.tensor(_exact_sq_norms(x), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=n * 2.0**-53, atol=0.0)
    ints = torch.randint(-1000, 1000, (5, n), generator=g).float()
    ints[:, -1] = 4093.0  # the last column counts (a tail element when n mod 8 ≠ 0)
    assert row_sq_norms64_cpu(ints).tolist() == [float(v) for v in (ints.long() ** 2).sum(1).tolist()]
    assert row_sq_norms64_cpu(ints).tolist() == row_sq_norms64(ints).tolist()  # the dispatch takes it


def test_kernel_sums_squares_beyond_float32_range_and_keeps_non_finite_rows():
    from dpopt.engine.row_norms import row_sq_norms64_cpu

    x = torch.full((3, 40), 1e20)
    x[1, 3] = float("inf")
    x[2, 39] = float("nan")
    got = row_sq_norms64_cpu(x)
    assert float(got[0]) == pytest.approx(40 * 1e40, rel=1e-7)
    assert got[1] == float("inf") and torch.isnan(got[2])


@pytest.mark.parametrize("rows,n", [(33, 18432), (36, 36864), (80, 864), (5, 30000), (2, 70000)])
def test_kernel_is_bit_identical_whatever_the_thread_count(rows, n):
    """Each row is reduced by one thread in the same order: asking for 1, 2, 3 or 7 threads (and torch's 1 or 2 threads
    through the dispatch) give the same bits."""
    from dpopt.engine.row_norms import RANGE_MIN_ELEMENTS, row_sq_norms64_cpu

    assert rows * n >= 2 * RANGE_MIN_ELEMENTS  # the split path is the one under test
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-4, 4, rows).view(-1, 1)
    one = row_sq_norms64_cpu(x, threads=1)
    for k in (2, 3, 7):
        assert torch.equal(row_sq_norms64_cpu(x, threads=k), one)
    before = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(row_sq_norms64(x), one)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, (x.double() ** 2).sum(1), rtol=n * 2.0**-53, atol=0.0)


def test_kernel_takes_strided_and_grad_inputs_and_refuses_other_tensors():
    from dpopt.engine.row_norms import row_sq_norms64_cpu

    base = torch.randn(40, 300, requires_grad=True)
    view = base[:, ::3]  # not contiguous, and tracked by autograd
    want = (view.detach().double() ** 2).sum(1)
    torch.testing.assert_close(row_sq_norms64_cpu(view, threads=2), want, rtol=1e-14, atol=0.0)
    assert row_sq_norms64_cpu(torch.zeros(0, 5)).shape == (0,)
    for bad in (torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, 4, 2), torch.zeros(3, 4).half()):
        with pytest.raises(ValueError, match="2-D float32 CPU"):
            row_sq_norms64_cpu(bad)


def test_a_recorded_input_keeps_the_torch_path_and_its_gradient():
    """Where autograd records ``flat`` the dispatch keeps torch's path (the kernel would cut the graph):
    d/dx Σ_r ‖x_r‖² = 2x."""
    x = torch.randn(40, 3000, requires_grad=True)
    got = row_sq_norms64(x)
    assert got.requires_grad
    got.sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach(), rtol=1e-6, atol=0.0)
    with torch.no_grad():
        assert not row_sq_norms64(x).requires_grad


def test_row_ranges_cover_the_rows_once():
    from dpopt.engine.row_norms import row_ranges

    assert row_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert row_ranges(2, 5) == [(0, 1), (1, 2)]
    assert row_ranges(4, 0) == [(0, 4)]


def test_small_inputs_are_not_cut_into_ranges_dearer_than_their_work(monkeypatch):
    """A chunk is split into at most b·n // RANGE_MIN_ELEMENTS ranges, whatever the thread count asked for."""
    from dpopt.engine import row_norms

    seen = []
    real = row_norms.row_ranges
    monkeypatch.setattr(row_norms, "row_ranges", lambda rows, parts: seen.append(parts) or real(rows, parts))
    m = row_norms.RANGE_MIN_ELEMENTS
    for rows, n in ((4, 100), (2, m), (4, m), (40, m)):
        row_norms.row_sq_norms64_cpu(torch.ones(rows, n), threads=64)
    assert seen == [0, 2, 4, 40]


def test_the_c_kernel_refuses_ranges_and_shapes_outside_its_buffers():
    """The kernel checks its arguments itself: rows outside out, a column count that does not match x, or a
    float64 x is a ValueError, never a read or write outside the buffers."""
    from dpopt.kernels import native

    x, out = np.ones((4, 3), dtype=np.float32), np.empty(4)
    wraps = 2**62 + 1  # 4 · wraps overflows to 4 = x's length: must not pass the size check
    for args in (
        (x, out, 3, 0, 5),
        (x, out, 4, 0, 4),
        (x, out, 3, 3, 2),
        (x.astype(np.float64), out, 3, 0, 4),
        (np.ones(4, dtype=np.float32), out, wraps, 0, 4),
    ):
        with pytest.raises(ValueError, match="row_sq_norms64 takes"):
            native.row_sq_norms64(*args)
    native.row_sq_norms64(x, out, 3, 1, 3)
    assert out[1] == out[2] == 3.0


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_gets_its_own_pool():
    """The parent's pool threads do not exist in a forked child: its first split call must not wait for them."""
    import os

    from dpopt.engine.row_norms import row_sq_norms64_cpu

    x = torch.randn(40, 5000)
    want = row_sq_norms64_cpu(x, threads=2)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:
        import signal

        signal.alarm(30)  # a child that hangs is killed: the test fails rather than hangs
        try:
            os._exit(0 if torch.equal(row_sq_norms64_cpu(x, threads=2), want) else 2)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("model_name", ["cnn5", "wrn16-4"])
def test_conv_model_norms_equal_torch_func_and_do_not_depend_on_threads(model_name):
    """Train mode, whole conv models: every parameter's per-example norm (direct-form convs through the kernel)
    equals torch.func's at 1 and 2 threads; CNN5's norms are the same bits at both (its recorded layer inputs
    and output gradients are, on this CPU; WRN-16-4's torch backward already differs in the last bits between
    1 and 2 threads, so its norms cannot be bit-equal)."""
    from torch import nn

    from dpopt.engine import fast_per_sample_gradients
    from dpopt.engine.reference import per_sample_gradients
    from dpopt.models import build_model
    from dpopt.types import ClipGeometry

    torch.manual_seed(0)
    model = build_model(model_name).train()
    g = torch.Generator().manual_seed(3)
    b = 12 if model_name == "cnn5" else 3
    x, y = torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g)
    n = len(list(model.parameters()))
    geo, groups = ClipGeometry(None, None), list(range(n))
    before = torch.get_num_threads()
    norms = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            src = fast_per_sample_gradients(model, nn.functional.cross_entropy, x, y)
            norms.append(src.sq_norms(geo, groups, n))
    finally:
        torch.set_num_threads(before)
    ref = per_sample_gradients(model, nn.functional.cross_entropy, x, y).sq_norms(geo, groups, n)
    assert bool((ref > 0).all())
    torch.testing.assert_close(norms[0].double(), ref.double(), rtol=1e-4, atol=0.0)
    torch.testing.assert_close(norms[1].double(), ref.double(), rtol=1e-4, atol=0.0)
    if model_name == "cnn5":
        assert torch.equal(norms[0], norms[1])


def test_a_tensor_subclass_takes_the_torch_path():
    """A FakeTensor (torch.compile's tracing) has no numpy data: the torch path, not ``.numpy()``; a plain
    subclass gets the same values as the kernel's (float64 squares of float32, summed in float64)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dpopt.engine.row_norms import row_sq_norms64, row_sq_norms64_cpu

    with FakeTensorMode():
        fake = torch.empty(4, 8)
        for fn in (row_sq_norms64, row_sq_norms64_cpu):
            out = fn(fake)
            assert out.shape == (4,) and out.dtype == torch.float64

    class Sub(torch.Tensor):
        pass

    x = torch.tensor([[1.0, 2.0, 2.0], [3.0, 4.0, 0.0]])
    for fn in (row_sq_norms64, row_sq_norms64_cpu):
        got = fn(x.as_subclass(Sub))
        assert got.dtype == torch.float64 and got.tolist() == [9.0, 25.0]
