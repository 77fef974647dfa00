"""Compile-once numba kernels: one lock per process (a fresh one in a forked child), a clear error without numba.

dpopt compiles three CPU kernels with numba: the Gaussian sampler's ziggurat (:mod:`dpopt.ziggurat`), the
per-row float64 squared norms (:mod:`dpopt.engine.row_norms`) and the release's add
(:func:`dpopt.privatizer.add_and_round`). Both are first called from several threads at
once (the noise threads; the norm's row ranges; the release's pieces), so each is built by the first caller only, under
:func:`compile_lock`, and kept for the process (:func:`compile_once`); :func:`njit` imports numba with an
``ImportError`` that says what to install, and falls back to an in-memory compile where numba finds no writable
cache directory (a read-only install and home).
"""

from __future__ import annotations

import os
import threading
from functools import lru_cache
from typing import Any, Callable, TypeVar

__all__ = ["NUMBA_REQUIREMENT", "compile_lock", "compile_once", "numba_module", "njit"]

NUMBA_REQUIREMENT = "numba>=0.59"
"""What to install when numba is missing (the pin of ``pyproject.toml``)."""

_LOCK = threading.Lock()

K = TypeVar("K")


def _new_lock_in_child() -> None:
    """A child forked while another thread held the lock (a DataLoader's workers fork at the start of a pass,
    when the step's early noise draw may be compiling) would wait for it forever: the child gets its own."""
    global _LOCK
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


def compile_lock() -> threading.Lock:
    """The process's compile lock (not re-entrant: a builder must not call another compile-once getter)."""
    return _LOCK


def compile_once(build: Callable[[], K]) -> Callable[[], K]:
    """``build`` run by the first caller only, its result kept: ``get()`` returns it.

    ``functools.lru_cache`` alone lets concurrent first callers each compute it; here they wait on
    :func:`compile_lock` and the second finds the first's result. ``get.cache`` is the ``lru_cache``
    (``cache_info()``, ``cache_clear()``).
    """
    cached = lru_cache(maxsize=1)(build)

    def get() -> K:
        with _LOCK:
            return cached()

    get.cache = cached  # type: ignore[attr-defined]
    get.__doc__ = build.__doc__
    return get


def numba_module(purpose: str) -> Any:
    """``import numba``, or an ``ImportError`` naming ``purpose`` and what to install.

    Raises:
        ImportError: numba is not installed (a dependency of dpopt).
    """
    try:
        import numba
    except ImportError as err:
        raise ImportError(
            f"{purpose} is compiled by numba, a dependency of dpopt that this environment lacks ({err}): "
            f"pip install '{NUMBA_REQUIREMENT}'"
        ) from err
    return numba


def njit(body: Callable[..., Any], purpose: str, **options: Any) -> Callable[..., Any]:
    """``body`` compiled by ``numba.njit(nogil=True, **options)``, cached on disk (next to its module, in numba's
    user cache directory or ``NUMBA_CACHE_DIR``) where one is writable, else compiled in memory for this process.

    ``nogil``: the compiled function releases the GIL, so Python threads run it in parallel. ``options``: more of
    ``numba.njit``'s (``error_model``, ...).

    Raises:
        ImportError: numba is not installed (:func:`numba_module`).
    """
    numba = numba_module(purpose)
    try:
        return numba.njit(nogil=True, cache=True, **options)(body)
    except RuntimeError:  # numba found no writable cache location (read-only install and home)
        return numba.njit(nogil=True, **options)(body)
