"""What every ``dpopt`` command shares: one way to fail, exceptions → exit codes, shared options.

Exit codes (the same for every command):

* ``0`` — done; ``1`` — a check or audit found a problem (``dpopt check``,
  ``dpopt audit``), set by the command itself;
* ``3`` — ``dpopt train`` finished (every file written) but the run's ledger check
  FAILED (σ = 0, an empty ledger, reproducible noise, ...): its ε is not a
  guarantee (:data:`EXIT_CHECK_FAILED`; ``check.txt`` in the run directory says why);
* ``2`` — the input cannot be used: one ``error: ...`` line on stderr, never a
  traceback (:func:`fail`; library ``ValueError`` — including
  :class:`dpopt.errors.ConfigError` and ``dpopt.data.DataError`` — and
  ``FileNotFoundError``, plus accountant failures in the accounting commands);
* ``4`` — the disk refused a write (full, quota, I/O error): one ``error:`` line; every file is
  replaced atomically, so nothing written before is changed (:mod:`dpopt.cli.faults`);
* ``130`` — interrupted (Ctrl-C): ``error: <what was interrupted>``.

The library names its *arguments* (``batch_size``); a command names its
*flags* (``--batch-size``). :func:`cli_errors` translates the arguments a
:class:`~dpopt.errors.ConfigError` declares with the command's mapping
(:func:`flags_for`), so messages read in the user's vocabulary.

Nothing here imports torch: ``dpopt --help`` and the accounting commands stay fast.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterable, Iterator, Mapping, NoReturn, Optional

import typer

from ..errors import translate

__all__ = [
    "ACCOUNTANT_HELP",
    "ACCOUNTING_ERRORS",
    "EXIT_CHECK_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "USAGE_ERRORS",
    "ACCOUNTANT_CHOICES",
    "HELP_MIN_WIDTH",
    "accountant_choices_text",
    "accountant_option",
    "cli_errors",
    "cli_message",
    "delta_option",
    "escape_markup",
    "fail",
    "flag_text",
    "flags_for",
    "reflow",
    "json_option",
    "status_progress",
    "tidy_help",
]

#: Exit code for input that cannot be used (as click's usage errors).
EXIT_USAGE = 2
#: Exit code of ``dpopt train`` when the finished run's ledger check fails (its files are all written).
EXIT_CHECK_FAILED = 3
#: Exit code after Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130

#: Library failures that mean "change the input": an ``error:`` line and exit 2.
USAGE_ERRORS: tuple = (ValueError, FileNotFoundError)
#: Failures of an accountant or a calibration, also shown as ``error:`` lines (never a traceback).
ACCOUNTING_ERRORS: tuple = (ValueError, FileNotFoundError, ImportError, RuntimeError, ArithmeticError, MemoryError)

ACCOUNTANT_HELP = "Accountant: pld (connect-the-dots PLD, default), rdp, or prv (needs prv-accountant)."

#: The accountants in words, for help texts and for the error on an unknown name.
ACCOUNTANT_CHOICES = {
    "pld": "privacy loss distributions, connect-the-dots: the default and the tightest",
    "rdp": "Rényi DP: fast, looser",
    "prv": "privacy random variables: needs the prv-accountant package",
}

#: Help is rendered at least this wide when stdout is not a terminal (files, pipes, CI logs)
#: and TERMINAL_WIDTH/COLUMNS are not set: rich's default of 80 columns truncated option names.
HELP_MIN_WIDTH = 100


# --------------------------------------------------------------------------- errors
def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code`` (2 unless said otherwise)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def flags_for(names: Iterable[str], **overrides: str) -> dict[str, str]:
    """``{argument: flag}``: each library argument name ``x_y`` → ``--x-y``, then ``overrides``.

    >>> flags_for(["batch_size"], hparams="--hp")
    {'batch_size': '--batch-size', 'hparams': '--hp'}
    """
    out = {name: "--" + name.replace("_", "-") for name in names}
    out.update(overrides)
    return out


def flag_text(text: str, flags: Mapping[str, str]) -> str:
    """Rewrite the library's advice phrases into the command's flags (for plain-text messages).

    ``accountant 'rdp'`` → ``--accountant rdp`` (for pld, rdp, prv) and ``set noise_multiplier
    directly`` → ``pass --noise-multiplier directly``, for the arguments in
    ``flags`` only; ``set target_epsilon instead`` → ``give --target-epsilon instead``.
    """
    if "accountant" in flags:
        text = re.sub(r"(?<![\w-])(?:--)?accountant '(pld|rdp|prv)'", rf"{flags['accountant']} \1", text)
    for name, flag in flags.items():
        for spelled in (name, flag):
            text = text.replace(f"set {spelled} directly", f"pass {flag} directly")
            text = text.replace(f"set {spelled} instead", f"give {flag} instead")
    return text


def cli_message(exc: BaseException, flags: Optional[Mapping[str, str]] = None) -> str:
    """The library's message for the user: declared arguments translated to ``flags``.

    A quoted value after a translated flag loses its quotes, as it would be
    typed (``clipping 'quantile'`` → ``--clipping quantile``).

    Exceptions other than ``ValueError``/``ImportError``/``OSError``/interrupts
    are prefixed with their type (``RuntimeError: ...``): they are not about
    the input, and the type helps a bug report.
    """
    flags = flags or {}
    text = translate(exc, flags) or type(exc).__name__
    for arg in getattr(exc, "arguments", ()):  # "--clipping 'quantile'" reads as typed: "--clipping quantile"
        if arg in flags:
            flag = flags[arg]
            text = re.sub(rf"(?<![\w-]){re.escape(flag)} '([^'\s]+)'", lambda m: f"{flag} {m.group(1)}", text)
    if not isinstance(exc, (ValueError, ImportError, OSError, KeyboardInterrupt)):
        text = f"{type(exc).__name__}: {text}"
    return flag_text(text, flags)


@contextlib.contextmanager
def cli_errors(
    flags: Optional[Mapping[str, str]] = None,
    *,
    errors: tuple = USAGE_ERRORS,
    interrupted: str = "interrupted",
    after_interrupt: str = "",
) -> Iterator[None]:
    """Run a command body; turn library exceptions into ``error:`` lines and exit codes.

    Args:
        flags: ``{argument: flag}`` of the command (see :func:`flags_for`).
        errors: exception types that exit 2 (default :data:`USAGE_ERRORS`).
        interrupted: the message for a bare Ctrl-C (an interrupt without a message).
        after_interrupt: appended to an interrupt's own message (e.g. ``"; nothing was trained"``).

    ``typer.Exit`` passes through unchanged (a command's own exit code). Any other ``OSError`` is one
    ``error:`` line too (:func:`dpopt.cli.faults.os_failure`: exit 2 for a path that cannot be
    used, 4 for a disk that refused a write).
    """
    try:
        yield
    except typer.Exit:
        raise
    except KeyboardInterrupt as exc:  # Ctrl-C; CalibrationInterrupted says what it interrupted
        fail(cli_message(exc, flags) + after_interrupt if str(exc) else interrupted, EXIT_INTERRUPTED)
    except errors as exc:
        fail(cli_message(exc, flags))
    except OSError as exc:  # a path that cannot be written (exit 2) or a disk that refused a write (exit 4)
        from .faults import os_failure

        fail(*os_failure(exc))


# --------------------------------------------------------------------------- shared options
#: What every ``--json`` help says about numbers (:mod:`dpopt.jsonio`).
JSON_NUMBERS_HELP = 'strict JSON: inf, -inf and NaN are the strings "inf", "-inf", "nan"'


def json_option(help: str = "Print one JSON object."):
    """``--json``: machine-readable output instead of text (strict JSON, :data:`JSON_NUMBERS_HELP`)."""
    return typer.Option(False, "--json", help=f"{help} ({JSON_NUMBERS_HELP})")


def delta_option(default=..., help: str = "δ in (0, 1), e.g. 1e-5."):
    """``--delta``: δ of the (ε, δ) guarantee (required unless a default is given)."""
    return typer.Option(default, "--delta", help=help)


def accountant_choices_text() -> str:
    """``pld (…), rdp (…) or prv (…)``: the accountants in words."""
    items = [f"{name} ({what})" for name, what in ACCOUNTANT_CHOICES.items()]
    return ", ".join(items[:-1]) + " or " + items[-1]


def _check_accountant_flag(value: Optional[str]) -> Optional[str]:
    """``--accountant`` callback: an unknown name is one ``error:`` line listing the choices in words."""
    if value is None or str(value).lower() in ACCOUNTANT_CHOICES:
        return value
    fail(f"unknown accountant {value!r} for --accountant; choose {accountant_choices_text()}")


def accountant_option(default: Optional[str] = "pld", help: str = ACCOUNTANT_HELP):
    """``--accountant``: pld, rdp or prv (an unknown name is refused with the choices in words)."""
    return typer.Option(default, "--accountant", help=help, callback=_check_accountant_flag)


# --------------------------------------------------------------------------- progress display
def status_progress(console, *, disable: bool):
    """A rich ``Progress`` whose tasks' ``status`` field is shown on its own line, wrapped, under the bar.

    One row per task: description, bar, ``done/total``, time remaining; then the task's status
    (ε, test metrics, and with ``--show-train-loss`` the batch loss and its NOT private label) on
    the next line, wrapped at the console's width. In one row the status was truncated to fit: at
    80 columns "batch loss 2.293 (NOT private)" lost its label. Add tasks with ``status=...``.
    rich is imported here, on the first call (a command that shows progress).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class _StatusProgress(Progress):
        def get_renderables(self):
            yield self.make_tasks_table(self.tasks)
            for task in self.tasks:
                status = task.fields.get("status")
                for line in str(status or "").splitlines():  # each line indented (a status may have several)
                    yield Text("  " + line, overflow="fold")

    # the description is text (a run directory may hold "["), never markup
    return _StatusProgress(
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        disable=disable,
    )


# --------------------------------------------------------------------------- help layout
def _widen(rich_utils) -> None:
    """Help :data:`HELP_MIN_WIDTH` wide when stdout is not a terminal and no width is set."""
    import os
    import sys

    if rich_utils.MAX_WIDTH is None and not os.environ.get("COLUMNS") and not sys.stdout.isatty():
        rich_utils.MAX_WIDTH = HELP_MIN_WIDTH


def _after_import(name: str, fn) -> None:
    """Call ``fn(module)`` once the module ``name`` is imported (now, if it already is).

    A one-shot ``sys.meta_path`` finder: it finds the module's spec with the remaining
    finders, then runs ``fn`` right after the module's own code.
    """
    import importlib.abc
    import importlib.util
    import sys

    if name in sys.modules:
        fn(sys.modules[name])
        return
    if any(getattr(f, "_dpopt_after", None) == name for f in sys.meta_path):
        return

    class _After(importlib.abc.MetaPathFinder):
        _dpopt_after = name

        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                fn(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _After())


def escape_markup(text: str) -> str:
    """``text`` with every ``[`` escaped for rich markup: rendered, it reads exactly as ``text``.

    Unlike :func:`rich.markup.escape` (which escapes only ``[`` that starts a tag, so ``[[variant]]``
    still lost its inner ``[variant]``), every ``[`` gets a backslash and the backslashes in front of it
    are doubled.

    >>> escape_markup("[sweep], [[variant]]")
    '\\\\[sweep], \\\\[\\\\[variant]]'
    """
    return re.sub(r"(\\*)\[", lambda m: m.group(1) * 2 + "\\[", text)


def reflow(doc: str) -> str:
    """A docstring's paragraphs each on one line (paragraphs: blank-line separated; ``\\b`` ones kept).

    typer's rich help keeps a docstring's line breaks *and* wraps at the terminal width, so a
    source line a little longer than the help (100 columns when piped) broke in two:
    "... a run with a checkpoint is" / "continued). ...". Joined, each paragraph is wrapped once.
    A paragraph that starts with click's ``\\b`` marker keeps its lines.

    >>> reflow("One line\\nand the next.\\n\\nSecond.")
    'One line and the next.\\n\\nSecond.'
    """
    import inspect

    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(doc))
    out = [p if p.startswith("\b") else " ".join(line.strip() for line in p.splitlines()) for p in paragraphs]
    return "\n\n".join(out)


def _escape_markup(app: typer.Typer) -> None:
    """Escape rich markup in every help text of ``app`` (once), so ``[sweep]`` is shown, not taken for a tag.

    typer renders help with rich markup when the app's ``rich_markup_mode`` is ``"rich"`` (typer's
    default since 0.12 where rich is installed; older typer showed plain text): a bracketed word such
    as ``[sweep]`` or ``[[variant]]`` was read as a style tag and vanished from ``dpopt sweep --help``.
    No dpopt help text uses markup on purpose, so in that mode every ``[`` is escaped
    (:func:`escape_markup`) in the option and argument helps and in each command's help (its
    docstring when no ``help=`` is given, its paragraphs first joined by :func:`reflow`); in any
    other mode nothing is changed. Plain strings only:
    nothing of rich is imported here.
    """
    import inspect

    import typer.core

    mode = getattr(app.rich_markup_mode, "value", app.rich_markup_mode)  # a DefaultPlaceholder in some typers
    if getattr(app, "_dpopt_escaped", False) or mode != "rich" or not getattr(typer.core, "HAS_RICH", True):
        return
    app._dpopt_escaped = True  # type: ignore[attr-defined]
    if isinstance(app.info.help, str):
        app.info.help = escape_markup(app.info.help)
    typers = [app] + [info.typer_instance for info in app.registered_groups if info.typer_instance is not None]
    callbacks = [app.registered_callback] if app.registered_callback is not None else []
    for sub in typers:
        if sub is not app and isinstance(sub.info.help, str):
            sub.info.help = escape_markup(sub.info.help)
        for command in sub.registered_commands:
            doc = command.help if command.help is not None else inspect.getdoc(command.callback)
            if isinstance(doc, str):
                command.help = escape_markup(reflow(doc))
            callbacks.append(command)  # type: ignore[arg-type]
    for item in callbacks:
        fn = getattr(item, "callback", None)
        if fn is None:
            continue
        for param in inspect.signature(fn).parameters.values():
            info = param.default
            if (
                isinstance(info, typer.models.ParameterInfo)
                and isinstance(info.help, str)
                and not getattr(info, "_dpopt_escaped", False)
            ):
                info.help = escape_markup(info.help)
                info._dpopt_escaped = True  # type: ignore[attr-defined]


def tidy_help(app: typer.Typer) -> None:
    """Make ``--help`` readable: option names never truncated, flags shown without a type, no text lost.

    * Width: when stdout is not a terminal and neither ``TERMINAL_WIDTH`` nor
      ``COLUMNS`` is set, help is rendered :data:`HELP_MIN_WIDTH` columns wide
      (rich's default of 80 squeezed ``--reproducible-noise`` to ``--reproducible-noi…``).
    * Flags: a boolean option takes no value, so its type column (``<bool>``)
      is left empty (including ``--help``).

    ``typer.rich_utils`` (rich's markdown, tables, tracebacks: 0.1-0.25 s of imports) is
    not imported here: typer imports it only to render help or an error, and the width
    is set at that moment (:func:`_after_import`). A command that runs (``dpopt
    calibrate ...``) never pays for it.
    * Markup: help texts are shown as written (:func:`_escape_markup`: ``[sweep]`` is
      text, not a rich style tag).
    """
    import typer.core

    _escape_markup(app)

    _after_import("typer.rich_utils", _widen)

    option_cls = typer.core.TyperOption
    if not getattr(option_cls.display_type_rich, "_dpopt_flags", False):
        shown = option_cls.display_type_rich

        def display_type_rich(self, ctx):
            if getattr(self, "is_flag", False) and not getattr(self, "count", False) and self.metavar is None:
                return None
            return shown(self, ctx)

        display_type_rich._dpopt_flags = True  # type: ignore[attr-defined]
        option_cls.display_type_rich = display_type_rich  # type: ignore[method-assign]
