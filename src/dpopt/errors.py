"""Library exceptions that name the arguments to change (the CLI maps them to its flags).

The library speaks in argument names (``batch_size``, ``noise_multiplier``);
the command line speaks in flags (``--batch-size``). A :class:`ConfigError`
carries the names of the arguments it is about, so a front end can translate
them without parsing the message: :func:`dpopt.cli` replaces each name by its
flag, and Python users read the names they passed.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

__all__ = ["ConfigError", "LedgerWriteError", "RunWriteError", "translate"]


class ConfigError(ValueError):
    """A value the user chose is invalid; the message says what to change.

    Args:
        message: the explanation, naming the arguments as the library spells
            them (e.g. ``"batch_size must be >= 1, got 0"``).
        arguments: those argument names (``("batch_size",)``).

    A ``ValueError`` subclass, so ``except ValueError`` keeps working.
    """

    def __init__(self, message: str, *arguments: str):
        super().__init__(message)
        self.arguments = tuple(arguments)


class LedgerWriteError(OSError):
    """A release's ledger entry could not be written (the journal's disk is full, its file read-only, ...).

    The ledger is write-ahead for what is released: a release whose entry is not on record is not made
    (:meth:`dpopt.privatizer.Privatizer.release`). The message names the write's own ``OSError`` (also
    the ``__cause__``), says what happened to the release and what to do.

    An ``OSError`` subclass, so ``except OSError`` keeps working; ``errno``/``filename`` are those of the
    failed write.

    Args:
        message: what happened (the write's error, what was and was not released).
        cause: the failed write's ``OSError`` (None: unpickled, or another rank's failure).
        advice: what to do, for the door that raised it (the Privatizer's is for a loop that calls
            ``step()``; :meth:`with_advice` gives another door's); appended to ``message``.

    Attributes:
        what, advice: the two parts of the text.
    """

    def __init__(self, message: str, cause: Optional[OSError] = None, advice: str = ""):
        super().__init__(f"{message} {advice}" if advice else message)
        self.what, self.advice = message, advice
        if cause is not None:
            self.errno, self.strerror, self.filename = cause.errno, cause.strerror, cause.filename

    def with_advice(self, advice: str) -> "LedgerWriteError":
        """The same failure (text of what happened, ``errno``, ``strerror``, ``filename``) with ``advice`` instead
        of this one's: a door that does not hand the user ``step()`` (``dpopt.hf.DPTrainer``) says what to do
        with its own options. Raise it ``from`` this error (its cause, the failed write, stays in the chain)."""
        other = LedgerWriteError(getattr(self, "what", str(self)), None, advice)
        other.errno, other.strerror, other.filename = self.errno, self.strerror, self.filename
        return other

    def __str__(self) -> str:
        return str(self.args[0])


class RunWriteError(OSError):
    """A run that had charged releases stopped on a failed write (disk full, ...): the write's ``OSError``
    and the run directory it left.

    Raised by :func:`dpopt.training.train` and :func:`dpopt.training.resume` from the failed write (its
    ``__cause__``), so a front end can say how that directory goes on
    (:func:`dpopt.accounting.run_continuation.continuation`). An ``OSError`` subclass with the failed
    write's ``errno``, ``strerror`` and ``filename``, so ``except OSError`` keeps working; its text is the
    failed write's (a :class:`LedgerWriteError` keeps its explanation: ``cause``).

    Args:
        cause: the failed write's ``OSError``.
        run_dir: the run directory (it holds the journal of the releases charged before the failure).
    """

    def __init__(self, cause: OSError, run_dir: object):
        super().__init__(cause.errno, cause.strerror or str(cause), cause.filename)
        self.cause, self.run_dir = cause, run_dir

    def __str__(self) -> str:
        return str(self.cause)

    def __reduce__(self):  # pickles with its cause and run directory (OSError's own reduce drops them)
        write = {"errno": self.errno, "strerror": self.strerror, "filename": self.filename}
        return (RunWriteError, (self.cause, self.run_dir), write)  # the write's: a cause may not pickle them


def translate(exc: BaseException, names: Mapping[str, str]) -> str:
    """The message of ``exc`` with each named argument replaced by ``names[argument]``.

    Only the arguments a :class:`ConfigError` declares are replaced, as whole
    words that are not part of a path or file name (``runs/model/model.pt`` keeps
    its ``model``: a word next to ``/``, ``\\`` or a ``.`` + letter is left alone);
    other exceptions are returned as ``str(exc)``.
    """
    text = str(exc)
    for arg in getattr(exc, "arguments", ()):
        if arg in names:
            text = re.sub(rf"(?<![\w\-/\\.]){re.escape(arg)}(?![\w\-/\\]|\.\w)", names[arg], text)
    return text
