"""Checkpoints: everything a run needs to continue exactly where it stopped.

``checkpoint.pt`` (written atomically: a temporary file renamed over the old
one, after the ledger journal was flushed) holds:

* ``config`` — the :class:`~dpopt.training.TrainConfig` as given (resume needs no options);
* ``step`` — logical steps completed; ``ledger_length`` — ledger entries then;
* ``model`` — the model's state; ``optimizer`` — torch's optimizer state, i.e.
  every transform's state (Adam/MacAdam moments and clip geometry, DiSK /
  DOPPLER filters, momentum); ``privatizer`` — its step counter, read/release
  counters, current clip bound(s) and released clip history
  (:meth:`~dpopt.privatizer.Privatizer.state_dict` without the ledger: the
  ledger is the journal ``ledger.jsonl`` beside it);
* ``sampler`` — the Poisson sampler's position (steps drawn);
* ``rng`` — the non-secret generators: torch (CPU and CUDA), Python's
  ``random``, NumPy. dpopt draws nothing per example from them (its models
  have no dropout); a model that does would make their state depend on the
  realised batch sizes;
* ``loop`` — the loop's own public counters (next epoch, metrics rows so far, wall time).

Never written: the state of the secret noise generator (a resumed run draws
from a new one seeded from OS entropy) — with ``reproducible_noise`` its
state is saved (inside ``privatizer`` and ``sampler``) so that an
interrupted and resumed run equals an uninterrupted one — and nothing
per-example (no batch sizes, indices, norms or losses).

Loading is safe by default: every value above is a dict, list, tuple, string, number, bool,
``None`` or tensor (with ``torch.device``/``torch.Size`` inside states), which
``torch.load(weights_only=True)`` reads without further allow-listing; a file that names any
other global (a class to build, a function to call: a pickle that would run code) is refused
before anything in it runs.
"""

from __future__ import annotations

import pickle
import random
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..accounting.run_continuation import CHECKPOINT_FILE
from ..atomic import atomic_write

__all__ = [
    "CHECKPOINT_NAME",
    "CHECKPOINT_VERSION",
    "atomic_write",
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "load_rng_state",
]

CHECKPOINT_NAME = CHECKPOINT_FILE  # one name: the continuation advice (accounting, no torch) reads it too
CHECKPOINT_VERSION = 1


def rng_state() -> dict:
    """States of the non-secret generators (torch CPU/CUDA, random, numpy)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def load_rng_state(state: dict) -> None:
    """Restore :func:`rng_state` (CUDA states only where CUDA is available)."""
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(v if not isinstance(v, list) else tuple(v) for v in state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states)


def save_checkpoint(path: Path, state: dict) -> Path:
    """Write ``state`` to ``path`` atomically (:func:`atomic_write`)."""
    full = dict(state, format="dpopt-checkpoint", version=CHECKPOINT_VERSION)
    return atomic_write(path, lambda fh: torch.save(full, fh), binary=True)


def _no_checkpoint(run_dir: Path) -> str:
    """The error of ``--resume run_dir`` without ``checkpoint.pt``: the directory searched, what it holds, the file
    names a resumable run has, and how to start a new run instead."""
    from ..accounting.ledger import JOURNAL_NAME

    if run_dir.is_file():
        found = "it is a file, not a run directory"
    elif not run_dir.exists():
        found = "it does not exist"
    else:
        names = sorted(p.name for p in run_dir.iterdir())
        found = (
            "it is empty"
            if not names
            else "it holds " + ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        )
    charged = (run_dir / JOURNAL_NAME).is_file()
    spent = (
        f" Its {JOURNAL_NAME} records releases already made on this data: a new run's ledger starts at 0 "
        "(--overwrite moves that journal aside), so the data's total epsilon is both runs' together."
        if charged
        else ""
    )
    config = run_dir / "config.json"
    again = f"the options in {config}" if config.is_file() else "the options of the run you meant to resume"
    reuse = " (--overwrite to reuse this directory)" if charged else ""
    return (
        f"--resume found no checkpoint in {run_dir} ({found}): it looked for {CHECKPOINT_NAME}, which dpopt train "
        f"writes beside {JOURNAL_NAME} every epoch (--checkpoint-every) and when a run stops; a run killed before "
        "its first checkpoint, or a --fsdp run, has none. Give --resume the --out directory of a run that wrote "
        f"one, or start a new run: dpopt train with {again} and --out NEW_DIR{reuse}.{spent}"
    )


def load_checkpoint(run_dir: Path) -> dict:
    """Read ``run_dir/checkpoint.pt``.

    Raises:
        FileNotFoundError: no checkpoint in ``run_dir``.
        ValueError: not a dpopt checkpoint (a truncated or damaged file, another kind of file), an
            unknown version, or a file that holds more than
            plain data and tensors (read with ``weights_only=True``: refused before it runs).
    """
    path = Path(run_dir) / CHECKPOINT_NAME
    if not path.exists():
        raise FileNotFoundError(_no_checkpoint(Path(run_dir)))
    damaged = (
        f"{path} is not a complete dpopt checkpoint (cut short by a kill or a full disk, or another kind "
        "of file): put back a copy of the run's checkpoint.pt, or start a new run"
    )
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a torn one has no central directory
        raise ValueError(damaged)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, KeyError, zipfile.BadZipFile) as exc:  # a damaged archive
        raise ValueError(damaged) from exc
    except pickle.UnpicklingError as exc:  # torch's weights-only unpickler met a global it does not allow
        reason = next((line.strip() for line in str(exc).splitlines() if "Unsupported" in line), "").split(" Please")[0]
        raise ValueError(
            f"{path} was refused: it holds objects a dpopt checkpoint never holds (only tensors, "
            "numbers, strings, lists and dicts), and loading them would run code from the file"
            + (f" ({reason})" if reason else "")
            + ". Resume only run directories you wrote; "
            "to inspect a file you trust, use torch.load(path, weights_only=False)"
        ) from exc
    if not isinstance(state, dict) or state.get("format") != "dpopt-checkpoint":
        raise ValueError(f"{path} is not a dpopt checkpoint")
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: unsupported checkpoint version {state.get('version')!r}")
    return state
