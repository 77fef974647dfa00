"""Shared test fixtures."""

import pytest
import torch


@pytest.fixture
def float64():
    """Run the test with torch's default dtype set to float64 (restored afterwards)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
