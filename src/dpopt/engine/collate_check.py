"""Examples independent through the collate: each checked example collated ALONE against its row of the batch.

The first-batch check (:mod:`dpopt.engine.check`) slices the batch as the
data loader collated it: a ``collate_fn`` that pads every sequence to the
batch's longest makes each row's *input* depend on the other examples (its
padding length), and a model that reads the padding — an LSTM classifier
taking ``h[:, -1]``, a mean over all positions — then moves the release by
more than C when the longest record is removed (1.64·C and 2.92·C measured,
issue 33 case 5). Slicing the padded batch cannot show it: both sides of the
check see the same padded row.

This check runs, on the first batch of each signature the hook door checks,
a few of the batch's examples through the loader's ``collate_fn`` alone
(:class:`CollateProbe` keeps the items of the last batch, in memory only) and
compares, example by example, the model's outputs and the gradients of a
random linear loss on them with those of the example's row of the batch
(run alone too, in the mode of the release, the same random seed on both
sides; where they differ in train mode, again in eval mode, since random
draws of differently padded inputs differ: only a difference that remains
there is refused). Outputs of different lengths (per-token outputs of a shorter
sequence) are compared on the aligned part (the row's first or last
positions). A disagreement is refused with advice (masks,
``pack_padded_sequence``, fixed-length padding).

What it needs, and where it stands aside (no verdict, nothing refused):
the model inputs of the step must be leaves of the collated batch (or rows
of one: ``DPTrainer``'s physical chunks), matched by value; the loader must
collate in this process (``num_workers=0``); no augmentation views (the views'
random draws differ between the two collations). Used by ``PrivacyEngine``
(``make_private``'s loader) and so by ``DPTrainer`` (its ``data_collator`` is
the loader's ``collate_fn``); ``iter_per_sample_sources`` and ``dpopt train``
take tensors that are already one example per row and have no collate.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .capture import leaves
from .check import RTOL, in_modes
from .recompute import param_grads

__all__ = ["CollateProbe", "CollateDependence", "check_collate", "probe_loader"]

MAX_EXAMPLES = 4
"""Examples compared per check (those of the batch's first 8 whose input differs when collated alone)."""


class CollateDependence(ValueError):
    """An example's output or gradient differs when it is collated alone (padding to the batch's longest)."""


class CollateProbe:
    """``collate_fn`` wrapper that keeps the items of the last batch it collated (private, in memory only).

    Args:
        collate_fn: the loader's collate function (called as given).

    Attributes:
        items: the list of dataset items of the last batch (None before the
            first, or after a copy / pickle: never serialised).

    Raises whatever ``collate_fn`` raises.
    """

    def __init__(self, collate_fn: Callable):
        self.collate_fn = collate_fn
        self.items: Optional[list] = None

    def __call__(self, batch: list) -> Any:
        out = self.collate_fn(batch)
        self.items = list(batch)
        return out

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["items"] = None  # private records: never in a copy, a pickle or a worker process
        return state

    def alone(self, i: int) -> Any:
        """Item ``i`` of the last batch collated by itself (a batch of one)."""
        return self.collate_fn([self.items[i]])  # type: ignore[index]


def _match(flat: list, batched: list, full: list[Tensor], rows: int) -> Optional[tuple[dict, int]]:
    """Position in ``flat`` → index of the collated leaf it is rows ``s..s+rows−1`` of, and the offset s.

    None if a batched input is not found in the collated batch, or the inputs
    come from different offsets.
    """
    mapping, offsets = {}, set()
    for j, (t, bt) in enumerate(zip(flat, batched)):
        if not bt:
            continue
        found = None
        for ci, c in enumerate(full):
            if (
                c.dim() != t.dim()
                or tuple(c.shape[1:]) != tuple(t.shape[1:])
                or c.shape[0] < rows
                or c.dtype != t.dtype
            ):
                continue
            cc = c.to(t.device)
            for s in range(int(c.shape[0]) - rows + 1):
                if torch.equal(cc[s : s + rows], t):
                    found = (ci, s)
                    break
            if found is not None:
                break
        if found is None:
            return None
        mapping[j] = found[0]
        offsets.add(found[1])
    if len(offsets) != 1:
        return None
    return mapping, offsets.pop()


def _aligned(big: Tensor, small: Tensor) -> list[Tensor]:
    """Views of ``big`` of ``small``'s shape: itself, or its first / last positions along every longer axis."""
    if big.shape == small.shape:
        return [big]
    if big.dim() != small.dim() or any(s > b for s, b in zip(small.shape, big.shape)):
        return []
    pre = big[tuple(slice(0, s) for s in small.shape)]
    suf = big[tuple(slice(b - s, b) for s, b in zip(small.shape, big.shape))]
    return [pre, suf]


def _close(a: Tensor, b: Tensor, tol: float, floor: float = 1e-12) -> bool:
    a64, b64 = a.detach().double(), b.detach().double()
    scale = max(float(a64.abs().max()) if a64.numel() else 0.0, float(b64.abs().max()) if b64.numel() else 0.0)
    return (
        bool(torch.isfinite(a64).all())
        and float((a64 - b64).abs().max() if a64.numel() else 0.0) <= tol * scale + floor
    )


#: a parameter's gradient difference below this fraction of the largest gradient entry of the model is rounding
#: (float32 resolution is 6e-8): a gradient that is zero in exact arithmetic (e.g. attention's key bias) comes out
#: as ~1e-12 noise whose own scale would otherwise make that noise look like a padding dependence
GRAD_FLOOR = 1e-6


def grads_close(xs: Sequence[Tensor], ys: Sequence[Tensor], tol: float) -> bool:
    """Whether two lists of parameter gradients agree: each within ``tol`` of its own largest entry, plus an
    absolute floor of :data:`GRAD_FLOOR` × the largest entry over ALL the parameters (rounding of a gradient that
    is zero in exact arithmetic is not a dependence on the padding; a real one moves gradients at their own scale).

    Args:
        xs, ys: gradients of the same parameters (same shapes), any float dtype.
        tol: relative tolerance.

    Returns:
        True if every pair is finite and close.
    """
    top = max((float(t.detach().abs().max()) for t in (*xs, *ys) if t.numel()), default=0.0)
    floor = max(1e-12, GRAD_FLOOR * top)
    return all(_close(x, y, tol, floor) for x, y in zip(xs, ys))


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _compare(model: nn.Module, params: Sequence[Tensor], sliced: tuple, alone: tuple, tol: float) -> Optional[str]:
    """None if the example's row (``sliced``) and the example collated alone give the same outputs and gradients.

    Returns what differs (``"output"`` or ``"gradient"``).
    """
    with torch.enable_grad():
        with _seeded(0):
            out_s = [o for o in leaves(model(*sliced[0], **sliced[1])) if o.is_floating_point()]
        with _seeded(0):
            out_a = [o for o in leaves(model(*alone[0], **alone[1])) if o.is_floating_point()]
        if len(out_s) != len(out_a):
            return "output"
        picked = []
        for s, a in zip(out_s, out_a):
            views = [v for v in _aligned(s, a) if _close(v, a, tol)]
            if not views:
                return "output"
            picked.append(views[0])
        gen = torch.Generator().manual_seed(1)
        rs = [torch.randn(a.shape, generator=gen, dtype=torch.float64).to(a) for a in out_a]
        loss_s = sum((v * r).sum() for v, r in zip(picked, rs))
        loss_a = sum((a * r).sum() for a, r in zip(out_a, rs))
        ps = [p for p in params if p.requires_grad]
        if not ps or not (
            isinstance(loss_s, Tensor) and isinstance(loss_a, Tensor) and loss_s.requires_grad and loss_a.requires_grad
        ):
            return None
        g_s = param_grads(loss_s, ps)  # through reentrant gradient checkpoints too (engine.recompute)
        g_a = param_grads(loss_a, ps)
    xs = [torch.zeros_like(p) if x is None else x for p, x in zip(ps, g_s)]
    ys = [torch.zeros_like(p) if y is None else y for p, y in zip(ps, g_a)]
    return None if grads_close(xs, ys, tol) else "gradient"


def check_collate(
    model: nn.Module,
    args,
    kwargs,
    rows: int,
    probe: CollateProbe,
    params: Sequence[Tensor],
    modes: Optional[Sequence[bool]] = None,
    quiet: Optional[Callable[[bool], Any]] = None,
) -> bool:
    """Refuse a model whose examples depend on each other through the collate (module docstring).

    Args:
        model: the root module. args, kwargs: the inputs of the step's
            forward pass (``rows`` rows along dim 0). probe: the loader's
            :class:`CollateProbe`. params: the trainable parameters.
        modes: the pass's train/eval mode signature (the check runs in it).
        quiet: ``quiet(flag)`` switches the door's recording off (True) and on.

    Returns:
        True if examples were compared (all agreed); False if the check stood
        aside (no items, inputs not found in the collated batch, shapes that
        cannot be aligned, or every example's input unchanged by padding).

    Raises:
        CollateDependence: (a ValueError) an example's output or gradient
            differs when collated alone; names the fix. Nothing is released.
    """
    items = probe.items
    if not items or rows < 2:
        return False
    flat, spec = tree_flatten((args, kwargs))
    batched = [isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == rows for t in flat]
    dtype = next((p.dtype for p in params), torch.float32)
    tol = 10 * RTOL.get(dtype, 5e-2)
    if quiet is not None:
        quiet(True)
    try:
        with torch.no_grad():
            full = leaves(probe.collate_fn(items))
        found = _match(flat, batched, full, rows)
        if found is None:
            return False
        mapping, start = found
        compared = 0
        with in_modes(model, modes):
            for i in range(min(rows, 8)):
                if start + i >= len(items):
                    break
                alone_leaves = leaves(probe.alone(start + i))
                if len(alone_leaves) != len(full):
                    return compared > 0
                a_flat, s_flat, differs = [], [], False
                for j, (t, bt) in enumerate(zip(flat, batched)):
                    if not bt:
                        a_flat.append(t)
                        s_flat.append(t)
                        continue
                    a = alone_leaves[mapping[j]].to(device=t.device, dtype=t.dtype)
                    if a.dim() != t.dim() or a.shape[0] != 1:
                        return compared > 0
                    s = t[i : i + 1].detach()
                    differs = differs or a.shape != s.shape or not torch.equal(a, s)
                    a_flat.append(a)
                    s_flat.append(s)
                if not differs:
                    continue  # padding did not change this example's input (the longest, or a fixed length)
                sliced, alone = tree_unflatten(s_flat, spec), tree_unflatten(a_flat, spec)
                what = _compare(model, params, sliced, alone, tol)
                if what is not None and any(m.training for m in model.modules()):  # random draws of other
                    # shapes (dropout masks differ with the padding length)? compare again without them (eval)
                    with in_modes(model, [False] * len(list(model.modules()))):
                        what = _compare(model, params, sliced, alone, tol)
                if what is not None:
                    raise CollateDependence(
                        f"an example's {what} differs when the data loader's collate_fn collates it alone from "
                        "its row of the batch: its input depends on the other examples of the batch (padding to "
                        "the batch's longest sequence, read by the model: an RNN's last step h[:, -1], a mean or "
                        "pooling over padded positions). Removing the longest record then changes every other "
                        "example's input and the release moves by more than max_grad_norm: the reported epsilon "
                        "would not hold. Make each example's output independent of its padding: mask padded "
                        "positions (attention_mask, a masked mean over the true lengths), read the last real "
                        "step (pack_padded_sequence with the true lengths, or h[i, length_i - 1]), or pad every "
                        "batch to one fixed length (collate_fn padding to the dataset's maximum length); nothing "
                        "was released"
                    )
                compared += 1
                if compared >= MAX_EXAMPLES:
                    break
        return compared > 0
    finally:
        if quiet is not None:
            quiet(False)


def probe_loader(loader, capture: Any, views: int = 1, view_fn: Optional[Callable] = None) -> Optional[CollateProbe]:
    """Wrap ``loader``'s ``collate_fn`` in a :class:`CollateProbe` and give it to ``capture`` (``make_private``).

    Args:
        loader: the ``DataLoader`` the private loop iterates (its
            ``collate_fn`` is replaced by the probe, which calls it).
        capture: the door's capture; only one whose ``checks_collate`` is
            True (:class:`~dpopt.engine.hooks.HookCapture`; not FSDP's, where
            one rank's extra forwards would stall the collectives) gets it.
        views, view_fn: augmentation multiplicity and function: with views
            (or an augmentation) nothing is installed (their random draws
            differ between the two collations).

    Returns:
        The probe, or None where none was installed (views, an augmentation,
        ``num_workers > 0``: the items would stay in the worker processes;
        FSDP's capture).
    """
    if (
        views > 1
        or view_fn is not None
        or not getattr(capture, "checks_collate", False)
        or getattr(loader, "num_workers", 0) > 0
    ):
        return None
    probe = CollateProbe(loader.collate_fn)
    loader.collate_fn = probe
    capture.collate_probe = probe
    return probe
