"""Experiments: resumable sweeps over ``train`` options and the tables/plots that summarise them.

* :mod:`.sweep` — :func:`~.sweep.load_sweep` (TOML config → grid points) and
  :func:`~.sweep.run_sweep` (runs them, appends each finished run to a results
  JSONL, skips what is already there; ``dpopt sweep``);
* :mod:`.report` — :func:`~.report.write_report` (mean ± std tables in markdown
  and CSV, PNG plots; ``dpopt report``).

Seeds in a sweep fix model initialisation only: the noise is secret unless a
config sets ``reproducible_noise`` (research only).
"""

from .report import summarize, write_report
from .sweep import load_sweep, parse_sweep, read_results, run_sweep

__all__ = ["load_sweep", "parse_sweep", "read_results", "run_sweep", "summarize", "write_report"]
