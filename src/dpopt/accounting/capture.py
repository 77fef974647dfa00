"""Capturing what an accounting library says while it computes ε (a leaf: imports nothing from dpopt).

dp_accounting's RDP accountant logs one absl warning per unconverged order
(600 log lines on a 100-entry mixed ledger), and numpy warns on overflow in
the PLD. :func:`captured` collects those messages instead of letting them
reach the terminal, and :func:`library_note` turns them into one line for
:attr:`~dpopt.accounting.cost.EpsilonReport.notes`.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import numpy as np

__all__ = ["captured", "library_note"]


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def captured(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, list]:
    """Call ``fn`` with warnings, absl log warnings (dp_accounting's RDP logs one per
    unconverged order) and floating-point warnings captured.

    Returns:
        ``(result, messages)``: the first line of each distinct message, in order.
    """
    absl = logging.getLogger("absl")
    handler, propagate = _Collect(), absl.propagate
    absl.addHandler(handler)
    absl.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught, np.errstate(all="ignore"):
            warnings.simplefilter("always")
            result = fn(*args, **kwargs)
    finally:
        absl.removeHandler(handler)
        absl.propagate = propagate
    messages = []
    texts = [str(w.message) or w.category.__name__ for w in caught]
    texts += [r.getMessage() for r in handler.records]
    for text in texts:
        text = text.strip().splitlines()[0] if text.strip() else "warning"
        if text not in messages:
            messages.append(text)
    return result, messages


def library_note(name: str, messages: list) -> tuple:
    """One note summarising ``messages`` captured from library ``name`` (empty tuple if none)."""
    if not messages:
        return ()
    first = messages[0] if len(messages[0]) <= 160 else messages[0][:157] + "..."
    more = f" (and {len(messages) - 1} other message(s))" if len(messages) > 1 else ""
    return (
        f"{name} warned while computing epsilon: {first!r}{more}; the value reported is still "
        "the library's upper bound",
    )
