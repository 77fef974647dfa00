"""Opacus's per-layer grad-sample configurations through both of dpopt's doors (issue 33, case 9).

The layer kinds and argument grids of Opacus's ``opacus/tests/grad_samples``
suite, re-created here (smaller grids, same kinds): Linear, Conv1d/2d/3d
(padding ints, ``"same"``, ``"valid"``; stride; dilation; groups), LayerNorm,
GroupNorm, InstanceNorm1d/2d/3d (affine), Embedding (2-4 dim index inputs,
batch-first and sequence-first ``[T, B, ...]`` as Opacus's ``embedding_test.py``
builds them), EmbeddingBag (one bag per row), RNN/GRU/LSTM (layers,
bidirectional, ``batch_first`` both ways) and MultiheadAttention.

Each configuration goes through

* the engine door, :func:`dpopt.engine.iter_per_sample_sources` (``batch_dim=1``
  for sequence-first inputs);
* the hook door, :class:`dpopt.engine.hooks.HookCapture` (the capture
  ``PrivacyEngine.make_private`` installs), and ``make_private`` itself (one
  step, σ = 0, no clipping: the release is the summed gradient over the
  expected batch size; ``batch_first=False`` where Opacus uses it).

Each must give per-example gradients equal to a single-example autograd loop
(float64, relative error ≤ 1e-9), or refuse with a ValueError saying what to
change. Any other exception (an IndexError, a size mismatch from the
internals) fails the test. Expected: the engine door computes every
configuration (sequence-first ones with ``batch_dim=1``; a layer without
parameters gives an empty source); the hook door and ``make_private`` compute
every batch-first one and refuse the sequence-first ones (``batch_first=False``
in the layer or in ``make_private``) and a model without parameters.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from per_example_zoo import per_example_from_source, rel_err
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpopt import PrivacyEngine
from dpopt.engine import iter_per_sample_sources
from dpopt.engine.hooks import HookCapture

DT = torch.float64
B = 3


class First(nn.Module):
    """The first output of a layer that returns a tuple (RNNs, MultiheadAttention as self-attention)."""

    def __init__(self, layer: nn.Module, attention: bool = False):
        super().__init__()
        self.layer, self.attention = layer, attention

    def forward(self, x):
        return (self.layer(x, x, x, need_weights=False) if self.attention else self.layer(x))[0]


def _configs() -> dict:
    """name -> (builder, x builder(b) -> input, batch_dim of x and of the output)."""
    out: dict = {}

    def add(name, build, make_x, bd=0):
        out[name] = (build, make_x, bd)

    def randn(*shape, bd=0):
        return lambda b: torch.randn(*shape[:bd], b, *shape[bd:], dtype=DT)

    for dims, bias in itertools.product((1, 2, 3), (True, False)):
        add(f"linear-d{dims}-bias{bias}", lambda bias=bias: nn.Linear(4, 3, bias=bias), randn(*[2] * (dims - 1), 4))
    conv_specs = [
        (0, 1, 1, 1),
        (2, 1, 1, 1),
        (1, 2, 1, 1),
        (0, 1, 2, 1),
        (1, 2, 2, 2),
        ("same", 1, 1, 1),
        ("same", 1, 2, 2),
        ("valid", 1, 1, 1),
        ("valid", 2, 1, 2),
    ]
    conv_kinds = {1: (nn.Conv1d, (9,)), 2: (nn.Conv2d, (7, 6)), 3: (nn.Conv3d, (5, 5, 5))}
    for nd, (cls, spatial) in conv_kinds.items():
        for (pad, stride, dil, groups), (cin, cout), kernel in itertools.product(conv_specs, ((2, 4), (1, 1)), (2, 3)):
            if groups > 1 and cin == 1:
                cin, cout = 2, 2
            name = f"conv{nd}d-k{kernel}-c{cin}x{cout}-p{pad}-s{stride}-d{dil}-g{groups}"
            add(
                name,
                lambda cls=cls, cin=cin, cout=cout, k=kernel, p=pad, s=stride, d=dil, g=groups: cls(
                    cin, cout, k, stride=s, padding=p, dilation=d, groups=g
                ),
                randn(cin, *spatial),
            )
    for shape, affine in itertools.product(((5,), (3, 5)), (True, False)):
        add(
            f"layernorm-{shape}-affine{affine}",
            lambda s=shape, a=affine: nn.LayerNorm(s, elementwise_affine=a),
            randn(2, *shape) if len(shape) == 1 else randn(*shape),
        )
    for groups, spatial in itertools.product((1, 2, 4), ((), (5,), (3, 4))):
        if groups == 4 and not spatial:
            continue  # one value per group: torch refuses it for any batch
        add(f"groupnorm-g{groups}-{len(spatial)}d", lambda g=groups: nn.GroupNorm(g, 4), randn(4, *spatial))
    for nd, spatial in ((1, (7,)), (2, (4, 5)), (3, (3, 3, 4))):
        cls = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[nd]
        for c in (1, 3):
            add(f"instancenorm{nd}d-c{c}", lambda cls=cls, c=c: cls(c, affine=True), randn(c, *spatial))
    add("embedding-1d", lambda: nn.Embedding(9, 5), lambda b: torch.randint(0, 9, (b,)))
    for dim, batch_first in itertools.product((2, 3, 4), (True, False)):
        rest = [4, 2, 2][: dim - 1]  # Opacus's [N, T, Q, R]: with batch_first=False dim 1 holds the examples
        bd = 0 if batch_first else 1

        def idx(b, rest=rest, bd=bd):
            shape = list(rest)
            shape.insert(bd, b)
            return torch.randint(0, 9, shape)

        add(f"embedding-{dim}d-batchfirst{batch_first}", lambda: nn.Embedding(9, 5), idx, bd)
    for mode in ("sum", "mean", "max"):
        add(f"embeddingbag-{mode}", lambda m=mode: nn.EmbeddingBag(9, 5, mode=m), lambda b: torch.randint(0, 9, (b, 4)))
    for cls, layers, bidi, batch_first in itertools.product(
        (nn.RNN, nn.GRU, nn.LSTM), (1, 2), (False, True), (True, False)
    ):
        bd = 0 if batch_first else 1
        add(
            f"{cls.__name__.lower()}-l{layers}-bi{bidi}-batchfirst{batch_first}",
            lambda cls=cls, n=layers, bi=bidi, bf=batch_first: First(
                cls(3, 4, num_layers=n, bidirectional=bi, batch_first=bf)
            ),
            randn(4, 3, bd=bd) if batch_first else randn(4, 3, bd=1),
            bd,
        )
    for batch_first, bias in itertools.product((True, False), (True, False)):
        bd = 0 if batch_first else 1
        add(
            f"mha-batchfirst{batch_first}-bias{bias}",
            lambda bf=batch_first, bias=bias: First(nn.MultiheadAttention(4, 2, bias=bias, batch_first=bf), True),
            randn(3, 4, bd=bd),
            bd,
        )
    return out


CONFIGS = _configs()


def _case(name, b=B, seed=0):
    build, make_x, bd = CONFIGS[name]
    torch.manual_seed(seed)
    model = build().to(DT)
    with torch.no_grad():  # away from the (1, 0) initialisation of norm layers: a real test
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = make_x(b)
    with torch.no_grad():
        y = torch.randn(model(x).movedim(bd, 0).shape, dtype=DT)
    return model, x, y, bd


def _loss(bd):
    """Opacus's L1 loss on the output with its examples moved to dim 0 (summed over one example)."""
    return lambda out, target: nn.functional.l1_loss(out.movedim(bd, 0), target, reduction="sum")


def _truth(model, x, y, bd):
    """Per-example gradients by a single-example autograd loop."""
    loss, params = _loss(bd), [p for p in model.parameters() if p.requires_grad]
    if not params:
        return []
    rows = []
    for i in range(x.shape[bd]):
        li = loss(model(x.narrow(bd, i, 1)), y[i : i + 1])
        rows.append(torch.autograd.grad(li, params, allow_unused=True))
    return [
        torch.stack([r[k] if r[k] is not None else torch.zeros_like(p) for r in rows]) for k, p in enumerate(params)
    ]


def _refusal(err: Exception) -> bool:
    """A clear refusal: a ValueError (or TypeError/NotImplementedError) with advice, not an internal crash."""
    return type(err) in (ValueError, TypeError, NotImplementedError) and len(str(err)) > 40


def _outcome(run) -> str:
    try:
        run()
    except Exception as err:  # noqa: BLE001 - classified: a refusal passes, anything else fails
        if _refusal(err):
            return "refused"
        raise
    return "ok"


def engine_door(name) -> str:
    model, x, y, bd = _case(name)
    truth = _truth(model, x, y, bd)

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            src = next(iter(iter_per_sample_sources(model, _loss(bd), x, y, batch_dim=bd)))
        sq, grads = per_example_from_source(src, len(truth))
        assert rel_err(grads, truth) <= 1e-9, name
        want_sq = torch.stack([t.flatten(1).square().sum(1) for t in truth], 1)
        assert rel_err([sq], [want_sq]) <= 1e-9, name

    return _outcome(run)


def hook_door(name, reduction) -> str:
    model, x, y, bd = _case(name)
    truth = _truth(model, x, y, bd)

    def run():
        cap = HookCapture(model, loss_reduction=reduction)
        try:
            total = _loss(bd)(model(x), y)
            (total if reduction == "sum" else total / x.shape[bd]).backward()
            src = cap.collect()
        finally:
            cap.detach()
        _, grads = per_example_from_source(src, len(truth))
        assert rel_err(grads, truth) <= 1e-9, name

    return _outcome(run)


def make_private_door(name) -> str:
    model, x, y, bd = _case(name)
    truth = _truth(model, x, y, bd)

    def run():
        xs = x.movedim(bd, 0) if x.dim() > 1 else x  # the loader holds examples along dim 0
        loader = DataLoader(TensorDataset(xs, y), batch_size=B)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = PrivacyEngine()
            m, opt, _ = engine.make_private(
                module=model,
                optimizer=optimizer,
                data_loader=loader,
                noise_multiplier=0.0,
                max_grad_norm=1e9,
                poisson_sampling=False,
                batch_first=bd == 0,
                loss_reduction="sum",
                criterion=nn.L1Loss(reduction="sum"),
            )
            _loss(bd)(m(x), y).backward()
            opt.step()
        for p, t in zip([p for p in model.parameters() if p.requires_grad], truth):
            torch.testing.assert_close(p.grad, t.sum(0) / opt.expected_batch_size, rtol=1e-9, atol=1e-12)
        opt.zero_grad()

    return _outcome(run)


SEQUENCE_FIRST = [n for n, c in CONFIGS.items() if c[2] != 0]
NO_PARAMETERS = [n for n in CONFIGS if not list(CONFIGS[n][0]().parameters())]
#: Sequence-first configurations whose layer declares the layout (``batch_first=False``): the hook door
#: sees it and refuses. An Embedding has no such flag: through HookCapture (which takes dim 0 of every
#: layer call as the example axis, by contract) its positions would be rows; the declared doors are
#: ``batch_dim=1`` (engine) and ``make_private(batch_first=False)`` (refused), both tested here.
HOOK_SEES_LAYOUT = [n for n in SEQUENCE_FIRST if not n.startswith("embedding")]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_door(name):
    if name in NO_PARAMETERS:  # nothing to privatize: an empty source, no crash
        model, x, y, bd = _case(name)
        src = next(iter(iter_per_sample_sources(model, _loss(bd), x, y, batch_dim=bd)))
        assert src.batch_size == B and not list(src.params)
        return
    assert engine_door(name) == "ok"  # the engine door takes batch_dim=1: every configuration is computed


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in SEQUENCE_FIRST or n in HOOK_SEES_LAYOUT])
def test_hook_door(name, reduction):
    want = "refused" if name in HOOK_SEES_LAYOUT or name in NO_PARAMETERS else "ok"
    assert hook_door(name, reduction) == want


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in NO_PARAMETERS])  # torch's optimizer refuses those
def test_make_private_door(name):
    assert make_private_door(name) == ("refused" if name in SEQUENCE_FIRST else "ok")


def test_make_private_refuses_batch_first_false_with_advice():
    model, x, y, _ = _case("embedding-2d-batchfirstFalse")
    loader = DataLoader(TensorDataset(x.t(), y), batch_size=B)
    with pytest.raises(ValueError, match=r"batch_first=False is not supported.*transpose\(0, 1\)"):
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            batch_first=False,
        )


@pytest.mark.parametrize("engine", ["fast", "reference"])
@pytest.mark.parametrize("seq, b, dims", list(itertools.product((0, 1, 4), (1, 3), (2, 3, 4))))
def test_embedding_sequence_first_across_opacus_shapes(seq, b, dims, engine):
    """Opacus's embedding_test.py with batch_first=False: indices [T, B, Q, R][:dims], T may be 0."""
    torch.manual_seed(seq * 10 + b)
    emb = nn.Embedding(9, 6).to(DT)
    x = torch.randint(0, 9, [seq, b, 2, 3][:dims])
    y = torch.randn(emb(x).movedim(1, 0).shape, dtype=DT)
    truth = _truth(emb, x, y, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        src = next(iter(iter_per_sample_sources(emb, _loss(1), x, y, batch_dim=1, engine=engine)))
    grads = per_example_from_source(src, 1)[1] if engine == "fast" else list(src.grads)  # reference: PerSampleGrads
    assert rel_err(grads, truth) <= 1e-12
