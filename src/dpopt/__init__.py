"""dpopt: differentially private training with adaptive optimizers.

Every read of private data goes through a :class:`~dpopt.privatizer.Privatizer`,
which records each noisy release in a :class:`~dpopt.accounting.PrivacyLedger`;
the optimizers (DP-SGD, DP-Adam, DP-MacAdam, ...) are post-processing chains.

The public API is imported lazily so that ``import dpopt`` (and the CLI's
accounting commands) do not pay for importing torch.
"""

import os
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

# OpenMP's default spin-waiting stalls 2-thread torch ops whenever another process holds a
# core (measured 5-80x slowdowns of small ops on a shared machine). It only takes effect if
# set before torch is first imported; a user's own setting always wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The version lives in one place, pyproject.toml; an installed dpopt reads it from its metadata.
try:
    __version__ = version("dpopt")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "Privatizer": "dpopt.privatizer",
    "Release": "dpopt.privatizer",
    "QuantileClipping": "dpopt.privatizer",
    "ClipGeometry": "dpopt.types",
    "DPOptimizer": "dpopt.optim",
    "PrivacyLedger": "dpopt.accounting.ledger",
    "epsilon": "dpopt.accounting.accountant",
    "PoissonSampler": "dpopt.sampling",
    "NoiseSource": "dpopt.noise",
    "per_sample_gradients": "dpopt.engine.reference",
    "iter_per_sample_gradients": "dpopt.engine.reference",
    "iter_per_sample_sources": "dpopt.engine",
    "per_example_lm_loss": "dpopt.losses",
    "check_model": "dpopt.models",
    "make_optimizer": "dpopt.methods",
    "list_methods": "dpopt.methods",
    "get_method": "dpopt.methods",
    "TrainConfig": "dpopt.training",
    "train": "dpopt.training",
    "PrivacyEngine": "dpopt.privacy_engine",
    "DPDataLoader": "dpopt.data_loader",
    "validate": "dpopt.validator",
    "fix": "dpopt.validator",
    "BatchMemoryManager": "dpopt.utils.batch_memory_manager",
    "ModuleValidator": "dpopt.module_validator",
}

__all__ = [  # _EXPORTS sorted, then __version__, as a literal list that tools read (tests/test_package.py)
    "BatchMemoryManager",
    "ClipGeometry",
    "DPDataLoader",
    "DPOptimizer",
    "ModuleValidator",
    "NoiseSource",
    "PoissonSampler",
    "PrivacyEngine",
    "PrivacyLedger",
    "Privatizer",
    "QuantileClipping",
    "Release",
    "TrainConfig",
    "check_model",
    "epsilon",
    "fix",
    "get_method",
    "iter_per_sample_gradients",
    "iter_per_sample_sources",
    "list_methods",
    "make_optimizer",
    "per_example_lm_loss",
    "per_sample_gradients",
    "train",
    "validate",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dpopt' has no attribute {name!r}")
