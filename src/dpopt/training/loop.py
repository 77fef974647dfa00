"""The step loop: Poisson-sample → per-sample sources → ``DPOptimizer.step`` → per-epoch evaluation and ε.

One logical step (DESIGN.md): Poisson-sample a batch (public q) → evaluate
per-sample gradients where the optimizer asks (``evaluation_points``) in
micro-batches of at most ``physical_batch_size`` → ``DPOptimizer.step`` (the
Privatizer releases once and records the step in the ledger) → post-processing.
ε is always computed by one accountant over the whole ledger.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ..accounting.accountant import epsilon
from ..engine import iter_per_sample_sources
from ..sampling import PoissonSampler
from .build import Run

__all__ = ["evaluate", "run_steps", "LOSS_EVERY"]

LOSS_EVERY = 10  # show_train_loss: the (NON-PRIVATE) batch loss is refreshed every 10 steps


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 2000) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on (x, y). Non-private: test data only."""
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(x), batch):
        out = model(x[i:i + batch])
        loss += float(nn.functional.cross_entropy(out, y[i:i + batch], reduction="sum"))
        correct += int((out.argmax(1) == y[i:i + batch]).sum())
    model.train()
    return correct / max(len(x), 1), loss / max(len(x), 1)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def run_steps(run: Run, on_step: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """Train ``run`` for ``run.steps`` logical steps; return one metrics row per epoch.

    After each epoch (and always after the last step) ε of the whole ledger
    and the test-set accuracy and loss are computed: the rows are
    ``{"epoch", "step", "test_accuracy", "test_loss", "epsilon"}`` — public
    values only. ``on_step`` is called after every step as documented in
    :func:`~dpopt.training.train`.
    """
    cfg, data, model, opt = run.cfg, run.data, run.model, run.optimizer
    steps, sample_rate = run.steps, run.sample_rate
    steps_per_epoch = 1.0 / sample_rate
    eps_now, metrics, next_epoch, loss = 0.0, [], 1, float("nan")
    sampler = PoissonSampler(data.n_train, sample_rate, steps, noise=run.noise)
    for step, idx in enumerate(sampler, start=1):
        x, y = data.x_train[idx], data.y_train[idx]
        sources = iter_per_sample_sources(model, _loss, x, y, cfg.physical_batch_size,
                                          opt.evaluation_points())
        opt.step(sources)
        if step >= next_epoch * steps_per_epoch - 1e-9 or step == steps:
            eps_now = epsilon(run.ledger, cfg.delta, cfg.accountant)
            acc, test_loss = evaluate(model, data.x_test, data.y_test)
            metrics.append({"epoch": next_epoch, "step": step, "test_accuracy": acc, "test_loss": test_loss,
                            "epsilon": eps_now})
            next_epoch += 1
        if on_step is not None:
            last = metrics[-1] if metrics else {}
            info = {"step": step, "steps": steps, "epsilon": eps_now,
                    "test_accuracy": last.get("test_accuracy"), "test_loss": last.get("test_loss")}
            if cfg.show_train_loss:  # asked for: NOT private (an extra forward pass of the private batch)
                if (step - 1) % LOSS_EVERY == 0 and len(x):
                    with torch.no_grad():
                        loss = float(_loss(model(x), y))
                info["loss"] = loss
            on_step(info)
    return metrics
