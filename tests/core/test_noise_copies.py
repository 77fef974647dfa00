"""No replayable copies (issue 19, item 4): a copy, pickle, ``torch.save`` or forked child of a
secret noise source re-seeds from OS entropy; reproducible sources keep their state.

"Draws differ" fails only if two independent OS-entropy MT19937 states give the same 200 normals
(probability far below 2^-1000); "draws equal" is checked bit for bit.
"""

import copy
import io
import os
import pickle

import numpy as np
import pytest
import torch
from torch import nn

import dpopt
from dpopt.engine.reference import PerSampleGrads
from dpopt.methods import make_optimizer
from dpopt.noise import NoiseSource, _mt_state_layout
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
    """Neither the MT19937 state of the uniforms nor the SFC64 state the normals' sampler left in its
    re-used per-thread bit generator reaches a pickle or torch.save."""
    src = NoiseSource("secret")
    src.normal((10,))
    src.uniform(10)
    at, width = _mt_state_layout()
    state = src._generators["cpu"].get_state().numpy().tobytes()[at : at + 624 * width]
    assert src._bitgens  # the normals' SFC64 object is kept for re-use, with its last state
    sfc = np.concatenate([bg.state["state"]["state"][:3] for bg in src._bitgens.values()]).tobytes()
    blob = pickle.dumps(src)
    buf = io.BytesIO()
    torch.save(src, buf)
    pieces = [state[i : i + 16] for i in range(0, len(state) - 16, 16 * 39)]  # of the 4,992-byte state
    pieces += [sfc[i : i + 8] for i in range(0, len(sfc), 8)]  # every 64-bit word of a, b, c
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
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(data, batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
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
