"""``DPDPOTrainer``: TRL's ``DPOTrainer`` with the preference PAIR as the privacy unit, through DPTrainer's step.

::

    from trl import DPOConfig
    from dpopt.hf import DPDPOTrainer
    trainer = DPDPOTrainer(model=policy, ref_model=reference,
                           args=DPOConfig("out", per_device_train_batch_size=4, max_steps=100, beta=0.1),
                           train_dataset=pairs, processing_class=tokenizer,   # prompt / chosen / rejected
                           noise_multiplier=1.0, max_grad_norm=1.0)
    trainer.train()

**The unit is the pair** (prompt, chosen, rejected): one Poisson draw per
pair, and the per-unit gradient is that of the pair's DPO loss (Rafailov et
al. 2023, "Direct Preference Optimization", arXiv 2305.18290, eq. 7)

    ℓ(x, y_w, y_l) = −log σ(β · [(log π_θ(y_w|x) − log π_ref(y_w|x)) − (log π_θ(y_l|x) − log π_ref(y_l|x))]),

clipped to C as ONE unit. The chosen and rejected sequences are two rows of
one forward pass (rows 2i, 2i + 1 of pair i), and the per-example engine
groups them as one example (``augmentation_multiplicity=2``: its per-example
gradient is the MEAN over the two rows, so the pair's loss is weighted by 2
in the training step to make the clipped unit exactly ∇ℓ). The collated
batch is held pair-major (``[pairs, 2, T]``, :class:`PairRows`), so
DPTrainer's physical chunks never split a pair. The engine's first-batch
check (rows do not mix) runs as for any model; its collate check (an example
collated alone gives the same output) stands aside with 2 rows per unit, so
a model that reads the padding TRL's collator adds is not caught there (a
causal LM with its attention mask does not read it;
``tests/hf_trl/test_trl_trainers.py`` compares each pair collated alone).

**The reference model is public**: it is the frozen starting point (a copy
of the initial policy by default), fixed before any private data is read
(under ``torchrun``, rank 0's: its parameters are broadcast to every rank);
its parameters are not charged and never trained. Its log-probabilities of
a private pair are a function of that pair, used only inside that pair's
loss within the privacy boundary (so covered by the pair's clipping); they
are never logged, stored or cached. For that reason
``precompute_ref_log_probs=True`` is refused: TRL writes them for every
private example into a dataset cache file on disk.

Per-pair losses supported (``loss_type``, several with ``loss_weights``):
``"sigmoid"`` (DPO, eq. 7 above), ``"hinge"`` (SLiC, Zhao et al. 2023,
arXiv 2305.10425: max(0, 1 − β·Δ)) and ``"ipo"`` (Azar et al. 2023, arXiv
2310.12036, eq. 17, with TRL's per-token average of each log-ratio).
Refused: loss types that couple pairs across the batch (``"aot"``,
``"aot_unpaired"`` sort the batch; ``"sft"`` is a token mean over the whole
batch) and the others not implemented here; ``ld_alpha``,
``use_weighting``, a ``f_divergence_type`` other than ``"reverse_kl"``, a
Mixture-of-Experts router loss (a batch-level statistic); a PEFT model
without ``ref_model`` (its reference is the same hooked model with the
adapter disabled); ``privacy_unit`` other than the pair;
``activation_offloading``, ``use_liger_kernel``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from trl import DPOConfig, DPOTrainer

from .trainer import DPTrainer
from .trl_common import TRLPrivate, trl_refusals

__all__ = [
    "DPDPOTrainer",
    "PairRows",
    "PAIR_LOSSES",
    "PAIR_UNIT",
    "dpo_refusals",
    "pair_losses",
    "public_reference",
    "sequence_logps",
]

#: per-pair loss types (each a function of the pair alone)
PAIR_LOSSES = ("sigmoid", "hinge", "ipo")
ROWS = 2  # rows per unit: chosen, rejected
#: the ledger header's and the summary's ``privacy_unit`` of a DPDPOTrainer run
PAIR_UNIT = "preference pair (prompt, chosen, rejected)"

_PAIR_KEYS = ("input_ids", "attention_mask", "completion_mask")


class PairRows:
    """Collator wrapper: TRL's preference batch ``[2P, T]`` (P chosen rows, then P rejected) as ``[P, 2, T]``.

    Row ``[i, 0]`` is pair i's prompt + chosen, ``[i, 1]`` its prompt + rejected;
    dim 0 is the pair, so a cut along dim 0 never separates a pair.

    Raises:
        ValueError: a batch with keys other than input_ids, attention_mask,
            completion_mask (e.g. precomputed reference log-probs).
    """

    def __init__(self, collator: Callable):
        self.collator = collator

    def __call__(self, features: list) -> dict:
        out = self.collator(features)
        extra = sorted(set(out) - set(_PAIR_KEYS))
        if extra:
            raise ValueError(f"DPDPOTrainer: the preference batch has keys {extra} it cannot keep per pair")
        p = len(features)
        return {k: v.reshape(ROWS, p, *v.shape[1:]).transpose(0, 1).contiguous() for k, v in out.items()}


def sequence_logps(logits: Tensor, input_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Σ over completion tokens of log p(token | prefix): ``[R]`` from logits ``[R, T, V]``, ids and mask ``[R, T]``.

    Position t's logits predict token t + 1 (causal LM); float32 or wider.
    """
    logp = torch.log_softmax(logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    token = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (token * completion_mask[:, 1:].to(token.dtype)).sum(1)


def pair_losses(
    policy: Tensor, reference: Tensor, completion_mask: Tensor, beta: float, loss_types: list, weights: list
) -> Tensor:
    """Each pair's preference loss ``[P]`` from sequence log-probs ``[P, 2]`` (column 0 chosen, 1 rejected).

    Args:
        policy, reference: ``[P, 2]`` log π_θ(y|x) and log π_ref(y|x).
        completion_mask: ``[P, 2, T]`` (IPO's per-token average).
        beta: β > 0.
        loss_types, weights: names in :data:`PAIR_LOSSES` and their weights.

    The formulas are in the module docstring (DPO eq. 7; SLiC hinge; IPO eq. 17).
    """
    ratio = policy - reference  # [P, 2] log-ratios
    delta = ratio[:, 0] - ratio[:, 1]
    total = torch.zeros_like(delta)
    for kind, w in zip(loss_types, weights):
        if kind == "sigmoid":
            loss = -F.logsigmoid(beta * delta)
        elif kind == "hinge":
            loss = torch.relu(1 - beta * delta)
        elif kind == "ipo":
            lengths = completion_mask.sum(-1).clamp(min=1).to(ratio.dtype)  # [P, 2]
            avg = ratio / lengths
            loss = (avg[:, 0] - avg[:, 1] - 1 / (2 * beta)) ** 2
        else:
            raise ValueError(f"loss_type {kind!r} is not a per-pair loss DPDPOTrainer implements ({PAIR_LOSSES})")
        total = total + float(w) * loss
    return total


def dpo_refusals(args: Any, model: Any, ref_model: Any, privacy_unit: Any) -> list[str]:
    """Why a ``DPOConfig`` (with this model / reference) cannot be trained privately; see the module docstring."""
    out = trl_refusals(args)
    types = list(getattr(args, "loss_type", ["sigmoid"]))
    coupled = sorted(set(types) & {"aot", "aot_unpaired", "sft"})
    if coupled:
        out.append(
            f"loss_type {coupled}: the loss couples pairs across the batch (aot sorts the batch; sft is a token "
            "mean over the whole batch), so one pair's influence is not its own gradient"
        )
    other = sorted(set(types) - set(PAIR_LOSSES) - {"aot", "aot_unpaired", "sft"})
    if other:
        out.append(f"loss_type {other}: not implemented per pair in DPDPOTrainer; use one of {list(PAIR_LOSSES)}")
    if getattr(args, "precompute_ref_log_probs", False):
        out.append(
            "precompute_ref_log_probs: TRL writes the reference log-probs of every private pair into a dataset "
            "cache file on disk; DPDPOTrainer computes them inside each pair's loss instead (set it False)"
        )
    if getattr(args, "ld_alpha", None) is not None:
        out.append("ld_alpha: not implemented in DPDPOTrainer; leave it None")
    if getattr(args, "use_weighting", False):
        out.append("use_weighting: WPO weights are not implemented in DPDPOTrainer; set it False")
    if getattr(args, "f_divergence_type", "reverse_kl") != "reverse_kl":
        out.append("f_divergence_type: only 'reverse_kl' (standard DPO) is implemented in DPDPOTrainer")
    if privacy_unit not in (None, "record", "pair"):
        out.append(
            f"privacy_unit={privacy_unit!r}: the unit of DPDPOTrainer is the preference pair (leave privacy_unit unset)"
        )
    if ref_model is None and callable(getattr(model, "get_base_model", None)):
        out.append(
            "a PEFT model without ref_model: the reference would be the same hooked model with the adapter "
            "disabled; pass ref_model= (a frozen copy of the base model)"
        )
    if isinstance(model, str):
        out.append("model as a name: load it first (DPDPOTrainer copies the initial policy as the reference)")
    return out


def public_reference(model: Any) -> Any:
    """A frozen copy of ``model``'s current weights, built fresh: ``type(model)(config)`` + ``load_state_dict``.

    Not ``copy.deepcopy``: a model that went through a TRL trainer has an
    instance ``forward`` (TRL's fused LM head) whose closure calls the
    ORIGINAL model, so a deep copy would run the live policy; it may also
    carry another engine's hooks. The fresh module has neither.

    Raises:
        ValueError: a model without a ``config`` (not a ``transformers`` model).
    """
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("DPDPOTrainer: pass ref_model= (the model is not a transformers model with a config)")
    first = next(iter(model.parameters()))
    ref = type(model)(copy.deepcopy(config)).to(device=first.device, dtype=first.dtype)
    ref.load_state_dict(model.state_dict())
    return ref.eval().requires_grad_(False)


class DPDPOTrainer(TRLPrivate, DPTrainer, DPOTrainer):
    """TRL's ``DPOTrainer`` with DP-SGD over preference pairs (each pair clipped as one unit).

    Args:
        model: the policy, a ``transformers`` causal LM (instance).
        ref_model: the frozen, public reference model; default: a copy of
            ``model`` taken before training (:func:`public_reference`; its
            parameters never change).
        args: a ``DPOConfig`` (default ``DPOConfig("dp_dpo_output")``); copied.
        **kwargs: DPTrainer's privacy keywords (``noise_multiplier`` or
            ``target_epsilon``, ``max_grad_norm``, ``delta``, ``method``, ...)
            and ``DPOTrainer``'s (``train_dataset`` with prompt / chosen /
            rejected, ``processing_class``, ...).

    Raises:
        ValueError: a setting that cannot be honoured privately
            (:func:`dpo_refusals` and DPTrainer's list).

    N (the dataset size of the accounting and of δ < 1/N) counts pairs.
    """

    def __init__(
        self,
        model: Any = None,
        ref_model: Any = None,
        args: Optional[Any] = None,
        *,
        privacy_unit: Any = None,
        **kwargs: Any,
    ):
        args = DPOConfig("dp_dpo_output") if args is None else args
        problems = dpo_refusals(args, model, ref_model, privacy_unit)
        if problems:
            raise ValueError("DPDPOTrainer cannot honour these settings privately:\n- " + "\n- ".join(problems))
        if ref_model is None:  # the public starting point, copied before any private data is read
            ref_model = public_reference(model)
        ref_model.eval().requires_grad_(False)
        super().__init__(model, args, privacy_unit="record", ref_model=ref_model, **kwargs)
        if getattr(self, "aux_loss_enabled", False):
            raise ValueError(
                "DPDPOTrainer: a Mixture-of-Experts router loss is a batch-level statistic (it mixes the pairs "
                "of a batch); set router_aux_loss_coef=0"
            )
        self.data_collator = PairRows(self.data_collator)
        self._same_reference_on_every_rank()

    def _same_reference_on_every_rank(self) -> None:
        """Several processes: every rank's reference becomes rank 0's (parameters and buffers broadcast).

        The engine broadcasts rank 0's POLICY when the loader is made; the reference (a copy of each rank's
        initial policy, or each rank's ``ref_model``) is public but could differ between ranks (a seed per
        process), and a rank scoring its pairs against another reference would not run the one-process
        mechanism. One process: nothing to do.
        """
        if not self.ranks.enabled:
            return
        from ..distributed import broadcast_parameters

        reference = cast(torch.nn.Module, self.ref_model)
        broadcast_parameters(list(reference.parameters()) + list(reference.buffers()), self.ranks)

    def _ledger_unit(self) -> Optional[str]:
        """The ledger header's unit: the preference pair (:data:`PAIR_UNIT`)."""
        return PAIR_UNIT

    def _unit_arguments(self, user_ids: Optional[list], q: float) -> dict:
        """make_private's unit arguments: the two rows of a pair are one example (``augmentation_multiplicity=2``)."""
        return {**super()._unit_arguments(user_ids, q), "augmentation_multiplicity": ROWS}

    def _losses(self, model: Any, inputs: Any) -> Any:
        """Per-pair losses ``[P]`` (×2 in training: the engine's unit gradient is the mean over the 2 rows) and outputs.

        ``inputs``: ``[P, 2, T]`` tensors (:class:`PairRows`); one forward of
        the policy over the ``2P`` rows (pair i: rows 2i, 2i + 1), one of the
        reference under ``no_grad``.
        """
        rows = {k: v.reshape(-1, *v.shape[2:]) for k, v in inputs.items()}
        mask = rows.pop("completion_mask")
        outputs = model(**rows, use_cache=False)
        reference_model = cast(torch.nn.Module, self.ref_model)  # set in __init__ (never None here)
        with torch.no_grad():
            ref_logits = reference_model(**rows, use_cache=False).logits
        p = int(inputs["input_ids"].shape[0])
        policy = sequence_logps(outputs.logits, rows["input_ids"], mask).reshape(p, ROWS)
        reference = sequence_logps(ref_logits, rows["input_ids"], mask).reshape(p, ROWS)
        loss = pair_losses(
            policy, reference, inputs["completion_mask"], float(self.beta), list(self.loss_types), self.loss_weights
        )
        if model.training:
            loss = loss * ROWS
        return loss, outputs
