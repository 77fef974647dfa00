"""A core lent to the step's noise draw (dpopt.core_loan, issue 34): the draw's pause changes no value, the
loan lowers torch's threads only between the forward and the weighted sums and only for small per-example
work, and it is always given back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import dpopt.core_loan as core_loan
import dpopt.engine.fast as fast
import dpopt.engine.layers as layers
import dpopt.noise as noise_mod
from dpopt.engine import iter_per_sample_sources
from dpopt.kernels import native
from dpopt.methods import make_optimizer
from dpopt.noise import NORMAL_CHUNK, NoiseSource


@pytest.fixture
def no_spare_core(monkeypatch):
    """Two CPUs for two torch threads: an early draw's workers wait (CpuNormalDraw, defer=None)."""
    monkeypatch.setattr(noise_mod.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)


def test_the_kernel_claims_nothing_while_paused(two_threads):
    """ziggurat_fill_chunks with next[1] != 0 returns 0 and leaves the claim counter; with next[1] = 0 it fills
    every chunk left, each once."""
    draw = NoiseSource("reproducible", seed=3).start_normal(3 * NORMAL_CHUNK + 5, defer=True)
    job = draw._job
    assert job is not None and job[2].shape == (2,)
    job[2][1] = 1
    assert native.ziggurat_fill_chunks(*job) == 0 and job[2][0] == 0
    job[2][1] = 0
    assert native.ziggurat_fill_chunks(*job) == 4 and native.ziggurat_fill_chunks(*job) == 0


@pytest.mark.parametrize("when", ["at-once", "after-the-worker", "twice"])
def test_a_paused_and_resumed_draw_holds_the_streams_values(two_threads, held_noise_pool, when):
    """A draw started with one worker and paused (before the worker ran; after the worker finished every chunk's
    body; or paused, resumed and paused again before any worker ran), then consumed
    (the consumer and the resumed workers take the rest), holds exactly the values of the streamed draw of the
    same source: only when the chunks are computed moved. The worker's thread is held by a gate where the test
    needs it not to have run yet."""
    n = 5 * NORMAL_CHUNK + 11
    want = NoiseSource("reproducible", seed=12).start_normal(n, stream=True).values()
    src = NoiseSource("reproducible", seed=12)
    gate, _ = held_noise_pool(src)
    if when == "after-the-worker":
        gate.set()
    draw = src.start_normal(n, defer=True)
    assert draw.waiting and draw._futures == []
    job = draw._job
    assert job is not None
    draw.start(workers=1)
    assert not draw.waiting and len(draw._futures) == 1
    if when == "after-the-worker":
        draw._futures[0].result()  # the worker filled every chunk's body (the tails wait for the consumer)
        assert job[2][0] > 5
    draw.pause()
    assert draw.waiting and job[2][1] == 1
    if when == "twice":
        draw.start(workers=1)
        assert job[2][1] == 0 and len(draw._futures) == 2
        draw.pause()
    if when != "after-the-worker":
        gate.set()
        for fut in list(draw._futures):
            fut.result()  # the paused workers claimed nothing
        assert job[2][0] == 0
    got = draw.values()
    assert torch.equal(got, want)
    assert not draw.waiting and draw._futures == [] and draw._job is None


@pytest.mark.parametrize("claimed, helpers", [(0, 1), (3, 1), (4, 0), (5, 0), (9, 0)])
def test_the_consumer_wakes_a_worker_only_for_a_second_unclaimed_chunk(two_threads, claimed, helpers):
    """_helpers: one worker per unclaimed chunk beyond the one the consumer claims itself, at most threads − 1
    (here 1): a draw of 5 chunks with 0 or 3 claimed wakes one, with 4 or more claimed (one or none left) none.
    The claim counter is set by hand on a draw that is then dropped unconsumed (its values are never read)."""
    draw = NoiseSource("reproducible", seed=4).start_normal(4 * NORMAL_CHUNK + 3, defer=True)
    assert draw._k == 5 and draw._job is not None
    draw._job[2][0] = claimed
    assert draw._helpers() == helpers


def test_a_draw_its_worker_finished_is_consumed_without_waking_one(two_threads, monkeypatch):
    """A lent worker computed every chunk, then the loan paused it: consume() resumes the draw for its own claims
    only (no worker task submitted: one woken for nothing is a wait for its wake-up) and the values are the
    stream's. A draw nobody started is consumed with one worker beside the consumer (threads − 1)."""
    n = 3 * NORMAL_CHUNK + 21
    want = NoiseSource("reproducible", seed=6).start_normal(n, stream=True).values()
    src = NoiseSource("reproducible", seed=6)
    draw = src.start_normal(n, defer=True)
    draw.start(workers=1)
    draw._futures[0].result()  # every chunk claimed and filled
    draw.pause()
    assert draw.waiting
    submitted: list = []

    def spy(source):
        pool = source._thread_pool()
        real_submit = pool.submit
        monkeypatch.setattr(pool, "submit", lambda *a, **k: submitted.append(a) or real_submit(*a, **k))

    spy(src)
    assert torch.equal(draw.values(), want) and submitted == []
    fresh = NoiseSource("reproducible", seed=6)
    spy(fresh)
    assert torch.equal(fresh.start_normal(n, defer=True).values(), want) and len(submitted) == 1


def test_a_paused_draw_with_one_chunk_left_is_filled_by_the_consumer(two_threads):
    """The loan's case: a worker filled every chunk but the last, then the draw was paused. consume() wakes no
    worker (_helpers() == 0) but resumes the claims: the consumer fills the last chunk itself and the values are
    the stream's (a resume that left the pause flag set would release that chunk's uninitialised memory). The
    "worker" here is the same kernel run on the job's leading k − 1 rows with a counter of its own."""
    n = 3 * NORMAL_CHUNK + 7
    want = NoiseSource("reproducible", seed=8).start_normal(n, stream=True).values()
    draw = NoiseSource("reproducible", seed=8).start_normal(n, defer=True)
    job, k = draw._job, draw._k
    assert job is not None and k == 4
    lead = list(job)
    lead[0] = job[0][: (k - 1) * NORMAL_CHUNK]
    lead[1], lead[8], lead[10] = job[1][: k - 1], job[8][: k - 1], job[10][: k - 1]
    lead[2] = np.zeros(2, np.int64)
    assert native.ziggurat_fill_chunks(*lead) == k - 1
    job[2][0], job[2][1] = k - 1, 1  # k − 1 chunks claimed and filled, the draw paused
    assert draw.waiting and draw._helpers() == 0
    assert torch.equal(draw.values(), want)


def test_pause_and_start_are_no_ops_where_nothing_waits_or_runs(two_threads):
    """pause() before any worker started, and start()/pause() on a consumed or streamed draw, do nothing."""
    draw = NoiseSource("reproducible", seed=1).start_normal(2 * NORMAL_CHUNK, defer=True)
    draw.pause()
    assert draw.waiting and draw._futures == []
    draw.values()
    draw.start()
    draw.pause()
    assert draw._futures == [] and not draw.waiting
    streamed = NoiseSource("reproducible", seed=1).start_normal(2 * NORMAL_CHUNK, stream=True)
    assert not streamed.waiting


class _Draw:
    """A stand-in draw that records start/pause."""

    def __init__(self, n=1000, waiting=True):
        self.n, self.waiting, self.calls = n, waiting, []

    def start(self, workers=None):
        self.calls.append(("start", workers))
        self.waiting = False

    def pause(self):
        self.calls.append(("pause",))
        self.waiting = True


def test_a_loan_lowers_torchs_threads_once_and_gives_them_back(two_threads):
    """lend: one worker started, torch at one thread fewer, a second lend changes nothing; wind_down: the draw
    paused, the threads still lowered; reclaim: the draw paused (again: a no-op on a real draw) and the threads
    restored; a second reclaim, a lend after it and a wind_down with nothing lent change nothing."""
    d = _Draw(n=1000)
    loan = core_loan.CoreLoan(d)
    assert loan.lend(16 * 1000)
    assert torch.get_num_threads() == 1 and d.calls == [("start", 1)]
    assert loan.lend(0) and d.calls == [("start", 1)]
    loan.wind_down()  # the worker pauses, torch's threads stay lowered
    assert torch.get_num_threads() == 1 and d.calls == [("start", 1), ("pause",)]
    loan.reclaim()
    assert torch.get_num_threads() == 2 and d.calls == [("start", 1), ("pause",), ("pause",)]
    loan.reclaim()
    assert torch.get_num_threads() == 2 and len(d.calls) == 3
    assert not loan.lend(0) and torch.get_num_threads() == 2 and len(d.calls) == 3  # one loan per step
    loan.wind_down()
    assert len(d.calls) == 3  # nothing lent: a no-op


@pytest.mark.parametrize(
    "macs, waiting, threads",
    [(None, True, 2), (16 * 1000 + 1, True, 2), (0, False, 2), (0, True, 1)],
    ids=["not-rows", "too-much-work", "draw-running", "one-thread"],
)
def test_no_loan_where_it_would_not_help(macs, waiting, threads):
    """No loan for work not known to be small (None), above LOAN_MACS_PER_NORMAL per normal, a draw whose
    workers already run (a spare core), or one torch thread."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        d = _Draw(n=1000, waiting=waiting)
        assert not core_loan.CoreLoan(d).lend(macs)
        assert torch.get_num_threads() == threads and d.calls == []
    finally:
        torch.set_num_threads(old)


def test_a_step_loan_is_given_back_on_an_error_and_is_not_seen_outside(two_threads):
    d = _Draw(n=1000)
    with pytest.raises(KeyError):
        with core_loan.step_loan(d):
            assert core_loan.lend(0)
            assert torch.get_num_threads() == 1
            raise KeyError("the step failed")
    assert torch.get_num_threads() == 2 and d.calls[-1] == ("pause",)
    assert not core_loan.lend(0)  # outside a step: no loan
    core_loan.reclaim()  # a no-op
    with core_loan.step_loan(None):
        assert not core_loan.lend(0)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(400, 2000), nn.ReLU(), nn.Linear(2000, 10))


def _steps(model, seed, seen, method="dp-sgd", physical=None):
    """Two ``method`` steps of ``model`` on a fixed batch of 32 (micro-batches of ``physical``) with reproducible
    noise (the first runs the first-batch check; ``seen`` is cleared before the second); the parameters after."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 400, generator=g), torch.randint(0, 10, (32,), generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(
        method,
        params,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=32.0,
        sample_rate=0.01,
        lr=0.1,
        generator=torch.Generator().manual_seed(seed),
    )
    for _ in range(2):
        seen.clear()
        opt.step(iter_per_sample_sources(model, nn.functional.cross_entropy, x, y, physical, opt.evaluation_points()))
    return [p.detach().clone() for p in params]


def test_the_engine_lends_a_core_between_the_forward_and_the_large_weighted_sums(
    two_threads, no_spare_core, monkeypatch
):
    """dp-sgd on a small MLP (802k + 20k parameters, 7 chunks of noise; backward to the layer outputs
    32·2000·10 multiply-adds ≪ 16 per normal): torch runs one thread during the per-example losses, the norms
    and the small weighted sums (the biases', the second layer's 32·2000·10), two for the first layer's
    (32·400·2000 > LENT_SUM_MACS) and after the step; without the loan (LOAN_MACS_PER_NORMAL = −1) two
    throughout. The released parameters agree (reproducible noise; the thread count may move the last bits
    of torch's kernels, not the noise)."""
    seen: list[tuple] = []

    def spy(name, f):
        def g(*a, **k):
            seen.append((name, torch.get_num_threads()))
            return f(*a, **k)

        return g

    monkeypatch.setattr(fast, "_per_example_losses", spy("losses", fast._per_example_losses))
    monkeypatch.setattr(fast.FastPerSampleGrads, "sq_norms", spy("norms", fast.FastPerSampleGrads.sq_norms))
    monkeypatch.setattr(layers.DirectBlock, "grad_sums", spy("bias sums", layers.DirectBlock.grad_sums))
    fb = layers.FactoredBlock.grad_sums
    monkeypatch.setattr(layers.FactoredBlock, "grad_sums", lambda self, *a: spy(f"sum {self.shape}", fb)(self, *a))
    pause = noise_mod.CpuNormalDraw.pause

    def paused(draw):
        seen.append(("pause", torch.get_num_threads(), draw.waiting))
        pause(draw)

    monkeypatch.setattr(noise_mod.CpuNormalDraw, "pause", paused)
    lent = _steps(_mlp(), 5, seen)
    pauses = [e for e in seen if e[0] == "pause"]
    # wind_down after the norms pauses the worker (torch still lent); reclaim's pause before the large sum: a no-op
    assert pauses == [("pause", 1, False), ("pause", 1, True)] and seen.index(pauses[0]) == seen.index(("norms", 1)) + 1
    seen[:] = [e for e in seen if e[0] != "pause"]
    one, two = (10, 2000), (2000, 400)
    small = [("losses", 1), ("norms", 1), ("bias sums", 1), ("bias sums", 1), (f"sum {one}", 1)]
    assert sorted(seen) == sorted(small + [(f"sum {two}", 2)]) and seen[-1] == (f"sum {two}", 2)
    assert torch.get_num_threads() == 2
    monkeypatch.setattr(core_loan, "LOAN_MACS_PER_NORMAL", -1)
    kept = _steps(_mlp(), 5, seen)
    assert sorted(seen) == sorted([(k, 2) for k, _ in small] + [(f"sum {two}", 2)])  # nothing lent, nothing paused
    for a, b in zip(lent, kept):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_no_loan_for_a_convolution_or_a_spare_core(two_threads, monkeypatch):
    """A conv layer's rows are not T = 1 (backward_macs None): no loan; nor where a core is spare (the draw's
    worker started at once)."""
    seen = []
    losses = fast._per_example_losses

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return losses(*a, **k)

    monkeypatch.setattr(fast, "_per_example_losses", spy)
    monkeypatch.setattr(noise_mod.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Unflatten(1, (1, 20, 20)), nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 18 * 18, 500))
    _steps(conv, 2, seen)
    assert seen == [2]
    monkeypatch.setattr(noise_mod.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    _steps(_mlp(), 2, seen)
    assert seen == [2]


def test_backward_macs_counts_the_input_gradients_of_row_layers():
    """Σ n·p·q over the recorded layers whose input needs a gradient (the first layer's input, the batch,
    does not); None once a recorded layer is not rows → rows."""
    rows = [(torch.zeros(8, 5), torch.zeros(8, 7)), (torch.zeros(8, 7, requires_grad=True), torch.zeros(8, 3))]

    class C:
        def __init__(self, inp, out):
            self.inp, self.out = inp, out

    assert fast.backward_macs([C(*r) for r in rows]) == 8 * 7 * 3
    assert fast.backward_macs([C(*rows[0]), C(torch.zeros(8, 2, 7, requires_grad=True), torch.zeros(8, 2, 3))]) is None
    assert fast.backward_macs([C(None, None)]) is None
    assert fast.backward_macs([]) == 0


def test_every_forward_runs_at_torchs_threads_with_several_evaluation_points(two_threads, no_spare_core, monkeypatch):
    """DiSK evaluates the per-example gradients at several points, one capture each: the loan made after the
    first capture's forward ends before the next forward (each forward at two threads, each capture's losses at
    one)."""
    seen: list[tuple[str, int]] = []
    losses = fast._per_example_losses

    def spy(*a, **k):
        seen.append(("losses", torch.get_num_threads()))
        return losses(*a, **k)

    monkeypatch.setattr(fast, "_per_example_losses", spy)
    model = _mlp()
    model.register_forward_pre_hook(lambda m, args: seen.append(("forward", torch.get_num_threads())))
    _steps(model, 3, seen, method="disk-sgd")
    forwards = [t for k, t in seen if k == "forward"]
    assert len(forwards) >= 2 and set(forwards) == {2}
    assert [t for k, t in seen if k == "losses"] == [1] + [2] * (len(forwards) - 1)  # one loan per step


def _losses_threads(monkeypatch) -> list:
    """Record torch's thread count at each capture's per-example losses."""
    seen: list = []
    losses = fast._per_example_losses

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return losses(*a, **k)

    monkeypatch.setattr(fast, "_per_example_losses", spy)
    return seen


def test_one_loan_per_step_over_micro_batches(two_threads, no_spare_core, monkeypatch):
    """Four physical micro-batches of 8: the first capture is lent, the other three run at torch's threads (the
    draw's chunks are all claimed by then or the consumer's: a loan per micro-batch would only slow them)."""
    seen = _losses_threads(monkeypatch)
    _steps(_mlp(), 4, seen, physical=8)
    assert seen == [1, 2, 2, 2] and torch.get_num_threads() == 2


class _Gain(nn.Module):
    """A parameter used outside any recognised layer: the per-example (torch.func) path."""

    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.ones(2000))

    def forward(self, x):
        return torch.tanh(x) * self.g


def test_no_loan_where_parameters_take_the_per_example_path(two_threads, no_spare_core, monkeypatch):
    seen = _losses_threads(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(400, 2000), _Gain(), nn.Linear(2000, 10))
    _steps(model, 6, [])
    assert seen and set(seen) == {2}


def test_no_loan_to_a_draw_of_another_size(two_threads):
    """A secret early draw made at begin() for the previous step's size (the release drops it) is not lent."""
    from dpopt.privatizer import Privatizer

    priv = Privatizer(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=8.0, sample_rate=0.1)
    params = [torch.zeros(3 * NORMAL_CHUNK)]
    priv._pending = NoiseSource("reproducible", seed=1).start_normal(2 * NORMAL_CHUNK, defer=True)
    assert priv._loanable(params) is None and priv._loanable(None) is priv._pending
    priv._pending = NoiseSource("reproducible", seed=1).start_normal(3 * NORMAL_CHUNK, defer=True)
    assert priv._loanable(params) is priv._pending
