"""The release boundary: one release is one Poisson batch (or a part of one), tagged and verified by dpopt.

DESIGN.md, "A release is a unit dpopt owns": which examples go into one
release is decided by the sampler that draws the logical batch, never inferred
from what the user's loop happens to do (how many times it calls ``step()``,
which signals are still queued, which batch it saw last).

How it works, on every door that hands out Poisson batches
(:class:`~dpopt.data_loader.DPDataLoader` in a plain loop and under
``DPTrainer``; :class:`~dpopt.utils.batch_memory_manager.BatchMemoryManager`):

* the loader tags each piece of data it hands to the loop with a
  :class:`ChunkTag` ``(batch, chunk, chunks, examples)``: ``batch`` is a serial
  number of the logical (Poisson) batch drawn for this optimizer, ``chunk`` the
  physical chunk's index in it, ``chunks`` their number (1 for a whole batch),
  ``examples`` the chunk's number of examples (private: kept in memory only,
  never printed or released; it drives the rows-vs-examples check);
* the optimizer's open step (:class:`ReleaseBoundary`) belongs to ONE batch.
  A chunk of another batch handed out while a step is open, leaving the
  ``BatchMemoryManager`` context (or the chunk iterator: ``break``, an
  exception) with a step open: the open step is **closed as its own release**
  — noise added, charged at q, the update applied — before anything of the new
  batch is added. What it holds is a subset of ONE Poisson batch (each example
  at most once), so its sensitivity is still C and the ledger's Poisson
  Gaussian step at q accounts for it; two batches are never merged;
* under ``BatchMemoryManager`` the chunk's tag (not a queue of signals)
  says whether ``step()`` ends the logical batch (the last chunk releases); a
  chunk the loop skipped (``continue``, an exception caught before ``step()``)
  is simply not added, and a logical batch the loop skipped ENTIRELY (an
  empty batch's ``continue``) is released as pure noise when the loop moves on
  (the next batch handed out, or the end of the pass: :meth:`ReleaseBoundary.pass_ended`)
  — every batch ``BatchMemoryManager`` hands out is released exactly once, so
  the number of releases does not depend on the data and data-parallel ranks
  release together. A ``step()`` that raises (a refusal) releases nothing, and
  its batch is not owed a noise release — except a cyclic batch (correlated
  noise, a tag with a ``position``): every batch a cyclic loader hands out, in a
  plain loop too, is released exactly once (pure noise if skipped or failed), so
  that release t holds the batch of step t (:mod:`dpopt.cyclic_batches`);
* the rows-vs-examples check (:meth:`ReleaseBoundary.check_rows`) compares the
  examples forwarded in the open step with the examples of the chunks that were
  current at its ``step()`` calls, from this one place on every path.

Why close and not refuse: ``break`` out of a ``BatchMemoryManager`` loop (a
step budget, a time limit) and ``if len(x) == 0: continue`` are ordinary loop
control flow; the part of a Poisson batch already added is a valid release
(a subset of one Poisson sample, sensitivity C), charged like any other.
Refusing would turn common loops into errors without a privacy gain. In a
plain loop (one ``step()`` per batch, no chunks) a batch the loop skips has
no release (a batch peeked at with ``next(iter(loader))`` must not cost a
release): keep stepping on empty batches there (docs/pitfalls.md, item 2).

Which release a step makes is decided in ONE place, :meth:`ReleaseBoundary.admit`, for every loader that
tags: ``make_private`` tells the boundary that its loader tags (:meth:`ReleaseBoundary.expect_tags`, with the
loader's sampler), and from then on every ``step()`` asks ``admit(release)`` (``release``: the 0-based index of
the release it would make, the releases made so far) before anything of the step is read. The sampler's kind
says the rule:

* a Poisson sampler (independent noise): the step's data must be a batch the loader drew, released once. A
  ``step()`` is refused (ValueError) when no tagged batch was handed out for it (a loop over the ORIGINAL
  DataLoader: shuffled batches, no Poisson sample) or when the current tag's batch was already released (a
  second ``step()`` on one batch; another loader's batches after one of make_private's). Otherwise each would
  be charged as a Poisson-subsampled release at q, an amplification that did not happen;
* a cyclic sampler (correlated noise, :mod:`dpopt.cyclic_batches`: its tags carry a ``position``): release t
  must hold the batch of step t, the participation the sensitivity was computed for. A ``step()`` is refused
  (RuntimeError) when the current tag's position is not ``release`` (a second ``step()`` on one batch) or when
  no tagged batch was handed out for it (the original data loader's, a wrapper's that bypasses the returned
  loader). The pure-noise release of a cyclic batch the loop skipped passes the same position rule.

A refusal says what to change and that nothing was released or charged; the boundary is left as it was, so a
refused step (``end(released=False)``) can be retried on its batch. What is not verified: that the tensors
forwarded are the current batch's (a loop over ``zip(loader, other_loader)`` forwarding the other's rows gets
one release per batch handed out; the rows-vs-examples check refuses such a step only when it carries more
rows than the current batch has examples).

Loaders dpopt does not own hand out no tags. A user's loader with
``poisson_sampling=False`` is not checked (``expect_tags`` is never called; the
ledger records that the sampling is not Poisson): the optimizer follows Opacus's
``signal_skip_step`` protocol as before, and the rows-vs-examples check has
nothing to compare with. Opacus's own ``BatchMemoryManager`` over make_private's
loader draws from its Poisson sampler directly (no tags): its steps are
accepted while the sampler has drawn more batches since the last tag was handed
out than such untagged steps have released (one release per Poisson batch
drawn); over the original loader it draws nothing and is refused, and over a
cyclic loader its batches carry no position and are refused.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

from .errors import LedgerWriteError

__all__ = ["ChunkTag", "ReleaseBoundary", "boundary_of"]

NOTHING_RELEASED = "nothing was released or charged"  # the end of every refusal of admit


@dataclass(frozen=True)
class ChunkTag:
    """What a loader handed to the loop: chunk ``chunk`` of ``chunks`` of logical batch ``batch``.

    Attributes:
        batch: serial number of the logical (Poisson) batch, unique per :class:`ReleaseBoundary` (public).
        chunk: the physical chunk's index in the batch, ``0 <= chunk < chunks``.
        chunks: the number of physical chunks of the batch (1: the whole batch).
        examples: the chunk's number of examples (private: in memory only).
        position: the batch's step in a cyclic order (correlated noise: the 0-based step t of the cyclic batch
            t mod b, :mod:`dpopt.cyclic_batches`; public), or None (Poisson batches: any step may release them).
            :meth:`ReleaseBoundary.admit` refuses to release a positioned batch as any other release than release
            ``position``.
    """

    batch: int
    chunk: int
    chunks: int
    examples: Optional[int]
    position: Optional[int] = None

    @property
    def last(self) -> bool:
        """Whether this is the last chunk of its logical batch (its ``step()`` releases)."""
        return self.chunk == self.chunks - 1


class ReleaseBoundary:
    """The boundary of one optimizer's releases: which logical batch the open step belongs to.

    Held by :class:`~dpopt.private_optimizer.PrivateOptimizer` (:func:`boundary_of`);
    loaders call :meth:`new_batch` when they draw a logical batch and :meth:`hand`
    when they give a chunk of it to the loop; the optimizer calls :meth:`admit`
    (may this step release, and as which release), :meth:`begin`,
    :meth:`step_chunk`, :meth:`counts` and :meth:`end`.

    Nothing here is written anywhere: copies and pickles of an optimizer get a
    fresh boundary.
    """

    def __init__(self) -> None:
        self._serial = 0
        self._owner: Optional[weakref.ref] = None
        self.current: Optional[ChunkTag] = None  # the chunk last handed to the loop (None: untagged)
        self.open_batch: Optional[int] = None  # the logical batch of the open step (None: no tagged open step)
        self._counted: set = set()  # chunks of the open step whose examples are counted
        self.examples: Optional[int] = 0  # examples of the counted chunks (private, memory only)
        self.rows: Optional[int] = 0  # examples forwarded into the open step (rows / K; private, memory only)
        self._owed: Optional[int] = None  # a BatchMemoryManager batch handed out and not yet released
        self._owed_position: Optional[int] = None  # its cyclic position (ChunkTag.position)
        self._public = 0  # stand-in rows the next step_chunk does not count (public_rows)
        self.chunk_public = 0  # of the chunk step_chunk counted last: its public stand-in rows (no user's)
        self._sampler: Any = None  # the sampler of the tagging loader make_private built (None: untagged)
        self.released = 0  # serial of the last logical batch released (0: none; public, a count of steps)
        self._drawn_at_hand = 0  # the sampler's draws when the last tag was handed out (public count)
        self._untagged = 0  # releases of untagged data since the last tag was handed out (public count)

    def __getstate__(self) -> dict:
        """A copy starts with no open step and no private count."""
        return {
            "_serial": self._serial,
            "_owner": None,
            "current": None,
            "open_batch": None,
            "_counted": set(),
            "examples": 0,
            "rows": 0,
            "_owed": None,
            "_owed_position": None,
            "_public": 0,
            "chunk_public": 0,
            "_sampler": None,  # a copy of the optimizer has no loader
            "released": 0,
            "_drawn_at_hand": 0,
            "_untagged": 0,
        }

    def bind(self, optimizer: Any) -> None:
        """Close open steps through ``optimizer`` (held weakly)."""
        if self._owner is None or self._owner() is not optimizer:
            self._owner = weakref.ref(optimizer)

    def expect_tags(self, sampler: Any) -> None:
        """The optimizer's data comes from a loader that tags every batch it hands out (make_private's loader,
        and dpopt's BatchMemoryManager over it), whose batches ``sampler`` draws: a Poisson sampler (its
        ``drawn``: the public count of batches drawn) or a cyclic one (it has a ``clock``,
        :mod:`dpopt.cyclic_batches`; its tags carry a ``position``). From now on :meth:`admit` refuses a
        ``step()`` on data the loader did not hand out, or one that would release a batch as another release
        than its own (a Poisson batch already released; a cyclic batch of another step)."""
        self._sampler = sampler
        self._drawn_at_hand = self._drawn()
        self._untagged = 0

    @property
    def cyclic(self) -> bool:
        """Whether the tagging loader's sampler is cyclic (correlated noise): release t holds the batch of step t."""
        return hasattr(self._sampler, "clock")

    def _drawn(self) -> int:
        return int(getattr(self._sampler, "drawn", 0) or 0)

    def admit(self, release: int) -> None:
        """May the ``step()`` being taken add its data to release ``release``? The one check of every tagging
        loader (:meth:`expect_tags`), asked before anything of the step is read; loaders that do not tag are
        not checked.

        Args:
            release: the 0-based index of the release the step's data would go into (the releases made so
                far, ``Privatizer.steps``).

        The rule is the sampler's (module docstring). Cyclic: the current tag's ``position`` must be
        ``release`` (:meth:`_check_position`). Poisson: accepted while the loader's sampler has drawn more
        Poisson batches since the last tag was handed out than untagged steps have released since (Opacus's
        own ``BatchMemoryManager`` over make_private's loader iterates the sampler directly and signals its
        chunks: at most one release per batch drawn; the last tag, stale, is then forgotten and the step is
        untagged), or else on the current tag's logical batch while it is not yet released (its chunks, a
        refused step retried). The loader hands each batch's tag after drawing it (prefetching workers too),
        so its own loop never counts as drawn around it.

        Raises:
            ValueError: Poisson: no tagged batch was handed out and no Poisson batch drawn for this step (a
                step on the original data loader's batches), or the current batch was already released (a
                second ``step()`` on one batch, or steps on another loader's batches after one of
                make_private's): the ledger would charge each as a Poisson-subsampled release at q, an
                amplification that did not happen.
            RuntimeError: cyclic: as :meth:`_check_position`.
        """
        if self._sampler is None:
            return
        tag = self.current
        if self.cyclic:
            self._check_position(None if tag is None else tag.position, release)
            return
        if self._drawn() - self._drawn_at_hand > self._untagged:
            self.current = None  # the last tag is stale: the step's data is a Poisson batch drawn around the loader
            return
        if tag is not None and tag.batch > self.released:
            return
        what = (
            "no batch of the data loader make_private returned was handed out for it"
            if tag is None
            else "the data loader's last batch was already released by an earlier step() (a second step() on one "
            "batch puts its examples in two releases; or the loop moved on to batches of another loader)"
        )
        raise ValueError(
            f"optimizer.step() refused: {what}. Each release is charged in the ledger as a Poisson-subsampled "
            "Gaussian step at the loader's sample_rate, which holds only for a batch that make_private's Poisson "
            "loader drew, released once: the original DataLoader's batches (shuffled, fixed size) are not Poisson "
            "samples. Iterate the data loader make_private returned (or dpopt's BatchMemoryManager over it) and "
            "call optimizer.step() once per batch (pass poisson_sampling=False to train on your own batches, "
            f"without the Poisson epsilon); {NOTHING_RELEASED}"
        )

    def _check_position(self, position: Optional[int], release: int) -> None:
        """The cyclic rule of :meth:`admit`: release ``release`` (0-based) may hold only the batch of step
        ``release`` (``position``: the tag's, None for data the cyclic loader did not hand out). The
        sensitivity of correlated noise is computed for cyclic batch t mod b at release t (k participations
        exactly b steps apart, docs/correlated-noise.md).

        Raises:
            RuntimeError: ``position`` is None or not ``release``.
        """
        if position is None:
            raise RuntimeError(
                f"correlated noise: release {release + 1} (1-based) holds a batch that the cyclic loader "
                "make_private returned did not hand out (the original data loader's, or a wrapper's that "
                "bypasses it): its participation pattern is not the one the sensitivity was computed for. "
                "Iterate the loader make_private returned (or dpopt's BatchMemoryManager over it); "
                f"{NOTHING_RELEASED} (docs/correlated-noise.md)"
            )
        if int(position) != int(release):
            raise RuntimeError(
                f"correlated noise: release {release + 1} (1-based) would hold the cyclic batch of step "
                f"{int(position) + 1}; the sensitivity (k participations exactly b steps apart) holds only for "
                "release t holding the batch of step t. Call optimizer.step() exactly once per batch of the "
                "loader make_private returned (a batch skipped with `continue` is released as pure noise); "
                f"{NOTHING_RELEASED} (docs/correlated-noise.md)"
            )

    def new_batch(self) -> int:
        """A fresh serial number for a logical batch just drawn."""
        self._serial += 1
        return self._serial

    def hand(self, tag: Optional[ChunkTag], owed: bool = False) -> None:
        """A loader gives ``tag``'s chunk to the loop (None: a batch it could not tag).

        A step open for another logical batch is closed first, as its own
        release. With ``owed`` (``BatchMemoryManager``'s chunks) every logical
        batch handed out is released exactly once: a batch the loop skipped
        entirely (``if len(x) == 0: continue`` on an empty batch, an exception
        before any ``step()`` of it) is released as pure noise (charged) when the
        loop moves on, so the number of releases does not depend on the data and
        data-parallel ranks release in step.
        """
        if self._owner_open() and (tag is None or self.open_batch is None or tag.batch != self.open_batch):
            self.close()
        elif self._owed is not None and (tag is None or tag.batch != self._owed):
            self._release_owed()
        if owed and tag is not None:
            self._owed, self._owed_position = tag.batch, tag.position
        if tag is not None:  # draws from here on that no tag follows: Poisson batches taken around the loader
            self._drawn_at_hand, self._untagged = self._drawn(), 0
        self.current = tag

    def settle(self) -> None:
        """Forget a batch handed out with ``owed`` and never stepped, unless a step is open.

        The cyclic samplers call it (through their ``clock``) before a new pass starts: that pass begins at
        the batch of the next release (:mod:`dpopt.cyclic_batches`), i.e. it hands the forgotten batch out
        again, so it needs no pure-noise release (a batch looked at with ``next(iter(loader))`` costs nothing).
        """
        if self._owed is not None and not self._owner_open():
            self._owed, self._owed_position = None, None

    def pass_ended(self) -> None:
        """A pass of a cyclic loader ran to its end (its iterator was exhausted): a batch it handed out and no
        step released (the loop's ``continue`` on the pass's last batch, a ``step()`` that raised) is released
        as pure noise now, by the same owed-release path as a batch skipped mid-pass (:meth:`hand`). Without it
        the next pass, which starts at the batch of the next release, would hand that batch out again and train
        on it, and the run would end one release short of its horizon. A pass left by ``break`` never gets here
        (the generator is not resumed): its batch is handed out again by the next pass (:meth:`settle`).

        Raises:
            LedgerWriteError: the pure-noise release's ledger entry could not be written (the batch stays owed).
        """
        if self._owed is not None and not self._owner_open():
            self._release_owed()

    def leave(self) -> None:
        """The loop left the chunk iterator or the ``BatchMemoryManager`` context: close an open step
        (or release a batch handed out and skipped entirely, as pure noise)."""
        if self._owner_open():
            self.close()
        elif self._owed is not None:
            self._release_owed()
        self._owed, self._owed_position = None, None
        self.current = None

    def _release_owed(self) -> None:
        """Release the owed batch as pure noise; a failed ledger write (nothing released) leaves it owed."""
        owner = None if self._owner is None else self._owner()
        before = (self._owed, self._owed_position, self.released)
        self.released = max(self.released, int(self._owed or 0))  # released as pure noise below
        position, self._owed, self._owed_position = self._owed_position, None, None
        if owner is not None:
            if self.cyclic:  # the pure-noise release of a cyclic batch passes admit's position rule too
                self._check_position(position, int(owner.privatizer.steps))
            try:
                owner._release_skipped_batch()
            except LedgerWriteError:
                self._owed, self._owed_position, self.released = before
                raise

    def _owner_open(self) -> bool:
        owner = None if self._owner is None else self._owner()
        return owner is not None and bool(getattr(owner, "_open", False))

    def close(self) -> None:
        """Release the open step now (the owner's ``_close_open_step``); forget it if the owner is gone."""
        owner = None if self._owner is None else self._owner()
        try:
            if owner is not None and getattr(owner, "_open", False):
                owner._close_open_step()
        except LedgerWriteError:  # nothing released: the batch is not spent
            self.end(released=False)
            raise
        self.end()

    # -- the optimizer's side -------------------------------------------------------
    def begin(self) -> None:
        """The optimizer opened a step: it belongs to the current chunk's batch (if tagged)."""
        self.open_batch = None if self.current is None else self.current.batch
        self._counted, self.examples, self.rows = set(), 0, 0

    def public_rows(self, rows: int) -> None:
        """The next ``step()``'s chunk holds ``rows`` PUBLIC stand-in rows that are no example of the batch.

        For a zero-weight stand-in chunk (one public row whose loss is multiplied by 0, so its
        per-example gradient is exactly 0): ``DPTrainer`` runs them so that every rank of an FSDP2
        model runs the same number of forward/backward passes (:func:`dpopt.hf.distributed.padded`).
        They add exactly 0 to the clipped sum and are not counted as forwarded examples by the next
        :meth:`step_chunk` (the rows-vs-examples check compares only real rows).

        Raises:
            ValueError: ``rows`` < 0.
        """
        if rows < 0:
            raise ValueError(f"public_rows takes a count >= 0, got {rows}")
        self._public += int(rows)

    def step_chunk(self, rows: Optional[int]) -> Optional[bool]:
        """Count ``rows`` examples forwarded in this ``step()`` against the current chunk.

        Returns:
            Whether this ``step()`` releases according to the chunk's tag
            (True on a chunked batch's last chunk, False before it), or None
            when the tag does not say (an untagged or single-chunk batch:
            ``signal_skip_step`` decides).
        """
        tag = self.current
        public, self._public = self._public, 0
        self.chunk_public = public
        if rows is None or self.rows is None:
            self.rows = None
        else:
            self.rows += max(0, int(rows) - public)
        if tag is None:
            self.examples = None
            return None
        if tag.batch == self.open_batch and (tag.chunk not in self._counted):
            self._counted.add(tag.chunk)
            if self.examples is not None and tag.examples is not None:
                self.examples += int(tag.examples)
            elif tag.examples is None:
                self.examples = None
        return self.tagged_release()

    def tagged_release(self) -> Optional[bool]:
        """Whether the current chunk's tag says the next ``step()`` releases (True on a chunked batch's last
        chunk, False before it); None when the tag does not say (an untagged or single-chunk batch). Reads
        nothing but the tag: the optimizer asks it before the step's per-sample work (issue 43)."""
        tag = self.current
        if tag is None or tag.chunks <= 1:
            return None
        return tag.last

    def counts(self) -> tuple[Optional[int], Optional[int]]:
        """(examples forwarded, examples of the chunks stepped) of the open step; None where unknown.

        Both are private: compare them in this process, never print them.
        """
        if self.open_batch is None:
            return self.rows, None
        return self.rows, self.examples

    def end(self, released: bool = True) -> None:
        """The open step was released, or discarded (``released=False``: a failed or refused ``step()``). A
        discarded Poisson batch is then not owed a pure-noise release either (nothing is released for a
        refusal); a discarded CYCLIC batch (a tag with a ``position``) stays owed, so that the loop can go on
        (e.g. after catching an out-of-memory error) with release t still holding the batch of step t."""
        if self._owed is not None and self.open_batch == self._owed and (released or self._owed_position is None):
            self._owed, self._owed_position = None, None
        if released and self.open_batch is not None:  # a tagged batch is released once (admit)
            self.released = max(self.released, self.open_batch)
        elif released:
            self._untagged += 1
        self.open_batch = None
        self._counted, self.examples, self.rows = set(), 0, 0


def boundary_of(optimizer: Any) -> ReleaseBoundary:
    """The :class:`ReleaseBoundary` of ``optimizer`` (made on first use, bound to it)."""
    bd = optimizer.__dict__.get("_boundary")
    if bd is None:
        bd = optimizer.__dict__["_boundary"] = ReleaseBoundary()
    bd.bind(optimizer)
    return bd
