"""Parameters used by several modules (tied weights): one per-example gradient, the sum over its uses.

GPT-2's token embedding ``wte`` is also its output projection ``lm_head``
(one ``nn.Parameter`` ``W [V, D]`` owned by an ``nn.Embedding`` and an
``nn.Linear``). Example i's gradient of such a parameter is the sum of the
gradients of its uses, g_i = Σ_u g_i^u, so its squared norm has cross terms::

    ‖g_i‖² = Σ_u ‖g_i^u‖² + 2 Σ_{u<v} ⟨g_i^u, g_i^v⟩.

Each use's rule builds its own block (:mod:`dpopt.engine.rules`);
:func:`merge_shared` combines the blocks of every parameter covered more
than once into one :class:`TiedBlock`:

* blocks of the same kind merge exactly: Linear/Conv2d/Conv1D weights
  (:class:`~dpopt.engine.layers.FactoredBlock`) concatenate their calls
  along t (g_i = Σ_t e_it a_itᵀ over every call of every use), embeddings
  (:class:`~dpopt.engine.layers.SparseRowsBlock`) add their touched rows,
  materialised blocks (:class:`~dpopt.engine.layers.DirectBlock`) add;
* **embedding + output projection** (flat geometry), factored, never
  forming the ``[V, D]`` head gradient of an example: with F_i = Σ_t e_it
  a_itᵀ (head; e_it ∈ R^V, a_it ∈ R^D) and S_i the embedding rows r_iv of
  the tokens example i looked up::

      ‖F_i + S_i‖² = ‖F_i‖² + Σ_{v touched by i} (‖r_iv‖² + 2 Σ_t e_it[v] ⟨a_it, r_iv⟩),

  ‖F_i‖² by the ghost norm Σ_{t,s} (a_it·a_is)(e_it·e_is) (Li et al. 2022)
  or the direct form, whichever is cheaper; the cross term costs
  O(K·T·D) for the K touched rows. Everything is accumulated in float64
  (the terms have mixed signs) and the total clamped at 0;
* **any other combination, or a shift/scale clip geometry** (AdaClip,
  DP-MacAdam): the exact documented fallback — per-example gradients of the
  parameter materialised for a chunk of examples at a time (memory bounded
  by the source's :class:`~dpopt.engine.layers.Budget` chunk), the uses
  added, then the norm in the geometry.

Clipped sums are linear: Σ_i c_i g_i = Σ_u Σ_i c_i g_i^u, each use's own sum.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from .layers import DirectBlock, FactoredBlock, LinearPart, SparseRowsBlock, _geo_sq_norms
from .row_norms import round_up_sq_norms

__all__ = ["TiedBlock", "merge_shared"]


def _split(blk, i: int):
    """The part of ``blk`` that covers parameter ``i`` (a DirectBlock over several parameters is split)."""
    if len(blk.index) == 1:
        return blk
    if isinstance(blk, DirectBlock):
        return DirectBlock([i], [blk.grads[blk.index.index(i)]])
    raise TypeError(f"cannot split a {type(blk).__name__} over parameters {blk.index}")  # pragma: no cover


def _rest(blk, shared: set):
    """``blk`` without the shared parameters (None if nothing is left)."""
    keep = [k for k, i in enumerate(blk.index) if i not in shared]
    if len(keep) == len(blk.index):
        return blk
    if not keep:
        return None
    return DirectBlock([blk.index[k] for k in keep], [blk.grads[k] for k in keep])


def merge_shared(blocks: Sequence, shapes: Sequence[torch.Size], chunk_bytes: int) -> list:
    """Blocks where every parameter is covered once: the uses of a shared parameter become one :class:`TiedBlock`.

    Args:
        blocks: the rules' blocks (a tied parameter appears in one block per use).
        shapes: parameter shapes by index.
        chunk_bytes: scratch memory of the materialised fallback (bytes).
    """
    count: dict[int, int] = {}
    for blk in blocks:
        for i in blk.index:
            count[i] = count.get(i, 0) + 1
    shared = {i for i, n in count.items() if n > 1}
    if not shared:
        return list(blocks)
    uses: dict[int, list] = {i: [] for i in sorted(shared)}
    out = []
    for blk in blocks:
        for i in blk.index:
            if i in shared:
                uses[i].append(_split(blk, i))
        rest = _rest(blk, shared)
        if rest is not None:
            out.append(rest)
    out.extend(TiedBlock(i, shapes[i], u, chunk_bytes) for i, u in uses.items())
    return out


def _merge_sparse(parts: list[SparseRowsBlock]) -> SparseRowsBlock:
    """One SparseRowsBlock whose touched rows are the sums of those of ``parts`` (same V, D, B)."""
    first = parts[0]
    keys = torch.cat([p.row_ex * first.V + p.row_tok for p in parts])
    rows = torch.cat([p.rows for p in parts])
    uniq, inv = torch.unique(keys, return_inverse=True)
    first.rows = rows.new_zeros(uniq.numel(), first.D).index_add_(0, inv, rows)
    first.row_ex, first.row_tok = uniq // first.V, uniq % first.V
    return first


class TiedBlock:
    """One parameter used by several modules: per-example gradient = sum of the uses' (module docstring).

    Args:
        index: the parameter's index; shape: its shape.
        uses: one block per use, each covering only this parameter.
        chunk_bytes: scratch memory for the materialised fallback.

    Attributes:
        form: ``"factored"`` (embedding + projection cross term), ``"sum"``
            (one kind only: merged exactly) or ``"dense"`` (materialised in
            chunks) — of the last :meth:`sq_norms` call.
    """

    def __init__(self, index: int, shape: Sequence[int], uses: Sequence, chunk_bytes: int):
        self.index = (index,)
        self.shape = tuple(shape)
        self.chunk_bytes = int(chunk_bytes)
        fac = [u for u in uses if isinstance(u, FactoredBlock)]
        sparse = [u for u in uses if isinstance(u, SparseRowsBlock)]
        direct = [u for u in uses if isinstance(u, DirectBlock)]
        other = [u for u in uses if not isinstance(u, (FactoredBlock, SparseRowsBlock, DirectBlock))]
        self.uses: list = list(other)
        if fac:
            f = fac[0]
            for g in fac[1:]:
                f.parts.extend(g.parts)
            f.T = sum(pt.T for pt in f.parts)
            self.uses.append(f)
        if sparse:
            self.uses.append(_merge_sparse(sparse))
        if direct:
            self.uses.append(DirectBlock([index], [sum(d.grads[0] for d in direct)]))  # type: ignore[list-item]
        self.form: Optional[str] = None

    @property
    def B(self) -> int:
        u = self.uses[0]
        return int(u.grads[0].shape[0]) if isinstance(u, DirectBlock) else int(u.B)

    # -- norms -----------------------------------------------------------------------
    def sq_norms(self, geos) -> list[Tensor]:
        if len(self.uses) == 1:
            self.form = "sum"
            return self.uses[0].sq_norms(geos)
        m, b = geos[0]
        kinds = {type(u) for u in self.uses}
        if (
            m is None
            and b is None
            and kinds == {FactoredBlock, SparseRowsBlock}
            and all(isinstance(pt, LinearPart) for u in self.uses if isinstance(u, FactoredBlock) for pt in u.parts)
        ):
            self.form = "factored"
            return [self._factored()]
        self.form = "dense"
        return [self._dense(m, b)]

    def _factored(self) -> Tensor:
        f = next(u for u in self.uses if isinstance(u, FactoredBlock))
        s = next(u for u in self.uses if isinstance(u, SparseRowsBlock))
        dtype = f._dtype()
        head = _factored_sq64(f)  # ‖F_i‖², float64
        rows = s.rows.double()
        total = head.index_add(0, s.row_ex, rows.square().sum(1))  # + Σ_touched ‖r_iv‖²
        cross = torch.zeros(s.rows.shape[0], dtype=torch.float64, device=rows.device)
        k = s.rows.shape[0]
        for pt in f.parts:  # Σ_t e_it[v] ⟨a_it, r_iv⟩ per touched row (i, v), in chunks of rows
            per_row = max(1, pt.T * (pt.a.shape[-1] + 1) * 8)
            step = max(1, min(k, self.chunk_bytes // per_row)) if k else 1
            for lo in range(0, k, step):
                hi = min(k, lo + step)
                ex, tok = s.row_ex[lo:hi], s.row_tok[lo:hi]
                a = pt.a[ex].double()  # [k, T, D]
                pos = torch.arange(pt.T, device=ex.device).view(1, -1)
                e = pt.e[ex.view(-1, 1), pos, tok.view(-1, 1)].double()  # [k, T]: e_it[v] of the row's token
                cross[lo:hi] += (torch.bmm(a, rows[lo:hi].unsqueeze(2)).squeeze(2) * e).sum(1)
        total = total.index_add(0, s.row_ex, 2.0 * cross)
        # rounded UP into the dtype, not to nearest: the float64 roundings counted as for a sum of non-negative
        # terms (head: its form's depth; ‖r‖²: D + rows; cross: D + T + rows); the mixed signs' cancellation
        # (≈ 1e-16 of the terms' magnitude, as the float64 Gram form's) stays a documented bound
        head_terms = f.T * f.T + max(f.p, f.q) + 2 if _ghost_cheaper(f) else f.T + f.p * f.q + 1
        return round_up_sq_norms(total.clamp_min_(0.0), head_terms + s.D + f.T + k + 4, dtype)

    def _dense_rows(self) -> int:
        per = math.prod(self.shape) * 8 * 2
        return max(1, min(max(self.B, 1), self.chunk_bytes // max(per, 1)))

    def _dense(self, m: Optional[Tensor], b: Optional[Tensor]) -> Tensor:
        n = self.B
        out = []
        step = self._dense_rows()
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            g = sum(_dense(u, lo, hi, self.shape) for u in self.uses)
            out.append(_geo_sq_norms(g, m, b))  # type: ignore[arg-type]
        if not out:
            return torch.zeros(0)
        return torch.cat(out)

    # -- sums ------------------------------------------------------------------------------
    def grad_sums(self, coefs, bad) -> list[Tensor]:
        total = None
        for u in self.uses:
            s = u.grad_sums(coefs, bad)[0].reshape(self.shape)
            total = s if total is None else total + s
        return [total]  # type: ignore[list-item]

    def free(self) -> None:
        for u in self.uses:
            u.free()


def _ghost_cheaper(f: FactoredBlock) -> bool:
    """Whether :func:`_factored_sq64` takes the ghost (Gram) form: T(p + q) < pq."""
    return f.T * (f.p + f.q) < f.p * f.q


def _factored_sq64(f: FactoredBlock) -> Tensor:
    """‖Σ_t e_it a_itᵀ‖² per example in float64: ghost norm or direct chunks, the cheaper."""
    if _ghost_cheaper(f):
        out = []
        step = max(1, min(f.B, f.budget.chunk_bytes // max(1, (2 * f.T * f.T + (f.p + f.q) * f.T) * 8)))
        for s in range(0, f.B, step):
            t = min(f.B, s + step)
            at, et = f._cat("at", s, t).double(), f._cat("et", s, t).double()
            out.append((torch.bmm(at.transpose(1, 2), at) * torch.bmm(et.transpose(1, 2), et)).sum((1, 2)))
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)
    out = []
    step = f._chunk_rows()
    for s in range(0, f.B, step):
        t = min(f.B, s + step)
        g = torch.bmm(f._cat("et", s, t).double(), f._cat("at", s, t).double().transpose(1, 2))
        out.append(g.reshape(g.shape[0], -1).square().sum(1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def _dense(u, lo: int, hi: int, shape: tuple) -> Tensor:
    """Per-example gradients of examples lo..hi−1 of one use, ``[hi − lo, *shape]`` (materialised)."""
    if isinstance(u, DirectBlock):
        return u.grads[0][lo:hi].reshape(hi - lo, *shape)
    if isinstance(u, FactoredBlock):
        if len(u.parts) == 1 and not isinstance(u.parts[0], LinearPart):
            g = u.parts[0].per_sample(lo, hi, "im2col")
        else:
            g = torch.bmm(u._cat("et", lo, hi), u._cat("at", lo, hi).transpose(1, 2))
        return g.reshape(hi - lo, *shape)
    if isinstance(u, SparseRowsBlock):
        g = u.rows.new_zeros(hi - lo, u.V, u.D)
        sel = (u.row_ex >= lo) & (u.row_ex < hi)
        g.index_put_((u.row_ex[sel] - lo, u.row_tok[sel]), u.rows[sel], accumulate=True)
        return g.reshape(hi - lo, *shape)
    raise TypeError(f"no materialised form for a {type(u).__name__}")  # pragma: no cover
