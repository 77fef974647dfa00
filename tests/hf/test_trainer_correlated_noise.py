"""DPTrainer with correlated noise (issue 36): ``noise_mechanism="banded:B" | "blt"`` on a tiny GPT-2 built from a
config (no downloads).

The horizon is the Trainer's planned steps, the batches are cyclic (one fixed partition, a fixed order), the ledger
is one Gaussian at σ/Δ that re-derives from its header; the released noise's covariance across steps is the
strategy's; removing one example moves a release by at most C/B̄ (the same seeded noise on both sides cancels:
correlated noise refuses σ = 0); resume, max_epsilon, user-level DP and a bad spec are refused.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import transformers as T  # noqa: E402
from scipy.optimize import brentq  # noqa: E402
from scipy.stats import norm  # noqa: E402

import dpopt.privacy_engine as privacy_engine_module  # noqa: E402
from dpopt.accounting.matrix_factorization import check_record  # noqa: E402
from dpopt.cyclic_batches import CyclicBatchSampler  # noqa: E402
from dpopt.hf import DPTrainer  # noqa: E402
from dpopt.noise import NoiseSource  # noqa: E402

V, L = 37, 8


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


class Tokens(torch.utils.data.Dataset):
    """n random token sequences for a causal LM; example i's first token is i + 1 (its identity in a batch)."""

    def __init__(self, n=32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(1, V, (n, L), generator=g)
        self.x[:, 0] = torch.arange(1, n + 1) % V

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": torch.ones(L, dtype=torch.long), "labels": self.x[i]}


def gpt2():
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V, n_positions=16, bos_token_id=0, eos_token_id=0)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return T.GPT2LMHeadModel(cfg)


def targs(out, **kw):
    base = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=12,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1000,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    base.update(kw)
    return T.TrainingArguments(str(out), **base)


def trainer(tmp_path, cls=DPTrainer, *, train_args: dict | None = None, **kwargs):
    """A ``cls`` (DPTrainer or a subclass) on a fresh tiny GPT-2 over ``Tokens()`` (N = 32) at record level, with
    :func:`targs` (batch 2 × 2 accumulation, 12 steps) updated by ``train_args``; ``kwargs`` (the privacy settings)
    go to it."""
    return cls(
        model=gpt2(),
        args=targs(tmp_path, **(train_args or {})),
        train_dataset=Tokens(),
        privacy_unit="record",
        **kwargs,
    )


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """ε(δ) of the Gaussian mechanism with sensitivity/σ = μ (Balle & Wang 2018, Thm 8), float64 brentq."""

    def gap(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return brentq(gap, 0.0, 200.0, xtol=1e-12)


class Recording(DPTrainer):
    """Records the first token of every example of every logical batch (the example's identity)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append(sorted(inputs["input_ids"][:, 0].tolist()))
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.mark.parametrize("mechanism", ["banded:2", "blt:2"])
def test_cyclic_batches_horizon_and_a_ledger_that_rederives(tmp_path, mechanism):
    """N = 32, B̄ = 4: b = 8 cyclic batches; max_steps = 12 is the horizon (k = 2 participations 8 apart)."""
    tr = trainer(
        tmp_path,
        Recording,
        noise_multiplier=2.0,
        max_grad_norm=1.0,
        method="dp-adam",
        noise_mechanism=mechanism,
    )
    tr.seen = []
    tr.train()
    # balls-in-bins batches (random sizes, possibly empty): one epoch is a partition, the public divisor N/b = 4
    assert len(tr.seen) == 12 and tr.expected_batch_size == pytest.approx(4.0)
    assert sorted(i for b in tr.seen[:8] for i in b) == list(range(1, 33))  # one epoch: a partition
    assert tr.seen[8:] == tr.seen[:4]  # the second epoch repeats the same batches in the same order
    rec = tr.ledger.mechanism
    assert (rec["kind"], rec["steps"], rec["participations"], rec["min_separation"]) == (mechanism[:-2], 12, 2, 8)
    assert tr.ledger.sampling == "cyclic (k=2 participations, min separation 8)"
    assert check_record(rec, tr.ledger.entries) == []
    assert tr.get_epsilon() == pytest.approx(_gaussian_epsilon(rec["sensitivity"] / 2.0, 1e-5), rel=2e-3)


def test_target_epsilon_is_met_from_below_over_num_train_epochs(tmp_path):
    """No max_steps: the horizon is ceil(num_train_epochs × 8) = 12 steps; σ is calibrated for it."""
    tr = trainer(
        tmp_path,
        train_args=dict(max_steps=-1, num_train_epochs=1.5),
        target_epsilon=4.0,
        max_grad_norm=1.0,
        noise_mechanism="banded:3",
    )
    tr.train()
    assert len(tr.ledger) == 12 and tr.ledger.mechanism["steps"] == 12
    assert 4.0 * 0.99 <= tr.get_epsilon() <= 4.0


def test_released_noise_covariance_across_steps_is_the_strategys(tmp_path, releases):
    """σ = 1e4, lr 0: the released gradient is noise up to a signal of norm ≤ C (< 1e-4 of one coordinate's std).

    Over the d ≈ 4,200 coordinates of the tiny GPT-2, each of the 21 covariance entries across T = 6 steps is
    compared with (σC/B̄)² (C⁻¹C⁻ᵀ)_st at 5 standard errors, se = √((Σ_ss Σ_tt + Σ_st²)/d): false alarm
    ≤ 21 × 5.7e-7 ≈ 1.2e-5 for a fresh seed (Bonferroni). The noise is seeded (the engine's NoiseSource, as in
    the sensitivity test below), so the test is deterministic: with the secret default it failed an honest
    stream in ≈ 1.2e-5 of CI runs. The Release's noise_std is the marginal std √Σ_tt.
    """
    sigma, c, bbar, steps = 1e4, 1.0, 4.0, 6
    model = gpt2()
    tr = DPTrainer(
        model=model,
        args=targs(tmp_path, max_steps=steps),
        train_dataset=Tokens(),
        privacy_unit="record",
        noise_multiplier=sigma,
        max_grad_norm=c,
        method=torch.optim.SGD(model.parameters(), lr=0.0),
        noise_mechanism="blt:2",
    )
    tr.engine.noise = NoiseSource("reproducible", seed=13)
    tr.train()
    assert len(releases) == steps and tr.ledger.noise == "reproducible"
    W = torch.stack([torch.cat([g.double().flatten() for g in r.grads]) for r in releases]).numpy()
    d = W.shape[1]
    mech = tr._private.privatizer.mechanism
    Dinv = np.linalg.inv(mech.strategy.matrix(steps))
    want = (sigma * c / bbar) ** 2 * (Dinv @ Dinv.T)
    got = W @ W.T / d
    se = np.sqrt((np.outer(np.diag(want), np.diag(want)) + want**2) / d)
    assert d > 4000
    assert np.all(np.abs(got - want) <= 5 * se), np.max(np.abs(got - want) / se)
    for t, r in enumerate(releases):
        assert float(r.noise_std[0]) == pytest.approx(math.sqrt(want[t, t]), rel=1e-6)


def test_removing_one_example_moves_each_release_by_at_most_c(tmp_path, releases, monkeypatch):
    """D (N = 8) and D − {example 8} (N = 7), B̄ = 4: b = 2 balls-in-bins batches from the same assignment seed
    (the 7 common examples keep their batches), T = 4 steps. The same seeded noise on both sides (correlated noise
    needs σ > 0), lr 0: each noisy clipped sum (release × the run's public divisor N/b) moves by exactly the removed
    example's clipped gradient (norm C = 1e-3, far below its unclipped norm) at the steps that use its batch j
    (t = j, j + 2), and not at the others — the stream's noise cancels.

    Tolerance: the float32 release (noisy coordinates ≲ 5σC ≈ 5e-3, two roundings of relative 6e-8 each) over
    ~4,200 coordinates: ≤ 65 × 6e-10 ≈ 4e-8, taken as 1e-7 (1e-4 C)."""
    seed = 2024
    monkeypatch.setattr(privacy_engine_module, "_partition_seed", lambda ctx: seed)
    j = next(k for k, b in enumerate(CyclicBatchSampler(8, 2, seed=seed).batches) if 7 in b)  # example 8: index 7
    c, slack = 1e-3, 1e-7
    runs = []
    for n in (8, 7):
        releases.clear()
        model = gpt2()
        tr = DPTrainer(
            model=model,
            args=targs(tmp_path / str(n), max_steps=4),
            train_dataset=Tokens(n),
            privacy_unit="record",
            noise_multiplier=1.0,
            max_grad_norm=c,
            delta=1e-2,
            method=torch.optim.SGD(model.parameters(), lr=0.0),
            noise_mechanism="banded:2",
        )
        tr.engine.noise = NoiseSource("reproducible", seed=11)
        tr.train()
        assert tr.ledger.mechanism["participations"] == 2 and tr.ledger.mechanism["min_separation"] == 2
        bbar = tr._private.expected_batch_size
        assert bbar == n / 2  # cyclic batches: the divisor is N/b
        runs.append(torch.stack([torch.cat([g.double().flatten() for g in r.grads]) for r in releases]) * bbar)
    moved = (runs[0] - runs[1]).norm(dim=1)
    other = 1 - j
    assert float(moved[other]) <= slack and float(moved[other + 2]) <= slack  # the batch without the example
    assert float(runs[0][j].norm()) > 10 * c  # the noise is there (and cancelled in the difference)
    assert float(moved[j]) == pytest.approx(c, abs=slack) and float(moved[j + 2]) == pytest.approx(c, abs=slack)


def test_resume_is_refused_with_a_clear_message(tmp_path):
    a = dict(save_strategy="steps", save_steps=2)
    tr = trainer(
        tmp_path, train_args=dict(max_steps=2, **a), noise_multiplier=1.0, max_grad_norm=1.0, noise_mechanism="blt"
    )
    tr.train()
    tr2 = trainer(
        tmp_path, train_args=dict(max_steps=4, **a), noise_multiplier=1.0, max_grad_norm=1.0, noise_mechanism="blt"
    )
    with pytest.raises(ValueError, match="resume_from_checkpoint with noise_mechanism='blt' is refused"):
        tr2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


def test_no_checkpoint_file_holds_the_stream_state_or_a_secret_generator_state(tmp_path):
    """A DPTrainer checkpoint (optimizer.pt, rng_state.pth, the model, the ledger, trainer_state.json) saved
    after the run's last release holds no float64 word of the BLT stream's buffers and no word of the secret
    source's in-memory states (SFC64 objects, MT19937 of the uniforms): every file, byte for byte."""
    from dpopt.noise import _mt_state_layout

    tr = trainer(
        tmp_path,
        train_args=dict(max_steps=2, save_strategy="steps", save_steps=2),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        noise_mechanism="blt",
    )
    tr.train()
    priv = tr._private.privatizer
    assert priv.noise.mode == "secret"
    ((_, (t, buf)),) = priv.mechanism._state.items()
    assert t == 2 and buf
    pieces = [b.view(-1)[i : i + 1].numpy().tobytes() for b in buf for i in range(0, b.numel(), 97)]
    if "cpu" in priv.noise._generators:
        at, width = _mt_state_layout()
        mt = priv.noise._generators["cpu"].get_state().numpy().tobytes()[at : at + 624 * width]
        pieces += [mt[i : i + 16] for i in range(0, len(mt) - 16, 16 * 13)]
    assert len(pieces) > 20 and all(len(p) >= 8 for p in pieces)
    files = [f for f in (tmp_path / "checkpoint-2").rglob("*") if f.is_file()]
    assert "optimizer.pt" in {f.name for f in files}
    for f in files:
        data = f.read_bytes()
        assert not any(p in data for p in pieces), f.name


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"noise_mechanism": "banded"}, "is not one of"),
        ({"noise_mechanism": "banded:2", "max_epsilon": 3.0}, "max_epsilon"),
        ({"noise_mechanism": "blt", "privacy_unit": "user"}, "privacy_unit='user'"),
    ],
)
def test_combinations_without_an_accountant_are_refused(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPTrainer(model=gpt2(), args=targs(tmp_path), train_dataset=Tokens(), noise_multiplier=1.0, **kwargs)


# -- sampling="cyclic-poisson": the amplified banded form (make_private's) --------------------------------


def test_cyclic_poisson_records_amplified_rounds_and_matches_make_private(tmp_path):
    """N = 32, B̄ = 4 (8 steps per epoch), q = 0.5: b' = 4 parts of 8; max_steps = 12: k = 3 rounds. Every example
    is seen only at the steps of its own part (one residue mod 4), the ledger re-derives from its record with one
    PoissonSampledDpEvent per round, and ε equals make_private's for the same settings (same σ, T, q, loader)."""
    from torch.utils.data import DataLoader, TensorDataset

    from dpopt import PrivacyEngine

    tr = trainer(
        tmp_path,
        Recording,
        noise_multiplier=2.0,
        max_grad_norm=1.0,
        method="dp-sgd",
        noise_mechanism="banded:2",
        sampling="cyclic-poisson",
        sample_rate=0.5,
    )
    tr.seen = []
    tr.train()
    assert len(tr.seen) == 12 and tr.sample_rate == 0.5 and tr.expected_batch_size == pytest.approx(4.0)
    residues: dict = {}
    for t, batch in enumerate(tr.seen):
        for i in batch:
            residues.setdefault(i, set()).add(t % 4)
    assert all(len(r) == 1 for r in residues.values())  # parts are fixed and disjoint
    rec = tr.ledger.mechanism
    assert (rec["steps"], rec["participations"], rec["min_separation"], rec["sample_rate"]) == (12, 3, 4, 0.5)
    assert tr.ledger.sampling == "cyclic poisson (q=0.5 within 4 partitions)"
    assert [type(e.event).__name__ for e in tr.ledger.entries].count("PoissonSampledDpEvent") == 3
    assert check_record(rec, tr.ledger.entries) == []
    engine = PrivacyEngine()
    data = TensorDataset(torch.randn(32, 3), torch.randint(0, 2, (32,)))
    engine.make_private(
        module=torch.nn.Linear(3, 2),
        optimizer="dp-sgd",
        data_loader=DataLoader(data, batch_size=4),
        noise_multiplier=2.0,
        max_grad_norm=1.0,
        noise_mechanism="banded:2",
        total_steps=12,
        sampling="cyclic-poisson",
        sample_rate=0.5,
        lr=0.1,
    )
    mech = engine._claims["privatizers"][0].mechanism
    assert mech.record()["strategy"] == rec["strategy"]
    from dp_accounting import dp_event

    from dpopt.accounting.accountant import epsilon

    want = epsilon(dp_event.ComposedDpEvent([mech.step_event(t) for t in range(12)]), 1e-5)
    assert tr.get_epsilon() == pytest.approx(want, rel=1e-9)


def test_cyclic_poisson_target_epsilon_is_met_from_below(tmp_path):
    tr = trainer(
        tmp_path,
        target_epsilon=3.0,
        max_grad_norm=1.0,
        noise_mechanism="banded:2",
        sampling="cyclic-poisson",
        sample_rate=0.5,
    )
    tr.train()
    assert 0.98 * 3.0 <= tr.get_epsilon() <= 3.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"noise_mechanism": "banded:2", "sample_rate": 0.5}, "rate within a part"),
        ({"sampling": "cyclic-poisson", "sample_rate": 0.5}, "correlated noise_mechanism only"),
    ],
)
def test_cyclic_poisson_without_an_accountant_is_refused(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tr = trainer(tmp_path, noise_multiplier=1.0, **kwargs)
        tr.train()


def test_cyclic_poisson_that_costs_is_warned_at_the_trainers_delta(tmp_path):
    """BLT at q = 0.5, σ = 1 (N = 32, 8 steps per epoch, 4 parts, T = 12): the amplified ε exceeds the 8 cyclic
    batches' one; DPTrainer's make_private warns with both, at the Trainer's δ (1e-6), and stays amplified."""
    from dpopt.accounting.accountant import AccountingWarning

    tr = trainer(
        tmp_path,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        delta=1e-6,
        noise_mechanism="blt",
        sampling="cyclic-poisson",
        sample_rate=0.5,
    )
    with pytest.warns(AccountingWarning, match=r"\(8 batches\).*delta=1e-06.*use sampling='cyclic'"):
        tr.train()
    assert tr.ledger.mechanism["sample_rate"] == 0.5 and tr.ledger.delta == 1e-6
