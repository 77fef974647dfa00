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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["tune_cpu_allocator", "release_free_heap", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "TOP_PAD"]

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
    fn = _TRIM[0]
    if fn is None:
        return False
    fn(0)
    return True
