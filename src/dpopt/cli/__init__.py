"""The ``dpopt`` command line (console script ``dpopt = dpopt.cli:main``; also ``python -m dpopt``).

One module per command group, each a ``typer.Typer`` whose commands are
merged into :data:`app`:

* :mod:`dpopt.cli.train` — ``train``, ``methods``;
* :mod:`dpopt.cli.accounting` — ``account``, ``calibrate``, ``ledger``, ``check``;
* :mod:`dpopt.cli.audit` — ``audit``;
* :mod:`dpopt.cli.split` — ``split`` (the budget split explorer);
* :mod:`dpopt.cli.diagnose` — ``diagnose`` (spectral diagnostics, non-private);
* :mod:`dpopt.cli.sweep` — ``sweep``, ``report`` (grids of runs, tables and plots);
* :mod:`dpopt.cli.common` — what they share: ``error: ...`` lines and exit
  codes (2 bad input, 130 interrupted), the translation of library argument
  names to flags, the shared options (``--delta``, ``--accountant``, ``--json``)
  and the help layout (:func:`~dpopt.cli.common.tidy_help`).

``dpopt --version`` prints the package version.

Commands parse options, call the library and print; the work (validation,
training, accounting reports, audits) is the library's. Heavy imports (torch)
happen inside command bodies so that ``dpopt --help`` and the accounting
commands start fast.
"""

from __future__ import annotations

import os
import sys

import typer  # importing dpopt (the package) sets OMP_WAIT_POLICY=PASSIVE before torch loads

from . import accounting, audit, diagnose, split, sweep, train
from .common import tidy_help
from .faults import silence_closed_stdout

__all__ = ["app", "main"]

app = typer.Typer(
    name="dpopt",
    help="Differentially private training with adaptive optimizers; every release is charged.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for _group in (train.group, accounting.group, audit.group, split.group, diagnose.group, sweep.group):
    app.add_typer(_group)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"dpopt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print dpopt's version and exit."
    ),
) -> None:
    """Differentially private training with adaptive optimizers; every release is charged."""


tidy_help(app)


def main() -> None:  # pragma: no cover - console entry point
    """Run the ``dpopt`` command line.

    Under torchrun (a process group joined by :func:`dpopt.distributed.setup`), the process leaves
    the group once the command is done (every file written, the summary printed) and exits with
    ``os._exit`` after flushing stdout and stderr: gloo's threads torn down during the interpreter's
    shutdown aborted a finished rank (SIGABRT) in about 1 run in 8 on a 2-core machine, which made
    torchrun report a failure and kill rank 0 before its buffered summary line was written.
    """
    try:
        app()
        code = 0
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    silence_closed_stdout()  # a reader that went away (`| head -1`): no "Exception ignored" at exit
    if "torch.distributed" not in sys.modules:  # no process group possible (dpopt --help, accounting commands)
        sys.exit(code)
    from ..distributed import leave

    if not leave():
        sys.exit(code)
    if isinstance(code, str):  # sys.exit("message"): printed, exit status 1
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))
