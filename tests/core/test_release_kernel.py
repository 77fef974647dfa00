"""The release's one compiled pass (``dpopt.privatizer.add_and_round`` with ``scale``, ``divisor`` and
``pool``): it must give bit for bit what the torch passes it replaced give, ``z.mul_(σS)`` (in
``Privatizer._draw``), ``.add_(s).to(dtype)`` (the float64 add, one rounding) and ``.div_(B̄)`` (in
``release``), whatever the number of threads (docs/performance.md, "MLP: dp-sgd's cost above its floor").
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch import nn

from dpopt.engine import iter_per_sample_sources
from dpopt.engine.reference import PerSampleGrads
from dpopt.methods import make_optimizer
from dpopt.noise import NoiseSource
from dpopt.privatizer import RELEASE_SPLIT_MIN, Privatizer, add_and_round

INTS = {torch.float32: torch.int32, torch.float64: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (tells -0.0 from 0.0 and every NaN payload)."""
    return t.contiguous().view(INTS[t.dtype])


def torch_release(z, s, dtype, scale, divisor):
    """The expression the pass replaced: σS·z as its own float64 pass, the mixed add, one cast, then ÷ B̄."""
    out = z.clone().mul_(scale).add_(s).to(dtype)
    return out if divisor is None else out.div_(divisor)


def special(dtype):
    """(s, z): ties, overflow past float32's max, subnormals (also after ÷ 256), signed zeros, inf and nan."""
    big, tiny = float(torch.finfo(torch.float32).max), float(torch.finfo(torch.float32).smallest_normal)
    s = [0.0, -0.0, -0.0, 1.0, 1.0, big, -big, tiny, tiny / 4, 1.0, float("inf"), float("nan"), float("inf"), 3.0]
    z = [0.0, 0.0, -0.0, 3 * 2**-24, -(2**-25), 1e38, -1e38, -1e-39, 2**-25, 1.0, 1.0, 1.0, float("-inf"), -3.0]
    return torch.tensor(s, dtype=torch.float64).to(dtype), torch.tensor(z, dtype=torch.float64)


@pytest.mark.parametrize("sum_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0e5])
@pytest.mark.parametrize("divisor", [None, 256.0, 255.7])
@pytest.mark.parametrize("shape", [(1000, 784), (2 * RELEASE_SPLIT_MIN + 3,), (3,), (), (0,), (7, 0)])
def test_the_pass_is_the_torch_passes_bit_for_bit(sum_dtype, out_dtype, scale, divisor, shape):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(shape, generator=g, dtype=torch.float64)
    s = (torch.randn(shape, generator=g, dtype=torch.float64) * 3.1).to(sum_dtype)
    want = torch_release(z, s, out_dtype, scale, divisor)
    with ThreadPoolExecutor(2) as pool:
        for p in (None, pool):
            for into_sum in (True, False):
                s_in = s.clone()
                got = add_and_round(z.clone(), s_in, out_dtype, into_sum, scale=scale, divisor=divisor, pool=p)
                assert got.dtype == out_dtype and got.shape == torch.Size(shape)
                assert torch.equal(bits(got), bits(want))
                if into_sum and sum_dtype == out_dtype and s.numel():
                    assert got.data_ptr() == s_in.data_ptr()  # written into the sum's own storage
                elif s.numel():
                    assert torch.equal(bits(s_in), bits(s))  # the sum left as it was (a retry starts from it)


@pytest.mark.parametrize("sum_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale,divisor", [(1.0, None), (1.0, 256.0), (0.5, 3.0), (2.0, 1e-40)])
def test_special_values_bit_for_bit(sum_dtype, out_dtype, scale, divisor):
    s, z = special(sum_dtype)
    want = torch_release(z, s, out_dtype, scale, divisor)
    for into_sum in (True, False):
        got = add_and_round(z.clone(), s.clone(), out_dtype, into_sum, scale=scale, divisor=divisor)
        assert torch.equal(bits(got), bits(want))
    if out_dtype == torch.float32 and scale == 1.0 and divisor is None:  # hand-checked
        got = add_and_round(z.clone(), s.clone(), out_dtype)
        assert got[3].item() == 1 + 2**-22  # 1 + 3·2^-24: the tie goes to even
        assert got[5].item() == float("inf") and got[6].item() == float("-inf")  # past float32's max
        assert str(got[2].item()) == "-0.0" and str(got[1].item()) == "0.0"  # -0 + -0 = -0; -0 + 0 = +0
        assert torch.isnan(got[11]) and torch.isnan(got[12]) and got[10].item() == float("inf")


def test_no_fused_multiply_add():
    """z·σS rounds to float64 before the add: (1 + 2^-30)² = 1 + 2^-29 + 2^-60 rounds to 1 + 2^-29, which the
    add cancels exactly (a fused multiply-add would keep the 2^-60)."""
    x = 1 + 2**-30
    for n in (1, 64, 1031):  # 64 and more: the kernel's vector body runs, not only its scalar remainder
        z, s = torch.full((n,), x, dtype=torch.float64), torch.full((n,), -(1 + 2**-29), dtype=torch.float64)
        assert bool((torch_release(z, s, torch.float64, x, None) == 0).all())
        for into_sum in (True, False):
            for divisor in (None, 3.0):
                out = add_and_round(z.clone(), s.clone(), torch.float64, into_sum, scale=x, divisor=divisor)
                assert bool((out == 0).all()), (n, into_sum, divisor)


def test_the_values_do_not_depend_on_the_number_of_threads():
    n = 5 * RELEASE_SPLIT_MIN + 11
    g = torch.Generator().manual_seed(4)
    z, s = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g)
    outs = []
    for workers in (1, 2, 3, 7):
        with ThreadPoolExecutor(workers) as pool:
            outs.append(
                add_and_round(z.clone(), s.clone(), torch.float32, scale=0.9, divisor=31.0, pool=pool, workers=workers)
            )
    assert all(torch.equal(bits(o), bits(outs[0])) for o in outs)
    assert torch.equal(bits(outs[0]), bits(torch_release(z, s, torch.float32, 0.9, 31.0)))


def test_a_process_pool_is_refused():
    """A process pool would write the pieces into pickled copies in its children and hand back the clipped sum
    with no noise and no ÷ B̄ (review of 2026-12-07): refused before anything is written."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    n = 2 * RELEASE_SPLIT_MIN
    s, z = torch.ones(n), torch.randn(n, dtype=torch.float64)
    with ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as pool:
        with pytest.raises(TypeError, match="ThreadPoolExecutor"):
            add_and_round(z, s, torch.float32, True, scale=5.0, divisor=4.0, pool=pool)
    assert torch.equal(s, torch.ones(n))  # untouched
    with ThreadPoolExecutor(2) as tpool:
        out = add_and_round(z.clone(), s.clone(), torch.float32, True, scale=5.0, divisor=4.0, pool=tpool)
    assert torch.equal(bits(out), bits(torch_release(z, s, torch.float32, 5.0, 4.0)))


@pytest.mark.parametrize(
    "mutant",
    [
        "divide before rounding",  # (s + σS·z)/B̄ in float64, rounded once: not the post-processing on record
        "float32 noise",  # σS·z rounded to float32 before the add
        "reciprocal",  # × (1/B̄) in place of ÷ B̄
        "round twice",  # through float32 in a float64 release... or through bf16-like truncation
    ],
)
def test_each_mutation_of_the_pass_changes_bits_these_tests_compare(mutant):
    """The data above tells the pass from its plausible mutations: each gives other bits somewhere."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(1000, 784, generator=g, dtype=torch.float64)
    s = torch.randn(1000, 784, generator=g, dtype=torch.float64).float() * 3.1
    scale, divisor = 0.37, 255.7
    zn, sn = z.numpy(), s.numpy().astype(np.float64)
    if mutant == "divide before rounding":
        bad = ((zn * scale + sn) / divisor).astype(np.float32)
    elif mutant == "float32 noise":
        bad = ((zn * scale).astype(np.float32).astype(np.float64) + sn).astype(np.float32) / np.float32(divisor)
    elif mutant == "reciprocal":
        bad = (zn * scale + sn).astype(np.float32) * np.float32(1 / divisor)
    else:
        bad = ((zn * scale + sn).astype(np.float32).astype(np.float64) / divisor).astype(np.float32)
        bad = (bad.view(np.int32) & ~np.int32(1)).view(np.float32)  # a last bit lost
    got = add_and_round(z.clone(), s.clone(), torch.float32, scale=scale, divisor=divisor)
    assert not torch.equal(bits(got), bits(torch.from_numpy(np.ascontiguousarray(bad, dtype=np.float32))))
    assert torch.equal(bits(got), bits(torch_release(z, s, torch.float32, scale, divisor)))


def test_fallbacks_keep_the_torch_expression():
    g = torch.Generator().manual_seed(2)
    z, s = torch.randn(40, 30, generator=g, dtype=torch.float64), torch.randn(40, 30, generator=g)
    want = z.clone().mul_(0.3).add_(s).to(torch.bfloat16).div_(7.0)
    assert torch.equal(add_and_round(z.clone(), s.clone(), torch.bfloat16, scale=0.3, divisor=7.0), want)
    t = torch.randn(30, 40, generator=g).t()  # non-contiguous sum
    want = z.clone().mul_(0.3).add_(t).to(torch.float32).div_(7.0)
    assert torch.equal(add_and_round(z.clone(), t, torch.float32, scale=0.3, divisor=7.0), want)


def previous_add_noise(self, std, dtypes):
    """``Privatizer._add_noise`` before the compiled pass: ``_draw``'s σS·z, numpy's add into it, ``copyto``
    rounding into the sum; ÷ B̄ left to ``release`` (which then divides: ``_divided`` stays False)."""
    noise, count_noise = self._draw(std)
    into_sum = self.quantile is None
    out = []
    for z, s, dt in zip(noise, self._sum, dtypes):
        if dt == torch.bfloat16:
            out.append(z.add_(s).to(dt))
            continue
        o = s if s.dtype == dt and into_sum else torch.empty(s.shape, dtype=dt)
        zn = z.numpy()
        np.add(zn, s.numpy(), out=zn)
        np.copyto(o.numpy(), zn, casting="same_kind")
        out.append(o)
    return out, count_noise


@pytest.mark.parametrize("threads", [1, 2])
def test_a_dp_sgd_step_equals_the_previous_code_given_the_same_reproducible_noise(threads, monkeypatch):
    """A whole ``dp-sgd`` step (fast engine, an MLP whose first weight is split over the threads) releases
    and updates exactly what the previous release code did, with the same seeded reproducible noise."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 700, generator=g), torch.randint(0, 3, (16,), generator=g)

    def step():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(700, 400), nn.ReLU(), nn.Linear(400, 3))  # 280,000 > 2·2^17 weights
        opt = make_optimizer(
            "dp-sgd",
            list(model.parameters()),
            noise_multiplier=0.8,
            max_grad_norm=0.05,
            expected_batch_size=16.3,  # B̄ not a power of two: the division rounds
            sample_rate=0.1,
            generator=torch.Generator().manual_seed(11),
        )
        rels = [opt.step(iter_per_sample_sources(model, nn.functional.cross_entropy, x, y)) for _ in range(2)]
        return [t for r in rels for t in r.grads] + [p.detach().clone() for p in model.parameters()]

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        new = step()
        with monkeypatch.context() as m:
            m.setattr(Privatizer, "_add_noise", previous_add_noise)
            old = step()
    finally:
        torch.set_num_threads(prev)
    assert len(new) == len(old) == 12  # 2 releases of 4 gradients, 4 parameters
    for a, b in zip(new, old):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_release_is_round_of_s_plus_sigma_s_z_then_divided(dtype):
    """Written out: round(s + σC·z) / B̄ with z the source's reproducible normals, for each parameter."""
    shapes = [(600, 500), (600,), (3,)]
    g = torch.Generator().manual_seed(5)
    sums = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    sigma, clip, bbar = 0.7, 1e6, 3.3
    priv = Privatizer(sigma, clip, bbar, 0.1, noise=NoiseSource("reproducible", seed=8))
    new = priv.privatize(PerSampleGrads([t.clone().unsqueeze(0) for t in sums]), params_like=sums).grads
    z = NoiseSource("reproducible", seed=8).normal((sum(s.numel() for s in sums),), dtype=torch.float64)
    at = 0
    for s, r in zip(sums, new):
        want = (z[at : at + s.numel()].view(s.shape) * (sigma * clip) + s.double()).to(dtype).div_(bbar)
        at += s.numel()
        assert r.dtype == dtype and torch.equal(r, want)


def test_the_noise_seam_still_reaches_the_release(monkeypatch):
    """``_draw`` hands z unscaled to the pass (scaled=False); a wrapper that halves what it returns (the audit's
    ``noise_half`` mutant) halves the released noise, exactly."""
    n = 3 * RELEASE_SPLIT_MIN

    def release():
        priv = Privatizer(2.0, 1.0, 4.0, 0.1, noise=NoiseSource("reproducible", seed=3))
        return priv.privatize(PerSampleGrads([torch.zeros(1, n)])).grads[0]

    full = release()
    draw = Privatizer._draw
    seen = []

    def half(self, std, rounded=False, **kw):
        seen.append(kw)
        noise, count = draw(self, std, rounded, **kw)
        return [z * 0.5 for z in noise], count

    monkeypatch.setattr(Privatizer, "_draw", half)
    halved = release()
    assert seen == [{"scaled": False}]
    assert torch.equal(halved, (full.double() * 0.5).float())  # σS·(z/2)/B̄ = (σS·z/B̄)/2: powers of two
    assert 0.45 < float(full.double().std()) < 0.55  # σ·C/B̄ = 0.5


@pytest.mark.parametrize("n", [5, 3 * RELEASE_SPLIT_MIN])
def test_a_seam_wrapper_that_drops_the_keyword_still_releases_sigma_s_z(monkeypatch, n):
    """A ``_draw`` wrapper that does not pass ``scaled=False`` through gets σS·z from the original; the pass then
    scales by what ``_draw`` did NOT apply (1), not by σS again: the same bits as without the wrapper (before:
    σS²·z, 0.3 of the noise at σS = 0.3). A replacement that never calls ``_draw`` is refused."""

    def release():
        priv = Privatizer(0.3, 1.0, 4.0, 0.1, noise=NoiseSource("reproducible", seed=3))
        return priv.privatize(PerSampleGrads([torch.zeros(1, n)])).grads[0]

    full = release()
    draw = Privatizer._draw

    def dropping(self, std, rounded=False, **kw):  # kw (scaled=False) dropped
        return draw(self, std, rounded)

    monkeypatch.setattr(Privatizer, "_draw", dropping)
    assert torch.equal(bits(release()), bits(full))
    z = NoiseSource("reproducible", seed=3).normal((n,), dtype=torch.float64)
    assert torch.equal(bits(full), bits((z * 0.3).float().div_(4.0)))  # σS·z/B̄, hand-written

    def own(self, std, rounded=False, **kw):  # noise of its own: the scale it applied is unknown
        return [torch.zeros(s.shape, dtype=torch.float64) for s in self._sum], None

    monkeypatch.setattr(Privatizer, "_draw", own)
    with pytest.raises(RuntimeError, match="must call Privatizer._draw"):
        release()


def test_the_c_pass_refuses_overlaps_types_and_lengths_it_cannot_write_safely():
    """The C pass (src/dpopt/_native.c) checks its buffers itself: a partial overlap of out and s, out
    overlapping z, a length mismatch or a non-float buffer is a ValueError, never an out-of-bounds write."""
    from dpopt.kernels import native

    s, z = np.arange(8, dtype=np.float32), np.ones(8)
    with pytest.raises(ValueError, match="overlaps s"):
        native.release(s[1:], s[:7], z[:7], 1.0, 1.0, False)
    with pytest.raises(ValueError, match="overlaps"):
        native.release(z.view(np.float32)[:8], s, z, 1.0, 1.0, False)
    with pytest.raises(ValueError, match="one length"):
        native.release(np.empty(7, np.float32), s, z, 1.0, 1.0, False)
    with pytest.raises(ValueError, match="float32 or float64"):
        native.release(np.empty(8, np.int32), s, z, 1.0, 1.0, False)
    with pytest.raises(ValueError, match="writable"):
        ro = np.empty(8, np.float32)
        ro.setflags(write=False)
        native.release(ro, s, z, 1.0, 1.0, False)
    s2 = s.copy()
    native.release(s2, s2, z, 0.5, 4.0, True)  # the same elements: in place, (s + 0.5) / 4 rounded once each
    assert np.array_equal(s2, ((s.astype(np.float64) + 0.5).astype(np.float32) / np.float32(4.0)))


def test_a_piece_no_worker_has_started_is_computed_by_the_caller():
    """add_and_round's pieces beyond the caller's own go to the pool; one still queued when the caller is done (its
    worker busy elsewhere) is taken back and computed by the caller: the same values, and nothing waits for it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from dpopt.privatizer import RELEASE_SPLIT_MIN, add_and_round

    n = 3 * RELEASE_SPLIT_MIN + 5
    z = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    s = torch.randn(n, generator=torch.Generator().manual_seed(2))
    want = (z * 0.7 + s.double()).float() / torch.tensor(3.0)
    gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(gate.wait)  # the pool's one worker is held: the pieces stay queued
        got = add_and_round(z.clone(), s.clone(), torch.float32, scale=0.7, divisor=3.0, pool=pool, workers=3)
        assert not busy.done()  # the release did not wait for the held worker
        gate.set()
    assert torch.equal(got, want)
