"""How a ``dpopt train`` run directory that stopped without its ``summary.json`` can go on.

A run stopped by a failed write (a full disk: exit 4), a kill, or a crash leaves a journal of charged
releases (``ledger.jsonl``) and perhaps a checkpoint. What the user can do next depends on the directory,
not on the error:

* a ``checkpoint.pt`` and independent noise: ``dpopt train --resume RUN_DIR`` continues the run;
* no checkpoint (the failure came before the first one; ``--fsdp`` runs write none) or correlated noise
  (``noise_mechanism`` banded/BLT: its noise stream is never saved, docs/correlated-noise.md): the run
  cannot continue. Its journal's releases stay charged to the data (a new run's ε adds to them), so the
  directory is kept, or moved aside, and a new run gets another ``--out``;
* no release journaled: nothing was charged; the same command can run again.

:func:`continuation` reads the directory (no torch) and says which, in words every command that meets such
a directory prints (``dpopt train``'s exit-4 line, ``dpopt check``'s refusal), so no message offers a
command that fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from .ledger import PrivacyLedger, run_ledger_file

__all__ = ["Continuation", "continuation", "CHECKPOINT_FILE"]

#: The checkpoint file of a ``dpopt train`` run directory (``dpopt.training.checkpoint.CHECKPOINT_NAME`` is this).
CHECKPOINT_FILE = "checkpoint.pt"


@dataclass(frozen=True)
class Continuation:
    """What a stopped run directory allows.

    Attributes:
        run_dir: the run directory.
        releases: charged releases in its ledger: the journal ``ledger.jsonl``, else ``ledger.json`` (0 without
            either; None when it cannot be read).
        resumable: ``dpopt train --resume run_dir`` continues it (a checkpoint, independent noise, releases).
        reason: why it cannot resume ('' when it can, or when nothing was released).
    """

    run_dir: Path
    releases: Optional[int]
    resumable: bool
    reason: str

    def advice(self, free_space: bool = False) -> str:
        """The next step as one sentence: resume, run again, or keep the charged journal and start a new run.

        Args:
            free_space: the run stopped on a full disk: the sentence says to free space first.
        """
        run, first = self.run_dir, "Free space, then " if free_space else ""
        if self.resumable:
            return f"{first}`dpopt train --resume {run}` continues the run from its last checkpoint"
        if self.releases == 0:
            return f"{first}run the command again (no release was charged)" if first else "No release was charged"
        held = "charged releases" if self.releases is None else f"{self.releases} charged release(s)"
        return (
            f"The run cannot continue ({self.reason}); its ledger {run_ledger_file(run)} holds {held}, which "
            "count against the data's privacy budget (a new run's ε adds to them): keep the directory, or move "
            f"it aside (e.g. `mv {run} {run}.failed`), and start a new run with another --out"
            + (" once there is space" if free_space else "")
        )


def _mechanism(run: Path) -> str:
    """The run's ``noise_mechanism`` from ``config.json`` ("independent" when absent or unreadable)."""
    try:
        config = json.loads((run / "config.json").read_text())
    except (OSError, ValueError):
        return "independent"
    mechanism = config.get("noise_mechanism") if isinstance(config, dict) else None
    return str(mechanism or "independent")


def _releases(run: Path) -> Optional[int]:
    """Entries of the run's ledger (the journal, else ``ledger.json``): 0 without one, None when unreadable."""
    if not run_ledger_file(run).exists():
        return 0
    try:
        return len(PrivacyLedger.load(run))
    except (OSError, ValueError):
        return None


def continuation(run_dir: Union[str, Path]) -> Continuation:
    """How the stopped run in ``run_dir`` can go on (reads ``config.json``, the journal, ``checkpoint.pt``).

    Args:
        run_dir: a ``dpopt train`` run directory (it need not exist: then nothing was released).

    Returns:
        a :class:`Continuation`; its :meth:`~Continuation.advice` is the sentence to print. Raises nothing.
    """
    run = Path(run_dir)
    releases = _releases(run)
    mechanism = _mechanism(run)
    if mechanism != "independent":
        reason = f"a correlated-noise run ({mechanism}) cannot be resumed: its noise stream is never saved"
    elif not (run / CHECKPOINT_FILE).is_file():
        reason = "no checkpoint was written before it stopped"
    else:
        reason = ""
    resumable = not reason and releases != 0
    return Continuation(run, releases, resumable, reason)
