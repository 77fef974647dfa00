"""``weighted_sum`` must return fresh tensors: the release writes into them, and the Privatizer refuses
sums that share memory with each other, with live sums of this or the previous step, or with a parameter
or its ``.grad`` (``Privatizer._check_fresh``)."""

from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch

import dpopt.privatizer as privatizer_module
from dpopt.engine.reference import PerSampleGrads
from dpopt.privatizer import Privatizer, _extent, _first_overlap

C, BBAR = 100.0, 4.0  # C large: no example is clipped, the clipped sum is the plain sum


def grads(b: int = 2) -> PerSampleGrads:
    """Example i has every coordinate of both parameters ([2] and [3]) equal to i + 1."""
    return PerSampleGrads([torch.arange(1.0, b + 1).view(-1, 1).expand(b, n).clone() for n in (2, 3)])


class Custom:
    """A hand-written source around a reference one; ``post`` rewrites what its weighted_sum returns."""

    def __init__(self, inner, post, params=None):
        self.inner, self.post, self.params = inner, post, params
        self.num_params, self.batch_size, self.nonfinite = inner.num_params, inner.batch_size, 0

    def sq_norms(self, geometry, groups, num_groups):
        return self.inner.sq_norms(geometry, groups, num_groups)

    def weighted_sum(self, weights, geometry, groups):
        return self.post(self.inner.weighted_sum(weights, geometry, groups))


def priv(sigma: float = 0.0) -> Privatizer:
    return Privatizer(sigma, C, expected_batch_size=BBAR, sample_rate=0.1, generator=torch.Generator().manual_seed(0))


def test_the_release_writes_into_the_returned_sums():
    """What the docstring says: on the CPU the noisy sum is rounded into the sum's own storage and divided
    by B̄ in place, so the released gradient IS the tensor weighted_sum returned (a kept buffer would be
    overwritten by the release, and the release by the buffer's next use)."""
    returned = []

    def keep(sums):
        returned.extend(sums)
        return sums

    p = priv(sigma=1.0)
    rel = p.privatize(Custom(grads(), keep))
    for g, s in zip(rel.grads, returned):
        assert g.data_ptr() == s.data_ptr()
    # σ = 1, C = 100: noise std 25 per coordinate; the clipped sum 1 + 2 = 3 is gone from the tensor
    assert not torch.allclose(returned[0], torch.full((2,), 3.0))


def test_one_tensor_for_two_parameters_is_refused():
    def twice(sums):
        buf = torch.zeros(3)
        return [buf[:2], buf]  # parameter 0's sum is a view into parameter 1's

    p = priv()
    with pytest.raises(ValueError, match=r"shares memory.*weighted_sum\(\)\[0\] and weighted_sum\(\)\[1\]"):
        p.privatize(Custom(grads(), twice))
    assert len(p.ledger) == 0 and p.steps == 0  # nothing released or recorded


def test_a_buffer_kept_across_steps_is_refused_before_the_second_release():
    """Without the check the second step would overwrite the first release with its clipped sum,
    WITHOUT noise, through the buffer the source keeps."""
    bufs = [torch.zeros(2), torch.zeros(3)]

    def into_buffers(sums):
        for b, s in zip(bufs, sums):
            b.copy_(s)
        return bufs

    p = priv(sigma=1.0)
    first = p.privatize(Custom(grads(), into_buffers))
    assert first.grads[0] is bufs[0]  # released: the kept buffer itself
    with pytest.raises(ValueError, match=r"weighted_sum\(\)\[\d\] \(returned in the previous step\)"):
        p.privatize(Custom(grads(), into_buffers))
    assert len(p.ledger) == 1 and p.steps == 1


def test_a_view_of_a_kept_buffer_is_refused_through_its_base():
    flat = torch.zeros(5)

    def views(sums):
        flat.copy_(torch.cat(sums))
        return list(flat.split([2, 3]))  # new view objects every call; the base is the kept buffer

    p = priv()
    rel = p.privatize(Custom(grads(), views))
    del rel  # the released views die; their base lives on in the source
    with pytest.raises(ValueError, match=r"\(its base\) \(returned in the previous step\)"):
        p.privatize(Custom(grads(), views))


def test_a_buffer_reused_by_the_next_micro_batch_is_refused():
    """The first micro-batch's sums are kept until the second is added: refilling them would count the
    second micro-batch twice (sensitivity 2C under noise for C)."""
    bufs = [torch.zeros(2), torch.zeros(3)]

    def into_buffers(sums):
        for b, s in zip(bufs, sums):
            b.copy_(s)
        return bufs

    p = priv()
    with pytest.raises(ValueError, match=r"returned in this step"):
        p.privatize([Custom(grads(), into_buffers), Custom(grads(), into_buffers)])
    assert len(p.ledger) == 0


@pytest.mark.parametrize("which", ["param", "grad"])
def test_a_parameter_or_its_grad_is_refused(which):
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    for q in params:
        q.grad = torch.zeros_like(q)

    def alias(sums):
        target = params[1] if which == "param" else params[1].grad
        with torch.no_grad():
            target.copy_(sums[1])
        return [sums[0], target.detach()]

    p = priv()
    label = "params[1]" if which == "param" else "params[1].grad"
    with pytest.raises(ValueError, match=re.escape(f"(weighted_sum()[1] and {label})")):
        p.privatize(Custom(grads(), alias, params=tuple(params)))
    assert len(p.ledger) == 0  # nothing of the step released
    rel = p.privatize(Custom(grads(), lambda sums: sums, params=tuple(params)))  # the step was discarded
    assert rel.grads[1].tolist() == [0.75] * 3 and len(p.ledger) == 1  # σ = 0: (1 + 2) / B̄


def test_the_tracked_sums_stay_bounded_over_many_micro_batches():
    """The check keeps weak references only to live sums, one per tensor (review of 2026-12-07: it kept one
    per sum and base ever returned in two steps and compared them all, O(micro-batches²) per step). Counted,
    not timed: 300 micro-batches of a source whose sums are views of one fresh buffer each (a base per
    micro-batch) leave at most this step's live sums and bases and the previous step's."""

    def views_of_one(sums):
        return list(torch.cat(sums).split([2, 3]))

    p = priv()
    source = Custom(grads(), views_of_one)
    sizes = []
    for _ in range(3):
        p.begin()
        for _ in range(300):
            p.accumulate(source)
            sizes.append(sum(len(refs) for refs in p._issued))
        p.release()
    # at most the last micro-batch's two views and base (earlier ones died: the running sum is a + b) plus
    # what the previous step left alive; the old check held 300 · 3 here
    assert max(sizes) <= 2 * 3 + 3, max(sizes)
    assert sizes[-1] <= 2 * 3 + 3


def test_disjoint_views_of_one_fresh_buffer_and_kept_releases_are_accepted():
    """A fresh flat buffer split per parameter is fine (disjoint byte ranges), and releases the caller
    keeps alive do not make the next step's fresh sums look shared: exact values over three steps."""

    def split_fresh(sums):
        return list(torch.cat(sums).split([2, 3]))

    p = priv()
    kept = [p.privatize(Custom(grads(), split_fresh)) for _ in range(3)]
    for rel in kept:  # σ = 0: (1 + 2) / B̄ per coordinate
        assert torch.equal(rel.grads[0], torch.full((2,), 0.75)) and torch.equal(rel.grads[1], torch.full((3,), 0.75))
    assert len(p.ledger) == 3
    for clone in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):  # the weak references are not copied
        assert clone.privatize(Custom(grads(), split_fresh)).grads[0].tolist() == [0.75, 0.75]


def test_first_overlap_is_exact_for_contiguous_byte_ranges():
    a = torch.zeros(8)
    assert _first_overlap([a[:4]], [a[4:]]) is None  # adjacent: no shared byte
    assert _first_overlap([a[:5]], [a[4:]]) == (0, 1, True)  # one shared element
    assert _first_overlap([a[4:]], [a[:5]]) == (1, 0, True)  # indices into fresh + others, the earlier start first
    assert _first_overlap([a[:4], a[4:]], []) is None
    assert _first_overlap([a[:4]], [a[1:2], a[2:3]]) is not None
    assert _first_overlap([], [a, a]) is None  # only pairs with a fresh tensor count
    assert _first_overlap([torch.zeros(8)], [a]) is None
    assert _first_overlap([torch.zeros(0)], [a]) is None  # no elements, no memory
    assert _first_overlap([a[::2]], [a[7:]]) is None  # strided: its span, first to last element (0..6)
    assert _first_overlap([a[::2]], [a[5:6]]) is None  # inside the span, between its elements (exact test)
    assert _first_overlap([a[::2]], [a[6:7]]) == (0, 1, True)  # its last element


def test_disjoint_strided_views_of_one_buffer_pass_and_shared_elements_are_found():
    """Spans that overlap where one tensor is strided are compared element by element (review of
    2026-12-07: they were refused by span)."""
    m = torch.randn(4, 6)  # an augmented product: weight [4, 5] and bias [4] as column slices
    w, b = m[:, :5], m[:, 5]
    assert _first_overlap([w, b], []) is None
    assert _first_overlap([w], [m[:, 4]]) == (0, 1, True)  # w's last column
    assert _first_overlap([b], [m[3, :]]) == (0, 1, True)  # m[3, 5] is b[3]; b starts first (m[0, 5])
    z = torch.zeros(())
    assert _first_overlap([z.expand(3, 4), z.expand(5)], []) is None  # one expanded zero, two sums: unwritable
    assert _first_overlap([z.expand(3, 4)], [z.expand(5)]) == (0, 1, True)  # one returned earlier: refused
    assert _first_overlap([z.expand(3, 4), z.view(1)], []) == (0, 1, True)  # one of them writable: refused
    u = torch.zeros(2)
    assert _first_overlap([u[0].expand(3, 4), u[1].expand(5)], []) is None  # two expanded zeros, disjoint
    f = torch.zeros(8)  # a float64 view of a float32 buffer's pairs of elements: byte by byte
    assert _first_overlap([f[::2]], [f.view(torch.float64)[1:2]]) == (0, 1, True)  # bytes 8..15: f[2], f[3]
    assert _first_overlap([f[::4]], [f.view(torch.float64)[1:2]]) is None  # f[0], f[4]: bytes 0..3, 16..19
    assert _extent(torch.zeros(2))[0] == ("cpu", -1)  # device key: (type, index), not get_device() alone


def test_a_strided_overlap_too_large_to_compare_is_refused_as_such(monkeypatch):
    m = torch.randn(4, 6)
    monkeypatch.setattr(privatizer_module, "STRIDED_OVERLAP_MAX", 3)
    assert _first_overlap([m[:, :5], m[:, 5]], []) == (0, 1, False)

    class Augmented:  # weight and bias sums as column slices of one fresh [2, 3] buffer
        num_params, batch_size, nonfinite, params = 2, 1, 0, None

        def sq_norms(self, geometry, groups, num_groups):
            return torch.ones(1, num_groups)

        def weighted_sum(self, weights, geometry, groups):
            out = torch.arange(6.0).view(2, 3)
            return [out[:, :2], out[:, 2]]

    with pytest.raises(ValueError, match="strided sums sharing a buffer are refused"):
        priv().privatize(Augmented())
    monkeypatch.undo()
    rel = priv().privatize(Augmented())  # compared element by element: accepted, exact values (σ = 0, ÷ B̄)
    assert rel.grads[0].tolist() == [[0.0, 0.25], [0.75, 1.0]] and rel.grads[1].tolist() == [0.5, 1.25]


def test_unused_parameters_sharing_one_expanded_zero_are_released():
    """A source that returns one expanded zero for its unused parameters: accepted, each released on its own
    (the release rounds a broadcast sum into a new tensor), exact values at σ = 0."""

    class Unused:
        num_params, batch_size, nonfinite, params = 3, 1, 0, None

        def sq_norms(self, geometry, groups, num_groups):
            return torch.ones(1, num_groups)

        def weighted_sum(self, weights, geometry, groups):
            z = torch.zeros(())
            return [torch.full((2,), 4.0), z.expand(3, 2), z.expand(5)]

    rel = priv().privatize(Unused())
    assert rel.grads[0].tolist() == [1.0, 1.0]  # 4 / B̄
    assert torch.equal(rel.grads[1], torch.zeros(3, 2)) and torch.equal(rel.grads[2], torch.zeros(5))


def test_a_refused_accumulate_discards_the_step_so_begin_starts_the_next():
    """By hand (begin / accumulate / release, as a custom loop drives the Privatizer): a refusal in
    accumulate discards the step — nothing accumulated survives into the next one, begin() works again,
    and the next step releases exactly the fresh source's clipped sum (σ = 0), once."""

    def twice(sums):
        buf = torch.zeros(3)
        return [buf[:2], buf]

    p = priv()
    p.begin()
    p.accumulate(grads())  # a good micro-batch first: its sum must not leak into the next step
    with pytest.raises(ValueError, match="shares memory"):
        p.accumulate(Custom(grads(), twice))
    p.begin()  # was: "begin() called twice without release()"
    p.accumulate(grads())
    rel = p.release()
    # examples 1 and 2, no clipping at C = 100: the sum is 3 per coordinate, ÷ B̄ = 4
    assert torch.equal(rel.grads[0], torch.full((2,), 0.75)) and torch.equal(rel.grads[1], torch.full((3,), 0.75))
    assert len(p.ledger) == 1 and p.steps == 1
