"""capture.leaves: its walk of the common structures gives exactly torch's pytree order (the hooks' versions,
the recorded inputs and the lifted layers' shapes all read it)."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._pytree import tree_flatten

from dpopt.engine.capture import leaves

Pair = namedtuple("Pair", "a b")


class Sub(torch.Tensor):
    """A tensor subclass: not a plain tensor, so leaves() hands it to tree_flatten."""


def _by_pytree(obj):
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _tensors():
    return st.integers(0, 3).map(
        lambda k: [
            torch.zeros(2),
            nn.Parameter(torch.ones(3)),
            torch.zeros(1).as_subclass(Sub),
            torch.zeros(()),
        ][k]
    )


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), st.text(max_size=2))

_trees = st.recursive(
    st.one_of(_tensors(), _scalars),
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=2), kids, max_size=3),
        st.tuples(kids, kids).map(lambda ab: Pair(*ab)),
        st.dictionaries(st.text(max_size=2), kids, max_size=2).map(OrderedDict),
        st.just(torch.Size([2, 3])),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(_trees)
def test_leaves_are_the_pytree_leaves_in_order(tree):
    got, want = leaves(tree), _by_pytree(tree)
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))


def test_the_usual_call_shapes():
    x, w = torch.zeros(4, 3), nn.Parameter(torch.ones(3))
    assert leaves(((x,), {})) == [x] and leaves(x) == [x]
    got = leaves(((x, 2, None, [w, (x,)]), {}))
    assert [id(t) for t in got] == [id(x), id(w), id(x)]
    kw = leaves(((x,), {"mask": w}))  # a dict with entries: pytree's order
    assert [id(t) for t in kw] == [id(t) for t in _by_pytree(((x,), {"mask": w}))]
    assert leaves(((), {})) == [] and leaves(3) == []
