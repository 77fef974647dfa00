"""Fault hooks for the fault-injection suite: a full disk at one write site, a SIGKILL at one point.

Used in-process (:class:`FullDisk`, with pytest's ``monkeypatch``) and as a script that runs the
``dpopt`` command line with a kill armed (``python tests/faults/inject.py SPEC -- ARGS...``; SPEC as
:func:`arm_kill`). Nothing here is part of dpopt: the hooks patch ``builtins.open``, ``os.write``
and ``PrivacyLedger.record`` from the outside, as a disk or the OS would fail them.
"""

from __future__ import annotations

import builtins
import errno
import os
import signal
import sys
from pathlib import Path


def _target(name: str) -> str:
    """``checkpoint.pt`` for ``checkpoint.pt``, ``checkpoint.pt.tmp`` (the atomic write's temporary file)."""
    return name[: -len(".tmp")] if name.endswith(".tmp") else name


def _fd_name(fd: int) -> str:
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}")).name
    except OSError:
        return ""


class _Writer:
    """A file object whose writes go through ``fault(n_bytes) -> n_allowed`` (it raises or kills past the limit)."""

    def __init__(self, fh, fault):
        self._fh, self._fault = fh, fault

    def write(self, data):
        allowed = self._fault(len(data))
        if allowed < len(data):
            self._fh.write(data[:allowed])
            self._fh.flush()
            self._fault.fail()
        return self._fh.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()

    def __getattr__(self, name):
        return getattr(self._fh, name)


class _Budget:
    """Lets ``skip`` writes (opens) of the target through whole, then ``budget`` bytes of the next, then fails."""

    def __init__(self, name: str, skip: int, budget: int, fail):
        self.name, self.skip, self.budget, self.fail = name, skip, budget, fail
        self.opened = 0

    def __call__(self, n: int) -> int:
        if self.opened <= self.skip:
            return n
        allowed = max(0, min(n, self.budget))
        self.budget -= allowed
        return allowed


def _enospc(name: str):
    def fail():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return fail


def _install(patch, budget: _Budget) -> None:
    """Route writes of ``budget.name`` (and its ``.tmp``) through ``budget``: ``open`` in w/a modes, ``os.write``."""
    real_open, real_write = builtins.open, os.write

    def fake_open(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        if (
            isinstance(file, (str, os.PathLike))
            and any(c in mode for c in "wax")
            and _target(Path(file).name) == budget.name
        ):
            budget.opened += 1
            return _Writer(fh, budget)
        return fh

    opened_fds: set = set()
    real_os_open = os.open

    def fake_os_open(path, flags, *args, **kwargs):
        fd = real_os_open(path, flags, *args, **kwargs)
        if flags & (os.O_WRONLY | os.O_RDWR) and _target(Path(path).name) == budget.name:
            budget.opened += 1
            opened_fds.add(fd)
        else:
            opened_fds.discard(fd)
        return fd

    def fake_write(fd, data):
        if fd in opened_fds and _target(_fd_name(fd)) == budget.name:
            allowed = budget(len(data))
            if allowed < len(data):
                if allowed:
                    real_write(fd, bytes(data[:allowed]))
                budget.fail()
        return real_write(fd, data)

    patch(builtins, "open", fake_open)
    patch(os, "open", fake_os_open)
    patch(os, "write", fake_write)


def full_disk(monkeypatch, name: str, skip: int = 0, budget: int = 0) -> _Budget:
    """Make the disk full for ``name``: ``skip`` writes of it succeed, the next fails with ENOSPC after ``budget`` bytes."""
    b = _Budget(name, skip, budget, _enospc(name))
    _install(monkeypatch.setattr, b)
    return b


def _kill():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm_kill(spec: str) -> None:
    """Arm a SIGKILL: ``write:NAME:SKIP:BYTES`` (inside the write of NAME after SKIP whole writes and BYTES
    bytes of the next) or ``release:N`` (right after the N-th release is recorded, before anything else)."""
    kind, _, rest = spec.partition(":")
    if kind == "write":
        name, skip, nbytes = rest.split(":")
        _install(lambda obj, attr, value: setattr(obj, attr, value), _Budget(name, int(skip), int(nbytes), _kill))
    elif kind == "release":
        from dpopt.accounting.ledger import PrivacyLedger

        limit, record = int(rest), PrivacyLedger.record

        def killing_record(self, *args, **kwargs):
            entry = record(self, *args, **kwargs)
            if len(self) >= limit:
                _kill()
            return entry

        PrivacyLedger.record = killing_record  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown kill spec {spec!r}")


if __name__ == "__main__":
    spec, sep, *args = sys.argv[1:]
    assert sep == "--", "usage: inject.py SPEC -- dpopt arguments"
    arm_kill(spec)
    sys.argv = ["dpopt", *args]
    from dpopt.cli import main

    main()


def read_only(monkeypatch, directory: Path) -> None:
    """Make ``directory`` read-only: writes under it fail with ``EROFS`` (a read-only file system) through
    ``open``, ``os.open``, ``os.mkdir`` and ``os.replace`` (simulated: ``chmod`` does not bind root, who
    runs the tests in some CI containers)."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)

    def inside(path) -> bool:
        try:
            return Path(os.path.abspath(path)).resolve().is_relative_to(directory)
        except (TypeError, ValueError):
            return False

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    real_open, real_os_open, real_mkdir, real_replace = builtins.open, os.open, os.mkdir, os.replace

    def fake_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+") and inside(file):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and inside(path):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if inside(path) and not os.path.isdir(path):
            refuse(path)
        return real_mkdir(path, *args, **kwargs)

    def fake_replace(src, dst, *args, **kwargs):
        if inside(dst):
            refuse(dst)
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(os, "replace", fake_replace)
