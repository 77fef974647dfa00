"""DPSFTTrainer and DPDPOTrainer (TRL) under 2 gloo processes (torchrun's environment), against one process.

One ``spawn_ranks`` runs every 2-process case (float64 tiny GPT-2 and the word-level tokenizer of
tests/hf_trl/trl_zoo.py; no downloads). Each rank starts from ITS OWN random policy (seed = rank): the
engine broadcasts rank 0's, and DPDPOTrainer's default reference (a copy of the initial policy) must be
rank 0's too. References are computed here, in one process, on rank 0's recorded parameters:

* σ = 0, plain SGD at lr 1, q = 1 (B̄ = per_device 2 × accumulation 2 × world 2 = N = 8 units: every unit
  is in the global batch, each rank holds its shard of 4 in 2 chunks): every step's update × B̄ equals
  Σ_units clip_C(g_unit), each g_unit by single-unit autograd on the unit collated ALONE through the
  trainer's own collator with an independent loss (SFT: token cross-entropy over the example's label
  tokens, one text = one record, unpacked; DPO: eq. 7 of Rafailov et al. 2023, one preference pair = one
  unit); C = 0.05 is below every unit's norm, so every unit is clipped and moves the sum by exactly C;
* σ = 1, q = 1/2 (N = 16, B̄ = 8), 3 steps: ε on both ranks equals the one-process run's at the same σ,
  q, steps, and the journal's releases equal the one-process journal's (σ, q and unit of every line);
* every rank holds the same parameters after every step; rank 0 alone writes the journal, the ledger
  and the summary (rank 1 is given its own output_dir, which must end without any of them).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gloo_ranks import gloo_group, progress, spawn_ranks, torchrun_env

pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf_trl"))  # trl_zoo (spawned ranks inherit sys.path)

import transformers as T  # noqa: E402
from trl import DPOConfig, SFTConfig  # noqa: E402
from trl_zoo import gpt2, pairs, texts, tokenizer  # noqa: E402

from dpopt.accounting.accountant import dpsgd_epsilon  # noqa: E402
from dpopt.distributed import check_replicas, context  # noqa: E402
from dpopt.hf import DPDPOTrainer, DPSFTTrainer  # noqa: E402
from dpopt.hf.dpo import PAIR_UNIT  # noqa: E402
from dpopt.hf.trainer import LEDGER_FILE, SUMMARY_FILE  # noqa: E402

pytestmark = pytest.mark.distributed

WORLD, PER_DEVICE, ACCUMULATION = 2, 2, 2
BBAR = PER_DEVICE * ACCUMULATION * WORLD  # 8
C, BETA, DELTA = 0.05, 0.5, 1e-3
EXACT_STEPS, NOISE_STEPS = 2, 3
# name: (kind, N units, σ, steps); N = B̄: q = 1 (exactness); N = 2 B̄: q = 1/2 (ε and journal)
CASES = {
    "sft_exact": ("sft", BBAR, 0.0, EXACT_STEPS),
    "dpo_exact": ("dpo", BBAR, 0.0, EXACT_STEPS),
    "sft_noise": ("sft", 2 * BBAR, 1.0, NOISE_STEPS),
    "dpo_noise": ("dpo", 2 * BBAR, 1.0, NOISE_STEPS),
}


def flat(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class Replicas(T.TrainerCallback):
    """After each step: do all ranks hold rank 0's parameters bit for bit (one collective)?"""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kw):
        self.trainer.equal.append(check_replicas(list(self.trainer.model.parameters()), context()))


def recording(base):
    """``base`` (DPSFTTrainer / DPDPOTrainer) that keeps the parameters before every step and its batch sizes."""

    class Recording(base):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.starts.append(flat(model))
            self.sizes.append(int(inputs["input_ids"].shape[0]))
            return super().training_step(model, inputs, num_items_in_batch)

    return Recording


def trainer(kind, out, n, sigma, steps, *, world=WORLD, seed=0, record=False):
    """The case's trainer; one process gets gradient_accumulation_steps × WORLD (the same B̄, the same q)."""
    model = gpt2(seed=seed, double=True)
    common = dict(
        per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=ACCUMULATION * WORLD // world,
        max_steps=steps,
        learning_rate=1.0,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps",
        save_steps=steps,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        bf16=False,
        gradient_checkpointing=False,
    )
    privacy = dict(
        noise_multiplier=sigma,
        max_grad_norm=C,
        delta=DELTA,
        method=torch.optim.SGD(model.parameters(), lr=1.0),
        processing_class=tokenizer(),
    )
    if kind == "sft":
        cls = recording(DPSFTTrainer) if record else DPSFTTrainer
        tr = cls(model=model, args=SFTConfig(str(out), max_length=16, **common), train_dataset=texts(n), **privacy)
    else:  # the default reference: a frozen copy of the initial policy (rank 0's on every rank)
        cls = recording(DPDPOTrainer) if record else DPDPOTrainer
        tr = cls(model=model, args=DPOConfig(str(out), beta=BETA, **common), train_dataset=pairs(n), **privacy)
    if record:
        tr.starts, tr.sizes, tr.equal = [], [], []
        tr.add_callback(Replicas(tr))
    return tr


def _worker(rank: int, world: int, tmp: str) -> None:
    torchrun_env(rank, world, HF_HUB_DISABLE_TELEMETRY="1", TQDM_DISABLE="1")
    with gloo_group(rank, world, tmp), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = {}
        for name, (kind, n, sigma, steps) in CASES.items():
            out = Path(tmp) / name / f"out-rank{rank}"  # rank 1's own output_dir: it must stay without privacy files
            tr = trainer(kind, out, n, sigma, steps, world=world, seed=rank, record=True)
            ref = getattr(tr, "ref_model", None)
            tr.train()
            results[name] = {
                "starts": tr.starts,
                "final": flat(tr.model),
                "sizes": tr.sizes,
                "equal": tr.equal,
                "epsilon": tr.get_epsilon(),
                "ledger": len(tr.ledger),
                "q": tr.sample_rate,
                "bbar": tr.bbar,
                "wrapped": type(tr.model_wrapped).__name__,
                "reference": None if ref is None else {k: v.detach().clone() for k, v in ref.state_dict().items()},
            }
            progress(tmp, rank, name)
        torch.save(results, Path(tmp) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl-ddp")
    spawn_ranks(_worker, tmp, stall_s=120)
    return tmp, [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


# -- independent per-unit losses (each unit collated ALONE through the trainer's collator) -------------------
def sft_loss_alone(model, collator, example):
    b = collator([example])
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    return F.cross_entropy(logits[0, :-1], b["labels"][0, 1:], ignore_index=-100)


def dpo_loss_alone(model, ref, collator, example):
    b = collator([example])  # TRL's collator: row 0 prompt + chosen, row 1 prompt + rejected

    def logp(m):
        lp = torch.log_softmax(m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1], -1)
        tok = lp.gather(-1, b["input_ids"][:, 1:, None])[..., 0]
        return (tok * b["completion_mask"][:, 1:]).sum(1)

    pol = logp(model)
    with torch.no_grad():
        rf = logp(ref)
    return -F.logsigmoid(BETA * ((pol[0] - rf[0]) - (pol[1] - rf[1])))


def load(params, seed=0):
    model = gpt2(seed=seed, double=True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    return model


def clipped_unit(model, loss):
    """clip_C of the unit's gradient (float64, flattened in named_parameters order)."""
    grads = torch.autograd.grad(loss, [p for n, p in model.named_parameters() if p.requires_grad])
    g = torch.cat([x.double().flatten() for x in grads])
    norm = float(g.norm())
    assert norm > C  # every unit is clipped: removing it moves the sum by exactly C
    return g * (C / norm)


@pytest.mark.parametrize("name", ["sft_exact", "dpo_exact"])
def test_sigma0_update_is_the_clipped_sum_of_single_unit_autograd_over_bbar(ddp, name, tmp_path):
    _, ranks = ddp
    kind, n, _, steps = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = trainer(kind, tmp_path, n, 0.0, steps, world=1)  # its prepared dataset and collator (one process)
    collator = one.data_collator if kind == "sft" else one.data_collator.collator  # TRL's own collator
    r0 = ranks[0][name]
    assert all(r[name]["q"] == 1.0 and r[name]["bbar"] == BBAR for r in ranks)
    assert [sum(r[name]["sizes"][t] for r in ranks) for t in range(steps)] == [n] * steps  # the global batch
    assert all(s == n // WORLD for r in ranks for s in r[name]["sizes"])  # each rank's shard, in 2 chunks
    if kind == "dpo":  # the reference is rank 0's initial policy on every rank (ranks started from seeds 0, 1)
        for k, v in ranks[1][name]["reference"].items():
            assert torch.equal(v, ranks[0][name]["reference"][k]), k
        ref = load(r0["starts"][0])
        for k, v in ref.state_dict().items():
            assert torch.equal(v, r0["reference"][k]), k
    ends = r0["starts"][1:] + [r0["final"]]
    for start, end in zip(r0["starts"], ends):
        model = load(start)
        units = []
        for i in range(n):
            example = one.train_dataset[i]
            loss = (
                sft_loss_alone(model, collator, example)
                if kind == "sft"
                else dpo_loss_alone(model, ref, collator, example)
            )
            units.append(clipped_unit(model, loss))
        names = [k for k, p in model.named_parameters() if p.requires_grad]
        released = torch.cat([((start[k] - end[k]) * BBAR).double().flatten() for k in names])  # lr 1
        want = sum(units)
        # float64 throughout: the update read back from the parameters is exact to ~1e-15 per coordinate
        assert float((released - want).norm()) <= 1e-9 * C, float((released - want).norm())
    assert float(want.norm()) > C  # not a vanishing check


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_epsilon_and_journal_equal_the_one_process_run(ddp, kind, tmp_path):
    tmp, ranks = ddp
    name = f"{kind}_noise"
    _, n, sigma, steps = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = trainer(kind, tmp_path, n, sigma, steps, world=1)
        one.train()
    q = BBAR / n
    assert one.sample_rate == q and one.get_epsilon() == pytest.approx(dpsgd_epsilon(sigma, q, steps, DELTA), rel=1e-9)
    for r in ranks:
        assert r[name]["q"] == q and r[name]["ledger"] == steps
        assert r[name]["epsilon"] == pytest.approx(one.get_epsilon(), rel=1e-12)

    def releases(folder):
        (journal,) = sorted(Path(folder).glob("ledger-*.jsonl"))
        lines = [json.loads(x) for x in journal.read_text().splitlines()]
        return lines[0], [{k: v for k, v in line.items() if k not in ("time", "run_id")} for line in lines[1:]]

    head, mine = releases(tmp / name / "out-rank0")
    one_head, theirs = releases(tmp_path)
    assert len(mine) == steps and mine == theirs
    assert {k: v for k, v in head.items() if k != "run_id"} == {k: v for k, v in one_head.items() if k != "run_id"}
    if kind == "dpo":
        assert (
            json.loads((tmp / name / "out-rank0" / f"checkpoint-{steps}" / LEDGER_FILE).read_text())["privacy_unit"]
            == PAIR_UNIT
        )


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_agree_and_rank0_alone_writes_the_privacy_files(ddp, name):
    tmp, ranks = ddp
    steps = CASES[name][3]
    for r in ranks:
        assert r[name]["equal"] == [True] * steps
        assert r[name]["wrapped"] == "GPT2LMHeadModel"  # never DistributedDataParallel
    for a, b in zip(ranks[0][name]["final"].values(), ranks[1][name]["final"].values()):
        assert torch.equal(a, b)
    zero, one = tmp / name / "out-rank0", tmp / name / "out-rank1"
    assert len(list(zero.glob("ledger-*.jsonl"))) == 1
    summary = json.loads((zero / f"checkpoint-{steps}" / SUMMARY_FILE).read_text())
    assert summary["steps"] == steps and float(summary["epsilon"]) == pytest.approx(ranks[1][name]["epsilon"])
    written = [p.name for p in one.rglob("*")] if one.exists() else []
    assert not [x for x in written if x.startswith("ledger-") or x in (LEDGER_FILE, SUMMARY_FILE)], written
