"""The repository's experiment configs load and read the data from data/ (issue 22: they named ../shared/data,
a directory only the project's own machines have)."""

from pathlib import Path

import pytest

from dpopt.experiments.sweep import load_sweep

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "experiments").rglob("*.toml"))


def test_there_are_configs():
    assert len(CONFIGS) >= 5


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_loads_and_reads_repository_data(path):
    text = path.read_text()
    assert "../shared" not in text.split("#")[0] and 'data_dir = "../' not in text
    sweep = load_sweep(str(path))
    for point in sweep.points:
        data_dir = point.options.get("data_dir")
        if point.options.get("dataset", "digits") in ("mnist", "cifar10"):
            assert data_dir is not None and not Path(data_dir).is_absolute() and not data_dir.startswith(".."), (
                path.name,
                data_dir,
            )


@pytest.mark.parametrize("path", [p for p in CONFIGS if "finetune" not in p.name], ids=lambda p: p.name)
def test_file_datasets_default_to_data(path):
    """Every config but the fine-tuning ones (which read a split they write under runs/) reads data/."""
    sweep = load_sweep(str(path))
    dirs = {p.options.get("data_dir") for p in sweep.points if p.options.get("dataset") in ("mnist", "cifar10")}
    assert dirs <= {"data"}, dirs


def test_data_dir_override_keeps_run_ids():
    path = ROOT / "experiments" / "macadam-mnist.toml"
    a, b = load_sweep(str(path)), load_sweep(str(path), data_dir="/elsewhere")
    assert [p.run_id for p in a.points] == [p.run_id for p in b.points]
    assert {p.options["data_dir"] for p in b.points} == {"/elsewhere"}
