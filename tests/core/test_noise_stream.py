"""The streamed noise draw and the release that adds it in place (issue 43: bytes per block, not per parameter).

A streamed :class:`dpopt.noise.CpuNormalDraw` computes its chunks only when consumed, each in a
chunk-sized scratch buffer, and a release larger than :data:`dpopt.privatizer.EARLY_DRAW_MAX` adds
them to the clipped sums chunk by chunk. Neither may change WHAT is drawn: every check is bit for
bit against :meth:`NoiseSource.normal` and the release formula round(s + σC·z) / B̄ written out.
"""

import pytest
import torch

import dpopt.privatizer as privatizer_module
from dpopt.engine.reference import PerSampleGrads
from dpopt.noise import CUT_RADIUS, NORMAL_CHUNK, NoiseSource
from dpopt.privatizer import Privatizer


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("n", [NORMAL_CHUNK + 1, 3 * NORMAL_CHUNK + 7])
def test_streamed_draw_is_the_stream_of_normal(n, threads):
    want = NoiseSource("reproducible", seed=3).normal((n,), dtype=torch.float64)
    src = NoiseSource("reproducible", seed=3)
    draw = src.start_normal(n, stream=True)
    assert draw.stream and draw._values is None  # nothing computed, no buffer of n values
    got = torch.full((n,), float("nan"), dtype=torch.float64)
    scratch_ptrs = set()

    def take(lo, hi, z):
        scratch_ptrs.add(z.data_ptr())
        got[lo:hi] = z

    assert draw.consume(take) is None
    assert torch.equal(got, want)
    assert len(scratch_ptrs) <= threads  # one reused chunk buffer per worker
    with pytest.raises(RuntimeError, match="consumed once"):
        draw.consume(take)


def test_a_streamed_draw_needs_a_consumer():
    draw = NoiseSource("secret").start_normal(NORMAL_CHUNK + 1, stream=True)
    with pytest.raises(ValueError, match="pass fn"):
        draw.consume()


def test_streamed_secure_draw_has_unit_moments_and_the_tail_bound():
    n = 4 * NORMAL_CHUNK
    out = torch.empty(n, dtype=torch.float64)
    NoiseSource("secure").start_normal(n, stream=True).consume(lambda lo, hi, z: out[lo:hi].copy_(z))
    # mean of n = 524,288 N(0, 1): sd 0.0014, 6 sd window (false alarm < 2e-9); var sd sqrt(2/n) = 0.002
    assert abs(float(out.mean())) < 6 * n**-0.5 and abs(float(out.var()) - 1) < 6 * (2 / n) ** 0.5
    assert float(out.abs().max()) <= CUT_RADIUS


SHAPES = [(700, 300), (300,), (5, 41), (0,), (NORMAL_CHUNK // 3 + 1,), (3,)]  # chunk boundaries inside params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_streamed_release_equals_the_formula_bit_for_bit(dtype, threads, monkeypatch):
    monkeypatch.setattr(privatizer_module, "EARLY_DRAW_MAX", NORMAL_CHUNK)  # this model streams its draw
    g = torch.Generator().manual_seed(5)
    sums = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
    sigma, clip, bbar = 0.7, 1e6, 3.0
    priv = Privatizer(sigma, clip, bbar, 0.1, noise=NoiseSource("reproducible", seed=8))
    streamed = []
    real = priv.noise.start_normal
    monkeypatch.setattr(priv.noise, "start_normal", lambda n, stream=False: streamed.append(stream) or real(n, stream))
    rel = priv.privatize(PerSampleGrads([t.clone().unsqueeze(0) for t in sums]), params_like=sums)
    assert streamed == [True]  # not drawn early at begin(), streamed at the release
    z = NoiseSource("reproducible", seed=8).normal((sum(s.numel() for s in sums),), dtype=torch.float64)
    at = 0
    for s, r in zip(sums, rel.grads):
        want = (z[at : at + s.numel()].view(s.shape) * (sigma * clip) + s.double()).to(dtype).div_(bbar)
        at += s.numel()
        assert r.dtype == dtype and torch.equal(r, want)


def test_small_models_still_draw_early(monkeypatch):
    priv = Privatizer(1.0, 1.0, 2.0, 0.1)
    x = [torch.zeros(1, NORMAL_CHUNK + 1)]
    priv.privatize(PerSampleGrads(x), params_like=[x[0][0]])  # learns the size
    priv.begin()
    assert priv._pending is not None and priv._pending.n == NORMAL_CHUNK + 1 and not priv._pending.stream
    monkeypatch.setattr(privatizer_module, "EARLY_DRAW_MAX", NORMAL_CHUNK)
    priv._pending = None
    priv._geometry = None
    priv.begin()
    assert priv._pending is None  # above the limit: nothing pre-drawn
