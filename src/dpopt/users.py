"""User-level DP: the USER is the privacy unit — users are Poisson-sampled and clipped as units.

The algorithm (Charles et al. 2024, "Fine-tuning large language models with
user-level differential privacy", arXiv 2407.07737, user-level sampling "ULS";
Chua et al. 2024, "Mind the privacy unit!", arXiv 2406.14322), per logical step::

    S      = {u : U_u < q}                       # Poisson sample of the N_users users at q_user
    R_u    = ≤ k records of u, uniformly at random # chosen from the secret stream, never from content
    ḡ_u    = (1/|R_u|) Σ_{i ∈ R_u} g_i            # ONE vector per user (its records' mean gradient)
    w̄_u    = ḡ_u · min(1, C / ‖ḡ_u‖)               # clipped as one unit
    g̃      = (Σ_{u ∈ S} w̄_u + N(0, σ² C² I)) / B̄  # B̄ = q_user · N_users (expected users)

Adding or removing one user (ALL of their records) adds or removes one term
w̄_u of norm ≤ C, so the step is the sampled Gaussian mechanism at q_user with
sensitivity C and the accountants' ε (add/remove one user) holds for users.
``k`` = ``max_records_per_user`` bounds the compute per user and is a public
hyperparameter; it changes no privacy quantity (the clip is on the user's
mean, whatever its number of records). N_users is treated as public (like N
for record-level DP; the ledger header records it).

This module holds the two pieces the doors share: :class:`UserPoissonBatchSampler`
/ :class:`UserDPDataLoader` (who is in a batch, and which rows belong to
whom: private, in memory only) and :func:`group_by_user` (a per-example
gradient source turned into a per-user one, exactly, before any clip factor).
The optimizer (:class:`~dpopt.private_optimizer.PrivateOptimizer`) calls
:func:`group_by_user` on every chunk it is handed (:class:`UserRows`).
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from typing import Any, Callable, Hashable, Iterator, Optional, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from .accounting.events import check_sample_rate
from .data_loader import DPDataLoader, EmptyBatchCollate
from .engine.reference import PerSampleGrads
from .noise import NoiseSource, make_noise_source
from .types import ClipGeometry

__all__ = [
    "PRIVACY_UNITS",
    "DEFAULT_MAX_RECORDS_PER_USER",
    "check_max_records",
    "check_privacy_unit",
    "users_of",
    "group_users",
    "user_unit_text",
    "UserPoissonBatchSampler",
    "UserDPDataLoader",
    "UserRows",
    "group_by_user",
    "user_sources",
    "user_cuts",
    "group_privacy",
]

PRIVACY_UNITS = ("record", "user", "block")
DEFAULT_MAX_RECORDS_PER_USER = 16  # k: a public default, independent of the data


def check_privacy_unit(unit: Any) -> str:
    """``unit`` checked against :data:`PRIVACY_UNITS` (``"record"`` | ``"user"`` | ``"block"``).

    Raises:
        ValueError: any other value (the message lists the choices).
    """
    if unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {unit!r}")
    return str(unit)


def user_unit_text(max_records_per_user: int) -> str:
    """The ledger header's ``privacy_unit`` text of user-level DP: ``"user (at most k records each)"``."""
    return f"user (at most {int(max_records_per_user)} records each)"


def users_of(user_ids: Sequence[Hashable], num_records: int) -> list[list[int]]:
    """The records of each user: ``[[i, ...] per user]``, users in order of first appearance
    (:func:`group_users` without the keys; same arguments and errors)."""
    return group_users(user_ids, num_records)[1]


def group_users(user_ids: Sequence[Hashable], num_records: int) -> tuple[list[str], list[list[int]]]:
    """(each user's key ``repr(id)``, the records of each user), users in order of first appearance.

    Args:
        user_ids: one id per record (any hashable: int, str; tensors/arrays of ints are read as ints),
            ``len(user_ids) == num_records``.
        num_records: N, the dataset's length.

    Raises:
        ValueError: a length that is not N, an unhashable id, or no record at all.
    """
    if isinstance(user_ids, Tensor):
        user_ids = user_ids.tolist()
    elif hasattr(user_ids, "tolist") and not isinstance(user_ids, (list, tuple)):
        user_ids = user_ids.tolist()  # numpy arrays
    ids = list(user_ids)
    if len(ids) != int(num_records):
        raise ValueError(
            f"user_ids must give one user id per record of the dataset: got {len(ids)} ids for "
            f"{int(num_records)} records"
        )
    if not ids:
        raise ValueError("user_ids is empty: there is no user to sample")
    slots: dict = {}
    out: list[list[int]] = []
    for i, uid in enumerate(ids):
        try:
            s = slots.setdefault(uid, len(out))
        except TypeError:
            raise ValueError(
                f"user ids must be hashable (int or str), got {type(uid).__name__} at record {i}"
            ) from None
        if s == len(out):
            out.append([])
        out[s].append(i)
    keys = [""] * len(out)
    for uid, s in slots.items():
        keys[s] = repr(uid)
    return keys, out


def check_max_records(k: Any) -> int:
    """``max_records_per_user`` k as an int ≥ 1.

    Raises:
        ValueError: not an integer ≥ 1.
    """
    if isinstance(k, bool) or not isinstance(k, (int,)) and not (isinstance(k, float) and k.is_integer()):
        raise ValueError(f"max_records_per_user must be an integer >= 1, got {k!r}")
    if int(k) < 1:
        raise ValueError(f"max_records_per_user must be an integer >= 1, got {k!r}")
    return int(k)


class UserPoissonBatchSampler(Sampler):
    """A ``batch_sampler`` of user-level Poisson batches: ``steps`` per epoch.

    Each step every user joins independently with probability q (53-bit
    uniforms compared in float64, as :class:`~dpopt.sampling.PoissonSampler`);
    a joining user with more than k records contributes the k of them with the
    smallest keyed hashes BLAKE2b(seed; user key, record's position in the user)
    — k uniformly random records, never chosen by content — where the 256-bit
    ``seed`` is drawn from the secret stream at every step (before the mask; never
    stored). A user's choice depends only on the seed, its key and its own
    records, so adding or removing another user changes no other user's
    records (the coupling the sensitivity argument uses). The batch lists each
    sampled user's records consecutively, users in order.

    Args:
        users: the records of each user (:func:`users_of`); N_users = ``len(users)`` (public).
        sample_rate: q_user ∈ (0, 1].
        steps: batches per epoch (≥ 1).
        max_records_per_user: k ≥ 1.
        noise: the :class:`~dpopt.noise.NoiseSource` of the masks and the record choices (default: secret).
        keys: each user's public key (its id as text, :func:`group_users`); default its position.
        ctx: data parallel (a :class:`~dpopt.distributed.DistributedContext` of several ranks): this
            rank samples ITS contiguous shard of the users only (:func:`~dpopt.distributed.shard_bounds`
            over N_users; indices stay global). Every user is on exactly one rank and joins with
            probability q, so the union over ranks is ONE user-level Poisson sample of all N_users users
            (the one-process event); a user's records are chosen on its rank. With reproducible noise
            every rank draws the masks of ALL users from the shared stream and keeps its shard's (the
            union is then the one-process batch of the same seed), as
            :class:`~dpopt.distributed.ShardedPoissonSampler` does for records.

    Attributes:
        sizes, groups: per batch drawn and not yet handed out by :class:`UserDPDataLoader`, the number
            of rows and the user slot (0, 1, ... in batch order) of each row — PRIVATE, memory only,
            never pickled.

    Raises:
        ValueError: no user, q outside (0, 1], steps < 1, k < 1.
    """

    def __init__(
        self,
        users: Sequence[Sequence[int]],
        sample_rate: float,
        steps: int,
        max_records_per_user: int,
        noise: Optional[NoiseSource] = None,
        keys: Optional[Sequence[str]] = None,
        ctx: Any = None,
    ):
        if not users:
            raise ValueError("there is no user to sample")
        if keys is not None and len(keys) != len(users):
            raise ValueError(f"{len(keys)} user keys for {len(users)} users")
        self.keys = [str(i) for i in range(len(users))] if keys is None else [str(k) for k in keys]
        if int(steps) < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.users = [list(r) for r in users]
        self.sample_rate = check_sample_rate(sample_rate)
        self.steps = int(steps)
        self.max_records_per_user = check_max_records(max_records_per_user)
        self.noise = make_noise_source(noise)
        self.lo, self.hi = 0, len(self.users)  # this rank's users (all of them on one process)
        if ctx is not None and ctx.enabled:
            from .distributed import shard_bounds

            self.lo, self.hi = shard_bounds(len(self.users), ctx.rank, ctx.world_size)
        self.drawn = 0
        self.position = 0  # batches drawn by :meth:`sample` (dpopt's own loop; its checkpoints)
        self.sizes: deque = deque(maxlen=1024)
        self.groups: deque = deque(maxlen=1024)

    @property
    def num_users(self) -> int:
        """N_users (public)."""
        return len(self.users)

    def __getstate__(self) -> dict:
        """Copies and pickles never carry the drawn batches (private)."""
        state = dict(self.__dict__)
        state["sizes"], state["groups"] = deque(maxlen=1024), deque(maxlen=1024)
        return state

    def __len__(self) -> int:
        return self.steps

    def sample(self) -> tuple[Tensor, Tensor]:
        """The next of ``steps`` batches of a run (dpopt's loop): (record indices, each row's user slot),
        both int64 tensors; advances :attr:`position`.

        Raises:
            StopIteration: all ``steps`` batches were drawn.
        """
        if self.position >= self.steps:
            raise StopIteration
        rows, slots = self._draw()
        self.position += 1
        return torch.tensor(rows, dtype=torch.int64), slots

    def state_dict(self) -> dict:
        """Public state (``position``, ``steps``, ``sample_rate``, k; never the users or their records);
        the generator state for reproducible noise only."""
        state: dict[str, Any] = {
            "version": 1,
            "unit": "user",
            "position": self.position,
            "steps": self.steps,
            "sample_rate": self.sample_rate,
            "max_records_per_user": self.max_records_per_user,
        }
        if self.noise.mode == "reproducible":
            state["noise_state"] = self.noise.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`: the next batch :meth:`sample` draws is batch ``position``.

        Raises:
            ValueError: a state of another sampler (unit, rate, steps or k differ).
        """
        mine = self.state_dict()
        for key in ("unit", "steps", "sample_rate", "max_records_per_user"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"sampler state with {key} = {state.get(key)!r} does not fit this sampler ({mine[key]!r})"
                )
        if not 0 <= int(state["position"]) <= self.steps:
            raise ValueError(f"sampler position {state['position']} outside [0, {self.steps}]")
        self.position = int(state["position"])
        if "noise_state" in state:
            self.noise.load_state_dict(state["noise_state"])

    def _chosen(self) -> list[int]:
        """The users of this rank's shard that join this step (global user positions, in order)."""
        q, lo, hi = self.sample_rate, self.lo, self.hi
        if self.noise.mode == "reproducible" or (lo, hi) == (0, len(self.users)):  # the whole draw (shared stream)
            joined = (self.noise.uniform(len(self.users)) < q).nonzero(as_tuple=True)[0]
            return [u for u in joined.tolist() if lo <= u < hi]
        return (self.noise.uniform(hi - lo) < q).nonzero(as_tuple=True)[0].add_(lo).tolist()

    def _draw(self) -> tuple[list[int], Tensor]:
        """One batch: (record indices, user slot of each row as an int64 tensor)."""
        words = (self.noise.uniform(5) * 2.0**53).to(torch.int64).tolist()  # 265 secret bits, drawn every step
        seed = b"".join(int(w).to_bytes(7, "little") for w in words)[:32]
        chosen = self._chosen()
        rows: list[int] = []
        slots: list[int] = []
        k = self.max_records_per_user
        for slot, u in enumerate(chosen):
            recs = self.users[u]
            if len(recs) > k:  # the k smallest keyed hashes: k uniformly random records, kept in record order
                pick = sorted(sorted(range(len(recs)), key=lambda j: _keyed(seed, self.keys[u], j))[:k])
                recs = [recs[j] for j in pick]
            rows.extend(recs)
            slots.extend([slot] * len(recs))
        return rows, torch.tensor(slots, dtype=torch.int64)

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            rows, slots = self._draw()
            self.drawn += 1
            self.sizes.append(len(rows))
            self.groups.append(slots)
            yield rows


def _keyed(seed: bytes, key: str, j: int) -> bytes:
    """BLAKE2b keyed by the step's secret seed over (user key, record position): a pseudo-random rank."""
    return hashlib.blake2b(f"{key}\x00{j}".encode(), key=seed, digest_size=16).digest()


class UserDPDataLoader(DPDataLoader):
    """A :class:`~dpopt.data_loader.DPDataLoader` whose batches are user-level Poisson samples.

    Args:
        dataset: a map-style dataset of N records.
        users: the records of each user (:func:`users_of`).
        sample_rate: q_user ∈ (0, 1]; expected users per batch q_user · N_users.
        steps: batches per epoch (default ``round(1/q_user)``).
        max_records_per_user: k ≥ 1 records per sampled user at most.
        collate_fn, noise: as :class:`~dpopt.data_loader.DPDataLoader`.
        keys: each user's key (:func:`group_users`; the record choice of a user depends on it).
        ctx: data parallel: this rank's shard of the users only (:class:`UserPoissonBatchSampler`).
        **kwargs: other ``DataLoader`` options (``num_workers``, ...).

    Attributes:
        last_batch_rows: the :class:`UserRows` of the batch last yielded (PRIVATE, memory only): which
            rows belong to which user; the optimizer groups each chunk's per-example gradients with it.

    Raises:
        ValueError: as the sampler; an ``IterableDataset``.
    """

    def __init__(
        self,
        dataset: Dataset,
        users: Sequence[Sequence[int]],
        sample_rate: float,
        max_records_per_user: int,
        steps: Optional[int] = None,
        collate_fn: Optional[Callable] = None,
        noise: Optional[NoiseSource] = None,
        keys: Optional[Sequence[str]] = None,
        ctx: Any = None,
        **kwargs: Any,
    ):
        if not hasattr(dataset, "__len__"):
            raise ValueError("user-level sampling needs a map-style dataset (with __len__ and __getitem__)")
        q = check_sample_rate(sample_rate)
        steps = int(round(1.0 / q)) if steps is None else int(steps)
        self.sample_rate = q
        self.poisson = UserPoissonBatchSampler(
            users, q, max(1, steps), max_records_per_user, noise=noise, keys=keys, ctx=ctx
        )  # type: ignore[assignment]  # same sizes/drawn interface
        DataLoader.__init__(
            self, dataset, batch_sampler=self.poisson, collate_fn=EmptyBatchCollate(dataset, collate_fn), **kwargs
        )
        self.last_batch_examples: Optional[int] = None
        self.last_batch_rows: Optional[UserRows] = None
        self.boundary = None

    def __iter__(self):
        """The batches in order; :attr:`last_batch_rows` says whose each row of the last one is."""
        self.poisson.groups.clear()
        self.last_batch_rows = None
        for batch in super().__iter__():
            in_order = getattr(self, "in_order", True)
            self.last_batch_rows = UserRows(self.poisson.groups.popleft()) if in_order and self.poisson.groups else None
            yield batch

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["last_batch_rows"] = None
        return state


class UserRows:
    """Which rows of one logical batch belong to which user, and how far the optimizer has read it.

    Args:
        slots: int64 ``[rows]``, the user slot of each row, non-decreasing (a user's rows are consecutive).

    PRIVATE (the realised batch): kept in memory only. :meth:`take` hands out the slots of the
    next chunk of ``rows`` rows and refuses a chunk that would split a user (its records would be
    clipped as two units: sensitivity 2C, not C).
    """

    def __init__(self, slots: Tensor):
        self.slots = slots
        self.offset = 0

    def take(self, rows: int) -> Tensor:
        """The slots (renumbered from 0) of the next ``rows`` rows.

        Raises:
            ValueError: more rows than the batch has left, or a chunk that ends inside a user.
        """
        lo, hi = self.offset, self.offset + int(rows)
        n = int(self.slots.numel())
        if hi > n:
            raise ValueError(
                "privacy_unit='user': this step's forward passes carried more rows than the user-level data "
                "loader's batch: forward its rows as they are (each user's records are consecutive); nothing "
                "was released"
            )
        if 0 < hi < n and bool(self.slots[hi - 1] == self.slots[hi]):
            raise ValueError(
                "privacy_unit='user': a physical chunk ends inside a user's records, which would clip that "
                "user as two units (sensitivity 2C): cut batches only between users (DPTrainer and "
                "dpopt's loop do), or step once per batch; nothing was released"
            )
        self.offset = hi
        part = self.slots[lo:hi]
        return part - part[0] if part.numel() else part


def group_by_user(source: Any, slots: Tensor) -> PerSampleGrads:
    """A per-example gradient source → the per-USER source of its users' mean gradients (exact).

    ḡ_u = (1/n_u) Σ_{i: slots[i] = u} g_i for each user slot u, computed BEFORE any clip factor
    (Charles et al. 2024, arXiv 2407.07737, ULS): the Privatizer then clips ‖ḡ_u‖ — the user's
    norm, not its records' — so the clipped sum moves by ≤ C when one user is removed.

    Args:
        source: a :class:`~dpopt.types.PerSampleSource` of B rows (per-example gradients).
        slots: int64 ``[B]``, the user slot of each row (0 … U−1, non-decreasing). Empty ``slots``
            with B > 0 rows means the rows carry no record (DPTrainer's public stand-in for an empty
            batch): 0 users.

    Returns:
        a :class:`~dpopt.engine.reference.PerSampleGrads` of U rows (materialised: U × P floats), with
        the source's ``params`` and ``points``; its ``nonfinite`` counts users.

    Raises:
        ValueError: ``slots`` of another length than B.

    Materialised per-example gradients are summed with ``index_add`` into per-user slots; any
    other source (factored, ghost) gives each user's sum by one ``weighted_sum`` with that user's
    indicator weights (``weighted_sum`` is linear in the weights: exact, U calls).
    """
    b = int(getattr(source, "batch_size", slots.numel()))
    params = getattr(source, "params", None)
    points = getattr(source, "points", None)
    if slots.numel() == 0:  # no record in this chunk: zero users (a stand-in row's gradient is not data)
        like = _param_likes(source, params)
        return PerSampleGrads([_no_rows(p) for p in like], params=params, points=points)
    if slots.numel() != b:
        raise ValueError(
            "privacy_unit='user': the per-example gradients of this step do not match the rows of the "
            "user-level loader's batch (the loop forwarded other rows than it yielded); nothing was released"
        )
    num_users = int(slots[-1]) + 1
    counts = torch.bincount(slots, minlength=num_users)
    grads = getattr(source, "grads", None)
    if isinstance(source, PerSampleGrads) and grads is not None:
        out = []
        for g in grads:
            acc = g.new_zeros((num_users, *g.shape[1:]))
            acc.index_add_(0, slots.to(g.device), g)
            out.append(acc / counts.to(g.device, g.dtype).view(-1, *([1] * (g.dim() - 1))))
        return PerSampleGrads(out, params=params, points=points)
    identity, flat = ClipGeometry(), [0] * int(source.num_params)
    device = getattr(source, "device", slots.device)
    per_user: list[list[Tensor]] = []
    for u in range(num_users):
        w = ((slots == u).to(torch.float64) / float(counts[u])).to(device)
        per_user.append(source.weighted_sum(w.view(-1, 1), identity, flat))
    stacked = [torch.stack([pu[j] for pu in per_user]) for j in range(int(source.num_params))]
    return PerSampleGrads(stacked, params=params, points=points)


def _no_rows(p: Tensor) -> Tensor:
    """A plain ``[0, *p.shape]`` tensor of ``p``'s dtype on its (local) device; ``p`` may be an FSDP2 shard
    (a ``DTensor``: its global shape, never DTensor arithmetic in a source)."""
    local = p.to_local() if hasattr(p, "to_local") else p
    return torch.zeros((0, *p.shape), dtype=p.dtype, device=local.device)


def _param_likes(source: Any, params: Optional[Sequence[Tensor]]) -> list[Tensor]:
    """Tensors shaped like the source's parameters (its ``params``, else one all-zero weighted sum)."""
    if params is not None:
        return list(params)
    rows = int(getattr(source, "batch_size", 0))
    zeros = torch.zeros(rows, 1, dtype=torch.float64, device=getattr(source, "device", "cpu"))
    return list(source.weighted_sum(zeros, ClipGeometry(), [0] * int(source.num_params)))


def user_cuts(slots: Tensor, max_rows: Optional[int]) -> list[tuple[int, int]]:
    """Row ranges ``[(lo, hi), ...]`` covering a batch whose rows are grouped by user, cut between users
    only: consecutive whole users, ≤ ``max_rows`` rows per range unless one user alone has more
    (then that user is a range of its own). An empty batch is ``[(0, 0)]``.

    Args:
        slots: int64 ``[rows]``, each row's user slot (non-decreasing).
        max_rows: the physical batch size (None: one range).
    """
    n = int(slots.numel())
    limit = n if max_rows is None else max(1, int(max_rows))
    starts = [0] + [i for i in range(1, n) if int(slots[i]) != int(slots[i - 1])] + [n]
    cuts, lo = [], 0
    for a, b in zip(starts[:-1], starts[1:]):  # the rows [a, b) of one user
        if b - lo > limit and a > lo:
            cuts.append((lo, a))
            lo = a
    cuts.append((lo, n))
    return cuts


def user_sources(
    make_sources: Callable[[Tensor, Tensor, int], Iterator[Any]],
    x: Tensor,
    y: Tensor,
    slots: Tensor,
    max_rows: Optional[int],
) -> Iterator[PerSampleGrads]:
    """Per-user sources of one batch (dpopt's loop): chunks of whole users (≤ ``max_rows`` rows unless
    one user has more), each chunk's per-example source grouped by :func:`group_by_user`.

    Args:
        make_sources: ``(x_chunk, y_chunk, rows) -> iterator of per-sample sources`` (one chunk each).
        x, y: the batch (rows grouped by user, as :meth:`UserPoissonBatchSampler.sample` orders them).
        slots: int64 ``[rows]``, each row's user slot.
        max_rows: the physical batch size (None: the whole batch is one chunk).
    """
    for a, b in user_cuts(slots, max_rows):
        part = slots[a:b]
        for src in make_sources(x[a:b], y[a:b], max(1, b - a)):
            yield group_by_user(src, part - part[0] if part.numel() else part)


def group_privacy(epsilon: float, delta: float, k: int) -> tuple[float, float]:
    """(ε', δ') that record-level (ε, δ)-DP gives a person with k records (group privacy).

    ε' = k·ε and δ' = k·e^{(k−1)ε}·δ (Dwork & Roth 2014, Theorem 2.2 and its (ε, δ) form:
    δ' = Σ_{j<k} e^{jε} δ ≤ k e^{(k−1)ε} δ). Tighter group bounds exist for specific mechanisms
    (the Gaussian mechanism's group sensitivity k·C); this is the generic one.

    Raises:
        ValueError: ε < 0, δ outside [0, 1), or k < 1.
    """
    if not epsilon >= 0 or not 0 <= delta < 1 or int(k) < 1:
        raise ValueError(f"need epsilon >= 0, delta in [0, 1) and k >= 1, got {epsilon}, {delta}, {k}")
    k = int(k)
    return k * float(epsilon), min(1.0, k * math.exp((k - 1) * float(epsilon)) * float(delta))
