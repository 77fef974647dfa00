"""Applies the privacy mutant named by $DPOPT_MUTANT at interpreter start (tests/auditing/mutants.py).

Only on PYTHONPATH while the mutation kill table runs (tests/auditing/mutants.py
puts it there), so every process of a mutated test run — pytest, the CLI
subprocesses it starts, gloo ranks — carries the same bug. Nothing in the
library reads the variable.
"""

import importlib.util
import os
import sys
from pathlib import Path

if os.environ.get("DPOPT_MUTANT"):
    _spec = importlib.util.spec_from_file_location(
        "dpopt_mutants", Path(__file__).resolve().parent.parent / "mutants.py"
    )
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["dpopt_mutants"] = _mod  # before exec: its dataclasses look their module up
    _spec.loader.exec_module(_mod)
    _mod.activate_from_env()
