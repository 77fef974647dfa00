"""Building a run: data → model → σ (or its calibration) → privacy options → optimizer → noise.

:func:`build_run` turns a validated :class:`~dpopt.training.config.TrainConfig`
into a :class:`Run`: everything the step loop needs and everything the run
files record, nothing trained yet. The method's hyperparameters are resolved
once (:meth:`dpopt.methods.MethodSpec.hparams`) and the optimizer is built from
them (:func:`dpopt.methods.build_optimizer`).

The noise and Poisson masks come from a secret :class:`~dpopt.noise.NoiseSource`
unless ``reproducible_noise`` is set (:func:`noise_source`); the seed fixes
model initialisation (and other non-private randomness) only.
"""

from __future__ import annotations

import secrets
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, cast

import torch
from torch import nn

from ..accounting.budget import DEFAULT_COUNT_SHARE, split_budget, split_for_count_noise
from ..accounting.calibration import (
    CalibrationResult,
    calibrate_amplified_noise_multiplier,
    calibrate_noise_multiplier,
    warn_if_amplification_costs,
)
from ..accounting.ledger import PrivacyLedger
from ..averaging import ParameterAverager
from ..correlated_noise import CorrelatedNoise, Participation, Strategy, optimize_strategy, parse_mechanism
from ..correlated_noise import calibrate_noise_multiplier as calibrate_mechanism_noise
from ..cyclic_batches import cyclic_poisson_partitions
from ..data import Dataset, split_validation
from ..distributed import DistributedContext, attach, backend_device, broadcast_parameters, poisson_sampler
from ..errors import ConfigError
from ..lr_schedules import check_schedule
from ..methods import build_optimizer, get_method
from ..models import DEFAULT_MODEL, build_model, check_model
from ..noise import NoiseSource
from ..optim import DPOptimizer
from ..privatizer import QuantileClipping
from .config import TrainConfig, planned_steps, resolve_device, validate_config

__all__ = [
    "Run",
    "build_run",
    "run_sampler",
    "read_user_ids",
    "layer_groups",
    "privacy_options",
    "noise_source",
    "REPRODUCIBLE_NOISE_WARNING",
]

REPRODUCIBLE_NOISE_WARNING = (
    "reproducible_noise: the Gaussian noise and Poisson masks are seeded from the "
    "published seed, so anyone who knows it can replay them: NO privacy guarantee "
    "(research reruns only; `dpopt check` fails this run's ledger)"
)


@dataclass
class Run:
    """A run, built and not yet trained. All fields but ``data``, ``model`` and ``optimizer`` are public.

    Attributes:
        cfg: the configuration it was built from.
        data: the dataset (private training split; test split and validation
            split, if any, evaluated without protection). With
            ``cfg.validation_fraction`` > 0 the training split is what remains
            after the validation records were held out.
        model_name, model: the model (initialised from ``cfg.seed``).
        noise: the run's noise source (secret unless ``cfg.reproducible_noise``).
        sample_rate: Poisson rate q (given, or B̄/N: then N is treated as public).
        steps: number of logical steps, ``round(epochs / q)`` (:func:`~.config.planned_steps`; refused
            when that is zero); correlated noise: ``round(epochs · b)``, b = round(N/B̄) batches per epoch.
        noise_multiplier: the σ used (calibrated when ``cfg.target_epsilon`` is set).
        calibration: the calibration result, or None.
        ledger: the privacy ledger every release is recorded in.
        hparams: the method's resolved hyperparameters (resolved once).
        privacy_facts: public facts of the clipping choice (layer bounds, budget split).
        optimizer: the :class:`~dpopt.optim.DPOptimizer`.
        device: where the model, the batches and the noise live.
        dist: the data-parallel context (:mod:`dpopt.distributed`; one process by default).
        averager: with ``cfg.ema_decay``, the :class:`~dpopt.averaging.ParameterAverager` (EMA with
            warm-up) of the released parameters, updated after every step; else None.
        users: with ``cfg.user_ids`` (user-level DP), the records of each user; q is then a rate of users
            (``batch_size`` / N_users, N_users public and in the ledger header) and B̄ counts users.
    """

    cfg: TrainConfig
    data: Dataset
    model_name: str
    model: nn.Module
    noise: NoiseSource
    sample_rate: float
    steps: int
    epoch_rate: float  # epochs per step: sample_rate, or 1/round(N/B̄) for correlated noise (cyclic batches / parts)
    noise_multiplier: float
    calibration: Optional[CalibrationResult]
    ledger: PrivacyLedger
    hparams: dict
    privacy_facts: dict
    optimizer: DPOptimizer
    device: torch.device = torch.device("cpu")
    dist: DistributedContext = DistributedContext()
    averager: Optional[ParameterAverager] = None  # cfg.ema_decay: EMA of the released parameters (docs/recipe.md)
    users: Optional[list] = None  # cfg.user_ids: the records of each user (private membership; dpopt.users)
    user_keys: Optional[list] = None  # cfg.user_ids: each user's id as text (keys the record choice)
    expected_batch_size: Optional[float] = None  # the divisor of the noisy sum: B̄, N/b (cyclic) or q·N/b'


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


def privacy_options(cfg: TrainConfig, model: nn.Module, sigma: float, clip: float) -> tuple[dict, dict]:
    """Privatizer options for the chosen clipping, and the public facts to record.

    Quantile clipping splits the total σ between the gradient and count releases
    (:mod:`dpopt.accounting.budget`) so that the step costs exactly σ.

    Raises:
        ConfigError: ``layer_bounds`` does not give one bound per layer.
    """
    if cfg.clipping == "per-layer":
        groups, names = layer_groups(model)
        bounds = list(cfg.layer_bounds) if cfg.layer_bounds is not None else [clip / len(names) ** 0.5] * len(names)
        if len(bounds) != len(names):
            raise ConfigError(
                f"layer_bounds needs {len(names)} values, one per layer ({', '.join(names)})", "layer_bounds"
            )
        return (
            {"noise_multiplier": sigma, "groups": groups, "group_bounds": bounds},
            {"layer_bounds": bounds, "layers": names},
        )
    if cfg.clipping == "quantile":
        if cfg.count_noise_multiplier is not None:
            split = split_for_count_noise(
                sigma, count_noise_multiplier=cfg.count_noise_multiplier, expected_batch_size=cfg.batch_size
            )
        else:
            split = split_budget(sigma, cfg.count_share if cfg.count_share is not None else DEFAULT_COUNT_SHARE)
        quantile = QuantileClipping(
            split.count_noise_multiplier, cfg.target_quantile, cfg.quantile_lr, initial_clip=clip
        )
        return (
            {"noise_multiplier": split.grad_noise_multiplier, "quantile": quantile},
            {
                "noise_multiplier_total": sigma,
                "grad_noise_multiplier": split.grad_noise_multiplier,
                "count_noise_multiplier": split.count_noise_multiplier,
                "count_share": split.count_share,
            },
        )
    if cfg.clipping == "auto":  # AUTO-S (Bu et al. 2023): C·g/(‖g‖+γ), sensitivity C
        from ..auto_clipping import AutoClipping, split_gamma

        gamma, _ = split_gamma(cfg.hparams, get_method(cfg.method).defaults)
        return {"noise_multiplier": sigma, "auto_clip": AutoClipping(gamma)}, {"clipping_gamma": gamma}
    return {"noise_multiplier": sigma}, {}


def noise_source(cfg: TrainConfig, *, stacklevel: int = 3) -> NoiseSource:
    """The run's :class:`~dpopt.noise.NoiseSource`: secret unless the config asks otherwise.

    ``reproducible_noise`` seeds it from ``cfg.seed`` (and warns: no privacy
    against anyone who knows the seed; ``stacklevel`` as for
    :func:`warnings.warn`, default: the caller of the function that called
    this one); ``secure_mode`` uses the OS CSPRNG.
    """
    if cfg.reproducible_noise:
        warnings.warn(REPRODUCIBLE_NOISE_WARNING, UserWarning, stacklevel=stacklevel)
        return NoiseSource("reproducible", seed=cfg.seed)
    return NoiseSource("secure" if cfg.secure_mode else "secret")


def _starting_model(cfg: TrainConfig, model_name: str) -> nn.Module:
    """The model by name (or ``hf:DIR``, a local save_pretrained directory), then init_from / freeze / LoRA."""
    fine_tune = cfg.init_from or cfg.freeze or cfg.lora_rank is not None
    if not (model_name.startswith("hf:") or fine_tune):
        return build_model(model_name, cfg.dataset)
    from ..hf.pretrained import HF_PREFIX, load_hf_model, prepare_model

    model = load_hf_model(model_name) if model_name.startswith(HF_PREFIX) else build_model(model_name, cfg.dataset)
    return prepare_model(model, cfg.init_from, cfg.freeze, cfg.lora_rank)


def _mechanism_plan(cfg: TrainConfig, n_train: int, steps: int) -> Optional[tuple[Strategy, Participation]]:
    """Correlated noise (``cfg.noise_mechanism``): the strategy optimised for the run's T steps over
    b = round(N/B̄) cyclic batches (k = ⌈T/b⌉ participations, b apart); None for independent noise."""
    kind, size = parse_mechanism(cfg.noise_mechanism)
    if kind == "independent":
        return None
    batches = cyclic_batches(n_train, cfg.batch_size)
    amplified = cfg.sampling == "cyclic-poisson"
    if amplified:  # b' parts, each example of part t mod b' sampled at q
        batches = cyclic_poisson_parts(cfg, n_train)
    participation = Participation(steps, -(-steps // batches), batches)
    # unamplified runs: the strategy tuned for their k participations (amplified: charged per round)
    return optimize_strategy(kind, steps, size, participation=None if amplified else participation), participation


def cyclic_batches(n_train: int, batch_size: float) -> int:
    """b = round(N / B̄) cyclic batches per epoch (1 ≤ b ≤ N): the steps of one epoch of correlated noise,
    so a run of E epochs has T = round(E · b) steps (:func:`~.config.planned_steps` at rate 1/b), as
    cyclic Poisson's T = round(E · L)."""
    return min(n_train, max(1, round(n_train / float(batch_size))))


def cyclic_poisson_parts(cfg: TrainConfig, n_train: int) -> int:
    """b' = round(q · L) parts of cyclic Poisson sampling, L = round(N / B̄) the steps of an epoch and q the
    ``sample_rate`` within a part: the expected batch q·N/b' is about B̄ (as make_private's b' = round(q ·
    len(data_loader))).

    Raises:
        ConfigError: b' rounds to 0 (naming ``sample_rate``).
    """
    per_epoch = max(1, round(n_train / float(cfg.batch_size)))
    parts = min(n_train, cyclic_poisson_partitions(cast(float, cfg.sample_rate), per_epoch))
    if parts < 1:
        raise ConfigError(
            f"sampling cyclic-poisson: round(sample_rate × N / batch_size) = round({cfg.sample_rate} × "
            f"{per_epoch}) is 0 parts; raise sample_rate to at least {0.5 / per_epoch:.3g}",
            "sampling",
            "sample_rate",
            "batch_size",
        )
    return parts


def build_run(
    cfg: TrainConfig, data: Dataset, *, stacklevel: int = 3, dist: Optional[DistributedContext] = None
) -> Run:
    """Validate ``cfg`` and build everything a run needs, in this order.

    Hold out the validation split (``cfg.validation_fraction``, before anything
    else) → validate against N (the remaining training records) → seed torch
    (initialisation only) → noise source → model (checked) → q and steps → σ
    (calibrated for ``target_epsilon``) → ledger → hyperparameters, resolved
    once → privacy options → optimizer.

    Args:
        cfg: the configuration.
        data: the loaded dataset. ``Run.data`` is it without the validation
            records when ``cfg.validation_fraction`` > 0
            (:func:`dpopt.data.split_validation`); sample from ``run.data``.
        stacklevel: where the reproducible-noise warning points, as for
            :func:`warnings.warn` counted from this function (default: the
            line that called it; :func:`~dpopt.training.train` passes 4, its caller).
        dist: data-parallel training (:mod:`dpopt.distributed`): the model's
            parameters and buffers are broadcast from rank 0 and the
            Privatizer all-reduces the clipped sums, noise drawn once (rank 0).

    Raises:
        ValueError: (:class:`~dpopt.errors.ConfigError` naming the fields)
            invalid configuration, unknown hyperparameter, a clipping option the
            method cannot use; calibration errors.
    """
    data = split_validation(
        data, cfg.validation_fraction
    )  # checks the fraction  # first: N, q and ε are those of the rest
    validate_config(cfg, data.n_train)
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)  # initialisation and other non-private randomness only
    noise = noise_source(cfg, stacklevel=stacklevel)
    model_name = cfg.model or DEFAULT_MODEL[cfg.dataset]
    model = _starting_model(cfg, model_name)
    check_model(model)
    model.to(device)  # initialised on the CPU from the seed: the same initial parameters on every device
    keys, users = (None, None) if cfg.user_ids is None else read_user_ids(cfg.user_ids, data.n_train, dist)
    units = data.n_train if users is None else len(users)  # records, or users (user-level DP)
    if users is not None and cfg.sample_rate is None and cfg.batch_size > units:
        raise ConfigError(
            f"batch_size {cfg.batch_size} (expected users per step) exceeds the {units} users; use at most {units}",
            "batch_size",
        )
    sample_rate = float(cfg.sample_rate) if cfg.sample_rate is not None else float(cfg.batch_size) / units
    amplified = cfg.sampling == "cyclic-poisson"  # q is the rate within a part; an epoch is round(N/B̄) steps
    correlated = parse_mechanism(cfg.noise_mechanism)[0] != "independent"  # an epoch: b = round(N/B̄) batches
    epoch_rate = 1.0 / cyclic_batches(units, cfg.batch_size) if correlated else sample_rate  # T = round(E·b)
    steps = planned_steps(cfg.epochs, epoch_rate)  # refuses epochs that round to no step
    try:
        check_schedule(cfg.lr_schedule, cfg.warmup_steps, steps)
    except ValueError as err:
        raise ConfigError(
            f"{err} (this run: epochs {cfg.epochs:g} at sample rate {sample_rate:.4g})", "warmup_steps", "epochs"
        ) from None
    sigma, calibration = cfg.noise_multiplier, None
    mechanism = _mechanism_plan(cfg, data.n_train, steps)
    if mechanism is not None and cfg.target_epsilon is not None:  # one Gaussian at the strategy's sensitivity
        strategy, participation = mechanism
        if amplified:  # k rounds of the Poisson-sampled Gaussian at σ/‖c‖: DP-SGD's σ for k rounds at q, × ‖c‖
            sigma = calibrate_amplified_noise_multiplier(
                cfg.target_epsilon,
                cfg.delta,
                strategy,
                steps,
                participation.min_separation,
                sample_rate,
                cfg.accountant,
            )
        else:
            sigma = calibrate_mechanism_noise(cfg.target_epsilon, cfg.delta, strategy, participation, cfg.accountant)
    elif cfg.target_epsilon is not None:
        calibration = calibrate_noise_multiplier(cfg.target_epsilon, cfg.delta, sample_rate, steps, cfg.accountant)
        sigma = calibration.noise_multiplier
    ledger = PrivacyLedger(dataset_size="unused" if cfg.sample_rate is not None else "public")
    spec = get_method(cfg.method)
    user_hp = dict(cfg.hparams)
    if cfg.clipping == "auto":  # AUTO-S: --hp gamma (or auto_gamma) is the normalisation's γ
        from ..auto_clipping import split_gamma

        _, user_hp = split_gamma(user_hp, spec.defaults)
    hp = spec.hparams(cfg.dataset, **dict(user_hp, lr=cfg.lr, max_grad_norm=cfg.max_grad_norm))
    privacy, privacy_facts = privacy_options(cfg, model, sigma, float(hp["max_grad_norm"]))
    if users is not None:
        from ..users import user_unit_text

        ledger.privacy_unit, ledger.num_users = user_unit_text(cfg.max_records_per_user), len(users)
        privacy_facts.update(privacy_unit="user", max_records_per_user=cfg.max_records_per_user, num_users=len(users))
    expected_batch_size = float(cfg.batch_size)
    if mechanism is not None:  # correlated noise over cyclic batches
        if users is not None:
            raise ConfigError(
                "noise_mechanism with user_ids (user-level DP) is not supported: the strategy's sensitivity is "
                "per record over cyclic batches",
                "noise_mechanism",
                "user_ids",
            )
        strategy, participation = mechanism
        try:
            privacy["mechanism"] = CorrelatedNoise(strategy, participation, sigma, sample_rate if amplified else None)
        except ValueError as exc:
            raise ConfigError(str(exc), "noise_mechanism", "sampling") from None
        if amplified:  # warned where cyclic batches (b = round(N / B̄)) would score a smaller ε
            plain = cyclic_batches(data.n_train, cfg.batch_size)
            warn_if_amplification_costs(
                strategy, participation.steps, plain, participation.min_separation, sample_rate, sigma, cfg.delta
            )
        # cyclic batches: N/b examples each; cyclic Poisson: q·N/b' expected
        expected_batch_size = data.n_train * (sample_rate if amplified else 1.0) / participation.min_separation
        privacy_facts["noise_mechanism"] = cfg.noise_mechanism
        # what the batches are: b cyclic batches (no sampling, q claims nothing) or Poisson within b' parts
        privacy_facts["sampling"] = "cyclic-poisson" if amplified else "cyclic"
        privacy_facts["min_separation"] = participation.min_separation
    opt = build_optimizer(
        spec,
        [p for p in model.parameters() if p.requires_grad],
        hp,
        expected_batch_size=expected_batch_size,
        sample_rate=sample_rate,
        ledger=ledger,
        noise=noise,
        model=model,
        **privacy,
    )
    dist = dist or DistributedContext()
    if dist.enabled:
        broadcast_parameters(list(model.parameters()) + list(model.buffers()), dist)
        hook = attach(opt.privatizer, dist)
        if hook is not None:  # records never write here (batched journal): the loop agrees rank 0's writes
            hook.agree_records = False
    return Run(
        cfg=cfg,
        data=data,
        model_name=model_name,
        model=model,
        noise=noise,
        sample_rate=sample_rate,
        steps=steps,
        epoch_rate=epoch_rate,
        noise_multiplier=sigma,
        calibration=calibration,
        ledger=ledger,
        hparams=hp,
        privacy_facts=privacy_facts,
        optimizer=opt,
        device=device,
        dist=dist,
        averager=None if cfg.ema_decay is None else ParameterAverager(model, cfg.ema_decay),
        users=users,
        user_keys=keys,
        expected_batch_size=expected_batch_size,
    )


def run_sampler(run: Run, dist: DistributedContext) -> Any:
    """The run's batch sampler: Poisson over records (this rank's shard under data parallel), or over users
    (:class:`dpopt.users.UserPoissonBatchSampler`, whose ``sample()`` also returns each row's owner), or the
    cyclic batches correlated noise is accounted for (:class:`dpopt.cyclic_batches.CyclicBatchSampler`: each
    example in one of b batches, i.i.d. uniform — balls-in-bins, so batches may be empty and still release;
    data parallel: every rank draws rank 0's assignment, its seed broadcast, and takes its slice of each batch —
    the slices are disjoint and their union is the one-process batch), or cyclic Poisson batches
    (:class:`dpopt.cyclic_batches.CyclicPoissonBatchSampler`; data parallel: rank 0's assignment, each rank
    Poisson-samples its slice of the step's part — the union is one cyclic Poisson sample). A collective under
    data parallel (and FSDP): every rank calls it."""
    mech = run.optimizer.privatizer.mechanism
    if mech is not None:
        from ..cyclic_batches import CyclicBatchSampler

        if mech.sample_rate is not None:  # amplified banded MF: part t mod b' Poisson-sampled at q
            from ..cyclic_batches import CyclicPoissonBatchSampler

            return CyclicPoissonBatchSampler(
                run.data.n_train,
                mech.participation.min_separation,
                mech.sample_rate,
                run.steps,
                noise=run.noise,
                seed=_partition_seed(dist),
                rank=dist.rank,
                world_size=dist.world_size,
            )
        return CyclicBatchSampler(
            run.data.n_train,
            mech.participation.min_separation,
            steps=run.steps,
            seed=_partition_seed(dist),
            rank=dist.rank,
            world_size=dist.world_size,
        )
    if run.users is None:
        return poisson_sampler(run.data.n_train, run.sample_rate, run.steps, dist, noise=run.noise)
    from ..users import UserPoissonBatchSampler

    return UserPoissonBatchSampler(
        run.users, run.sample_rate, run.steps, run.cfg.max_records_per_user, noise=run.noise, keys=run.user_keys
    )


def _partition_seed(dist: DistributedContext) -> int:
    """A fresh secret seed of the cyclic (or cyclic Poisson) balls-in-bins assignment (:mod:`secrets`; held in
    memory only, never saved or logged), rank 0's on every rank so that all ranks draw the same assignment."""
    seed = torch.tensor(
        [secrets.randbits(62)], dtype=torch.int64, device=backend_device(dist) if dist.enabled else None
    )
    if dist.enabled:
        broadcast_parameters([seed], dist)
    return int(seed.item())


def read_user_ids(path: str, n_train: int, dist: Optional[DistributedContext]) -> tuple[list[str], list[list[int]]]:
    """(each user's key, the records of each user) (:func:`dpopt.users.group_users`) from ``path``: one user
    id per line, one line per training record in the dataset's order (blank lines are not skipped).

    Raises:
        ConfigError: an unreadable file, a line count that is not N, or data-parallel training.
    """
    from ..users import group_users

    if dist is not None and dist.enabled:
        raise ConfigError("user_ids (user-level DP) is not supported with data-parallel training yet", "user_ids")
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read user_ids {path}: {exc.strerror or exc}", "user_ids") from None
    try:
        return group_users([line.strip() for line in lines], n_train)
    except ValueError as err:
        raise ConfigError(f"user_ids {path}: {err}", "user_ids") from None
