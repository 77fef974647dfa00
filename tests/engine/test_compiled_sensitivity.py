"""σ = 0 sensitivity through the compiled paths, on a token model (Embedding → LayerNorm → mean → Linear).

Both compiled doors: ``dpopt train --compile`` (:func:`dpopt.engine.iter_per_sample_sources` with ``compile=``,
the Privatizer's release) and ``PrivacyEngine.make_private(..., compile=...)`` (the user's forward and backward,
the optimizer's release). With noise_multiplier = 0 the release times B̄ is the clipped sum; removing one example
from the batch must move it by at most C — also across the compiled/eager boundary: a batch of 2 rows runs the
compiled graph, a batch of 1 row the eager capture (docs/performance.md, "Privacy notes"), so the eager fallback
must give the compiled path's clipped values. (The Hugging Face door refuses ``torch_compile``:
tests/hf/test_trainer.py.)

C = 1e-3 is below every example's gradient norm (asserted), so each example contributes exactly C: the move is
C to float tolerance (relative 1e-4; a reassociated float32 reduction differs by ≈ 1e-7 relative), and a capture
that mixed examples (another example's clipped vector changing direction) would move it by more.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpopt import PrivacyEngine
from dpopt.engine import iter_per_sample_sources
from dpopt.engine.hooks import HookCapture
from dpopt.methods import make_optimizer
from dpopt.types import ClipGeometry

C = 1e-3
TOL = 1e-4
VOCAB, T = 11, 5


class Tokens(nn.Module):
    """Embedding → LayerNorm → tanh → mean over the T tokens → Linear: ``[B, T]`` token ids → ``[B, 3]``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.ln, self.out = nn.Embedding(VOCAB, 6), nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, t):
        return self.out(torch.tanh(self.ln(self.emb(t))).mean(1))


def batch(n: int = 6, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, T), generator=g), torch.randint(0, 3, (n,), generator=g)


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def assert_moves_by_c(full: torch.Tensor, less: torch.Tensor) -> None:
    moved = float((full - less).norm())
    assert C * (1 - TOL) <= moved <= C * (1 + TOL), moved / C


# -- dpopt train --compile: the engine's compiled capture, the Privatizer's release -------------------------------
def engine_clipped_sum(model, opt, x, y, backend) -> torch.Tensor:
    """σ = 0: the Privatizer's release of this batch × B̄ = Σ_i min(1, C/‖g_i‖) g_i (the parameters are not
    updated: every batch is released at the same θ)."""
    params = [p for p in model.parameters() if p.requires_grad]
    release = opt.privatizer.privatize(
        iter_per_sample_sources(model, loss_fn, x, y, compile=backend), params_like=params
    )
    return flat(release.grads) * release.expected_batch_size


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_train_compile_sigma_zero_sensitivity(backend):
    model = Tokens()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(
        "dp-sgd", params, noise_multiplier=0.0, expected_batch_size=6.0, sample_rate=0.1, lr=0.1, max_grad_norm=C
    )
    x, y = batch()
    eager = Tokens()
    ref = next(iter_per_sample_sources(eager, loss_fn, x, y))  # the eager engine: every example is clipped
    assert float(ref.sq_norms(ClipGeometry(), [0] * ref.num_params, 1).min().sqrt()) > 10 * C
    full = engine_clipped_sum(model, opt, x, y, backend)
    for j in (0, 4):
        keep = torch.arange(6) != j
        assert_moves_by_c(full, engine_clipped_sum(model, opt, x[keep], y[keep], backend))
    # the compiled/eager boundary: 2 rows (compiled) against either 1 row alone (eager)
    pair = engine_clipped_sum(model, opt, x[:2], y[:2], backend)
    for j in (0, 1):
        assert_moves_by_c(pair, engine_clipped_sum(model, opt, x[1 - j : 2 - j], y[1 - j : 2 - j], backend))


# -- make_private(compile=...): the door's compiled forward, the optimizer's release ---------------------------------
def door(backend):
    """A PrivacyEngine door over Tokens with σ = 0 and lr = 0 (releases, never moves θ); the list the released
    clipped sums (release × B̄, read from each Release) are appended to."""
    model = Tokens()
    x, y = batch(12, 9)
    loader = DataLoader(TensorDataset(x, y), batch_size=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # σ = 0: the reproducible-noise warning
        model, opt, _ = PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=C,
            poisson_sampling=False,
            compile=backend,
        )
    priv, sums = opt.privatizer, []
    release = priv.release

    def recorded(*args, **kwargs):
        out = release(*args, **kwargs)
        sums.append(flat(out.grads) * out.expected_batch_size)
        return out

    priv.release = recorded
    return model, opt, sums


def door_clipped_sum(model, opt, sums, x, y) -> torch.Tensor:
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()
    return sums[-1]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param(True, marks=pytest.mark.slow)])
def test_make_private_compile_sigma_zero_sensitivity(backend):
    model, opt, sums = door(backend)
    x, y = batch()
    full = door_clipped_sum(model, opt, sums, x, y)
    assert opt._capture._door is not None and opt._capture._door.compiles >= 1  # it ran compiled
    for j in (0, 4):
        keep = torch.arange(6) != j
        assert_moves_by_c(full, door_clipped_sum(model, opt, sums, x[keep], y[keep]))
    pair = door_clipped_sum(model, opt, sums, x[:2], y[:2])
    for j in (0, 1):  # one row: the eager hooks
        assert_moves_by_c(pair, door_clipped_sum(model, opt, sums, x[1 - j : 2 - j], y[1 - j : 2 - j]))
    assert len(sums) == 6 and not opt._capture._refused


def test_the_eager_fallback_gives_the_compiled_clipped_values():
    """Example j's squared norm and clipped gradient from a compiled batch of 6 rows = from the eager capture of
    its row alone (the path a one-row batch takes), in both doors (float tolerance 2e-5 relative)."""

    def close(a, b):
        return bool((a - b).abs().max() <= 2e-5 * b.abs().max() + 1e-12)

    def per_example(src):
        k = src.num_params
        sq = src.sq_norms(ClipGeometry(), [0] * k, 1)[:, 0]
        w = (C / sq.sqrt()).clamp(max=1.0)
        rows = [
            flat(src.weighted_sum((torch.arange(len(sq)) == i).to(w).mul(w).unsqueeze(1), ClipGeometry(), [0] * k))
            for i in range(len(sq))
        ]
        return sq, rows

    x, y = batch()
    model = Tokens()
    sq, rows = per_example(next(iter_per_sample_sources(model, loss_fn, x, y, compile="aot_eager")))
    cap_model = Tokens()
    cap = HookCapture(cap_model, compile="aot_eager")
    loss_fn(cap_model(x), y).backward()
    sq_door, rows_door = per_example(cap.collect())
    assert cap._door.compiles == 1
    for j in (0, 3, 5):
        sq1, row1 = per_example(
            next(iter_per_sample_sources(model, loss_fn, x[j : j + 1], y[j : j + 1], compile="aot_eager"))
        )
        assert close(sq1, sq[j : j + 1]) and close(row1[0], rows[j])
        loss_fn(cap_model(x[j : j + 1]), y[j : j + 1]).backward()
        sq1, row1 = per_example(cap.collect())
        assert close(sq1, sq_door[j : j + 1]) and close(row1[0], rows_door[j])
    assert cap._door.compiles == 1  # the one-row passes compiled nothing: they ran eagerly
    cap.detach()
