"""A forced per-example norm form (``norm_form=``) through both doors, on a small LM-head-like model.

The cost model picks the Cholesky form (:mod:`dpopt.engine.chol_norm`) only for wide heads such as GPT-2's
LM head (``chol_cost`` below the direct form's), so the small models of the other tests never reach it.
``norm_form="chol"`` forces it wherever it applies (flat geometry, a Linear layer with T > 1), through
``iter_per_sample_sources`` (what ``dpopt train``'s loop calls, the Privatizer's release) and
``PrivacyEngine.make_private`` (the user's forward and backward, the optimizer's release). Checked, in train
mode: the per-example norms and the clipped sum equal single-example autograd; with noise_multiplier = 0,
removing one example moves the released clipped sum by C (every example is clipped: C is below each
norm, asserted); and the Cholesky routine ran on the head (its calls counted) — without the option the cost
model takes the direct form here, so a forced form that silently did not reach the blocks fails.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpopt.engine.layers as layers
from dpopt import PrivacyEngine
from dpopt.engine import iter_per_sample_sources
from dpopt.engine.hooks import HookCapture
from dpopt.engine.layers import NORM_FORMS, Budget, check_norm_form
from dpopt.methods import make_optimizer
from dpopt.types import ClipGeometry

VOCAB, D, T, B = 40, 8, 6, 5
C = 1e-3
TOL = 1e-4


class Head(nn.Module):
    """Embedding → tanh → Linear to the vocabulary: ``[B, T]`` token ids → ``[B, T, VOCAB]`` logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)

    def forward(self, t):
        return self.head(torch.tanh(self.emb(t)))


def loss_fn(out, y):
    """Mean token cross-entropy: of one example (engine door) or of the batch (= mean of the examples')."""
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def batch(n: int = B, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, T), generator=g), torch.randint(0, VOCAB, (n, T), generator=g)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


@pytest.fixture
def chol_calls(monkeypatch):
    """Counts the Cholesky-form calls of the factored blocks (``layers.cholesky_sq_norms``)."""
    calls = []
    real = layers.cholesky_sq_norms

    def counted(narrow, wide, *args, **kwargs):
        calls.append(tuple(narrow.shape))
        return real(narrow, wide, *args, **kwargs)

    monkeypatch.setattr(layers, "cholesky_sq_norms", counted)
    return calls


def truth(model, x, y):
    """Single-example autograd: per-example gradients ``[B, d]`` (flat, in named_parameters order)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.stack(
        [flat(torch.autograd.grad(loss_fn(model(x[i : i + 1]), y[i : i + 1]), params)) for i in range(len(y))]
    )


def engine_source(model, x, y, norm_form):
    return next(iter(iter_per_sample_sources(model, loss_fn, x, y, norm_form=norm_form)))


def hook_source(model, x, y, norm_form):
    cap = HookCapture(model, "mean", norm_form=norm_form)
    try:
        for _ in range(2):  # the first collect runs the first-batch check; the second is an ordinary step
            model.zero_grad()
            loss_fn(model(x), y).backward()
            src = cap.collect()
        return src
    finally:
        cap.detach()


SOURCES = {"engine": engine_source, "hooks": hook_source}


@pytest.mark.parametrize("door", list(SOURCES))
def test_forced_cholesky_norms_and_clipped_sum_equal_single_example_autograd(door, chol_calls):
    model, (x, y) = Head().train(), batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no demotion: the head stays on its rule
        src = SOURCES[door](model, x, y, "chol")
    head = [n for n, _ in model.named_parameters()].index("head.weight")
    geo, k = ClipGeometry(), src.num_params
    n = len(chol_calls)  # the first-batch check ran the forced form too (its calls counted here)
    sq = src.sq_norms(geo, [0] * k, 1)[:, 0]
    assert src.forms()[head] == "chol" and chol_calls[n:] == [(B, T, D)]  # the head's norms: Cholesky, narrow a
    g = truth(model, x, y)
    torch.testing.assert_close(sq.double(), g.double().square().sum(1), rtol=1e-5, atol=0)
    w = torch.clamp(C / sq.sqrt(), max=1.0)
    assert bool((w < 1).all())  # every example clipped: the clipped sum depends on each norm
    got = flat(src.weighted_sum(w.unsqueeze(1), geo, [0] * k))
    want = (w.double().unsqueeze(1) * g.double()).sum(0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("door", list(SOURCES))
def test_without_the_option_this_head_takes_the_direct_form(door, chol_calls):
    """The control: the cost model does not choose Cholesky here, so the forced tests see the option work."""
    model, (x, y) = Head().train(), batch()
    src = SOURCES[door](model, x, y, None)
    src.sq_norms(ClipGeometry(), [0] * src.num_params, 1)
    head = [n for n, _ in model.named_parameters()].index("head.weight")
    assert src.forms()[head] == "direct" and not chol_calls


@pytest.mark.parametrize("form", ["gram", "direct"])
def test_the_other_forms_are_forced_too(form):
    model, (x, y) = Head().train(), batch()
    src = engine_source(model, x, y, form)
    sq = src.sq_norms(ClipGeometry(), [0] * src.num_params, 1)[:, 0]
    assert src.forms()[[n for n, _ in model.named_parameters()].index("head.weight")] == form
    torch.testing.assert_close(sq.double(), truth(model, x, y).double().square().sum(1), rtol=1e-5, atol=0)


def test_a_shifted_geometry_keeps_the_direct_form(chol_calls):
    """Cholesky (and Gram) have no identity for ‖g − m‖: a forced form applies in the flat geometry only."""
    model, (x, y) = Head().train(), batch()
    src = engine_source(model, x, y, "chol")
    k = src.num_params
    shift = ClipGeometry(shift=[torch.zeros_like(p) for p in model.parameters()])
    chol_calls.clear()  # the first-batch check's (flat geometry)
    src.sq_norms(shift, [0] * k, 1)
    assert src.forms()[[n for n, _ in model.named_parameters()].index("head.weight")] == "direct" and not chol_calls


def test_norm_form_is_checked():
    assert all(check_norm_form(f) == f for f in (None, *NORM_FORMS))
    for bad in ("cholesky", "", 1):
        with pytest.raises(ValueError, match="norm_form must be None"):
            check_norm_form(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="norm_form must be None"):
        iter_per_sample_sources(Head(), loss_fn, *batch(), norm_form="fast")
    with pytest.raises(ValueError, match="engine='fast'"):
        iter_per_sample_sources(Head(), loss_fn, *batch(), engine="reference", norm_form="chol")
    with pytest.raises(ValueError, match="norm_form must be None"):
        HookCapture(Head(), norm_form="Gram")
    assert Budget().norm_form is None


# -- σ = 0 sensitivity through the doors ---------------------------------------------------------------------------
def assert_moves_by_c(full: torch.Tensor, less: torch.Tensor) -> None:
    moved = float((full - less).norm())
    assert C * (1 - TOL) <= moved <= C * (1 + TOL), moved / C


def test_engine_door_sigma_zero_sensitivity_with_the_cholesky_form(chol_calls):
    """``dpopt train``'s step: ``iter_per_sample_sources`` → the Privatizer's release (× B̄: the clipped sum)."""
    model = Head().train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(
        "dp-sgd", params, noise_multiplier=0.0, expected_batch_size=6.0, sample_rate=0.1, lr=0.1, max_grad_norm=C
    )
    x, y = batch(6)

    def clipped_sum(xb, yb):
        release = opt.privatizer.privatize(
            iter_per_sample_sources(model, loss_fn, xb, yb, norm_form="chol"), params_like=params
        )
        return flat(release.grads) * release.expected_batch_size

    assert float(truth(model, x, y).norm(dim=1).min()) > 10 * C  # every example is clipped
    full = clipped_sum(x, y)
    assert chol_calls
    for j in range(6):
        keep = torch.arange(6) != j
        n = len(chol_calls)
        assert_moves_by_c(full, clipped_sum(x[keep], y[keep]))
        assert len(chol_calls) > n  # this neighbour's head norms were Cholesky too


def test_make_private_sigma_zero_sensitivity_with_the_cholesky_form(chol_calls, releases):
    """``PrivacyEngine.make_private(..., norm_form="chol")``: the user's step, the optimizer's release."""
    model = Head().train()
    x, y = batch(12, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # σ = 0: the reproducible-noise warning
        model, opt, _ = PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),  # releases, never moves θ
            data_loader=DataLoader(TensorDataset(x, y), batch_size=6),
            noise_multiplier=0.0,
            max_grad_norm=C,
            poisson_sampling=False,
            norm_form="chol",
        )

    def clipped_sum(xb, yb):  # the release (conftest's ``releases``) times its divisor: the clipped sum
        opt.zero_grad()
        loss_fn(model(xb), yb).backward()
        n = len(chol_calls)
        opt.step()
        assert len(chol_calls) > n  # the head's norms of this step were Cholesky
        return flat(releases[-1].grads) * releases[-1].expected_batch_size

    x, y = x[:6], y[:6]
    full = clipped_sum(x, y)
    for j in range(6):
        keep = torch.arange(6) != j
        assert_moves_by_c(full, clipped_sum(x[keep], y[keep]))
    assert len(releases) == 7


def test_plan_caches_keeps_nothing_for_a_forced_gram_or_cholesky_layer():
    """A forced Gram/Cholesky layer forms no per-example gradient; a forced direct layer caches within budget."""
    g = torch.Generator().manual_seed(2)
    part = layers.LinearPart(torch.randn(3, 16, 20, generator=g), torch.randn(3, 16, 1024, generator=g))
    # None: the cost model, with room for the cache: the cached direct form (1) beats Cholesky (1.14)
    for form, cached in (("chol", False), ("gram", False), ("direct", True), (None, True)):
        budget = Budget(16 << 20, 1 << 30, norm_form=form)
        blk = layers.FactoredBlock(0, (1024, 20), [part], budget, 3)
        assert layers.plan_caches([blk], [True], budget) == [cached] and budget.used == cached * blk.cache_nbytes()
        blk.sq_norms([(None, None)])
        assert blk.form == (form or "direct") and (blk._cache is not None) == cached
