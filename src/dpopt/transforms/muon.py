"""Muon on released gradients (DP-Muon, DP-Muon-S) and the routing of parameters.

the spectral paper (Shanmugam, Barnes, Taylor 2026; docs/algorithms.md),
Table 15; docs/algorithms.md "Muon, DP-Muon, DP-Muon-S". The gradient g̃ is
privatized ONCE for the whole model (global flat clipping, DP-SGD privatizer);
everything here is post-processing of that release.

For each hidden weight matrix W (conv kernels flattened to out × in·kh·kw)::

    M_t = β M_{t−1} + (1−β) g̃_t                  EMA momentum, M_0 = 0
    U_t = (1−β) g̃_t + β M_t   (Nesterov)   or   U_t = M_t
    DP-Muon    (β .95, Nesterov, η .02):  O_t = NS5(U_t) · √max(1, rows/cols)
    DP-Muon-S  (β .9, no Nesterov, η .3): O_t = σ₁(U_t) · NS5(U_t)
    W_t = W_{t−1} − η O_t                         (the −η is scale_by_lr's)

σ₁ comes from a warm-started power iteration (one ``[cols]`` vector of state
per matrix), or exactly from the SVD in ``orthogonalizer="svd"`` mode. All
other parameters — biases, norm gains, embedding tables, the first conv kernel
and the classifier head — are routed to Adam (or SGD) on g̃ by a :class:`Partition`
whose label function :func:`hidden_matrix_labels` builds from the model's
parameter list (override it with your own ``label_fn``).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .base import Partition, StepContext, Transform
from .newton_schulz import NS_COEFFICIENTS, NS_EPS, ORTHOGONALIZERS, as_matrix, orthogonalize, top_singular_value

__all__ = [
    "ScaleByMuon",
    "MUON_SCALINGS",
    "EXCLUDE_FIRST",
    "MUON_LABEL",
    "OTHER_LABEL",
    "hidden_matrix_labels",
    "embedding_parameters",
    "muon_partition",
]

MUON_SCALINGS = ("shape", "spectral", "none")
EXCLUDE_FIRST = ("conv", "always", "never")
MUON_LABEL, OTHER_LABEL = "muon", "other"


class ScaleByMuon(Transform):
    """Muon direction of released gradients of weight matrices (no learning rate).

    Algorithm (per parameter, shapes ``[out, *rest]`` flattened to
    ``[out, prod(rest)]`` = rows × cols for the orthogonalization)::

        M ← β M + (1−β) g̃
        U ← (1−β) g̃ + β M  if nesterov else M
        O ← orth(U) · s,  s = √max(1, rows/cols)  ("shape", DP-Muon)
                          s = σ₁(U)               ("spectral", DP-Muon-S)
                          s = 1                   ("none")

    Args:
        momentum: β ∈ [0, 1) (0.95 for DP-Muon, 0.9 for DP-Muon-S).
        nesterov: use the Nesterov blend U = (1−β)g̃ + βM.
        ns_steps: Newton–Schulz iterations K ≥ 1 (5).
        scaling: ``"shape"``, ``"spectral"`` or ``"none"`` (see above).
        orthogonalizer: ``"newton-schulz"`` (default) or ``"svd"`` (exact
            polar factor UVᵀ, and exact σ₁ for ``"spectral"``).
        ns_coefficients: (a, b, c) of the quintic iteration.
        eps: ε of the Frobenius normalisation (1e-7).
        power_iters: power-iteration steps per update for σ₁ (≥ 1; 2).

    State per parameter: ``momentum_buffer`` (param-shaped); with
    ``"spectral"`` also ``power_vector`` (``[cols]``, deterministic start).

    Raises:
        ValueError: invalid hyperparameters, or (at ``init``) a parameter with
            fewer than 2 dims — route biases and gains elsewhere with a
            :class:`~dpopt.transforms.base.Partition`.

    Source: the spectral paper (Shanmugam, Barnes, Taylor 2026) Table 15 (β, Nesterov, η, NS = 5);
    Keller Jordan's Muon (EMA momentum, Nesterov blend, √max(1, rows/cols)).
    """

    name = "scale_by_muon"

    def __init__(
        self,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        scaling: str = "shape",
        orthogonalizer: str = "newton-schulz",
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        power_iters: int = 2,
    ):
        if not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if int(ns_steps) != ns_steps or int(ns_steps) < 1:
            raise ValueError(f"ns_steps must be an integer >= 1, got {ns_steps}")
        if scaling not in MUON_SCALINGS:
            raise ValueError(f"scaling must be one of {MUON_SCALINGS}, got {scaling!r}")
        if orthogonalizer not in ORTHOGONALIZERS:
            raise ValueError(f"orthogonalizer must be one of {ORTHOGONALIZERS}, got {orthogonalizer!r}")
        if len(tuple(ns_coefficients)) != 3:
            raise ValueError(f"ns_coefficients must be (a, b, c), got {ns_coefficients!r}")
        if not float(eps) > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        if int(power_iters) < 1:
            raise ValueError(f"power_iters must be >= 1, got {power_iters}")
        self.momentum, self.nesterov = float(momentum), bool(nesterov)
        self.ns_steps, self.scaling, self.orthogonalizer = int(ns_steps), scaling, orthogonalizer
        self.ns_coefficients = tuple(float(c) for c in ns_coefficients)
        self.eps, self.power_iters = float(eps), int(power_iters)

    def init(self, param: Tensor) -> dict:
        if param.dim() < 2:
            raise ValueError(
                f"ScaleByMuon orthogonalizes matrices; got a parameter of shape "
                f"{tuple(param.shape)}. Route 1-D parameters to Adam/SGD with a Partition "
                "(see hidden_matrix_labels)"
            )
        state = {"momentum_buffer": torch.zeros_like(param)}
        if self.scaling == "spectral":
            cols = as_matrix(param).shape[1]
            gen = torch.Generator().manual_seed(0)  # public, data-independent start vector
            v = torch.randn(cols, generator=gen, dtype=torch.float64).to(param.dtype).to(param.device)
            state["power_vector"] = v / v.norm()
        return state

    def update(self, updates, states, params, ctx: StepContext):
        beta = self.momentum
        out = []
        for g, st in zip(updates, states):
            buf = st["momentum_buffer"]
            buf.mul_(beta).add_(g, alpha=1.0 - beta)
            u = (1.0 - beta) * g + beta * buf if self.nesterov else buf
            o = orthogonalize(u, self.orthogonalizer, self.ns_steps, self.ns_coefficients, self.eps)  # type: ignore[arg-type]
            rows, cols = as_matrix(u).shape
            if self.scaling == "shape":
                o = o * math.sqrt(max(1.0, rows / cols))
            elif self.scaling == "spectral":
                m = as_matrix(u)
                if self.orthogonalizer == "svd":
                    sigma = torch.linalg.matrix_norm(m, ord=2)
                else:
                    sigma, st["power_vector"] = top_singular_value(m, st["power_vector"], self.power_iters)
                o = sigma * o
            out.append(o)
        return out


def _is_matrix(p: Tensor) -> bool:
    """A linear map's weight (≥ 2-D), not a table broadcast over the batch (ViT's ``[1, 1, D]`` class token,
    ``[1, T, D]`` position embeddings: ≥ 3-D with a leading 1, added to activations rather than multiplied)."""
    return p.dim() >= 2 and not (p.dim() >= 3 and p.shape[0] == 1)


def embedding_parameters(model: nn.Module) -> list[Tensor]:
    """The weights of every ``nn.Embedding`` / ``nn.EmbeddingBag`` in ``model`` (lookup tables, not
    linear maps: Muon's orthogonalization does not apply to them; torch.optim.Muon's docs and
    Keller Jordan's Muon route them to AdamW)."""
    return [m.weight for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]


def hidden_matrix_labels(
    params: Union[Sequence[Tensor], nn.Module],
    exclude_first: str = "conv",
    exclude_last: bool = True,
    embeddings: Optional[Iterable[Tensor]] = None,
) -> Callable[[Tensor], str]:
    """Label function for Muon routing, built from the parameters in model order.

    A parameter is labelled ``"muon"`` iff it has ≥ 2 dims (a linear weight or
    a conv kernel) and is not excluded; everything else is ``"other"``:

    * biases, norm gains and other 1-D parameters are never Muon;
    * tables added to the activations, broadcast over the batch (≥ 3-D with a leading
      dimension of 1: a ViT's ``[1, 1, D]`` class token and ``[1, T, D]`` position
      embeddings) are never Muon: they are embeddings, not linear maps;
    * embedding tables (``nn.Embedding`` / ``nn.EmbeddingBag`` weights, 2-D
      but lookups, not linear maps) are never Muon: pass the model as
      ``params`` (they are found by module type) or list them in
      ``embeddings`` (:func:`embedding_parameters`). A plain parameter list
      cannot tell an embedding from a linear weight: give one of the two when
      the model has embeddings;
    * the LAST weight (≥ 2-D) is the classifier head: excluded when
      ``exclude_last`` (default);
    * the FIRST weight: ``exclude_first="conv"`` (default) excludes it only if
      it is a conv kernel (≥ 3-D: the input-facing "first conv" of the
      spectral paper), so an MLP's first linear layer is a hidden matrix;
      ``"always"`` excludes it whatever its shape; ``"never"`` keeps it.

    "First" and "last" are among the ≥ 2-D parameters that are not
    embeddings (so a language model's input embedding is never taken for the
    first hidden matrix, nor a tied or untied output embedding for the head
    position). Identification is by tensor identity in ``params`` (the order
    the model lists them, e.g. ``model.parameters()``), so it needs no module names.

    Args:
        params: the trainable parameters in model order, or the model itself
            (its trainable parameters; embeddings detected by module type).
        exclude_first: ``"conv"``, ``"always"`` or ``"never"``.
        exclude_last: exclude the classifier head (default: the head goes to
            the other branch, as torch.optim.Muon's docs and Keller Jordan's
            Muon advise).
        embeddings: parameters to route to the other branch as embeddings
            (added to those found in a model).

    Returns:
        ``label_fn(param) -> "muon" | "other"``.

    Raises:
        ValueError: unknown ``exclude_first``; and ``label_fn`` raises
            ValueError for a tensor that is not in ``params``.
    """
    if exclude_first not in EXCLUDE_FIRST:
        raise ValueError(f"exclude_first must be one of {EXCLUDE_FIRST}, got {exclude_first!r}")
    emb_ids = {id(p) for p in (embeddings or ())}
    if isinstance(params, nn.Module):
        emb_ids |= {id(p) for p in embedding_parameters(params)}
        params = [p for p in params.parameters() if p.requires_grad]
    params = list(params)
    weights = [i for i, p in enumerate(params) if _is_matrix(p) and id(p) not in emb_ids]
    excluded: set[int] = set()
    if weights:
        first = weights[0]
        if exclude_first == "always" or (exclude_first == "conv" and params[first].dim() >= 3):
            excluded.add(first)
        if exclude_last:
            excluded.add(weights[-1])
    labels = {id(p): (MUON_LABEL if i in weights and i not in excluded else OTHER_LABEL) for i, p in enumerate(params)}
    keep_alive = params  # ids stay valid while the label function lives

    def label_fn(param: Tensor) -> str:
        try:
            return labels[id(param)]
        except KeyError:
            raise ValueError(
                f"parameter of shape {tuple(param.shape)} was not in the list the Muon "
                f"routing was built from ({len(keep_alive)} parameters)"
            ) from None

    label_fn.labels = [labels[id(p)] for p in params]  # type: ignore[attr-defined]
    return label_fn


def muon_partition(muon: Transform, other: Transform, label_fn: Callable[[Tensor], str]) -> Partition:
    """``Partition({"muon": muon, "other": other}, label_fn)`` (see :func:`hidden_matrix_labels`)."""
    return Partition({MUON_LABEL: muon, OTHER_LABEL: other}, label_fn)
