"""The hf extra's range is the one CI tests (issue 21): pyproject's lower bounds are the versions .ci/run installs
in its second venv for tests/hf, and the newest the main install resolves lies inside the range."""

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _extra() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["hf"]
    return {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower(): d for d in deps}


def _version(text: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def _padded(text: str) -> tuple:
    v = _version(text)
    return v + (0,) * (3 - len(v))


def test_lower_bounds_are_the_versions_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    extra = _extra()
    for name in ("transformers", "peft"):
        pinned = re.search(rf'"{name}==([0-9.]+)"', ci)
        assert pinned, f".ci/run installs no pinned {name} for the oldest-versions run"
        low = re.search(r">=\s*([0-9.]+)", extra[name]).group(1)
        assert _padded(pinned.group(1)) == _padded(low), (name, low, pinned.group(1))  # 4.47 == 4.47.0
    assert "tests/hf" in ci[ci.index('"transformers==') :]


@pytest.mark.parametrize("name", ["transformers", "peft"])
def test_installed_version_is_inside_the_range(name):
    try:
        installed = _version(metadata.version(name))
    except metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed")
    spec = _extra()[name]
    low = _version(re.search(r">=\s*([0-9.]+)", spec).group(1))
    assert installed >= low
    high = re.search(r"<\s*([0-9.]+)", spec)
    if high:
        assert installed < _version(high.group(1))
