"""Secret randomness (issue 9, item 1): noise and masks are never replayable from a published seed.

Statistical tests state their false-alarm rate; all draws that must differ
come from OS entropy, so "two runs differ" fails only if two independent
63-bit seeds collide (probability 2^-63).
"""

import math

import pytest
import torch
from scipy import stats

import dpopt
from dpopt.accounting.ledger import PrivacyLedger
from dpopt.accounting.ledger_check import check_run
from dpopt.engine.reference import PerSampleGrads
from dpopt.noise import NoiseSource, make_noise_source
from dpopt.privatizer import Privatizer
from dpopt.sampling import PoissonSampler
from dpopt.training import TrainConfig, train


def _run(tmp_path, name, **kw):
    cfg = TrainConfig(
        dataset="digits", method="dp-sgd", epochs=0.5, seed=3, accountant="rdp", out=str(tmp_path / name), **kw
    )
    summary = train(cfg)
    return summary, torch.load(tmp_path / name / "model.pt")


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_same_seed_gives_different_models_by_default(tmp_path):
    s1, m1 = _run(tmp_path, "a")
    s2, m2 = _run(tmp_path, "b")
    assert s1["noise"] == s2["noise"] == "secret"
    assert not _same(m1, m2)
    assert check_run(tmp_path / "a").passed


def test_reproducible_noise_is_identical_and_fails_the_check(tmp_path):
    with pytest.warns(UserWarning, match="NO privacy guarantee"):
        s1, m1 = _run(tmp_path, "a", reproducible_noise=True)
    with pytest.warns(UserWarning):
        s2, m2 = _run(tmp_path, "b", reproducible_noise=True)
    assert _same(m1, m2)
    assert s1["noise"] == "reproducible"
    assert PrivacyLedger.load(tmp_path / "a").noise == "reproducible"
    result = check_run(tmp_path / "a")
    assert not result.passed
    assert "noise reproducible from a published seed" in result.format()


def test_privatizer_noise_ignores_the_global_seed():
    """The old defect: noise drawn from a generator fixed by the user's seed."""
    grads = PerSampleGrads([torch.zeros(3, 50)])
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        draws.append(Privatizer(1.0, 1.0, 4.0, 0.1).privatize(grads).grads[0])
    assert not torch.equal(draws[0], draws[1])


def test_privatizer_records_the_noise_mode():
    assert Privatizer(1.0, 1.0, 4.0, 0.1).ledger.noise == "secret"
    assert Privatizer(1.0, 1.0, 4.0, 0.1, secure_mode=True).ledger.noise == "secure"
    gen = torch.Generator().manual_seed(1)
    assert Privatizer(1.0, 1.0, 4.0, 0.1, generator=gen).ledger.noise == "reproducible"
    with pytest.raises(ValueError, match="at most one"):
        Privatizer(1.0, 1.0, 4.0, 0.1, generator=gen, secure_mode=True)


def test_reproducible_source_is_reproducible_and_secret_is_not():
    a, b = NoiseSource("reproducible", seed=5), NoiseSource("reproducible", seed=5)
    assert torch.equal(a.normal((100,)), b.normal((100,)))
    s, t = NoiseSource(), NoiseSource()
    assert not torch.equal(s.normal((100,)), t.normal((100,)))
    assert s._seed is None and "seed" not in repr(s)  # a secret source keeps no seed
    with pytest.raises(ValueError, match="reproducible"):
        NoiseSource("secret", seed=1)
    with pytest.raises(ValueError, match="needs a seed"):
        NoiseSource("reproducible")
    with pytest.raises(ValueError, match="noise mode"):
        NoiseSource("fast")


@pytest.mark.parametrize("mode", ["secret", "secure"])
def test_normal_draws_are_standard_normal(mode):
    """Kolmogorov–Smirnov test of 200,000 draws against N(0, 1) at α = 1e-7 (false alarm 1 in 10^7 runs: the
    draws are secret, so every run is a new one). Power: the critical distance is 0.0065; a std off by 5 %
    (distance 0.012) or float32 uniforms' 24-bit grid in the tails would still be rejected."""
    z = make_noise_source(secure_mode=mode == "secure").normal((200_000,), dtype=torch.float64)
    assert z.dtype == torch.float64 and z.shape == (200_000,)
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-7


def test_secure_uniforms_cover_the_unit_interval_with_53_bits():
    u = NoiseSource("secure").uniform(100_000)
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # α = 1e-7 (the draws are secure, so a new draw every run); critical distance 0.0092 on 100,000 uniforms
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-7
    # float32-resolution uniforms would all be multiples of 2^-24
    assert bool(((u * 2**24) % 1 != 0).any())


def test_poisson_masks_are_float64_exact_for_tiny_rates():
    """q = 1e-7 is compared in float64: 0 hits in 10^6 draws has probability e^-0.1 ≈ 0.90;
    a float32 comparison draws with probability 1.19e-7 — the test checks the comparison dtype."""
    src = NoiseSource("reproducible", seed=0)
    u = src.uniform(1000)
    assert u.dtype == torch.float64
    sampler = PoissonSampler(1000, 0.5, 3)
    assert sampler.noise.mode == "secret"
    sizes = [len(b) for b in sampler]
    assert all(0 < n < 1000 for n in sizes)  # P(fail) ≈ 3·2^-999


def test_poisson_masks_are_secret_by_default():
    torch.manual_seed(0)
    a = [b.tolist() for b in PoissonSampler(200, 0.3, 2)]
    torch.manual_seed(0)
    b = [b.tolist() for b in PoissonSampler(200, 0.3, 2)]
    assert a != b  # identical only if two 63-bit OS seeds collide


def test_from_dpopt_import_train_is_the_function(tmp_path):
    from dpopt import train as train_fn

    assert callable(train_fn) and train_fn is dpopt.training.train
    summary = train_fn(
        TrainConfig(dataset="digits", method="dp-sgd", epochs=0.1, accountant="rdp", out=str(tmp_path / "r"))
    )
    assert summary["steps"] == max(1, round(0.1 / summary["sample_rate"]))
    assert math.isfinite(summary["epsilon"])


def test_cli_same_seed_differs_reproducible_identical_and_check_fails(tmp_path):
    from typer.testing import CliRunner

    from dpopt.cli import app

    runner = CliRunner()
    base = ["train", "--method", "dp-sgd", "--epochs", "0.3", "--seed", "4", "--accountant", "rdp"]
    models = {}
    for name, extra in (
        ("a", []),
        ("b", []),
        ("r1", ["--reproducible-noise"]),
        ("r2", ["--reproducible-noise"]),
        ("s", ["--secure-mode"]),
    ):
        res = runner.invoke(app, base + extra + ["--out", str(tmp_path / name)])
        # a run whose ledger check fails (reproducible noise) still trains, then exits 3
        assert res.exit_code == (3 if extra == ["--reproducible-noise"] else 0), res.output
        models[name] = torch.load(tmp_path / name / "model.pt")
        if name == "r1":
            assert "NO privacy guarantee" in " ".join(res.output.split())
    assert not _same(models["a"], models["b"])
    assert _same(models["r1"], models["r2"])
    assert PrivacyLedger.load(tmp_path / "s").noise == "secure"
    res = runner.invoke(app, ["check", str(tmp_path / "r1")])
    assert res.exit_code != 0 and "noise reproducible from a published seed" in res.output
    assert runner.invoke(app, ["check", str(tmp_path / "a")]).exit_code == 0
    res = runner.invoke(app, base + ["--reproducible-noise", "--secure-mode", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "exclude each other" in res.output


def test_torch_cpu_seeds_keep_only_32_bits():
    """The premise of the full-state seeding: manual_seed(s) and manual_seed(s + 2^32) draw the same.

    If a future torch keeps all 64 bits this test fails, and the full-state
    seeding is then merely redundant (still correct).
    """
    a = torch.randn(8, generator=torch.Generator().manual_seed(5))
    b = torch.randn(8, generator=torch.Generator().manual_seed(5 + 2**32))
    assert torch.equal(a, b)


def test_secret_cpu_generator_runs_mt19937_from_the_given_words():
    """Cross-check against Python's own MT19937 (random module) started from the same 624 words."""
    import os
    import random

    from dpopt.noise import _MT_WORDS, _cpu_generator_from_words

    raw = os.urandom(4 * _MT_WORDS)
    words = [int.from_bytes(raw[4 * i : 4 * i + 4], "little") for i in range(_MT_WORDS)]
    py = random.Random()
    py.setstate((3, tuple(words) + (_MT_WORDS,), None))  # index 624: the next draw twists, as torch's
    want = [py.getrandbits(32) % 2**24 for _ in range(64)]
    got = torch.randint(0, 2**24, (64,), generator=_cpu_generator_from_words(raw), dtype=torch.int64)
    assert got.tolist() == want
    with pytest.raises(ValueError, match="all-zero"):
        _cpu_generator_from_words(bytes(4 * _MT_WORDS))


def test_secret_sources_are_not_seeded_states():
    """A secret CPU generator's state is not init_genrand(s) for any 32-bit s (it would be if seeded)."""
    from dpopt.noise import _MT_WORDS, _mt_init, _mt_state_layout

    at, width = _mt_state_layout()
    states = []
    for _ in range(2):
        gen = NoiseSource("secret")._generator("cpu")
        raw = gen.get_state().numpy().tobytes()
        words = [int.from_bytes(raw[at + i * width : at + i * width + 4], "little") for i in range(_MT_WORDS)]
        assert words[1:4] != _mt_init(words[0], 4)[1:4]  # not the words seeding with words[0] would give
        states.append(words)
    assert states[0] != states[1]


def test_chunked_cpu_normals_do_not_depend_on_the_thread_count():
    """Large tensors are filled chunk by chunk (NORMAL_CHUNK) from derived generators, possibly in parallel."""
    from dpopt.noise import NORMAL_CHUNK

    shape = (3, NORMAL_CHUNK + 5)
    old = torch.get_num_threads()
    try:
        draws = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            draws.append(NoiseSource("reproducible", seed=11).normal(shape))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(draws[0], draws[1])


def test_chunked_cpu_normals_are_independent_standard_normals():
    """KS test against N(0, 1) (α = 1e-7: the secret draws are new every run; critical distance 0.004 on
    524,288 draws) and chunk-to-chunk correlation below 5.6/√n (false alarm 2.1e-8 per pair, 6 pairs) for
    secret and reproducible sources: false alarm ≈ 2.3e-7 per run. Chunks that repeated one generator state
    would correlate at 1."""
    from dpopt.noise import NORMAL_CHUNK

    for src in (NoiseSource("secret"), NoiseSource("reproducible", seed=5)):
        z = src.normal((4 * NORMAL_CHUNK,), dtype=torch.float64)
        assert stats.kstest(z.numpy(), "norm").pvalue > 1e-7
        chunks = z.view(4, NORMAL_CHUNK)
        corr = torch.corrcoef(chunks)
        off = corr[~torch.eye(4, dtype=torch.bool)]
        assert float(off.abs().max()) < 5.6 / math.sqrt(NORMAL_CHUNK)
        assert not torch.equal(chunks[0], chunks[1])


def test_chunked_normals_work_in_a_forked_child():
    """A pool created before fork has no threads in the child: the child must make its own, not deadlock.

    ``Process`` with the fork start method hands the child the parent's object itself (no pickling).
    """
    import multiprocessing as mp

    from dpopt.noise import NORMAL_CHUNK

    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        src = NoiseSource("reproducible", seed=2)
        src.normal((2 * NORMAL_CHUNK,))  # the pool exists now
        assert src._pool is not None
        ctx = mp.get_context("fork")
        child = ctx.Process(target=_draw_in_child, args=(src, 2 * NORMAL_CHUNK))
        child.start()
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
            pytest.fail("a forked child deadlocked drawing chunked noise")
    finally:
        torch.set_num_threads(old)
    assert child.exitcode == 0


def _draw_in_child(src, n):
    torch.set_num_threads(2)
    assert src.normal((n,)).shape == (n,)


def _path_draw(path: str, src: NoiseSource) -> torch.Tensor:
    """One protecting draw from ``src`` by ``path`` (the ways the library draws on the CPU)."""
    from dpopt.noise import NORMAL_CHUNK

    n = 2 * NORMAL_CHUNK + 3
    if path == "small float32":
        return src.normal((7,))
    if path == "poisson uniforms":
        return src.uniform(1000)
    if path == "chunked float64":
        return src.normal((n,), dtype=torch.float64)
    if path == "chunked bfloat16":
        return src.normal((n,), dtype=torch.bfloat16)
    if path == "started early":
        return src.start_normal(n).values()
    if path == "streamed":
        out = torch.empty(n, dtype=torch.float64)
        src.start_normal(n, stream=True).consume(lambda lo, hi, z: out[lo:hi].copy_(z))
        return out
    x = torch.zeros(1, n)
    priv = Privatizer(1.0, 1.0, 2.0, 0.1, noise=src)
    priv.privatize(PerSampleGrads([x]), params_like=[x[0]])
    return priv.privatize(PerSampleGrads([x]), params_like=[x[0]]).grads[0]  # the second: drawn at begin()


PATHS = [
    "poisson uniforms",
    "small float32",
    "chunked float64",
    "chunked bfloat16",
    "started early",
    "streamed",
    "privatizer",
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", ["secret", "secure"])
@pytest.mark.parametrize("path", PATHS)
def test_protecting_normals_are_a_function_of_os_entropy_alone(path, mode, threads, monkeypatch):
    """On every CPU path (one thread or the worker pool, early or streamed, each dtype, the Privatizer's early
    and streamed releases): with os.urandom fixed, two fresh sources draw the same values although torch's,
    numpy's and Python's global generators were seeded differently before each; with the real os.urandom and
    the same global seeds they differ. No protecting draw comes from a user-seedable or torch generator."""
    import random

    import numpy as np

    import dpopt.noise as noise_mod
    import dpopt.privatizer as privatizer_module

    if path == "privatizer" and threads == 2:
        monkeypatch.setattr(privatizer_module, "EARLY_DRAW_MAX", 2 * 2**17)  # this size streams its release
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        real = []
        for _ in range(2):
            torch.manual_seed(0), np.random.seed(0), random.seed(0)
            real.append(_path_draw(path, NoiseSource(mode)))
        assert not torch.equal(real[0], real[1])
        monkeypatch.setattr(noise_mod.os, "urandom", lambda k: bytes((11 * i + 5) % 251 for i in range(k)))
        fixed = []
        for seed in (1, 2):
            torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)
            fixed.append(_path_draw(path, NoiseSource(mode)))
        assert torch.equal(fixed[0], fixed[1])
        assert float(fixed[0].double().abs().max()) > 0
    finally:
        torch.set_num_threads(old)
