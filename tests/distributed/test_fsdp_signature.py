"""FSDP2 (2 gloo ranks): the synchronised first-batch check re-runs on a new signature, not only a new mode.

``ShardedCapture`` runs the check on every rank at once (the same FSDP collectives). It used to key that check
on the train/eval flags alone (``ModeCheck.needed(p.modes)``), so what the one-process doors re-check — a module
attribute switched after step 1 (``model[1].mix = True``: the forward now mixes the examples), a user's hook
added after the check, a batch in a larger size class — was released unchecked: with σ = 0 and lr = 0,
removing one example from rank 0's batch (12 → 11 rows, one size class) moved the released clipped sum by
more than C (numbers below). Now each rank decides locally on its
own full signature (:func:`dpopt.engine.check.signature`: modes, module state with the user's hooks, size
class; it holds this process's ``id()``s and this rank's batch size, so it is never compared across ranks),
the ranks agree with one all-reduce (any rank's new signature: all check together), and each marks its own
signature checked after the check passed. Each mixing change is refused on both ranks, nothing is released;
a steady loop is checked once.

Numbers (2 gloo ranks, 2-vCPU Xeon, 2026-12-07 11:41 UTC), before the fix, with ``h + 4 · mean(h)`` over the
rank's batch: attribute 2.27 C, hook 2.27 C, size class (mixing only above 16 rows per rank; 24 → 23 rows)
1.08 C, each step released with no further check (1 check in 5 steps); the steady loop's ×3 hook was not
checked either (counts [1, 1, 1]). After: every case refused on both ranks (3 checks: the two refused steps),
counts [1, 2, 2].

A rank with fewer than 2 examples (the ``small_*`` cases): ``ShardedCapture.collect`` runs the synchronised check when some rank's signature is new. It used to skip the
check on EVERY rank when some rank had fewer than 2 examples (Poisson sampling gives a rank 0 or 1 example
now and then), and every rank released its step: a rank with 12 examples and a new signature (here
``model[1].mix = True``: the forward adds 4 · mean(h) over the rank's batch) released an unchecked step whose
forward mixed its examples. Now every rank with ≥ 2 examples runs the check whenever some such rank's
signature is new; a rank with 0 or 1 examples takes part in its collectives (the all-gathers, the refusal's
agreement) without passes and without marking its signature, as the one-process engine skips a batch of 1
(it cannot mix; its next batch of ≥ 2 is checked).

Numbers (2 gloo ranks, 2-vCPU Xeon, load 4.4, 2026-12-07 11:58 UTC; σ = 0, lr = 0, C = 0.05; rank 0: 12 rows,
then 11 with its example 0 removed; rank 1: 1 row, or 0), before the fix: both steps released on both ranks with
no check (1 check in 5 steps), removing rank 0's example moved the released sum by 2.2735 C (1 row and 0 rows
alike). After: both steps refused on both ranks (rank 0: "do not match single-example autograd", 2 more checks;
rank 1: "another rank", no passes), nothing released; the steady loop's check counts are as asserted below.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from gloo_ranks import gloo_group, progress, spawn_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.engine import hooks as hooks_mod

pytestmark = pytest.mark.slow  # one spawn of 2 ranks (~15-40 s on a loaded 2-core machine)

C = 0.05  # below every per-example norm here: every example is clipped
N = 12  # rows per rank; 11 (one removed) is the same size class (8-15)
MIX = 4.0  # the mixing term's weight: h + MIX · mean(h) over the rank's batch


class _Switch(nn.Module):
    """Identity, or (``mix`` set, or more than ``above`` rows) adds the batch mean: mixes the examples."""

    def __init__(self, above: int = 10**9):
        super().__init__()
        self.mix, self.above = False, above

    def forward(self, h):
        return h + MIX * h.mean(0, keepdim=True) if self.mix or h.shape[0] > self.above else h


def _mix_hook(m, args, out):
    return out + MIX * out.mean(0, keepdim=True)


def _setup(above: int = 10**9):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same initialisation on both ranks
    m = nn.Sequential(nn.Linear(4, 6), _Switch(above), nn.Tanh(), nn.Linear(6, 3))
    fully_shard(m[0])
    fully_shard(m[3])
    fully_shard(m)
    engine = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=m,
            optimizer=torch.optim.SGD(m.parameters(), lr=0.0),
            data_loader=DataLoader(TensorDataset(torch.zeros(64, 4), torch.zeros(64, dtype=torch.long)), 64),
            noise_multiplier=0.0,
            max_grad_norm=C,
            distributed="fsdp",
        )
    opt.handout = loader  # q = 1: every step's batch holds 32 rows per rank (_step trains on its own rows)
    return m, engine, model, opt


def _batch(rank: int, n: int):
    g = torch.Generator().manual_seed(11 + rank)  # each rank its own examples
    return torch.randn(n, 4, generator=g) * 2, torch.randint(0, 3, (n,), generator=g)


def _step(model, opt, x, y):
    """One step on ``x, y``; the released clipped sum (gradient × E[B], gathered), or the refusal's text.

    The step takes a batch of make_private's loader (q = 1: its release boundary, 32 rows per rank) and
    trains on the test's own rows instead (public test data, ≤ 24 rows; the same rows with one removed:
    what the sensitivity bound is about).
    """
    next(iter(opt.handout))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    try:
        opt.step()
    except ValueError as exc:
        opt.zero_grad()
        return f"refused: {exc}"
    return torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()]) * opt.expected_batch_size


def _with_and_without_one(rank: int, model, opt, x, y):
    """The step on the rank's batch, then on it with rank 0's example 0 removed (each released sum or refusal)."""
    full = _step(model, opt, x, y)
    keep = torch.arange(len(y)) != 0 if rank == 0 else torch.ones(len(y), dtype=torch.bool)
    return full, _step(model, opt, x[keep], y[keep])


def _outcome(before: tuple, checks: list, engine, full, less) -> dict:
    """What a case reports: checks and releases before/after, each step's verdict, the move over C (if both released)."""
    moved = (
        float((full - less).norm()) / C if isinstance(full, torch.Tensor) and isinstance(less, torch.Tensor) else None
    )
    return {
        "checks_before": before[0],
        "released_before": before[1],
        "checks_after": len(checks),
        "released_after": len(engine.ledger),
        "full": full if isinstance(full, str) else "released",
        "less": less if isinstance(less, str) else "released",
        "moved_over_c": moved,
    }


def _case(rank: int, change: str, checks: list) -> dict:
    """3 steady steps, then ``change``; then the step with the full batch and with rank 0's example 0 removed."""
    checks.clear()
    m, engine, model, opt = _setup(above=16 if change == "size" else 10**9)
    x, y = _batch(rank, 2 * N if change == "size" else N)
    x0, y0 = (x[:N], y[:N]) if change == "size" else (x, y)
    for _ in range(3):
        _step(model, opt, x0, y0)
    before = (len(checks), len(engine.ledger))
    handle = None
    if change == "attr":
        m[1].mix = True
    elif change == "hook":
        handle = m[0].register_forward_hook(_mix_hook)
    full, less = _with_and_without_one(rank, model, opt, x, y)
    if handle is not None:
        handle.remove()
    return _outcome(before, checks, engine, full, less)


def _steady(checks: list) -> dict:
    """8 equal steps, a new hook (per example: ×3) for 3 steps, the hook removed for 2: checks counted."""
    m, engine, model, opt = _setup()
    x, y = _batch(0, N)
    counts = []
    for _ in range(8):
        _step(model, opt, x, y)
    counts.append(len(checks))
    h = m[0].register_forward_hook(lambda mod, a, o: 3 * o)
    for _ in range(3):
        _step(model, opt, x, y)
    counts.append(len(checks))
    h.remove()
    for _ in range(2):
        _step(model, opt, x, y)
    counts.append(len(checks))
    return {"counts": counts, "released": len(engine.ledger)}


def _small_case(rank: int, small: int, checks: list) -> dict:
    """3 steps of 12 rows on both ranks; ``mix`` switched on; rank 1 gets ``small`` rows, rank 0 12 then 11."""
    checks.clear()
    m, engine, model, opt = _setup()
    x, y = _batch(rank, N)
    for _ in range(3):
        _step(model, opt, x, y)
    before = (len(checks), len(engine.ledger))
    m[1].mix = True
    if rank == 1:
        x, y = x[:small], y[:small]
    full, less = _with_and_without_one(rank, model, opt, x, y)
    return _outcome(before, checks, engine, full, less)


def _small_steady(rank: int, checks: list) -> dict:
    """Steps with rank 1's batch of 1 in between (no new signature): the check count after each phase."""
    m, engine, model, opt = _setup()
    x, y = _batch(rank, N)
    counts = []
    for _ in range(4):
        _step(model, opt, x, y)
    counts.append(len(checks))  # 1: the first step
    for _ in range(2):  # rank 1 small, nobody's signature new (rank 1's small size class: not checked, as alone)
        _step(model, opt, x[:1] if rank == 1 else x, y[:1] if rank == 1 else y)
    counts.append(len(checks))
    for _ in range(3):
        _step(model, opt, x, y)
    counts.append(len(checks))
    m[0].register_forward_hook(lambda mod, a, o: 3 * o)  # per example: a new signature that passes the check
    _step(model, opt, x[:1] if rank == 1 else x, y[:1] if rank == 1 else y)
    counts.append(len(checks))  # rank 0 checked it (rank 1, with 1 row, took part without passes)
    for _ in range(3):
        _step(model, opt, x, y)
    counts.append(len(checks))  # rank 1's 12 rows under the hook: new on rank 1, checked once (both ranks)
    return {"counts": counts, "released": len(engine.ledger)}


def _worker(rank: int, world: int, tmp: str) -> None:
    checks: list = []
    real = hooks_mod.HookCapture._verify

    def counting(self, p, key=None, defer=False):  # FSDP's synchronised check calls HookCapture._verify directly
        checks.append(1)
        return real(self, p, key, defer)

    hooks_mod.HookCapture._verify = counting
    with gloo_group(rank, world, tmp):
        out = {}
        for change in ("attr", "hook", "size"):
            out[change] = _case(rank, change, checks)
            progress(tmp, rank, change)
        checks.clear()
        out["steady"] = _steady(checks)
        progress(tmp, rank, "steady")
        for small in (1, 0):
            out[f"small_{small}"] = _small_case(rank, small, checks)
            progress(tmp, rank, f"small={small}")
        checks.clear()
        out["small_steady"] = _small_steady(rank, checks)
        progress(tmp, rank, "small_steady")
        torch.save(out, f"{tmp}/rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp-signature")
    spawn_ranks(_worker, tmp, deadline_s=420, stall_s=120)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("change", ["attr", "hook", "size"])
def test_a_mixing_change_after_the_check_is_rechecked_and_refused_on_every_rank(runs, change):
    """Before: released unchecked, moved by 1.08-2.27 C (> C); now refused on both ranks, nothing released."""
    for r in runs:
        c = r[change]
        assert c["released_before"] == 3 and c["checks_before"] == 1
        assert c["checks_after"] > c["checks_before"], c  # the check ran again
        assert c["full"].startswith("refused") and c["less"].startswith("refused"), c
        assert ("do not match single-example autograd" in c["full"]) or ("another rank" in c["full"]), c
        assert c["released_after"] == 3  # nothing released
        assert c["moved_over_c"] is None


def test_steady_loop_checked_once_and_each_new_signature_once(runs):
    for r in runs:
        assert r["steady"]["counts"] == [1, 2, 2]  # 8 steps: 1; a ×3 hook: 1 more (agrees); removed: checked before
        assert r["steady"]["released"] == 13


@pytest.mark.parametrize("small", [1, 0])
def test_a_small_rank_does_not_release_an_unchecked_mixing_step(runs, small):
    """Before: both steps released unchecked on both ranks (rank 1 with ``small`` rows), removing rank 0's
    example 0 moved the released sum by ≈ 2.3 C (> C); now rank 0 runs the check and both ranks refuse."""
    for r in runs:
        c = r[f"small_{small}"]
        assert c["released_before"] == 3 and c["checks_before"] == 1, c
        assert c["full"].startswith("refused") and c["less"].startswith("refused"), c
        assert ("do not match single-example autograd" in c["full"]) or ("another rank" in c["full"]), c
        assert c["released_after"] == 3, c  # nothing released
        assert c["moved_over_c"] is None
    assert runs[0][f"small_{small}"]["checks_after"] == 3  # rank 0 ran the check for both refused steps
    assert "do not match single-example autograd" in runs[0][f"small_{small}"]["full"]
    assert "another rank" in runs[1][f"small_{small}"]["full"]  # rank 1 (no passes on ≤ 1 row) refused with it
    assert runs[1][f"small_{small}"]["checks_after"] == 1


def test_steady_loop_checked_once_with_a_small_rank_between(runs):
    """The first step's check only: rank 1's batches of 1 (unchecked, as alone) do not check anything again.
    Rank 1's small size class stays unmarked (the one-process rule), but its 12-row class was checked."""
    assert runs[0]["small_steady"]["counts"] == [1, 1, 1, 2, 3], runs[0]["small_steady"]
    assert runs[1]["small_steady"]["counts"] == [1, 1, 1, 1, 2], runs[1]["small_steady"]
    for r in runs:
        assert r["small_steady"]["released"] == 13  # the per-example hook passes: every step released
