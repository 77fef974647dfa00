"""The DP training loop used by ``dpopt train`` and by users.

One logical step (DESIGN.md): Poisson-sample a batch (public q) → evaluate
per-sample gradients where the optimizer asks (``evaluation_points``) in
micro-batches of at most ``physical_batch_size`` → ``DPOptimizer.step`` (the
Privatizer releases once and records the step in the ledger) → post-processing.
ε is always computed by one accountant over the whole ledger.

What the run writes and prints (run files, ``--json`` line, progress) is public
configuration, released values (the model, test-set metrics computed from it)
and accountant output only. The noise and Poisson masks come from a secret
:class:`~dpopt.noise.NoiseSource` unless ``reproducible_noise`` is set; the
seed fixes model initialisation (and other non-private randomness) only.
The dataset size N is treated as public when the sample rate is derived as
q = B̄/N (the run files then reveal N); give ``sample_rate`` to avoid that.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from .accounting.accountant import ACCOUNTANTS, check_delta, epsilon
from .accounting.events import check_noise_multiplier
from .accounting.budget import DEFAULT_COUNT_SHARE, split_budget, split_for_count_noise
from .accounting.calibration import calibrate_noise_multiplier
from .accounting.ledger import PrivacyLedger
from .check import check_ledger
from .data import Dataset, load_dataset
from .methods import get_method, make_optimizer
from .models import DEFAULT_MODEL, build_model, check_model, num_parameters
from .engine import iter_per_sample_sources
from .noise import NoiseSource
from .privatizer import QuantileClipping
from .sampling import PoissonSampler

__all__ = ["TrainConfig", "train", "evaluate", "validate_config", "layer_groups", "CLIPPINGS"]

CLIPPINGS = ("flat", "per-layer", "quantile")
LOSS_EVERY = 10  # show_train_loss: the (NON-PRIVATE) batch loss is refreshed every 10 steps
REPRODUCIBLE_NOISE_WARNING = ("reproducible_noise: the Gaussian noise and Poisson masks are seeded from the "
                              "published seed, so anyone who knows it can replay them: NO privacy guarantee "
                              "(research reruns only; `dpopt check` fails this run's ledger)")


@dataclass
class TrainConfig:
    """Everything that defines a run (all public). ``None`` means the method's default."""

    dataset: str = "digits"
    data_dir: Optional[str] = None
    model: Optional[str] = None
    method: str = "dp-macadam"
    noise_multiplier: float = 1.0
    delta: float = 1e-5
    max_grad_norm: Optional[float] = None
    batch_size: float = 64.0  # expected batch size B̄ (the public denominator); sample_rate = B̄ / N by default
    epochs: float = 10.0
    lr: Optional[float] = None
    seed: int = 0  # model initialisation and other non-private randomness (never the noise)
    accountant: str = "pld"
    physical_batch_size: Optional[int] = None
    out: Optional[str] = None
    hparams: dict = field(default_factory=dict)  # method hyperparameters (h1, h2, betas, ...)
    target_epsilon: Optional[float] = None  # calibrate σ for this ε (then noise_multiplier is ignored)
    clipping: str = "flat"  # flat | per-layer | quantile
    layer_bounds: Optional[list] = None  # per-layer: one bound per layer (default C/√K each)
    target_quantile: float = 0.5
    quantile_lr: float = 0.2
    count_share: Optional[float] = None  # quantile: share r of the budget for the count (0.05)
    count_noise_multiplier: Optional[float] = None  # quantile: explicit 2σ_b instead of a share
    overwrite: bool = False  # allow --out to replace an earlier run's files
    sample_rate: Optional[float] = None  # explicit Poisson rate q (then N is not used to derive it)
    reproducible_noise: bool = False  # research only: noise and masks seeded from `seed` (no privacy)
    secure_mode: bool = False  # noise and masks from the OS CSPRNG (dpopt.noise)
    show_train_loss: bool = False  # on_step gets the NON-PRIVATE loss of the private batch


def validate_config(cfg: TrainConfig, n_train: int) -> None:
    """Check a config against the dataset size; errors say what to change.

    Raises:
        ValueError: σ < 0, δ ∉ (0, 1), batch size ≤ 0 or > N (when q = B̄/N),
            q ∉ (0, 1], lr ≤ 0, epochs ≤ 0, unknown accountant or method,
            reproducible noise together with secure mode.
    """
    check_noise_multiplier(cfg.noise_multiplier)
    check_delta(cfg.delta)
    get_method(cfg.method)
    if not (cfg.batch_size >= 1 and math.isfinite(cfg.batch_size)):
        raise ValueError(f"--batch-size (the expected batch size) must be a number >= 1, got {cfg.batch_size}")
    if cfg.sample_rate is None and cfg.batch_size > n_train:
        raise ValueError(f"--batch-size {cfg.batch_size} exceeds the {n_train} training examples; "
                         f"use at most {n_train}")
    if cfg.sample_rate is not None and not (0.0 < cfg.sample_rate <= 1.0):
        raise ValueError(f"--sample-rate must be in (0, 1], got {cfg.sample_rate}")
    if cfg.reproducible_noise and cfg.secure_mode:
        raise ValueError("--reproducible-noise and --secure-mode exclude each other")
    if cfg.lr is not None and not cfg.lr > 0:
        raise ValueError(f"--lr must be > 0, got {cfg.lr}")
    if not (cfg.epochs > 0 and math.isfinite(cfg.epochs)):
        raise ValueError(f"--epochs must be a finite number > 0, got {cfg.epochs}")
    if cfg.lr is not None and not math.isfinite(cfg.lr):
        raise ValueError(f"--lr must be finite, got {cfg.lr}")
    if cfg.accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {cfg.accountant!r}; choose one of {ACCOUNTANTS}")
    if cfg.max_grad_norm is not None and not cfg.max_grad_norm > 0:
        raise ValueError(f"--max-grad-norm must be > 0, got {cfg.max_grad_norm}")
    if cfg.physical_batch_size is not None and cfg.physical_batch_size <= 0:
        raise ValueError(f"--physical-batch-size must be > 0, got {cfg.physical_batch_size}")
    if cfg.clipping not in CLIPPINGS:
        raise ValueError(f"unknown clipping {cfg.clipping!r}; choose one of {', '.join(CLIPPINGS)}")
    if cfg.clipping != "quantile" and (cfg.count_share is not None or cfg.count_noise_multiplier is not None):
        raise ValueError("--count-share / --count-noise-multiplier apply to --clipping quantile only")
    if cfg.clipping != "per-layer" and cfg.layer_bounds is not None:
        raise ValueError("--layer-bounds applies to --clipping per-layer only")
    if cfg.count_share is not None and cfg.count_noise_multiplier is not None:
        raise ValueError("give --count-share or --count-noise-multiplier, not both")
    if cfg.target_epsilon is not None and not cfg.target_epsilon > 0:
        raise ValueError(f"--target-epsilon must be > 0, got {cfg.target_epsilon}")


def layer_groups(model: nn.Module) -> tuple[list[int], list[str]]:
    """Group index of each trainable parameter: one group per module owning parameters.

    Returns:
        (group index per parameter in ``model.parameters()`` order, layer names).
    """
    names, groups = [], []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own:
            names.append(name)
            groups.extend([len(names) - 1] * len(own))
    return groups, names


def _privacy_options(cfg: TrainConfig, model: nn.Module, sigma: float, clip: float) -> tuple[dict, dict]:
    """Privatizer options for the chosen clipping, and the public facts to record.

    Quantile clipping splits the total σ between the gradient and count releases
    (:mod:`dpopt.accounting.budget`) so that the step costs exactly σ.
    """
    if cfg.clipping == "per-layer":
        groups, names = layer_groups(model)
        bounds = list(cfg.layer_bounds) if cfg.layer_bounds is not None else \
            [clip / len(names) ** 0.5] * len(names)
        if len(bounds) != len(names):
            raise ValueError(f"--layer-bounds needs {len(names)} values, one per layer ({', '.join(names)})")
        return ({"noise_multiplier": sigma, "groups": groups, "group_bounds": bounds},
                {"layer_bounds": bounds, "layers": names})
    if cfg.clipping == "quantile":
        if cfg.count_noise_multiplier is not None:
            split = split_for_count_noise(sigma, count_noise_multiplier=cfg.count_noise_multiplier,
                                          expected_batch_size=cfg.batch_size)
        else:
            split = split_budget(sigma, cfg.count_share if cfg.count_share is not None else DEFAULT_COUNT_SHARE)
        quantile = QuantileClipping(split.count_noise_multiplier, cfg.target_quantile, cfg.quantile_lr,
                                    initial_clip=clip)
        return ({"noise_multiplier": split.grad_noise_multiplier, "quantile": quantile},
                {"noise_multiplier_total": sigma, "grad_noise_multiplier": split.grad_noise_multiplier,
                 "count_noise_multiplier": split.count_noise_multiplier, "count_share": split.count_share})
    return {"noise_multiplier": sigma}, {}


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


RUN_FILES = ("config.json", "metrics.jsonl", "ledger.json", "model.pt", "summary.json", "check.txt")


def _run_dir(cfg: TrainConfig) -> Path:
    """The run directory, created; refuses a file, or a directory holding another run.

    Raises:
        ValueError: ``--out`` is a file, already holds a run (pass ``overwrite``), or
            cannot be created.
    """
    if cfg.out:
        path = Path(cfg.out)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{cfg.method}-{cfg.dataset}-s{cfg.seed}-{stamp}"
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path} is a file; give a directory for the run")
    if not cfg.overwrite and any((path / name).exists() for name in RUN_FILES):
        raise ValueError(f"--out {path} already holds a run; choose a new directory or pass --overwrite")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create the run directory {path}: {exc.strerror or exc}") from None
    return path


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def noise_source(cfg: TrainConfig) -> NoiseSource:
    """The run's :class:`~dpopt.noise.NoiseSource`: secret unless the config asks otherwise.

    ``reproducible_noise`` seeds it from ``cfg.seed`` (and warns: no privacy
    against anyone who knows the seed); ``secure_mode`` uses the OS CSPRNG.
    """
    if cfg.reproducible_noise:
        warnings.warn(REPRODUCIBLE_NOISE_WARNING, UserWarning, stacklevel=3)
        return NoiseSource("reproducible", seed=cfg.seed)
    return NoiseSource("secure" if cfg.secure_mode else "secret")


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
        ValueError / DataError: invalid configuration or data.
    """
    start = time.perf_counter()
    data = data or load_dataset(cfg.dataset, cfg.data_dir)
    validate_config(cfg, data.n_train)
    torch.manual_seed(cfg.seed)  # initialisation and other non-private randomness only
    noise = noise_source(cfg)
    model_name = cfg.model or DEFAULT_MODEL[cfg.dataset]
    model = build_model(model_name, cfg.dataset)
    check_model(model)
    sample_rate = float(cfg.sample_rate) if cfg.sample_rate is not None else float(cfg.batch_size) / data.n_train
    steps = max(1, int(round(cfg.epochs / sample_rate)))
    sigma, calibration = cfg.noise_multiplier, None
    if cfg.target_epsilon is not None:
        calibration = calibrate_noise_multiplier(cfg.target_epsilon, cfg.delta, sample_rate, steps,
                                                 cfg.accountant)
        sigma = calibration.noise_multiplier
    ledger = PrivacyLedger(dataset_size="unused" if cfg.sample_rate is not None else "public")
    overrides = dict(cfg.hparams, lr=cfg.lr, max_grad_norm=cfg.max_grad_norm)
    hp = get_method(cfg.method).hparams(cfg.dataset, **overrides)
    privacy, privacy_facts = _privacy_options(cfg, model, sigma, float(hp["max_grad_norm"]))
    opt = make_optimizer(cfg.method, [p for p in model.parameters() if p.requires_grad],
                         expected_batch_size=float(cfg.batch_size), sample_rate=sample_rate, ledger=ledger,
                         noise=noise, dataset=cfg.dataset, **privacy, **overrides)
    run_dir = _run_dir(cfg)
    config = dict(asdict(cfg), model=model_name, hparams=dict(hp), noise_multiplier=sigma,
                  max_grad_norm=hp["max_grad_norm"], lr=hp["lr"], sample_rate=sample_rate, steps=steps,
                  num_parameters=num_parameters(model), **privacy_facts)
    (run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))

    steps_per_epoch = 1.0 / sample_rate
    eps_now, metrics, next_epoch, loss = 0.0, [], 1, float("nan")
    sampler = PoissonSampler(data.n_train, sample_rate, steps, noise=noise)
    for step, idx in enumerate(sampler, start=1):
        x, y = data.x_train[idx], data.y_train[idx]
        sources = iter_per_sample_sources(model, _loss, x, y, cfg.physical_batch_size,
                                          opt.evaluation_points())
        opt.step(sources)
        if step >= next_epoch * steps_per_epoch - 1e-9 or step == steps:
            eps_now = epsilon(ledger, cfg.delta, cfg.accountant)
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
    with open(run_dir / "metrics.jsonl", "w") as fh:
        for row in metrics:
            fh.write(json.dumps(row) + "\n")
    ledger.save(run_dir / "ledger.json")
    torch.save(model.state_dict(), run_dir / "model.pt")
    final = metrics[-1]  # the last step always closes an epoch row: no second evaluation
    acc, test_loss, eps = final["test_accuracy"], final["test_loss"], final["epsilon"]
    summary: dict[str, Any] = {
        "method": cfg.method, "dataset": cfg.dataset, "model": model_name,
        "test_accuracy": acc, "test_loss": test_loss, "epsilon": eps, "delta": cfg.delta,
        "noise_multiplier": sigma, "max_grad_norm": hp["max_grad_norm"], "clipping": cfg.clipping,
        "sample_rate": sample_rate, "expected_batch_size": float(cfg.batch_size), "steps": steps,
        "epochs": cfg.epochs, "lr": hp["lr"], "accountant": cfg.accountant, "seed": cfg.seed,
        "num_parameters": num_parameters(model), "noise": noise.mode,
        "dataset_size": ledger.dataset_size, "privatizer_reads": opt.privatizer.reads, "privatizer_releases": opt.privatizer.releases,
        "wall_seconds": time.perf_counter() - start, "run_dir": str(run_dir),
        **privacy_facts,
    }
    if calibration is not None:
        summary.update(target_epsilon=cfg.target_epsilon, calibrated_epsilon=calibration.epsilon)
    if opt.privatizer.quantile is not None:
        summary["final_max_grad_norm"] = opt.privatizer.max_grad_norm
    check = check_ledger(ledger, summary)
    summary["check"] = "pass" if check.passed else "FAIL: " + ", ".join(check.failures)
    (run_dir / "check.txt").write_text(check.format() + "\n")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
