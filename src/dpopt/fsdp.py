"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with per-example clipping and ONE noise draw per coordinate.

Use (every rank, after ``torch.distributed.init_process_group``; gloo on CPU, NCCL on GPUs)::

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model, opt, loader = dpopt.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, distributed="fsdp")

One logical step on W ranks, each holding whole examples (its Poisson shard,
:class:`~dpopt.distributed.ShardedPoissonSampler`, as for DDP)::

    rank r, each layer while FSDP has it unsharded (its forward / backward):
             hooks record the layer's input a_i and output gradient e_i          (HookCapture)
    rank r:  ‖g_i‖² = Σ_layers ‖g_i,layer‖²  → clip factor c_i = min(1, C/‖g_i‖)   (whole examples: local)
             s_r   = Σ_i c_i g_i  in FULL (unsharded) shape                       (Privatizer.accumulate)
             s_r[shard r] += σC·z[shard r]    z: the full-shape draw, indexed by GLOBAL coordinate
    all:     S̃[shard r] = reduce_scatter_sum(s_0 … s_{W−1})[shard r]               (one collective; owner r)
             p.grad (DTensor, local shard) = S̃[shard r] / B̄ → the user's optimizer on the local shards

Why this is the one-process mechanism (DESIGN.md, "the privacy boundary"):

* **Norms over the whole gradient.** The hook capture computes each layer's
  per-example gradient from the full activations and output gradients it
  records (the unsharded weight shape), so the squared norms are summed over
  every layer of the model before the clip factor — no layer lives "on
  another rank": each rank holds whole examples.
* **Clip before any reduction; FSDP's own reduction off.** FSDP2 would
  reduce-scatter the RAW gradient of every unit in its post-backward hook
  (divided by W by default). :func:`prepare_model` switches that off
  (``set_requires_gradient_sync(False)`` on every FSDP module), and the raw
  unsharded gradients autograd leaves behind are dropped at every step
  (:class:`ShardedCapture`); only clipped sums cross the network, summed,
  never divided by W behind the noise's back.
* **Noise once per coordinate, std σC on the sum.** Coordinate j is owned by
  exactly one rank (FSDP's ``Shard(0)`` chunk); only its owner adds noise to it,
  before the reduce-scatter, so the reduced total is never formed without noise.
  Every rank draws the full-shape noise tensor and keeps its own chunk: with a
  reproducible stream this is the one-process draw, coordinate for coordinate
  (``tests/distributed/test_fsdp.py`` checks the equality); with secret noise
  each rank's own OS-seeded stream supplies its chunk (independent per
  coordinate, std σC).
* **Sensitivity.** Adding or removing one example changes one rank's clipped
  sum by at most C (√ΣC_k² per layer); the reduce-scatter only sums.
* **Correlated noise** (DP matrix factorization, :mod:`dpopt.correlated_noise`).
  The mechanism's w_t = (C⁻¹z)_t is coordinatewise, so the owner of a chunk
  runs the stream of that chunk only: its state (B − 1 or N float64 vectors of
  the chunk's size) is fed from the rank's own fresh noise, stays in its
  memory and is never sent; coordinate j gets exactly the one-process w_t[j].

Trades made (and measured, ``benchmarks/fsdp_bytes.py``):

* **Reduce-scatter, not all-reduce then slice.** Each rank receives only its
  shard: (W−1)/W·P elements per step on a ring, half an all-reduce (DDP's
  2(W−1)/W·P). With FSDP's two parameter all-gathers (forward, and backward
  after ``reshard_after_forward``) a step moves ≈ 3(W−1)/W·P elements against
  DDP's 2(W−1)/W·P: 1.5×. A backend without ``reduce_scatter_tensor`` falls
  back to an all-reduce of the packed buffer and keeps the local chunk (2×).
* **Full-shape clipped sums.** The clipped sums (and a micro-batch
  accumulator) are held in full shape on every rank until the step's one
  reduce-scatter: P extra floats per rank at the step, which DDP holds too;
  FSDP's sharding of the parameters and optimizer state is kept. Micro-batches
  (``signal_skip_step`` / BatchMemoryManager) therefore accumulate unsharded
  and reduce once per logical step (no collective per micro-batch).
* **Full-shape noise draw on every rank** (for global indexing): P normals per
  rank instead of P/W.

Refused, with an error saying what to change: a model without ``fully_shard``
(use ``distributed=True``), trainable parameters FSDP does not shard (plain
tensors beside DTensors), a mesh of more than one dimension (HSDP) or
placements other than ``Shard(0)`` (tensor parallelism), a
``MixedPrecisionPolicy`` (untested: norms and noise must stay float32),
trainable parameters of layers without a fast per-example rule (their
``torch.func`` fallback would need the unsharded weight), dpopt method names
(their clip geometry and state are not sharded: use a ``torch.optim``
optimizer). Frozen parameters work (they are not clipped or noised), and so do tied weights inside one
FSDP unit (GPT-2's ``lm_head.weight is wte.weight`` in the root unit; the engine counts the tie once)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence, cast

import torch
from torch import Tensor, nn

from .correlated_noise import CorrelatedNoise
from .distributed import DistributedContext, RankAgreement, any_rank, backend_device
from .engine.check import ModeCheck, signature
from .engine.fast import FastPerSampleGrads
from .engine.hooks import HookCapture
from .engine.layers import DirectBlock
from .engine.rules import RULES

__all__ = [
    "fsdp_modules",
    "prepare_model",
    "ShardedCapture",
    "ShardedRelease",
    "capture_for",
    "attach",
    "shard_rows",
    "bytes_per_step",
]


def _fsdp():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    return FSDPModule, DTensor, Shard


def fsdp_modules(model: nn.Module) -> list:
    """The modules of ``model`` that ``fully_shard`` was applied to (``FSDPModule`` instances), root first."""
    FSDPModule, _, _ = _fsdp()
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _param_groups(model: nn.Module) -> list:
    """FSDP2's parameter groups (one per ``fully_shard`` call that owns parameters)."""
    groups = []
    for m in fsdp_modules(model):
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
        if group is not None:
            groups.append(group)
    return groups


def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)``: the dim-0 rows FSDP2's ``Shard(0)`` gives ``rank`` (``torch.chunk``: ⌈rows/W⌉ each, the last
    ranks shorter or empty)."""
    c = -(-int(rows) // int(world_size)) if rows else 0
    return min(rank * c, rows), min((rank + 1) * c, rows)


def prepare_model(model: nn.Module, ctx: DistributedContext) -> None:
    """Check an FSDP2 model for dpopt's sharded release and switch FSDP's own gradient reduction off.

    Also registers the fast per-example rule of each layer class ``fully_shard``
    subclassed (``FSDPLinear`` → ``nn.Linear``'s rule: FSDP's class adds hooks
    and methods, not another forward).

    Raises:
        ValueError: no ``fully_shard`` on the model; a trainable parameter that
            is not an FSDP ``DTensor`` with one mesh dimension of the group's
            size and placement ``Shard(0)`` (HSDP, tensor parallelism, or a
            parameter FSDP does not manage); a ``MixedPrecisionPolicy``.
    """
    FSDPModule, DTensor, Shard = _fsdp()
    mods = fsdp_modules(model)
    if not mods or not isinstance(model, FSDPModule):
        raise ValueError(
            "distributed='fsdp' needs a model with torch.distributed.fsdp.fully_shard applied (to its "
            "layers or blocks and then to the root model); for a replicated model use "
            "distributed=True"
        )
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if not isinstance(p, DTensor):
            raise ValueError(
                f"trainable parameter {name!r} is not sharded by FSDP (a plain tensor): apply "
                "fully_shard to a module that contains it (e.g. the root model), or freeze it"
            )
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise ValueError(
                f"parameter {name!r} is sharded as {tuple(p.placements)} over a {p.device_mesh.ndim}-D "
                "mesh: dpopt supports FSDP2's plain Shard(0) over a 1-D mesh only (no HSDP, no tensor "
                "parallelism); call fully_shard(module) with the default mesh"
            )
        if p.device_mesh.size() != ctx.world_size:
            raise ValueError(
                f"parameter {name!r} is sharded over {p.device_mesh.size()} ranks but the process group "
                f"has {ctx.world_size}: shard over the same group make_private trains over"
            )
    for group in _param_groups(model):
        mp = group.mp_policy
        if mp.param_dtype is not None or mp.reduce_dtype is not None:
            raise ValueError(
                "distributed='fsdp' with a MixedPrecisionPolicy is not supported (untested: per-example "
                "norms and noise must stay float32); call fully_shard without mp_policy"
            )
    for m in model.modules():  # FSDP's dynamic subclass gets its base class's rule
        t = type(m)
        if isinstance(m, FSDPModule) and t not in RULES:
            base = next((b for b in t.__mro__[1:] if b in RULES), None)
            if base is not None and base is not FSDPModule:
                RULES[t] = RULES[base]
    model.set_requires_gradient_sync(False, recurse=True)


@contextmanager
def _held_unsharded(model: nn.Module) -> Iterator[None]:
    """Context: every FSDP unit all-gathered once and kept unsharded (no collective inside), resharded after.

    The per-example check runs many small forward/backward passes; without
    this each would all-gather every unit twice.
    """
    groups = _param_groups(model)
    saved = [(g.post_forward_mesh_info, g.reshard_after_backward) for g in groups]
    for m in fsdp_modules(model):
        m.unshard()
    for g in groups:
        g.post_forward_mesh_info, g.reshard_after_backward = None, False
    try:
        yield
    finally:
        for g, (info, after) in zip(groups, saved):
            g.post_forward_mesh_info, g.reshard_after_backward = info, after
        for m in fsdp_modules(model):
            m.reshard()


#: what a rank that runs no pass of the check contributes to the agreed k (a min over ranks): more than any k
_NO_K = 1 << 20


class ShardedCapture(HookCapture):
    """:class:`~dpopt.engine.hooks.HookCapture` of an FSDP2 model: full-shape per-sample sources, checks in step.

    Args:
        model: the FSDP2 root (checked by :func:`prepare_model` first).
        ctx: the data-parallel context (W ranks).
        **kw: as for :class:`~dpopt.engine.hooks.HookCapture`.

    The sources cover the sharded ``DTensor`` parameters (matched by identity
    to the optimizer's) with their GLOBAL shapes; everything computed from them
    is a plain full-shape tensor. The first-batch check against single-example
    autograd runs at the same step on every rank (FSDP's all-gathers around it
    match across ranks): at the first step where some rank with ≥ 2 examples
    has a new :func:`~dpopt.engine.check.signature` (train/eval flags, module
    state with the user's hooks, size class), as the one-process doors do
    (:meth:`collect`: one small all-reduce per step). The ranks with ≥ 2
    examples run its passes; a rank with 0 or 1 takes part without passes and
    leaves its own signature unchecked (a batch of one cannot mix examples; the
    one-process engine skips it the same way). A refusal on one rank is raised
    on every rank.

    Raises:
        ValueError: as :class:`HookCapture`; a trainable parameter of a layer
            without a fast rule (its ``torch.func`` fallback is not supported here).
    """

    defers_check = False  # its check's passes run on every rank inside collect (the same collectives)

    lifts_layers = False  # every parameter needs a fast rule here (no vjp of an enclosing call)

    forms_param_grads = True  # FSDP's own backward machinery runs on the unsharded parameters: left as it is

    def __init__(self, model: nn.Module, ctx: DistributedContext, **kw):
        super().__init__(model, **kw)
        self.ctx = ctx
        if self.plan.fallback or self.plan.bare:
            names = sorted(self.names[i] for i in self.plan.fallback) or sorted(
                self._names.get(id(m), "?") for m in self.plan.bare
            )
            self.detach()
            raise ValueError(
                f"distributed='fsdp' needs a fast per-example rule for every trainable parameter; "
                f"{names} have none (dpopt.engine.rules: Linear, Conv, Embedding, LayerNorm, "
                "GroupNorm, MultiheadAttention, ...): freeze them, or use distributed=True"
            )
        # shape/dtype stand-ins (no memory) for the engine's zero blocks: never DTensor arithmetic in a source
        self.plan.params = [
            torch.zeros((), dtype=p.dtype, device=p.to_local().device).expand(p.shape)  # type: ignore[attr-defined, misc]
            for p in self.params
        ]
        self._syncing = False
        self._agreed_k, self._agreed_rows = _NO_K, 0  # the check's k and rows, agreed over ranks in collect

    def _empty(self) -> FastPerSampleGrads:
        blocks = [DirectBlock(list(range(len(self.params))), [q.new_zeros((0, *q.shape)) for q in self.plan.params])]
        return self._source(blocks, 0)

    checks_collate = False  # one rank's extra forwards (examples collated alone) would stall FSDP's collectives

    def _verify(
        self, p, key=None, defer: bool = False
    ) -> None:  # never deferred; only inside collect's synchronised check (all ranks at once)
        if self._syncing:
            super()._verify(p, key)
        elif key is not None:  # FSDP's check is synchronised in collect (each rank's full signature, agreed
            self._modes.done(key)  # over ranks); this rank-local mark only keeps HookCapture's bookkeeping

    # The synchronised check's passes run with every unit held unsharded (_held_unsharded: no collective inside
    # a pass; a rank that refuses stops early, a rank with < 2 examples runs none); its example count and sizes
    # are agreed over ranks (one all-reduce in collect, before the passes), and every row of a size is compared.
    compare_subset = False

    def _check_examples(self, p: Any) -> int:
        """k: the smallest over the ranks that run the check's passes (agreed in :meth:`collect`, before any
        pass: no collective here)."""
        return self._agreed_k

    def _check_rows(self, p: Any) -> int:
        """The largest batch over ranks (agreed in :meth:`collect`)."""
        return self._agreed_rows

    def _unsharded_params(self) -> list[Tensor]:
        where = {id(fp.sharded_param): fp for g in _param_groups(self.model) for fp in g.fsdp_params}
        return [where[id(p)].unsharded_param for p in self.params]

    def _drop_fsdp_grads(self) -> None:
        """Free the raw unsharded gradients autograd accumulated (FSDP's reduction is off: never used)."""
        for g in _param_groups(self.model):
            for fp in g.fsdp_params:
                if hasattr(fp, "_unsharded_param"):
                    fp._unsharded_param.grad = None
                fp.unsharded_accumulated_grad = None

    def _agree(self, needed: bool, k: int, rows: int) -> tuple[bool, int, int]:
        """ONE all-reduce (max, float64) per step: (some rank needs the check, the smallest ``k``, the largest
        ``rows`` over ranks). A rank that runs no pass gives ``k`` = :data:`_NO_K` (no effect on the min)."""
        t = torch.tensor(
            [1.0 if needed else 0.0, -float(k), float(rows)], dtype=torch.float64, device=backend_device(self.ctx)
        )
        if self.ctx.enabled:
            t = self.ctx.all_reduce(t, op="max")
        flag, neg_k, top = t.tolist()
        return flag > 0, int(-neg_k), int(top)

    def collect(self, defer_check: bool = False) -> FastPerSampleGrads:  # defers_check is False
        """The step's full-shape per-sample source (as :meth:`HookCapture.collect`), after the synchronised check.

        The check runs when some rank's own :func:`~dpopt.engine.check.signature` (train/eval flags, module
        state with the user's hooks, size class of its batch) was not checked on that rank: each rank decides
        on its own signature (it holds this process's ``id()`` values and this rank's batch size: never compared
        across ranks). ONE all-reduce per step (:meth:`_agree`) tells every rank whether some rank with ≥ 2
        examples needs the check, the check's k (the smallest over those ranks) and its rows (the largest batch
        over ranks, :meth:`_check_rows`: it covers every rank's size class). Then every rank holds the units
        unsharded (FSDP's all-gathers: every rank) and the ranks with ≥ 2 examples run the passes (local compute,
        no collective); a rank with 0 or 1 example runs none and does not mark its signature (as the one-process
        engine: a batch of one cannot mix examples; its next batch of ≥ 2 is checked). Before (2026-12-07), one
        rank with < 2 examples made EVERY rank skip the check and release: a rank of 12 examples with a new,
        mixing forward released an unchecked step (2.27 C for one example removed at σ = 0,
        ``tests/distributed/test_fsdp_signature.py``). After a check that passed, each checking rank marks its
        own signature; a refusal on some rank is raised on every rank and no rank marks its signature (the same
        model code runs on all: the next step with it is checked again everywhere).
        """
        self._drop_fsdp_grads()
        done = [c for c in self._rec.calls if c.has_grad]
        p = done[0].pass_ if done else None
        if not hasattr(self, "_synced"):  # signatures checked by every rank together (kept apart from the
            self._synced = ModeCheck(self._modes.enabled)  # rank-local marks, which would make ranks diverge)
        sig = signature(self.model, p.batch_size // self.views, p.modes, p.state) if p is not None else None
        b = p.batch_size if p is not None else 0
        checks = p is not None and b // self.views >= 2  # a batch of 0 or 1 example cannot mix: no passes
        local = checks and sig is not None and self._synced.needed(sig)
        k = super()._check_examples(cast(Any, p)) if checks else _NO_K
        needed = False
        if self._synced.enabled:
            needed, self._agreed_k, self._agreed_rows = self._agree(local, k, b)
        if needed:  # every rank takes part (the all-gathers, the verdict); the ranks with ≥ 2 examples check
            error = None
            with _held_unsharded(self.model):
                if checks:
                    saved, self.params = self.params, self._unsharded_params()  # type: ignore[assignment]
                    self._syncing = True
                    try:
                        super()._verify(p)  # type: ignore[arg-type]
                    except ValueError as exc:
                        error = exc
                    finally:
                        self.params, self._syncing = saved, False
                        self._drop_fsdp_grads()
            if any_rank(error is not None, self.ctx):  # a refusal on any rank: no rank marks its signature
                self._rec.calls = []
                if error is not None:
                    raise error
                raise ValueError(
                    "the per-example check refused this model on another rank (its error is reported there)"
                )
            if checks:  # this rank's own signature; a rank of < 2 examples leaves its own unchecked (as alone)
                self._synced.done(cast(tuple, sig))
        return super().collect()


class ShardedRelease(RankAgreement):
    """The Privatizer's ``reduce`` hook for FSDP2: owner-only noise, ONE reduce-scatter, sharded ``DTensor`` totals.

    Args:
        params: the trainable ``DTensor`` parameters, in the Privatizer's order.
        ctx: the data-parallel context.
        use_reduce_scatter: None: use ``reduce_scatter_tensor`` when the
            backend has it (else all-reduce and keep the local chunk).
        mechanism: the Privatizer's :class:`~dpopt.correlated_noise.CorrelatedNoise`
            (DP matrix factorization), or None (independent noise). With one,
            this rank turns the fresh σS·z of the coordinates it OWNS into the
            mechanism's w_t = (C⁻¹z)_t, streamed: the stream state (B − 1
            banded vectors or N BLT buffers, float64) covers this rank's shard
            only (⌈rows/W⌉-row chunks, zero-padded, of every parameter), lives
            in this process's memory only and never crosses the network; the
            noisy shard is rounded once to the sums' dtype. The mechanism is
            coordinatewise, so coordinate j gets exactly the one-process w_t[j]
            (the same w_t for the same z: ``tests/distributed/test_fsdp_correlated_noise.py``).

    Call: ``(sums, count, draw) -> (totals, noisy_count)``
    (:class:`~dpopt.privatizer.Privatizer`, ``reduce``): ``sums`` full-shape
    local clipped sums; ``draw()`` the step's full-shape noise (σS·z per
    parameter in global coordinate order, then the count's). Returns one
    ``DTensor`` per parameter, placed like it, whose local shard is this rank's
    rows of Σ_r s_r + σS·z; the noisy count is all-reduced in float64 (count
    noise added by rank 0 only).

    Attributes:
        calls: steps reduced (with a mechanism: the release index of the
            stream). elements: elements of the last packed input
            buffer (W × the local chunk). collective: ``"reduce_scatter"`` or
            ``"all_reduce"`` (public configuration, for the bytes figures).
    """

    #: the Privatizer hands this hook fresh σS·z and lets it stream the correlated noise of its own shard
    correlates_own_noise = True

    def __init__(
        self,
        params: Sequence[Tensor],
        ctx: DistributedContext,
        use_reduce_scatter: Optional[bool] = None,
        mechanism: Optional[CorrelatedNoise] = None,
    ):
        self.params, self.ctx = list(params), ctx
        self.use_reduce_scatter = use_reduce_scatter
        self.mechanism = mechanism
        self.calls = 0
        self.elements = 0
        self.collective = ""

    def _layout(self, p: Tensor) -> tuple[int, int, int]:
        """(rows per chunk, row size, this rank's rows) of parameter ``p``'s ``Shard(0)`` chunks."""
        rows = p.shape[0] if p.dim() else 1
        c = -(-rows // self.ctx.world_size)
        lo, hi = shard_rows(rows, self.ctx.world_size, self.ctx.rank)
        local = p.to_local()  # type: ignore[attr-defined]
        if p.dim() and local.shape[0] != hi - lo:
            raise RuntimeError(
                f"FSDP shard of shape {tuple(local.shape)} is not rows [{lo}, {hi}) of "
                f"{tuple(p.shape)}: unexpected sharding"
            )
        return c, (p.numel() // rows if rows else 0), hi - lo

    def _pack(self, tensors: Sequence[Tensor], dtype, device) -> Tensor:
        """[W, L]: row r = concat over parameters of chunk r (zero-padded to ⌈rows/W⌉ rows), flattened."""
        w = self.ctx.world_size
        parts = []
        for t, p in zip(tensors, self.params):
            c, row, _ = self._layout(p)
            flat = t.reshape(-1).to(dtype)
            padded = flat.new_zeros(w * c * row)
            padded[: flat.numel()] = flat
            parts.append(padded.view(w, c * row))
        return torch.cat(parts, dim=1) if parts else torch.zeros((w, 0), dtype=dtype, device=device)

    def _own(self, tensors: Sequence[Tensor], dtype, device) -> Tensor:
        """This rank's row of :meth:`_pack` (its chunk of every parameter, zero-padded to ⌈rows/W⌉ rows), without
        packing the other ranks' rows."""
        parts = []
        for t, p in zip(tensors, self.params):
            c, row, mine = self._layout(p)
            lo = self.ctx.rank * c * row
            part = torch.zeros(c * row, dtype=dtype, device=t.device)
            part[: mine * row] = t.reshape(-1)[lo : lo + mine * row]
            parts.append(part)
        return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)

    def _add_own_noise(self, buf: Tensor, noise: Sequence[Tensor]) -> None:
        """``buf[rank] += noise`` of this rank's chunk: independent noise as drawn (already in the sums' dtype);
        with a mechanism, the chunk's fresh float64 σS·z streamed into w_t (this rank's state only) and added in
        float64, the noisy chunk rounded once."""
        r = self.ctx.rank
        if self.mechanism is None:
            buf[r] += self._own(noise, buf.dtype, buf.device)
            return
        z = self._own(noise, torch.float64, buf.device)
        w = self.mechanism.correlate(z, self.calls, f"fsdp-shard:{buf.device}")
        buf[r] = w.add_(buf[r]).to(buf.dtype)

    def __call__(
        self, sums: Sequence[Tensor], count: Optional[float], draw: Callable[[], tuple[list[Tensor], Optional[float]]]
    ):
        import torch.distributed as dist

        _, DTensor, _ = _fsdp()
        sums = [
            torch.zeros(s.shape, dtype=s.dtype, device=s.to_local().device) if isinstance(s, DTensor) else s
            for s in sums
        ]
        noise, count_noise = draw()  # every rank: the full tensor (global indexing); only the owner's chunk is used
        noise = [
            torch.zeros(z.shape, dtype=z.dtype, device=z.to_local().device) if isinstance(z, DTensor) else z
            for z in noise
        ]
        dtype, device = (sums[0].dtype, sums[0].device) if sums else (torch.float32, None)
        r, w = self.ctx.rank, self.ctx.world_size
        buf = self._pack(sums, dtype, device)
        self._add_own_noise(buf, noise)  # owner-only noise, before anything crosses the network
        self.elements = buf.numel()
        if self.use_reduce_scatter is None:  # decided once, identically on every rank
            self.use_reduce_scatter = w > 1 and _has_reduce_scatter(self.ctx)
        if w == 1:
            local = buf[0]
            self.collective = "none"
        elif self.use_reduce_scatter:
            local = buf.new_empty(buf.shape[1])
            _reduce_scatter(local, buf.reshape(-1), self.ctx.group)
            self.collective = "reduce_scatter"
        else:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.ctx.group)
            local = buf[r]
            self.collective = "all_reduce"
        out, offset = [], 0
        for p in self.params:
            c, row, mine = self._layout(p)
            shard = local[offset : offset + mine * row].clone().view(p.to_local().shape)  # type: ignore[attr-defined]
            offset += c * row
            out.append(
                DTensor.from_local(
                    shard,
                    cast(Any, p).device_mesh,
                    cast(Any, p).placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
            )
        noisy_count = None
        if count is not None:  # float64; the count noise on rank 0 only (drawn on every rank: aligned streams)
            total = torch.tensor(
                [count + (cast(float, count_noise) if r == 0 else 0.0)],
                dtype=torch.float64,
                device=backend_device(self.ctx),
            )
            noisy_count = float(self.ctx.all_reduce(total)[0])
        self.calls += 1
        return out, noisy_count


def _reduce_scatter(out: Tensor, inp: Tensor, group) -> None:
    """Sum-reduce-scatter ``inp`` (W equal chunks) into ``out``: ``reduce_scatter_single`` where torch has it
    (the newer name), else ``reduce_scatter_tensor``."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=dist.ReduceOp.SUM, group=group)


def _has_reduce_scatter(ctx: DistributedContext) -> bool:
    """Whether the group's backend implements ``reduce_scatter_tensor`` (NCCL does; gloo is probed: one tiny
    collective on every rank)."""
    import torch.distributed as dist

    if dist.get_backend(ctx.group) != "gloo":
        return True
    try:
        out = torch.zeros(1)
        _reduce_scatter(out, torch.ones(ctx.world_size), ctx.group)
        return bool(out.item() == ctx.world_size)
    except (RuntimeError, NotImplementedError):
        return False


def capture_for(module: nn.Module, distributed, optimizer, ctx: DistributedContext, **kw) -> HookCapture:
    """``make_private``'s capture: a :class:`ShardedCapture` for ``distributed="fsdp"`` (after
    :func:`prepare_model`), else a plain :class:`~dpopt.engine.hooks.HookCapture`.

    Raises:
        ValueError: ``distributed`` other than False, True or ``"fsdp"``; a dpopt method name with
            ``"fsdp"``; what :func:`prepare_model` and :class:`ShardedCapture` refuse.
    """
    if distributed not in (False, True, "fsdp"):
        raise ValueError(
            f"distributed must be False, True (DDP-style replicas) or 'fsdp' (a fully_shard model), got {distributed!r}"
        )
    if distributed != "fsdp":
        return HookCapture(module, **kw)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            "distributed='fsdp' takes a torch.optim optimizer over the sharded parameters (e.g. "
            "torch.optim.AdamW(model.parameters())): dpopt method names keep clip geometry and "
            "state that are not sharded"
        )
    prepare_model(module, ctx)
    return ShardedCapture(module, ctx, **kw)


@torch.no_grad()
def attach(privatizer, params: Sequence[Tensor], module: nn.Module, ctx: DistributedContext) -> ShardedRelease:
    """Broadcast ``module``'s buffers from rank 0 (they are replicated) and make ``privatizer`` release the
    sharded noisy sum over every rank (:class:`ShardedRelease`; with the Privatizer's correlated-noise
    mechanism, each rank streams the noise of its own shard). Sharded parameters are not broadcast: each
    coordinate lives on one rank only.

    Raises:
        ValueError: a privatizer that already has a ``reduce`` hook.
    """
    if privatizer.reduce is not None:
        raise ValueError("this Privatizer already has a reduce hook")
    for b in module.buffers():
        ctx.broadcast(b.data)
    privatizer.reduce = ShardedRelease(params, ctx, mechanism=privatizer.mechanism)
    return privatizer.reduce


def bytes_per_step(
    params: Sequence[Tensor],
    world_size: int,
    *,
    reduce_scatter: bool = True,
    reshard_after_forward: bool = True,
    itemsize: int = 4,
) -> dict:
    """Ring-collective bytes SENT per rank per step: dpopt FSDP2 vs DDP (analytic, for the benchmark).

    FSDP2: an all-gather of the parameters in forward and (``reshard_after_forward``)
    again in backward, (W−1)/W·P each, plus dpopt's reduce-scatter (W−1)/W·P'
    (P' = padded elements; an all-reduce: twice). DDP: one all-reduce 2(W−1)/W·P.
    """
    w = int(world_size)
    p = sum(t.numel() for t in params)
    padded = sum(
        -(-(t.shape[0] if t.dim() else 1) // w) * w * (t.numel() // max(t.shape[0] if t.dim() else 1, 1))
        for t in params
    )
    gather = (w - 1) / w * p * (2 if reshard_after_forward else 1)
    reduce = (w - 1) / w * padded * (1 if reduce_scatter else 2)
    ddp = 2 * (w - 1) / w * p
    return {
        "fsdp": (gather + reduce) * itemsize,
        "ddp": ddp * itemsize,
        "ratio": (gather + reduce) / ddp if ddp else math.nan,
    }
