"""docs/finetuning.md's architecture table is the one generated from the test zoos (tests/hf/architecture_table.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from architecture_table import ROWS, case_names, documented, table  # noqa: E402


def test_every_tested_case_has_a_row_and_no_row_is_untested():
    assert set(ROWS) == case_names()


def test_the_docs_table_is_the_generated_one():
    assert documented() == table(), "regenerate: python tests/hf/architecture_table.py --write"
