"""PrivacyLedger: the append-only list of every noisy release of a run.

Only the :class:`~dpopt.privatizer.Privatizer` appends to a ledger (one entry
per logical step, containing the step's DpEvent and public metadata such as the
clip bound applied, the sensitivity and the noise std). Accountants read the
ledger as a whole (:func:`dpopt.accounting.accountant.epsilon`); the ledger
never computes ε itself.

JSON format (``version`` 1)::

    {"format": "dpopt-ledger", "version": 1,
     "neighbouring": "add_or_remove_one", "sampling": "poisson",
     "entries": [{"step": 0, "event": {...}, "meta": {...}}, ...]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dp_accounting import dp_event

from .events import event_from_dict, event_to_dict

__all__ = ["LedgerEntry", "PrivacyLedger", "LEDGER_VERSION"]

LEDGER_VERSION = 1
NEIGHBOURING = ("add_or_remove_one", "replace_one")


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


class PrivacyLedger:
    """Append-only record of releases, saved as versioned JSON.

    Args:
        neighbouring: ``"add_or_remove_one"`` (default; what dp_accounting's
            Poisson-sampling analysis assumes) or ``"replace_one"``.
        sampling: ``"poisson"`` (default) or another scheme, recorded as is.

    Raises:
        ValueError: on an unknown neighbouring relation.
    """

    def __init__(self, neighbouring: str = "add_or_remove_one", sampling: str = "poisson"):
        if neighbouring not in NEIGHBOURING:
            raise ValueError(f"neighbouring must be one of {NEIGHBOURING}, got {neighbouring!r}")
        self.neighbouring = neighbouring
        self.sampling = sampling
        self._entries: list[LedgerEntry] = []

    # -- writing ---------------------------------------------------------
    def record(self, step: int, event: dp_event.DpEvent, **meta: Any) -> LedgerEntry:
        """Append one release (called by the Privatizer only)."""
        entry = LedgerEntry(int(step), event, _public(meta))
        self._entries.append(entry)
        return entry

    # -- reading ---------------------------------------------------------
    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        return tuple(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def events(self) -> list[dp_event.DpEvent]:
        return [e.event for e in self._entries]

    def compacted(self) -> list[tuple[dp_event.DpEvent, int]]:
        """Runs of consecutive identical events as ``(event, count)`` pairs."""
        runs: list[tuple[dp_event.DpEvent, int]] = []
        for entry in self._entries:
            if runs and runs[-1][0] == entry.event:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((entry.event, 1))
        return runs

    def composed_event(self) -> dp_event.DpEvent:
        """The whole ledger as one DpEvent (compacted with SelfComposed runs)."""
        runs = self.compacted()
        if not runs:
            return dp_event.NoOpDpEvent()
        parts = [ev if n == 1 else dp_event.SelfComposedDpEvent(ev, int(n)) for ev, n in runs]
        return parts[0] if len(parts) == 1 else dp_event.ComposedDpEvent(parts)

    # -- persistence -----------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": "dpopt-ledger",
            "version": LEDGER_VERSION,
            "neighbouring": self.neighbouring,
            "sampling": self.sampling,
            "entries": [e.to_dict() for e in self._entries],
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), allow_nan=False))
        return path

    @classmethod
    def from_dict(cls, data: dict) -> "PrivacyLedger":
        if data.get("format") != "dpopt-ledger":
            raise ValueError("not a dpopt ledger (missing 'format': 'dpopt-ledger')")
        if int(data.get("version", -1)) != LEDGER_VERSION:
            raise ValueError(f"unsupported ledger version {data.get('version')!r}; expected {LEDGER_VERSION}")
        ledger = cls(data.get("neighbouring", "add_or_remove_one"), data.get("sampling", "poisson"))
        for raw in data["entries"]:
            ledger._entries.append(LedgerEntry(int(raw["step"]), event_from_dict(raw["event"]), raw.get("meta", {})))
        return ledger

    @classmethod
    def load(cls, path: str | Path) -> "PrivacyLedger":
        """Read a ledger JSON file (a run directory is accepted too)."""
        path = Path(path)
        if path.is_dir():
            path = path / "ledger.json"
        if not path.exists():
            raise FileNotFoundError(f"no ledger at {path}; pass a run directory or its ledger.json")
        return cls.from_dict(json.loads(path.read_text()))

    def __repr__(self) -> str:
        return f"PrivacyLedger({len(self)} releases, neighbouring={self.neighbouring!r})"


