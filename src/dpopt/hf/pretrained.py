"""Starting points of a private fine-tune in ``dpopt train``: local weights, local HF directories, freezing, LoRA.

Everything here reads LOCAL files only (never a hub download at run time):

* :func:`load_hf_model` — ``--model hf:DIR``: a directory written by
  ``save_pretrained`` (``config.json`` naming the architecture), loaded with
  ``local_files_only=True`` and wrapped in :class:`HFLogits` so that dpopt's
  loop can call ``model(x)`` on its batches;
* :func:`load_weights` — ``--init-from PATH``: a dpopt ``model.pt`` (the
  ``state_dict`` a run directory holds) or any torch state dict (also the
  ``model_state_dict`` / ``module_state_dict`` / ``state_dict`` entry of a
  checkpoint dict), read with ``torch.load(weights_only=True)``;
* :func:`freeze` — ``--freeze PATTERN``: parameters whose names match a
  shell pattern (:mod:`fnmatch`) stop training (no per-sample gradient, no
  noise);
* :func:`add_lora` — ``--lora-rank R``: PEFT LoRA adapters of rank R on every
  ``nn.Linear`` (the base weights frozen).

Privacy: the starting weights are treated as PUBLIC. Weights trained on the
private data (even privately) are not a public starting point for another
run on the same data: the two runs' ε add up (docs/finetuning.md).
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Iterable, Optional, Union

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["HF_PREFIX", "HFLogits", "load_hf_model", "load_weights", "freeze", "add_lora", "prepare_model"]

HF_PREFIX = "hf:"
_STATE_KEYS = ("model_state_dict", "module_state_dict", "state_dict", "model")


class HFLogits(nn.Module):
    """``model(x)`` → ``hf(x).logits`` for a transformers model; flat inputs reshaped to the config's image shape.

    Args:
        hf: a transformers model whose first positional input is the batch
            (``pixel_values`` / ``input_ids`` / ``input_values``).

    A 2-D float input ``[B, D]`` is viewed as ``[B, C, H, W]`` when the
    config has ``num_channels`` C and ``image_size`` H = W with C·H·W = D
    (dpopt's digits are 8×8 images stored flat); any other input is passed as is.
    """

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf
        cfg = getattr(hf, "config", None)
        c, s = getattr(cfg, "num_channels", None), getattr(cfg, "image_size", None)
        self.image_shape = (int(c), int(s), int(s)) if isinstance(c, int) and isinstance(s, int) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.image_shape is not None
            and x.dim() == 2
            and x.is_floating_point()
            and x.shape[1] == self.image_shape[0] * self.image_shape[1] * self.image_shape[2]
        ):
            x = x.view(x.shape[0], *self.image_shape)
        return self.hf(x).logits


def load_hf_model(spec: str) -> HFLogits:
    """``hf:DIR`` → the local ``save_pretrained`` directory's model (its ``config.architectures[0]`` class).

    Raises:
        ConfigError: not ``hf:DIR``; DIR is not a directory with ``config.json``;
            transformers is not installed; the architecture is unknown to it.
    """
    if not spec.startswith(HF_PREFIX) or len(spec) == len(HF_PREFIX):
        raise ConfigError(
            f"a Hugging Face model is given as hf:DIR (a local save_pretrained directory), got {spec!r}", "model"
        )
    where = Path(spec[len(HF_PREFIX) :]).expanduser()
    if not (where / "config.json").is_file():
        raise ConfigError(
            f"{where} is not a save_pretrained directory (no config.json). dpopt never downloads: "
            "save the model on a machine with access (model.save_pretrained(DIR)) and copy DIR here",
            "model",
        )
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the hf extra
        raise ConfigError("--model hf:DIR needs transformers: pip install 'dpopt[hf]'", "model") from exc
    config = transformers.AutoConfig.from_pretrained(str(where), local_files_only=True)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise ConfigError(f"{where}/config.json names no architecture transformers knows ({arch!r})", "model")
    return HFLogits(cls.from_pretrained(str(where), local_files_only=True))


def load_weights(model: nn.Module, path: Union[str, Path]) -> None:
    """Load a dpopt ``model.pt`` / torch state dict at ``path`` into ``model`` (all keys must match).

    Raises:
        ConfigError: no such file; not a state dict of tensors; keys or shapes
            that do not match ``model`` (the message lists some of each).
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"init_from: no file {path}", "init_from")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict):
        for key in _STATE_KEYS:
            if isinstance(state.get(key), dict):
                state = state[key]
                break
    if not (isinstance(state, dict) and state and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise ConfigError(
            f"init_from: {path} holds no state dict of tensors (a dpopt model.pt or torch.save(model.state_dict()))",
            "init_from",
        )
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(k for k in set(own) & set(state) if tuple(own[k].shape) != tuple(state[k].shape))
    if missing or unexpected or shapes:
        raise ConfigError(
            f"init_from: {path} does not fit the model (missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}, other shapes {shapes[:4]}); give the --model it was saved from",
            "init_from",
            "model",
        )
    model.load_state_dict(state)


def freeze(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """Set ``requires_grad = False`` on parameters whose names match any shell pattern; returns their names.

    Raises:
        ConfigError: a pattern matching no parameter (its names are listed),
            or every parameter frozen.
    """
    names = [n for n, _ in model.named_parameters()]
    frozen = []
    for pattern in patterns:
        hit = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hit:
            raise ConfigError(
                f"freeze: {pattern!r} matches no parameter; the names are {names[:12]}"
                f"{' ...' if len(names) > 12 else ''}",
                "freeze",
            )
        frozen += hit
    for n, p in model.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    if all(not p.requires_grad for p in model.parameters()):
        raise ConfigError("freeze: every parameter is frozen; nothing would train", "freeze")
    return sorted(set(frozen))


def add_lora(model: nn.Module, rank: int) -> nn.Module:
    """The PEFT LoRA model of ``model``: rank-``rank`` adapters (α = 2r, no dropout) on every ``nn.Linear``.

    Raises:
        ConfigError: rank < 1, no ``nn.Linear`` in the model, peft not installed.
    """
    if not (isinstance(rank, int) and rank >= 1):
        raise ConfigError(f"lora_rank must be an integer >= 1, got {rank!r}", "lora_rank")
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - the hf extra
        raise ConfigError("--lora-rank needs peft: pip install 'dpopt[hf]'", "lora_rank") from exc
    targets = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not targets:
        raise ConfigError("lora_rank: the model has no nn.Linear layer to adapt", "lora_rank")
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets)
    return peft.get_peft_model(model, config)


def prepare_model(
    model: nn.Module,
    init_from: Optional[str] = None,
    freeze_patterns: Optional[list] = None,
    lora_rank: Optional[int] = None,
) -> nn.Module:
    """Weights from ``init_from``, then ``freeze_patterns``, then LoRA (in that order); returns the model to train."""
    if init_from:
        load_weights(model, init_from)
    if freeze_patterns:
        freeze(model, freeze_patterns)
    if lora_rank is not None:
        model = add_lora(model, lora_rank)
    return model
