"""No replayable copies (issue 19, item 4): a copy, pickle, ``torch.save`` or forked child of a
secret noise source re-seeds from OS entropy; reproducible sources keep their state.

"Draws differ" fails only if two independent OS-entropy MT19937 states give the same 200 normals
(probability far below 2^-1000); "draws equal" is checked bit for bit.
"""

import copy
import io
import os
import pickle

import pytest
import torch
from torch import nn

import dpopt
from dpopt.engine.reference import PerSampleGrads
from dpopt.methods import make_optimizer
from dpopt.noise import NORMAL_CHUNK, CpuNormalDraw, NoiseSource, _mt_state_layout
from dpopt.privatizer import Privatizer
from dpopt.sampling import PoissonSampler


def _torch_round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {
    "pickle": lambda o: pickle.loads(pickle.dumps(o)),
    "deepcopy": copy.deepcopy,
    "copy": copy.copy,
    "torch.save": _torch_round_trip,
}


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("mode", ["secret", "secure"])
def test_copies_of_a_secret_source_draw_other_noise(mode, how):
    src = NoiseSource(mode)
    src.normal((10,))  # the generator exists now
    clone = COPIES[how](src)
    assert clone.mode == mode
    assert not torch.equal(src.normal((200,)), clone.normal((200,)))


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_copies_of_a_reproducible_source_replay_it(how):
    src = NoiseSource("reproducible", seed=4)
    src.normal((10,))
    clone = COPIES[how](src)
    assert torch.equal(src.normal((200,)), clone.normal((200,)))


def test_a_shallow_copy_of_a_reproducible_source_shares_its_stream():
    src = NoiseSource("reproducible", seed=4)
    src.normal((10,))
    clone = copy.copy(src)
    assert clone._generators["cpu"] is src._generators["cpu"]


def test_a_pickle_of_a_secret_source_holds_none_of_its_generator_state():
    """The MT19937 state of the uniforms reaches neither a pickle nor torch.save (the normals' sampler keeps no
    generator object between draws: each chunk's SFC64 state lives in the compiled kernel's call)."""
    src = NoiseSource("secret")
    src.normal((10,))
    src.uniform(10)
    at, width = _mt_state_layout()
    state = src._generators["cpu"].get_state().numpy().tobytes()[at : at + 624 * width]
    blob = pickle.dumps(src)
    buf = io.BytesIO()
    torch.save(src, buf)
    pieces = [state[i : i + 16] for i in range(0, len(state) - 16, 16 * 39)]  # of the 4,992-byte state
    for piece in pieces:
        assert piece not in blob and piece not in buf.getvalue()


def _release(priv: Privatizer) -> torch.Tensor:
    return priv.privatize(PerSampleGrads([torch.zeros(2, 100)])).grads[0]


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_copied_privatizer_draws_other_noise(how):
    priv = Privatizer(1.0, 1.0, 4.0, 0.1)
    _release(priv)
    clone = COPIES[how](priv)
    assert clone.ledger is not priv.ledger and len(clone.ledger) == len(priv.ledger) == 1
    assert not torch.equal(_release(priv), _release(clone))


def test_copied_reproducible_privatizer_replays():
    priv = Privatizer(1.0, 1.0, 4.0, 0.1, generator=torch.Generator().manual_seed(3))
    clone = copy.deepcopy(priv)
    assert torch.equal(_release(priv), _release(clone))


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_copied_dp_optimizer_draws_other_noise(how):
    """Users deep-copy optimizers (EMA, SWA): the copy's step must not replay the original's noise."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    opt = make_optimizer(
        "dp-sgd", model.parameters(), noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.1, lr=0.1
    )
    pair = COPIES[how]((model, opt))
    grads = PerSampleGrads([torch.zeros(2, 3, 5), torch.zeros(2, 3)])
    opt.step(grads)
    pair[1].step(grads)
    assert not torch.equal(model.weight, pair[0].weight)


def test_copied_poisson_sampler_draws_other_masks():
    sampler = PoissonSampler(400, 0.5, 3)
    clone = copy.deepcopy(sampler)
    assert [b.tolist() for b in sampler] != [b.tolist() for b in clone]  # equal w.p. 2^-1200


def test_copied_privacy_engine_optimizer_draws_other_noise():
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    model = nn.Linear(4, 2)
    engine = dpopt.PrivacyEngine()
    with pytest.warns(UserWarning, match="poisson_sampling=False"):  # both optimizers step on one given batch
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=torch.utils.data.DataLoader(data, batch_size=8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
        )
    twin_model, twin_opt = copy.deepcopy((model, opt))
    x, y = data.tensors
    for m, o in ((model, opt), (twin_model, twin_opt)):
        o.zero_grad()
        nn.functional.cross_entropy(m(x[:8]), y[:8]).backward()
        o.step()
    assert not torch.equal(model.weight, twin_model.weight)


def _fork_draw(src: NoiseSource, n: int) -> torch.Tensor:
    """The child's first draw (bytes through a pipe), then the parent's next draw."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: draw, send, leave without running the parent's atexit handlers
        try:
            os.write(write, src.normal((n,), dtype=torch.float64).numpy().tobytes())
        finally:
            os._exit(0)
    os.close(write)
    data = b""
    while len(data) < 8 * n:
        part = os.read(read, 8 * n - len(data))
        if not part:
            break
        data += part
    os.close(read)
    os.waitpid(pid, 0)
    assert len(data) == 8 * n, "the child sent no draw"
    return torch.frombuffer(bytearray(data), dtype=torch.float64)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_reseeds_secret_noise():
    src = NoiseSource("secret")
    src.normal((10,))
    child = _fork_draw(src, 200)
    assert not torch.equal(child, src.normal((200,), dtype=torch.float64))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_keeps_reproducible_noise():
    src = NoiseSource("reproducible", seed=8)
    src.normal((10,))
    child = _fork_draw(src, 200)
    assert torch.equal(child, src.normal((200,), dtype=torch.float64))


# -- every written form, byte for byte (issue 34 review): no secret state of the source or of a started draw --


def _secret_pieces(src: NoiseSource, draw=None) -> list[bytes]:
    """Byte strings of the secret state a source holds in memory (each ≥ 64 random bits, so a chance match in
    a blob of L bytes has probability ≤ L·2^-64): 16-byte pieces of the MT19937 state of the uniforms, and of a
    started draw its 24-byte chunk states and its first computed normals."""
    pieces = []
    if "cpu" in src._generators:
        at, width = _mt_state_layout()
        mt = src._generators["cpu"].get_state().numpy().tobytes()[at : at + 624 * width]
        pieces += [mt[i : i + 16] for i in range(0, len(mt) - 16, 16 * 13)]
    if draw is not None:
        draw.start()  # a deferred draw (no core spare beside torch's threads): its workers compute it now
        for fut in draw._futures:
            fut.result()
        pieces += list(draw._states)
        if draw._values is not None:
            pieces += [draw._values[i : i + 1].numpy().tobytes() for i in range(0, draw.n, NORMAL_CHUNK // 2)]
    return pieces


def _written(obj) -> list[bytes]:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return [pickle.dumps(obj), buf.getvalue()]


@pytest.mark.parametrize("threads", [1, 2])
def test_nothing_written_from_a_secret_privatizer_mid_step_holds_a_secret(threads):
    """Between begin() and release() the Privatizer holds the step's started draw (its chunk states, its
    computed noise) and its source the uniforms' MT19937 state: a pickle,
    torch.save, state_dict or deepcopy of it carries none of them."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        priv = Privatizer(1.0, 1.0, 2.0, 0.1)
        x = torch.zeros(1, 3 * NORMAL_CHUNK + 5)
        priv.privatize(PerSampleGrads([x]), params_like=[x[0]])  # learns the size
        priv.noise.uniform(10)
        priv.begin()  # the next step's draw starts now (secret)
        draw = priv._pending
        assert isinstance(draw, CpuNormalDraw) and draw._states and len(draw._states) == 4
        pieces = _secret_pieces(priv.noise, draw)
        assert len(pieces) > 30
        blobs = _written(priv) + _written(priv.state_dict())
        for piece in pieces:
            assert all(piece not in blob for blob in blobs)
        twin = copy.deepcopy(priv)
        assert twin._pending is None and twin.noise._generators == {}
        assert twin.noise._pool is None
    finally:
        torch.set_num_threads(old)


def test_nothing_written_from_private_optimizers_holds_a_secret(tmp_path):
    """A PrivacyEngine optimizer (and its Poisson loader's masks) and a make_optimizer one, after a release of
    more than one chunk on 2 threads: torch.save of optimizer.state_dict(), the engine's checkpoint file and
    a pickle of the Privatizer carry no state of the secret source; a deepcopy holds none either."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(8, 520), torch.randint(0, 2, (8,)))
        model = nn.Linear(520, 256)  # 133,376 parameters: two chunks
        engine = dpopt.PrivacyEngine()
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=torch.utils.data.DataLoader(data, batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
        xb, yb = next(iter(loader))  # q = 0.5: the masks are drawn
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        src = opt.privatizer.noise
        assert "cpu" in src._generators  # the masks were drawn
        engine.save_checkpoint(path=tmp_path / "ck.pt", module=model, optimizer=opt)
        blobs = _written(opt.state_dict()) + [(tmp_path / "ck.pt").read_bytes(), pickle.dumps(opt.privatizer)]
        small = nn.Linear(600, 500)  # 300,500 parameters
        opt2 = make_optimizer(
            "dp-sgd", small.parameters(), noise_multiplier=1.0, expected_batch_size=4.0, sample_rate=0.1, lr=0.1
        )
        opt2.step(PerSampleGrads([torch.zeros(2, 500, 600), torch.zeros(2, 500)]))
        blobs += _written(opt2.state_dict()) + _written(opt2)
        pieces = _secret_pieces(src) + _secret_pieces(opt2.privatizer.noise)
        assert len(pieces) >= 24  # 24 pieces of the masks' MT19937 state
        for piece in pieces:
            assert all(piece not in blob for blob in blobs)
        twin_model, twin = copy.deepcopy((model, opt))
        assert twin.privatizer.noise._generators == {}
    finally:
        torch.set_num_threads(old)


def _in_child(fn) -> bytes:
    """The (short) bytes ``fn()`` returns in a forked child, through a pipe (the child leaves without the
    parent's atexit handlers)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, fn())
        finally:
            os._exit(0)
    os.close(write)
    data = os.read(read, 4096)
    os.close(read)
    os.waitpid(pid, 0)
    return data


def _sha(t: torch.Tensor) -> bytes:
    import hashlib

    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).digest()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("mode", ["secret", "secure"])
def test_a_forked_child_replays_no_protecting_draw_of_its_parent(mode):
    """Forked mid-step on 2 threads (worker pool, SFC64 objects and the step's started draw alive in the
    parent; the child runs on one, as a DataLoader worker does): the child's release, its next chunked draw (3 chunks) and its Poisson uniforms each differ from
    the parent's (equal with probability ≤ 2^-190 for independent OS-entropy states)."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        priv = Privatizer(1.0, 1.0, 2.0, 0.1, secure_mode=mode == "secure")
        x = torch.zeros(1, 2 * NORMAL_CHUNK + 5)
        priv.privatize(PerSampleGrads([x]), params_like=[x[0]])  # learns the size; pool and SFC64 objects exist
        priv.noise.uniform(10)
        priv.begin()
        priv.accumulate(PerSampleGrads([x]))
        assert isinstance(priv._pending, CpuNormalDraw)  # the step's draw, started before the fork

        def draws() -> bytes:
            rel = priv.release().grads[0]
            assert float(rel.abs().max()) > 0
            more = priv.noise.normal((3 * NORMAL_CHUNK,), dtype=torch.float64)
            return _sha(rel) + _sha(more) + _sha(priv.noise.uniform(1000))

        def child() -> bytes:
            torch.set_num_threads(1)  # torch's OpenMP team is not fork-safe (as in DataLoader workers)
            return (b"refused" if not priv._pending.usable else b"kept!!!") + draws()

        theirs = _in_child(child)
        ours = draws()
        assert theirs[:7] == b"refused" and len(theirs) == 7 + 96, theirs[:7]
        for k, what in enumerate(("release", "chunked draw", "uniforms")):
            assert theirs[7 + 32 * k : 7 + 32 * (k + 1)] != ours[32 * k : 32 * (k + 1)], what
    finally:
        torch.set_num_threads(old)
