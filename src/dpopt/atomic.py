"""Atomic file writes: a reader, a killed process or a full disk leaves the old file or the new one, never a torn one.

Every file dpopt replaces (checkpoints, ``model.pt``, JSON, check texts, reports, plots) is written by
:func:`atomic_write`: into ``NAME.tmp`` beside it, flushed and ``fsync``-ed, then renamed over
``NAME`` (``os.replace``: atomic on POSIX and Windows). When the write fails (``ENOSPC``, a
read-only directory, an exception of the writer), the temporary file is removed and ``NAME`` is
unchanged; the error is re-raised as an ``OSError`` that names ``NAME`` (the write of a file
handle raises one without a file name, and ``torch.save(obj, fh)`` turns it into a
``RuntimeError`` whose context is the ``OSError``: that one is raised). A process killed between the
write and the rename leaves ``NAME.tmp``, which the next write of ``NAME`` replaces
(:func:`remove_stale` clears them when a run is resumed).

Nothing here imports torch or matplotlib.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

__all__ = [
    "TMP_SUFFIX",
    "atomic_write",
    "atomic_write_text",
    "atomic_savefig",
    "append_whole",
    "check_writable_dir",
    "remove_stale",
]

#: Suffix of the temporary file beside its target.
TMP_SUFFIX = ".tmp"


def _named(exc: OSError, path: Path) -> OSError:
    """``exc`` with ``path`` as its file name when it has none (a write through a file handle)."""
    if exc.filename is None and exc.errno is not None:
        return type(exc)(exc.errno, exc.strerror, str(path))
    return exc


def atomic_write(path: Union[str, os.PathLike], write: Callable[[Any], Any], binary: bool = False) -> Path:
    """Write a file atomically: ``write(fh)`` into ``path.tmp``, fsync, rename over ``path``.

    Args:
        path: the file to (re)place.
        write: called once with the open temporary file (text mode unless ``binary``).
        binary: open the temporary file in binary mode.

    Returns:
        ``path``.

    Raises:
        OSError: the write, flush or rename failed (naming ``path``); the temporary file is removed
            and ``path`` is unchanged. Any exception of ``write`` likewise removes the temporary file.
    """
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb" if binary else "w") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        _discard(tmp)
        raise _named(exc, path) from None
    except BaseException as exc:
        _discard(tmp)
        cause = _os_error_in(exc)
        if cause is not None:  # torch.save's writer turns the file's OSError into a RuntimeError
            raise _named(cause, path) from None
        raise
    return path


def _os_error_in(exc: BaseException) -> Optional[OSError]:
    """The ``OSError`` that ``exc`` was raised while handling (its cause or context chain), or None."""
    seen = set()
    link: Optional[BaseException] = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError):
            return link
        link = link.__cause__ or link.__context__
    return None


def atomic_write_text(path: Union[str, os.PathLike], text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (:func:`atomic_write`, UTF-8)."""
    return atomic_write(path, lambda fh: fh.write(text.encode(encoding)), binary=True)


def atomic_savefig(fig: Any, path: Union[str, os.PathLike], **savefig_kwargs: Any) -> Path:
    """``fig.savefig(path)`` atomically (:func:`atomic_write`): a full disk never leaves a truncated image.

    The format is taken from ``path``'s suffix unless ``format=`` is given (matplotlib cannot see the
    name of the temporary file it writes into).
    """
    path = Path(path)
    savefig_kwargs.setdefault("format", path.suffix.lstrip(".") or "png")
    return atomic_write(path, lambda fh: fig.savefig(fh, **savefig_kwargs), binary=True)


def remove_stale(directory: Union[str, os.PathLike], names: Iterable[str]) -> list[Path]:
    """Remove ``NAME.tmp`` for each of ``names`` in ``directory`` (left by a process killed mid-write).

    Returns:
        The files removed.
    """
    removed = []
    for name in names:
        tmp = Path(directory) / (name + TMP_SUFFIX)
        if tmp.is_file():
            _discard(tmp)
            removed.append(tmp)
    return removed


def _discard(tmp: Path) -> None:
    try:
        tmp.unlink(missing_ok=True)
    except OSError:  # a read-only directory never held it; nothing else to do
        pass


def check_writable_dir(directory: Union[str, os.PathLike]) -> Path:
    """Make ``directory`` (with its parents) and prove a file can be created in it, before any work is done.

    A probe file (``.dpopt-probe-<pid>.tmp``) is created and removed at once. Commands call it before a
    long computation whose results go there, so that an unwritable output directory is refused at
    the start, not after the work.

    Returns:
        ``directory``.

    Raises:
        OSError: the directory cannot be made or written (naming it; e.g. ``PermissionError`` for
            a read-only directory, ``NotADirectoryError`` for a file).
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".dpopt-probe-{os.getpid()}{TMP_SUFFIX}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, str(path)) from None
    os.close(fd)
    _discard(probe)
    return path


def append_whole(path: Union[str, os.PathLike], data: bytes, sync: bool = True) -> None:
    """Append ``data`` to ``path`` (unbuffered), ``fsync`` if ``sync``; on failure cut the file back.

    For append-only line files (the ledger journal, ``metrics.jsonl``): a write the disk refuses
    half-way (``ENOSPC``) would leave a torn line that later appends bury in the middle of the file;
    the file is cut back to its size before the call instead (best effort: a torn LAST line is
    dropped on reading anyway).

    Raises:
        OSError: the write or ``fsync`` failed (naming ``path``).
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        except BaseException as exc:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
                raise type(exc)(exc.errno, exc.strerror, str(path)) from None
            raise
    finally:
        os.close(fd)
