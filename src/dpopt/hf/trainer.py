"""``DPTrainer``: a ``transformers.Trainer`` whose training loop is DP-SGD (or any dpopt method), through PrivacyEngine.

::

    from dpopt.hf import DPTrainer
    trainer = DPTrainer(model=model, args=TrainingArguments("out", per_device_train_batch_size=8,
                                                            gradient_accumulation_steps=4, max_steps=100),
                        train_dataset=train, data_collator=collator,
                        noise_multiplier=1.0, max_grad_norm=1.0)       # or target_epsilon=8.0
    trainer.train()
    trainer.get_epsilon(1e-5)

What the subclass changes (DESIGN.md, "the privacy boundary"):

* **Batches.** The train loader is a Poisson sampler at q = 1/ceil(N/B̄)
  (= B̄/N when B̄ divides N; Opacus's convention), B̄ =
  ``per_device_train_batch_size × gradient_accumulation_steps × world_size``,
  built by :meth:`dpopt.PrivacyEngine.make_private` and NOT prepared by
  accelerate (its re-sharding would replace the sampler). Each Poisson batch
  — of varying size — is one optimizer step: it is cut into physical chunks
  of at most ``per_device_train_batch_size`` examples (the rule of
  :class:`~dpopt.utils.batch_memory_manager.BatchMemoryManager`) and the
  chunks go through the PrivateOptimizer's skip-step protocol, so a logical
  batch is ONE release (one ledger entry, noise once). The Trainer's own
  accumulation is set to 1 in a copy of ``args``; ``gradient_accumulation_steps``
  only sets B̄ and the chunking. ``ignore_data_skip`` is set: a resumed run
  draws fresh Poisson batches for its remaining steps.
* **Loss.** :func:`dpopt.hf.loss.per_example_loss`: the model is run
  without ``labels`` and each example's loss is computed from the logits
  (token-level LM losses averaged over the example's own tokens);
  ``num_items_in_batch`` is never used. The chunk's loss is the sum of its
  per-example losses (``loss_reduction="sum"``).
* **Clipping and noise.** The per-example bound C is ``max_grad_norm`` of
  this class, or a user-set ``TrainingArguments.max_grad_norm`` (one that
  differs from the dataclass default 1.0); both set to different values is
  refused (:mod:`dpopt.hf.guarantee`). The copy's ``max_grad_norm`` is then
  set to 0 (the Trainer's aggregate clipping of the release is not the DP
  bound). ``target_epsilon`` is calibrated for the whole run: on resume, σ of
  the remaining steps is re-calibrated with the releases already in the
  ledger (refused when the ledger alone has spent the target).
* **Privacy unit.** Packed texts (``run_clm``'s ``group_texts``: equal-length
  blocks, ``labels == input_ids``, no padding) are detected, or declared with
  ``privacy_unit=N``: the unit "block of N tokens" is warned about and
  recorded in the ledger header, the logs and the summary.
  ``privacy_unit="user"`` (with ``user_column``) is user-level DP
  (:mod:`dpopt.users`): users Poisson-sampled at q_user = 1/ceil(N_users/B̄), at
  most ``max_records_per_user`` examples each, each user's mean gradient
  clipped as one unit, chunks cut between users (docs/privacy-unit.md).
* **Logs.** The Trainer's keys computed from the private batches
  (``loss``, ``grad_norm``, ``train_loss``, ``total_flos``, token counts:
  :data:`~dpopt.hf.guarantee.PRIVATE_LOG_KEYS`) are dropped; ``epsilon`` and
  ``delta`` are added; a user's own keys (``trainer.log({...})`` from a
  callback) pass through — what they log is theirs to judge; FLOPs are
  not counted (they depend on the realised batch sizes); evaluation metrics
  only with ``eval_is_public=True``. The epoch counter is global step /
  Poisson steps per epoch, so it continues after a resume.
  ``train()`` returns ``training_loss = nan``.
* **State.** Every checkpoint's ``optimizer.pt`` carries the ledger
  (PrivateOptimizer.state_dict; run-length form, O(groups)); ``privacy_ledger.json`` (the same form, atomic) and
  ``privacy_summary.json`` (``dpopt check`` reads them) are written beside;
  an append-only journal ``ledger-<run_id>.jsonl`` in ``output_dir`` (not in
  a checkpoint directory: ``save_total_limit`` never deletes it) holds every
  release, so ``resume_from_checkpoint`` — even of an older checkpoint —
  restores the whole ledger. A checkpoint without an optimizer state is refused.
* **The model is never wrapped**: hooks are attached to it
  (``generate()``, ``save_pretrained()``, PEFT's ``merge_and_unload()``
  work during and after training).

* **Several processes** (``torchrun`` / ``accelerate launch``, any world size, one or several
  nodes): :mod:`dpopt.hf.distributed` — each rank draws its shard of ONE Poisson sample at the
  global q, clips per example, rank 0 adds the noise once, one all-reduce per logical batch (the
  model is never DDP-wrapped); rank 0 alone writes the journal and the ledger files.
* **Correlated noise** (``noise_mechanism="banded:B"`` / ``"blt"``, docs/correlated-noise.md):
  the horizon T is the Trainer's planned steps (``max_steps``, else
  ``ceil(num_train_epochs × steps per epoch)``), the loader is
  :class:`~dpopt.cyclic_batches.CyclicBatchSampler`'s b = ceil(N/B̄) fixed balls-in-bins batches in a fixed
  cyclic order (not Poisson: the sensitivity analysis needs k = ceil(T/b) participations b steps
  apart), ε is one Gaussian at σ/Δ (unamplified). Resuming such a run is refused (the stream
  state is never saved), as are ``max_epsilon`` and ``privacy_unit="user"``. Several processes with a
  replicated model: every rank takes its slice of each cyclic batch (the slices are disjoint, their union the
  one-process batch) and rank 0 alone runs the stream (the noise is added once, before the all-reduce); with a
  ``fully_shard``-ed model (FSDP2, below) each rank streams the noise of its shard.
  ``sampling="cyclic-poisson", sample_rate=q``: make_private's amplified form over
  b' = round(q × steps per epoch) parts, each example of part t mod b' included with probability q
  (:class:`~dpopt.cyclic_batches.CyclicPoissonLoader`); one Trainer epoch stays ``steps per epoch`` steps;
  under torchrun each rank Poisson-samples its slice of the step's part (the union is one cyclic Poisson
  sample) and the noise is added once, as above.
* **bf16** (``bf16=True``): the forward in bf16 autocast, norms, clipping and noise in float32
  (:mod:`dpopt.hf.precision`).
* **FSDP2**: a model ``fully_shard``-ed before ``DPTrainer`` is built (under torchrun), or an unsharded one with
  ``TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2})`` — DPTrainer then applies
  ``fully_shard`` itself from those settings, before the Trainer and accelerate see the model
  (:mod:`dpopt.hf.fsdp_args`: accelerate's own FSDP2 prepare would swap the parameters after the private
  optimizer and hooks are attached) — trains through
  the engine's ``distributed="fsdp"`` (:mod:`dpopt.fsdp`): per-example norms on the full-shape
  gradient, each coordinate's noise added once by its shard's owner, one reduce-scatter per step;
  every rank runs the same number of chunks per step (the MAX over ranks, padded with zero-weight
  stand-ins: :func:`dpopt.hf.distributed.agreed_chunks`). Checkpoints hold the model gathered to rank 0,
  the ledger, and one optimizer-state file per rank: a sharded run resumes on the same number of processes.
  ``bf16=True`` composes (the same float32 norms, clipping and noise), and so does
  ``privacy_unit="user"`` (each chunk's full-shape per-example gradients grouped into per-user means before
  the clip; a stand-in chunk belongs to no user).

Refused, each with a message: fp16 (a GradScaler's skip-on-inf reads
private gradients), deepspeed (pointing to FSDP2), the FSDP settings
:func:`~dpopt.hf.fsdp_args.fsdp_refusals` lists (offload, activation checkpointing, FSDP1, ...),
several GPUs in one process (``nn.DataParallel``), ``torch_compile``, length-grouped sampling, counting input
tokens (a count of the private batches), ``auto_find_batch_size`` (it
re-runs steps), a label smoother, ``compute_loss_func``,
and ``load_best_model_at_end`` / ``EarlyStoppingCallback`` unless
``eval_is_public=True`` (the selection reads the evaluation set, uncharged).
"""

from __future__ import annotations

import copy
import math
import numbers
from pathlib import Path
from typing import Any, Callable, Optional, Union, cast

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import TrainOutput

from .. import jsonio
from ..accounting.calibration import (
    calibrate_amplified_noise_multiplier,
    calibrate_correlated_noise_multiplier,
    calibrate_noise_multiplier,
)
from ..accounting.events import poisson_gaussian_step
from ..accounting.incremental import EpsilonTracker
from ..accounting.ledger import PrivacyLedger
from ..accounting.matrix_factorization import Participation, optimize_strategy, parse_mechanism
from ..errors import LedgerWriteError
from ..privacy_engine import PrivacyEngine, check_sampling
from ..release_boundary import boundary_of
from ..users import DEFAULT_MAX_RECORDS_PER_USER, check_max_records
from .batches import batch_size, split_batch, split_by_user, stand_in
from .distributed import (
    agreed_chunks,
    check_launch,
    data_parallel_context,
    full_state_dict,
    is_sharded,
    journal_not_reopened,
    launched_args,
    load_full_state_dict,
    load_optimizer_shards,
    padded,
    replicas_not_wrapped,
    save_optimizer_shards,
    share_ledger,
)
from .fsdp_args import fsdp_refusals, fsdp_requested, shard_as_configured, without_fsdp
from .guarantee import PRIVATE_LOG_KEYS, calibrate_remaining, packed_block, resolve_max_grad_norm, unit_text
from .loss import per_example_loss
from .precision import AutocastRelease, check_mixed_precision

__all__ = ["DPTrainer", "LOGGED", "LEDGER_FILE", "SUMMARY_FILE"]

LOGGED = (
    "learning_rate",
    "epoch",
    "epsilon",
    "delta",
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
)
LEDGER_FILE = "privacy_ledger.json"
SUMMARY_FILE = "privacy_summary.json"


class _DropColumn:
    """A collator wrapper that drops one key (the user-id column) from every example before collating."""

    def __init__(self, collator: Callable, column: str):
        self.collator, self.column = collator, column

    def __call__(self, features: list) -> Any:
        return self.collator([{k: v for k, v in f.items() if k != self.column} for f in features])


def _refusals(args: TrainingArguments, kwargs: dict, eval_is_public: bool) -> list[str]:
    """Why ``args`` / Trainer keywords cannot be honoured privately (empty when they can)."""
    out = []
    if args.fp16:
        out.append(
            "fp16: a GradScaler's skip-on-inf decision reads the private gradients (an uncharged release); "
            "use bf16=True (autocast without a scaler) or float32"
        )
    if args.deepspeed:
        out.append(
            "deepspeed: it shards and reduces un-clipped gradients; for a model that does not fit one device "
            "use FSDP2: TrainingArguments(fsdp='full_shard', fsdp_config={'fsdp_version': 2}) under torchrun, or "
            "a model you fully_shard-ed (docs/fsdp.md, 'FSDP2 through DPTrainer')"
        )
    out.extend(fsdp_refusals(args))  # fsdp= / fsdp_config=: what DPTrainer's own sharding cannot honour
    if args.torch_compile:
        out.append("torch_compile: the per-sample hooks are not verified under torch.compile; set it False")
    if getattr(args, "group_by_length", False) or getattr(args, "train_sampling_strategy", "random") != "random":
        out.append(
            "length-grouped sampling: the batches must be Poisson samples; keep "
            "train_sampling_strategy='random' (DPTrainer replaces the sampler)"
        )
    tokens = getattr(args, "include_num_input_tokens_seen", "no")
    if tokens not in ("no", False, None) or getattr(args, "include_tokens_per_second", False):
        out.append(
            "include_num_input_tokens_seen / include_tokens_per_second: the token count of private "
            "batches would be logged; switch them off"
        )
    if args.auto_find_batch_size:
        out.append(
            "auto_find_batch_size: a retry re-runs steps (releases) and changes the batch size; set the "
            "batch size yourself"
        )
    if args.label_smoothing_factor:
        out.append(
            "label_smoothing_factor: DPTrainer computes the per-example loss itself; pass "
            "per_example_loss=fn(outputs, labels) -> [B] with the smoothing"
        )
    if kwargs.get("compute_loss_func") is not None:
        out.append(
            "compute_loss_func: it receives num_items_in_batch (a batch-level normalisation); pass "
            "per_example_loss=fn(outputs, labels) -> [B] instead"
        )
    if args.n_gpu > 1:
        out.append(
            f"{args.n_gpu} GPUs in one process: the Trainer would use nn.DataParallel, whose replicas the "
            "per-example hooks do not see; launch one process per GPU (torchrun --nproc_per_node "
            f"{args.n_gpu} ...) or set CUDA_VISIBLE_DEVICES to one GPU"
        )
    if not eval_is_public:
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
            out.append(
                "save_strategy='best': saving by an evaluation metric is an uncharged look at that data; "
                "pass eval_is_public=True only if the evaluation set is public"
            )
        if args.load_best_model_at_end:
            out.append(
                "load_best_model_at_end: choosing a checkpoint by an evaluation set is a look at that "
                "data that is not charged; pass eval_is_public=True only if the evaluation set holds "
                "no record of the private training data"
            )
        if any(
            type(c).__name__ == "EarlyStoppingCallback"
            or c == "EarlyStoppingCallback"
            or getattr(c, "__name__", "") == "EarlyStoppingCallback"
            for c in kwargs.get("callbacks") or []
        ):
            out.append(
                "EarlyStoppingCallback: stopping on evaluation metrics is an uncharged look at that data; "
                "pass eval_is_public=True only if the evaluation set is public"
            )
    return out


def _checked_mechanism(
    spec: str, privacy_unit: Any, max_epsilon: Optional[float], sampling: Optional[str], sample_rate: Optional[float]
) -> str:
    """``noise_mechanism`` as given, or a ValueError for a bad spec or a combination without an accountant
    (``sampling`` / ``sample_rate``: make_private's; the rate is used by ``sampling="cyclic-poisson"`` only)."""
    kind, _ = parse_mechanism(spec)  # ValueError listing the accepted forms
    if sample_rate is not None and sampling != "cyclic-poisson":
        raise ValueError(
            "DPTrainer: sample_rate= is the rate within a part of sampling='cyclic-poisson'; otherwise q is "
            "B-bar/N (per_device_train_batch_size x gradient_accumulation_steps x world_size): drop it"
        )
    if kind == "independent":
        if sampling is not None:
            raise ValueError("DPTrainer: sampling= applies to a correlated noise_mechanism only; drop it")
        return "independent"
    problems = []
    if privacy_unit == "user":
        problems.append("privacy_unit='user' (the strategy's sensitivity is per record over cyclic batches)")
    if max_epsilon is not None:
        problems.append("max_epsilon (the run is one mechanism over its planned steps: set the steps instead)")
    if problems:
        raise ValueError(f"DPTrainer: noise_mechanism={spec!r} cannot be used with: " + "; ".join(problems))
    return str(spec)


class _EpsilonStop(TrainerCallback):
    """Stops training after the last step whose release keeps ε ≤ ``max_epsilon`` (checked after each step)."""

    def __init__(self, trainer: "DPTrainer"):
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        per_epoch = len(self.trainer._dp_loader) if self.trainer._dp_loader is not None else 0
        if per_epoch:  # the epoch counter continues after a resume: steps so far / Poisson steps per epoch
            state.epoch = state.global_step / per_epoch
        if self.trainer.next_step_exceeds():
            control.should_training_stop = True
        return control


class DPTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with per-example clipping, Gaussian noise and an exact ledger.

    Args:
        model, args, **kwargs: as ``transformers.Trainer`` (``train_dataset``,
            ``data_collator``, ``eval_dataset``, ``processing_class``,
            ``callbacks``, ``optimizers``, ...). ``args`` is copied, not changed.
        noise_multiplier: σ; or
        target_epsilon: ε for the whole planned run (``max_steps``, else
            ``ceil(num_train_epochs × steps per epoch)``) at ``delta``; σ is
            calibrated with the accountant (give exactly one of the two).
        max_grad_norm: the per-example clipping bound C (> 0). Default: a user-set
            ``TrainingArguments.max_grad_norm`` (one that differs from the dataclass
            default 1.0), else 1.0; both set to different values is refused
            (:func:`~dpopt.hf.guarantee.resolve_max_grad_norm`).
        delta: δ of the logged ε and of calibration (default 1e-5; must be < 1/N).
        method: a torch optimizer over the model's trainable parameters, a
            dpopt method name (``"dp-adam"``, ``"dp-muon"``, ...; built with
            ``lr = args.learning_rate`` and ``method_kwargs``), or None: the
            Trainer's own optimizer (``args.optim``, AdamW by default).
        method_kwargs: hyperparameters of a method name.
        secure_mode: noise and Poisson masks from the OS CSPRNG.
        accountant: ``"pld"`` (default), ``"rdp"`` or ``"prv"``.
        max_epsilon: stop after the last step whose ε(δ) stays ≤ this.
        noise_mechanism: ``"independent"`` (default), or correlated noise across steps
            (DP matrix factorization, :mod:`dpopt.correlated_noise`): ``"banded:B"`` or
            ``"blt"`` / ``"blt:N"`` — the argument of :meth:`dpopt.PrivacyEngine.make_private`;
            the horizon is the Trainer's planned steps and the batches are cyclic (module docstring);
            under torchrun each rank takes its slice of every cyclic batch and the noise is added once
            (replicas: rank 0 runs the stream; FSDP2: each rank its shard's).
        sampling, sample_rate: correlated noise only: ``sampling="cyclic-poisson"`` with ``sample_rate=q``
            is make_private's amplified banded form (module docstring; under torchrun each rank samples
            its slice of the step's part); ``"cyclic"`` (default) otherwise.
        per_example_loss: ``fn(outputs, labels) -> [B]`` (see :mod:`dpopt.hf.loss`).
        causal_lm: shift LM labels (default: from the model's class).
        eval_is_public: the evaluation set holds no record of the private
            data: its metrics are logged and ``load_best_model_at_end`` /
            early stopping are allowed.
        privacy_unit: what one protected unit is: None (detect: a causal-LM
            dataset of equal-length blocks with ``labels == input_ids`` and no
            padding — ``run_clm``'s ``group_texts`` — is taken as packed, warned),
            ``"record"`` (each example is one record: no detection),
            ``"block"`` (declared packing, N read from the dataset's blocks) or
            an int N (packed blocks of N tokens, declared). The names are the
            privacy-unit vocabulary (record / user / block) of docs/privacy-unit.md. Packed: the unit is
            "block of N tokens", recorded in the ledger header, the logs
            (``privacy_unit_tokens``) and the summary. ``"user"``: user-level DP
            (:mod:`dpopt.users`): each example's ``user_column`` names its user; users are
            Poisson-sampled at q_user = 1/ceil(N_users/B̄) (B̄ counts USERS then), each sampled
            user brings at most ``max_records_per_user`` of its examples (chosen at random) and
            the mean of their gradients is clipped to ``max_grad_norm`` as ONE unit; ε is per
            user. Chunks never split a user. Pack texts within a user only (a block mixing
            two users' texts is in both users' contributions: not checked).
        user_column: with ``privacy_unit="user"``: the train dataset's column (key) of user ids
            (default ``"user_id"``); it is dropped before collation.
        max_records_per_user: with ``privacy_unit="user"``: k, the examples a sampled user brings
            at most (public; default :data:`dpopt.users.DEFAULT_MAX_RECORDS_PER_USER`).

    Attributes:
        engine: the :class:`~dpopt.PrivacyEngine` (its ledger, accountant, journal).
        ranks: the :class:`~dpopt.distributed.DistributedContext` of the run (one process
            unless launched by torchrun / accelerate launch).
        sharded: whether ``model`` is ``fully_shard``-ed (FSDP2): the release is the engine's
            ``distributed="fsdp"`` (docs/fsdp.md, "FSDP2 through DPTrainer").
        noise_multiplier, sample_rate, expected_batch_size: public settings
            (known once training has started).

    Raises:
        ValueError: both or neither of ``noise_multiplier`` / ``target_epsilon``;
            a setting in the module docstring's refusal list (all of them, in
            one message); bad ``max_grad_norm`` / ``delta``;
            ``fully_shard`` on submodules without the root (:func:`~dpopt.hf.distributed.is_sharded`); FSDP settings DPTrainer cannot honour
            (:mod:`dpopt.hf.fsdp_args`), or accelerate's FSDP plugin from the environment.
    """

    def __init__(
        self,
        model: Any = None,
        args: Optional[TrainingArguments] = None,
        *,
        noise_multiplier: Optional[float] = None,
        target_epsilon: Optional[float] = None,
        max_grad_norm: Optional[float] = None,
        delta: float = 1e-5,
        method: Union[None, str, torch.optim.Optimizer] = None,
        method_kwargs: Optional[dict] = None,
        secure_mode: bool = False,
        accountant: str = "pld",
        max_epsilon: Optional[float] = None,
        per_example_loss: Optional[Callable] = None,
        causal_lm: Optional[bool] = None,
        eval_is_public: bool = False,
        privacy_unit: Union[None, str, int] = None,
        user_column: str = "user_id",
        max_records_per_user: int = DEFAULT_MAX_RECORDS_PER_USER,
        noise_mechanism: str = "independent",
        sampling: Optional[str] = None,
        sample_rate: Optional[float] = None,
        **kwargs: Any,
    ):
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError("DPTrainer takes exactly one of noise_multiplier= and target_epsilon=")
        for name, value in (("noise_multiplier", noise_multiplier), ("target_epsilon", target_epsilon)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
        self.noise_mechanism = _checked_mechanism(noise_mechanism, privacy_unit, max_epsilon, sampling, sample_rate)
        self._sampling: dict[str, Any] = {} if sampling is None else {"sampling": sampling, "sample_rate": sample_rate}
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        if method_kwargs and not isinstance(method, str):
            raise ValueError("method_kwargs are hyperparameters of a dpopt method name (method='dp-adam', ...)")
        if isinstance(method, torch.optim.Optimizer) and (kwargs.get("optimizers") or (None,))[0] is not None:
            raise ValueError("give the torch optimizer once: method= or optimizers=(optimizer, scheduler)")
        args = TrainingArguments(output_dir="dp_trainer_output") if args is None else args
        args = launched_args(args)  # torchrun on CPUs: accelerate joins the gloo group (use_cpu=True)
        max_grad_norm = resolve_max_grad_norm(args, max_grad_norm)  # never ignored (hf.guarantee)
        if not (
            privacy_unit in (None, "record", "block", "user")
            or (isinstance(privacy_unit, int) and not isinstance(privacy_unit, bool) and privacy_unit >= 1)
        ):
            raise ValueError(
                f"privacy_unit must be None (detect), 'record', 'user', 'block' or a block length in tokens "
                f"(int >= 1), got {privacy_unit!r}"
            )
        self.privacy_unit = privacy_unit
        self.user_column = str(user_column)
        self.max_records_per_user = check_max_records(max_records_per_user)
        self.block_tokens: Optional[int] = None  # packed texts: the privacy unit is a block of this many tokens
        self._evaluating = False
        problems = _refusals(args, kwargs, eval_is_public)
        if problems:
            raise ValueError("DPTrainer cannot honour these settings privately:\n- " + "\n- ".join(problems))
        check_launch(args.world_size)
        if fsdp_requested(args):  # FSDP2 from TrainingArguments: DPTrainer shards, accelerate never does
            model = self._shard_from_args(model, args, method, kwargs)
            args = without_fsdp(args)
        self.per_device_batch = int(args.per_device_train_batch_size)
        self.accumulation = int(args.gradient_accumulation_steps)
        args = copy.copy(args)
        args.max_grad_norm = 0.0
        args.gradient_accumulation_steps = 1
        args.ignore_data_skip = True
        self.engine = PrivacyEngine(accountant=accountant, secure_mode=secure_mode)
        self.delta = float(delta)
        self.max_grad_norm = float(max_grad_norm)
        self.max_epsilon = None if max_epsilon is None else float(max_epsilon)
        self._sigma, self._target = noise_multiplier, target_epsilon
        self._method, self._method_kwargs = method, dict(method_kwargs or {})
        self._loss_fn, self._causal = per_example_loss, causal_lm
        self.eval_is_public = bool(eval_is_public)
        self._dp_loader: Optional[DataLoader] = None
        self._private: Any = None
        self._tracker: Optional[EpsilonTracker] = None  # the max_epsilon stop
        self._eps_cache: Optional[tuple] = None
        self.noise_multiplier: Optional[float] = None
        self.sample_rate: Optional[float] = None
        self.expected_batch_size: Optional[float] = None
        super().__init__(model=model, args=args, **kwargs)
        self.add_callback(_EpsilonStop(self))
        self.ranks = data_parallel_context(self.args.world_size)  # several: torchrun (dpopt.hf.distributed)
        if getattr(self.accelerator.state, "fsdp_plugin", None) is not None:
            raise ValueError(
                "accelerate's FSDP plugin is on (accelerate launch --use_fsdp / an accelerate config with FSDP): "
                "it would shard the model after the private optimizer is built and reduce un-clipped gradients; "
                "launch without it (accelerate launch --num_processes W, or torchrun) and pass "
                "TrainingArguments(fsdp='full_shard', fsdp_config={'fsdp_version': 2}) instead (docs/fsdp.md)"
            )
        self.sharded = is_sharded(self.model)  # FSDP2: the engine's distributed="fsdp" (dpopt.fsdp)
        check_mixed_precision(self.args, self.accelerator)  # the precision asked for is the one accelerate runs
        self._autocast = AutocastRelease(self.accelerator)  # bf16: the release's check in the forward's autocast
        self.add_callback(self._autocast)

    @staticmethod
    def _shard_from_args(model: Any, args: TrainingArguments, method: Any, kwargs: dict) -> Any:
        """``model`` ``fully_shard``-ed as ``args.fsdp`` / ``fsdp_config`` ask (:mod:`dpopt.hf.fsdp_args`).

        Raises:
            ValueError: no ``model`` (a ``model_init``), or a torch optimizer built before the sharding (it
                holds the unsharded parameters).
        """
        if model is None:
            raise ValueError(
                "fsdp= needs model= (DPTrainer shards it before the Trainer starts); model_init is not supported"
            )
        if isinstance(method, torch.optim.Optimizer) or (kwargs.get("optimizers") or (None,))[0] is not None:
            raise ValueError(
                "fsdp= with a torch optimizer built before DPTrainer: it holds the unsharded parameters that "
                "fully_shard replaces; choose the optimizer with TrainingArguments(optim=...), or fully_shard the "
                "model yourself and build the optimizer on it (docs/fsdp.md)"
            )
        return shard_as_configured(model, args)

    # -- public ------------------------------------------------------------------
    @property
    def ledger(self) -> PrivacyLedger:
        """The :class:`~dpopt.accounting.ledger.PrivacyLedger` of every release (restored on resume)."""
        return self.engine.ledger

    def get_epsilon(self, delta: Optional[float] = None) -> float:
        """ε(δ) of every release so far under the engine's accountant (δ default: the trainer's ``delta``).

        Cached per (number of releases, δ): the logs and ``train()`` ask again without a new release.
        """
        key = (len(self.ledger), self.ledger.run_id, self.delta if delta is None else float(delta))
        if self._eps_cache is None or self._eps_cache[0] != key:
            self._eps_cache = (key, self.engine.get_epsilon(key[2]))
        return self._eps_cache[1]

    @property
    def bbar(self) -> int:
        """B̄ = per_device_train_batch_size × gradient_accumulation_steps × world size (the expected batch size asked)."""
        return self.per_device_batch * self.accumulation * max(1, int(self.args.world_size))

    # -- data and optimizer: one make_private ---------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """The Poisson (correlated noise: cyclic) loader of ``make_private`` (made once, with the private optimizer; not accelerate-prepared)."""
        if self._dp_loader is not None:
            return self._dp_loader
        if self.train_dataset is None:
            raise ValueError("DPTrainer: training requires a train_dataset")
        dataset, collator = self.train_dataset, self.data_collator
        user_ids = self._user_ids(dataset) if self.privacy_unit == "user" else None  # before columns are dropped
        if user_ids is not None:
            collator = _DropColumn(collator, self.user_column)
        if type(dataset).__module__.startswith("datasets"):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        n = len(dataset) if user_ids is None else len(set(user_ids))  # type: ignore[arg-type]  # units: records or users
        if not 1 <= self.bbar <= n:
            raise ValueError(
                f"the expected batch size B-bar = per_device_train_batch_size x "
                f"gradient_accumulation_steps x world_size = {self.bbar} must be in [1, N = {n}]"
                + (" (N counts users: privacy_unit='user')" if user_ids is not None else "")
            )
        if self.delta >= 1.0 / n:
            raise ValueError(
                f"delta = {self.delta} is not < 1/N = {1.0 / n:.3g}: such a delta allows releasing a "
                "record outright; pass a smaller delta="
            )
        self._declare_unit(dataset)
        base = DataLoader(
            dataset,
            batch_size=self.bbar,
            shuffle=True,
            collate_fn=collator,
            num_workers=self.args.dataloader_num_workers,
        )
        per_epoch = len(base) if user_ids is None else math.ceil(n / self.bbar)  # Opacus's rule, over units
        q = 1.0 / per_epoch
        sigma, horizon = self._sigma, self._mechanism_arguments(per_epoch)
        if sigma is None and horizon:
            sigma = self._calibrate_mechanism(per_epoch)
        elif sigma is None:
            sigma = calibrate_noise_multiplier(
                cast(float, self._target), self.delta, q, self._planned_steps(per_epoch), str(self.engine.accountant)
            ).noise_multiplier
        optimizer, hparams = self._method, {}
        if isinstance(optimizer, str):
            hparams = dict(self._method_kwargs)
            hparams.setdefault("lr", self.args.learning_rate)
        elif optimizer is None:
            optimizer = super().create_optimizer()
        self.optimizer = None
        self.engine.ledger.delta = self.delta  # the run's δ (ledger header; make_private's amplification check)
        _, private, loader = self.engine.make_private(
            module=cast(torch.nn.Module, self.model),
            optimizer=optimizer,
            data_loader=base,
            noise_multiplier=float(sigma),
            max_grad_norm=self.max_grad_norm,
            loss_reduction="sum",
            # shards at q; replicas: noise once (rank 0), one all-reduce per step; FSDP2: noise by each
            # coordinate's owner, one reduce-scatter per step
            distributed="fsdp" if self.sharded else self.ranks.enabled,
            **self._unit_arguments(user_ids, q),
            **horizon,
            **hparams,
        )
        self.optimizer, self._private, self._dp_loader = private, private, loader
        self.noise_multiplier, self.sample_rate, self.expected_batch_size = float(sigma), q, q * n
        if self._sampling.get("sampling") == "cyclic-poisson":  # q within a part, q·N/b' per batch
            self.sample_rate = float(cast(float, self._sampling["sample_rate"]))
            self.expected_batch_size = float(private.expected_batch_size)
        self.engine.ledger.delta = self.delta  # `dpopt ledger` scores at the run's delta
        unit = self._ledger_unit()
        if unit is not None:
            self.engine.ledger.privacy_unit = unit
        return loader

    def _ledger_unit(self) -> Optional[str]:
        """The ledger header's ``privacy_unit`` when it is not make_private's: a packed block's text, else None
        (a subclass with its own unit, e.g. DPO's preference pair, returns that)."""
        return None if self.block_tokens is None else unit_text(self.block_tokens)

    # -- correlated noise (dpopt.correlated_noise) -------------------------------------
    def _mechanism_arguments(self, per_epoch: int) -> dict:
        """make_private's correlated-noise arguments: the mechanism and the horizon T = the Trainer's planned
        steps (empty for independent noise)."""
        if self.noise_mechanism == "independent":
            return {}
        return {
            "noise_mechanism": self.noise_mechanism,
            "total_steps": self._planned_steps(per_epoch),
            **self._sampling,
        }

    def _calibrate_mechanism(self, per_epoch: int) -> float:
        """σ for ``target_epsilon`` of the correlated-noise run: one Gaussian at the strategy's sensitivity for
        k = ceil(T/b) participations b = ``per_epoch`` steps apart
        (:func:`~dpopt.accounting.calibration.calibrate_correlated_noise_multiplier`)."""
        steps = self._planned_steps(per_epoch)
        kind, size = parse_mechanism(self.noise_mechanism)
        if self._sampling.get("sampling") == "cyclic-poisson":  # k rounds of Gaussian(σ/‖c‖) sampled at q
            q = cast(float, self._sampling["sample_rate"])
            parts = check_sampling("cyclic-poisson", kind, self.noise_mechanism, q, per_epoch)
            return calibrate_amplified_noise_multiplier(
                cast(float, self._target),
                self.delta,
                optimize_strategy(kind, steps, size),
                steps,
                parts,
                q,
                str(self.engine.accountant),
            )
        participation = Participation(steps, -(-steps // per_epoch), per_epoch)
        return calibrate_correlated_noise_multiplier(
            cast(float, self._target),
            self.delta,
            optimize_strategy(kind, steps, size, participation=participation),  # what make_private builds
            participation,
            str(self.engine.accountant),
        )

    # -- privacy_unit="user" (dpopt.users) ---------------------------------------------
    def _user_ids(self, dataset: Any) -> list:
        """The user id of every train example, read from :attr:`user_column` (a column or a key of each example).

        Raises:
            ValueError: an example without that column.
        """
        col = self.user_column
        names = getattr(dataset, "column_names", None)
        if names is not None:  # a datasets.Dataset: the whole column at once
            if col not in names:
                raise ValueError(f"privacy_unit='user': the train dataset has no column {col!r} (pass user_column=)")
            return list(dataset[col])
        out = []
        for i in range(len(dataset)):
            example = dataset[i]
            if not isinstance(example, dict) or col not in example:
                raise ValueError(
                    f"privacy_unit='user': train example {i} has no {col!r} key; give each example its user id "
                    "there, or name the key with user_column="
                )
            out.append(example[col])
        return out

    def _unit_arguments(self, user_ids: Optional[list], q: float) -> dict:
        """make_private's privacy-unit arguments: none for records/blocks, the user-level ones for users."""
        if user_ids is None:
            return {}
        return {
            "privacy_unit": "user",
            "user_ids": user_ids,
            "max_records_per_user": self.max_records_per_user,
            "sample_rate": q,
        }

    def _chunks(self, inputs: Any) -> list:
        """The physical chunks of a Poisson batch: at most ``per_device_train_batch_size`` examples,
        or (privacy_unit="user") whole users only (:func:`dpopt.hf.batches.split_by_user`)."""
        if self.privacy_unit != "user":
            return split_batch(inputs, self.per_device_batch)
        rows = getattr(self._dp_loader, "last_batch_rows", None)
        if rows is None:
            raise RuntimeError("privacy_unit='user': the user-level loader's last batch is unknown")
        return split_by_user(inputs, rows.slots, self.per_device_batch)

    def _declare_unit(self, dataset: Any) -> None:
        """The privacy unit: declared, or detected packing (warned); sets :attr:`block_tokens`."""
        import warnings

        if self.privacy_unit in ("record", "user"):
            return
        if isinstance(self.privacy_unit, int):
            self.block_tokens = int(self.privacy_unit)
            return
        if self.privacy_unit == "block":
            block = packed_block(dataset, require_labels=False)
            if block is None:
                raise ValueError(
                    "privacy_unit='block' needs a dataset of equal-length input_ids blocks to read N "
                    "from; pass privacy_unit=N (the block length in tokens) instead"
                )
            self.block_tokens = block
            return
        causal = (
            self._causal
            if self._causal is not None
            else type(getattr(self.model, "base_model", self.model)).__name__.endswith(("ForCausalLM", "LMHeadModel"))
            or "CausalLM" in type(self.model).__name__
            or "LMHead" in type(self.model).__name__
        )
        block = packed_block(dataset) if causal else None
        if block is None:
            return
        self.block_tokens = block
        warnings.warn(
            f"DPTrainer: the train dataset looks packed (every example is a block of {block} tokens with "
            "labels = input_ids and no padding, as run_clm's group_texts makes): the privacy unit is the "
            f"BLOCK of {block} tokens, not a record — a record spread over k blocks is protected at about "
            "k times epsilon (group privacy). Recorded in the ledger header, logs and summary. Pack per "
            "record (or bound the blocks per record) for record-level DP; pass privacy_unit='record' if "
            f"each example is one record, or privacy_unit={block} to declare the packing",
            UserWarning,
            stacklevel=3,
        )

    def _prepare_for_training(self, max_steps: Any, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        """The Trainer's preparation; on several processes the model is placed and autocast, never DDP-wrapped."""
        if not (self.ranks.enabled or self.sharded):
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        with replicas_not_wrapped(self.accelerator):
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def create_optimizer(self, model: Any = None) -> Any:
        """The PrivateOptimizer made with the loader (:meth:`get_train_dataloader`)."""
        if self._private is None:
            self.get_train_dataloader()
        return self.optimizer

    def _planned_steps(self, per_epoch: int) -> int:
        if self.args.max_steps and self.args.max_steps > 0:
            return int(self.args.max_steps)
        return max(1, math.ceil(self.args.num_train_epochs * per_epoch))

    def next_step_exceeds(self) -> bool:
        """Whether one more release would take ε(δ) past ``max_epsilon`` (False without one).

        :meth:`~dpopt.accounting.incremental.EpsilonTracker.releases_within_budget`
        (the stop ``dpopt train --max-epsilon`` uses): bisection cached while the
        ledger grows by this run's step, the next step composed onto any other
        ledger (e.g. resumed from a run with another σ).
        """
        if self.max_epsilon is None or self.noise_multiplier is None:
            return False
        tracker = self._tracker
        if tracker is None or tracker.max_epsilon != float(self.max_epsilon):
            tracker = self._tracker = EpsilonTracker(self.delta, str(self.engine.accountant), self.max_epsilon)
        step = poisson_gaussian_step(self.noise_multiplier, self.sample_rate)
        planned = max(1, int(getattr(self.state, "max_steps", 0) or 0) - int(self.state.global_step or 0))
        return tracker.releases_within_budget(self.ledger, step, planned) < 1  # cached for the planned steps

    # -- the step: chunks of one Poisson batch, one release --------------------------
    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """Mean of the per-example losses (evaluation; ``num_items_in_batch`` is ignored)."""
        loss, outputs = self._losses(model, inputs)
        return (loss.mean(), outputs) if return_outputs else loss.mean()

    def _losses(self, model: Any, inputs: Any) -> Any:
        return per_example_loss(model, inputs, causal=self._causal, loss_fn=self._loss_fn, return_outputs=True)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """Clip and add every physical chunk of the Poisson batch ``inputs``; the Trainer's ``optimizer.step()`` releases.

        Returns a zero tensor: the private batch's loss is not reported.
        """
        if self.next_step_exceeds():
            raise RuntimeError(
                f"max_epsilon = {self.max_epsilon} reached: {len(self.ledger)} releases already "
                f"(epsilon {self.get_epsilon():.4g}); another step would exceed it"
            )
        model.train()
        inputs = self._prepare_inputs(inputs)
        opt = self._private
        opt.zero_grad()
        empty = batch_size(inputs) == 0
        chunks = [] if empty else self._chunks(inputs)
        target = agreed_chunks(max(1, len(chunks)), self.ranks) if self.sharded else max(1, len(chunks))
        for i, (chunk, real) in enumerate(padded(chunks, target, stand_in(inputs))):
            with self.compute_loss_context_manager():
                loss = self._losses(model, chunk)[0].sum()
            self.accelerator.backward(loss if real else loss * 0.0)  # a stand-in adds exactly 0 (hf.distributed)
            if not real:  # a stand-in's public row is not an example of the batch (release_boundary)
                boundary_of(opt).public_rows(batch_size(chunk))
            if i < target - 1:
                opt.signal_skip_step(True)
                with self.accelerator.autocast():  # bf16: the first-batch check replays an autocast forward
                    opt.step()  # clips and adds this chunk into the open step: no release
                opt.zero_grad()
        return torch.zeros((), device=self.args.device)

    def floating_point_ops(self, inputs: Any) -> int:
        """0: FLOPs of a Poisson batch count its realised size (saved as total_flos)."""
        return 0

    # -- outputs ------------------------------------------------------------------
    def log(self, logs: dict, start_time: Optional[float] = None) -> None:
        """Log only public values: ε, δ, lr, epoch, speed; evaluation metrics if ``eval_is_public``."""
        if self._evaluating:  # evaluation metrics: only with eval_is_public
            keep = {
                k: v
                for k, v in logs.items()
                if k in LOGGED or (self.eval_is_public and not k.startswith("train") and k not in PRIVATE_LOG_KEYS)
            }
        else:  # the Trainer's keys of the private batches are dropped; a user's own keys pass through
            keep = {k: v for k, v in logs.items() if k not in PRIVATE_LOG_KEYS}
        if self._private is not None:
            keep["epsilon"] = self.get_epsilon()
            keep["delta"] = self.delta
            if self.block_tokens is not None:
                keep["privacy_unit_tokens"] = self.block_tokens
        super().log(keep, start_time)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.evaluate``; its metrics are returned, and logged only with ``eval_is_public``."""
        self._evaluating = True
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._evaluating = False

    def train(self, *args: Any, **kwargs: Any) -> TrainOutput:
        """``Trainer.train``; the returned training_loss is NaN (the private batches' loss is not released).

        ``resume_from_checkpoint`` with an FSDP2 (sharded) model: every rank loads the checkpoint's whole model
        and keeps its shards, and its own optimizer-state file (same number of processes); the ledger as for
        data parallel.

        Raises:
            LedgerWriteError: a release's ledger entry could not be written (the journal's disk is full, ...):
                nothing was released; the advice is this trainer's (:meth:`_ledger_write_advice`).
        """
        try:
            out = super().train(*args, **kwargs)
        except LedgerWriteError as exc:  # the Privatizer's advice is for a loop that calls step(): say ours
            raise exc.with_advice(self._ledger_write_advice()) from exc
        finally:
            self._autocast.close()
        metrics = {k: v for k, v in out.metrics.items() if k in LOGGED}
        if self._private is not None:
            metrics.update(epsilon=self.get_epsilon(), delta=self.delta)
            if self.block_tokens is not None:
                metrics["privacy_unit_tokens"] = self.block_tokens
        return TrainOutput(out.global_step, float("nan"), metrics)

    def _ledger_write_advice(self) -> str:
        """What to do after a failed ledger write, with this trainer's options (output_dir, resume)."""
        journal = self.engine.journal or Path(str(self.args.output_dir)) / f"ledger-{self.ledger.run_id}.jsonl"
        free = f"free space on the disk of {journal} (the ledger journal in output_dir) or make that file writable"
        if self.noise_mechanism != "independent":
            return (
                f"DPTrainer stopped: {free}, then start a new run (another output_dir): with "
                f"noise_mechanism={self.noise_mechanism!r} resume_from_checkpoint is refused (the noise stream is "
                "never saved), and the new run's epsilon adds to this one's (docs/correlated-noise.md)"
            )
        return (
            f"DPTrainer stopped: {free}, then call trainer.train(resume_from_checkpoint=True) with the same "
            "DPTrainer options: it continues from the last checkpoint-N in output_dir, and the journal keeps "
            "every release made after that checkpoint charged (no checkpoint-N saved yet: start the run again "
            "with another output_dir; the releases in this journal stay charged to the data)"
        )

    # -- checkpoints carry the ledger -------------------------------------------------
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; a sharded (FSDP2) model is gathered to rank 0 only (one tensor at a time on
        the others: :func:`~dpopt.hf.distributed.full_state_dict`) and saved whole by rank 0 — a checkpoint
        that loads into the unsharded model (``from_pretrained``)."""
        if not self.sharded:
            return super().save_model(output_dir, _internal_call)
        # a collective: every rank; {} off rank 0 (save_on_each_node: whole on every rank)
        state = full_state_dict(cast(torch.nn.Module, self.model), every_rank=bool(self.args.save_on_each_node))
        if self.args.should_save:
            self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's ``optimizer.pt`` (rank 0: ledger, param groups); a sharded model's optimizer state goes
        to one file per rank instead (:func:`~dpopt.hf.distributed.save_optimizer_shards`)."""
        if not self.sharded or self._private is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        inner = self._private.original_optimizer
        save_optimizer_shards(inner, output_dir, self.args.process_index, self.args.world_size)
        whole = inner.state_dict
        inner.state_dict = lambda: {**whole(), "state": {}}  # the shards: above
        try:
            super()._save_optimizer_and_scheduler(output_dir)
        finally:
            del inner.state_dict

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The Trainer's model load; a sharded model takes the checkpoint's whole model, each rank its shards."""
        if not self.sharded:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_full_state_dict(cast(torch.nn.Module, self.model), resume_from_checkpoint)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint, the journal in output_dir first, and the ledger + summary beside it."""
        run_dir = Path(self._get_output_dir(trial=trial))
        # the journal is global rank 0's (save_on_each_node: other nodes write checkpoints, never the journal)
        if self._private is not None and self.engine.journal is None and self.args.process_index == 0:
            self.engine.open_journal(run_dir / f"ledger-{self.ledger.run_id}.jsonl")
        super()._save_checkpoint(model, trial)
        if self._private is None or not self.args.should_save:
            return
        folder = run_dir / f"checkpoint-{self.state.global_step}"
        self.ledger.save(folder / LEDGER_FILE, compact=True)  # run-length form: O(groups), atomic
        summary = self.engine.summary(self.delta)
        summary["privacy_unit"] = self.ledger.privacy_unit or unit_text(self.block_tokens)
        (folder / SUMMARY_FILE).write_text(jsonio.dumps(summary))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """Restore the optimizer (its state carries the ledger: the engine takes the whole record in).

        A sharded (FSDP2) run also loads this rank's optimizer-state file
        (:func:`~dpopt.hf.distributed.load_optimizer_shards`).

        Raises:
            ValueError: a checkpoint without ``optimizer.pt`` (ε would restart at 0); a sharded run's checkpoint
                resumed without sharding, or on another number of processes (its optimizer state is per rank).
        """
        if checkpoint is not None and self.noise_mechanism != "independent":
            raise ValueError(
                f"resume_from_checkpoint with noise_mechanism={self.noise_mechanism!r} is refused: the correlated "
                "noise stream's state is as secret as the noise and is never saved, and a restarted stream is not "
                "the mechanism the run is accounted for; start a new run (docs/correlated-noise.md)"
            )
        if checkpoint is not None and not (Path(checkpoint) / "optimizer.pt").is_file():
            raise ValueError(
                f"{checkpoint} has no optimizer.pt, which carries the privacy ledger: resuming from it "
                "would restart epsilon at 0 (was it saved with save_only_model=True?)"
            )
        if checkpoint is not None and not self.sharded and any(Path(checkpoint).glob("optimizer-shard-*.pt")):
            raise ValueError(
                f"{checkpoint} was written by a sharded (FSDP2) run: its optimizer state is in per-rank shard "
                "files; resume it with the same fsdp= settings on the same number of processes"
            )
        with journal_not_reopened(self._private, self.ranks):  # the journal is rank 0's file
            super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self.sharded and self._private is not None:  # this rank's optimizer shards
            load_optimizer_shards(
                self._private.original_optimizer, checkpoint, self.args.process_index, self.args.world_size
            )
        if checkpoint is not None and self._private is not None:
            share_ledger(self.ledger, self.ranks)  # rank 0's record (its journal's releases too) on every rank
        if checkpoint is not None and self._target is not None and self._private is not None and len(self.ledger):
            self._recalibrate(checkpoint)

    def _recalibrate(self, checkpoint: str) -> None:
        """σ for ``target_epsilon`` over the whole run: the ledger's releases + the steps still to run.

        Raises:
            ValueError: the ledger alone already spends the target.
        """
        import json

        state = Path(checkpoint) / "trainer_state.json"
        done = int(json.loads(state.read_text()).get("global_step", 0)) if state.is_file() else len(self.ledger)
        assert self._dp_loader is not None and self._target is not None and self.sample_rate is not None
        remaining = max(1, self._planned_steps(len(self._dp_loader)) - done)
        sigma = calibrate_remaining(
            self._target, self.delta, self.sample_rate, remaining, self.ledger, str(self.engine.accountant)
        )
        self._private.noise_multiplier = sigma  # recorded in the claims' sigma schedule from the next release
        self.noise_multiplier = sigma
        self._tracker = None
