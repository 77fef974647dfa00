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


@pytest.fixture(scope="session")
def leaky():
    """The deliberately leaky privatizers and ledger checks of ``tests/auditing/leaky.py`` (test-only module).

    Loaded from its file by ``importlib`` (no ``sys.path`` change) and registered once as
    ``sys.modules["leaky"]``, so every test sees the same classes.
    """
    import importlib.util
    import sys
    from pathlib import Path

    if "leaky" in sys.modules:
        return sys.modules["leaky"]
    spec = importlib.util.spec_from_file_location("leaky", Path(__file__).parent / "auditing" / "leaky.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["leaky"] = module
    spec.loader.exec_module(module)
    return module
