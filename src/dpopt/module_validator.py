"""Opacus's ``ModuleValidator`` (``validate`` / ``fix`` / ``is_valid``) over :mod:`dpopt.validator`.

``from dpopt.module_validator import ModuleValidator`` stands in for
``from opacus.validators import ModuleValidator``: the same three class
methods, with dpopt's list of refused layers (:mod:`dpopt.validator`: batch
norm, instance norm with running statistics, ``max_norm``/sparse embeddings)
and dpopt's fixes (BatchNorm → GroupNorm, the others switched off). Errors
are :class:`UnsupportedModuleError` (a ``ValueError``), as Opacus's name.
"""

from __future__ import annotations

from torch import nn

from . import validator

__all__ = ["ModuleValidator", "UnsupportedModuleError"]


class UnsupportedModuleError(ValueError):
    """A module dpopt's per-sample engines refuse (Opacus's name); the message lists each problem and its fix."""


class ModuleValidator:
    """Opacus's ``ModuleValidator`` interface (class methods only)."""

    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False) -> list[str]:
        """The problems of ``module`` (one line each: the layer, why, the fix); ``[]`` when valid.

        Raises:
            UnsupportedModuleError: ``strict=True`` and some problem was found.
        """
        problems = validator.validate(module)
        if strict and problems:
            raise UnsupportedModuleError(
                "the model cannot be trained privately as is:\n  "
                + "\n  ".join(problems)
                + "\nModuleValidator.fix(model) (or PrivacyEngine.get_compatible_module) "
                "replaces these layers"
            )
        return problems

    @classmethod
    def is_valid(cls, module: nn.Module) -> bool:
        """True when :meth:`validate` finds nothing."""
        return not cls.validate(module)

    @classmethod
    def fix(cls, module: nn.Module, **kwargs) -> nn.Module:
        """A COPY of the module with every fixable layer replaced (:func:`dpopt.validator.fix` on a deep copy).

        As Opacus's ``ModuleValidator.fix``: the module given is left as it is
        (``model = ModuleValidator.fix(model)`` is the usual call).

        Opacus's keyword options (e.g. ``num_groups``) are not supported: dpopt
        picks GroupNorm's groups itself (:func:`dpopt.validator.groupnorm_groups`).

        Raises:
            TypeError: a keyword option was given.
        """
        if kwargs:
            raise TypeError(
                f"ModuleValidator.fix takes no options in dpopt (got {sorted(kwargs)}); it picks "
                "GroupNorm's num_groups as gcd(32, C) (dpopt.validator.groupnorm_groups); replace "
                "the layers yourself for another choice"
            )
        import copy

        return validator.fix(copy.deepcopy(module))

    @classmethod
    def fix_and_validate(cls, module: nn.Module) -> nn.Module:
        """:meth:`fix` then ``validate(strict=True)``; returns the fixed module."""
        fixed = cls.fix(module)
        cls.validate(fixed, strict=True)
        return fixed
