"""Packing within a user: each user's token stream is cut into blocks of its own (never a block of two users).

User-level DP with packed texts (``DPSFTTrainer(privacy_unit="user", packing=True)``;
Charles et al., "Fine-tuning LLMs with user-level DP", arXiv 2407.07737, §3: a
user's contribution is built from that user's data only). TRL's wrapped packing
concatenates the whole dataset and cuts it every ``seq_length`` tokens, so a
block straddles two users and removing one user would change another user's
block. Here each user's examples are concatenated (in dataset order) into ONE
row, and TRL's own :func:`trl.pack_dataset` (``strategy="wrapped"``) cuts the
rows one at a time (``batch_size=1``: a map batch is one user, and wrapped
packing never crosses a map batch). A per-token provenance column is packed
along with the tokens and checked: every block's tokens come from one user.

The output has one row per block: ``input_ids`` and ``labels`` (the user's
label masks kept, e.g. completion-only) and the user column holding that
block's user id. A user with T tokens has ceil(T / seq_length) blocks, all
full but the last. Blocks are that user's records for user-level sampling
(``max_records_per_user`` k bounds the blocks a sampled user brings).
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["pack_by_user"]

_ROW = "__dpopt_user_row__"  # per-token provenance: the index of the user whose token it is


def pack_by_user(
    dataset: Any,
    seq_length: int,
    user_column: str = "user_id",
    columns: tuple[str, ...] = ("input_ids", "labels"),
    map_kwargs: Optional[dict] = None,
) -> Any:
    """Pack a tokenized ``datasets.Dataset`` into blocks of ``seq_length`` tokens, each within one user.

    Args:
        dataset: a ``datasets.Dataset`` with list columns ``columns`` (token
            ids, labels; equal lengths per row) and the scalar ``user_column``.
        seq_length: the block length in tokens (≥ 1); TRL's ``max_length``.
        user_column: the column of user ids (any hashable values).
        columns: the token-aligned list columns packed (others are dropped).
        map_kwargs: extra keywords for ``Dataset.map`` (e.g. ``num_proc``,
            ``desc``); ``batch_size`` is fixed to 1 (one user per map batch).

    Returns:
        A ``datasets.Dataset`` of blocks: ``columns`` (≤ ``seq_length`` tokens
        each) and ``user_column`` (the block's user id); users in order of
        first appearance, each user's blocks in token order.

    Raises:
        ValueError: ``seq_length`` < 1, a missing column, or a row whose
            ``columns`` differ in length.
        RuntimeError: a packed block holding tokens of two users (a change in
            TRL's packing; never expected).
    """
    from datasets import Dataset
    from trl import pack_dataset

    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"pack_by_user: seq_length must be an integer >= 1, got {seq_length!r}")
    names = list(getattr(dataset, "column_names", None) or [])
    missing = [c for c in (*columns, user_column) if c not in names]
    if missing:
        raise ValueError(
            f"pack_by_user: the dataset has no column(s) {missing} (it has {names}); tokenize it first and "
            "give every example its user id (user_column=)"
        )
    streams: dict[Any, dict[str, list]] = {}
    data = {c: dataset[c] for c in columns}
    for i, user in enumerate(dataset[user_column]):
        row = [list(data[c][i]) for c in columns]
        if len({len(r) for r in row}) > 1:
            raise ValueError(f"pack_by_user: example {i} has columns {list(columns)} of different lengths")
        stream = streams.setdefault(user, {c: [] for c in columns})
        for c, values in zip(columns, row):
            stream[c].extend(values)
    users = list(streams)
    rows = {c: [streams[u][c] for u in users] for c in columns}
    rows[_ROW] = [[j] * len(streams[u][columns[0]]) for j, u in enumerate(users)]
    packed = pack_dataset(Dataset.from_dict(rows), seq_length, "wrapped", {**(map_kwargs or {}), "batch_size": 1})
    owners = packed[_ROW]
    if any(len(set(block)) != 1 for block in owners):
        raise RuntimeError("pack_by_user: a packed block holds tokens of two users (TRL's wrapped packing changed)")
    return packed.remove_columns(_ROW).add_column(user_column, [users[block[0]] for block in owners])
