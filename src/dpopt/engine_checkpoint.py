"""The bodies of :meth:`PrivacyEngine.save_checkpoint <dpopt.privacy_engine.PrivacyEngine.save_checkpoint>` and
:meth:`PrivacyEngine.load_checkpoint <dpopt.privacy_engine.PrivacyEngine.load_checkpoint>`.

The methods are documented (and called) on :class:`~dpopt.privacy_engine.PrivacyEngine`, which delegates
to these functions; the checkpoint layout, the ledger rules and the journal are in :mod:`dpopt.checkpoint`
(kept free of torch work at import: the accounting layer imports it). Warnings here name the caller of
the engine's method (one more frame than a method's own ``stacklevel=2``).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn

from .checkpoint import CHECKPOINT_VERSION, atomic_torch_save, default_journal, recorded_journal

if TYPE_CHECKING:
    from .privacy_engine import PrivacyEngine
    from .private_optimizer import PrivateOptimizer

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(
    engine: "PrivacyEngine",
    *,
    path: Union[str, os.PathLike, Any],
    module: nn.Module,
    optimizer: Optional[PrivateOptimizer] = None,
    noise_scheduler: Optional[Any] = None,
    grad_clip_scheduler: Optional[Any] = None,
    checkpoint_dict: Optional[dict] = None,
    module_state_dict_kwargs: Optional[dict] = None,
    torch_save_kwargs: Optional[dict] = None,
    journal: Optional[Union[str, os.PathLike]] = None,
) -> None:
    """The body of :meth:`PrivacyEngine.save_checkpoint <dpopt.privacy_engine.PrivacyEngine.save_checkpoint>` (documented there)."""
    engine._own(optimizer)
    on_disk = isinstance(path, (str, os.PathLike))
    if journal is not None or on_disk:  # it opens (or writes) the journal: rank 0's file
        engine._keeper.check_main("save_checkpoint")
    if journal is not None:
        engine._keeper.open_journal(journal)
    elif engine._keeper.journal is None:
        if on_disk:
            engine._keeper.open_journal(default_journal(path, engine.ledger.run_id))
        else:
            warnings.warn(
                "save_checkpoint to a file object without journal=: no ledger journal is kept, so "
                "loading this checkpoint after more training would not charge the releases made "
                "after it",
                UserWarning,
                stacklevel=3,
            )
    engine._keeper.flush()
    where = engine._keeper.journal
    if where is not None and on_disk and Path(where).parent.resolve() == Path(path).parent.resolve():
        where = Path(where).name  # type: ignore[assignment]  # beside the checkpoint: the directory can move as a whole
    ckpt = dict(checkpoint_dict or {})
    ckpt["module_state_dict"] = module.state_dict(**(module_state_dict_kwargs or {}))
    ledger_state = engine.ledger.state_dict()  # run-length form, shared by every key below (stored once)
    if optimizer is not None:
        ckpt["optimizer_state_dict"] = optimizer.state_dict()
        priv = ckpt["optimizer_state_dict"].get("privatizer")
        if isinstance(priv, dict) and "ledger" in priv:  # the same ledger (engine._own checked it)
            priv["ledger"] = ledger_state
    if noise_scheduler is not None:
        ckpt["noise_scheduler_state_dict"] = noise_scheduler.state_dict()
    if grad_clip_scheduler is not None:
        ckpt["grad_clip_scheduler_state_dict"] = grad_clip_scheduler.state_dict()
    if callable(getattr(engine.accountant, "state_dict", None)):
        ckpt["privacy_accountant_state_dict"] = engine.accountant.state_dict()
        if (
            isinstance(ckpt["privacy_accountant_state_dict"].get("ledger"), dict)
            and getattr(engine.accountant, "ledger", None) is engine.ledger
        ):
            ckpt["privacy_accountant_state_dict"]["ledger"] = ledger_state
    ckpt["privacy_ledger"] = ledger_state
    ckpt["accountant"] = str(engine.accountant)
    ckpt["dpopt_checkpoint"] = {
        "version": CHECKPOINT_VERSION,
        "run_id": engine.ledger.run_id,
        "ledger_length": len(engine.ledger),
        "journal": None if where is None else str(where),
    }
    if on_disk:
        atomic_torch_save(ckpt, path, **(torch_save_kwargs or {}))
    else:
        torch.save(ckpt, path, **(torch_save_kwargs or {}))


def load_checkpoint(
    engine: "PrivacyEngine",
    *,
    path: Union[str, os.PathLike, Any],
    module: nn.Module,
    optimizer: Optional[PrivateOptimizer] = None,
    noise_scheduler: Optional[Any] = None,
    grad_clip_scheduler: Optional[Any] = None,
    module_load_dict_kwargs: Optional[dict] = None,
    torch_load_kwargs: Optional[dict] = None,
) -> dict:
    """The body of :meth:`PrivacyEngine.load_checkpoint <dpopt.privacy_engine.PrivacyEngine.load_checkpoint>` (documented there)."""
    engine._own(optimizer)
    ckpt = torch.load(path, **{"weights_only": True, **(torch_load_kwargs or {})})
    info = ckpt.get("dpopt_checkpoint") or {}
    saved = ckpt.get("privacy_ledger")
    if saved is None:
        saved = (ckpt.get("privacy_accountant_state_dict") or {}).get("ledger")
    journal = recorded_journal(info.get("journal"), path)
    where = f"checkpoint {path}" if isinstance(path, (str, os.PathLike)) else "checkpoint"
    engine._keeper.adopt(
        saved, journal=journal, where=where, header_fixed=bool(engine._privatizers()), stacklevel=4
    )  # warnings name the caller of PrivacyEngine.load_checkpoint
    module.load_state_dict(ckpt["module_state_dict"], **(module_load_dict_kwargs or {}))
    opt_state = ckpt.get("optimizer_state_dict") or {}
    if optimizer is not None and opt_state:
        opt_state = dict(opt_state)
        meta = opt_state.pop("dpopt", None)
        optimizer._load_rest(opt_state, opt_state.pop("privatizer"))
        optimizer._restore_sigma(meta)  # the scheduled sigma of the next release, as saved
    elif (optimizer is not None) != bool(opt_state):
        warnings.warn(
            f"the checkpoint has {'an' if opt_state else 'no'} optimizer state but optimizer is "
            f"{'not ' if optimizer is None else ''}given: the optimizer's state is not restored",
            UserWarning,
            stacklevel=3,
        )
    if noise_scheduler is not None and ckpt.get("noise_scheduler_state_dict"):
        noise_scheduler.load_state_dict(ckpt["noise_scheduler_state_dict"])
    if grad_clip_scheduler is not None and ckpt.get("grad_clip_scheduler_state_dict"):
        grad_clip_scheduler.load_state_dict(ckpt["grad_clip_scheduler_state_dict"])
    engine._keeper.settle(engine._privatizers())
    return ckpt
