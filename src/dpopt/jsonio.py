"""JSON in dpopt's outputs: strict JSON, with non-finite numbers written as strings.

JSON has no infinity or NaN; Python's ``json.dumps`` writes ``Infinity``/``NaN``,
which strict parsers (``jq``, JavaScript's ``JSON.parse``, Go, Rust's serde)
reject. Every JSON file and ``--json`` line dpopt writes (``summary.json``,
``config.json``, ``metrics.jsonl``, ``diagnostics.json``, sweep records, each
command's ``--json`` object) goes through :func:`dumps`, which writes

* ``+inf`` as ``"inf"``, ``-inf`` as ``"-inf"`` and NaN as ``"nan"`` (strings;
  e.g. ``"epsilon": "inf"`` for a run with σ = 0), and
* refuses anything else that is not JSON (``allow_nan=False`` after the conversion).

Readers (``dpopt train --resume``, ``dpopt sweep``/``report``, ``dpopt check``/``ledger``)
use :func:`loads`, which turns exactly those three strings back into floats (and
still accepts ``Infinity``/``NaN`` in files written before this convention).

Nothing here imports torch or numpy (the accounting commands stay light); a
numpy float64 is a ``float`` and is handled; other numpy/torch scalars are
converted by the writer's ``default`` (e.g. ``default=str``) as before.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["NON_FINITE", "json_safe", "dumps", "loads", "revive"]

#: The strings that stand for the non-finite floats in dpopt's JSON.
NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _text(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float (at any depth of dicts, lists and tuples) as its string.

    >>> json_safe({"epsilon": float("inf"), "rows": [1.0, float("nan")]})
    {'epsilon': 'inf', 'rows': [1.0, 'nan']}
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else _text(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`json_safe` ``(obj)``: strict JSON (keyword arguments as ``json.dumps``).

    A ``default`` hook's non-finite result is converted too.

    Raises:
        ValueError: a non-finite float that reached the encoder anyway (never silently ``Infinity``).
        TypeError: an object JSON cannot hold and no ``default`` converts.
    """
    default = kwargs.pop("default", None)
    hook = (lambda o: json_safe(default(o))) if default is not None else None
    return json.dumps(json_safe(obj), allow_nan=False, default=hook, **kwargs)


def revive(obj: Any) -> Any:
    """The inverse of :func:`json_safe`: ``"inf"``, ``"-inf"`` and ``"nan"`` (exactly) back to floats."""
    if isinstance(obj, str):
        return NON_FINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {k: revive(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [revive(v) for v in obj]
    return obj


def loads(text: str) -> Any:
    """Parse dpopt JSON: ``json.loads`` then :func:`revive`.

    Raises:
        json.JSONDecodeError: not JSON.
    """
    return revive(json.loads(text))
