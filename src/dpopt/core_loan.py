"""One of torch's cores lent to the step's noise draw while the step's per-example work is small (issue 34).

For users: automatic, nothing to call. It helps where torch runs as many threads as the process has cores, on
a small model (e.g. an MLP on MNIST: ≈ 0.88 of the step's wall time on two cores), and needs OpenMP's passive
wait: ``import dpopt`` before ``torch`` (dpopt then sets ``OMP_WAIT_POLICY=PASSIVE``; with torch imported first
OpenMP spin-waits on the lent core and the loan gains nothing). To turn it off, set
``dpopt.core_loan.LOAN_MACS_PER_NORMAL = -1`` (read at each step). The released values are the same either way.

Where torch uses every core (``torch.get_num_threads()`` threads, none spare), the Privatizer's early noise
draw waits for the release (:class:`~dpopt.noise.CpuNormalDraw`, ``defer``): a draw worker running during
torch's parallel regions takes a core from one of torch's threads and the whole region waits for it. Between
the forward and the weighted sums, though, the engine's phases on a small model are small operations
(the per-example losses, the backward to the layer outputs, the norms, the clip factors) that torch's
threads do not speed up: on the MNIST MLP at B = 256 and two threads they take ≈ 1.7 ms, against ≈ 0.9 ms at
one thread (docs/performance.md, "MLP: a core lent to the noise draw"). So for those phases the engine
runs torch at one thread fewer and the draw's worker computes chunks on the core given up; before the
weighted sums (large GEMMs, which do use every thread) the worker is paused and torch's threads restored.
The consumer (:meth:`~dpopt.noise.CpuNormalDraw.consume`, at the release) and the workers then finish the
chunks left.

Only *when* and on which thread the chunks are computed moves: each chunk's values come from its own SFC64
state, drawn when the draw was made, never from the timing. Which phases run at which thread count follows
from the shapes of the step (:data:`LOAN_MACS_PER_NORMAL`), never from timings, so a run is as repeatable as
before.

The loan lives for one :meth:`~dpopt.privatizer.Privatizer.privatize` call (:func:`step_loan`, a context
variable: nothing of it outlives the call, and another thread or task sees none) and is made at most once in
it: the engine lends (:func:`lend`) after the first capture's forward, pauses the draw's worker after the norms
(:func:`wind_down`) and reclaims (:func:`reclaim`) before the first large weighted sum or the next forward (later micro-batches and evaluation points run at torch's own
thread count); :func:`step_loan` reclaims, whatever happens, when the call ends. Lent phases: what runs
between those points — the user's loss function on the batch, the backward to the layer outputs, the blocks,
the norms (with a shift/scale geometry: two GEMMs per weight), the clip factors and the small weighted sums.
The rule (:data:`LOAN_MACS_PER_NORMAL`) counts the recorded layers' input gradients only: a frozen layer
between trainable ones, or a shift/scale geometry's norm GEMMs, is not counted (at worst a slower step, never
a different value); the engine does not lend where some parameters take the per-example (torch.func) path.
Only torch's OpenMP backend is lent to (the native backend refuses a thread count changed after parallel
work has started).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from typing import TYPE_CHECKING, Iterator, Optional

import torch

if TYPE_CHECKING:
    from .noise import CpuNormalDraw

#: The loan is made when the backward to the recorded layers' outputs costs at most this many multiply-adds
#: per normal of the draw (and every recorded layer maps rows to rows: T = 1). One normal costs ≈ 2 ns of
#: one core here, a multiply-add of a large GEMM ≈ 0.012 ns: at 16 the backward's share at one thread
#: fewer is a tenth of the draw's time. Measured (MLP, two threads): B = 256 (3.3 per normal) 16 % less
#: wall time, B = 1024 (13) 2.5 % less, B = 4096 (52, above: no loan) 4 % more; CNN5 (conv: no loan) 35 %
#: more had it been lent.
LOAN_MACS_PER_NORMAL = 16

#: Weighted sums of at most this many multiply-adds run before the loan ends (the engine's small blocks: a
#: bias's Σ c_i e_i, a small layer's GEMM): at two torch threads each waits ≈ 0.1 ms for torch's second
#: thread here, more than the second thread saves below ≈ 30 M (a GEMM of 16 M ≈ 0.17 ms at one thread).
LENT_SUM_MACS = 1 << 24


class CoreLoan:
    """The step's pending noise draw and the torch thread count to restore while a core is lent to it.

    Args:
        draw: the Privatizer's early draw of this step (:class:`~dpopt.noise.CpuNormalDraw`).
    """

    def __init__(self, draw: "CpuNormalDraw"):
        self.draw = draw
        self._threads: Optional[int] = None  # torch's thread count while lent, else None
        self._made = False  # a loan was made in this step (at most one: later phases run at torch's threads)

    @property
    def lent(self) -> bool:
        """Whether a core is lent now (torch at one thread fewer, the draw's worker running)."""
        return self._threads is not None

    def lend(self, backward_macs: Optional[int]) -> bool:
        """Lend a core if the draw waits for one, torch runs ≥ 2 threads and ``backward_macs`` (the
        multiply-adds of the backward to the layer outputs, None: not known to be small) is at most
        :data:`LOAN_MACS_PER_NORMAL` per normal: the draw's worker starts (one) and torch runs one thread
        fewer until :meth:`reclaim`. At most one loan per step (a second call after :meth:`reclaim` lends
        nothing), and only on torch's OpenMP backend. Returns whether a core is lent after the call."""
        if self.lent:
            return True
        if self._made or backward_macs is None or backward_macs > LOAN_MACS_PER_NORMAL * self.draw.n:
            return False
        threads = torch.get_num_threads()
        if threads < 2 or not self.draw.waiting or not _openmp():
            return False
        self._made = True
        self.draw.start(workers=1)  # before torch's threads change: the noise pool is sized by them
        # recorded before the change: an exception delivered right after it (a signal: KeyboardInterrupt) still
        # finds the count to restore in reclaim()
        self._threads = threads
        torch.set_num_threads(threads - 1)
        return True

    def wind_down(self) -> None:
        """Near a loan's end: the draw's worker stops claiming chunks (:meth:`~dpopt.noise.CpuNormalDraw.pause`)
        while torch stays at one thread fewer, so that the chunk it is computing ends before the large GEMMs
        rather than beside them (the engine calls it after the norms: the clip factors and the small sums left
        take about one chunk's time). A no-op when nothing is lent."""
        if self.lent:
            self.draw.pause()

    def reclaim(self) -> None:
        """End a loan: the draw's worker stops claiming chunks (:meth:`~dpopt.noise.CpuNormalDraw.pause`;
        the consumer resumes it) and torch's thread count is restored. A no-op when nothing is lent."""
        threads, self._threads = self._threads, None
        if threads is None:
            return
        try:
            self.draw.pause()
        finally:
            torch.set_num_threads(threads)


@lru_cache(maxsize=1)
def _openmp() -> bool:
    """Whether torch's intra-op threads are OpenMP's (whose count may change at any time; the native backend
    warns and keeps its pool)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


_LOAN: ContextVar[Optional[CoreLoan]] = ContextVar("dpopt_core_loan", default=None)


@contextmanager
def step_loan(draw: Optional["CpuNormalDraw"]) -> Iterator[Optional[CoreLoan]]:
    """The loan of one step (None without an early draw): :func:`lend` and :func:`reclaim` act on it inside
    the ``with`` block; on leaving it (normally or by an exception) a lent core is reclaimed."""
    loan = CoreLoan(draw) if draw is not None else None
    token = _LOAN.set(loan)
    try:
        yield loan
    finally:
        _LOAN.reset(token)
        if loan is not None:
            loan.reclaim()


def lent() -> bool:
    """Whether the current step's loan has a core lent now (False outside :func:`step_loan`)."""
    loan = _LOAN.get()
    return loan is not None and loan.lent


def lend(backward_macs: Optional[int]) -> bool:
    """:meth:`CoreLoan.lend` on the current step's loan (False outside :func:`step_loan`)."""
    loan = _LOAN.get()
    return loan is not None and loan.lend(backward_macs)


def wind_down() -> None:
    """:meth:`CoreLoan.wind_down` on the current step's loan (a no-op outside :func:`step_loan`)."""
    loan = _LOAN.get()
    if loan is not None:
        loan.wind_down()


def reclaim() -> None:
    """:meth:`CoreLoan.reclaim` on the current step's loan (a no-op outside :func:`step_loan`)."""
    loan = _LOAN.get()
    if loan is not None:
        loan.reclaim()
