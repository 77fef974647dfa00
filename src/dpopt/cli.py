"""The ``dpopt`` command line.

Commands are grouped in modules that each register onto :data:`app`:
``cli_train`` (train, methods), ``cli_accounting`` (account, calibrate, ledger,
check) and ``cli_audit`` (audit). Heavy imports (torch) happen inside command
bodies so that accounting commands start fast.
"""

from __future__ import annotations

import os

# OpenMP's default spin-waiting makes 2-thread torch ops stall whenever another process holds
# a core (measured: small ops 5-80x slower on a shared 2-core machine). Must be set before
# torch is imported; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import typer  # noqa: E402

from . import cli_accounting, cli_audit, cli_train  # noqa: E402

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
