"""``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2, ...})`` for ``DPTrainer``: DPTrainer shards.

::

    args = TrainingArguments("out", fsdp="full_shard", fsdp_config={"fsdp_version": 2}, optim="sgd", ...)
    DPTrainer(model=model, args=args, train_dataset=train, noise_multiplier=1.0, max_grad_norm=1.0).train()
    # torchrun --nproc_per_node 2 train.py

**Why DPTrainer shards the model itself instead of letting accelerate do it.** With an FSDP
plugin, accelerate's ``prepare`` calls ``fully_shard`` on the model AFTER the Trainer has built
the optimizer, replaces every parameter by a new ``DTensor`` and swaps the optimizer's parameter
references (``fsdp2_switch_optimizer_parameters``). The private optimizer and the per-example
hooks of :meth:`~dpopt.PrivacyEngine.make_private` would then hold the old, unsharded tensors, and
FSDP's own post-backward reduce-scatter (of the RAW gradients) would be on. So
:func:`shard_as_configured` applies ``fully_shard`` in ``DPTrainer.__init__``, from the same
``fsdp_config``, before the Trainer, the optimizer and the engine see the model, and
:func:`without_fsdp` gives the Trainer a copy of ``args`` with FSDP off, so accelerate never
prepares (or checkpoints) an FSDP model. From there the run is exactly the "``fully_shard``-ed
model passed to DPTrainer" path (docs/fsdp.md): ``make_private(..., distributed="fsdp")``
(:mod:`dpopt.fsdp`) — per-example norms on the full-shape gradient, each coordinate's noise
added once by its shard's owner, FSDP's reduction of un-clipped gradients switched off, one
reduce-scatter of clipped sums per logical batch.

**What is sharded** (accelerate's FSDP2 auto-wrap rules, ``fsdp2_prepare_auto_wrap_policy``):
``auto_wrap_policy="TRANSFORMER_BASED_WRAP"`` (the default) shards every module of the classes
named in ``transformer_layer_cls_to_wrap`` (default: those of the model's ``_no_split_modules``
present in it), ``"SIZE_BASED_WRAP"`` every module with more than ``min_num_params``
parameters, ``"NO_WRAP"`` none; bottom-up, then the root. accelerate's extra unit for the
embeddings / final norm / LM head is not made: they stay in the root's unit (tied weights
included, as the engine's tie handling is tested). ``reshard_after_forward`` (``"full_shard"``:
True, ``"shard_grad_op"``: False) is honoured. Before sharding, every rank takes rank 0's
parameters and buffers (one broadcast each), so the sharded model is rank 0's model whatever
each process initialised — what DDP and accelerate's ``sync_module_states`` do.

**Refused** (:func:`fsdp_refusals`, each with what to change): FSDP version 1, XLA FSDP,
``cpu_offload`` / ``"offload"`` (the engine keeps the full-shape clipped sums and the noise on the
parameters' device), ``activation_checkpointing`` (the per-example capture is not verified under
recomputation), ``cpu_ram_efficient_loading`` (ranks > 0 would hold empty weights; load the
model on every rank instead), a ``state_dict_type`` other than ``FULL_STATE_DICT`` (checkpoints
hold the gathered model), an ``fsdp_config`` key this module does not know, ``bf16`` (refused for
every sharded model by DPTrainer), one process (FSDP needs ``torchrun --nproc_per_node`` W ≥ 2),
a ``model_init`` instead of a model, and a torch optimizer built before DPTrainer (it would hold
the unsharded parameters: use ``args.optim``). ``accelerate launch --use_fsdp`` (accelerate's
plugin from the environment) is refused by DPTrainer: pass the settings as ``fsdp=`` /
``fsdp_config=`` instead.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["fsdp_requested", "fsdp_refusals", "shard_as_configured", "without_fsdp"]

# fsdp_plugin_args keys (TrainingArguments._process_fsdp_args, FSDP version 2) and whether DPTrainer honours them
_KNOWN_KEYS = {
    "fsdp_version",
    "cpu_offload",
    "auto_wrap_policy",
    "min_num_params",
    "transformer_cls_names_to_wrap",
    "cpu_ram_efficient_loading",
    "state_dict_type",
    "activation_checkpointing",
    "reshard_after_forward",
}


def fsdp_requested(args: Any) -> bool:
    """Whether ``args`` (a ``TrainingArguments``) asks for FSDP (``fsdp`` set, in any of its forms)."""
    return bool(getattr(args, "fsdp", None))


def _plugin_args(args: Any) -> Optional[dict]:
    """The FSDP plugin arguments TrainingArguments built in ``__post_init__`` (None if ``fsdp`` was set later)."""
    plugin = getattr(args, "fsdp_plugin_args", None)
    return dict(plugin) if isinstance(plugin, dict) else None


def fsdp_refusals(args: Any) -> list[str]:
    """Why ``args``' FSDP settings cannot be honoured by DPTrainer (empty when they can, or without FSDP).

    Args:
        args: a ``transformers.TrainingArguments`` after ``__post_init__`` (which normalises ``fsdp`` /
            ``fsdp_config`` into ``fsdp_plugin_args``, the accelerate plugin's keyword arguments).

    Returns:
        One line per setting, each saying what to change (the module docstring lists them).
    """
    if not fsdp_requested(args):
        return []
    config = dict(getattr(args, "fsdp_config", None) or {})
    plugin = _plugin_args(args)
    if config.get("xla") or config.get("xla_fsdp_v2"):
        return ["fsdp_config xla: XLA FSDP is not supported; use FSDP2 (fsdp_config={'fsdp_version': 2})"]
    if plugin is None:
        return [
            "fsdp: this TrainingArguments has no fsdp_plugin_args (fsdp was set after it was built, or transformers "
            "is older than the FSDP2 arguments): pass fsdp= / fsdp_config= to its constructor (transformers 5), or "
            "apply fully_shard to the model yourself and pass it without fsdp= (docs/fsdp.md)"
        ]
    out = []
    if int(plugin.get("fsdp_version", 2)) != 2:
        out.append(
            "fsdp_version 1: DPTrainer supports FSDP2 only (per-example clipping on the full-shape gradient, "
            "dpopt.fsdp); set fsdp_config={'fsdp_version': 2}"
        )
    if plugin.get("cpu_offload"):
        out.append(
            "fsdp 'offload' / cpu_offload: the private release keeps the full-shape clipped sums and the noise on "
            "the parameters' device; drop the offload (or shard over more processes)"
        )
    if plugin.get("activation_checkpointing"):
        out.append(
            "fsdp_config activation_checkpointing: the per-example capture is not verified under recomputation; "
            "drop it (use a smaller per_device_train_batch_size: the logical batch B-bar is kept by accumulation)"
        )
    if plugin.get("cpu_ram_efficient_loading"):
        out.append(
            "fsdp_config cpu_ram_efficient_loading: ranks > 0 would hold empty weights; load the model on every "
            "rank (DPTrainer shards it after taking rank 0's weights) and drop this option"
        )
    if str(plugin.get("state_dict_type", "FULL_STATE_DICT")).upper() != "FULL_STATE_DICT":
        out.append(
            f"fsdp_config state_dict_type={plugin['state_dict_type']!r}: DPTrainer's checkpoints hold the gathered "
            "model (FULL_STATE_DICT, written by rank 0); drop the option"
        )
    # with FSDP1, transformers fills FSDP1's own defaults (backward_prefetch, ...) in: not the user's options
    unknown = sorted(set(plugin) - _KNOWN_KEYS) if int(plugin.get("fsdp_version", 2)) == 2 else []
    if unknown:
        out.append(f"fsdp options {unknown}: not supported by DPTrainer's FSDP2 path; drop them")
    if int(args.world_size) < 2:
        out.append(
            "fsdp with one process: FSDP shards over several processes; launch with torchrun --nproc_per_node W "
            "(W >= 2; use_cpu=True without GPUs) or drop fsdp="
        )
    return out


def without_fsdp(args: Any) -> Any:
    """A copy of ``args`` with FSDP switched off (the Trainer and accelerate then see a plain data-parallel run)."""
    args = copy.copy(args)
    args.fsdp = None
    args.fsdp_config = {}
    args.fsdp_plugin_args = None
    return args


def _class_named(model: nn.Module, name: str) -> Optional[type]:
    return next((type(m) for m in model.modules() if type(m).__name__ == name), None)


def _wrap_policy(model: nn.Module, plugin: dict) -> Callable[[nn.Module], bool]:
    """accelerate's FSDP2 auto-wrap rule (``fsdp2_prepare_auto_wrap_policy``) as a predicate on modules.

    Raises:
        ValueError: a class named in ``transformer_layer_cls_to_wrap`` that the model does not contain.
    """
    policy = str(plugin.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP"))
    if policy == "SIZE_BASED_WRAP":
        least = int(plugin.get("min_num_params", 0) or 0)
        return lambda m: sum(p.numel() for p in m.parameters()) > least
    if policy != "TRANSFORMER_BASED_WRAP":
        return lambda m: False
    named = plugin.get("transformer_cls_names_to_wrap")
    if named:
        classes = []
        for name in str(named).split(","):
            cls = _class_named(model, name.strip())
            if cls is None:
                raise ValueError(
                    f"fsdp_config transformer_layer_cls_to_wrap names {name.strip()!r}, which is not a module class "
                    f"of {type(model).__name__}; name its block class (e.g. the decoder layer's)"
                )
            classes.append(cls)
    else:
        no_split = getattr(model, "_no_split_modules", None) or []
        classes = [c for c in (_class_named(model, n) for n in no_split) if c is not None]
    wrapped = tuple(classes)
    return lambda m: bool(wrapped) and isinstance(m, wrapped)


def _bottom_up(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` below the root, each after all of its descendants (post-order)."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if id(child) not in seen:
                seen.add(id(child))
                visit(child)
                out.append(child)

    visit(model)
    return out


def _take_rank0_state(model: nn.Module) -> None:
    """Every rank's parameters and buffers become rank 0's (one broadcast per tensor; a collective)."""
    import torch.distributed as dist

    from ..distributed import backend_device, context

    device = backend_device(context())
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            sent = t.detach().to(device, torch.uint8 if t.dtype == torch.bool else t.dtype)  # gloo: no bool
            dist.broadcast(sent, src=0)
            if sent is not t:
                t.copy_(sent.to(t.dtype))


def shard_as_configured(model: nn.Module, args: Any) -> nn.Module:
    """Apply ``fully_shard`` to ``model`` (in place) as ``args``' FSDP2 settings ask; a collective on every rank.

    Rank 0's parameters and buffers are broadcast first; then every module the auto-wrap rule
    selects is sharded, bottom-up, then the root, with the configured ``reshard_after_forward``
    (module docstring). Call after :func:`fsdp_refusals` found nothing, with the process group
    initialised (``args.world_size`` read).

    Args:
        model: the unsharded model, the same architecture on every rank.
        args: the ``TrainingArguments`` with ``fsdp`` set.

    Returns:
        ``model`` (now an ``FSDPModule`` whose trainable parameters are ``DTensor`` shards).

    Raises:
        ValueError: ``fully_shard`` already applied somewhere in the model (shard it yourself OR pass
            ``fsdp=``, not both); a ``transformer_layer_cls_to_wrap`` class the model lacks.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError(
            "the model is already fully_shard-ed and TrainingArguments asks for fsdp: shard it yourself and drop "
            "fsdp= / fsdp_config=, or pass the unsharded model with fsdp="
        )
    plugin = _plugin_args(args) or {}
    reshard = bool(plugin.get("reshard_after_forward", True))
    chosen = _wrap_policy(model, plugin)
    _take_rank0_state(model)
    for module in [m for m in _bottom_up(model) if chosen(m)]:  # chosen before any class is swapped
        fully_shard(module, reshard_after_forward=reshard)
    fully_shard(model)  # the root: torch's default (no reshard after forward for the root)
    return model
