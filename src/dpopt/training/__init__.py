"""The DP training loop used by ``dpopt train`` and by users.

:func:`train` is three steps, one module each:

* :mod:`.build` — building a run (:func:`~.build.build_run` → :class:`~.build.Run`):
  data, model, σ or its calibration, privacy options, the method's
  hyperparameters (resolved once, in the registry) and optimizer, the noise source;
* :mod:`.loop` — the step loop (:func:`~.loop.run_steps`): Poisson-sample a
  batch (public q) → per-sample sources at the optimizer's evaluation points,
  in micro-batches of at most ``physical_batch_size`` → ``DPOptimizer.step``
  (the Privatizer releases once and records the step in the ledger) →
  per-epoch test metrics and ε (one accountant over the whole ledger);
* :mod:`.results` — writing the run directory (:data:`RUN_FILES`).

:mod:`.config` holds :class:`TrainConfig` and :func:`validate_config`; its
errors (:class:`~dpopt.errors.ConfigError`) name the config fields, which the
CLI shows as flags.

What the run writes and prints (run files, ``--json`` line, progress) is public
configuration, released values (the model, test-set metrics computed from it)
and accountant output only. The noise and Poisson masks come from a secret
:class:`~dpopt.noise.NoiseSource` unless ``reproducible_noise`` is set; the
seed fixes model initialisation (and other non-private randomness) only.
The dataset size N is treated as public when the sample rate is derived as
q = B̄/N (the run files then reveal N); give ``sample_rate`` to avoid that.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from ..data import Dataset, load_dataset
from .build import REPRODUCIBLE_NOISE_WARNING, Run, build_run, layer_groups, noise_source
from .config import CLIPPINGS, TrainConfig, validate_config
from .loop import LOSS_EVERY, evaluate, run_steps
from .results import RUN_FILES, run_directory, write_config, write_results

__all__ = ["TrainConfig", "train", "evaluate", "validate_config", "layer_groups", "CLIPPINGS",
           "noise_source", "REPRODUCIBLE_NOISE_WARNING", "RUN_FILES", "LOSS_EVERY", "Run", "build_run",
           "run_steps"]


def train(cfg: TrainConfig, data: Optional[Dataset] = None,
          on_step: Optional[Callable[[dict], None]] = None) -> dict:
    """Train a model with DP; write the run directory; return the summary dict.

    Args:
        cfg: the run's configuration.
        data: a loaded :class:`~dpopt.data.Dataset` (loaded from cfg if None).
        on_step: called after every step with ``{"step", "steps", "epsilon",
            "test_accuracy", "test_loss"}`` (ε spent and test-set metrics at the
            last epoch end; None before the first). Only with
            ``cfg.show_train_loss`` is ``"loss"`` added: the NON-PRIVATE loss
            of the private batch (an extra forward pass every 10 steps), for a
            display the user has asked for.

    Returns:
        dict with method, dataset, model, test_accuracy, epsilon, delta,
        noise_multiplier, sample_rate, expected_batch_size, steps, accountant,
        noise (the noise mode), wall_seconds, run_dir and more — public values only.

    Raises:
        ValueError / DataError: invalid configuration or data
            (:class:`~dpopt.errors.ConfigError` names the fields to change).
    """
    start = time.perf_counter()
    data = data or load_dataset(cfg.dataset, cfg.data_dir)
    run = build_run(cfg, data, stacklevel=4)  # the reproducible-noise warning points at train's caller
    run_dir = run_directory(cfg)
    write_config(run_dir, run)
    metrics = run_steps(run, on_step)
    return write_results(run_dir, run, metrics, start)
