"""dpopt.numba_kernels: each compiled kernel is compiled INSIDE the compile lock (its build's warm-up calls),
never lazily at a real call outside it, and a fork waits for a compile in progress (review of 2026-12-07).

numba compiles a dispatcher without a signature at its first call, under numba's global compiler lock, which
has no fork handler: a child forked while another thread holds it hangs at its first compile. Every fork test
here sets ``signal.alarm`` in the child, so a regression fails (the child is killed) instead of hanging.
"""

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from dpopt import numba_kernels, privatizer, ziggurat
from dpopt.engine import row_norms
from dpopt.noise import make_noise_source
from dpopt.privatizer import RELEASE_SPLIT_MIN, add_and_round


def test_the_ziggurat_is_compiled_when_its_getter_returns():
    ziggurat._cached_kernel.cache.cache_clear()
    kernel = ziggurat._compiled()
    sigs = list(kernel.signatures)
    assert sigs  # compiled (or loaded from the cache) by the build, inside the lock
    ziggurat.ziggurat_body(np.empty(5000), ziggurat.sfc64_seed_state(bytes(range(24))))
    ziggurat.ziggurat_body(np.empty(7)[::1], ziggurat.sfc64_seed_state(bytes(24)), discard=3)
    make_noise_source().normal((10_000,), dtype=torch.float64)
    assert list(kernel.signatures) == sigs  # the real calls compiled nothing more


def test_the_row_norm_kernel_is_compiled_when_its_getter_returns():
    row_norms._kernel.cache.cache_clear()
    kernel = row_norms._kernel()
    sigs = list(kernel.signatures)
    assert sigs
    x = torch.randn(40, 5000)
    row_norms.row_sq_norms64_cpu(x, threads=1)
    row_norms.row_sq_norms64_cpu(x, threads=2)
    row_norms.row_sq_norms64_cpu(torch.randn(5000, 40).t(), threads=2)  # non-contiguous: copied first
    row_norms.row_sq_norms64_cpu(torch.randn(3, 1))
    assert list(kernel.signatures) == sigs


def test_the_release_kernels_are_compiled_when_their_getters_return():
    privatizer._cached_release_kernel.cache_clear()
    kernels = {
        (dt, inplace): privatizer._release_kernel(np.dtype(dt), inplace)
        for dt in ("float32", "float64")
        for inplace in (True, False)
    }
    sigs = {key: list(k.signatures) for key, k in kernels.items()}
    assert all(sigs.values())
    n = 2 * RELEASE_SPLIT_MIN + 5
    with ThreadPoolExecutor(2) as pool:
        for sum_dtype in (torch.float32, torch.float64):
            for out_dtype in (torch.float32, torch.float64):
                for into_sum in (True, False):
                    for divisor in (None, 3.0):
                        for p, size in ((None, 9), (pool, n)):
                            z, s = torch.randn(size, dtype=torch.float64), torch.randn(size).to(sum_dtype)
                            add_and_round(z, s, out_dtype, into_sum, scale=0.3, divisor=divisor, pool=p)
    assert {key: list(k.signatures) for key, k in kernels.items()} == sigs  # every call's types were warmed up


def _child_draws_and_exits() -> None:
    """In a forked child: draw noise and norms (each compiles anew: the caches were cleared), exit 0 on success;
    SIGALRM kills a child that hangs."""
    signal.alarm(30)
    try:
        out = np.empty(100)
        ziggurat.ziggurat_body(out, ziggurat.sfc64_seed_state(bytes(24)))
        norms = row_norms.row_sq_norms64_cpu(torch.ones(2, 3), threads=1)
        os._exit(0 if np.isfinite(out).sum() >= 95 and norms.tolist() == [3.0, 3.0] else 2)
    except BaseException:
        os._exit(3)


def _fork_while_another_thread_compiles(in_dpopt_build: bool) -> None:
    """Another thread holds numba's global compiler lock (as a dispatcher's compile or cache load does), inside a
    dpopt compile-once build or outside dpopt, when the main thread forks; the compile ends 0.3 s later, while
    the fork waits for it. The child must compile both kernels itself (caches cleared) and draw."""
    from numba.core.compiler_lock import global_compiler_lock

    held, release = threading.Event(), threading.Event()

    def compiling() -> int:
        with global_compiler_lock:
            held.set()
            release.wait(10)
        return 1

    target = numba_kernels.compile_once(compiling) if in_dpopt_build else compiling
    ziggurat._cached_kernel.cache.cache_clear()
    row_norms._kernel.cache.cache_clear()
    thread = threading.Thread(target=target)
    thread.start()
    assert held.wait(10)
    threading.Timer(0.3, release.set).start()
    pid = os.fork()
    if pid == 0:
        _child_draws_and_exits()
    thread.join()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), f"the child hung at its first numba call (status {status})"
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_waits_for_a_compile_in_progress_in_another_thread():
    """Another thread is inside a compile-once build (holding numba's compiler lock, as a compile does) when the
    main thread forks: the fork waits for it, and the child can compile and draw. Without the fork handler the
    child inherits numba's lock held by a thread it does not have and hangs (killed by its alarm)."""
    _fork_while_another_thread_compiles(in_dpopt_build=True)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_from_the_thread_that_holds_the_lock_goes_on():
    """The lock is re-entrant: a fork inside a build (the same thread) is not a deadlock, and the child gets a
    fresh lock."""
    ziggurat._cached_kernel.cache.cache_clear()
    with numba_kernels.compile_lock():
        pid = os.fork()
        if pid == 0:
            _child_draws_and_exits()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_waits_for_numbas_compiler_lock_held_outside_dpopt():
    """Another thread holds numba's global compiler lock outside dpopt's (any numba compile: the reviewer's
    /tmp/rev/e5.py) when the main thread forks: the fork waits for it, and the child, which must compile both
    kernels (the caches were cleared), can draw."""
    _fork_while_another_thread_compiles(in_dpopt_build=False)


def _run_isolated(script: str) -> None:
    """``script`` in a fresh interpreter (it forks and plays with signals and locks), killed after 60 s: a
    deadlock fails the test instead of hanging the suite."""
    import subprocess
    import sys
    import textwrap

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK" in done.stdout, done.stdout + done.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_an_interrupt_while_the_fork_waits_leaves_no_lock_held():
    """A signal handler raising while the fork handler waits for numba's lock (CPython prints the exception of
    a ``before`` handler and forks anyway): the parent must not keep dpopt's lock, or every later kernel getter
    in another thread waits forever (second review of 2026-12-07: it did)."""
    _run_isolated(
        """
        import os, signal, threading, time
        from numba.core.compiler_lock import global_compiler_lock
        from dpopt import numba_kernels

        held = threading.Event()
        def compiling():
            with global_compiler_lock:
                held.set()
                time.sleep(1.5)
        t = threading.Thread(target=compiling)
        t.start()
        held.wait(10)
        def interrupt(signum, frame):
            raise KeyboardInterrupt
        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        t.join()
        got = []
        other = threading.Thread(target=lambda: got.append(numba_kernels.compile_lock().acquire(timeout=5)))
        other.start()
        other.join()
        assert got == [True], "dpopt's compile lock stayed held by the forking thread"
        print("OK")
        """
    )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_inside_a_numba_compile_does_not_wait_for_a_build_waiting_for_numba():
    """Lock order: a build holds dpopt's lock and waits for numba's; the forking thread holds numba's (inside
    some numba compile). Waiting for dpopt's lock there is a deadlock; the fork must go on (second review of
    2026-12-07: it hung)."""
    _run_isolated(
        """
        import os, threading, time
        from numba.core.compiler_lock import global_compiler_lock
        from dpopt import numba_kernels

        started = threading.Event()
        def build():
            with numba_kernels.compile_lock():
                started.set()
                time.sleep(0.3)
                with global_compiler_lock:
                    pass
        with global_compiler_lock:
            b = threading.Thread(target=build)
            b.start()
            started.wait(10)
            pid = os.fork()
            if pid == 0:
                os._exit(0)
        os.waitpid(pid, 0)
        b.join(20)
        assert not b.is_alive()
        print("OK")
        """
    )
