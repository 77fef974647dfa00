"""The CPU noise draw started early and consumed at the release (issue 23, fixed per-step cost).

:class:`dpopt.noise.CpuNormalDraw` moves WHEN the step's noise is computed (while the per-sample work
runs) and fuses the release's arithmetic into its chunks; it must not change WHAT is drawn. Every
check here is bit for bit against the one-piece formulas: :meth:`NoiseSource.normal` at the same
point of the stream, and the release round(s + σC·z) / B̄ · scale + shift written out by hand (the
sampler itself: tests/core/test_noise_ziggurat.py).
"""

import copy
import os
import pickle
import threading

import numpy as np
import pytest
import torch

import dpopt.privatizer as privatizer_module
from dpopt.engine.reference import PerSampleGrads
from dpopt.noise import NORMAL_CHUNK, CpuNormalDraw, NoiseSource
from dpopt.privatizer import Privatizer, QuantileClipping
from dpopt.types import ClipGeometry


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("n", [NORMAL_CHUNK + 1, 2 * NORMAL_CHUNK, 3 * NORMAL_CHUNK + 7, 10])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_started_draw_is_the_stream_of_normal(n, dtype, threads):
    """start_normal(n).values() == normal((n,)) at the same point of a reproducible stream (and the
    draws after it are the same too: the words were taken from the source when it started)."""
    a, b = NoiseSource("reproducible", seed=11), NoiseSource("reproducible", seed=11)
    a.normal((5,)), b.normal((5,))
    want, after = a.normal((n,), dtype=dtype), a.normal((7,), dtype=torch.float64)
    draw = b.start_normal(n)
    got_after = b.normal((7,), dtype=torch.float64)  # drawn from the source before the draw is consumed
    got = draw.values(None, dtype)
    assert got.dtype == dtype and torch.equal(got, want) and torch.equal(got_after, after)


def test_consume_gives_each_chunk_once_in_order_and_the_draw_once(threads):
    n = 2 * NORMAL_CHUNK + 5
    src = NoiseSource("reproducible", seed=2)
    want = NoiseSource("reproducible", seed=2).normal((n,), dtype=torch.float64)
    seen = []
    draw = src.start_normal(n)
    flat = draw.consume(lambda lo, hi, z: seen.append((lo, hi, z.clone())))
    seen.sort(key=lambda t: t[0])
    assert [(lo, hi) for lo, hi, _ in seen] == [
        (0, NORMAL_CHUNK),
        (NORMAL_CHUNK, 2 * NORMAL_CHUNK),
        (2 * NORMAL_CHUNK, n),
    ]
    assert torch.equal(torch.cat([z for _, _, z in seen]), want) and torch.equal(flat[:n], want)
    assert not draw.usable
    with pytest.raises(RuntimeError, match="consumed once"):
        draw.consume()


def test_a_draw_is_never_pickled_or_copied():
    draw = NoiseSource("secret").start_normal(NORMAL_CHUNK + 3)
    for how in (pickle.dumps, copy.deepcopy, copy.copy):
        with pytest.raises(TypeError, match="never copied"):
            how(draw)
    draw.consume()


def _release_by_hand(sums, z, std, bbar, scale=None, shift=None, dtype=None):
    """round_dtype(s + std·z in float64) / B̄ (in that dtype: ``dtype``, the parameters', else the sum's), then
    × scale + shift. A bf16 parameter's sum is float32 (dpopt.engine.layers.compute_dtype): rounded once to bf16."""
    out, at = [], 0
    for i, s in enumerate(sums):
        zi = z[at : at + s.numel()].view(s.shape)
        at += s.numel()
        g = (zi * std + s.double()).to(dtype or s.dtype).div_(bbar)
        if scale is not None:
            g.mul_(scale[i])
        if shift is not None:
            g.add_(shift[i])
        out.append(g)
    return out


SHAPES = [(700, 300), (300,), (5, 41), (0,), (NORMAL_CHUNK // 3 + 1,), (3,)]  # chunk boundaries inside params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("geometry", [False, True])
@pytest.mark.parametrize("early", [True, False], ids=["drawn at begin", "drawn at release"])
def test_release_equals_the_formula_bit_for_bit(dtype, geometry, early, threads):
    """One example per sum (its clipped sum is itself, C large); the release must equal the formula
    with z = the source's float64 draw of all parameters in order — whether privatize() started it
    at begin() (early) or release() drew it (begin/accumulate/release called by hand)."""
    g = torch.Generator().manual_seed(4)
    sums = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
    sigma, clip, bbar = 0.9, 1e6, 3.0
    geo = None
    if geometry:
        geo = ClipGeometry(
            tuple(torch.randn(s, generator=g).to(dtype) * 0.1 for s in SHAPES),
            tuple((torch.rand(s, generator=g) + 0.5).to(dtype) for s in SHAPES),
        )
        w = [(s - m) / b for s, m, b in zip(sums, geo.shift, geo.scale)]  # the geometry's own coordinates
    else:
        w = sums
    priv = Privatizer(sigma, clip, bbar, 0.1, noise=NoiseSource("reproducible", seed=9))
    src = PerSampleGrads([t.unsqueeze(0) for t in sums])
    if early:
        rel = priv.privatize(src, geo, params_like=sums)
    else:
        priv.begin(geo)
        priv.accumulate(src)
        rel = priv.release()
    z = NoiseSource("reproducible", seed=9).normal((sum(s.numel() for s in sums),), dtype=torch.float64)
    clipped = [
        t.clone()
        for t in PerSampleGrads([t.unsqueeze(0) for t in sums]).weighted_sum(
            torch.ones(1, 1, dtype=torch.float64 if dtype == torch.float64 else torch.float32),
            geo or ClipGeometry(),
            [0] * len(sums),
        )
    ]
    assert all(torch.allclose(c.double(), x.double(), rtol=1e-2, atol=1e-2) for c, x in zip(clipped, w))
    want = _release_by_hand(
        clipped, z, sigma * clip, bbar, geo.scale if geo else None, geo.shift if geo else None, dtype=dtype
    )
    assert all(r.dtype == dtype and r.is_contiguous() and torch.equal(r, x) for r, x in zip(rel.grads, want))


def test_early_draw_keeps_the_stream_order_with_quantile_clipping():
    """Gradient noise, then the count noise, then the next step: the stream of three releases with
    the draw started at begin() equals the one drawn at release() (begin/accumulate/release by hand)."""

    def run(early):
        g = torch.Generator().manual_seed(1)
        priv = Privatizer(1.1, 0.5, 4.0, 0.1, quantile=QuantileClipping(1.0), noise=NoiseSource("reproducible", seed=3))
        out = []
        for _ in range(3):
            grads = [torch.randn(6, *s, generator=g) for s in SHAPES]
            if early:
                rel = priv.privatize(PerSampleGrads(grads), params_like=[t[0] for t in grads])
            else:
                priv.begin()
                priv.accumulate(PerSampleGrads(grads))
                rel = priv.release()
            out += list(rel.grads) + [torch.tensor(priv.bounds)]
        return out

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def test_a_failed_step_drops_its_early_draw_and_the_next_release_draws_anew():
    priv = Privatizer(1.0, 1.0, 2.0, 0.1)  # secret: begin() starts a draw of the last release's size

    class Broken:
        num_params = 1

        def sq_norms(self, *args):
            raise ValueError("boom")

    ones = [torch.ones(NORMAL_CHUNK + 9)]
    priv.privatize(PerSampleGrads([ones[0].unsqueeze(0)]), params_like=ones)
    with pytest.raises(ValueError, match="boom"):
        priv.privatize(Broken(), params_like=ones)
    assert priv._pending is None and len(priv.ledger) == 1
    priv.begin()
    assert priv._pending is not None and priv._pending.n == NORMAL_CHUNK + 9  # secret: pre-drawn at begin()
    priv.accumulate(PerSampleGrads([torch.ones(1, 5)]))  # another size: the early draw is dropped
    rel = priv.release()
    assert rel.grads[0].shape == (5,) and len(priv.ledger) == 2 and priv._pending is None


def test_copies_of_a_privatizer_mid_step_carry_no_draw():
    """A copy taken between begin() and release() must not carry the draw (it would replay it)."""
    x = torch.zeros(1, NORMAL_CHUNK + 1)
    for how in (copy.deepcopy, lambda p: pickle.loads(pickle.dumps(p))):
        priv = Privatizer(1.0, 1.0, 2.0, 0.1)
        priv.privatize(PerSampleGrads([x]), params_like=[x[0]])
        priv.begin()
        assert isinstance(priv._pending, CpuNormalDraw)
        twin = how(priv)
        assert twin._pending is None
        for p in (priv, twin):
            p.accumulate(PerSampleGrads([x]))
        a, b = priv.release().grads[0], twin.release().grads[0]
        assert not torch.equal(a, b)  # secret: independent draws (equal with probability ~0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_draw_started_before_a_fork_is_refused_in_the_child():
    src = NoiseSource("secret")
    draw = src.start_normal(NORMAL_CHUNK + 1)
    draw.consume()  # the parent's own draw is consumed; another one is in flight at the fork
    draw = src.start_normal(NORMAL_CHUNK + 1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, b"1" if not draw.usable else b"0")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert draw.usable and draw.consume().numel() >= NORMAL_CHUNK + 1


def test_start_normal_refuses_a_negative_count():
    with pytest.raises(ValueError, match=">= 0"):
        NoiseSource("secret").start_normal(-1)
    assert NoiseSource("secure").start_normal(3).values().shape == (3,)


def test_release_of_sums_that_require_grad_has_no_autograd_history(threads):
    """A release is public data and never carries autograd history, whatever its sums were (the
    prefetched draw is computed in worker threads, where grad mode is on by default)."""
    s = torch.randn(1, NORMAL_CHUNK + 11, requires_grad=True)
    priv = Privatizer(1.0, 1e6, 2.0, 0.1, noise=NoiseSource("reproducible", seed=1))
    rel = priv.privatize(PerSampleGrads([s]), params_like=[s[0]])
    z = NoiseSource("reproducible", seed=1).normal((NORMAL_CHUNK + 11,), dtype=torch.float64)
    assert rel.grads[0].grad_fn is None and not rel.grads[0].requires_grad
    assert torch.equal(rel.grads[0], (z * 1e6 + s[0].detach().double()).float().div_(2.0))


class _Recorder:
    """Wraps dpopt.noise.ziggurat_normals (a streamed draw's chunk): records the SFC64 state every chunk is
    computed from, and can fail the ``fail_at``-th call (a chunk that raises mid-draw)."""

    def __init__(self, real, fail_at=None):
        self.real, self.fail_at, self.states, self.calls = real, fail_at, [], 0

    def __call__(self, state, out):
        self.states.append(bytes(state))
        if self.fail_at is not None and len(self.states) == self.fail_at:
            raise MemoryError("chunk failed")
        return self.real(state, out)


class _JobRecorder(_Recorder):
    """Wraps dpopt._native.ziggurat_fill_chunks (an early draw's chunks, claimed by the calling threads): records
    the 24-byte SFC64 states of a job's chunks when its first call starts (none claimed yet), and can fail the
    ``fail_at``-th call."""

    def __init__(self, real, fail_at=None):
        super().__init__(real, fail_at)
        self.jobs: list = []
        self.lock = threading.Lock()

    def __call__(self, out, states, next_, *rest):
        with self.lock:  # the worker threads and the consumer call it concurrently
            self.calls += 1
            if not any(states is job for job in self.jobs):  # a job's first call: no chunk claimed yet
                self.jobs.append(states)
                self.states += [row.astype("<u8").tobytes() for row in states[:, :3]]
        if self.fail_at is not None and self.calls == self.fail_at:
            raise MemoryError("chunk failed")
        return self.real(out, states, next_, *rest)


@pytest.mark.parametrize("stream", [False, True], ids=["early", "streamed"])
def test_every_chunk_has_its_own_state_and_a_failed_draw_is_never_reused(stream, threads, monkeypatch):
    """Chunk i is computed once, from the i-th of the draw's own states (streamed: no reuse of index 0 or of the
    scratch's previous chunk; early: chunk i is bit for bit ziggurat_normals of the i-th state), all distinct; a
    draw whose chunk failed cannot be consumed again, and the Privatizer's retry draws states it never used
    (secret: fresh os.urandom; equal with probability 2^-192)."""
    import dpopt.noise as noise_mod

    reference = noise_mod.ziggurat_normals
    if stream:
        rec = _Recorder(noise_mod.ziggurat_normals)
        monkeypatch.setattr(noise_mod, "ziggurat_normals", rec)
    else:
        rec = _JobRecorder(noise_mod.native.ziggurat_fill_chunks)
        monkeypatch.setattr(noise_mod.native, "ziggurat_fill_chunks", rec)
    n = 3 * NORMAL_CHUNK + 7
    draw = NoiseSource("secret").start_normal(n, stream=stream)
    want = list(draw._states)
    assert len(want) == 4 and len(set(want)) == 4 and all(len(s) == 24 for s in want)
    parts = {}
    draw.consume(lambda lo, hi, z: parts.__setitem__(lo, z.clone()))
    assert sorted(rec.states) == sorted(want) and len(rec.states) == 4  # each state once, none repeated
    assert draw._states == []  # not kept past their use
    assert sorted(parts) == [0, NORMAL_CHUNK, 2 * NORMAL_CHUNK, 3 * NORMAL_CHUNK]
    assert len({parts[k][:7].numpy().tobytes() for k in parts}) == 4
    for i, lo in enumerate(sorted(parts)):  # chunk i is the i-th state's stream (body and tail), computed once
        assert np.array_equal(parts[lo].numpy(), reference(want[i], np.empty(parts[lo].numel())))

    rec.states.clear()
    rec.calls = 0
    rec.fail_at = 2 if stream else 1
    made: list = []
    with pytest.raises(MemoryError, match="chunk failed"):  # one thread, early: raised by start_normal itself
        made.append(NoiseSource("secret").start_normal(n, stream=stream))
        made[0].consume(lambda lo, hi, z: None)
    if made:
        with pytest.raises(RuntimeError, match="consumed once"):
            made[0].consume(lambda lo, hi, z: None)
        if not stream:  # the failed early draw keeps no chunk state: the job's states wiped, the seeds dropped
            assert made[0]._job is None and made[0]._states == [] and not made[0]._words.any()
    rec.states.clear()
    rec.calls = 0
    priv = Privatizer(1.0, 1.0, 2.0, 0.1)
    x = torch.zeros(1, n)
    if stream:
        monkeypatch.setattr(privatizer_module, "EARLY_DRAW_MAX", NORMAL_CHUNK)
    with pytest.raises(MemoryError, match="chunk failed"):
        priv.privatize(PerSampleGrads([x]), params_like=[x[0]])
    failed = set(rec.states)
    # the draw failed in release(), after its entry was written ahead (kept for the retry); one thread, early: it
    # failed when privatize() started it, before release()
    assert priv._pending is None and len(priv.ledger) == (0 if threads == 1 and not stream else 1)
    rec.fail_at = None
    rec.states.clear()
    rel = priv.release(params_like=[x[0]])  # the step is still open: the release is retried
    assert len(priv.ledger) == 1 and rel.grads[0].shape == (n,)
    assert len(rec.states) == 4 and len(set(rec.states)) == 4 and not (set(rec.states) & failed)


@pytest.mark.parametrize("cap", [0, 3])
def test_a_chunk_with_more_tail_positions_than_recorded_is_redrawn_whole(cap, threads, monkeypatch):
    """An early draw records at most _TAIL_CAP tail positions per chunk (≈ 34 expected of 1024); a chunk with more is
    computed again by ziggurat_normals from its state: the values are still the stream's (the streamed draw's)."""
    import dpopt.noise as noise_mod

    monkeypatch.setattr(noise_mod, "_TAIL_CAP", cap)
    n = 3 * NORMAL_CHUNK + 5
    want = NoiseSource("reproducible", seed=3).start_normal(n, stream=True).values()
    draw = NoiseSource("reproducible", seed=3).start_normal(n)
    got = draw.values()
    assert torch.equal(got, want) and bool(torch.isfinite(got).all())
    assert float(got.abs().max()) > noise_mod.ZIGGURAT_R  # tail values were drawn (≈ 100 of them)


def test_a_draw_whose_workers_never_start_is_computed_by_the_consumer(two_threads, held_noise_pool):
    """The consumer claims every chunk no worker has started; a worker task still queued (its thread busy) is
    cancelled, not waited for: the values are the stream's, and consume() returns while the worker stays held."""
    n = 3 * NORMAL_CHUNK + 9
    want = NoiseSource("reproducible", seed=8).start_normal(n, stream=True).values()
    src = NoiseSource("reproducible", seed=8)
    gate, busy = held_noise_pool(src)
    draw = src.start_normal(n, defer=False)
    assert len(draw._futures) == 1  # threads − 1 workers
    got = draw.values()
    assert not busy.done() and draw._futures == []
    gate.set()
    assert torch.equal(got, want)


@pytest.mark.parametrize("when", ["now", "start", "consume", "auto-spare", "auto-none"])
def test_when_the_workers_start_changes_no_value(two_threads, monkeypatch, when):
    """``defer`` moves only the time of the chunks: a draw whose workers start at once, at ``start()`` (called
    twice: the second a no-op), or only at ``consume()`` holds the stream's values (the streamed draw, another
    path through the same chunk states); with ``defer=None`` the workers start at once exactly where
    ``sched_getaffinity`` shows more CPUs than torch threads."""
    import dpopt.noise as noise_mod

    n = 4 * NORMAL_CHUNK + 17
    want = NoiseSource("reproducible", seed=21).start_normal(n, stream=True).values()
    src = NoiseSource("reproducible", seed=21)
    if when.startswith("auto"):
        cpus = {0, 1, 2} if when == "auto-spare" else {0, 1}
        monkeypatch.setattr(noise_mod.os, "sched_getaffinity", lambda pid: cpus, raising=False)
        draw = src.start_normal(n)
        assert len(draw._futures) == (1 if when == "auto-spare" else 0)
    else:
        draw = src.start_normal(n, defer=when != "now")
        assert len(draw._futures) == (1 if when == "now" else 0)
        if when == "start":
            draw.start()
            first = list(draw._futures)
            assert len(first) == 1
            draw.start()
            assert draw._futures == first  # no second set of workers
    got = draw.values()
    assert draw._futures == [] and torch.equal(got, want)
    with pytest.raises(RuntimeError):
        draw.consume()
    draw.start()  # after consume: nothing to start
    assert draw._futures == []


def test_spare_core(monkeypatch):
    """spare_core: more CPUs in the affinity mask than threads; os.cpu_count() where there is no mask."""
    import dpopt.noise as noise_mod

    monkeypatch.setattr(noise_mod.os, "sched_getaffinity", lambda pid: {0, 1, 5}, raising=False)
    assert noise_mod.spare_core(2) and not noise_mod.spare_core(3)
    monkeypatch.delattr(noise_mod.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(noise_mod.os, "cpu_count", lambda: 4)
    assert noise_mod.spare_core(3) and not noise_mod.spare_core(4)
