"""Post-processing transforms (see :mod:`dpopt.transforms.base`)."""

from .base import ClipGeometry, EvaluationPoint, Partition, StepContext, Transform, chain

__all__ = ["ClipGeometry", "EvaluationPoint", "Partition", "StepContext", "Transform", "chain"]
