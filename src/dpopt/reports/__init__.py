"""Reports written for people: the budget split explorer's HTML page and PNG plot.

Post-processing of public values only (configuration and accountant output);
nothing here sees private data. :mod:`.split_html` needs only the standard
library; :mod:`.split_plot` needs matplotlib (``pip install dpopt[plots]``).
"""

from .split_html import render_split_html, write_split_html

__all__ = ["render_split_html", "write_split_html", "write_split_png"]


def write_split_png(table, path):
    """Draw the explorer's plot (see :func:`dpopt.reports.split_plot.write_split_png`); needs matplotlib."""
    from .split_plot import write_split_png as _write

    return _write(table, path)
