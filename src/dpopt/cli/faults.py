"""How commands meet faults of the machine: a disk that refuses a write, a console that went away, warnings.

* :func:`os_failure` — an ``OSError`` → one ``error:`` line and an exit code. A path the user chose
  that cannot be written or read (``EACCES``, ``EROFS``, ``EPERM``, ``ENOTDIR``, ``EISDIR``, ...) is
  bad input: exit :data:`~dpopt.cli.common.EXIT_USAGE` (2). A disk that failed a write (``ENOSPC``,
  ``EDQUOT``, ``EIO``, ``EFBIG``, anything else) is exit :data:`EXIT_DISK` (4): every file dpopt
  replaces is replaced atomically, so nothing written before is changed; free space and run the
  command again. ``dpopt train`` says how its run directory goes on instead: ``--resume RUN_DIR`` only
  when it holds a checkpoint of independent noise (:mod:`dpopt.accounting.run_continuation`).
* :class:`PipeSafe` — a console stream that ignores a closed reader (``dpopt train 2>&1 | head -1``):
  the first ``BrokenPipeError`` silences the stream and the command goes on writing its files
  (``dpopt train``). Other commands whose reader goes away stop quietly (click's exit 1, no traceback).
* :func:`clean_warnings` — Python warnings shown as one ``warning: ...`` line (no source line).

Nothing here imports torch or rich.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import warnings
from typing import Any, Callable, Iterator, Optional, TextIO, cast

__all__ = [
    "EXIT_DISK",
    "BAD_PATH_ERRNOS",
    "os_failure",
    "PipeSafe",
    "pipe_safe",
    "clean_warnings",
    "silence_closed_stdout",
]

#: Exit code when the disk refused a write (full, quota, I/O error): nothing written before is changed.
EXIT_DISK = 4
#: ``errno`` values that mean "this path cannot be used": bad input (exit 2).
BAD_PATH_ERRNOS = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENOENT,
        errno.EEXIST,
        errno.ENAMETOOLONG,
    }
)


def os_failure(exc: OSError, advice: Optional[str] = None) -> tuple[str, int]:
    """The ``error:`` line (without the prefix) and exit code for ``exc``.

    Args:
        exc: the error.
        advice: for a disk that refused a write, what to do next (default: free space and run the command
            again); ``dpopt train`` passes how its run directory goes on
            (:meth:`dpopt.accounting.run_continuation.Continuation.advice`).

    Returns:
        ``(message, code)``: code 2 for a path that cannot be used (:data:`BAD_PATH_ERRNOS`), else
        :data:`EXIT_DISK`. The message names the file and the system's reason.
    """
    where = f"{exc.filename}: " if exc.filename is not None else ""
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.errno in BAD_PATH_ERRNOS:
        return f"{where}{reason}; choose a path this user can write (or read)", 2
    return (
        f"{where}{reason}: the disk refused a write; files written before are unchanged (no partial file is "
        f"left). {advice or 'Free space and run the command again'}",
        EXIT_DISK,
    )


class PipeSafe:
    """A text stream that stops writing, without an error, once its reader has gone (``EPIPE``).

    Args:
        stream: the stream to write to (``sys.stdout``/``sys.stderr``; None when the process was
            started with it closed: every write is dropped).

    ``closed_reader`` is True after the first broken pipe; later writes are dropped. Other errors
    pass through. Usable as the ``file`` of a rich ``Console``.
    """

    def __init__(self, stream: Optional[TextIO]):
        self.stream = stream
        self.closed_reader = False

    def _guard(self, fn: Callable[[], Any]) -> Any:
        if self.closed_reader:
            return None
        if self.stream is None:  # started with the stream closed (`dpopt train >&-`)
            self.closed_reader = True
            return None
        try:
            return fn()
        except (BrokenPipeError, ConnectionResetError):
            self.closed_reader = True
        except ValueError:  # "I/O operation on closed file"
            self.closed_reader = True
        except OSError as exc:  # EPIPE raised as a plain OSError by some streams
            if exc.errno != errno.EPIPE:
                raise
            self.closed_reader = True
        return None

    def write(self, text: str) -> int:
        self._guard(lambda: self.stream.write(text))  # type: ignore[union-attr]  # None: dropped by _guard
        return len(text)

    def flush(self) -> None:
        self._guard(lambda: self.stream.flush())  # type: ignore[union-attr]  # None: dropped by _guard

    def isatty(self) -> bool:
        if self.closed_reader or self.stream is None:
            return False
        try:
            return bool(self.stream.isatty())
        except ValueError:  # closed
            return False

    def fileno(self) -> int:
        if self.stream is None:
            raise OSError(errno.EBADF, "the stream is closed")
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", None) or "utf-8"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def pipe_safe(stream: Optional[TextIO]) -> TextIO:
    """``stream`` wrapped in a :class:`PipeSafe` (typed as a text stream, e.g. for a rich ``Console``)."""
    return cast(TextIO, PipeSafe(stream))


def silence_closed_stdout() -> None:
    """At exit: if stdout's reader has gone, point stdout at ``/dev/null`` so the interpreter's last flush
    does not print ``Exception ignored ... BrokenPipeError`` (the recipe of Python's ``signal`` docs)."""
    if sys.stdout is None:  # started with stdout closed: nothing to flush
        return
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass


@contextlib.contextmanager
def clean_warnings(echo: Callable[[str], Any]) -> Iterator[None]:
    """Show each Python warning raised inside as one line ``warning: MESSAGE`` through ``echo``.

    Python's default shows the file, line number and source line of the code that warned, which reads
    as a crash to a user of the command line. Filters set inside still apply. Restored on exit.
    """
    with warnings.catch_warnings():

        def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001
            echo("warning: " + " ".join(str(message).split()))

        warnings.showwarning = show
        yield
