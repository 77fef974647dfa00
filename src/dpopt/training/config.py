"""What defines a run: :class:`TrainConfig` (all public) and :func:`validate_config`.

Errors are :class:`~dpopt.errors.ConfigError` and name the ``TrainConfig``
fields to change (``batch_size``, ``lr``, ...); the CLI shows them as flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

from ..accounting.accountant import ACCOUNTANTS, check_delta
from ..accounting.events import check_noise_multiplier
from ..data import check_validation_fraction
from ..engine.layers import NORM_FORMS
from ..errors import ConfigError
from ..methods import get_method

if TYPE_CHECKING:
    import torch

__all__ = [
    "TrainConfig",
    "validate_config",
    "CLIPPINGS",
    "DEVICES",
    "resolve_device",
    "planned_steps",
    "epoch_end_step",
]

CLIPPINGS = ("flat", "per-layer", "quantile", "auto")  # auto: AUTO-S (dpopt.auto_clipping)
DEVICES = ("cpu", "cuda", "auto")


@dataclass
class TrainConfig:
    """Everything that defines a run (all public). ``None`` means the method's default.

    ``validation_fraction`` F (default 0): before anything else, ``floor(F·N + 1/2)``
    records of the training set (:func:`dpopt.data.validation_indices`: a fixed
    public permutation, the same for every ``seed``) are removed from training and
    used only for evaluation — ``val_accuracy`` / ``val_loss`` next to the test
    metrics in every metrics row and the summary. N, the sample rate q = B̄/N and
    ε are those of the remaining records. Privacy: the validation records are never
    trained on and get NO protection (their metrics are released as they are, like
    the test set's); ε covers the remaining training records only. Choosing
    hyperparameters by validation accuracy across several runs is NOT charged to
    any run's ε: each run's ε is for that run, and releasing the best of k runs
    costs more (Liu & Talwar 2019, "Private selection from private candidates";
    Papernot & Steinke 2022, "Hyperparameter tuning with Renyi differential privacy").
    """

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
    # the capture's forward/backward as one torch.compile graph (inductor), checked against eager single-example
    # autograd on the first batch; models it cannot trace are refused (dpopt.engine.compiled)
    compile: Union[bool, str] = False  # True (inductor) or a backend name (dpopt.engine.compiled.COMPILE_BACKENDS)
    # None: the cost model picks each layer's per-example norm form; "gram" | "chol" | "direct" forces it wherever it
    # applies (dpopt.engine.layers.Budget.norm_form; every form is exact: tests and measurements)
    norm_form: Optional[str] = None
    out: Optional[str] = None
    hparams: dict = field(default_factory=dict)  # method hyperparameters (h1, h2, betas, ...)
    target_epsilon: Optional[float] = None  # calibrate σ for this ε (then noise_multiplier is ignored)
    clipping: str = "flat"  # flat | per-layer | quantile | auto
    layer_bounds: Optional[list] = None  # per-layer: one bound per layer (default C/√K each)
    target_quantile: float = 0.5
    quantile_lr: float = 0.2
    count_share: Optional[float] = None  # quantile: share r of the budget for the count (0.05)
    count_noise_multiplier: Optional[float] = None  # quantile: explicit 2σ_b instead of a share
    overwrite: bool = False  # allow `out` to replace an earlier run's files
    sample_rate: Optional[float] = None  # explicit Poisson rate q (then N is not used to derive it)
    reproducible_noise: bool = False  # research only: noise and masks seeded from `seed` (no privacy)
    secure_mode: bool = False  # noise and masks from the OS CSPRNG (dpopt.noise)
    show_train_loss: bool = False  # on_step gets the NON-PRIVATE loss of the private batch
    max_epsilon: Optional[float] = None  # stop before the step whose release would take ε past this (at delta)
    checkpoint_every: Optional[int] = None  # steps between checkpoints (None: every epoch; 0: only at the end)
    log_every: Optional[int] = None  # also write a metrics.jsonl row every this many steps
    tensorboard: Optional[str] = None  # TensorBoard log dir: public scalars of every metrics row
    device: str = "cpu"  # cpu | cuda | auto (cuda if available): model, batches and noise on it
    # hold out floor(F·N + 1/2) training records (a fixed public permutation, not the seed) for val_accuracy /
    # val_loss: never trained on, NO protection (like the test set); N, q and ε are those of the rest
    validation_fraction: float = 0.0
    # fine-tuning (dpopt.hf.pretrained; local files only, the starting weights are PUBLIC): a dpopt model.pt or
    # torch state dict loaded before training, shell patterns of parameter names not trained, PEFT LoRA rank
    init_from: Optional[str] = None
    freeze: Optional[list] = None
    lora_rank: Optional[int] = None
    # the from-scratch recipe (De et al. 2022; docs/recipe.md): K augmented views per example, their gradient
    # averaged before clipping (same ε); the views' augmentation (None: crop-flip when K > 1); an EMA of the
    # released parameters (post-processing: model_ema.pt, ema_* metrics); lr warm-up + constant/cosine
    augmentation_multiplicity: int = 1
    augment: Optional[str] = None
    ema_decay: Optional[float] = None
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    # user-level DP (dpopt.users; docs/privacy-unit.md): a text file of one user id per training record (in the
    # dataset's order); users are Poisson-sampled at q = batch_size / N_users (or sample_rate), each brings at most
    # max_records_per_user records (chosen at random), and their mean gradient is clipped as one unit
    user_ids: Optional[str] = None
    max_records_per_user: int = 16
    # "independent", or correlated noise across steps: "banded:B" / "blt[:N]" (dpopt.correlated_noise)
    noise_mechanism: str = "independent"
    # correlated noise only: "cyclic" (None: the default, unamplified) or "cyclic-poisson" (amplified:
    # round(q·N/B̄) parts, part t mod b' Poisson-sampled at q = sample_rate; dpopt.cyclic_batches)
    sampling: Optional[str] = None


def _check_noise_mechanism(cfg: TrainConfig) -> None:
    """Correlated noise (docs/correlated-noise.md): a known spec, ``sample_rate`` only with cyclic-poisson
    sampling (cyclic batches are sized by ``batch_size``), and none of the options it has no accountant for
    (quantile clipping, σ = 0)."""
    from ..correlated_noise import parse_mechanism

    try:
        kind, _ = parse_mechanism(cfg.noise_mechanism)
    except ValueError as exc:
        raise ConfigError(str(exc), "noise_mechanism") from None
    if cfg.sampling not in (None, "cyclic", "cyclic-poisson"):
        raise ConfigError(f"sampling must be cyclic or cyclic-poisson, got {cfg.sampling!r}", "sampling")
    if kind == "independent":
        if cfg.sampling is not None:
            raise ConfigError(
                "sampling applies to correlated noise only (independent noise is Poisson-sampled): "
                "drop it or set noise_mechanism",
                "sampling",
                "noise_mechanism",
            )
        return
    if cfg.sampling == "cyclic-poisson" and cfg.sample_rate is None:
        raise ConfigError(
            "sampling cyclic-poisson needs sample_rate q (each example of the step's part is included with "
            "probability q; round(q·N/batch_size) parts)",
            "sampling",
            "sample_rate",
        )
    if cfg.sampling != "cyclic-poisson" and cfg.sample_rate is not None:  # cyclic batches are sized by batch_size
        raise ConfigError(
            f"sample_rate is read only with sampling cyclic-poisson; noise_mechanism {cfg.noise_mechanism} over "
            "cyclic batches takes their size from batch_size: drop sample_rate or add sampling cyclic-poisson",
            "sample_rate",
            "sampling",
        )
    if cfg.clipping == "quantile":
        raise ConfigError("noise_mechanism needs a fixed clip bound, not clipping 'quantile'", "noise_mechanism")
    if cfg.max_epsilon is not None:
        raise ConfigError(
            "noise_mechanism: max_epsilon is not supported (the run's epsilon is fixed by the strategy and "
            "sigma when it starts); set target_epsilon instead",
            "noise_mechanism",
            "max_epsilon",
        )
    if cfg.target_epsilon is None and not cfg.noise_multiplier > 0:
        raise ConfigError("noise_mechanism needs noise_multiplier > 0", "noise_mechanism", "noise_multiplier")


def validate_config(cfg: TrainConfig, n_train: int) -> None:
    """Check a config against the dataset size; errors say what to change.

    Raises:
        ValueError: (a :class:`~dpopt.errors.ConfigError` naming the fields)
            σ < 0, δ ∉ (0, 1), batch size ≤ 0 or > N (when q = B̄/N),
            q ∉ (0, 1], lr ≤ 0, epochs ≤ 0, unknown accountant or method,
            reproducible noise together with secure mode, validation_fraction ∉ [0, 1),
            a ``norm_form`` other than None or one of :data:`~dpopt.engine.layers.NORM_FORMS`,
            lr or max_grad_norm given both as a field and in ``hparams`` with different values.
    """
    check_validation_fraction(cfg.validation_fraction)
    check_noise_multiplier(cfg.noise_multiplier)
    check_delta(cfg.delta)
    get_method(cfg.method)
    if not (cfg.batch_size >= 1 and math.isfinite(cfg.batch_size)):
        raise ConfigError(
            f"batch_size (the expected batch size) must be a number >= 1, got {cfg.batch_size}", "batch_size"
        )
    if cfg.sample_rate is None and cfg.batch_size > n_train:
        raise ConfigError(
            f"batch_size {cfg.batch_size} exceeds the {n_train} training examples; use at most {n_train}", "batch_size"
        )
    if cfg.sample_rate is not None and not (0.0 < cfg.sample_rate <= 1.0):
        raise ConfigError(f"sample_rate must be in (0, 1], got {cfg.sample_rate}", "sample_rate")
    if cfg.reproducible_noise and cfg.secure_mode:
        raise ConfigError("reproducible_noise and secure_mode exclude each other", "reproducible_noise", "secure_mode")
    _check_noise_mechanism(cfg)
    if cfg.lr is not None and not cfg.lr > 0:
        raise ConfigError(f"lr must be > 0, got {cfg.lr}", "lr")
    if not (cfg.epochs > 0 and math.isfinite(cfg.epochs)):
        raise ConfigError(f"epochs must be a finite number > 0, got {cfg.epochs}", "epochs")
    if cfg.lr is not None and not math.isfinite(cfg.lr):
        raise ConfigError(f"lr must be finite, got {cfg.lr}", "lr")
    for key in ("lr", "max_grad_norm"):  # two values for one setting: the field silently won before
        own, given = getattr(cfg, key), cfg.hparams.get(key)
        if own is not None and given is not None and given != own:
            raise ConfigError(f"{key} is given twice ({own} and hparams {key}={given}); give one of them", key)
    if cfg.accountant not in ACCOUNTANTS:
        raise ConfigError(f"unknown accountant {cfg.accountant!r}; choose one of {ACCOUNTANTS}")
    if cfg.max_grad_norm is not None and not cfg.max_grad_norm > 0:
        raise ConfigError(f"max_grad_norm must be > 0, got {cfg.max_grad_norm}", "max_grad_norm")
    if cfg.physical_batch_size is not None and cfg.physical_batch_size <= 0:
        raise ConfigError(f"physical_batch_size must be > 0, got {cfg.physical_batch_size}", "physical_batch_size")
    if cfg.clipping not in CLIPPINGS:
        raise ConfigError(f"unknown clipping {cfg.clipping!r}; choose one of {', '.join(CLIPPINGS)}")
    if cfg.clipping != "quantile" and (cfg.count_share is not None or cfg.count_noise_multiplier is not None):
        raise ConfigError(
            "count_share / count_noise_multiplier apply to clipping 'quantile' only",
            "count_share",
            "count_noise_multiplier",
            "clipping",
        )
    if cfg.clipping != "per-layer" and cfg.layer_bounds is not None:
        raise ConfigError("layer_bounds applies to clipping 'per-layer' only", "layer_bounds", "clipping")
    if cfg.count_share is not None and cfg.count_noise_multiplier is not None:
        raise ConfigError(
            "give count_share or count_noise_multiplier, not both", "count_share", "count_noise_multiplier"
        )
    if cfg.max_epsilon is not None and not (cfg.max_epsilon > 0 and math.isfinite(cfg.max_epsilon)):
        raise ConfigError(f"max_epsilon must be a finite number > 0, got {cfg.max_epsilon}", "max_epsilon")
    if cfg.checkpoint_every is not None and cfg.checkpoint_every < 0:
        raise ConfigError(
            f"checkpoint_every must be >= 0 steps (0: only at the end), got {cfg.checkpoint_every}", "checkpoint_every"
        )
    if cfg.log_every is not None and cfg.log_every < 1:
        raise ConfigError(f"log_every must be >= 1 step, got {cfg.log_every}", "log_every")
    if cfg.device not in DEVICES:
        raise ConfigError(f"unknown device {cfg.device!r}; choose one of {', '.join(DEVICES)}", "device")
    if cfg.target_epsilon is not None and not cfg.target_epsilon > 0:
        raise ConfigError(f"target_epsilon must be > 0, got {cfg.target_epsilon}", "target_epsilon")
    if cfg.norm_form is not None and cfg.norm_form not in NORM_FORMS:
        raise ConfigError(
            f"norm_form must be one of {', '.join(NORM_FORMS)} (or unset: the cost model chooses), got {cfg.norm_form!r}",
            "norm_form",
        )
    if cfg.lora_rank is not None and not (isinstance(cfg.lora_rank, int) and cfg.lora_rank >= 1):
        raise ConfigError(f"lora_rank must be an integer >= 1, got {cfg.lora_rank!r}", "lora_rank")
    _validate_recipe(cfg)
    _validate_user_level(cfg)


def _validate_user_level(cfg: TrainConfig) -> None:
    """user_ids and what user-level DP cannot be combined with (dpopt.users)."""
    k = cfg.max_records_per_user
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"max_records_per_user must be an integer >= 1, got {k!r}", "max_records_per_user")
    if cfg.user_ids is None:
        return
    if cfg.validation_fraction:
        raise ConfigError(
            "user_ids with validation_fraction > 0: the held-out records would cut users in two; hold out "
            "whole users yourself, or use validation_fraction 0",
            "user_ids",
            "validation_fraction",
        )
    if cfg.augmentation_multiplicity > 1 or cfg.augment not in (None, "none"):
        raise ConfigError(
            "user_ids (user-level DP) is not supported with augmentation", "user_ids", "augmentation_multiplicity"
        )


def _validate_recipe(cfg: TrainConfig) -> None:
    """augmentation_multiplicity, augment, ema_decay, lr_schedule, warmup_steps (docs/recipe.md)."""
    from ..augment import AUGMENTATIONS
    from ..lr_schedules import SCHEDULES

    k = cfg.augmentation_multiplicity
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(
            f"augmentation_multiplicity must be an integer >= 1 (1: no extra views), got {k!r}",
            "augmentation_multiplicity",
        )
    if cfg.augment is not None and cfg.augment not in AUGMENTATIONS:
        raise ConfigError(f"unknown augment {cfg.augment!r}; choose one of {', '.join(AUGMENTATIONS)}", "augment")
    if (k > 1 or cfg.augment not in (None, "none")) and cfg.dataset != "cifar10":
        raise ConfigError(
            f"augmentation ({cfg.augment or 'crop-flip'}) is implemented for the cifar10 dataset only "
            f"(this run's dataset is {cfg.dataset!r}); use augmentation_multiplicity 1 and no augment",
            "augmentation_multiplicity",
            "augment",
        )
    if k > 1 and cfg.augment == "none":
        raise ConfigError(
            f"augmentation_multiplicity {k} with augment 'none' makes {k} identical views of each "
            f"example: the same clipped gradient at {k}x the cost; use augment crop-flip or flip, "
            "or augmentation_multiplicity 1",
            "augmentation_multiplicity",
            "augment",
        )
    if cfg.ema_decay is not None and not (0.0 <= cfg.ema_decay < 1.0):
        raise ConfigError(f"ema_decay must be in [0, 1) (e.g. 0.999), got {cfg.ema_decay}", "ema_decay")
    if cfg.lr_schedule not in SCHEDULES:
        raise ConfigError(
            f"unknown lr_schedule {cfg.lr_schedule!r}; choose one of {', '.join(SCHEDULES)}", "lr_schedule"
        )
    if isinstance(cfg.warmup_steps, bool) or not isinstance(cfg.warmup_steps, int) or cfg.warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be an integer >= 0, got {cfg.warmup_steps!r}", "warmup_steps")


def planned_steps(epochs: float, sample_rate: float) -> int:
    """The number of logical steps of a run: ``round(epochs / q)`` (Python's rounding); zero is refused.

    A run's epochs are counted as ``steps × q`` (one epoch = 1/q expected steps); epoch k ends at
    step ``round(k / q)`` (:func:`epoch_end_step`), so a 1-epoch run and the first epoch of a longer
    run have the same number of steps.

    Raises:
        ConfigError: (naming ``epochs``) ``epochs / q`` rounds to zero steps: ``--epochs 1e-9``
            silently ran one step before.
    """
    raw = float(epochs) / float(sample_rate)
    steps = int(round(raw))
    if steps < 1:
        raise ConfigError(
            f"epochs {epochs:g} is {raw:.3g} of a step at sample rate q = {sample_rate:.4g} (a run "
            f"takes round(E/q) steps), which rounds to no step; give epochs >= {sample_rate:.4g} "
            "(one step) or more",
            "epochs",
        )
    return steps


def epoch_end_step(epoch: int, sample_rate: float, steps: int) -> int:
    """The step after which epoch ``epoch`` (1, 2, ...) ends: ``round(epoch / q)``, at most ``steps``.

    The same rounding as :func:`planned_steps`: the first epoch of a 3-epoch run ends at the step
    count of a 1-epoch run (234 steps for MNIST at B̄ = 256, 1/q = 234.375; it ended at 235 when
    the end was the first step ≥ 1/q). The last step of a run always closes its last epoch row.
    """
    return min(int(steps), max(1, int(round(epoch / float(sample_rate)))))


def resolve_device(device: str) -> "torch.device":
    """``"cpu"``, ``"cuda"`` or ``"auto"`` (cuda if available, else cpu) as a ``torch.device``.

    Raises:
        ConfigError: ``"cuda"`` without a usable CUDA device, or an unknown name.
    """
    import torch

    if device not in DEVICES:
        raise ConfigError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}", "device")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device 'cuda' asked for but torch sees no CUDA device (torch.cuda.is_available() is "
            "False); use device 'cpu' or 'auto'",
            "device",
        )
    return torch.device(device)
