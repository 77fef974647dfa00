"""Augmentation multiplicity (De et al. 2022): K augmented views per example, averaged before clipping.

Example i's gradient is the mean over its K views of the per-view gradient,
g_i = (1/K) Σ_k ∇ℓ(θ; aug_k(x_i), y_i) (De et al. 2022, arXiv:2204.13650,
§3.1; jax_privacy computed it as the gradient of the per-example loss
averaged over the views, the loss of ``[N, K, ...]`` reshaped to ``[N·K]``
and back). Clipping, summing and noising apply to g_i, so example i still
moves the release by at most C (its K views are one example: the neighbouring
relation and hence ε are those of K = 1; the same ledger events), while the
gradient's variance falls.

The augmentation draws are NOT privacy-protecting randomness: they may be
seeded and replayed (dpopt train seeds them from ``--seed`` and the step).

Layout contract (both front doors): a batch of B examples becomes B·K rows,
**example-major** — rows i·K, ..., i·K + K − 1 are the K views of example i —
built by :func:`repeat_views` (images) with labels ``y.repeat_interleave(K)``
(:func:`repeat_labels`). The per-example gradient is the MEAN over an
example's rows; ``loss_reduction="mean"`` divides by the B examples (a mean
over the B·K rows is exactly that: (1/B) Σ_i (1/K) Σ_k ℓ_ik).

The engine groups the rows itself (``rows_per_example=K`` of
:func:`~dpopt.engine.iter_per_sample_sources`); ``dpopt train
--augmentation-multiplicity K`` (:class:`ViewBatches`) and
``make_private(augmentation_multiplicity=K)`` use that. :class:`ViewsOf` and
:func:`views_loss` express the same thing through the one-example-per-row
interface (inputs ``[B, K, ...]``) for the per-example (``torch.func``)
engine; micro-batches (``physical_batch_size``) split dim 0 — examples — so
never an example's views.

Augmentations (tensor ops; torchvision is not a dependency — its wheels pin a
torch version):

* ``"crop-flip"``: random crop with zero padding 4 (in the normalised
  space: the pad is the dataset mean) and a horizontal flip with
  probability ½, per view — the CIFAR-10 augmentation of De et al. (and of
  torchvision's ``RandomCrop(32, padding=4)`` + ``RandomHorizontalFlip()``);
* ``"flip"``: horizontal flip only; ``"none"``: identity (K copies).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn

__all__ = [
    "AUGMENTATIONS",
    "crop_flip",
    "hflip",
    "get_augmentation",
    "repeat_views",
    "repeat_labels",
    "ViewsOf",
    "views_loss",
    "check_multiplicity",
    "resolve_augmentation",
    "expand_views",
    "ViewCollate",
]

AUGMENTATIONS = ("crop-flip", "flip", "none")


def check_multiplicity(k) -> int:
    """``k`` as an int ≥ 1.

    Raises:
        ValueError: not an integer ≥ 1 (say what to give).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"augmentation_multiplicity must be an integer >= 1 (1: no extra views), got {k!r}")
    return k


def hflip(x: Tensor, generator: Optional[torch.Generator] = None, p: float = 0.5) -> Tensor:
    """Flip each image of ``x [N, C, H, W]`` left-right with probability ``p`` (independently)."""
    flip = torch.rand(x.shape[0], generator=generator, device="cpu").to(x.device) < p
    return torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)


def crop_flip(
    x: Tensor, generator: Optional[torch.Generator] = None, padding: int = 4, padding_mode: str = "constant"
) -> Tensor:
    """Random crop of the zero-padded image (padding 4) and a random horizontal flip, per image.

    Args:
        x: ``[N, C, H, W]`` images (any float dtype/device).
        generator: CPU generator of the draws (crop offsets uniform in
            {0, ..., 2·padding} per axis; flip with probability ½).
        padding: pixels added on each side before cropping back to H×W.
        padding_mode: ``"constant"`` (zeros) or ``"reflect"``.

    Returns:
        ``[N, C, H, W]``.

    Raises:
        ValueError: x not 4-D, a negative padding.
    """
    if x.dim() != 4:
        raise ValueError(f"crop_flip takes images [N, C, H, W], got shape {tuple(x.shape)}")
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    n, _, h, w = x.shape
    if padding:
        xp = torch.nn.functional.pad(x, (padding,) * 4, mode=padding_mode)
        dy = torch.randint(0, 2 * padding + 1, (n,), generator=generator).to(x.device)
        dx = torch.randint(0, 2 * padding + 1, (n,), generator=generator).to(x.device)
        rows = (dy.view(-1, 1) + torch.arange(h, device=x.device)).view(n, 1, h, 1)
        cols = (dx.view(-1, 1) + torch.arange(w, device=x.device)).view(n, 1, 1, w)
        idx = torch.arange(n, device=x.device).view(n, 1, 1, 1)
        ch = torch.arange(x.shape[1], device=x.device).view(1, -1, 1, 1)
        x = xp[idx, ch, rows, cols]
    return hflip(x, generator)


def get_augmentation(name: str) -> Callable[[Tensor, Optional[torch.Generator]], Tensor]:
    """The augmentation ``fn(x [N, ...], generator) -> [N, ...]`` of that name (:data:`AUGMENTATIONS`).

    Raises:
        ValueError: unknown name.
    """
    if name == "crop-flip":
        return crop_flip
    if name == "flip":
        return hflip
    if name == "none":
        return lambda x, generator=None: x.clone()  # type: ignore[misc]
    raise ValueError(f"unknown augmentation {name!r}; choose one of {', '.join(AUGMENTATIONS)}")


def repeat_views(
    x: Tensor, k: int, fn: Optional[Callable] = None, generator: Optional[torch.Generator] = None
) -> Tensor:
    """B examples → B·K rows, example-major (rows i·K..i·K+K−1 are example i's views), each through ``fn``.

    Args:
        x: ``[B, ...]``; k: views per example (≥ 1); fn: ``fn(rows, generator) -> rows``
            applied to the B·K repeated rows (None: plain copies); generator: its randomness.

    Returns:
        ``[B·K, ...]``.
    """
    check_multiplicity(k)
    rows = x.repeat_interleave(k, dim=0)
    return rows if fn is None else fn(rows, generator)


def repeat_labels(y: Tensor, k: int) -> Tensor:
    """Labels of :func:`repeat_views`' rows: ``y.repeat_interleave(k)``, ``[B·K, ...]``."""
    return y.repeat_interleave(check_multiplicity(k), dim=0)


def resolve_augmentation(augmentation, k: int) -> Callable:
    """``make_private``'s ``augmentation``: a name of :data:`AUGMENTATIONS` or ``fn(rows, generator) -> rows``.

    Raises:
        ValueError: an unknown name, or ``"none"`` with ``k`` > 1 (k identical views: the same
            gradient at k times the cost).
        TypeError: neither a name nor a callable.
    """
    if isinstance(augmentation, str):
        if augmentation == "none" and k > 1:
            raise ValueError(
                f"augmentation='none' with augmentation_multiplicity={k} makes {k} identical views of "
                f"each example (the same gradient at {k}x the cost); give an augmentation such as "
                "'crop-flip' or your own fn(rows, generator), or augmentation_multiplicity=1"
            )
        return get_augmentation(augmentation)
    if not callable(augmentation):
        raise TypeError(
            f"augmentation must be one of {', '.join(AUGMENTATIONS)} or a function fn(rows, generator) "
            f"-> rows, got {type(augmentation).__name__}"
        )
    return augmentation


def expand_views(batch, k: int, fn: Callable):
    """A collated batch of B examples → B·K example-major rows: the input through ``fn``, the rest repeated.

    Args:
        batch: a tensor ``[B, ...]`` (the inputs), or a tuple/list whose first element is the
            input tensor ``[B, ...]`` and whose other elements are tensors ``[B, ...]`` (labels,
            weights, ...).
        k: views per example; fn: ``fn(rows [B·K, ...], generator=None) -> rows`` (its draws come
            from torch's default generator: augmentation randomness protects nothing).

    Returns:
        the same structure: the input ``fn(repeat_views(x, k))``, every other tensor
        ``repeat_interleave(k, dim=0)`` (rows i·K … i·K + K − 1 are example i's).

    Raises:
        TypeError: a batch of another structure (a dict, ...) or a non-tensor element.
        ValueError: an element whose dim 0 is not the batch's B.
    """
    if isinstance(batch, Tensor):
        return _views_of_input(batch, k, fn)
    if not isinstance(batch, (tuple, list)) or not batch or not isinstance(batch[0], Tensor):
        raise TypeError(
            f"augmentation= expands batches that are a tensor or a tuple/list whose first element is the "
            f"input tensor, got {type(batch).__name__}; for other batches leave augmentation=None and "
            "forward each example's K views as consecutive rows yourself (dpopt.augment.repeat_views)"
        )
    b = batch[0].shape[0]
    out = [_views_of_input(batch[0], k, fn)]
    for j, item in enumerate(batch[1:], start=1):
        if not isinstance(item, Tensor) or item.dim() == 0 or item.shape[0] != b:
            what = type(item).__name__ if not isinstance(item, Tensor) else f"a tensor of shape {tuple(item.shape)}"
            raise (TypeError if not isinstance(item, Tensor) else ValueError)(
                f"augmentation=: element {j} of the batch is {what}, not a tensor of the batch's {b} examples "
                "along dim 0, so its rows cannot be repeated with the views; leave augmentation=None and repeat "
                "the views yourself (dpopt.augment.repeat_views, repeat_labels)"
            )
        out.append(item.repeat_interleave(k, dim=0))
    if isinstance(batch, list):
        return out
    return type(batch)(*out) if hasattr(batch, "_fields") else type(batch)(out)  # a namedtuple, a tuple


def _views_of_input(x: Tensor, k: int, fn: Callable) -> Tensor:
    return repeat_views(x, k, fn if x.shape[0] else None)  # an empty batch: nothing to augment


class ViewCollate:
    """``collate_fn`` of ``make_private(augmentation=...)``'s loader: examples → example-major views.

    Wraps the loader's own ``collate_fn`` (applied first) with :func:`expand_views`. The data
    loader's sampler still draws EXAMPLES (q, N and the expected batch size count examples), and
    BatchMemoryManager splits the index list, so a chunk always holds whole examples with all their
    views: the layout the engine's ``rows_per_example=K`` groups is right by construction.

    Args:
        collate_fn: the loader's collate function; k: views per example (≥ 1); fn: the augmentation.
    """

    def __init__(self, collate_fn: Callable, k: int, fn: Callable):
        self.collate_fn, self.k, self.fn = collate_fn, check_multiplicity(k), fn

    def __call__(self, items):
        return expand_views(self.collate_fn(items), self.k, self.fn)


class ViewsOf(nn.Module):
    """``model`` applied to the K views of each example: ``x [B, K, ...] → out [B, K, ...]``.

    The wrapped model sees ``[B·K, ...]`` (example-major); its parameters are
    the wrapper's (``named_parameters`` prefixed ``model.``). One example per
    row of dim 0 of the wrapper's input, as dpopt's per-example engines
    expect. Labels stay one per example, ``y [B, ...]``: :func:`views_loss`
    applies each to the example's K outputs.

    Raises:
        ValueError: ``x`` whose dim 1 is not K (e.g. ``[B·K, ...]`` rows: use
            ``x.reshape(B, K, ...)``, or the engines' ``rows_per_example=K``).
    """

    def __init__(self, model: nn.Module, k: int):
        super().__init__()
        self.model, self.k = model, check_multiplicity(k)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 2 or x.shape[1] != self.k:
            raise ValueError(
                f"ViewsOf(K={self.k}) takes x [B, K, ...] (the K views of each example along dim 1), "
                f"got {tuple(x.shape)}; reshape [B·K, ...] rows to [B, K, ...]"
            )
        b = x.shape[0]
        out = self.model(x.reshape(b * self.k, *x.shape[2:]))
        return out.reshape(b, self.k, *out.shape[1:])


def views_loss(loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    """Per-example loss of :class:`ViewsOf`'s output: the mean over the K views of ``loss_fn``.

    ``fn(out [b, K, ...], y [b, ...]) -> (1/K) Σ_k loss_fn(out[:, k], y)`` (for b = 1,
    what the per-example engines differentiate, that is example i's loss averaged over its views).
    """

    def loss(out: Tensor, target: Tensor) -> Tensor:
        k = out.shape[1]
        return sum(loss_fn(out[:, j], target) for j in range(k)) / k  # type: ignore[return-value]

    return loss


class ViewBatches:
    """dpopt train's batches with augmentation (and multiplicity): what the loop hands the per-example engine.

    Args:
        model, loss_fn: the run's model and ``loss_fn(out[1, ...], y[1]) -> scalar``.
        k: views per example (≥ 1); augment: an :data:`AUGMENTATIONS` name.
        seed: the run's seed: the draws of step s come from a generator seeded
            from (seed, s) — non-private randomness, reproducible and resumable.

    ``batch(x, y, step) -> (model, loss_fn, x, y, kwargs)``, ``kwargs`` for
    :func:`~dpopt.engine.iter_per_sample_sources`: for K = 1 the augmented
    batch with the run's model and the fast engine (``{}``); for K > 1 the
    B·K example-major rows (:func:`repeat_views`) and labels with
    ``rows_per_example=K`` when the engine groups views itself
    (:func:`engine_groups_views`: the fast engine, exact, B examples per
    source), else inputs ``[B, K, ...]`` with the :class:`ViewsOf` wrapper,
    :func:`views_loss` and ``engine="reference"`` (the per-example
    ``torch.func`` path: exact for any model, slower). Either way a
    micro-batch (``physical_batch_size``) counts examples and never splits
    an example's views.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable, k: int, augment: str, seed: int, grouped: bool = True):
        self.k = check_multiplicity(k)
        self.fn = get_augmentation(augment)
        self.seed = int(seed)
        self.model, self.loss_fn = model, loss_fn
        self.grouped = bool(grouped)
        self.views_model = ViewsOf(model, k) if k > 1 and not self.grouped else None
        self.views_loss = views_loss(loss_fn) if k > 1 and not self.grouped else None

    def generator(self, step: int) -> torch.Generator:
        """The CPU generator of step ``step``'s augmentation draws (seeded from the run seed and the step)."""
        return torch.Generator().manual_seed((self.seed * 1_000_003 + int(step) + 1) % (1 << 62))

    def batch(self, x: Tensor, y: Tensor, step: int):
        g = self.generator(step)
        if self.k == 1:
            return self.model, self.loss_fn, self.fn(x, g), y, {}
        rows = repeat_views(x, self.k, self.fn, g)
        if self.grouped:
            return self.model, self.loss_fn, rows, repeat_labels(y, self.k), {"rows_per_example": self.k}
        return (
            self.views_model,
            self.views_loss,
            rows.reshape(x.shape[0], self.k, *x.shape[1:]),
            y,
            {"engine": "reference"},
        )
