"""dpopt: differentially private training with adaptive optimizers.

Every read of private data goes through a :class:`~dpopt.privatizer.Privatizer`,
which records each noisy release in a :class:`~dpopt.accounting.PrivacyLedger`;
the optimizers (DP-SGD, DP-Adam, DP-MacAdam, ...) are post-processing chains.

The public API is imported lazily so that ``import dpopt`` (and the CLI's
accounting commands) do not pay for importing torch.
"""

import os
from importlib import import_module

# OpenMP's default spin-waiting stalls 2-thread torch ops whenever another process holds a
# core (measured 5-80x slowdowns of small ops on a shared machine). It only takes effect if
# set before torch is first imported; a user's own setting always wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

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

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dpopt' has no attribute {name!r}")
