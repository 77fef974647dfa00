"""Commands ``dpopt train`` and ``dpopt methods``.

The command parses options into a :class:`dpopt.training.TrainConfig`, runs
:func:`dpopt.training.train` and prints its summary; everything else
(validation, calibration, the run directory) is the library's. Library errors
name ``TrainConfig`` fields and are shown with this command's flags
(:func:`train_flags`). torch is imported inside the command body only.
"""

from __future__ import annotations

import sys
import warnings
from typing import Optional

import typer

from ..jsonio import dumps
from .common import (
    EXIT_CHECK_FAILED,
    accountant_option,
    cli_errors,
    delta_option,
    fail,
    flags_for,
    json_option,
    status_progress,
)

DATASET_HELP = "digits (bundled, no files), mnist or cifar10 (read from --data-dir)"

group = typer.Typer()

#: Library argument names whose flag is not simply ``--x-y``.
_FLAG_OVERRIDES = {"hparams": "--hp", "expected_batch_size": "--batch-size", "augmentation_multiplicity": "--augmult"}


def train_flags() -> dict[str, str]:
    """``{argument: flag}`` for ``dpopt train``'s messages.

    Every ``TrainConfig`` field ``x_y`` → ``--x-y``; ``hparams`` → ``--hp``;
    a method hyperparameter ``k`` → ``--hp k`` unless it has its own flag
    (``--h1``, ``--h2``, ``--variance-update``, ``--lr``). Imports torch (via
    :mod:`dpopt.training`), so it is called inside the command only.
    """
    import dataclasses

    from ..methods import list_methods
    from ..training import TrainConfig

    flags = {key: f"--hp {key}" for spec in list_methods() for key in spec.defaults}
    flags.update(
        flags_for(
            [f.name for f in dataclasses.fields(TrainConfig)] + ["h1", "h2", "variance_update"], **_FLAG_OVERRIDES
        )
    )
    return flags


def _parse_hp(items: Optional[list[str]]) -> dict:
    """``["KEY=VALUE", ...]`` → dict; VALUE is a Python literal (0.9, (0.9, 0.99), True) or a string.

    Raises:
        ValueError: an item without ``=`` or an empty key, or a key given twice.
    """
    import ast

    out: dict = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--hp takes KEY=VALUE (e.g. --hp momentum=0.9), got {item!r}")
        if key in out:
            raise ValueError(f"--hp {key} given twice")
        try:
            out[key] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            out[key] = raw.strip()
    return out


def progress_status(info: dict) -> str:
    """The progress line of one step's ``on_step`` info (:func:`dpopt.training.train`): public values only.

    ε: the incremental RDP bound refreshed every step, beside the run's accountant's ε at the last
    evaluation (metrics row); before the first evaluation there is none ("at the first
    evaluation", not "0.000"). Then the last test metrics, and the batch loss only when
    ``--show-train-loss`` put it in ``info``, labelled NOT private.
    """
    bound, eps, accountant = info.get("epsilon_bound"), info.get("epsilon"), info.get("accountant")
    last = "at the first evaluation" if eps is None else f"{eps:.3f} at the last evaluation"
    if bound is not None and accountant != "rdp":
        status = f"ε ≤ {bound:.3f} (rdp bound; {accountant} ε {last})"
    elif bound is not None:
        status = f"ε {bound:.3f}"
    else:
        status = f"ε {last}"
    if info.get("test_accuracy") is not None:
        status += f"  test acc {info['test_accuracy']:.3f}  test loss {info['test_loss']:.3f}"
    if "loss" in info:
        status += f"  batch loss {info['loss']:.3f} (NOT private)"
    return status


def _recipe_line(summary: dict) -> str:
    """The from-scratch recipe's settings a summary records (views, augmentation, lr schedule), or ''."""
    parts = []
    if "augmentation_multiplicity" in summary:
        parts.append(f"{summary['augmentation_multiplicity']} view(s) per example, augment {summary['augment']}")
    if "lr_schedule" in summary:
        parts.append(f"lr schedule {summary['lr_schedule']}, {summary['warmup_steps']} warm-up step(s)")
    return ("recipe: " + "; ".join(parts)) if parts else ""


def _resume_command(summary: dict) -> str:
    """The command that continues an interrupted run (under torchrun when it ran on several processes)."""
    world = int(summary.get("world_size") or 1)
    launcher = f"torchrun --standalone --nproc_per_node {world} -m dpopt" if world > 1 else "dpopt"
    return f"{launcher} train --resume {summary['run_dir']}"


def _typed_flags(ctx: typer.Context, allowed: set) -> set:
    """The flags the user typed (or set through the environment), other than ``allowed`` parameters.

    Compares the parameter source, not the value: ``--epochs 10`` is refused with --resume even
    though 10 is the default (a value check let it through silently).
    """

    def typed(name: str) -> bool:
        source = ctx.get_parameter_source(name)  # click's ParameterSource (typer vendors click)
        return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")

    return {param.opts[0] for param in ctx.command.params if param.name not in allowed and typed(param.name)}


@group.command("train")
def train_command(
    ctx: typer.Context,
    dataset: str = typer.Option("digits", help=DATASET_HELP),
    data_dir: Optional[str] = typer.Option(None, help="directory with mnist.npz / IDX files, cifar10.npz"),
    model: Optional[str] = typer.Option(
        None,
        help="mlp-small (digits), mlp (mnist), cnn5 (cifar10; also cnn5-ws, "
        "wrn16-4, wrn16-4-ws, resnet18), or hf:DIR (a local "
        "save_pretrained directory; needs transformers)",
    ),
    method: str = typer.Option("dp-macadam", help="see `dpopt methods`"),
    noise_multiplier: Optional[float] = typer.Option(
        None, help="σ: noise std = σ × sensitivity (default 1.0; not with --target-epsilon)"
    ),
    delta: float = delta_option(1e-5, help="δ of the reported (ε, δ)"),
    max_grad_norm: Optional[float] = typer.Option(None, help="clip bound C (default 1.0; w-space for MacAdam)"),
    batch_size: float = typer.Option(
        64.0, help="expected batch size B̄ (public denominator); sample_rate = B̄/N unless --sample-rate is given"
    ),
    sample_rate: Optional[float] = typer.Option(
        None,
        help="Poisson rate q; default B̄/N, which treats the dataset size N as public (run files reveal it). "
        "With --sample-rate, --batch-size is only the public denominator of the noisy average: "
        "set it near q×N yourself (dpopt does not print q×N, which would reveal N)",
    ),
    epochs: float = typer.Option(
        10.0,
        help="epochs E: the run takes round(E / q) steps, q the sample rate; "
        "epoch k ends after step round(k / q); fewer than one step is refused",
    ),
    lr: Optional[float] = typer.Option(None, help="learning rate (default: the method's)"),
    seed: int = typer.Option(
        0,
        help="seed for model initialisation and non-private randomness; the noise and "
        "Poisson masks are secret (OS entropy) unless --reproducible-noise",
    ),
    reproducible_noise: bool = typer.Option(
        False,
        help="RESEARCH ONLY: seed the noise and masks from --seed (bit-identical reruns; no privacy "
        "against anyone who knows the seed; `dpopt check` fails the ledger)",
    ),
    secure_mode: bool = typer.Option(False, help="draw noise and masks from the OS CSPRNG (slower)"),
    show_train_loss: bool = typer.Option(
        False, help="show the loss of the private training batch in the progress bar: NOT PRIVATE (display only)"
    ),
    accountant: str = accountant_option("pld", help="pld (connect-the-dots), rdp or prv"),
    physical_batch_size: Optional[int] = typer.Option(
        None,
        help="micro-batch size for per-sample grads, in examples (with --augmult K: each with its K views, "
        "K× the rows)",
    ),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: torch's choice)"),
    out: Optional[str] = typer.Option(None, help="run directory (default runs/<method>-<dataset>-...)"),
    overwrite: bool = typer.Option(False, help="let --out replace an earlier run's files"),
    h1: Optional[float] = typer.Option(None, help="MacAdam/AdaClip clamp floor (paper value per dataset)"),
    h2: Optional[float] = typer.Option(None, help="MacAdam/AdaClip clamp ceiling (paper value per dataset)"),
    variance_update: Optional[str] = typer.Option(None, help="MacAdam: paper (default) or unbiased"),
    target_epsilon: Optional[float] = typer.Option(None, help="calibrate σ for this ε (overrides σ)"),
    clipping: str = typer.Option(
        "flat",
        help="flat, per-layer, quantile (adaptive, Andrew et al.) or auto "
        "(AUTO-S, Bu et al.: C·g/(‖g‖+γ); --hp gamma=0.01)",
    ),
    layer_bounds: Optional[str] = typer.Option(None, help="per-layer: comma-separated bounds, one per layer"),
    target_quantile: float = typer.Option(0.5, help="quantile: fraction of unclipped examples aimed at"),
    quantile_lr: float = typer.Option(0.2, help="quantile: geometric step size η_C"),
    count_share: Optional[float] = typer.Option(None, help="quantile: budget share of the count (0.05)"),
    count_noise_multiplier: Optional[float] = typer.Option(
        None, help="quantile: explicit count noise multiplier 2σ_b (refused if ≤ σ)"
    ),
    hp: Optional[list[str]] = typer.Option(
        None,
        "--hp",
        help="method hyperparameter KEY=VALUE, repeatable (e.g. --hp momentum=0.9 --hp "
        "ns_steps=5 --hp kappa=0.4 --hp gamma=1.5 --hp filter=second-order); "
        "see `dpopt methods` for each method's keys",
    ),
    max_epsilon: Optional[float] = typer.Option(
        None,
        help="stop before the step whose release would take ε past this budget (at --delta, with "
        "--accountant); everything is saved and the summary says so",
    ),
    checkpoint_every: Optional[int] = typer.Option(
        None, help="steps between checkpoints (default: every epoch; 0: only when the run stops)"
    ),
    log_every: Optional[int] = typer.Option(None, help="also write a metrics.jsonl row every this many steps"),
    tensorboard: Optional[str] = typer.Option(
        None,
        help="TensorBoard log directory: test metrics, ε, lr, clip bound and scale statistics (public "
        "values only) at every metrics row; needs the tensorboard package",
    ),
    device: str = typer.Option("cpu", help="cpu, cuda or auto (cuda if available): model, batches and noise"),
    validation_fraction: float = typer.Option(
        0.0,
        help="F in [0, 1): hold out round(F×N) training records (halves up; a fixed public permutation, the "
        "same for every --seed) for val_accuracy / val_loss, never trained on. They get NO protection "
        "(released like the test set); N, q = B̄/N and ε are those of the remaining records. Choosing "
        "hyperparameters by validation accuracy over several runs is NOT charged to ε: each run's ε is "
        "for that run, tuning over k runs costs more (Liu & Talwar 2019; Papernot & Steinke 2022)",
    ),
    init_from: Optional[str] = typer.Option(
        None, help="fine-tune from these PUBLIC weights: a dpopt model.pt or a torch state dict (local file)"
    ),
    freeze: Optional[list[str]] = typer.Option(
        None, help="do not train parameters whose names match this shell pattern (repeatable, e.g. '0.*')"
    ),
    lora_rank: Optional[int] = typer.Option(
        None, help="train PEFT LoRA adapters of this rank on every linear layer, base weights frozen (needs peft)"
    ),
    augmult: int = typer.Option(
        1,
        "--augmult",
        help="K augmented views per example (cifar10; long form --augmentation-multiplicity K); each "
        "example's gradient is the mean over its views, clipped once: same ε as K = 1, K× the "
        "compute (De et al. 2022; docs/recipe.md)",
    ),
    augmentation_multiplicity: Optional[int] = typer.Option(
        None, "--augmentation-multiplicity", hidden=True, help="the long form of --augmult"
    ),
    augment: Optional[str] = typer.Option(
        None,
        help="augmentation of the training batches: crop-flip (random crop, padding 4, + horizontal flip; "
        "default when K > 1), flip or none",
    ),
    ema_decay: Optional[float] = typer.Option(
        None,
        help="also keep an EMA of the released parameters with this decay (e.g. 0.999; warm-up "
        "min(D, (1+t)/(10+t))): evaluated every metrics row and saved as model_ema.pt (post-processing)",
    ),
    lr_schedule: str = typer.Option(
        "constant", help="constant or cosine (decay to ~0 at the last step), after --warmup-steps"
    ),
    warmup_steps: int = typer.Option(0, help="linear lr warm-up over this many steps (lr·(s+1)/W)"),
    noise_mechanism: str = typer.Option(
        "independent",
        help="independent, or correlated noise across steps (DP matrix factorization): banded:B (B bands) or "
        "blt / blt:N (N buffers); trains on cyclic batches; resume refused (docs/correlated-noise.md)",
    ),
    fsdp: bool = typer.Option(
        False,
        help="under torchrun: shard the model with FSDP2 (fully_shard) over the processes, per-example "
        "clipping and one noise draw per coordinate (dp-sgd, dp-adam; no checkpoints; docs/fsdp.md)",
    ),
    resume: Optional[str] = typer.Option(
        None,
        help="RUN_DIR: continue an interrupted run to its planned steps with its saved configuration "
        "(only --device, --threads and --json may be given with it)",
    ),
    json_out: bool = json_option("print the summary as one JSON object (last line)"),
) -> None:
    """Train a model with differential privacy and report test accuracy and (ε, δ).

    SIGINT (Ctrl-C) or SIGTERM finishes the current step and stops cleanly (ledger, metrics, checkpoint and
    summary written; exit code 130 or 143); `dpopt train --resume RUN_DIR` continues the run.

    Exit code 3: the run finished and every file is written, but its ledger check FAILED (σ = 0, an empty
    ledger, --reproducible-noise, ...): the ε it reports is not a guarantee; check.txt says why. 2: bad input.
    """
    import signal as _signal

    from rich.console import Console

    from ..training import LOSS_EVERY, TrainConfig, train

    if resume is not None:
        given = _typed_flags(ctx, allowed={"resume", "device", "threads", "json_out"})
        if given:
            fail(f"--resume continues with the run's saved configuration; do not give {', '.join(sorted(given))}")
    hparams = {k: v for k, v in {"h1": h1, "h2": h2, "variance_update": variance_update}.items() if v is not None}
    try:
        extra = _parse_hp(hp)
    except ValueError as exc:
        fail(str(exc))
    if set(extra) & set(hparams):
        fail(f"{sorted(set(extra) & set(hparams))} given both as an option and with --hp")
    hparams.update(extra)
    try:
        bounds = [float(b) for b in layer_bounds.split(",")] if layer_bounds else None
    except ValueError:
        fail(f"--layer-bounds must be comma-separated numbers, got {layer_bounds!r}")
    if noise_multiplier is not None and target_epsilon is not None:
        fail("give --noise-multiplier or --target-epsilon, not both (the target calibrates σ)")
    if augmentation_multiplicity is not None and augmult != 1 and augmentation_multiplicity != augmult:
        fail("give --augmult or --augmentation-multiplicity, not both")
    if augmentation_multiplicity is not None:
        augmult = augmentation_multiplicity
    cfg = TrainConfig(
        dataset=dataset,
        data_dir=data_dir,
        model=model,
        method=method,
        noise_multiplier=1.0 if noise_multiplier is None else noise_multiplier,
        delta=delta,
        max_grad_norm=max_grad_norm,
        batch_size=batch_size,
        epochs=epochs,
        lr=lr,
        seed=seed,
        accountant=accountant,
        physical_batch_size=physical_batch_size,
        out=out,
        hparams=hparams,
        target_epsilon=target_epsilon,
        clipping=clipping,
        layer_bounds=bounds,
        target_quantile=target_quantile,
        quantile_lr=quantile_lr,
        count_share=count_share,
        count_noise_multiplier=count_noise_multiplier,
        overwrite=overwrite,
        sample_rate=sample_rate,
        reproducible_noise=reproducible_noise,
        secure_mode=secure_mode,
        show_train_loss=show_train_loss,
        max_epsilon=max_epsilon,
        checkpoint_every=checkpoint_every,
        log_every=log_every,
        device=device,
        tensorboard=tensorboard,
        validation_fraction=validation_fraction,
        init_from=init_from,
        freeze=list(freeze) if freeze else None,
        lora_rank=lora_rank,
        augmentation_multiplicity=augmult,
        augment=augment,
        ema_decay=ema_decay,
        lr_schedule=lr_schedule,
        warmup_steps=warmup_steps,
        noise_mechanism=noise_mechanism,
    )
    if threads is not None:
        if threads < 1:
            fail(f"--threads must be >= 1, got {threads}")
        import torch

        torch.set_num_threads(threads)
    from ..allocator import tune_cpu_allocator

    tune_cpu_allocator()  # glibc: reuse freed activation blocks (dpopt.allocator; DPOPT_NO_ALLOCATOR_TUNING=1: off)
    import os

    # data parallel under torchrun (dpopt.distributed): rank 0 alone prints; the library writes files on rank 0
    quiet = int(os.environ.get("RANK", "0")) != 0
    console = Console(stderr=True, quiet=quiet)
    terminal = console.is_terminal and not quiet
    if not terminal:  # piped: no hard wrapping at 80 columns (paths stay on one line)
        console = Console(stderr=True, width=10_000, soft_wrap=True, quiet=quiet)
    # public values only: ε spent and the last test-set metrics; the private batch loss only if asked for.
    # The status goes on its own wrapped line under the bar (in the bar's row it was cut at 80 columns).
    progress = status_progress(console, disable=not terminal)
    task = None
    label = f"{method} on {dataset}" if resume is None else f"resuming {resume}"
    epoch_seen = [None]
    trained = [False]  # a step was trained (a resumed complete run trains none)

    def on_step(info: dict) -> None:
        nonlocal task
        trained[0] = True
        status = progress_status(info)
        if not terminal:  # one plain line per metrics row (epoch) on stderr
            if info["test_accuracy"] is not None and info["test_loss"] != epoch_seen[0]:
                epoch_seen[0] = info["test_loss"]
                console.print(
                    f"step {info['step']}/{info['steps']}  ε {info['epsilon']:.4f}  test acc "
                    f"{info['test_accuracy']:.4f}  test loss {info['test_loss']:.4f}",
                    markup=False,
                )
            if "loss" in info and (info["step"] - 1) % LOSS_EVERY == 0:  # --show-train-loss: when it is refreshed
                console.print(
                    f"step {info['step']}/{info['steps']}  batch loss {info['loss']:.4f} (NOT private: "
                    "the loss of the private training batch, display only)",
                    markup=False,
                )
            return
        if task is None:
            task = progress.add_task(label, total=info["steps"], status=status)
        progress.update(task, completed=info["step"], status=status)

    if reproducible_noise:
        console.print(
            "[bold red]warning:[/] --reproducible-noise: the noise and Poisson masks are seeded from "
            f"--seed {seed}; anyone who knows it can replay them, so this run has NO privacy "
            "guarantee (research reruns only). `dpopt check` will fail its ledger."
        )
    with cli_errors(train_flags(), interrupted="training interrupted", after_interrupt="; nothing was trained"):
        with progress, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="reproducible_noise", category=UserWarning)
            warnings.filterwarnings(
                "ignore", message=".* is already complete .*nothing to resume", category=UserWarning
            )
            if resume is not None:
                from ..training import resume as resume_run

                summary = resume_run(resume, on_step=on_step, device=None if device == "cpu" else device)
            elif fsdp:  # dpopt.fsdp_train: the model sharded over torchrun's processes
                from ..fsdp_train import train_fsdp

                summary = train_fsdp(cfg, on_step=on_step)
            else:
                summary = train(cfg, on_step=on_step)
    if summary.get("rank", 0) != 0:  # another rank of a data-parallel run: rank 0 reports
        return
    out_console = Console() if Console().is_terminal else Console(width=10_000, soft_wrap=True)
    if resume is not None and not trained[0] and summary.get("status", "completed") == "completed":
        console.print(
            f"note: {resume} is already complete ({summary['steps']} steps); nothing was trained, "
            "its files are unchanged",
            markup=False,
        )
    out_console.print(
        f"[bold]{summary['method']}[/] on {summary['dataset']} ({summary['model']}): "
        f"test accuracy {summary['test_accuracy']:.4f}, ε = {summary['epsilon']:.4f} at δ = {summary['delta']:g} "
        f"({summary['accountant']}), σ = {summary['noise_multiplier']:g}, q = {summary['sample_rate']:.5f}, "
        f"{summary['steps']} steps, {summary['wall_seconds']:.1f} s"
    )
    if "val_accuracy" in summary:
        out_console.print(
            f"validation accuracy {summary['val_accuracy']:.4f}, loss {summary['val_loss']:.4f} on "
            f"the held-out {summary.get('validation_fraction', 0):g} of the training set (never "
            "trained on; no protection, like the test set; not covered by ε)"
        )
    recipe = _recipe_line(summary)
    if recipe:
        out_console.print(recipe, markup=False)
    if "ema_test_accuracy" in summary:
        out_console.print(
            f"EMA model (decay {summary['ema_decay']:g}, post-processing; model_ema.pt): test accuracy "
            f"{summary['ema_test_accuracy']:.4f}, loss {summary['ema_test_loss']:.4f}"
        )
    if "target_epsilon" in summary:
        out_console.print(
            f"σ = {summary['noise_multiplier']:.4g} calibrated for target ε = {summary['target_epsilon']:g}"
        )
    if "count_share" in summary:
        out_console.print(
            f"quantile clipping: σ_grad = {summary['grad_noise_multiplier']:.4g}, count noise "
            f"multiplier 2σ_b = {summary['count_noise_multiplier']:.4g} (share "
            f"{summary['count_share']:.3g}); final C = {summary['final_max_grad_norm']:.4g}"
        )
    out_console.print(f"ledger check: {summary['check']}  (details: {summary['run_dir']}/check.txt)")
    out_console.print(f"run directory: {summary['run_dir']}")
    status = summary.get("status", "completed")
    if status == "interrupted":
        out_console.print(
            f"interrupted ({summary.get('stop_signal')}) after {summary['steps']} of "
            f"{summary['planned_steps']} steps, ε spent = {summary['epsilon']:.4f}; continue with: "
            f"{_resume_command(summary)}"
        )
    elif status == "budget_exhausted":
        out_console.print(
            f"stopped at the ε budget: {summary['steps']} of {summary['planned_steps']} steps, "
            f"ε = {summary['epsilon']:.4f} ≤ --max-epsilon {summary['max_epsilon']:g} (the next "
            "step would exceed it)"
        )
    if json_out:
        sys.stdout.write(dumps(summary) + "\n")
    if status == "interrupted":  # not finished: the check runs again when the resumed run completes
        raise typer.Exit(128 + (_signal.SIGTERM if summary.get("stop_signal") == "SIGTERM" else _signal.SIGINT))
    if summary.get("check", "pass") != "pass":
        typer.echo(
            f"error: the run's ledger check failed ({summary['check']}): its ε is not a privacy guarantee; "
            f"see {summary['run_dir']}/check.txt (exit code {EXIT_CHECK_FAILED})",
            err=True,
        )
        raise typer.Exit(EXIT_CHECK_FAILED)


@group.command("methods")
def methods_command(json_out: bool = json_option("machine-readable list")) -> None:
    """List every DP optimizer with its reference and default hyperparameters."""
    from ..methods import list_methods

    specs = list_methods()
    if json_out:
        rows = [
            {
                "name": s.name,
                "description": s.description,
                "reference": s.reference,
                "defaults": s.defaults,
                "dataset_defaults": s.dataset_defaults,
            }
            for s in specs
        ]
        sys.stdout.write(dumps(rows, default=str) + "\n")
        return
    for s in specs:
        defaults = ", ".join(f"{k}={v}" for k, v in s.defaults.items())
        typer.echo(f"{s.name:14s} {s.description}\n{'':14s} ref: {s.reference}\n{'':14s} defaults: {defaults}")
        for data, over in s.dataset_defaults.items():
            typer.echo(f"{'':14s} on {data}: " + ", ".join(f"{k}={v}" for k, v in over.items()))


def register(app: typer.Typer) -> None:
    """Add ``train`` and ``methods`` to ``app``."""
    app.add_typer(group)
