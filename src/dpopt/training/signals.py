"""SIGINT / SIGTERM during training: finish the current step, then stop cleanly.

:func:`graceful_stop` installs handlers (main thread only; elsewhere it does
nothing) that record the first signal in a :class:`StopRequest`; the loop
checks it between steps and stops with ``status = "interrupted"`` after
writing the ledger, metrics, a checkpoint and the summary. A second SIGINT
raises ``KeyboardInterrupt`` at once (the journal is still flushed on the way
out, so the ledger never under-counts). The previous handlers are restored
on exit.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

__all__ = ["StopRequest", "graceful_stop", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class StopRequest:
    """The first stop signal received (None: keep going)."""

    signum: Optional[int] = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> Optional[str]:
        return None if self.signum is None else signal.Signals(self.signum).name


@contextlib.contextmanager
def graceful_stop() -> Iterator[StopRequest]:
    """Record SIGINT/SIGTERM in the yielded :class:`StopRequest` instead of dying mid-step."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum, frame):
        if request.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if request.signum is None:
            request.signum = signum

    previous = {}
    for sig in STOP_SIGNALS:
        try:
            previous[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):  # pragma: no cover - platforms without the signal
            pass
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
