"""TensorBoard logging of a run's PUBLIC quantities (``dpopt train --tensorboard DIR``).

Only values that are public under DP are logged: test-set metrics of the
released model, ε spent (accountant output), the learning rate (configuration
and schedule), the clip bound in use (a released value under quantile
clipping), and summary statistics of the AdaClip / DP-MacAdam clip scale b
(computed by the transforms from released gradients only), and under
quantile clipping the released (noisy) fraction of unclipped examples of the
last step — the count is released with noise and charged. Never a loss,
count or norm of the private training batch.

Uses ``torch.utils.tensorboard.SummaryWriter``, which needs the
``tensorboard`` package (``pip install dpopt[logging]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

__all__ = ["TensorBoardLogger", "public_scalars", "LOGGED_METRICS"]

# keys of a metrics row that are logged (val_*: held-out validation records, no protection, like test)
LOGGED_METRICS = ("test_accuracy", "test_loss", "val_accuracy", "val_loss", "epsilon")


def public_scalars(row: dict, optimizer=None) -> dict[str, float]:
    """The scalars to log for one metrics row: ``{tag: value}``, public quantities only.

    Args:
        row: a ``metrics.jsonl`` row (test metrics of the released model and ε; ``val/accuracy``
            and ``val/loss`` too when the run holds out a validation split).
        optimizer: the run's :class:`~dpopt.optim.DPOptimizer` (optional): adds
            ``train/lr`` (first param group), ``privacy/max_grad_norm`` (the bound
            applied at the last release), ``privacy/unclipped_fraction_released``
            (quantile clipping: the noisy released fraction) and, for methods with a clip scale,
            ``geometry/scale_mean``/``_min``/``_max`` over all coordinates.
    """
    out = {
        f"{k.split('_', 1)[0]}/{k.split('_', 1)[1]}" if k.startswith(("test_", "val_")) else f"privacy/{k}": float(
            row[k]
        )
        for k in LOGGED_METRICS
        if row.get(k) is not None
    }
    if optimizer is None:
        return out
    out["train/lr"] = float(optimizer.param_groups[0]["lr"])
    out["privacy/max_grad_norm"] = float(optimizer.privatizer.max_grad_norm)
    last = optimizer.privatizer.ledger.last_entry  # O(1): never a copy of the ledger
    if last is not None and "released_fraction" in last.meta:  # quantile clipping's NOISY unclipped fraction
        out["privacy/unclipped_fraction_released"] = float(last.meta["released_fraction"])
    scales = [
        sub["scale"]
        for st in optimizer.state.values()
        for sub in _substates(st)
        if isinstance(sub.get("scale"), torch.Tensor)
    ]
    if scales:
        flat = torch.cat([s.detach().flatten().double() for s in scales])
        out.update(
            {
                "geometry/scale_mean": float(flat.mean()),
                "geometry/scale_min": float(flat.min()),
                "geometry/scale_max": float(flat.max()),
            }
        )
    return out


def _substates(state: dict):
    """A parameter's state and the nested per-transform states of a chain (``"0.macadam": {...}``)."""
    yield state
    for value in state.values():
        if isinstance(value, dict):
            yield from _substates(value)


class TensorBoardLogger:
    """Writes :func:`public_scalars` of each metrics row to a TensorBoard event file.

    Args:
        log_dir: directory of the event files (created).

    Raises:
        ImportError: the ``tensorboard`` package is missing (the message says
            how to install it).
    """

    def __init__(self, log_dir: Union[str, Path]):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except (ImportError, ModuleNotFoundError) as exc:
            raise ImportError(
                "--tensorboard needs the tensorboard package: pip install tensorboard (or dpopt[logging])"
            ) from exc
        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(str(self.log_dir))

    def log(self, row: dict, optimizer=None, step: Optional[int] = None) -> None:
        """Log one metrics row at ``step`` (default ``row["step"]``) and flush."""
        at = int(step if step is not None else row.get("step", 0))
        for tag, value in public_scalars(row, optimizer).items():
            self.writer.add_scalar(tag, value, at)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
