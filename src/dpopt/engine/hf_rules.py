"""Fast rules of Hugging Face ``transformers`` layers, registered when such a layer is first planned.

:func:`dpopt.engine.rules.rule_for` imports this module the first time it
sees a module whose class lives in ``transformers`` (dpopt itself never
imports the package). Registered, by exact type:

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

from .layers import DirectBlock, FactoredBlock, LinearPart, rms_norm_grads
from .rules import RULES, LayerCalls, register_rule

__all__ = ["HF_RMS_NORMS"]

try:  # pragma: no branch
    from transformers.pytorch_utils import Conv1D
except Exception:  # noqa: BLE001 — a transformers without Conv1D: nothing to register
    Conv1D = None

if Conv1D is not None and Conv1D not in RULES:
    @register_rule(Conv1D)
    def _conv1d(layer: LayerCalls) -> list:
        b, blocks = layer.batch_size, []
        if "weight" in layer.index:  # W [nx, nf]: g_i = Σ_t a_it e_itᵀ = LinearPart with a and e swapped
            blocks.append(FactoredBlock(layer.index["weight"], layer.shapes["weight"],
                                        [LinearPart(e, a) for a, e in layer.calls], layer.budget, b))
        if "bias" in layer.index:
            blocks.append(DirectBlock([layer.index["bias"]],
                                      [sum(e.reshape(b, -1, e.shape[-1]).sum(1) for _, e in layer.calls)]))
        return blocks

HF_RMS_NORMS = ("llama.modeling_llama.LlamaRMSNorm", "mistral.modeling_mistral.MistralRMSNorm",
                "qwen2.modeling_qwen2.Qwen2RMSNorm")
"""RMSNorm classes given the rule if their ``forward`` is LlamaRMSNorm's code."""


def _rms(layer: LayerCalls) -> list:
    m = layer.module
    if "weight" not in layer.index:
        return []
    shape = tuple(layer.shapes["weight"])
    return [DirectBlock([layer.index["weight"]], [sum(rms_norm_grads(a, e, shape, m.variance_epsilon, upcast=True)
                                                      for a, e in layer.calls)])]


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


_LLAMA = _load(HF_RMS_NORMS[0])
if _LLAMA is not None:
    _code = _source(_LLAMA)
    for _path in HF_RMS_NORMS:
        _cls = _load(_path)
        if _cls is not None and _cls not in RULES and _code and _source(_cls) == _code:
            register_rule(_cls, supports=lambda m: hasattr(m, "variance_epsilon"))(_rms)
