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
    USAGE_ERRORS,
    accountant_option,
    cli_errors,
    delta_option,
    fail,
    flags_for,
    json_option,
    status_progress,
)
from .faults import BAD_PATH_ERRNOS, clean_warnings, os_failure, pipe_safe

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
    """The status lines of one step's ``on_step`` info (:func:`dpopt.training.train`): public values only.

    Line 1, ε: the incremental RDP bound refreshed every step, beside the run's accountant's ε at
    the last evaluation, named by its step (after ``--resume`` that is a step of the earlier
    segment, never shown as this step's); before the first evaluation there is none ("at the first
    evaluation", not "0.000"). Line 2: the last test metrics (their step), and the batch loss only
    when ``--show-train-loss`` put it in ``info``, labelled NOT private. Each line fits in 80 columns.
    """
    bound, eps, accountant = info.get("epsilon_bound"), info.get("epsilon"), info.get("accountant")
    at = f"at step {info['metrics_step']}" if info.get("metrics_step") is not None else "at the last evaluation"
    last = "at the first evaluation" if eps is None else f"{eps:.3f} {at}"
    if bound is not None and accountant != "rdp":
        status = f"ε ≤ {bound:.3f} (rdp bound; {accountant} ε {last})"
    elif bound is not None:
        status = f"ε {bound:.3f}"
    else:
        status = f"ε {last}"
    second = []
    if info.get("test_accuracy") is not None:
        where = f" ({at})" if bound is not None and accountant == "rdp" else ""
        second.append(f"test acc {info['test_accuracy']:.3f}  test loss {info['test_loss']:.3f}{where}")
    if "loss" in info:
        second.append(f"batch loss {info['loss']:.3f} (NOT private)")
    return status + ("\n" + "  ".join(second) if second else "")


def _batches_text(summary: dict) -> str:
    """How the run's batches were drawn, as the ε it claims reads them: Poisson at rate q (amplified), or b
    cyclic batches of correlated noise, which claim no amplification (the q of B̄/N is not a sampling rate)."""
    if summary.get("sampling") == "cyclic":
        return f"cyclic batches, b = {summary['min_separation']}, no amplification"
    if summary.get("sampling") == "cyclic-poisson":
        return f"q = {summary['sample_rate']:.5f} within b' = {summary['min_separation']} cyclic parts"
    return f"q = {summary['sample_rate']:.5f}"


def _recipe_line(summary: dict) -> str:
    """The from-scratch recipe's settings a summary records (views, augmentation, lr schedule), or ''."""
    parts = []
    if "augmentation_multiplicity" in summary:
        parts.append(f"{summary['augmentation_multiplicity']} view(s) per example, augment {summary['augment']}")
    if "lr_schedule" in summary:
        parts.append(f"lr schedule {summary['lr_schedule']}, {summary['warmup_steps']} warm-up step(s)")
    return ("recipe: " + "; ".join(parts)) if parts else ""


def _after_interrupt(summary: dict) -> str:
    """What the interrupted run's line says next: how to continue it, or why it cannot be continued."""
    if summary.get("fsdp"):
        return "a --fsdp run keeps no checkpoint and cannot be resumed (a new run's ε adds to this one's)"
    if summary.get("noise_mechanism"):
        return (
            f"a correlated-noise run ({summary['noise_mechanism']}) cannot be resumed: its noise stream is never "
            "saved (a new run's ε adds to this one's)"
        )
    return f"continue with: {_resume_command(summary)}"


def _resume_command(summary: dict) -> str:
    """The command that continues an interrupted run (under torchrun when it ran on several processes)."""
    world = int(summary.get("world_size") or 1)
    launcher = f"torchrun --standalone --nproc_per_node {world} -m dpopt" if world > 1 else "dpopt"
    return f"{launcher} train --resume {summary['run_dir']}"


def _disk_failure(exc: OSError, run_dir: Optional[str]) -> None:
    """A disk that refused a write of the run: exit 4 with how the run directory goes on (resume only when it
    can: :func:`~dpopt.accounting.run_continuation.continuation`); other errors are re-raised as they are."""
    from ..errors import RunWriteError

    where = exc.run_dir if isinstance(exc, RunWriteError) else run_dir
    if isinstance(exc, USAGE_ERRORS) or exc.errno in BAD_PATH_ERRNOS or where is None:
        raise exc  # bad input (exit 2: cli_errors), or no run directory to speak of
    from ..accounting.run_continuation import continuation

    fail(*os_failure(exc, continuation(str(where)).advice(free_space=True)))


#: ``--dtype`` values ``dpopt train`` accepts: its built-in models, batches and noise are float32.
DTYPES = ("float32", "fp32", "torch.float32")


def _dtype_refusal(dtype: str) -> str:
    """The error of ``dpopt train --dtype <dtype>`` for a value not in :data:`DTYPES`: what is accepted and where
    bf16/fp16 training is (the engine and DPTrainer doors)."""
    return (
        f"--dtype {dtype!r} is not accepted: dpopt train trains its built-in models in float32 only (accepted "
        "value: float32, the default, also spelled fp32 or torch.float32; or leave --dtype out). To train in bf16 "
        "or fp16, use "
        "PrivacyEngine.make_private on your own model (model.to(torch.bfloat16), or torch.autocast) or "
        "dpopt.hf.DPTrainer with TrainingArguments(bf16=True) (docs/architecture.md, 'Mixed precision')"
    )


def _typed_flags(ctx: typer.Context, allowed: set) -> set:
    """The flags the user typed (or set through the environment), other than ``allowed`` parameters.

    Compares the parameter source, not the value: ``--epochs 10`` is refused with --resume even
    though 10 is the default (a value check let it through silently).
    """

    def typed(name: str) -> bool:
        source = ctx.get_parameter_source(name)  # click's ParameterSource (typer vendors click)
        return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")

    return {param.opts[0] for param in ctx.command.params if param.name not in allowed and typed(param.name)}


def _refuse_conflicts(ctx: typer.Context, extra: dict, clipping: str, own_flags: dict) -> None:
    """Fail on options that contradict each other (one ``error:`` line, exit 2).

    * ``--hp lr=...`` with ``--lr`` (or ``--hp max_grad_norm=...`` with ``--max-grad-norm``): two
      values for one setting; the flag silently won before.
    * ``--target-quantile`` / ``--quantile-lr`` typed without ``--clipping quantile``: they would be
      ignored (the run clips at a fixed bound).
    """
    for key, value in own_flags.items():
        if key in extra and value is not None:
            flag = "--" + key.replace("_", "-")
            fail(f"--hp {key}={extra[key]!r} and {flag} {value:g} both set {key}; give one of them")
    if clipping != "quantile" and ctx.params.get("resume") is None:
        ignored = sorted(_typed_flags(ctx, allowed=set()) & {"--target-quantile", "--quantile-lr"})
        if ignored:
            fail(
                f"{' and '.join(ignored)} {'applies' if len(ignored) == 1 else 'apply'} to --clipping quantile only (this run's clipping is {clipping}); "
                "add --clipping quantile or drop them"
            )


@group.command("train")
def train_command(
    ctx: typer.Context,
    dataset: str = typer.Option("digits", help=DATASET_HELP),
    data_dir: Optional[str] = typer.Option(None, help="directory with mnist.npz / IDX files, cifar10.npz"),
    model: Optional[str] = typer.Option(
        None,
        help="mlp-small (digits), mlp (mnist), cnn5 (cifar10), cnn5-ws, wrn16-4, wrn16-4-ws, resnet18, "
        "or hf:DIR (a local save_pretrained directory)",
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
        help="Poisson rate q (default B̄/N, which makes N public: run files reveal it); with it, "
        "--batch-size is only the noisy average's public denominator: set it near q×N yourself",
    ),
    epochs: float = typer.Option(
        10.0,
        help="epochs E: round(E / q) steps, q the sample rate (an E that rounds to 0 steps is refused)",
    ),
    lr: Optional[float] = typer.Option(None, help="learning rate (default: the method's)"),
    seed: int = typer.Option(
        0,
        help="seed of the model's initialisation; the noise and masks stay secret (OS entropy)",
    ),
    reproducible_noise: bool = typer.Option(
        False,
        "--reproducible-noise",
        help="RESEARCH ONLY: seed the noise and masks from --seed: NO privacy (`dpopt check` fails it)",
    ),
    secure_mode: bool = typer.Option(False, "--secure-mode", help="draw noise and masks from the OS CSPRNG (slower)"),
    show_train_loss: bool = typer.Option(
        False,
        "--show-train-loss",
        help="show the loss of the private training batch in the progress bar: NOT PRIVATE (display only)",
    ),
    accountant: str = accountant_option("pld", help="pld (connect-the-dots), rdp or prv"),
    physical_batch_size: Optional[int] = typer.Option(
        None,
        help="micro-batch for per-sample gradients, in examples (each with its --augmult views)",
    ),
    compile: bool = typer.Option(
        False,
        "--compile",
        help="compile the per-sample capture (inductor), checked against eager on the first batch (docs/performance.md)",
    ),
    norm_form: Optional[str] = typer.Option(None, help="force a norm form: gram, chol or direct"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: torch's choice)"),
    out: Optional[str] = typer.Option(None, help="run directory (default runs/<method>-<dataset>-...)"),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="let --out replace an earlier run's files (a charged journal is kept aside)"
    ),
    h1: Optional[float] = typer.Option(None, help="MacAdam/AdaClip clamp floor (paper value per dataset)"),
    h2: Optional[float] = typer.Option(None, help="MacAdam/AdaClip clamp ceiling (paper value per dataset)"),
    variance_update: Optional[str] = typer.Option(None, help="MacAdam: paper (default) or unbiased"),
    target_epsilon: Optional[float] = typer.Option(None, help="calibrate σ for this ε (overrides σ)"),
    clipping: str = typer.Option(
        "flat",
        help="flat, per-layer, quantile (adaptive) or auto (AUTO-S; --hp gamma=0.01)",
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
        help="method hyperparameter KEY=VALUE, repeatable (e.g. --hp momentum=0.9); "
        "each method's keys: `dpopt methods`",
    ),
    max_epsilon: Optional[float] = typer.Option(
        None,
        help="stop before the step that would take ε past this budget (at --delta); all is saved",
    ),
    checkpoint_every: Optional[int] = typer.Option(
        None, help="steps between checkpoints (default: every epoch; 0: only when the run stops)"
    ),
    log_every: Optional[int] = typer.Option(None, help="also write a metrics.jsonl row every this many steps"),
    tensorboard: Optional[str] = typer.Option(
        None,
        help="TensorBoard log directory (public values only; needs the tensorboard package)",
    ),
    device: str = typer.Option("cpu", help="cpu, cuda or auto (cuda if available): model, batches and noise"),
    validation_fraction: float = typer.Option(
        0.0,
        help="F in [0, 1): hold out round(F×N) training records (a fixed public split) for val_accuracy, "
        "never trained on; they get NO protection. Tuning on them over several runs is NOT charged to ε "
        "(docs/pitfalls.md)",
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
        help="K augmented views per example (cifar10; long form --augmentation-multiplicity), averaged "
        "before the one clip: same ε, K× the compute (docs/recipe.md)",
    ),
    augmentation_multiplicity: Optional[int] = typer.Option(
        None, "--augmentation-multiplicity", hidden=True, help="the long form of --augmult"
    ),
    augment: Optional[str] = typer.Option(
        None,
        help="crop-flip (default when --augmult > 1), flip or none",
    ),
    ema_decay: Optional[float] = typer.Option(
        None,
        help="also keep an EMA of the released parameters (e.g. 0.999): evaluated too, saved as model_ema.pt",
    ),
    lr_schedule: str = typer.Option(
        "constant", help="constant or cosine (decay to ~0 at the last step), after --warmup-steps"
    ),
    warmup_steps: int = typer.Option(0, help="linear lr warm-up over this many steps (lr·(s+1)/W)"),
    user_ids: Optional[str] = typer.Option(
        None,
        "--user-ids",
        help="FILE: one user id per training record; user-level DP, ε per user (docs/privacy-unit.md)",
    ),
    max_records_per_user: int = typer.Option(
        16, help="with --user-ids: at most k records per sampled user (chosen at random)"
    ),
    noise_mechanism: str = typer.Option(
        "independent",
        help="independent, banded:B or blt[:N]: correlated noise (docs/correlated-noise.md)",
    ),
    sampling: Optional[str] = typer.Option(
        None,
        help="correlated noise: cyclic (default) or cyclic-poisson (amplified; --sample-rate: rate in a part)",
    ),
    fsdp: bool = typer.Option(
        False,
        "--fsdp",
        help="under torchrun: shard the model with FSDP2 (dp-sgd, dp-adam; no checkpoints; docs/fsdp.md)",
    ),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", hidden=True
    ),  # hidden: float32 is the only value, the flag exists to explain that (DTYPES)
    resume: Optional[str] = typer.Option(
        None,
        help="RUN_DIR: continue an interrupted run with its saved configuration (only --device, "
        "--threads, --repair-journal and --json may be given with it)",
    ),
    repair_journal: bool = typer.Option(
        False,
        "--repair-journal",
        help="with --resume: keep a damaged ledger.jsonl's readable lines, charge what the rest may hold",
    ),
    json_out: bool = json_option("print the summary as one JSON object (last line)"),
) -> None:
    """Train a model with differential privacy and report test accuracy and (ε, δ).

    SIGINT (Ctrl-C) or SIGTERM finishes the current step and stops cleanly (ledger, metrics, checkpoint and
    summary written; exit code 130 or 143); `dpopt train --resume RUN_DIR` continues the run.

    Exit code 3: the run finished and every file is written, but its ledger check FAILED (σ = 0, an empty
    ledger, --reproducible-noise, ...): the ε it reports is not a guarantee; check.txt says why. 2: bad input
    (also an output path that cannot be written). 4: the disk refused a write (full): files written before
    are unchanged; the error says how the run goes on. A damaged ledger.jsonl line: --resume RUN_DIR
    --repair-journal.
    """
    import signal as _signal

    from rich.console import Console

    from ..training import LOSS_EVERY, TrainConfig, train

    if dtype is not None and dtype not in DTYPES:
        fail(_dtype_refusal(dtype))
    if resume is not None:
        given = _typed_flags(ctx, allowed={"resume", "device", "threads", "json_out", "repair_journal"})
        if given:
            fail(f"--resume continues with the run's saved configuration; do not give {', '.join(sorted(given))}")
    elif repair_journal:
        fail("--repair-journal goes with --resume RUN_DIR (it repairs the journal of the run to continue)")
    hparams = {k: v for k, v in {"h1": h1, "h2": h2, "variance_update": variance_update}.items() if v is not None}
    try:
        extra = _parse_hp(hp)
    except ValueError as exc:
        fail(str(exc))
    if set(extra) & set(hparams):
        fail(f"{sorted(set(extra) & set(hparams))} given both as an option and with --hp")
    _refuse_conflicts(ctx, extra, clipping, {"lr": lr, "max_grad_norm": max_grad_norm})
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
        compile=compile,
        norm_form=norm_form,
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
        user_ids=user_ids,
        max_records_per_user=max_records_per_user,
        noise_mechanism=noise_mechanism,
        sampling=sampling,
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
    # a reader that goes away (`dpopt train 2>&1 | head -1`) silences the console, never the run
    err, std = pipe_safe(sys.stderr), pipe_safe(sys.stdout)
    console = Console(file=err, quiet=quiet)
    terminal = console.is_terminal and not quiet
    if not terminal:  # piped: no hard wrapping at 80 columns (paths stay on one line)
        console = Console(file=err, width=10_000, soft_wrap=True, quiet=quiet)
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
        if not terminal:  # one plain line per metrics row (epoch) on stderr, when the row is of this step
            fresh = info.get("metrics_step") == info["step"] if "metrics_step" in info else True
            if fresh and info["test_accuracy"] is not None and info["test_loss"] != epoch_seen[0]:
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
    had_summary = resume is not None and os.path.exists(os.path.join(resume, "summary.json"))
    with cli_errors(train_flags(), interrupted="training interrupted", after_interrupt="; nothing was trained"):
        with progress, clean_warnings(lambda line: console.print(line, markup=False)):
            warnings.filterwarnings("ignore", message="reproducible_noise", category=UserWarning)
            warnings.filterwarnings(
                "ignore", message=".* is already complete .*nothing to resume", category=UserWarning
            )
            try:
                if resume is not None:
                    from ..training import resume as resume_run

                    summary = resume_run(
                        resume,
                        on_step=on_step,
                        device=None if device == "cpu" else device,
                        repair_journal=repair_journal,
                    )
                elif fsdp:  # dpopt.fsdp_train: the model sharded over torchrun's processes
                    from ..fsdp_train import train_fsdp

                    summary = train_fsdp(cfg, on_step=on_step)
                else:
                    summary = train(cfg, on_step=on_step)
            except OSError as exc:
                _disk_failure(exc, resume or cfg.out)
    if summary.get("rank", 0) != 0:  # another rank of a data-parallel run: rank 0 reports
        return
    out_console = Console(file=std)
    if not out_console.is_terminal:
        out_console = Console(file=std, width=10_000, soft_wrap=True)
    if resume is not None and not trained[0] and summary.get("status", "completed") == "completed":
        done = "its files are unchanged" if had_summary else "its final files (summary.json, ...) are written now"
        console.print(
            f"note: {resume} is already complete ({summary['steps']} steps); nothing was trained, {done}",
            markup=False,
        )
    # two short lines, not one of ~125 characters that wrapped mid-figure at 80 columns
    out_console.print(
        f"[bold]{summary['method']}[/] on {summary['dataset']} ({summary['model']}): "
        f"test accuracy {summary['test_accuracy']:.4f}, {summary['steps']} steps, {summary['wall_seconds']:.1f} s"
    )
    out_console.print(
        f"ε = {summary['epsilon']:.4f} at δ = {summary['delta']:g} ({summary['accountant']}), "
        f"σ = {summary['noise_multiplier']:g}, {_batches_text(summary)}"
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
            f"{summary['planned_steps']} steps, ε spent = {summary['epsilon']:.4f}; " + _after_interrupt(summary)
        )
    elif status == "budget_exhausted":
        out_console.print(
            f"stopped at the ε budget: {summary['steps']} of {summary['planned_steps']} steps, "
            f"ε = {summary['epsilon']:.4f} ≤ --max-epsilon {summary['max_epsilon']:g} (the next "
            "step would exceed it)"
        )
    if json_out:
        std.write(dumps(summary) + "\n")
        std.flush()
    if status == "interrupted":  # not finished: the check runs again when the resumed run completes
        raise typer.Exit(128 + (_signal.SIGTERM if summary.get("stop_signal") == "SIGTERM" else _signal.SIGINT))
    if summary.get("check", "pass") != "pass":
        err.write(
            f"error: the run's ledger check failed ({summary['check']}): its ε is not a privacy guarantee; "
            f"see {summary['run_dir']}/check.txt (exit code {EXIT_CHECK_FAILED})\n"
        )
        raise typer.Exit(EXIT_CHECK_FAILED)


#: ``dpopt train --help``'s option groups (rich panels): at 80 columns one long table squeezed each help
#: into ~20 characters (336 lines); grouped, with shorter texts, it reads in about half the lines.
TRAIN_PANELS = {
    "Data and model": ("dataset", "data_dir", "model", "validation_fraction", "device", "threads"),
    "Privacy": (
        "noise_multiplier",
        "target_epsilon",
        "delta",
        "max_epsilon",
        "accountant",
        "batch_size",
        "sample_rate",
        "epochs",
        "max_grad_norm",
        "secure_mode",
        "reproducible_noise",
        "user_ids",
        "max_records_per_user",
        "noise_mechanism",
        "sampling",
    ),
    "Method": ("method", "lr", "hp", "h1", "h2", "variance_update", "lr_schedule", "warmup_steps", "seed"),
    "Clipping": ("clipping", "layer_bounds", "target_quantile", "quantile_lr", "count_share", "count_noise_multiplier"),
    "Fine-tuning and recipe": ("init_from", "freeze", "lora_rank", "augmult", "augment", "ema_decay"),
    "Run directory and output": (
        "out",
        "overwrite",
        "resume",
        "repair_journal",
        "checkpoint_every",
        "log_every",
        "tensorboard",
        "show_train_loss",
        "json_out",
    ),
    "Scale": ("physical_batch_size", "compile", "norm_form", "fsdp"),
}


def _set_panels(fn, panels: dict) -> None:
    """Put each option of ``fn`` into its rich help panel (every visible option in exactly one)."""
    import inspect

    where = {name: panel for panel, names in panels.items() for name in names}
    for name, param in inspect.signature(fn).parameters.items():
        info = param.default
        if isinstance(info, typer.models.ParameterInfo) and name in where:
            info.rich_help_panel = where[name]


_set_panels(train_command, TRAIN_PANELS)


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
