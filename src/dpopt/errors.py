"""Library exceptions that name the arguments to change (the CLI maps them to its flags).

The library speaks in argument names (``batch_size``, ``noise_multiplier``);
the command line speaks in flags (``--batch-size``). A :class:`ConfigError`
carries the names of the arguments it is about, so a front end can translate
them without parsing the message: :func:`dpopt.cli` replaces each name by its
flag, and Python users read the names they passed.
"""

from __future__ import annotations

import re
from typing import Mapping

__all__ = ["ConfigError", "translate"]


class ConfigError(ValueError):
    """A value the user chose is invalid; the message says what to change.

    Args:
        message: the explanation, naming the arguments as the library spells
            them (e.g. ``"batch_size must be >= 1, got 0"``).
        arguments: those argument names (``("batch_size",)``).

    A ``ValueError`` subclass, so ``except ValueError`` keeps working.
    """

    def __init__(self, message: str, *arguments: str):
        super().__init__(message)
        self.arguments = tuple(arguments)


def translate(exc: BaseException, names: Mapping[str, str]) -> str:
    """The message of ``exc`` with each named argument replaced by ``names[argument]``.

    Only the arguments a :class:`ConfigError` declares are replaced, as whole
    words that are not part of a path or file name (``runs/model/model.pt`` keeps
    its ``model``: a word next to ``/``, ``\\`` or a ``.`` + letter is left alone);
    other exceptions are returned as ``str(exc)``.
    """
    text = str(exc)
    for arg in getattr(exc, "arguments", ()):
        if arg in names:
            text = re.sub(rf"(?<![\w\-/\\.]){re.escape(arg)}(?![\w\-/\\]|\.\w)", names[arg], text)
    return text
