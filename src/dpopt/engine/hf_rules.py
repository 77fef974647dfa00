"""Fast rules of Hugging Face ``transformers`` layers, registered when such a layer is first planned.

:func:`dpopt.engine.rules.rule_for` calls :func:`register` (through
``rules.LAZY_RULES``, filled when the engine imports this module) the first
time it sees a module whose class lives in ``transformers`` (dpopt itself
never imports the package). Registered, by exact type:

* ``transformers.pytorch_utils.Conv1D`` (GPT-2's attention and MLP
  projections): ``out = x @ W + b`` with ``W [nx, nf]``, so example i's
  weight gradient is Σ_t a_it e_itᵀ (``[nx, nf]``, the transpose of a
  Linear's): a :class:`~dpopt.engine.layers.FactoredBlock` with the roles of
  input and output gradient swapped — ghost norm, direct or T = 1 closed
  form chosen by cost as for ``nn.Linear``; bias Σ_t e_it;
* ``LlamaRMSNorm`` and the RMSNorm classes of other models whose
  ``forward`` is the same code (Mistral, Qwen2): weight gradient
  Σ_t x̂_t ⊙ e_t with x̂ computed in float32 as the layer does
  (:func:`~dpopt.engine.layers.rms_norm_grads`).

Anything else from ``transformers`` falls back to the exact per-example path
(the first-batch check then covers it like any other layer).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, cast

from .layers import DirectBlock, FactoredBlock, LinearPart, rms_norm_grads
from .rules import LAZY_RULES, RULES, LayerCalls, linear_bias_sums, register_rule

__all__ = ["HF_RMS_NORMS", "register"]

HF_RMS_NORMS = (
    "llama.modeling_llama.LlamaRMSNorm",
    "mistral.modeling_mistral.MistralRMSNorm",
    "qwen2.modeling_qwen2.Qwen2RMSNorm",
)
"""RMSNorm classes given the rule if their ``forward`` is LlamaRMSNorm's code."""


def _conv1d(layer: LayerCalls) -> list:
    b, blocks = layer.batch_size, []
    if "weight" in layer.index:  # W [nx, nf]: g_i = Σ_t a_it e_itᵀ = LinearPart with a and e swapped
        blocks.append(
            FactoredBlock(
                layer.index["weight"],
                layer.shapes["weight"],
                [LinearPart(e, a, layer.dtype) for a, e in layer.calls],
                layer.budget,
                b,
            )
        )
    if "bias" in layer.index:
        blocks.append(
            DirectBlock(
                [layer.index["bias"]],  # type: ignore[arg-type]
                [linear_bias_sums(layer)],
            )
        )
    return blocks


def _rms(layer: LayerCalls) -> list:
    m = layer.module
    if "weight" not in layer.index:
        return []
    shape = tuple(layer.shapes["weight"])
    return [
        DirectBlock(
            [layer.index["weight"]],
            [
                cast(
                    Any,
                    sum(
                        rms_norm_grads(a, e, shape, cast(float, m.variance_epsilon), upcast=True)
                        for a, e in layer.calls
                    ),
                )
            ],
        )
    ]


def _load(path: str):
    mod, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module("transformers.models." + mod), name)
    except Exception:  # noqa: BLE001 — not in this transformers version
        return None


def _source(cls) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


_TYPES: list = []  # (class, rule fn, supports) found once per process


def _types() -> list:
    if not _TYPES:
        try:
            from transformers.pytorch_utils import Conv1D

            _TYPES.append((Conv1D, _conv1d, None))
        except Exception:  # noqa: BLE001 — a transformers without Conv1D
            pass
        llama = _load(HF_RMS_NORMS[0])
        code = _source(llama) if llama is not None else ""
        for path in HF_RMS_NORMS:
            cls = _load(path)
            if cls is not None and code and _source(cls) == code:
                _TYPES.append((cls, _rms, lambda m: hasattr(m, "variance_epsilon")))
    return _TYPES


def register() -> None:
    """Register the rules above that are not registered yet (idempotent)."""
    for cls, fn, supports in _types():
        if cls not in RULES:
            register_rule(cls, supports=supports, views="merge", chunked=fn is _conv1d)(fn)  # both sum over positions


LAZY_RULES["transformers."] = register  # called by rule_for on a transformers layer: never imports it before
