"""dpopt's compiled CPU kernels (the C extension ``dpopt._native``), or an error that says how to build them.

Eight kernels. The first five run with the GIL released, so that Python threads run them in parallel on disjoint
pieces:

* ``ziggurat_fill``: the body of the CPU Gaussian sampler (:mod:`dpopt.ziggurat`);
* ``fill_tails``: its tail positions, each an exact draw of Z | Z ≥ r from the same stream (Marsaglia 1964;
  :func:`dpopt.noise.ziggurat_normals`);
* ``ziggurat_fill_chunks``: body and tails on every chunk of an early noise draw, the chunks claimed by the calling
  threads through one atomic counter (:class:`dpopt.noise.CpuNormalDraw`);
* ``release``: the release's one pass, out = rnd(z·scale + s) [/ B̄] (:func:`dpopt.privatizer.add_and_round`);
* ``row_sq_norms64``: per-row float64 squared norms of float32 rows (:mod:`dpopt.engine.row_norms`).

The last three work on ``[B]`` and ``[B, G]`` vectors (microseconds; they keep the GIL) and replace a dozen small
torch ops each, with the same bits:

* ``sq_round_up``: float64 squared norms (or the product of two) times a margin, rounded up into float32
  (:func:`dpopt.engine.row_norms.round_up_sq_norms`);
* ``sq_group_totals``: the per-parameter float32 norms summed per clip group in float64, rounded up into
  float32, with the all-finite check (:class:`dpopt.engine.fast.FastPerSampleGrads`);
* ``clip_factors32``: min(1, C/√S) rounded down into float32 (:func:`dpopt.privatizer.clip_factors`).

They are C (``src/dpopt/_native.c``), compiled when the package is built (``pip install``; a C compiler is needed
to install from the source distribution), with ``-ffp-contract=off`` (no fused multiply-add: the bit-for-bit
tests against torch/numpy expressions hold) and without ``-ffast-math``. Compiled ahead of time, they add no
compiler to the running process: the numba kernels they replace loaded LLVM at the first noise draw, ≈ 127 MiB
resident in every DP process (docs/performance.md), and compiled at run time under a lock that a fork had to wait
for.
"""

from __future__ import annotations

from typing import TypeGuard

import torch

__all__ = ["native", "numpy_readable"]

try:
    from . import _native as native
except ImportError as err:  # a source tree that was never built, or a broken install
    raise ImportError(
        "dpopt's compiled CPU kernels (the extension module dpopt._native, built from src/dpopt/_native.c) are "
        f"missing ({err}). Install dpopt with pip so that they are built (`pip install -e .` in a source tree, "
        "`pip install --force-reinstall dpopt` otherwise); a C compiler (gcc or clang) is needed where no wheel "
        "for this platform exists."
    ) from err

_KERNELS = (
    "ziggurat_fill",
    "ziggurat_fill_chunks",
    "fill_tails",
    "release",
    "row_sq_norms64",
    "sq_round_up",
    "sq_group_totals",
    "clip_factors32",
)
_stale = [name for name in _KERNELS if not hasattr(native, name)]
if _stale:  # an extension built from an older _native.c (a source tree updated without rebuilding it)
    raise ImportError(
        f"dpopt's compiled CPU kernels (dpopt._native, at {getattr(native, '__file__', '?')}) were built from an "
        f"older src/dpopt/_native.c: {', '.join(_stale)} missing. Rebuild them (`pip install -e .` in a source "
        "tree, `pip install --force-reinstall dpopt` otherwise)."
    )


def numpy_readable(x: object, dtype: torch.dtype) -> TypeGuard[torch.Tensor]:
    """``x`` is a plain ``torch.Tensor`` (not a subclass) of ``dtype``, contiguous, on the CPU and not recorded by
    autograd: the C kernels may read or write it through ``x.numpy()`` (the checks every caller of the last three
    kernels makes before taking the C pass; otherwise it takes the torch expression with the same bits)."""
    return (
        type(x) is torch.Tensor
        and x.dtype == dtype
        and x.device.type == "cpu"
        and not x.requires_grad
        and x.is_contiguous()
    )
