"""PrivacyLedger: the append-only list of every noisy release of a run.

Only the :class:`~dpopt.privatizer.Privatizer` appends to a ledger (one entry
per logical step, containing the step's DpEvent and public metadata such as the
clip bound applied, the sensitivity and the noise std). Accountants read the
ledger as a whole (:func:`dpopt.accounting.accountant.epsilon`); the ledger
never computes ε itself.

JSON format (``version`` 2)::

    {"format": "dpopt-ledger", "version": 2, "run_id": "3f2a…",
     "neighbouring": "add_or_remove_one", "sampling": "poisson",
     "noise": "secret", "dataset_size": "public",
     "entries": [{"step": 0, "event": {...}, "meta": {...}}, ...]}

Header fields (DESIGN.md "Secret randomness", "Nothing private in any output"):

* ``run_id`` — 32 lowercase hex digits (``uuid.uuid4().hex``, OS entropy, no
  data in it) made when the ledger is created and kept through
  ``state_dict``/``load_state_dict``, the journal, ``save``/``load``: every
  copy of one run's ledger carries the same id, so two ledgers (or a journal
  and a checkpoint) can be told to belong to one run or to two. Files written
  before the id existed load with ``run_id = None`` ("unknown"; no id is
  invented for them).
* ``neighbouring`` — the neighbouring relation the ε is stated for.
* ``sampling`` — ``"poisson"`` (what the accountants assume) or another scheme.
* ``noise`` — how the Privatizer's noise and Poisson masks were seeded, one of
  :data:`NOISE_MODES`: ``"secret"`` (OS entropy, never written anywhere),
  ``"secure"`` (a cryptographically secure generator) or ``"reproducible"``
  (seeded from a published seed: a research mode whose ε does not hold against
  anyone who knows the seed; ``dpopt check`` fails it).
* ``dataset_size`` — ``"public"``: the dataset size N is treated as public
  (the sample rate q = B̄/N and the run files may reveal it); ``"unused"``: the
  sample rate was given explicitly and nothing recorded is derived from N.
* ``privacy_unit`` (optional, written only when set) — what one protected unit
  is when it is not one example, e.g. ``"block of 16 tokens"`` (packed texts;
  DPTrainer). Absent: one example.
* ``num_users`` (optional, written only when set) — user-level DP (``privacy_unit``
  ``"user (at most k records each)"``): N_users, the number of users, treated as public like N.
* ``delta`` (optional, written only when set) — the run's δ (public), so that
  ``dpopt ledger FILE`` scores at the run's δ without a summary beside it.
* ``mechanism`` (optional, written only for correlated noise) — the noise
  mechanism's public record (:meth:`dpopt.correlated_noise.CorrelatedNoise.record`:
  kind, strategy coefficients, horizon, participations, min separation, σ,
  sensitivity, ``amplification``, ``resume``); each entry's event is then
  the release's share of the mechanism's one Gaussian, re-derived from this
  record alone by ``dpopt check`` (:func:`dpopt.correlated_noise.check_record`).
  Readers that do not know these keys ignore them (the version stays 2).

Journal (``ledger.jsonl``, JSON lines, :data:`JOURNAL_VERSION` 1), written while a run goes
(:meth:`PrivacyLedger.open_journal`, :meth:`PrivacyLedger.flush`)::

    {"format": "dpopt-ledger-journal", "version": 1, "entry_version": 2, "run_id": ..., "neighbouring": ...,
     "sampling": ..., "noise": ..., "dataset_size": ...}
    {"step": 0, "event": {...}, "meta": {...}}
    ...

A header line comes first and again whenever a header field changes (the
last one holds; ``noise = "reproducible"`` anywhere makes the whole journal
reproducible); every other line is one entry in the version-2 entry format.
Appending costs O(new entries) per flush, where rewriting ``ledger.json``
would cost O(all entries) — quadratic over a long run flushed every few
steps; each flush is followed by ``fsync``, so an entry is on disk before any
file that depends on it is written. A torn last line (a process killed while
flushing; nothing depending on that entry was written yet) is dropped on
reading. :meth:`PrivacyLedger.load` of a run directory reads the journal when
there is one (it is never shorter than ``ledger.json``, which is written
when a run stops); the journal is also a valid argument itself.

Run-length form (``version`` 3; :meth:`PrivacyLedger.state_dict`, what every
checkpoint holds). In memory, and in every checkpoint, identical consecutive
releases are ONE group: a release joins the last group when its event and
metadata equal the group's and its step is the next one. A group is written as::

    {"step": 0, "count": 10000, "event": {...}, "meta": {...}}

(the releases at steps ``step`` … ``step + count - 1``), and the state is the
header fields plus ``"groups": [...]`` in place of ``"entries"``. A training
run at fixed σ, q and C is one group whatever its length, so a checkpoint
costs O(groups), not O(steps). ``ledger.json`` (:meth:`PrivacyLedger.to_dict`,
:meth:`PrivacyLedger.save`) stays version 2, one entry per release, and the
journal stays one line per release: they are the record. :meth:`from_dict`
reads versions 1, 2 and 3, so checkpoints written before the run-length form
(per-release lists) still load.

Version-1 files (written before the noise source was recorded, when noise was
always seeded from the published seed) load with ``noise = "unknown"`` and
``dataset_size = "public"``; ``dpopt check`` treats ``"unknown"`` as
reproducible.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from dp_accounting import dp_event

from ..atomic import append_whole, atomic_write
from .events import NEIGHBOURING, event_from_dict, event_to_dict

__all__ = [
    "LedgerEntry",
    "LedgerGroup",
    "PrivacyLedger",
    "EventLike",
    "LEDGER_VERSION",
    "NOISE_MODES",
    "DATASET_SIZE_MODES",
    "JOURNAL_VERSION",
    "JOURNAL_NAME",
    "JournalDamaged",
    "new_run_id",
    "longest_record",
    "run_ledger_file",
]

LEDGER_VERSION = 2
#: Version of the run-length form (:meth:`PrivacyLedger.state_dict`: checkpoints).
GROUPED_VERSION = 3
#: Version of the JSON-lines journal format (its entries are in the LEDGER_VERSION entry format).
JOURNAL_VERSION = 1
#: File name of the journal in a run directory (beside ``ledger.json``).
JOURNAL_NAME = "ledger.jsonl"
#: Ledger versions :meth:`PrivacyLedger.from_dict` reads.
READABLE_VERSIONS = (1, 2, 3)
#: How the noise was seeded; "unknown" is reserved for version-1 files.
NOISE_MODES = ("secret", "secure", "reproducible")
#: Statements about the dataset size N.
DATASET_SIZE_MODES = ("public", "unused")
_RUN_ID = re.compile(r"[0-9a-f]{32}")


class JournalDamaged(ValueError):
    """A line of a ledger journal before its last cannot be read (not JSON, or not an entry).

    Attributes:
        path: the journal; line: the 1-based number of the first damaged line.

    :func:`dpopt.accounting.journal_repair.repair_journal` rewrites such a journal from its readable
    lines, charging every release a damaged line may have held.
    """

    def __init__(self, path: Union[str, Path], line: int):
        self.path, self.line = Path(path), int(line)
        super().__init__(
            f"{path}, line {line}: not a readable ledger entry (a damaged ledger journal). The readable lines can "
            "be kept and every release a damaged line may have held charged: resume with repair_journal=True "
            "(dpopt train --resume RUN_DIR --repair-journal)"
        )


def new_run_id() -> str:
    """A fresh run id: ``uuid.uuid4().hex`` (32 lowercase hex digits from OS entropy; no data in it)."""
    return uuid.uuid4().hex


def _checked_run_id(run_id: Any) -> Optional[str]:
    """``run_id`` if it is None or 32 lowercase hex digits, else ValueError saying what is expected."""
    if run_id is None or (isinstance(run_id, str) and _RUN_ID.fullmatch(run_id)):
        return run_id
    raise ValueError(f"run_id must be 32 lowercase hex digits (uuid.uuid4().hex) or None, got {run_id!r}")


def _public(value: Any) -> Any:
    """Coerce metadata to JSON-ready Python types (floats, ints, lists, str)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, (list, tuple)):
        return [_public(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _public(v) for k, v in value.items()}
    return float(value)


@dataclass(frozen=True)
class LedgerEntry:
    """One release: the logical step, its DpEvent and public metadata."""

    step: int
    event: dp_event.DpEvent
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"step": int(self.step), "event": event_to_dict(self.event), "meta": _public(self.meta)}


@dataclass(frozen=True)
class LedgerGroup:
    """``count`` identical consecutive releases: steps ``step`` … ``step + count - 1``, one event, one metadata.

    A read-only view of one run-length group of a :class:`PrivacyLedger`
    (:attr:`PrivacyLedger.groups`); every release in it is the
    :class:`LedgerEntry` ``(step + i, event, meta)``, ``0 ≤ i < count``.
    """

    step: int
    count: int
    event: dp_event.DpEvent
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """``{"step", "count", "event", "meta"}``: the version-3 (run-length) group format."""
        return {
            "step": int(self.step),
            "count": int(self.count),
            "event": event_to_dict(self.event),
            "meta": _public(self.meta),
        }


class _Group:
    """A mutable run-length group (the ledger's own storage; the last one grows as releases are recorded)."""

    __slots__ = ("step", "count", "event", "meta")

    def __init__(self, step: int, count: int, event: dp_event.DpEvent, meta: dict):
        self.step, self.count, self.event, self.meta = step, count, event, meta

    def takes(self, step: int, event: dp_event.DpEvent, meta: dict) -> bool:
        """Does the release ``(step, event, meta)`` continue this group?"""
        return step == self.step + self.count and (event is self.event or event == self.event) and meta == self.meta

    def entry(self, i: int) -> LedgerEntry:
        return LedgerEntry(self.step + i, self.event, self.meta)

    def frozen(self) -> LedgerGroup:
        return LedgerGroup(self.step, self.count, self.event, self.meta)

    def same(self, other: "_Group") -> bool:
        return (self.step, self.count, self.meta) == (other.step, other.count, other.meta) and self.event == other.event


class PrivacyLedger:
    """Append-only record of releases, saved as versioned JSON.

    Args:
        neighbouring: ``"add_or_remove_one"`` (default; what dp_accounting's
            Poisson-sampling analysis assumes) or ``"replace_one"``.
        sampling: ``"poisson"`` (default) or another scheme, recorded as is.
        noise: how the noise is seeded, one of :data:`NOISE_MODES` (default
            ``"secret"``); the Privatizer records its actual mode with
            :meth:`mark_noise`.
        dataset_size: the statement about N, ``"public"`` (q = B̄/N) or
            ``"unused"`` (q given explicitly; nothing recorded depends on N).
        run_id: this run's id (32 lowercase hex digits); default a fresh
            :func:`new_run_id`. Public attribute ``run_id``; ``None`` only for
            a ledger read from a file written before run ids existed.

    Raises:
        ValueError: on an unknown neighbouring relation, noise mode,
            dataset_size statement, or a malformed run_id.
    """

    def __init__(
        self,
        neighbouring: str = "add_or_remove_one",
        sampling: str = "poisson",
        noise: str = "secret",
        dataset_size: str = "public",
        run_id: Optional[str] = None,
    ):
        if neighbouring not in NEIGHBOURING:
            raise ValueError(f"neighbouring must be one of {NEIGHBOURING}, got {neighbouring!r}")
        if noise not in NOISE_MODES:
            raise ValueError(f"noise must be one of {NOISE_MODES}, got {noise!r}")
        if dataset_size not in DATASET_SIZE_MODES:
            raise ValueError(f"dataset_size must be one of {DATASET_SIZE_MODES}, got {dataset_size!r}")
        self.neighbouring = neighbouring
        self.sampling = sampling
        self.privacy_unit: Optional[str] = None  # e.g. "block of 16 tokens" (packed texts); None: one example
        self.delta: Optional[float] = None  # the run's delta (public), read by `dpopt ledger`; None: not recorded
        self.num_users: Optional[int] = None  # user-level DP: N_users (public, like N); None: not user-level
        # correlated noise (DP matrix factorization): the mechanism's public record (dpopt.correlated_noise)
        self.mechanism: Optional[dict] = None
        self.noise = noise
        self.dataset_size = dataset_size
        self.run_id: Optional[str] = new_run_id() if run_id is None else _checked_run_id(run_id)
        self._groups: list[_Group] = []  # run-length groups of identical consecutive releases
        self._starts: list[int] = []  # index (release number) of each group's first release
        self._n = 0  # releases recorded
        self._journal: Optional[Path] = None
        self._flushed = 0  # entries already in the journal
        self._journal_header: Optional[dict] = None  # the header last written to the journal
        self._autoflush = False  # flush the journal at every record()
        self._unsynced = False  # lines written to the journal without fsync

    def mark_noise(self, mode: str) -> str:
        """Record how the Privatizer's noise (and Poisson masks) are seeded.

        A ledger that ever had reproducible noise stays ``"reproducible"``
        (later secret noise does not undo a release that can be replayed), and
        one loaded as ``"unknown"`` (version 1) stays ``"unknown"`` unless
        marked reproducible. Otherwise the mode is set to ``mode``.

        Args:
            mode: one of :data:`NOISE_MODES`.

        Returns:
            The ledger's noise mode after the call.

        Raises:
            ValueError: on an unknown mode.
        """
        if mode not in NOISE_MODES:
            raise ValueError(f"noise mode must be one of {NOISE_MODES}, got {mode!r}")
        if mode == "reproducible" or self.noise not in ("reproducible", "unknown"):
            self.noise = mode
        return self.noise

    # -- writing ---------------------------------------------------------
    def record(self, step: int, event: dp_event.DpEvent, **meta: Any) -> LedgerEntry:
        """Append one release (called by the Privatizer only); O(1): it joins the last group when identical.

        With an autoflushed journal (:meth:`open_journal`) the entry is appended to the journal here, and
        the record is all or nothing: when that write fails the entry is taken out of memory again, so the
        ledger holds exactly what the journal holds (the Privatizer then releases nothing,
        :meth:`dpopt.privatizer.Privatizer.release`).

        Raises:
            OSError: the journal write failed (the ledger is as before the call).
        """
        entry = LedgerEntry(int(step), event, _public(meta))
        groups = len(self._groups)
        self._append(entry.step, entry.event, entry.meta, 1)
        if self._autoflush:
            try:
                self.flush(sync=False)
            except BaseException:
                self._drop_last(groups)
                raise
        return entry

    def _withdraw_last(self) -> bool:
        """Take back the last release's entry if it is in memory only (no journal, or not yet written to it).

        Private: only the Privatizer, which knows the release was not made, may call it (the ledger cannot
        tell a made release from one that was not; a public call could drop a charged entry). For a release
        that was never made: a data-parallel step whose entry another rank could not write
        (:meth:`dpopt.privatizer.Privatizer.release`: every rank then releases nothing). An entry already in
        the journal is never taken back (the ledger over-counts, never under-counts).

        Returns:
            True if the entry was taken back; False (the ledger unchanged) when there is none or it is written.
        """
        if self._n == 0 or (self._journal is not None and self._flushed >= self._n):
            return False
        self._drop_last(len(self._groups) - 1 if self._groups[-1].count == 1 else len(self._groups))
        return True

    def _drop_last(self, groups: int) -> None:
        """Undo the :meth:`_append` of ONE release made when the ledger had ``groups`` groups."""
        if len(self._groups) > groups:
            self._groups.pop()
            self._starts.pop()
        else:
            self._groups[-1].count -= 1
        self._n -= 1

    def _append(self, step: int, event: dp_event.DpEvent, meta: dict, count: int) -> None:
        """Add ``count`` releases ``(step + i, event, meta)``, merged into the last group when they continue it."""
        if count <= 0:
            return
        last = self._groups[-1] if self._groups else None
        if last is not None and last.takes(step, event, meta):
            last.count += count
        else:
            self._starts.append(self._n)
            self._groups.append(_Group(step, count, event, meta))
        self._n += count

    def _set_groups(self, groups: Any) -> None:
        """Replace every release by ``groups`` (LedgerGroup / _Group-like: step, count, event, meta), copied."""
        self._groups, self._starts, self._n = [], [], 0
        for g in groups:
            self._append(int(g.step), g.event, g.meta, int(g.count))

    # -- reading ---------------------------------------------------------
    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        """Every release as a :class:`LedgerEntry`, in order: a NEW tuple, O(releases) — never on a hot path.

        Use :attr:`last_entry`, ``len(ledger)``, ``iter(ledger)``, :meth:`entries_since` or
        :attr:`groups` there.
        """
        return tuple(self)

    def __len__(self) -> int:
        """The number of releases recorded (O(1))."""
        return self._n

    def __iter__(self) -> Iterator[LedgerEntry]:
        """The releases in order, one :class:`LedgerEntry` at a time (no copy of the ledger)."""
        for g in self._groups:
            for i in range(g.count):
                yield g.entry(i)

    @property
    def last_entry(self) -> Optional[LedgerEntry]:
        """The last release recorded (O(1)), or None for an empty ledger."""
        if not self._groups:
            return None
        g = self._groups[-1]
        return g.entry(g.count - 1)

    @property
    def groups(self) -> tuple[LedgerGroup, ...]:
        """The run-length groups (:class:`LedgerGroup`), in order: O(groups), independent of the run's length."""
        return tuple(g.frozen() for g in self._groups)

    def entries_since(self, start: int) -> tuple[LedgerEntry, ...]:
        """The entries from index ``start`` on (O(new entries + log groups), unlike :attr:`entries`)."""
        start = max(int(start), 0)
        if start >= self._n:
            return ()
        k = bisect.bisect_right(self._starts, start) - 1
        out: list[LedgerEntry] = []
        offset = start - self._starts[k]
        for g in self._groups[k:]:
            out.extend(g.entry(i) for i in range(offset, g.count))
            offset = 0
        return tuple(out)

    def _groups_since(self, start: int) -> list[tuple[int, int, "_Group"]]:
        """``(first index in group, count, group)`` covering the releases from index ``start`` on: O(new groups)."""
        start = max(int(start), 0)
        if start >= self._n:
            return []
        k = bisect.bisect_right(self._starts, start) - 1
        out = [(start - self._starts[k], self._groups[k].count - (start - self._starts[k]), self._groups[k])]
        out.extend((0, g.count, g) for g in self._groups[k + 1 :])
        return out

    def extends(self, other: "PrivacyLedger") -> bool:
        """Does this ledger hold ``other``'s releases as its first ``len(other)`` entries (same run)?

        True when ``other`` is empty; False when both have run ids and they
        differ, when ``other`` is longer, or when an entry differs (step, event
        or metadata). O(len(other)).
        """
        if not len(other):
            return True
        if self.run_id is not None and other.run_id is not None and self.run_id != other.run_id:
            return False
        if len(other) > len(self):
            return False
        # both are in canonical run-length form (maximal groups): other is a prefix iff its groups are ours,
        # its last one possibly shorter. O(groups of other).
        k = len(other._groups)
        if k > len(self._groups):
            return False
        for mine, theirs in zip(self._groups[: k - 1], other._groups[: k - 1]):
            if not mine.same(theirs):
                return False
        mine, theirs = self._groups[k - 1], other._groups[k - 1]
        return (
            (mine.step, mine.meta) == (theirs.step, theirs.meta)
            and theirs.count <= mine.count
            and mine.event == theirs.event
        )

    def events(self) -> list[dp_event.DpEvent]:
        """Every release's DpEvent, in order (a list of O(releases) references)."""
        return [g.event for g in self._groups for _ in range(g.count)]

    def compacted(self) -> list[tuple[dp_event.DpEvent, int]]:
        """Runs of consecutive identical events as ``(event, count)`` pairs (O(groups))."""
        runs: list[tuple[dp_event.DpEvent, int]] = []
        for g in self._groups:
            if runs and (runs[-1][0] is g.event or runs[-1][0] == g.event):
                runs[-1] = (runs[-1][0], runs[-1][1] + g.count)
            else:
                runs.append((g.event, g.count))
        return runs

    def composed_event(self) -> dp_event.DpEvent:
        """The whole ledger as one DpEvent (compacted with SelfComposed runs)."""
        runs = self.compacted()
        if not runs:
            return dp_event.NoOpDpEvent()
        parts = [ev if n == 1 else dp_event.SelfComposedDpEvent(ev, int(n)) for ev, n in runs]
        return parts[0] if len(parts) == 1 else dp_event.ComposedDpEvent(parts)

    # -- journal (append while a run goes) --------------------------------
    def header(self) -> dict:
        """The header fields (run_id, neighbouring, sampling, noise, dataset_size)."""
        return {
            "run_id": self.run_id,
            "neighbouring": self.neighbouring,
            "sampling": self.sampling,
            "noise": self.noise,
            "dataset_size": self.dataset_size,
            **self._run_statements(),
        }

    def _run_statements(self) -> dict:
        """The optional header fields ``privacy_unit``, ``delta`` and ``mechanism`` (written only when set)."""
        out: dict[str, Any] = {}
        if self.privacy_unit is not None:
            out["privacy_unit"] = str(self.privacy_unit)
        if self.delta is not None:
            out["delta"] = float(self.delta)
        if self.num_users is not None:
            out["num_users"] = int(self.num_users)
        if self.mechanism is not None:
            out["mechanism"] = dict(self.mechanism)
        return out

    def _read_run_statements(self, raw: dict) -> None:
        unit, delta, mechanism = raw.get("privacy_unit"), raw.get("delta"), raw.get("mechanism")
        if mechanism is not None:
            if not isinstance(mechanism, dict):
                raise ValueError(f"the ledger's mechanism record must be an object, got {mechanism!r}")
            self.mechanism = dict(mechanism)
        if unit is not None:
            self.privacy_unit = str(unit)
        if delta is not None:
            self.delta = float(delta)
        if raw.get("num_users") is not None:
            self.num_users = int(raw["num_users"])

    def open_journal(
        self, path: str | Path, *, flushed: Optional[int] = None, rewrite: bool = False, autoflush: bool = False
    ) -> Path:
        """Append this ledger's entries to the JSON-lines journal at ``path`` from now on.

        Args:
            path: the journal file (``ledger.jsonl``); created if missing.
            flushed: how many of this ledger's entries the file already holds
                (default: 0 for a new file; ``len(self)`` for an existing one, as
                after :meth:`load_state_dict` from that journal).
            rewrite: write the whole ledger to ``path`` now, atomically (a
                resumed run: drops a torn last line before appending).
            autoflush: append at every :meth:`record`, so that each release is
                in the journal before its value is used (``PrivacyEngine``
                checkpoints: one small write per step, ``fsync``-ed at the
                next explicit :meth:`flush`, e.g. before a checkpoint is written).

        Otherwise nothing is written until :meth:`flush`.
        """
        path = Path(path)
        self._autoflush = bool(autoflush)
        path.parent.mkdir(parents=True, exist_ok=True)
        if rewrite:
            tmp = path.with_name(path.name + ".tmp")
            tmp.unlink(missing_ok=True)
            self._journal, self._flushed, self._journal_header = tmp, 0, None
            try:
                self.flush()
                os.replace(tmp, path)
            except BaseException:  # the old journal stays as it was; no temporary file is left
                self._journal, self._flushed = None, 0
                tmp.unlink(missing_ok=True)
                raise
            self._journal = path
            return path
        exists = path.exists() and path.stat().st_size > 0
        if flushed is None:
            flushed = self._n if exists else 0
        self._journal, self._flushed = path, int(flushed)
        self._journal_header = self.header() if exists else None
        return path

    def close_journal(self) -> None:
        """Stop writing to the journal (what it holds stays; entries recorded from now on are in memory only).

        For a journal that could not be started (its first :meth:`flush` failed): the ledger
        goes back to having none, so another path can be opened.
        """
        self._journal, self._flushed, self._journal_header, self._autoflush = None, 0, None, False

    def flush(self, sync: bool = True) -> int:
        """Append the entries recorded since the last flush to the journal and ``fsync`` it.

        Args:
            sync: ``fsync`` the file (also entries written earlier without it).
                ``False`` (autoflush) hands the lines to the OS only: they
                survive the process being killed, not the machine crashing.

        Returns:
            The number of entries written (0 without a journal or new entries).
        """
        if self._journal is None:
            return 0
        lines = []
        if self._journal_header != self.header():
            lines.append(
                json.dumps(
                    {
                        "format": "dpopt-ledger-journal",
                        "version": JOURNAL_VERSION,
                        "entry_version": LEDGER_VERSION,
                        **self.header(),
                    }
                )
            )
        new = self.entries_since(self._flushed)
        lines.extend(json.dumps(e.to_dict(), allow_nan=False) for e in new)
        if not lines and not (sync and self._unsynced):
            return 0
        append_whole(self._journal, ("\n".join(lines) + "\n").encode() if lines else b"", sync)
        self._unsynced = not sync
        self._journal_header = self.header()
        self._flushed = self._n
        return len(new)

    @property
    def unflushed(self) -> int:
        """Entries recorded but not yet in the journal."""
        return self._n - self._flushed if self._journal is not None else 0

    @classmethod
    def read_journal(cls, path: str | Path) -> "PrivacyLedger":
        """Read a JSON-lines journal (a torn last line is dropped with a warning).

        Raises:
            ValueError: not a dpopt journal, an unknown version, or a malformed line before the last.
        """
        path = Path(path)
        lines = path.read_text().split("\n")
        complete = lines[:-1]  # every complete line ends with a newline
        if lines[-1].strip():
            warnings.warn(
                f"{path}: dropped an incomplete last line (a flush cut short; nothing written "
                "after it depends on that entry)",
                UserWarning,
                stacklevel=2,
            )
        ledger: Optional[PrivacyLedger] = None
        reproducible = False
        for number, line in enumerate(complete, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError:
                raise JournalDamaged(path, number) from None
            if not isinstance(raw, dict):
                raise JournalDamaged(path, number)
            if "format" in raw:
                if raw.get("format") != "dpopt-ledger-journal" or raw.get("version") != JOURNAL_VERSION:
                    raise ValueError(f"{path}, line {number}: not a dpopt ledger journal of version {JOURNAL_VERSION}")
                if raw.get("noise") not in NOISE_MODES:
                    raise ValueError(f"{path}: ledger noise {raw.get('noise')!r} is not one of {NOISE_MODES}")
                reproducible |= raw["noise"] == "reproducible"
                groups = ledger._groups if ledger is not None else []
                ledger = cls(raw["neighbouring"], raw["sampling"], raw["noise"], raw["dataset_size"])
                ledger.run_id = _checked_run_id(raw.get("run_id"))  # None: a journal from before run ids
                ledger._read_run_statements(raw)
                ledger._set_groups(groups)
            elif ledger is None:
                raise ValueError(f"{path}: the ledger journal does not start with its header")
            else:
                try:
                    ledger._append_raw(raw, 1)
                except (KeyError, TypeError, ValueError):
                    raise JournalDamaged(path, number) from None
        if ledger is None:
            raise ValueError(f"{path}: an empty ledger journal")
        if reproducible:
            ledger.noise = "reproducible"
        return ledger

    # -- state (checkpoints) ---------------------------------------------
    def state_dict(self) -> dict:
        """The whole ledger as plain data in the run-length form (version 3; module docstring): O(groups).

        What every checkpoint holds. :meth:`from_dict` / :meth:`load_state_dict` read it (and the
        per-release versions 1-2 of older checkpoints).
        """
        return {
            "format": "dpopt-ledger",
            "version": GROUPED_VERSION,
            **self.header(),
            "groups": [g.frozen().to_dict() for g in self._groups],
        }

    def load_state_dict(self, state: Union[dict, "PrivacyLedger"]) -> None:
        """Replace this ledger's header and entries, in place, with ``state`` (a :meth:`to_dict` dict).

        The noise mode follows :meth:`mark_noise` (a reproducible ledger stays reproducible).
        The run id becomes the state's (the loaded run continues); a state from
        before run ids (``run_id`` None) keeps this ledger's id.
        """
        other = state if isinstance(state, PrivacyLedger) else PrivacyLedger.from_dict(state)
        noise = self.noise
        if other.run_id is not None:
            self.run_id = other.run_id
        self.neighbouring, self.sampling, self.dataset_size = other.neighbouring, other.sampling, other.dataset_size
        self.noise = other.noise
        self._read_run_statements(other._run_statements())
        self._set_groups(other._groups)  # copied: this ledger's last group grows in place
        if noise in NOISE_MODES:
            self.mark_noise(noise)
        self._flushed = min(self._flushed, self._n)

    # -- persistence -----------------------------------------------------
    def to_dict(self) -> dict:
        """The ledger as version-2 JSON data: one entry per release (``ledger.json``; O(releases))."""
        return {
            "format": "dpopt-ledger",
            "version": LEDGER_VERSION,
            "run_id": self.run_id,
            "neighbouring": self.neighbouring,
            "sampling": self.sampling,
            "noise": self.noise,
            "dataset_size": self.dataset_size,
            **self._run_statements(),
            "entries": [e.to_dict() for e in self],
        }

    def save(self, path: str | Path, compact: bool = False) -> Path:
        """Write the ledger as JSON, atomically (a temporary file renamed over ``path``, fsync-ed).

        Args:
            path: the file.
            compact: write the run-length form (:meth:`state_dict`, version 3: O(groups), for
                checkpoints) instead of one entry per release (version 2, the default).
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.state_dict() if compact else self.to_dict(), allow_nan=False)
        return atomic_write(path, lambda fh: fh.write(text))

    @classmethod
    def from_dict(cls, data: dict) -> "PrivacyLedger":
        """Read a ledger from its JSON dict (versions 1, 2 and the run-length 3; see the module docstring).

        Raises:
            ValueError: not a dpopt ledger, an unknown version, or invalid header values.
        """
        if data.get("format") != "dpopt-ledger":
            raise ValueError("not a dpopt ledger (missing 'format': 'dpopt-ledger')")
        try:
            version = int(data.get("version", -1))
        except (TypeError, ValueError):
            version = -1
        if version not in READABLE_VERSIONS:
            raise ValueError(f"unsupported ledger version {data.get('version')!r}; expected one of {READABLE_VERSIONS}")
        ledger = cls(
            data.get("neighbouring", "add_or_remove_one"),
            data.get("sampling", "poisson"),
            dataset_size=data.get("dataset_size", "public"),
        )
        ledger.run_id = _checked_run_id(data.get("run_id"))  # None: written before run ids existed
        ledger._read_run_statements(data)
        if version == 1:
            ledger.noise = "unknown"  # before the noise source was recorded: seeded from the published seed
        else:
            noise = data.get("noise")
            if noise not in NOISE_MODES:
                raise ValueError(f"ledger noise {noise!r} is not one of {NOISE_MODES}")
            ledger.noise = noise
        if version == GROUPED_VERSION:
            for raw in data["groups"]:
                count = int(raw["count"])
                if count < 1:
                    raise ValueError(f"a ledger group must hold at least one release, got count {count}")
                ledger._append_raw(raw, count)
        else:
            for raw in data["entries"]:
                ledger._append_raw(raw, 1)
        return ledger

    def _append_raw(self, raw: dict, count: int) -> None:
        """Append a JSON entry/group ``{"step", "event", "meta"}`` ``count`` times (the event parsed once per group)."""
        step, meta = int(raw["step"]), raw.get("meta", {})
        last = self._groups[-1] if self._groups else None
        cached = getattr(self, "_raw_event", None)
        if (
            last is not None
            and step == last.step + last.count
            and meta == last.meta
            and cached is not None
            and cached[0] is last.event
            and cached[1] == raw["event"]
        ):
            event = last.event  # a long per-release list: one parsed event per group
        else:
            event = event_from_dict(raw["event"])
            self._raw_event = (event, raw["event"])
        self._append(step, event, meta, count)

    @classmethod
    def load(cls, path: str | Path) -> "PrivacyLedger":
        """Read a ledger JSON file or journal; a run directory is accepted too.

        In a run directory the journal (``ledger.jsonl``) is read when present —
        it holds every flushed release, also of a run killed before it wrote
        ``ledger.json`` — else ``ledger.json``.
        """
        path = Path(path)
        if path.is_dir():
            path = run_ledger_file(path)
        if path.suffix == ".jsonl" and path.exists():
            return cls.read_journal(path)
        if not path.exists():
            raise FileNotFoundError(f"no ledger at {path}; pass a run directory or its ledger.json")
        return cls.from_dict(json.loads(path.read_text()))

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger({len(self)} releases, run_id={self.run_id!r}, "
            f"neighbouring={self.neighbouring!r}, noise={self.noise!r})"
        )


def run_ledger_file(run_dir: str | Path) -> Path:
    """The file a ``dpopt train`` run directory's ledger is read from: the journal :data:`JOURNAL_NAME` when
    present (every flushed release, also of a run killed before its stop), else ``ledger.json``.

    The one place this choice is made (:meth:`PrivacyLedger.load` of a directory, ``dpopt ledger``/``check``).
    """
    run = Path(run_dir)
    return run / JOURNAL_NAME if (run / JOURNAL_NAME).exists() else run / "ledger.json"


def longest_record(named: dict[str, "PrivacyLedger"]) -> tuple[str, "PrivacyLedger"]:
    """The one ledger that holds all the others' releases: ``(its name, it)``.

    Args:
        named: candidate records of one run by a short name for messages
            (e.g. ``{"checkpoint": ..., "journal": ..., "engine": ...}``); empty
            ledgers hold nothing and always fit.

    Returns:
        The longest candidate (the first named among equally long ones) when
        every other candidate is a prefix of it (:meth:`PrivacyLedger.extends`).

    Raises:
        ValueError: two candidates are records of different runs (run ids) or of
            two branches of one run (different releases at the same position);
            the message names both. Choosing either would forget releases.
    """
    if not named:
        raise ValueError("longest_record needs at least one ledger")
    name, best = max(named.items(), key=lambda kv: len(kv[1]))  # max keeps the first of equals
    for other_name, other in named.items():
        if best.extends(other):
            continue
        if best.run_id is not None and other.run_id is not None and best.run_id != other.run_id:
            why = f"different runs (run ids {other.run_id} and {best.run_id})"
        else:
            why = "two branches of one run (they differ at a release both hold)"
        raise ValueError(
            f"the {other_name} ledger ({len(other)} releases) and the {name} ledger ({len(best)} "
            f"releases) are records of {why}: taking either would forget releases of the other. "
            "Load this state into a fresh PrivacyEngine (or keep the record that belongs to it)"
        )
    return name, best


#: What the accountants read: a whole :class:`PrivacyLedger` or a bare DpEvent
#: (add/remove-one; see :func:`~dpopt.accounting.events.ledger_relation`).
EventLike = Union[PrivacyLedger, dp_event.DpEvent]
