"""PrivacyEngine state that carries the ledger, and the journal that keeps releases made after a checkpoint.

DESIGN.md, "The ledger travels with the state": any saved state from which
training can continue carries the ledger, or loading it refuses; ε is never
restarted silently. :class:`LedgerKeeper` is the one place where a
:class:`~dpopt.privacy_engine.PrivacyEngine` takes a saved ledger in
(``engine.load_checkpoint`` and ``PrivateOptimizer.load_state_dict`` both
call :meth:`LedgerKeeper.adopt`) and where its journal is kept.

Rules of :meth:`LedgerKeeper.adopt`:

* a state without a ledger (a plain torch ``optimizer.state_dict()``, an
  Opacus checkpoint's optimizer state) is refused — into a run that has made
  releases (they would be forgotten) and into a fresh engine (the releases
  that produced the state are in no ledger: ε would restart from zero). A
  state that truly does not come from private training on this data (public
  pre-training) is loaded into the torch optimizer BEFORE ``make_private``:
  a visible, deliberate act;
* the engine's ledger becomes, in place, the longest of the saved ledger, the
  journal and the engine's own ledger, each of which must be a prefix of it
  (:func:`~dpopt.accounting.ledger.longest_record`): loading an OLDER
  checkpoint keeps every release made after it (warned, with their number);
  records of different runs (run ids) or of two branches are refused;
* the ledger headers (neighbouring relation, sampling, dataset-size statement)
  must agree with the engine's once it has made something private.

The journal (``ledger-<run_id>.jsonl`` beside the first checkpoint, or
``journal=``) is the run's append-only JSON-lines ledger
(:meth:`~dpopt.accounting.ledger.PrivacyLedger.open_journal`): every release
is appended to it as it is recorded (a process killed later keeps it; the
file is ``fsync``-ed before each checkpoint or optimizer state is built, so
a machine crash cannot leave a checkpoint ahead of its journal) from the
first ``save_checkpoint`` (or ``engine.open_journal``) on; every checkpoint
and optimizer state records where it is. Two processes that load one checkpoint and train on both append
to the same journal, which then holds both branches (all charged at the next
load); each process's own ``get_epsilon`` counts its branch and what was in
the journal when it loaded. In a data-parallel run (``make_private(...,
distributed=...)``) only rank 0 writes the journal: ``engine.open_journal`` and
``save_checkpoint`` refuse on the other ranks (:meth:`LedgerKeeper.check_main`), and a
load on them reads the journal but never opens it.

Checkpoint layout (``torch.save`` of a dict; Opacus's keys, then dpopt's)::

    module_state_dict, optimizer_state_dict (PrivateOptimizer.state_dict(): the Privatizer
    state and ledger inside), noise_scheduler_state_dict, grad_clip_scheduler_state_dict,
    privacy_accountant_state_dict (engine.accountant.state_dict(), where it has one),
    privacy_ledger (the engine's ledger, PrivacyLedger.state_dict()), accountant (its name),
    dpopt_checkpoint: {"version": 1, "run_id", "ledger_length", "journal"}

The ledger is stored ONCE, in its run-length form (``PrivacyLedger.state_dict``, version 3: O(groups),
not O(releases)): the optimizer state's and the accountant state's ``"ledger"`` are the same dict as
``privacy_ledger`` (pickle writes a shared object once). Checkpoints written before (three per-release
copies, version 2) load as before. A path is written atomically (:func:`atomic_torch_save`).

Everything in it is public: released values, public configuration and the
ledger; a secret noise generator's state is never written (Privatizer.state_dict).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from .accounting.ledger import PrivacyLedger, longest_record

__all__ = ["CHECKPOINT_VERSION", "LedgerKeeper", "atomic_torch_save", "default_journal", "recorded_journal"]

CHECKPOINT_VERSION = 1


def default_journal(checkpoint: Union[str, os.PathLike], run_id: Optional[str]) -> Path:
    """``<checkpoint's directory>/ledger-<run_id>.jsonl``: one journal per run, whatever the checkpoints are named."""
    return Path(checkpoint).parent / f"ledger-{run_id or 'unknown'}.jsonl"


def recorded_journal(recorded: Optional[str], checkpoint: Any) -> Optional[Path]:
    """The journal a checkpoint records (relative paths are relative to the checkpoint's directory), or None.

    A recorded absolute path that no longer exists falls back to the same file
    name beside the checkpoint (a directory moved as a whole).
    """
    if not recorded:
        return None
    path = Path(recorded)
    here = isinstance(checkpoint, (str, os.PathLike))
    if not path.is_absolute():
        return Path(checkpoint).parent / path if here else path
    if not path.exists() and here and (Path(checkpoint).parent / path.name).exists():
        return Path(checkpoint).parent / path.name
    return path


def atomic_torch_save(obj: Any, path: Union[str, os.PathLike], **torch_save_kwargs: Any) -> Path:
    """``torch.save(obj, path)`` atomically: a temporary file beside ``path``, ``fsync``, ``os.replace``.

    A reader, or a process killed mid-write, sees the old file or the new one, never a torn one; the
    directory is ``fsync``-ed too where the OS allows (POSIX). The temporary name carries the process
    id, so two processes saving to one path cannot write into each other's file.

    Raises:
        OSError: the write or rename failed (the temporary file is removed; ``path`` is unchanged).
    """
    import torch  # imported here: this module is imported by the accounting layer without torch work

    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh, **torch_save_kwargs)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # no directory handles (Windows): the rename is still atomic
        return path
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
    return path


def _totals(groups: Iterable) -> tuple[int, int]:
    reads = releases = 0
    for g in groups:  # run-length groups: O(groups)
        reads += int(g.meta.get("reads", 0)) * g.count
        releases += int(g.meta.get("releases", 0)) * g.count
    return reads, releases


def journal_off_main(door: str, rank: int, world_size: int) -> str:
    """The refusal of ``engine.<door>`` on ``rank`` > 0 of a data-parallel run of ``world_size`` ranks."""
    return (
        f"engine.{door}() was called on rank {rank} of {world_size}: in a data-parallel run only rank 0 "
        "writes the ledger journal (every rank's ledger holds the same releases, so a second writer would "
        f"append each release again or fork the file). Call engine.{door}() on rank 0 only, e.g. "
        f"`if torch.distributed.get_rank() == 0: engine.{door}(...)`; load_checkpoint works on every rank "
        "(ranks > 0 read the journal, never write it)"
    )


class LedgerKeeper:
    """Takes saved ledgers into an engine's ledger (never losing a release) and keeps its journal.

    Args:
        ledger: the engine's ledger (changed in place only: the Privatizers and
            the accountant hold the same object).

    Attributes:
        journal: the journal file every release is appended to, or None.
        carried_reads, carried_releases: reads/releases of the adopted ledger
            not counted by this process's Privatizers (made before the load);
            ``PrivacyEngine.summary`` adds them to the Privatizers' own counts.
        rank, world_size: this process's place in the engine's data-parallel
            group (set by ``make_private(..., distributed=...)``; 0 of 1 otherwise):
            only rank 0 writes the journal.
    """

    def __init__(self, ledger: PrivacyLedger):
        self.ledger = ledger
        self.journal: Optional[Path] = None
        self.carried_reads = 0
        self.carried_releases = 0
        self.rank, self.world_size = 0, 1

    def check_main(self, door: str) -> None:
        """Refuse ``door`` (``"open_journal"``, ``"save_checkpoint"``) on a rank other than 0 of a data-parallel run.

        Every rank's ledger holds the same releases: a second rank writing the journal would append each
        release again (or fork the file), so only rank 0 writes it.

        Raises:
            RuntimeError: ``rank != 0``; the message says to call ``door`` on rank 0 only.
        """
        if self.rank != 0:
            raise RuntimeError(journal_off_main(door, self.rank, self.world_size))

    # -- the journal -------------------------------------------------------------
    def open_journal(self, path: Union[str, os.PathLike]) -> Path:
        """Append every release to the journal at ``path`` from now on (the whole ledger is written first).

        An existing file must hold a prefix of this ledger (this run's journal,
        e.g. the one this state was loaded with): only the missing entries are
        appended.

        Raises:
            ValueError: the engine already journals to another file (old
                checkpoints point to it: switching would stop it growing), or
                ``path`` holds a record this ledger does not contain (another
                run's journal: choose another path).
            OSError: the journal could not be written (the engine then keeps
                none: the same or another path can be opened again).
        """
        path = Path(path)
        if self.journal is not None:
            if os.path.abspath(self.journal) != os.path.abspath(path):
                raise ValueError(
                    f"this engine already keeps its ledger journal at {self.journal}; the "
                    f"checkpoints saved so far point to it, so it cannot move to {path} (omit "
                    "journal=, or pass the same path)"
                )
            self.ledger.flush()
            return self.journal
        flushed = 0
        if path.exists() and path.stat().st_size > 0:
            on_disk = PrivacyLedger.read_journal(path)
            if not self.ledger.extends(on_disk):
                raise ValueError(
                    f"{path} holds a ledger journal ({len(on_disk)} releases, run id "
                    f"{on_disk.run_id}) that this engine's ledger ({len(self.ledger)} releases, run "
                    f"id {self.ledger.run_id}) does not contain: another run's record. Choose "
                    "another journal path, or load the checkpoint that belongs to it"
                )
            flushed = len(on_disk)
        self.ledger.open_journal(path, flushed=flushed, autoflush=True)
        try:
            self.ledger.flush()
        except BaseException:  # not started (disk full, ...): no journal is kept, so another path can be tried
            self.ledger.close_journal()
            raise
        self.journal = path
        return path

    def flush(self) -> None:
        """Write the releases not yet in the journal (no-op without one)."""
        if self.journal is not None:
            self.ledger.flush()

    # -- loading -----------------------------------------------------------------
    def adopt(
        self,
        saved: Optional[Union[dict, PrivacyLedger]],
        *,
        journal: Optional[Path],
        where: str,
        header_fixed: bool,
        stacklevel: int = 3,
    ) -> int:
        """Make the engine's ledger the longest record of this run (module docstring); returns releases kept.

        Args:
            saved: the ledger the state carries (a ``state_dict``), or None.
            journal: the journal the state recorded (read if it exists; then
                journaled to), or None.
            where: the state, for messages (``"checkpoint ckpt.pt"``).
            header_fixed: the engine has made something private, so its
                header (sampling, ...) describes the coming releases.
            stacklevel: of its warnings (the default names the caller of the
                method that called ``adopt``).

        Returns:
            The number of releases beyond the saved ledger's that stay charged
            (from the journal or the engine's own ledger; warned when > 0).

        Raises:
            ValueError: no ledger in the state (both cases, module docstring);
                records of different runs or branches; a header that differs.
                The engine's ledger is unchanged when it raises.
        """
        if saved is None:
            if len(self.ledger):
                raise ValueError(
                    f"refused to load the {where}: it carries no privacy ledger, and this run has "
                    f"already made {len(self.ledger)} releases that loading it would forget. Load a "
                    "state saved by dpopt (engine.save_checkpoint, or the state_dict() of the "
                    "optimizer make_private returned), which carries the ledger"
                )
            raise ValueError(
                f"refused to load the {where}: it carries no privacy ledger (a plain torch "
                "optimizer state_dict, or one saved by Opacus or an older dpopt), so the releases "
                "that produced it would be counted nowhere and epsilon would restart from zero. Load "
                "a state saved by dpopt (engine.save_checkpoint, or the state_dict() of the optimizer "
                "make_private returned). If this state did NOT come from private training on this "
                "data (e.g. public pre-training), load it into your torch optimizer before calling "
                "make_private"
            )
        if (
            journal is not None
            and self.journal is not None
            and os.path.abspath(journal) != os.path.abspath(self.journal)
        ):
            raise ValueError(
                f"the {where} records the ledger journal {journal}, but this engine already keeps "
                f"its journal at {self.journal}: load it into a fresh PrivacyEngine"
            )
        saved_ledger = saved if isinstance(saved, PrivacyLedger) else PrivacyLedger.from_dict(saved)
        candidates = {f"saved ({where})": saved_ledger}
        if journal is not None:
            if journal.exists() and journal.stat().st_size > 0:
                candidates[f"journal {journal}"] = PrivacyLedger.read_journal(journal)
            else:
                warnings.warn(
                    f"the {where} records the ledger journal {journal}, which is missing: releases made "
                    f"after it was saved (if any) cannot be counted; epsilon counts its "
                    f"{len(saved_ledger)} releases (keep the journal beside the checkpoints)",
                    UserWarning,
                    stacklevel=stacklevel,
                )
        if len(self.ledger):
            candidates["engine"] = self.ledger
        name, best = longest_record(candidates)
        if header_fixed:
            mine = (self.ledger.neighbouring, self.ledger.sampling, self.ledger.dataset_size)
            theirs = (best.neighbouring, best.sampling, best.dataset_size)
            if mine != theirs:
                raise ValueError(
                    f"the {where} is of a run with (neighbouring, sampling, dataset_size) = {theirs}, "
                    f"this engine's is {mine}: one ledger cannot state both. Make the engine private "
                    "with the settings of the saved run"
                )
        kept = len(best) - len(saved_ledger)
        if best is not self.ledger:
            self.ledger.load_state_dict(best)
        if kept > 0:
            warnings.warn(
                f"the {where} was saved after {len(saved_ledger)} releases; the {name} holds "
                f"{len(best)} of the same run: the {kept} releases made after it stay charged "
                f"(epsilon counts all {len(best)})",
                UserWarning,
                stacklevel=stacklevel,
            )
        if journal is not None and self.rank == 0:  # rank > 0 read it above; only rank 0 writes it
            self.open_journal(journal)
        return kept

    def settle(self, privatizers: Iterable) -> None:
        """After a load: what the ledger holds beyond the Privatizers' own counters is carried.

        ``summary()``'s ``privatizer_reads``/``privatizer_releases`` are then the
        Privatizers' counts plus these, equal to the ledger's for the releases
        made before the load; releases made after it are counted independently.
        """
        reads, releases = _totals(self.ledger.groups)
        privs = list(privatizers)
        self.carried_reads = reads - sum(p.reads for p in privs)
        self.carried_releases = releases - sum(p.releases for p in privs)
