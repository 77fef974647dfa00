"""Post-processing transforms (see :mod:`dpopt.transforms.base`)."""

from .adaclip import AdaClip
from .adam import ScaleByAdam
from .base import ClipGeometry, EvaluationPoint, Partition, StepContext, Transform, chain
from .filters import DiSK, LowPassFilter, doppler_coefficients
from .macadam import MacAdam
from .muon import ScaleByMuon, hidden_matrix_labels, muon_partition
from .newton_schulz import newton_schulz, orthogonalize, polar_exact, top_singular_value
from .sgd import Momentum, ScaleByLearningRate, scale_by_lr

__all__ = [
    "AdaClip",
    "ScaleByAdam",
    "ClipGeometry",
    "EvaluationPoint",
    "Partition",
    "StepContext",
    "Transform",
    "chain",
    "DiSK",
    "LowPassFilter",
    "doppler_coefficients",
    "MacAdam",
    "ScaleByMuon",
    "hidden_matrix_labels",
    "muon_partition",
    "newton_schulz",
    "orthogonalize",
    "polar_exact",
    "top_singular_value",
    "Momentum",
    "ScaleByLearningRate",
    "scale_by_lr",
]
