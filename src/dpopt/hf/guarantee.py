"""What ``DPTrainer`` promises about its run, decided in one place (issue 33, case 7).

* :func:`resolve_max_grad_norm` — the per-example bound C from DPTrainer's
  ``max_grad_norm=`` and ``TrainingArguments.max_grad_norm``: a value the user
  set in either place is C; both set to different values is refused; never
  silently ignored.
* :func:`calibrate_remaining` — σ for ``target_epsilon`` over the WHOLE run:
  the releases already in the ledger (a resumed run) composed with the steps
  still to run; refused when the ledger alone has already spent the target.
* :func:`packed_block` — a causal-LM dataset whose examples are all blocks of
  the same N tokens with ``labels == input_ids`` and no padding (``run_clm``'s
  ``group_texts``): the privacy unit is then the block of N tokens, not a record.
* :data:`PRIVATE_LOG_KEYS` — the Trainer's own log keys computed from private
  batches (dropped); any other key a user logs passes through.
"""

from __future__ import annotations

import math
from typing import Any, Optional

__all__ = [
    "PRIVATE_LOG_KEYS",
    "calibrate_remaining",
    "hf_default_max_grad_norm",
    "packed_block",
    "resolve_max_grad_norm",
    "unit_text",
]

#: log keys the Trainer computes from the private batches (never logged by DPTrainer)
PRIVATE_LOG_KEYS = frozenset(
    {"loss", "grad_norm", "train_loss", "total_flos", "num_input_tokens_seen", "train_tokens_per_second"}
)


def hf_default_max_grad_norm() -> float:
    """The dataclass default of ``TrainingArguments.max_grad_norm`` (1.0 in transformers 4.x and 5.x)."""
    from transformers import TrainingArguments

    return float(TrainingArguments.__dataclass_fields__["max_grad_norm"].default)  # type: ignore[arg-type]


def resolve_max_grad_norm(args: Any, given: Optional[float]) -> float:
    """The per-example clipping bound C of a DPTrainer run.

    "Set by the user" for ``TrainingArguments.max_grad_norm`` means: different
    from the dataclass default (:func:`hf_default_max_grad_norm`, 1.0) — a
    ``TrainingArguments`` cannot tell an explicit 1.0 from the default, and
    1.0 is also DPTrainer's own default, so the two agree.

    Args:
        args: the ``TrainingArguments``.
        given: DPTrainer's ``max_grad_norm=`` (None: not given).

    Returns:
        C > 0, finite: ``given`` if given, else the user-set
        ``args.max_grad_norm``, else 1.0.

    Raises:
        ValueError: both set to different values; a user-set
            ``args.max_grad_norm`` ≤ 0 (no clipping) without ``given``; C not a
            finite number > 0.
    """
    default = hf_default_max_grad_norm()
    hf = getattr(args, "max_grad_norm", default)
    hf_set = hf is not None and float(hf) != default
    if (
        given is not None
        and not isinstance(given, bool)
        and isinstance(given, (int, float))
        and hf_set
        and float(hf) != float(given)
    ):
        raise ValueError(
            f"TrainingArguments.max_grad_norm = {hf} and DPTrainer(max_grad_norm={given}) disagree: "
            "the per-example clipping bound C is one number. Set it in one place (DPTrainer's "
            "max_grad_norm=, or TrainingArguments.max_grad_norm with DPTrainer's left out)"
        )
    if given is None and hf_set:
        if not float(hf) > 0:
            raise ValueError(
                f"TrainingArguments.max_grad_norm = {hf} (no clipping) cannot be the per-example bound "
                "of DP training: pass DPTrainer(max_grad_norm=C) with C > 0"
            )
        given = float(hf)
    c = 1.0 if given is None else given
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < math.inf:
        raise ValueError(f"max_grad_norm must be a finite number > 0 (the per-example bound), got {c!r}")
    return float(c)


def calibrate_remaining(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    remaining: int,
    ledger: Any,
    accountant: str = "pld",
    rtol: float = 0.01,
) -> float:
    """σ whose ``remaining`` Poisson Gaussian steps at q, after the ledger's releases, keep ε(δ) ≤ the target.

    The whole run is ``ledger`` (every release already made, e.g. before a
    resume) composed with ``remaining`` steps of
    :func:`~dpopt.accounting.events.poisson_gaussian_step` (σ, q). With an empty
    ledger this is :func:`~dpopt.accounting.calibration.calibrate_noise_multiplier`.
    Otherwise σ is bisected (ε falls as σ grows) and the σ returned is one whose
    ε was computed and is ≤ the target (conservative), within ``rtol`` of the
    smallest such σ.

    Raises:
        ValueError: the ledger alone already spends the target (no σ reaches
            it), or even σ = 1e4 does not.
    """
    from dp_accounting import dp_event

    from ..accounting.accountant import epsilon
    from ..accounting.calibration import calibrate_noise_multiplier
    from ..accounting.events import dpsgd_event

    remaining = max(1, int(remaining))
    if len(ledger) == 0:
        return float(
            calibrate_noise_multiplier(target_epsilon, delta, sample_rate, remaining, accountant).noise_multiplier
        )
    spent = epsilon(ledger, delta, accountant)
    prefix = ledger.composed_event()

    def eps(sigma: float) -> float:
        return epsilon(
            dp_event.ComposedDpEvent([prefix, dpsgd_event(sigma, sample_rate, remaining)]), delta, accountant
        )

    advice = (
        "raise target_epsilon, lower max_steps / num_train_epochs, or start a new run (a new ledger) "
        "instead of resuming"
    )
    if spent >= target_epsilon:
        raise ValueError(
            f"target_epsilon = {target_epsilon:g} is already out of reach: the {len(ledger)} releases "
            f"already in the ledger spend epsilon = {spent:.4g} (delta = {delta:g}, {accountant}) and "
            f"{remaining} more steps can only add to it; {advice}"
        )
    lo, hi = 0.3, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise ValueError(
                f"target_epsilon = {target_epsilon:g} is out of reach for {remaining} more steps after "
                f"the ledger's epsilon = {spent:.4g}; {advice}"
            )
    while hi - lo > rtol * hi:
        mid = 0.5 * (lo + hi)
        if eps(mid) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return float(hi)


def packed_block(dataset: Any, probe: int = 32, require_labels: bool = True) -> Optional[int]:
    """N when ``dataset`` looks like packed text (``run_clm``'s ``group_texts``): blocks of N tokens; else None.

    Read from up to ``probe`` items spread over the dataset: every item is a
    mapping with ``input_ids`` of the same length N ≥ 2, ``labels`` equal to
    ``input_ids`` and no padding (``attention_mask`` absent or all ones). The
    lengths and the labels-are-the-inputs structure are treated as public (as
    the item structure is elsewhere in dpopt); no token value is kept.

    A dataset of fixed-length records that are NOT concatenated texts looks the
    same: declare ``privacy_unit="record"`` to DPTrainer then. With
    ``require_labels=False`` (a declared ``privacy_unit="block"``) only the
    equal lengths are required.
    """
    try:
        n = len(dataset)
    except TypeError:
        return None
    if n == 0:
        return None
    idx = sorted({int(i * (n - 1) / max(1, probe - 1)) for i in range(min(probe, n))})
    length = None
    for i in idx:
        item = dataset[i]
        if not hasattr(item, "keys") or "input_ids" not in item or (require_labels and "labels" not in item):
            return None
        ids = _as_list(item["input_ids"])
        labels = _as_list(item["labels"]) if require_labels else ids
        if ids is None or labels is None or len(ids) < 2 or ids != labels:
            return None
        if length is None:
            length = len(ids)
        elif len(ids) != length:
            return None
        mask = _as_list(item.get("attention_mask")) if "attention_mask" in item else None
        if mask is not None and any(int(m) != 1 for m in mask):
            return None
    return length


def _as_list(x: Any) -> Optional[list]:
    if x is None:
        return None
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)) and all(isinstance(v, int) for v in x):
        return list(x)
    return None


def unit_text(block: Optional[int]) -> str:
    """The ledger header's ``privacy_unit`` text: ``"block of N tokens"`` or ``"record"``."""
    return "record" if block is None else f"block of {int(block)} tokens"
