"""Do a run directory's two ledger files agree? The journal ``ledger.jsonl`` and ``ledger.json``.

A ``dpopt train`` run appends every release to the journal as it goes (fsync-ed before any file that
depends on it) and writes ``ledger.json`` — the same ledger, one entry per release — when it stops
(completed, interrupted or at its ε budget), beside ``summary.json``. The checks and ``dpopt ledger``
score the journal (it holds every release, also of a run killed before it wrote ``ledger.json``); a
``ledger.json`` that says something else is a record the checks never read, so it must be compared:

* equal parsed ledgers (header fields, the mechanism record, sampling and every entry in order) agree;
* ``ledger.json`` a strict PREFIX of the journal is what a legitimately stopped run that was resumed
  and then killed leaves (the resumed segment appended to the journal and never reached its own stop).
  That is not tampering only when ``summary.json`` was written at the same stop, i.e. its ``steps``
  equals ``ledger.json``'s entries; otherwise (e.g. the last entry deleted from ``ledger.json`` of a
  completed run) it is a disagreement;
* anything else is a disagreement, named by its first difference.

The ledger ``delta`` is compared only when the journal's header records it: a ``dpopt train`` run sets it
when it stops, after the journal's last flush, so only ``ledger.json`` states it (the checks read δ from
``summary.json``; ``dpopt ledger`` from the summary before the header).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from .ledger import JOURNAL_NAME, PrivacyLedger

__all__ = ["SNAPSHOT_NAME", "LedgerFiles", "compare_ledger_files", "first_disagreement"]

#: ``ledger.json``: the ledger a run writes when it stops (beside the journal :data:`JOURNAL_NAME`).
SNAPSHOT_NAME = "ledger.json"


@dataclass(frozen=True)
class LedgerFiles:
    """What the ledger files of one run directory say about each other.

    Attributes:
        files: the files present and read, journal first (``("ledger.jsonl", "ledger.json")``, or one).
        disagreement: ``"ledger.json disagrees with ledger.jsonl: …"`` naming the first difference; None
            when they agree (or only one file exists).
        note: a remark when they agree only as a prefix (a resumed run killed after its earlier stop).
    """

    files: tuple[str, ...]
    disagreement: Optional[str] = None
    note: Optional[str] = None


def _show(value: Any) -> str:
    return "absent" if value is _ABSENT else repr(value)


_ABSENT = object()


def _dict_difference(where: str, mine: Mapping, theirs: Mapping) -> Optional[str]:
    """The first key (depth-first, journal's order then the snapshot's extra keys) where two dicts differ."""
    for key in list(mine) + [k for k in theirs if k not in mine]:
        a, b = mine.get(key, _ABSENT), theirs.get(key, _ABSENT)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            inner = _dict_difference(f"{where}{key}.", a, b)
            if inner is not None:
                return inner
        elif a != b:
            return f"{where}{key} is {_show(b)} in ledger.json, {_show(a)} in ledger.jsonl"
    return None


def first_disagreement(journal: PrivacyLedger, snapshot: PrivacyLedger) -> Optional[str]:
    """The first place where ``snapshot`` (``ledger.json``) contradicts ``journal`` (``ledger.jsonl``).

    Compares the parsed ledgers (not bytes): the header (:meth:`PrivacyLedger.header`: run id,
    neighbouring relation, sampling, noise source, dataset-size statement, privacy unit, δ, number of
    users and the correlated-noise mechanism record, key by key), then the entries in order (step,
    event, metadata). ``delta`` is skipped when the journal's header has none (module docstring).

    Returns:
        None when ``snapshot`` equals ``journal`` or is a prefix of it (fewer entries, all equal);
        else one line ``"ledger.json disagrees with ledger.jsonl: …"``.
    """
    head_j, head_s = journal.header(), snapshot.header()
    if "delta" not in head_j:
        head_s.pop("delta", None)
    where = _dict_difference("", head_j, head_s)
    if where is None:
        if len(snapshot) > len(journal):
            where = f"ledger.json holds {len(snapshot)} releases, the journal only {len(journal)}"
        else:
            for i, (mine, theirs) in enumerate(zip(journal.entries, snapshot.entries)):
                if mine.step != theirs.step:
                    where = f"entry {i}: step {theirs.step} in ledger.json, {mine.step} in ledger.jsonl"
                elif mine.event != theirs.event:
                    where = f"entry {i} (step {mine.step}): event {theirs.event} in ledger.json, {mine.event} in ledger.jsonl"
                else:
                    where = _dict_difference(f"entry {i} (step {mine.step}): meta.", mine.meta, theirs.meta)
                if where is not None:
                    break
    return None if where is None else f"ledger.json disagrees with ledger.jsonl: {where}"


def compare_ledger_files(
    run_dir: str | Path, summary_steps: Optional[int] = None, journal: Optional[PrivacyLedger] = None
) -> LedgerFiles:
    """Read a run directory's journal and ``ledger.json`` (those present) and say whether they agree.

    Args:
        run_dir: a ``dpopt train`` run directory.
        summary_steps: ``summary.json``'s ``steps`` (None: no summary). A ``ledger.json`` that is a strict
            prefix of the journal agrees only when it has exactly this many entries (written at the same
            stop as the summary); otherwise the prefix is a disagreement.
        journal: the journal as the caller already read it (``PrivacyLedger.load(run_dir)``), so that it is
            parsed once (and a torn last line warned once); None: read here.

    Returns:
        :class:`LedgerFiles` (files present; the first disagreement; a note for an accepted prefix).

    Raises:
        FileNotFoundError, ValueError: a present file cannot be read as a ledger (:meth:`PrivacyLedger.load`).
    """
    run = Path(run_dir)
    journal_path, snapshot_path = run / JOURNAL_NAME, run / SNAPSHOT_NAME
    files = tuple(p.name for p in (journal_path, snapshot_path) if p.exists())
    if len(files) < 2:
        return LedgerFiles(files)
    if journal is None:
        journal = PrivacyLedger.load(journal_path)
    snapshot = PrivacyLedger.load(snapshot_path)
    why = first_disagreement(journal, snapshot)
    if why is not None or len(snapshot) == len(journal):
        return LedgerFiles(files, why)
    if summary_steps is None or int(summary_steps) != len(snapshot):
        said = "no summary.json" if summary_steps is None else f"summary.json's {summary_steps} steps"
        return LedgerFiles(
            files,
            f"ledger.json disagrees with ledger.jsonl: ledger.json holds only the first {len(snapshot)} of the "
            f"journal's {len(journal)} releases, and {said} does not date it to an earlier stop of the run",
        )
    return LedgerFiles(
        files,
        note=(
            f"ledger.json holds the first {len(snapshot)} of the journal's {len(journal)} releases (written at "
            "an earlier stop, with summary.json; the run was resumed and stopped without writing them again): "
            "it agrees with the journal as far as it goes; the journal is checked"
        ),
    )
