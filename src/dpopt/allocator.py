"""CPU allocator tuning for training processes: keep freed activation-sized blocks for reuse.

On Linux with glibc, ``malloc`` serves every block above its mmap threshold
(128 KiB, raised dynamically up to 32 MiB) with a fresh ``mmap`` and returns it
with ``munmap`` on free. A training step allocates and frees its activations,
their gradients and the per-example scratch space every step, so every step
page-faults (and the kernel zeroes) all of that memory again. On the 2-core
machines this project is measured on that fault traffic was about half of a
CIFAR-10 CNN step at 512–1024 rows, private or not (docs/performance.md,
"Allocator").

:func:`tune_cpu_allocator` sets three ``mallopt`` parameters for the whole
process (the same as the environment variables ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` given at start-up): blocks up
to 32 MiB come from the heap, freed memory is kept (the process's resident
memory stays at its peak instead of shrinking between steps), and the heap
grows in 512 MiB steps. Nothing else changes: no value computed by a step
depends on it. ``dpopt train`` calls it on start unless the environment
variable ``DPOPT_NO_ALLOCATOR_TUNING`` is set; library users may call it
themselves.

:func:`release_free_heap` goes the other way, once: ``malloc_trim(0)`` hands the
pages of every free heap block back to the OS. The engines call it around the
first-batch check's passes (rare: once per mode signature), whose activations
have other sizes than the step's and would otherwise stay resident, unused,
through the first step (docs/performance.md, "The first step's resident excess is
glibc's free heap").

:func:`in_own_arena` runs a function on a short-lived thread, which glibc
serves from another malloc arena than the main thread's heap. The ``dp-sgd``
door runs its first-batch check there (once per mode signature): the check's
passes at 9/8 of the batch would otherwise grow the main heap by ≈ 50–60 MiB
beyond the step's own extent and leave small live blocks scattered through
it, so that later steps place their activations (and, when a ≥ 32 MiB hole
is left, the logits) on pages the non-private step never touches
(docs/performance.md, "LoRA memory: glibc's heap modes").
"""

from __future__ import annotations

import contextvars
import ctypes
import ctypes.util
import os
import sys
import threading
from typing import Any, Callable, TypeVar

_T = TypeVar("_T")

__all__ = ["tune_cpu_allocator", "release_free_heap", "in_own_arena", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "TOP_PAD"]

MMAP_THRESHOLD = 32 << 20  # bytes: glibc's largest allowed mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 2**31 - 1  # bytes of free heap top kept before returning memory to the OS (mallopt takes an int)
TOP_PAD = 512 << 20  # bytes added to each heap extension

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc <malloc.h>
_DONE: list = []  # set once per process (a list, so that the function needs no global statement)
_TRIM: list = []  # glibc's malloc_trim once looked up: [function or None]


def tune_cpu_allocator() -> bool:
    """Set glibc's mmap threshold, trim threshold and top pad for a training process (module docstring).

    Idempotent. Does nothing (returns False) off Linux, without glibc, when
    ``DPOPT_NO_ALLOCATOR_TUNING`` is set in the environment, or if glibc refuses
    a value.

    Returns:
        True if the three parameters are set (now or by an earlier call).
    """
    if _DONE:
        return True
    if os.environ.get("DPOPT_NO_ALLOCATOR_TUNING") or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting it also switches off glibc's dynamic threshold adjustment
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (_M_TOP_PAD, TOP_PAD),
        )
    )
    if ok:
        _DONE.append(True)
    return ok


def release_free_heap() -> bool:
    """Return the free pages of glibc's heap to the OS (``malloc_trim(0)``); no value anywhere changes.

    glibc keeps freed blocks in its heap for reuse; blocks whose sizes no
    later allocation fits stay resident while unused. ``malloc_trim(0)``
    releases the top of every arena and, since glibc 2.8, every whole page
    inside a free block (``madvise(MADV_DONTNEED)``), so that resident memory
    drops to the blocks in use plus partial pages. Live blocks are not moved
    or touched. Cost: a walk of the free lists plus, later, one page fault
    per released page that is used again — so it is meant for rare points
    (the first-batch check's passes), not for every step: once per step,
    between the loss and the backward of the ``dp-sgd`` door, it put every
    GPT-2 + LoRA memory child at 0.99–1.00× of the non-private peak but
    cost 5–7 % of a GPT-2 step's CPU time and 21–25 % of the MNIST MLP's,
    mostly in faulting the released pages in again (docs/performance.md,
    "LoRA memory: glibc's heap modes").

    Returns:
        True if glibc's ``malloc_trim`` was called, False off Linux, without
        glibc or when ``DPOPT_NO_ALLOCATOR_TUNING`` is set (read at the first
        call). After :func:`tune_cpu_allocator` it also returns the kept heap
        top (the 512 MiB pad), which the next steps grow again once.

    Source: glibc manual, ``malloc_trim(3)``.
    """
    fn = _glibc_trim()
    if fn is None:
        return False
    fn(0)
    return True


def _glibc_trim():
    """glibc's ``malloc_trim`` (looked up once), or None off Linux, without glibc or with ``DPOPT_NO_ALLOCATOR_TUNING``."""
    if not _TRIM:
        fn = None
        if sys.platform.startswith("linux") and not os.environ.get("DPOPT_NO_ALLOCATOR_TUNING"):
            try:  # the process's own symbols (libc among them): no ldconfig subprocess as find_library runs
                fn = ctypes.CDLL(None).malloc_trim
            except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
                fn = None
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
        _TRIM.append(fn)
    return _TRIM[0]


def _torch_modes_active() -> bool:
    """True if a torch function/dispatch mode or inference mode is active here (thread-local in torch)."""
    import torch

    c = torch._C
    return bool(
        torch.is_inference_mode_enabled()
        or (hasattr(c, "_len_torch_function_stack") and c._len_torch_function_stack() > 0)
        or (hasattr(c, "_len_torch_dispatch_stack") and c._len_torch_dispatch_stack() > 0)
    )


def in_own_arena(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """Return ``fn(*args, **kwargs)``, run on a short-lived thread so that glibc serves it from another arena.

    glibc gives a new thread its own malloc arena (or a free one left by an
    ended thread) instead of the main thread's heap (glibc ``malloc/arena.c``,
    ``arena_get2``), so what ``fn`` allocates and frees does not grow or
    fragment the heap of the caller's later steps; blocks still alive
    afterwards are freed into their arena from any thread. The caller waits
    for the thread: nothing runs concurrently. The thread gets the caller's
    torch grad mode, CPU autocast state (enabled, dtype, cache), intra-op
    thread count and ``contextvars`` context; values do not depend on the
    thread. An exception of ``fn`` is re-raised here (the same object).
    An interrupt of the wait (``KeyboardInterrupt``) waits for ``fn`` to end
    before it propagates, so that ``fn`` never runs on after the caller left.

    Runs ``fn`` inline instead (same result) off Linux, without glibc, when
    ``DPOPT_NO_ALLOCATOR_TUNING`` is set (read at the first call of
    :func:`release_free_heap` or here), or while a torch function or
    dispatch mode or inference mode is active (torch keeps those per
    thread).

    Used for the first-batch check of the ``dp-sgd`` door on CPU
    (:meth:`~dpopt.engine.fast.PerSampleEngine._compute`; docs/performance.md,
    "LoRA memory: glibc's heap modes").
    """
    import torch

    if not _glibc_trim() or _torch_modes_active():
        return fn(*args, **kwargs)
    grad = torch.is_grad_enabled()
    ac = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled())
    nthreads = torch.get_num_threads()
    ctx = contextvars.copy_context()
    box: dict = {}

    def body() -> None:
        try:
            torch.set_num_threads(nthreads)  # OpenMP's team size is per thread
            with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=ac[1], enabled=ac[0], cache_enabled=ac[2]):
                box["value"] = ctx.run(fn, *args, **kwargs)
        except BaseException as err:  # noqa: BLE001 — handed to the caller's thread as is
            box["error"] = err

    worker = threading.Thread(target=body, name="dpopt-own-arena", daemon=True)
    worker.start()
    try:
        worker.join()
    except BaseException:
        while worker.is_alive():  # fn must not run on after the caller unwound (it may touch the model)
            try:
                worker.join()
            except BaseException:  # noqa: BLE001 — a second interrupt: keep waiting
                continue
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]
