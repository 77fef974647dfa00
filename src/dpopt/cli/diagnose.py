"""Command ``dpopt diagnose``: per-layer spectral diagnostics (NON-PRIVATE research tool).

Computes the clean clipped mean gradient of a model (initialisation, or a
trained run with ``--checkpoint``) on ``--examples`` training examples with
dpopt's per-sample engine — WITHOUT noise and WITHOUT the ledger — and, for
each expected batch size, the noise std s = σC/B̄ the DP-SGD release would
carry, then writes the recovery table (✓ where B̄ ≥ B*), the SNR table, the
Monte Carlo cosine table, the figures and a JSON file to ``--out``. The math
is :mod:`dpopt.diagnostics`; nothing here feeds training. torch is imported
inside the command body.

Non-private output never goes into a run directory: an ``--out`` that is, or is
inside, a directory holding a run's files (:data:`RUN_MARKERS`: ``ledger.json``,
``summary.json``, ``model.pt``, ...) is refused before anything is computed.
Each ``.md`` file opens with a visible ``# NON-PRIVATE ...`` heading.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from ..atomic import atomic_write_text, check_writable_dir
from ..jsonio import dumps, loads
from .common import accountant_option, cli_errors, delta_option, fail, flags_for

group = typer.Typer()

#: Files that make a directory a `dpopt train` run directory (diagnose never writes in or below one).
RUN_MARKERS = (
    "ledger.json",
    "ledger.jsonl",
    "summary.json",
    "model.pt",
    "checkpoint.pt",
    "privacy_ledger.json",
    "privacy_summary.json",
)  # the last two: a DPTrainer checkpoint-N/
#: The first lines of every .md file diagnose writes: a heading a reader cannot miss.
MD_HEADING = "# NON-PRIVATE research diagnostics (not differentially private)"

DIAGNOSE_FLAGS = flags_for(
    [
        "dataset",
        "data_dir",
        "model",
        "batch_sizes",
        "noise_multiplier",
        "target_epsilon",
        "epochs",
        "checkpoint",
        "out",
        "examples",
        "max_grad_norm",
        "momentum",
        "trials",
        "delta",
        "accountant",
        "layer",
    ]
)

_HELP = (
    "Spectral diagnostics: which layers' leading gradient directions survive the DP noise, per batch size.\n\n"
    "NON-PRIVATE research tool: reads --examples training examples WITHOUT noise and WITHOUT the privacy "
    "ledger (the clean clipped mean gradient); use it only on data you may inspect. Its output never feeds "
    "training.\n\n"
    "For each weight matrix (conv kernels as out × in·k·k) and each B̄ in --batch-sizes: σ₁, effective and "
    "stable rank, spectral SNR, ρ = σ₁/(s(mn)^¼) with s = σC/B̄ (recoverable iff ρ > 1, BBP), B* with and "
    "without momentum, Monte Carlo recovery cosines vs the random-matrix prediction. σ per batch size: "
    "--noise-multiplier, or calibrated for --target-epsilon over --epochs at q = B̄/N. Writes recovery.md, "
    "snr.md, cosines.md, diagnostics.json, spectrum.png, recovery.png to --out."
)


def _check_checkpoint(checkpoint: str) -> None:
    """Fail with one ``error:`` line unless ``checkpoint`` is a run directory with config.json and model.pt."""
    run = Path(checkpoint)
    if not run.is_dir():
        what = "is a file" if run.exists() else "does not exist"
        fail(f"--checkpoint {checkpoint} {what}; give a `dpopt train` run directory (with config.json and model.pt)")
    missing = [name for name in ("config.json", "model.pt") if not (run / name).is_file()]
    if missing:
        fail(
            f"--checkpoint {checkpoint} has no {' or '.join(missing)}; give a finished `dpopt train` run "
            "directory (an interrupted one: `dpopt train --resume` it first)"
        )


def run_directory_at(out: Path) -> Optional[tuple[Path, list[str]]]:
    """(the run directory, its run files) if ``out`` is a run directory or lies inside one; else None."""
    path = out.expanduser().resolve()
    for folder in (path, *path.parents):
        found = [name for name in RUN_MARKERS if (folder / name).is_file()]
        if found:
            return folder, found
    return None


def _parse_batch_sizes(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"--batch-sizes must be comma-separated numbers, got {text!r}")
    if not out or any(b <= 0 for b in out):
        fail(f"--batch-sizes must be positive numbers, got {text!r}")
    return sorted(set(out))


@group.command("diagnose", help=_HELP)
def diagnose(
    dataset: str = typer.Option("cifar10", "--dataset", help="digits, mnist or cifar10"),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="directory with mnist.npz / cifar10.npz"),
    model: Optional[str] = typer.Option(None, "--model", help="mlp-small, mlp, cnn5 (default: the dataset's)"),
    batch_sizes: str = typer.Option("256,1024,4096", "--batch-sizes", help="expected batch sizes B̄, comma-separated"),
    noise_multiplier: Optional[float] = typer.Option(
        None, "--noise-multiplier", help="σ for every batch size (not with --target-epsilon)"
    ),
    target_epsilon: Optional[float] = typer.Option(
        None, "--target-epsilon", help="calibrate σ per batch size for this ε over --epochs"
    ),
    epochs: Optional[float] = typer.Option(None, "--epochs", help="epochs for the calibration (steps = epochs/q)"),
    delta: float = delta_option(1e-5),
    accountant: str = accountant_option(),
    checkpoint: Optional[str] = typer.Option(
        None,
        "--checkpoint",
        help="a `dpopt train` run directory: diagnose its model.pt (model named in its config.json)",
    ),
    out: str = typer.Option(..., "--out", help="output directory"),
    examples: int = typer.Option(
        1024, "--examples", min=1, help="training examples for the clean gradient (cost is linear in it)"
    ),
    max_grad_norm: float = typer.Option(1.0, "--max-grad-norm", help="clip bound C"),
    momentum: float = typer.Option(0.95, "--momentum", help="β for B* with momentum (DP-Muon's 0.95)"),
    trials: int = typer.Option(20, "--trials", min=0, help="Monte Carlo draws per layer and batch size"),
    layer: Optional[str] = typer.Option(None, "--layer", help="layer for the spectrum figure (default: largest)"),
    curve_points: int = typer.Option(
        16,
        "--curve-points",
        min=2,
        help="batch sizes on the theory curve of recovery.png (one σ calibration each with --target-epsilon)",
    ),
    seed: int = typer.Option(0, "--seed", help="seed of the example subset, the model init and the simulated noise"),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads"),
) -> None:
    """Run the diagnostics (help text above)."""
    if checkpoint is not None:  # first: a wrong path is the first thing to fix
        _check_checkpoint(checkpoint)
    bs = _parse_batch_sizes(batch_sizes)
    if (noise_multiplier is None) == (target_epsilon is None):
        fail("give exactly one of --noise-multiplier S or --target-epsilon E (with --epochs K)")
    if target_epsilon is not None and (epochs is None or epochs <= 0):
        fail("--target-epsilon needs --epochs K > 0 (the calibration's number of steps is K / q)")
    if not 0.0 <= momentum < 1.0:
        fail(f"--momentum must be in [0, 1), got {momentum}")
    if not max_grad_norm > 0:
        fail(f"--max-grad-norm must be > 0, got {max_grad_norm}")
    held = run_directory_at(Path(out))
    if held is not None:
        fail(
            f"--out {out}: {held[0]} is a training run's directory (it holds {', '.join(held[1])}); non-private "
            "diagnostics never go into a run directory, whose files are public by design. Choose an --out "
            "outside it, e.g. --out diagnostics/"
        )
    start = time.perf_counter()
    with cli_errors(DIAGNOSE_FLAGS):
        check_writable_dir(out)  # refused now, not after the diagnostics ran
        import torch
        from torch import nn

        from ..accounting.calibration import calibrate_noise_multiplier
        from ..data import load_dataset
        from ..diagnostics.gradients import NON_PRIVATE_NOTICE
        from ..diagnostics.model import diagnose_model
        from ..diagnostics.report import cosine_table, plot_recovery, plot_spectrum, recovery_table, snr_table
        from ..models import DEFAULT_MODEL, build_model, check_model
        from ..training.config import planned_steps

        if threads is not None:
            torch.set_num_threads(max(1, threads))
        typer.echo(NON_PRIVATE_NOTICE)
        data = load_dataset(dataset, data_dir)
        model_name = model or DEFAULT_MODEL[dataset]
        if checkpoint is not None:
            run = Path(checkpoint)
            cfg = loads((run / "config.json").read_text())
            model_name = cfg.get("model") or model_name
            if model is not None and model != model_name:
                fail(f"--model {model} does not match the checkpoint's model {model_name}")
        torch.manual_seed(seed)
        net = build_model(model_name, dataset)
        check_model(net)
        if checkpoint is not None:
            net.load_state_dict(torch.load(Path(checkpoint) / "model.pt", map_location="cpu", weights_only=True))
        n = data.n_train

        cache: dict = {}

        def sigma_of(b: float) -> float:
            if noise_multiplier is not None:
                return float(noise_multiplier)
            if b not in cache:
                q = min(1.0, b / n)
                steps = planned_steps(epochs, q)  # type: ignore[arg-type]  # as dpopt train: round(epochs / q), refused if 0
                cache[b] = calibrate_noise_multiplier(target_epsilon, delta, q, steps, accountant).noise_multiplier  # type: ignore[arg-type]
            return cache[b]

        sigmas = {b: sigma_of(b) for b in bs}
        for b in bs:
            typer.echo(f"B̄ = {b:g}: σ = {sigmas[b]:.4g}, noise std s = σC/B̄ = {sigmas[b] * max_grad_norm / b:.3g}")
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:examples]
        x, y = data.x_train[idx], data.y_train[idx]
        diag = diagnose_model(
            net,
            nn.functional.cross_entropy,
            x,
            y,
            batch_sizes=bs,
            noise_multipliers=sigmas,
            max_grad_norm=max_grad_norm,
            momentum=momentum,
            trials=trials,
            seed=seed,
            progress=typer.echo,
        )
        out_dir = Path(out)
        out_dir.mkdir(parents=True, exist_ok=True)
        setting = (
            f"{model_name} on {dataset}, {'checkpoint ' + checkpoint if checkpoint else 'initialisation'}"
            f" (seed {seed}), clean gradient from {len(y)} training examples, C = {max_grad_norm:g}, "
            + (
                f"σ = {noise_multiplier:g}"
                if noise_multiplier is not None
                else f"σ calibrated for ε = {target_epsilon:g}, δ = {delta:g} over {epochs:g} epochs ({accountant})"
            )
        )
        header = f"{MD_HEADING}\n\n**{NON_PRIVATE_NOTICE}**\n\n{setting}\n\n"
        tables = {"recovery.md": recovery_table(diag), "snr.md": snr_table(diag), "cosines.md": cosine_table(diag)}
        for name, text in tables.items():
            atomic_write_text(out_dir / name, header + text + "\n")
        doc = dict(diag.to_dict(), setting=setting, model=model_name, dataset=dataset, checkpoint=checkpoint)
        atomic_write_text(out_dir / "diagnostics.json", dumps(doc, indent=1, default=str))
        pick = (
            next((lay for lay in diag.layers if lay.name == layer), None)
            if layer
            else max(diag.layers, key=lambda lay: lay.shape[0] * lay.shape[1])
        )
        if pick is None:
            fail(f"--layer {layer} is not a matrix layer; choose one of {', '.join(lay.name for lay in diag.layers)}")
        plot_spectrum(diag, pick, out_dir / "spectrum.png", seed=seed)
        plot_recovery(diag, out_dir / "recovery.png", sigma_of, grid=curve_points)
        typer.echo("\nPer-layer recovery (✓: B̄ ≥ B*, the leading direction is recoverable)\n")
        typer.echo(tables["recovery.md"])
        typer.echo("\nSpectral SNR ‖Ḡ‖_F / ‖N‖_F\n")
        typer.echo(tables["snr.md"])
        typer.echo(
            f"\nwrote {', '.join(tables)}, diagnostics.json, spectrum.png, recovery.png to {out_dir} "
            f"in {time.perf_counter() - start:.1f} s"
        )
        typer.echo(NON_PRIVATE_NOTICE)
