"""The release's add-and-round (``dpopt.privatizer.add_and_round``) and the per-example bias sums of a
linear layer (``dpopt.engine.rules.linear_bias_sums``): both were rewritten for speed (MLP step,
docs/performance.md "MLP: dp-sgd's cost above its floor") and must give bit for bit the values of the
expressions they replaced, ``z.add_(s).to(dtype)`` and ``sum(e.reshape(b, -1, q).sum(1, dtype))``.
"""

import pytest
import torch
from torch import nn

import dpopt.engine.rules as rules_module
import dpopt.privatizer as privatizer_module
from dpopt.engine import iter_per_sample_sources
from dpopt.engine.reference import PerSampleGrads
from dpopt.methods import make_optimizer
from dpopt.noise import NoiseSource
from dpopt.privatizer import Privatizer, add_and_round


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (distinguishes -0.0 from 0.0 and every NaN payload)."""
    return t.contiguous().view({torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype])


def special_sums(dtype: torch.dtype) -> torch.Tensor:
    """Values where rounding is delicate: ties, overflow past float32's max, subnormals, signed zeros, inf, nan."""
    big = float(torch.finfo(torch.float32).max)
    tiny = float(torch.finfo(torch.float32).smallest_normal)
    vals = [0.0, -0.0, 1.0, -1.0, big, -big, tiny, tiny / 4, 1 + 2**-24, 1 + 3 * 2**-24, float("inf"), float("nan")]
    return torch.tensor(vals, dtype=dtype)


@pytest.mark.parametrize("sum_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1000, 784), (1000,), (3,), (), (0,), (7, 0)])
def test_add_and_round_is_the_float64_add_then_one_rounding_bit_for_bit(sum_dtype, out_dtype, shape):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(shape, generator=g, dtype=torch.float64) * 0.37
    s = (torch.randn(shape, generator=g, dtype=torch.float64) * 3.1).to(sum_dtype)
    want = z.clone().add_(s).to(out_dtype)
    s_ptr = s.data_ptr()
    got = add_and_round(z.clone(), s.clone() if sum_dtype != out_dtype else s, out_dtype)
    assert got.dtype == out_dtype and got.shape == torch.Size(shape)
    assert torch.equal(bits(got), bits(want))
    if sum_dtype == out_dtype and s.numel():
        assert got.data_ptr() == s_ptr  # rounded into the sum's own storage: no new buffer


@pytest.mark.parametrize("sum_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float64])
def test_add_and_round_special_values(sum_dtype, out_dtype):
    s = special_sums(sum_dtype)
    n = s.numel()
    # noise values that make a tie (3·2^-24 after 1.0), cancel, overflow
    z = torch.tensor(
        [0.0, 0.0, 3 * 2**-24, -(2**-25), 1e38, -1e38, -1e-39, 0.0, 2**-25, 2**-25, 1.0, 1.0], dtype=torch.float64
    )[:n]
    want = z.clone().add_(s).to(out_dtype)
    got = add_and_round(z.clone(), s.clone(), out_dtype)
    assert torch.equal(bits(got), bits(want))
    # hand-checked: 1 + 3·2^-24 is halfway between the float32 values 1 + 2^-23 and 1 + 2^-22: to even, 1 + 2^-22
    if out_dtype == torch.float32:
        assert got[2].item() == 1 + 2**-22
        assert got[4].item() == float("inf") and got[5].item() == float("-inf")  # past float32's max
        assert torch.isnan(got[11]) and got[10].item() == float("inf")


@pytest.mark.parametrize(
    "case",
    ["bf16 release", "non-contiguous sum", "grad-tracking noise"],
)
def test_add_and_round_falls_back_to_torch_with_the_same_values(case):
    g = torch.Generator().manual_seed(2)
    z = torch.randn(40, 30, generator=g, dtype=torch.float64)
    s = torch.randn(40, 30, generator=g)
    dtype = torch.float32
    if case == "bf16 release":
        dtype = torch.bfloat16
    elif case == "non-contiguous sum":
        s = torch.randn(30, 40, generator=g).t()
    want = z.clone().add_(s).to(dtype)
    zz = z.clone().requires_grad_(True) if case == "grad-tracking noise" else z.clone()
    with torch.no_grad():
        got = add_and_round(zz, s.clone() if s.is_contiguous() else s, dtype)
    assert got.dtype == dtype and torch.equal(got, want)


def old_add_noise(self, std, dtypes):
    """The release's add before the change: ``z.add_(s).to(dtype)`` per parameter (torch's mixed-dtype add)."""
    noise, count_noise = self._draw(std)
    return [z.add_(s).to(dt) for z, s, dt in zip(noise, self._sum, dtypes)], count_noise


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_release_equals_the_formula_and_the_previous_release(dtype, monkeypatch):
    shapes = [(1000, 784), (1000,), (10, 1000), (10,)]
    g = torch.Generator().manual_seed(5)
    sums = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    sigma, clip, bbar = 0.7, 1e6, 3.0

    def release():
        priv = Privatizer(sigma, clip, bbar, 0.1, noise=NoiseSource("reproducible", seed=8))
        return priv.privatize(PerSampleGrads([t.clone().unsqueeze(0) for t in sums]), params_like=sums).grads

    new = release()
    z = NoiseSource("reproducible", seed=8).normal((sum(s.numel() for s in sums),), dtype=torch.float64)
    at = 0
    for s, r in zip(sums, new):  # round(s + σC·z) / B̄, written out
        want = (z[at : at + s.numel()].view(s.shape) * (sigma * clip) + s.double()).to(dtype).div_(bbar)
        at += s.numel()
        assert r.dtype == dtype and torch.equal(r, want)
    monkeypatch.setattr(Privatizer, "_add_noise", old_add_noise)
    for a, b in zip(new, release()):
        assert torch.equal(a, b)


def old_linear_bias_sums(layer):
    """linear_bias_sums before the change: a reduction over the positions even when there is one, then ``sum()``."""
    b = layer.batch_size
    return sum(e.reshape(b, -1, e.shape[-1]).sum(1, dtype=layer.dtype) for _, e in layer.calls)


class TwoCalls(nn.Module):
    """One Linear called twice (its bias gradient sums both calls) on [B, T, 5] inputs, T = 1 or 3."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(torch.tanh(self.lin(x[..., :5]) @ torch.ones(4, 5))))).sum(1)


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("model_fn,shape", [(mlp, (9, 12)), (TwoCalls, (9, 1, 5)), (TwoCalls, (9, 3, 5))])
def test_dp_sgd_releases_equal_the_previous_code_given_the_same_reproducible_noise(model_fn, shape, monkeypatch):
    """A whole ``dp-sgd`` step through the fast engine: the new bias sums and add-and-round release exactly
    what the replaced code released (same seeded reproducible noise, same model and batch), and the bias
    sums equal the per-example bias gradients summed by hand (Σ_t e_it over every call)."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(*shape, generator=g), torch.randint(0, 3, (shape[0],), generator=g)

    def loss_fn(out, target):
        return nn.functional.cross_entropy(out, target)

    def step():
        torch.manual_seed(0)
        model = model_fn()
        opt = make_optimizer(
            "dp-sgd",
            list(model.parameters()),
            noise_multiplier=0.8,
            max_grad_norm=0.05,  # every example clipped: the clip weights enter every sum
            expected_batch_size=9.0,
            sample_rate=0.1,
            generator=torch.Generator().manual_seed(11),
        )
        rel = opt.step(iter_per_sample_sources(model, loss_fn, x, y))
        return list(rel.grads), [p.detach().clone() for p in model.parameters()]

    new_grads, new_params = step()
    with monkeypatch.context() as m:
        m.setattr(rules_module, "linear_bias_sums", old_linear_bias_sums)
        m.setattr(Privatizer, "_add_noise", old_add_noise)
        old_grads, old_params = step()
    for a, b in zip(new_grads + new_params, old_grads + old_params):
        assert torch.equal(a, b)


def test_linear_bias_sums_are_the_per_example_bias_gradients():
    """Against single-example autograd: the bias gradient of example i is Σ over calls and positions of e_it."""
    torch.manual_seed(0)
    model = TwoCalls()
    x = torch.randn(4, 3, 5)
    seen = {}
    real = rules_module.linear_bias_sums

    def spy(layer):
        out = real(layer)
        if layer.module is model.lin:
            seen["lin"] = out.clone()
            assert torch.equal(out, old_linear_bias_sums(layer))
        return out

    rules_module_linear = rules_module.linear_bias_sums
    try:
        rules_module.linear_bias_sums = spy
        src = next(iter(iter_per_sample_sources(model, lambda o, t: o.sum(), x, torch.zeros(4))))
        src.sq_norms(privatizer_module.ClipGeometry(), [0] * src.num_params, 1)
    finally:
        rules_module.linear_bias_sums = rules_module_linear
    for i in range(4):
        model.zero_grad()
        model(x[i : i + 1]).sum().backward()
        assert torch.allclose(seen["lin"][i], model.lin.bias.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("numel", [5, privatizer_module.EARLY_DRAW_MAX + 3])  # the one-buffer and the streamed add
def test_a_failed_quantile_release_leaves_the_clipped_sums_for_its_retry(numel):
    """Quantile clipping records its entry (with the noisy count) AFTER the noise is added: when that write
    fails nothing is released and release() may be retried. The clipped sums must still be the clipped sums
    then (the noisy sums must not have been rounded into them), or the retry releases s + z1 + z2: twice
    the noise variance under a noise_std that says once."""
    from dpopt.privatizer import QuantileClipping

    priv = Privatizer(1.0, 1e6, 1.0, 0.1, quantile=QuantileClipping(1.0), noise=NoiseSource("reproducible", seed=1))
    priv.begin(None)
    priv.accumulate(PerSampleGrads([torch.full((1, numel), 100.0)]))
    before = [s.clone() for s in priv._sum]
    real, calls = priv.ledger.record, []

    def full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    priv.ledger.record = full_disk
    with pytest.raises(Exception, match="No space left"):
        priv.release([torch.zeros(numel)])
    assert all(torch.equal(a, b) for a, b in zip(before, priv._sum))
    g = priv.release([torch.zeros(numel)]).grads[0]
    # one draw of std σ·C/B̄ = 1e6 around 100 per coordinate: noise added twice would put the sample std near 1.41e6
    assert 0.8e6 < float(g.double().std()) < 1.2e6 if numel > 1000 else torch.isfinite(g).all()
