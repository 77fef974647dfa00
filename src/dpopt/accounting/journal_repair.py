"""Repairing a damaged ledger journal: keep every readable release, charge every release a damaged line may have held.

A journal line in the middle of ``ledger.jsonl`` can be damaged (bit rot, a copy cut short, an
editor). :meth:`~dpopt.accounting.ledger.PrivacyLedger.read_journal` refuses such a journal
(:class:`~dpopt.accounting.ledger.JournalDamaged`): ε must never be computed from a record with a
hole. :func:`repair_journal` is the way forward; the rule is *charge what cannot be proved absent*:

* every readable header and entry line is kept as it is;
* a run of damaged lines between two readable entries at steps ``a`` and ``b`` held the releases
  of steps ``a + 1 … b - 1`` (the training loop records one release per step, numbered
  consecutively): those ``b - a - 1`` releases are charged again, each with the event and metadata
  of the entries on both sides, which must agree (a run at fixed σ, q and C; otherwise the repair
  is refused: nothing can say which release was lost). When ``b = a + 1`` the damaged lines held no
  release of their own (a header, or a line written again after a failed write): nothing is charged;
* damaged lines before the first readable entry: the releases of steps ``0 … s - 1`` (``s`` the
  first readable step), charged with that entry's event;
* damaged complete lines after the last readable entry: nothing after them proves how many there
  were, so each such line is charged as one release (the last readable entry's event, the next
  steps). A torn LAST line (no newline: a flush cut short) is dropped, as on every read: nothing
  that depends on it was written.

The original file is kept as ``ledger.jsonl.damaged`` (never overwritten: a second repair keeps the
first original) and the repaired journal replaces ``ledger.jsonl`` atomically. A journal whose
first header is unreadable is refused (the neighbouring relation, sampling and noise statements
cannot be guessed).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from ..atomic import atomic_write_text
from .events import event_from_dict

__all__ = ["JournalRepair", "repair_journal", "DAMAGED_SUFFIX"]

#: Suffix of the copy of the damaged original kept beside the repaired journal.
DAMAGED_SUFFIX = ".damaged"


@dataclass(frozen=True)
class JournalRepair:
    """What :func:`repair_journal` did.

    Attributes:
        path: the journal repaired.
        damaged_lines: 1-based numbers of the unreadable complete lines.
        charged: releases added for them (each charged with a neighbour's event).
        original: the copy of the damaged file (``ledger.jsonl.damaged``).
    """

    path: Path
    damaged_lines: tuple[int, ...]
    charged: int
    original: Path

    def message(self) -> str:
        """One line for the user."""
        lines = ", ".join(map(str, self.damaged_lines[:8])) + (" …" if len(self.damaged_lines) > 8 else "")
        return (
            f"repaired {self.path}: {len(self.damaged_lines)} damaged line(s) ({lines}); {self.charged} release(s) "
            f"they may have held are charged; the damaged original is kept as {self.original}"
        )


def _entry(line: str) -> Optional[dict]:
    """The parsed entry or header of ``line``, or None when it is damaged."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(raw, dict):
        return None
    if "format" in raw:
        return raw if raw.get("format") == "dpopt-ledger-journal" else None
    try:
        int(raw["step"])
        event_from_dict(raw["event"])
    except (KeyError, TypeError, ValueError):
        return None
    if not isinstance(raw.get("meta", {}), dict):
        return None
    return raw


def _same(a: dict, b: dict) -> bool:
    return a["event"] == b["event"] and a.get("meta", {}) == b.get("meta", {})


def _charges(prev: Optional[dict], nxt: Optional[dict], n_damaged: int, path: Path) -> list[dict]:
    """The entries a run of ``n_damaged`` damaged lines between ``prev`` and ``nxt`` stands for."""

    def like(src: dict, step: int) -> dict:
        return {"step": step, "event": src["event"], "meta": src.get("meta", {})}

    if prev is None and nxt is None:
        raise ValueError(f"{path}: no readable entry to tell what the damaged lines held; cannot repair")
    if nxt is None:  # after the last readable entry: one release per damaged line
        start = int(prev["step"]) + 1  # type: ignore[index]
        return [like(prev, start + i) for i in range(n_damaged)]  # type: ignore[arg-type]
    first = 0 if prev is None else int(prev["step"]) + 1
    missing = int(nxt["step"]) - first
    if missing <= 0:
        return []  # a header or a line written again: no release of its own
    if prev is not None and not _same(prev, nxt):
        raise ValueError(
            f"{path}: the {missing} release(s) lost in damaged lines lie between entries of different "
            "events; what they were cannot be told, so the journal is not repaired (restore it from a copy)"
        )
    return [like(nxt, first + i) for i in range(missing)]


def repair_journal(path: Union[str, Path]) -> JournalRepair:
    """Rewrite the journal at ``path`` from its readable lines, charging what damaged lines may have held.

    The rule is the module docstring's. The result reads with
    :meth:`~dpopt.accounting.ledger.PrivacyLedger.read_journal`.

    Args:
        path: the journal (``ledger.jsonl``).

    Returns:
        A :class:`JournalRepair` (``damaged_lines`` empty: the journal was whole and is unchanged).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: its first header is unreadable, no entry is readable, or releases lost between
            entries of different events (nothing can say what they were).
        OSError: the repaired journal or the copy of the original cannot be written (the journal is
            then unchanged).
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    complete = lines[:-1]  # a torn last line (no newline) is dropped, as on every read
    parsed = [(_entry(line) if line.strip() else {}) for line in complete]
    damaged = tuple(i + 1 for i, raw in enumerate(parsed) if raw is None)
    original = path.with_name(path.name + DAMAGED_SUFFIX)
    if not damaged:
        return JournalRepair(path, (), 0, original)
    first = next((raw for raw in parsed if raw), None)
    if first is None or "format" not in first:
        raise ValueError(f"{path}: the journal's first header is damaged; cannot repair (restore it from a copy)")
    out: list[str] = []
    prev: Optional[dict] = None
    pending = 0
    charged = 0

    def settle(nxt: Optional[dict]) -> None:
        nonlocal pending, charged
        if pending:
            for entry in _charges(prev, nxt, pending, path):
                out.append(json.dumps(entry, allow_nan=False))
                charged += 1
            pending = 0

    for line, raw in zip(complete, parsed):
        if raw is None:
            pending += 1
        elif not raw:
            continue
        elif "format" in raw:
            out.append(line)
        else:
            settle(raw)
            out.append(line)
            prev = raw
    settle(None)
    if not original.exists():
        shutil.copyfile(path, original)
    atomic_write_text(path, "\n".join(out) + "\n")
    return JournalRepair(path, damaged, charged, original)
