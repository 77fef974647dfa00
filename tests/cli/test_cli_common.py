"""The CLI's shared parts: error lines and exit codes, argument → flag translation, the app's layout."""

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from dpopt.cli import app
from dpopt.cli.common import cli_errors, cli_message, fail, flag_text, flags_for
from dpopt.errors import ConfigError


def _command(body):
    """A one-command app whose command runs ``body`` under the shared error handling."""
    one = typer.Typer()

    @one.command()
    def run() -> None:
        with cli_errors(flags_for(["batch_size", "accountant", "noise_multiplier"])):
            body()

    return one


@pytest.mark.parametrize(
    "exc, code, line",
    [
        (ConfigError("batch_size must be >= 1, got 0", "batch_size"), 2, "error: --batch-size must be >= 1, got 0"),
        (
            ConfigError("batch_size applies to accountant 'rdp' only", "batch_size", "accountant"),
            2,
            "error: --batch-size applies to --accountant rdp only",
        ),
        (ValueError("batch_size must be >= 1"), 2, "error: batch_size must be >= 1"),  # undeclared: as is
        (FileNotFoundError("no ledger.json in /x"), 2, "error: no ledger.json in /x"),
        (ValueError("epsilon is huge; use accountant 'rdp'"), 2, "error: epsilon is huge; use --accountant rdp"),
        (
            ValueError("raise target_epsilon or set noise_multiplier directly"),
            2,
            "error: raise target_epsilon or pass --noise-multiplier directly",
        ),
        (KeyboardInterrupt(), 130, "error: interrupted"),
        (KeyboardInterrupt("calibration interrupted at step 3"), 130, "error: calibration interrupted at step 3"),
    ],
)
def test_exceptions_become_one_error_line_and_an_exit_code(exc, code, line):
    def body():
        raise exc

    res = CliRunner().invoke(_command(body), [])
    assert res.exit_code == code
    assert res.stderr.strip() == line and res.stdout == ""


def test_other_exceptions_and_exits_pass_through():
    def exits():
        raise typer.Exit(1)

    assert CliRunner().invoke(_command(exits), []).exit_code == 1

    def bug():
        raise TypeError("a bug")

    res = CliRunner().invoke(_command(bug), [])
    assert isinstance(res.exception, TypeError)  # a bug stays a traceback, not a tidy "error:"


def test_fail_and_messages():
    with pytest.raises(typer.Exit) as info:
        fail("nope", code=3)
    assert info.value.exit_code == 3
    assert flags_for(["batch_size"], hparams="--hp") == {"batch_size": "--batch-size", "hparams": "--hp"}
    assert flag_text("unknown accountant 'foo'", {"accountant": "--accountant"}) == "unknown accountant 'foo'"
    assert flag_text("use accountant 'pld'", {}) == "use accountant 'pld'"  # a command without --accountant
    assert cli_message(RuntimeError("grid too fine")) == "RuntimeError: grid too fine"
    assert cli_message(ArithmeticError()) == "ArithmeticError: ArithmeticError"


def test_every_command_is_a_module_level_function_of_its_group():
    from dpopt.cli import accounting, audit, diagnose, split, sweep, train

    names = {}
    for module in (train, accounting, audit, split, diagnose, sweep):
        for info in module.group.registered_commands:
            fn = info.callback
            assert fn.__qualname__ == fn.__name__ and fn.__module__ == module.__name__
            names[info.name] = module.__name__.rsplit(".", 1)[1]
    assert names == {
        "train": "train",
        "methods": "train",
        "account": "accounting",
        "calibrate": "accounting",
        "ledger": "accounting",
        "check": "accounting",
        "audit": "audit",
        "split": "split",
        "diagnose": "diagnose",
        "sweep": "sweep",
        "report": "sweep",
    }
    assert [g.typer_instance for g in app.registered_groups] == [
        train.group,
        accounting.group,
        audit.group,
        split.group,
        diagnose.group,
        sweep.group,
    ]


def test_python_dash_m_dpopt():
    res = subprocess.run([sys.executable, "-m", "dpopt", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0
    for command in (
        "train",
        "methods",
        "account",
        "calibrate",
        "ledger",
        "check",
        "audit",
        "split",
        "diagnose",
        "sweep",
        "report",
    ):
        assert command in res.stdout


def test_help_imports_no_torch():
    code = "import sys\nfrom dpopt.cli import app\nprint('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr


def test_library_advice_to_set_an_argument_instead_names_the_flag():
    """The library's "set target_epsilon instead" reads "give --target-epsilon instead" in a command (the
    noise_mechanism + max_epsilon refusal of TrainConfig); other commands' text is left alone."""
    flags = flags_for(["target_epsilon", "max_epsilon"])
    text = "max_epsilon is not supported; set target_epsilon instead"
    assert flag_text(text, flags) == "max_epsilon is not supported; give --target-epsilon instead"
    assert flag_text(text, {}) == text
    exc = ConfigError("noise_mechanism: max_epsilon is not supported; set target_epsilon instead", "max_epsilon")
    assert cli_message(exc, flags) == "noise_mechanism: --max-epsilon is not supported; give --target-epsilon instead"


def test_train_help_says_which_epochs_are_refused():
    """`--epochs 0.05` is accepted (≥ one step at digits' q); the help names the refusal that exists: an E that
    rounds to 0 steps (the old "fewer than one is refused" read as fewer than one epoch)."""
    res = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert res.exit_code == 0
    assert "fewer than one is refused" not in res.output and "rounds to 0 steps is refused" in res.output
