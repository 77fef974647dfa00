"""Packaging facts a tool or a user reads: the literal ``__all__``, the version's single source."""

import re
from pathlib import Path

import dpopt

ROOT = Path(__file__).resolve().parents[1]


def test_all_is_the_lazy_exports_and_the_version():
    assert dpopt.__all__ == sorted(dpopt._EXPORTS) + ["__version__"]


def test_version_is_pyproject_s():
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert dpopt.__version__ in (declared, "0+unknown")  # 0+unknown: a source tree never installed
