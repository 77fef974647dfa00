"""``DPTrainer(noise_mechanism=...)`` with a REPLICATED model under 2 gloo processes (torchrun's environment),
against the one-process DPTrainer run (issue 36: "DDP adds the stream once per coordinate").

Both runs use the same public partition (``secrets.randbits`` fixed) and the same reproducible noise
(``noise_generator`` seeded: research mode, test only), the same initial model and B̄ = 8 (2 processes ×
2 per device × accumulation 2; one process: 2 × 4), N = 32, so b = 4 cyclic batches and T = 6 steps (k = 2):

* every rank takes a slice of each cyclic batch; the slices are disjoint and their union is the one-process
  batch, and steps 4-5 repeat steps 0-1 (cyclic);
* rank 0 alone runs the stream, so after 6 steps of ``blt:2`` at σ = 1 the parameters equal the one-process
  run's within 2e-5 absolute + 1e-4 relative (float32; only the summation order of the clipped sum differs).
  Noise added on both ranks would move each update by σ·C·lr·(C⁻¹z)_t/B̄ ≈ 0.5 × 0.1 × 1/8 ≈ 6e-3 per
  coordinate (σ = 1, C = 0.1, lr = 0.5), far beyond it (making every rank add the noise fails this test);
* ε, the ledger's mechanism record and its number of releases are the one-process run's; both ranks end
  with identical parameters; exactly one journal (rank 0's);
* resuming from the run's checkpoint is refused on every rank (as in one process);
* ``sampling="cyclic-poisson", sample_rate=0.5`` with ``banded:2`` (b' = 2 parts of 16, T = 6): each rank
  Poisson-samples its slice of part t mod 2, the union is the one-process batch every step, and the parameters,
  ε and the mechanism record equal the one-process run's (same tolerance).
"""

from __future__ import annotations

import functools
import json
import types
import warnings
from pathlib import Path

import pytest
import torch
from gloo_ranks import gloo_group, spawn_ranks, torchrun_env

pytest.importorskip("transformers")

import transformers as T  # noqa: E402

import dpopt.privacy_engine as privacy_engine_module  # noqa: E402
from dpopt.distributed import check_replicas, context  # noqa: E402
from dpopt.hf import DPTrainer  # noqa: E402

pytestmark = pytest.mark.distributed

V, L, N = 37, 8, 32
WORLD, PER_DEVICE = 2, 2
BBAR = 8  # 2 ranks x 2 per device x 2 accumulation = 1 rank x 2 x 4: b = N / BBAR = 4 cyclic batches
STEPS, LR, SIGMA, C, SEED = 6, 0.5, 1.0, 0.1, 7
MECHANISM = "blt:2"


class Tokens(torch.utils.data.Dataset):
    """N random token sequences (causal LM); example i's first token is i + 1 (its identity in a batch)."""

    def __init__(self):
        self.x = torch.randint(1, V, (N, L), generator=torch.Generator().manual_seed(0))
        self.x[:, 0] = torch.arange(1, N + 1)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": torch.ones(L, dtype=torch.long), "labels": self.x[i]}


def gpt2():
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V, n_positions=16, bos_token_id=0, eos_token_id=0)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return T.GPT2LMHeadModel(cfg)


class Recording(DPTrainer):
    """Records the identities (first tokens) of this rank's examples of every logical batch."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append(sorted(inputs["input_ids"][:, 0].tolist()))
        return super().training_step(model, inputs, num_items_in_batch)


def trainer(out, accumulation, max_steps=STEPS, cls=DPTrainer, mechanism=MECHANISM, **kw):
    """A DPTrainer of ``mechanism`` whose make_private gets the seeded noise generator (test only)."""
    args = T.TrainingArguments(
        str(out),
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=accumulation,
        max_steps=max_steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        logging_steps=1000,
        save_strategy="steps",
        save_steps=STEPS,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    model = gpt2()
    tr = cls(
        model=model,
        args=args,
        train_dataset=Tokens(),
        noise_multiplier=SIGMA,
        max_grad_norm=C,
        method=torch.optim.SGD(model.parameters(), lr=LR),
        privacy_unit="record",
        noise_mechanism=mechanism,
        **kw,
    )
    tr.engine.make_private = functools.partial(
        tr.engine.make_private, noise_generator=torch.Generator().manual_seed(SEED)
    )
    return tr


POISSON = dict(mechanism="banded:2", sampling="cyclic-poisson", sample_rate=0.5)  # b' = round(0.5 × 4) = 2


def run(out, accumulation, **kw) -> dict:
    """The run's final parameters, batches, ε, ledger and mechanism record (the public partition fixed)."""
    real = privacy_engine_module.secrets
    privacy_engine_module.secrets = types.SimpleNamespace(randbits=lambda k: 1234)
    try:
        tr = trainer(out, accumulation, cls=Recording, **kw)
        tr.seen = []
        tr.train()
    finally:
        privacy_engine_module.secrets = real
    return {
        "params": {n: p.detach().clone() for n, p in tr.model.named_parameters()},
        "batches": tr.seen,
        "epsilon": tr.get_epsilon(),
        "ledger_steps": [e.step for e in tr.ledger.entries],
        "mechanism": tr.ledger.mechanism,
        "replicas_equal": check_replicas(list(tr.model.parameters()), context()) if context().enabled else None,
    }


def refusal(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "accepted"


def _worker(rank: int, world: int, tmp: str) -> None:
    torchrun_env(rank, world)
    out = Path(tmp) / "run"
    with gloo_group(rank, world, tmp), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run(out, accumulation=2)
        result["resume"] = refusal(
            lambda: trainer(out, 2, max_steps=STEPS + 2).train(resume_from_checkpoint=str(out / f"checkpoint-{STEPS}"))
        )
        result["cyclic_poisson"] = run(Path(tmp) / "cp", accumulation=2, **POISSON)
        torch.save(result, Path(tmp) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-ddp-mf")
    spawn_ranks(_worker, tmp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        single = run(tmp / "single", accumulation=4)
        single["cyclic_poisson"] = run(tmp / "cp-single", accumulation=4, **POISSON)
    return tmp, [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)], single


def test_each_rank_a_disjoint_slice_of_the_one_process_cyclic_batch(runs):
    _, ranks, single = runs
    assert len(single["batches"]) == STEPS
    for t, batch in enumerate(single["batches"]):
        a, b = (r["batches"][t] for r in ranks)
        assert a and b and not set(a) & set(b)
        assert sorted(a + b) == batch
    assert single["batches"][4:] == single["batches"][:2]  # b = 4: the cycle repeats


def test_stream_added_once_parameters_equal_one_process(runs):
    _, ranks, single = runs
    start = {n: p.detach() for n, p in gpt2().named_parameters()}
    moved = max(float((single["params"][n] - p).abs().max()) for n, p in start.items())
    assert moved > 1e-2  # the noise moved the model far beyond the tolerance below
    for r in ranks:
        assert r["replicas_equal"]
        for n, p in single["params"].items():
            torch.testing.assert_close(r["params"][n], p, atol=2e-5, rtol=1e-4)


def test_epsilon_ledger_and_one_journal_as_one_process(runs):
    tmp, ranks, single = runs
    assert single["mechanism"]["kind"] == "blt" and single["mechanism"]["steps"] == STEPS
    assert single["ledger_steps"] == list(range(STEPS))
    for r in ranks:
        assert r["mechanism"] == single["mechanism"]
        assert r["ledger_steps"] == single["ledger_steps"]
        assert r["epsilon"] == pytest.approx(single["epsilon"], rel=1e-12)
    journals = sorted((tmp / "run").glob("ledger-*.jsonl"))
    assert len(journals) == 1, journals
    assert len(journals[0].read_text().splitlines()) == 1 + STEPS  # a header and one line per release
    saved = json.loads((tmp / "run" / f"checkpoint-{STEPS}" / "privacy_summary.json").read_text())
    assert saved["epsilon"] == pytest.approx(single["epsilon"], rel=1e-9)


def test_resume_refused_on_every_rank(runs):
    _, ranks, _ = runs
    for r in ranks:
        assert "resume_from_checkpoint with noise_mechanism='blt:2' is refused" in r["resume"]


def test_cyclic_poisson_equals_one_process(runs):
    _, ranks, single = runs
    one = single["cyclic_poisson"]
    assert len(one["batches"]) == STEPS and one["mechanism"]["sample_rate"] == 0.5
    assert one["mechanism"]["min_separation"] == 2 and one["ledger_steps"] == list(range(STEPS))
    for t, batch in enumerate(one["batches"]):  # DPTrainer records non-empty chunks only
        a, b = (r["cyclic_poisson"]["batches"][t] for r in ranks)
        assert not set(a) & set(b) and sorted(a + b) == batch
    for r in (r["cyclic_poisson"] for r in ranks):
        assert r["replicas_equal"] and r["mechanism"] == one["mechanism"]
        assert r["epsilon"] == pytest.approx(one["epsilon"], rel=1e-12)
        for n, p in one["params"].items():
            torch.testing.assert_close(r["params"][n], p, atol=2e-5, rtol=1e-4)
