"""The pieces the fault suite relies on, alone: atomic writes, whole-line appends, exit codes of OS errors,
the pipe-safe console stream and one-line warnings."""

from __future__ import annotations

import errno
import io
import pickle
import warnings

import pytest
from inject import full_disk

from dpopt.accounting.ledger import JOURNAL_NAME, PrivacyLedger
from dpopt.accounting.run_continuation import continuation
from dpopt.atomic import append_whole, atomic_write_text, check_writable_dir, remove_stale
from dpopt.cli.faults import EXIT_DISK, PipeSafe, clean_warnings, os_failure
from dpopt.errors import LedgerWriteError, RunWriteError


def test_atomic_write_on_a_full_disk_keeps_the_old_file_and_no_tmp(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    atomic_write_text(path, "old\n")
    with monkeypatch.context() as m:
        full_disk(m, "summary.json", budget=2)
        with pytest.raises(OSError) as info:
            atomic_write_text(path, "new and longer\n")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_append_whole_cuts_a_failed_append_back(tmp_path, monkeypatch):
    path = tmp_path / "ledger.jsonl"
    append_whole(path, b'{"a": 1}\n')
    with monkeypatch.context() as m:
        full_disk(m, "ledger.jsonl", budget=3)  # 3 bytes of the line reach the disk, then ENOSPC
        with pytest.raises(OSError, match="No space left"):
            append_whole(path, b'{"b": 2}\n')
    assert path.read_bytes() == b'{"a": 1}\n'  # no torn line for the next append to bury


def test_remove_stale_and_check_writable_dir(tmp_path):
    (tmp_path / "checkpoint.pt.tmp").write_bytes(b"torn")
    assert [p.name for p in remove_stale(tmp_path, ["checkpoint.pt", "model.pt"])] == ["checkpoint.pt.tmp"]
    assert check_writable_dir(tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        check_writable_dir(tmp_path / "file")


@pytest.mark.parametrize(
    "code, expected",
    [(errno.ENOSPC, EXIT_DISK), (errno.EDQUOT, EXIT_DISK), (errno.EIO, EXIT_DISK), (errno.EROFS, 2), (errno.EACCES, 2)],
)
def test_os_failure_exit_codes(code, expected):
    message, exit_code = os_failure(OSError(code, "reason", "/x/y"))
    assert exit_code == expected and message.startswith("/x/y: reason")


def test_os_failure_says_the_advice_it_is_given_instead_of_running_again():
    message, code = os_failure(OSError(errno.ENOSPC, "No space left", "/r/x"), "Free space, then do X")
    assert code == EXIT_DISK and message.endswith("(no partial file is left). Free space, then do X")
    assert os_failure(OSError(errno.ENOSPC, "No space left"))[0].endswith("Free space and run the command again")


def _journal(run, entries: int) -> None:
    from dp_accounting import dp_event

    ledger = PrivacyLedger()
    ledger.open_journal(run / JOURNAL_NAME)
    for step in range(entries):
        ledger.record(step, dp_event.GaussianDpEvent(1.0))
    ledger.flush()


def test_continuation_reads_checkpoint_mechanism_and_charged_releases(tmp_path):
    """The four cases of a stopped run directory, and only the first offers --resume."""
    run = tmp_path / "run"
    run.mkdir()
    assert continuation(run).releases == 0 and "run the command again" in continuation(run).advice(True)
    _journal(run, 3)
    (run / "config.json").write_text('{"noise_mechanism": "independent"}')
    none_yet = continuation(run)
    assert (none_yet.releases, none_yet.resumable) == (3, False) and "no checkpoint" in none_yet.reason
    assert "3 charged release(s)" in none_yet.advice() and "--resume" not in none_yet.advice()
    (run / "checkpoint.pt").write_bytes(b"x")
    assert continuation(run).resumable and f"dpopt train --resume {run}" in continuation(run).advice()
    (run / "config.json").write_text('{"noise_mechanism": "banded:4"}')
    banded = continuation(run)
    assert not banded.resumable and "correlated-noise run (banded:4)" in banded.advice()
    (run / JOURNAL_NAME).write_text("not a journal\n")
    assert continuation(run).releases is None and "holds charged releases" in continuation(run).advice()


def test_run_write_error_keeps_the_write_and_its_run_directory():
    cause = LedgerWriteError("release 3 failed: Nothing was released", OSError(errno.ENOSPC, "No space", "/r/j"))
    err = RunWriteError(cause, "/r")
    assert isinstance(err, OSError) and (err.errno, err.filename, err.run_dir) == (errno.ENOSPC, "/r/j", "/r")
    assert str(err) == str(cause)
    again = pickle.loads(pickle.dumps(err))
    assert (again.errno, again.run_dir, str(again)) == (errno.ENOSPC, "/r", str(cause))


def test_ledger_write_error_takes_another_doors_advice():
    """The Privatizer's advice is for a loop that calls step(); DPTrainer swaps it (with_advice) for its own."""
    err = LedgerWriteError("release 3 failed. Nothing was released.", OSError(errno.ENOSPC, "No space", "/r/j"), "x")
    assert str(err) == "release 3 failed. Nothing was released. x" and err.advice == "x"
    other = err.with_advice("resume from output_dir")
    assert str(other) == "release 3 failed. Nothing was released. resume from output_dir"
    assert isinstance(other, LedgerWriteError) and (other.errno, other.strerror, other.filename) == (
        errno.ENOSPC,
        "No space",
        "/r/j",
    )


class _Closed(io.StringIO):
    def write(self, text):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def test_pipe_safe_drops_writes_once_the_reader_is_gone():
    stream = PipeSafe(_Closed())
    assert stream.write("line\n") == 5 and stream.closed_reader
    stream.write("more\n")
    stream.flush()
    none = PipeSafe(None)  # started with the stream closed
    assert none.write("x") == 1 and not none.isatty()


def test_clean_warnings_prints_one_line_without_the_source():
    lines: list = []
    with clean_warnings(lines.append):
        warnings.warn("the ledger journal holds 4 releases\nafter this checkpoint", UserWarning, stacklevel=1)
    assert lines == ["warning: the ledger journal holds 4 releases after this checkpoint"]
