"""Every ``dpopt * --help`` shows its help texts whole (issue 22: rich markup ate bracketed words).

typer renders help through rich markup, where ``[sweep]`` is a style tag: ``dpopt sweep --help``
printed "sweep config (TOML): , , , []" and "(default:  threads)". The tests render every command's
help as a user sees it and look for every word of every option, argument and command help text.
"""

import re

import click
import pytest
import typer
from typer.testing import CliRunner

from dpopt.cli import app
from dpopt.cli.common import escape_markup, reflow

runner = CliRunner()
_BOX = re.compile(r"[│╭╮╰╯─┌┐└┘|]")


def _commands() -> dict[str, click.Command]:
    root = typer.main.get_command(app)
    return {name: cmd for name, cmd in root.commands.items()}


def _flat(text: str) -> str:
    """Rendered help as one line: box characters dropped, whitespace collapsed."""
    return " ".join(_BOX.sub(" ", text).split())


def _unescape(text: str) -> str:
    """The help text as written: dpopt.cli.common.escape_markup undone (2k+1 backslashes + "[" -> k + "[")."""
    return re.sub(r"(\\+)\[", lambda m: "\\" * (len(m.group(1)) // 2) + "[", text)


def _texts(cmd: click.Command) -> list[str]:
    texts = [cmd.help or ""]
    for param in cmd.params:
        texts.append(getattr(param, "help", None) or "")
    return [_unescape(t) for t in texts if t]


def test_escape_markup_round_trip():
    from rich.text import Text

    for text in [
        "[sweep], [base], [grid], [[variant]]",
        "F in [0, 1)",
        "[bold]not a style[/]",
        "a \\[b] c",
        "no brackets",
    ]:
        escaped = escape_markup(text)
        assert Text.from_markup(escaped).plain == text
        assert _unescape(escaped) == text


def test_every_command_is_covered():
    assert {
        "train",
        "sweep",
        "report",
        "split",
        "diagnose",
        "audit",
        "account",
        "calibrate",
        "ledger",
        "check",
        "methods",
    } <= set(_commands())


@pytest.mark.parametrize("name", [""] + sorted(_commands()))
def test_help_shows_every_word_of_every_help_text(name):
    cmd = _commands()[name] if name else typer.main.get_command(app)
    res = runner.invoke(app, [name, "--help"] if name else ["--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    shown = _flat(res.output)
    missing = []
    for text in _texts(cmd):
        for word in text.split():
            if word == "\b":
                continue
            if word not in shown:
                missing.append(word)
    assert not missing, f"dpopt {name} --help lost {missing}"


def test_sweep_help_keeps_the_config_sections():
    res = runner.invoke(app, ["sweep", "--help"], env={"COLUMNS": "200"})
    shown = _flat(res.output)
    assert "sweep config (TOML): [sweep], [base], [grid], [[variant]]" in shown
    assert "(default: [sweep] threads)" in shown
    assert "(default: [sweep] out, else runs/sweeps/NAME)" in shown


def test_a_long_docstring_line_is_not_broken_in_two():
    """The sweep docstring's source line is longer than the 100-column help: it used to show
    "... a run with a checkpoint is" and "continued). ..." on separate lines."""
    res = runner.invoke(app, ["sweep", "--help"])  # not a terminal: 100 columns (tidy_help)
    lines = [line.strip() for line in res.output.splitlines()]
    assert not any(line.endswith("with a checkpoint is") for line in lines), res.output
    assert reflow("a\nb\n\n\bkeep\nlines\n\nc") == "a b\n\n\bkeep\nlines\n\nc"
