"""Writing the run directory: config.json, metrics.jsonl, ledger.json, model.pt, summary.json, check.txt.

Everything written is public configuration, released values (the model,
test-set metrics computed from it) and accountant output only. The dataset
size N is treated as public when the sample rate is derived as q = B̄/N (the
run files then reveal N); give ``sample_rate`` to avoid that.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..accounting.ledger_check import check_ledger
from ..errors import ConfigError
from ..models import num_parameters
from .build import Run
from .config import TrainConfig

__all__ = ["RUN_FILES", "run_directory", "write_config", "write_results"]

RUN_FILES = ("config.json", "metrics.jsonl", "ledger.json", "model.pt", "summary.json", "check.txt")


def run_directory(cfg: TrainConfig) -> Path:
    """The run directory, created; refuses a file, or a directory holding another run.

    Raises:
        ConfigError: ``out`` is a file, already holds a run (allow ``overwrite``),
            or cannot be created.
    """
    if cfg.out:
        path = Path(cfg.out)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{cfg.method}-{cfg.dataset}-s{cfg.seed}-{stamp}"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"out {path} is a file; give a directory for the run", "out")
    if not cfg.overwrite and any((path / name).exists() for name in RUN_FILES):
        raise ConfigError(f"out {path} already holds a run; choose a new directory or allow overwrite",
                          "out", "overwrite")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the run directory {path}: {exc.strerror or exc}", "out") from None
    return path


def write_config(run_dir: Path, run: Run) -> None:
    """``config.json``: the configuration as run (model, resolved hyperparameters, σ used, q, steps)."""
    hp = run.hparams
    config = dict(asdict(run.cfg), model=run.model_name, hparams=dict(hp), noise_multiplier=run.noise_multiplier,
                  max_grad_norm=hp["max_grad_norm"], lr=hp["lr"], sample_rate=run.sample_rate, steps=run.steps,
                  num_parameters=num_parameters(run.model), **run.privacy_facts)
    (run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))


def write_results(run_dir: Path, run: Run, metrics: list[dict], start: float) -> dict:
    """Write metrics, ledger, model, check and summary; return the summary (public values only).

    Args:
        run_dir: the run directory (:func:`run_directory`).
        run: the trained run.
        metrics: the per-epoch rows of :func:`~dpopt.training.loop.run_steps` (the last one
            closes the final step: no second evaluation).
        start: ``time.perf_counter()`` when the run began (for ``wall_seconds``).
    """
    cfg, hp, ledger, opt = run.cfg, run.hparams, run.ledger, run.optimizer
    with open(run_dir / "metrics.jsonl", "w") as fh:
        for row in metrics:
            fh.write(json.dumps(row) + "\n")
    ledger.save(run_dir / "ledger.json")
    torch.save(run.model.state_dict(), run_dir / "model.pt")
    final = metrics[-1]  # the last step always closes an epoch row: no second evaluation
    acc, test_loss, eps = final["test_accuracy"], final["test_loss"], final["epsilon"]
    summary: dict[str, Any] = {
        "method": cfg.method, "dataset": cfg.dataset, "model": run.model_name,
        "test_accuracy": acc, "test_loss": test_loss, "epsilon": eps, "delta": cfg.delta,
        "noise_multiplier": run.noise_multiplier, "max_grad_norm": hp["max_grad_norm"], "clipping": cfg.clipping,
        "sample_rate": run.sample_rate, "expected_batch_size": float(cfg.batch_size), "steps": run.steps,
        "epochs": cfg.epochs, "lr": hp["lr"], "accountant": cfg.accountant, "seed": cfg.seed,
        "num_parameters": num_parameters(run.model), "noise": run.noise.mode,
        "dataset_size": ledger.dataset_size, "privatizer_reads": opt.privatizer.reads,
        "privatizer_releases": opt.privatizer.releases,
        "wall_seconds": time.perf_counter() - start, "run_dir": str(run_dir),
        **run.privacy_facts,
    }
    if run.calibration is not None:
        summary.update(target_epsilon=cfg.target_epsilon, calibrated_epsilon=run.calibration.epsilon)
    if opt.privatizer.quantile is not None:
        summary["final_max_grad_norm"] = opt.privatizer.max_grad_norm
    check = check_ledger(ledger, summary)
    summary["check"] = "pass" if check.passed else "FAIL: " + ", ".join(check.failures)
    (run_dir / "check.txt").write_text(check.format() + "\n")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
