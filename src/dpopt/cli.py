"""The ``dpopt`` command line.

Commands are grouped in modules that each register onto :data:`app`:
``cli_train`` (train, methods), ``cli_accounting`` (account, calibrate, ledger,
check) and ``cli_audit`` (audit). Heavy imports (torch) happen inside command
bodies so that accounting commands start fast.
"""

from __future__ import annotations

import typer  # importing dpopt (the package) sets OMP_WAIT_POLICY=PASSIVE before torch loads

from . import cli_accounting, cli_audit, cli_train

app = typer.Typer(
    name="dpopt",
    help="Differentially private training with adaptive optimizers; every release is charged.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for _module in (cli_train, cli_accounting, cli_audit):
    _module.register(app)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
