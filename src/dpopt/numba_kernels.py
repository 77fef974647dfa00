"""Compile-once numba kernels: one lock per process (a fresh one in a forked child), a clear error without numba.

dpopt compiles three CPU kernels with numba: the Gaussian sampler's ziggurat (:mod:`dpopt.ziggurat`), the
per-row float64 squared norms (:mod:`dpopt.engine.row_norms`) and the release's add
(:func:`dpopt.privatizer.add_and_round`). Each is first called from several threads at once (the noise threads;
the norm's row ranges; the release's pieces), so each is built by the first caller only, under
:func:`compile_lock`, and kept for the process (:func:`compile_once`). A numba dispatcher without a signature
compiles lazily, at its first call, under numba's own global compiler lock; so each build ends with warm-up
calls (:func:`njit`'s ``warmup``) on tiny arrays of exactly the argument types the real calls use: the compile
(or the load from numba's cache) happens INSIDE :func:`compile_lock`, and a real call compiles nothing.

A fork waits for a compile in progress: ``os.register_at_fork`` takes the lock (and numba's global compiler
lock, where numba is imported: any numba compile, dpopt's or not) before the fork and releases them after; the
child gets a fresh lock and numba's released. Without that, a DataLoader worker forked while a noise thread
compiles would inherit numba's compiler lock held by a thread that does not exist in the child and hang at its
first numba compile. :func:`njit` imports numba with an ``ImportError`` that says what to install, and falls
back to an in-memory compile where numba finds no writable cache directory (a read-only install and home).
"""

from __future__ import annotations

import os
import sys
import threading
from functools import lru_cache
from typing import Any, Callable, Optional, TypeVar

__all__ = ["NUMBA_REQUIREMENT", "compile_lock", "compile_once", "numba_module", "njit"]

NUMBA_REQUIREMENT = "numba>=0.59"
"""What to install when numba is missing (the pin of ``pyproject.toml``)."""

_LOCK = threading.RLock()

K = TypeVar("K")


_HELD: tuple[bool, Any] = (False, None)  # what _hold_for_fork acquired: (this lock, numba's lock or None)


def _numba_compiler_lock() -> Any:
    """numba's global compiler lock where numba is imported (by dpopt or anyone), else None."""
    module = sys.modules.get("numba.core.compiler_lock")
    return getattr(module, "global_compiler_lock", None)


def _hold_for_fork() -> None:
    """Before a fork: wait for a compile in progress in another thread (a DataLoader's workers fork at the start
    of a pass, when the step's early noise draw may be compiling), so that the child inherits neither this lock
    nor numba's compiler lock held by a thread it does not have: this lock first (a dpopt build takes it before
    numba's), then numba's, which any numba compile holds (dpopt's or not). Re-entrant: a fork from the thread
    that holds them goes on.

    A fork from a thread that already holds numba's lock (inside some numba compile) does not wait for this
    one: a dpopt build in another thread may be waiting for numba's lock (the reverse order: a deadlock); it
    takes this lock only if free, and the child gets a fresh one either way. What was acquired is recorded
    (:data:`_HELD`) and only that is released after the fork, so an interrupt while waiting (a signal handler
    raising; CPython prints an exception of a ``before`` handler and forks anyway) leaves no lock held.
    """
    global _HELD
    _HELD = (False, None)
    numba_lock = _numba_compiler_lock()
    if numba_lock is not None and numba_lock.is_locked():  # this thread is inside a numba compile
        _HELD = (_LOCK.acquire(blocking=False), None)
        return
    _LOCK.acquire()
    _HELD = (True, None)
    if numba_lock is not None:
        numba_lock.acquire()
        _HELD = (True, numba_lock)


def _release_after_fork() -> None:
    """After a fork, in the parent: the locks :func:`_hold_for_fork` acquired (and only those), in reverse order."""
    global _HELD
    mine, numba_lock = _HELD
    _HELD = (False, None)
    if numba_lock is not None:
        numba_lock.release()
    if mine:
        _LOCK.release()


def _new_lock_in_child() -> None:
    """After a fork, in the child: numba's compiler lock released where :func:`_hold_for_fork` acquired it (this
    thread holds its copy) and a fresh compile lock (the parent's is held by the forking thread, or by a thread
    the child does not have)."""
    global _LOCK, _HELD
    numba_lock = _HELD[1]
    _HELD = (False, None)
    if numba_lock is not None:
        numba_lock.release()
    _LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_hold_for_fork, after_in_parent=_release_after_fork, after_in_child=_new_lock_in_child)


def compile_lock() -> Any:
    """The process's compile lock (a ``threading.RLock``: a builder may call another compile-once getter)."""
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


def njit(
    body: Callable[..., Any],
    purpose: str,
    warmup: Optional[Callable[[Callable[..., Any]], None]] = None,
    **options: Any,
) -> Callable[..., Any]:
    """``body`` compiled by ``numba.njit(nogil=True, **options)``, cached on disk (next to its module, in numba's
    user cache directory or ``NUMBA_CACHE_DIR``) where one is writable, else compiled in memory for this process.

    ``nogil``: the compiled function releases the GIL, so Python threads run it in parallel. ``warmup``: called
    with the dispatcher before it is returned; it calls it on tiny arrays of each argument type the real calls
    use, so that the compile (lazy in numba: at a dispatcher's first call with new types) happens here, inside
    the caller's :func:`compile_lock` (a :func:`compile_once` build), not at a later call outside it.
    ``options``: more of ``numba.njit``'s (``error_model``, ...).

    Raises:
        ImportError: numba is not installed (:func:`numba_module`).
    """
    numba = numba_module(purpose)
    try:
        kernel = numba.njit(nogil=True, cache=True, **options)(body)
    except RuntimeError:  # numba found no writable cache location (read-only install and home)
        kernel = numba.njit(nogil=True, **options)(body)
    if warmup is not None:
        warmup(kernel)
    return kernel
