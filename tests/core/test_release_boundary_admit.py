"""One check decides whether a step may release, and as which release: ``ReleaseBoundary.admit(release)``.

The Poisson tags (a batch make_private's loader drew, released once: ValueError) and the cyclic positions of
correlated noise (release t holds the batch of step t: RuntimeError) used to be checked in two places (the
boundary before the step, the optimizer's release after it). Now ``admit`` decides both by the kind of the
loader's sampler, before anything of the step is read, and leaves the boundary as it was when it refuses;
the pure-noise release of a cyclic batch the loop skipped passes the same position rule. A refused step is
noted ONCE, in ``PrivateOptimizer.step``: stepping again and again without a new backward says the refusal
with the "repeats a refused step" suffix exactly once, whichever door refused.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from test_release_boundary_poisson_tags import _private
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt
from dpopt.release_boundary import NOTHING_RELEASED, ChunkTag, ReleaseBoundary

REPEAT = "repeats a refused step"


def _boundary(sampler) -> ReleaseBoundary:
    bd = ReleaseBoundary()
    bd.expect_tags(sampler)
    return bd


def _tag(batch: int, position=None) -> ChunkTag:
    return ChunkTag(batch=batch, chunk=0, chunks=1, examples=3, position=position)


# -- the check itself: one method, the sampler's rule ----------------------------------------------------------


def test_a_loader_that_does_not_tag_is_not_checked():
    bd = ReleaseBoundary()
    for release in (0, 1, 7):
        bd.admit(release)  # no expect_tags: nothing to compare with (poisson_sampling=False)


def test_poisson_rule_a_drawn_batch_released_once():
    sampler = SimpleNamespace(drawn=0)
    bd = _boundary(sampler)
    assert not bd.cyclic
    with pytest.raises(ValueError, match="no batch of the data loader make_private returned") as err:
        bd.admit(0)
    assert str(err.value).endswith(NOTHING_RELEASED)
    sampler.drawn = 1  # the loader draws batch 1 and hands its tag out
    bd.hand(_tag(bd.new_batch()))
    bd.admit(0)
    bd.admit(5)  # the release index plays no part for Poisson batches
    bd.begin()
    bd.end()  # batch 1 released
    with pytest.raises(ValueError, match="already released") as err:
        bd.admit(1)
    assert str(err.value).endswith(NOTHING_RELEASED)
    assert bd.released == 1 and bd.current == _tag(1)  # a refusal leaves the boundary as it was
    sampler.drawn = 2  # a Poisson batch drawn around the loader (Opacus's BatchMemoryManager): one release
    bd.admit(1)
    assert bd.current is None  # the stale tag is forgotten: the step is untagged
    bd.begin()
    bd.end()
    with pytest.raises(ValueError, match="no batch of the data loader make_private returned"):
        bd.admit(2)  # one untagged release per batch drawn, not two


def test_cyclic_rule_release_t_holds_the_batch_of_step_t():
    bd = _boundary(SimpleNamespace(clock=None))
    assert bd.cyclic
    with pytest.raises(RuntimeError, match=r"release 1 \(1-based\) holds a batch that the cyclic loader") as err:
        bd.admit(0)
    assert NOTHING_RELEASED in str(err.value)
    bd.hand(_tag(bd.new_batch(), position=2))
    bd.admit(2)
    for release, shown in ((3, "release 4"), (1, "release 2")):  # a second step on it; a step ahead of it
        with pytest.raises(RuntimeError, match=rf"{shown} \(1-based\) would hold the cyclic batch of step 3") as err:
            bd.admit(release)
        assert NOTHING_RELEASED in str(err.value)
    assert bd.current == _tag(1, position=2) and bd.released == 0  # refusals change nothing


def test_a_skipped_cyclic_batch_is_released_as_noise_only_at_its_own_position():
    """The pure-noise release of a batch handed out and never stepped passes admit's position rule."""
    skipped: list = []

    class Owner:
        _open = False
        privatizer = SimpleNamespace(steps=4)

        def _release_skipped_batch(self):
            skipped.append(self.privatizer.steps)

    owner = Owner()
    bd = _boundary(SimpleNamespace(clock=None))
    bd.bind(owner)
    bd.hand(_tag(bd.new_batch(), position=4), owed=True)
    bd.hand(_tag(bd.new_batch(), position=5), owed=True)  # batch of step 4 skipped: released at release 4
    assert skipped == [4]
    owner.privatizer.steps = 6  # (had two releases happened meanwhile) release 6 may not hold step 5's batch
    with pytest.raises(RuntimeError, match=r"release 7 \(1-based\) would hold the cyclic batch of step 6"):
        bd.leave()
    assert skipped == [4]


# -- the one place a refusal is noted: a repeat says it again, its suffix once ---------------------------------


def _poisson_engine():
    """64 examples in shuffled batches of 8 through make_private (SGD, σ = 1, C = 1): the Poisson-tag tests' setup."""
    return _private()


def _cyclic_engine():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 2), torch.zeros(32, dtype=torch.long))
    model = nn.Linear(2, 2)
    engine = dpopt.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=model,
            optimizer="dp-sgd",
            data_loader=DataLoader(data, batch_size=8),
            lr=0.1,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            noise_mechanism="banded:4",
            epochs=2,
        )
    return engine, model, opt, loader, None


def _refuse_original_loader(engine, model, opt, loader, original):
    x, y = next(iter(original))  # the original loader's batch: no Poisson sample
    nn.functional.cross_entropy(model(x), y).backward()
    return ValueError, "no batch of the data loader make_private returned"


def _refuse_second_cyclic_step(engine, model, opt, loader, original):
    x, y = next(iter(loader))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()  # the same batch again: release 2 would hold step 1's
    return RuntimeError, r"release 2 \(1-based\) would hold the cyclic batch of step 1"


def _refuse_repeated_rows(engine, model, opt, loader, original):
    x, y = next(batch for batch in loader if len(batch[0]))  # the first non-empty batch handed out
    nn.functional.cross_entropy(model(torch.cat([x, x])), torch.cat([y, y])).backward()  # rows > examples
    return ValueError, "more rows than the data loader's last batch had examples"


@pytest.mark.parametrize(
    "make, refuse",
    [
        (_poisson_engine, _refuse_original_loader),  # admit, Poisson tags
        (_cyclic_engine, _refuse_second_cyclic_step),  # admit, cyclic positions
        (_poisson_engine, _refuse_repeated_rows),  # the accumulate block (rows-vs-examples check)
    ],
)
def test_a_refusal_stepped_again_and_again_says_the_suffix_exactly_once(make, refuse):
    engine, model, opt, loader, original = make()
    cls, match = refuse(engine, model, opt, loader, original)
    entries = len(engine.ledger)
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(cls, match=match) as first:
        opt.step()
    assert REPEAT not in str(first.value)
    for _ in range(3):  # the 2nd, 3rd and 4th step() without a new backward
        with pytest.raises(cls, match=match) as again:
            opt.step()
        assert type(again.value) is cls
        text = str(again.value)
        assert text.startswith(str(first.value)) and text.count(REPEAT) == 1
        assert opt._refusal == (cls, str(first.value))  # the noted refusal stays the first one, suffix-free
    assert len(engine.ledger) == entries  # nothing released or charged by any of them
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    opt.zero_grad()  # forgets the refusal; a step without records is refused (by admit, or "without a backward
    for _ in range(2):  # pass") and not noted: judged afresh on the same state each time, never with the suffix
        with pytest.raises((ValueError, RuntimeError)) as bare:
            opt.step()
        assert REPEAT not in str(bare.value) and opt._refusal is None
    assert len(engine.ledger) == entries
