"""The test tiers (issue 23): markers declared in pyproject.toml, applied by path in tests/conftest.py."""

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def _conftest():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiers_conftest", TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "relpath, tiers",
    [
        ("distributed/test_ddp_resume.py::test_x", {"distributed"}),
        ("distributed/new_folder/test_new.py::test_y[a]", {"distributed"}),
        ("hf/test_trainer.py::test_z", {"hf"}),
        ("integration/test_hf_trainer.py::test_z", {"hf"}),
        ("cli/test_cli_train.py::test_train_digits_json_and_run_directory", set()),
        ("core/test_distributed_like_name.py::t", set()),  # a file name is not a folder
    ],
)
def test_tiers_by_path(relpath, tiers):
    assert _conftest().tiers_for(relpath) == tiers


def test_slow_list_marks_by_node_id_prefix(monkeypatch):
    conf = _conftest()
    monkeypatch.setattr(conf, "SLOW", ("training/test_resume.py::test_sigint",))
    assert conf.tiers_for("training/test_resume.py::test_sigint_stops_cleanly") == {"slow"}
    assert conf.tiers_for("training/test_resume.py::test_other") == set()


def test_collection_applies_the_markers():
    """`-m distributed` selects exactly the tests under tests/distributed/ (fresh pytest, collection only)."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "distributed",
            str(TESTS / "distributed"),
            str(TESTS / "cli" / "test_cli_common.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=TESTS.parent,
    )
    ids = [line for line in res.stdout.splitlines() if "::" in line]
    assert res.returncode == 0, res.stdout + res.stderr
    assert ids and all(i.startswith("tests/distributed/") for i in ids)


def test_every_marker_used_is_declared():
    """--strict-markers is on (pyproject.toml): an undeclared marker is a collection error, not a silent tier."""
    text = (TESTS.parent / "pyproject.toml").read_text()
    assert "--strict-markers" in text
    for tier in ("slow", "distributed", "hf", "gpu"):
        assert f'"{tier}: ' in text
