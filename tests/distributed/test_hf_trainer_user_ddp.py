"""User-level DP (``privacy_unit="user"``, dpopt.users) through ``DPTrainer`` under 2 gloo processes.

One ``spawn_ranks`` runs both cases (float64 1-layer GPT-2; each rank starts from its own seed, the
engine broadcasts rank 0's model). 8 users own 1, 2 or 4 records (15 records), k = 2 records per user:

* σ = 0, plain SGD at lr 1, B̄ = per_device 2 × accumulation 2 × world 2 = N_users = 8 (q_user = 1: every
  user in every step, each rank its shard of 4 users): each step's update × B̄ equals
  Σ_u clip_C(ḡ_u), ḡ_u the mean of single-record autograd gradients over the user's records (at most k;
  user 5 has 4 distinct records and brings 2 of them, chosen from the secret stream: the release must
  match exactly one of the C(4, 2) = 6 pairs). C is below every user's norm, so each user's term has norm
  exactly C: removing one user (all its records) moves the clipped sum by that term, ≤ C — and not by
  up to k·C as per-record clipping would;
* σ = 1, q_user = 1/2 (B̄ = 4), 2 steps: ε on both ranks equals the one-process run's at the same σ, q,
  steps; the ledger header says the unit and N_users; every rank ends with the same parameters;
* the σ = 0 case with a ``fully_shard``-ed (FSDP2) model, users owning 2, 2, 4, 2, 1, 1, 1, 1 records: rank 0's
  shard needs 4 chunks per step and rank 1's 2, so rank 1 runs 2 zero-weight stand-in chunks per step (they
  belong to no user): the release is again exactly Σ_u clip_C(ḡ_u) by single-record autograd.
"""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path

import pytest
import torch
from gloo_ranks import gloo_group, progress, spawn_ranks, torchrun_env

pytest.importorskip("transformers")

import transformers as T  # noqa: E402

from dpopt.accounting.accountant import dpsgd_epsilon  # noqa: E402
from dpopt.distributed import check_replicas, context  # noqa: E402
from dpopt.hf import DPTrainer  # noqa: E402
from dpopt.losses import per_example_lm_loss  # noqa: E402

pytestmark = pytest.mark.distributed

V, L = 37, 6
RECORDS = [1, 2, 2, 1, 2, 4, 1, 2]  # records per user (user 5 alone: more than k)
RECORDS_FSDP = [2, 2, 4, 2, 1, 1, 1, 1]  # rank 0's shard: 8 rows (4 chunks); rank 1's: 4 rows (2 chunks)
USERS, K, C, DELTA = len(RECORDS), 2, 1e-3, 1e-3
WORLD, PER_DEVICE = 2, 2
STEPS = 2


class UserTokens(torch.utils.data.Dataset):
    """One random token sequence per record, with its owner in ``user_id`` (users' records consecutive here)."""

    def __init__(self, records=RECORDS):
        self.user = [u for u, n in enumerate(records) for _ in range(n)]
        self.x = torch.randint(1, V, (len(self.user), L), generator=torch.Generator().manual_seed(3))

    def __len__(self):
        return len(self.user)

    def __getitem__(self, i):
        return {
            "input_ids": self.x[i],
            "attention_mask": torch.ones(L, dtype=torch.long),
            "labels": self.x[i],
            "user_id": self.user[i],
        }


def gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = T.GPT2Config(
        n_layer=1,
        n_embd=8,
        n_head=2,
        vocab_size=V,
        n_positions=8,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return T.GPT2LMHeadModel(cfg).double()


def flat(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def full(model):
    """{name: full tensor} of the trainable parameters (gathered from FSDP2 shards: a collective)."""
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def sharded_gpt2(seed):
    """The tiny GPT-2 with ``fully_shard`` on its block, then on the root."""
    from torch.distributed.fsdp import fully_shard

    model = gpt2(seed)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model


class Recording(DPTrainer):
    """Keeps the full parameters before each step and, per step, the real and stand-in chunks it ran."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.starts.append(full(model))
        self.ran.append([0, 0])
        return super().training_step(model, inputs, num_items_in_batch)

    def _losses(self, model, inputs):
        real = bool((inputs["labels"] != -100).any())  # a stand-in's labels are all -100
        self.ran[-1][0 if real else 1] += 1
        return super()._losses(model, inputs)


class Replicas(T.TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kw):
        self.trainer.equal.append(check_replicas(list(self.trainer.model.parameters()), context()))


def trainer(out, sigma, accumulation, seed=0, sharded=False, records=RECORDS):
    model = sharded_gpt2(seed) if sharded else gpt2(seed)
    tr = Recording(
        model=model,
        args=T.TrainingArguments(
            str(out),
            per_device_train_batch_size=PER_DEVICE,
            gradient_accumulation_steps=accumulation,
            max_steps=STEPS,
            learning_rate=1.0,
            lr_scheduler_type="constant",
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        ),
        train_dataset=UserTokens(records),
        noise_multiplier=sigma,
        max_grad_norm=C,
        delta=DELTA,
        method=torch.optim.SGD(model.parameters(), lr=1.0),
        privacy_unit="user",
        max_records_per_user=K,
    )
    tr.starts, tr.equal, tr.ran = [], [], []
    if not sharded:
        tr.add_callback(Replicas(tr))
    return tr


# name: (σ, gradient accumulation, fully_shard-ed, records per user)
CASES = {
    "exact": (0.0, USERS // (PER_DEVICE * WORLD), False, RECORDS),
    "noise": (1.0, USERS // (2 * PER_DEVICE * WORLD), False, RECORDS),
    "fsdp": (0.0, USERS // (PER_DEVICE * WORLD), True, RECORDS_FSDP),
}


def _worker(rank: int, world: int, tmp: str) -> None:
    torchrun_env(rank, world)
    with gloo_group(rank, world, tmp), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = {}
        for name, (sigma, accumulation, sharded, records) in CASES.items():
            tr = trainer(Path(tmp) / name, sigma, accumulation, seed=rank, sharded=sharded, records=records)
            tr.train()
            results[name] = {
                "starts": tr.starts,
                "final": full(tr.model),
                "ran": tr.ran,
                "sharded": tr.sharded,
                "equal": tr.equal,
                "epsilon": tr.get_epsilon(),
                "ledger": len(tr.ledger),
                "unit": tr.ledger.privacy_unit,
                "num_users": tr.ledger.num_users,
                "q": tr.sample_rate,
                "bbar": tr.bbar,
            }
            progress(tmp, rank, name)
        torch.save(results, Path(tmp) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-user-ddp")
    spawn_ranks(_worker, tmp, stall_s=120)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def record_grads(params, records=RECORDS):
    """Each record's (owner, gradient) (float64, flattened), by single-record autograd at ``params``."""
    model = gpt2()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    data, out = UserTokens(records), []
    for i in range(len(data)):
        x = data[i]["input_ids"][None]
        loss = per_example_lm_loss(model(input_ids=x).logits, x).sum()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        out.append(torch.cat([g.flatten() for g in grads]))
    return data.user, out


def clip(g):
    norm = float(g.norm())
    assert norm > C  # every user is clipped: its term has norm exactly C
    return g * (C / norm)


@pytest.mark.parametrize("name", ["exact", "fsdp"])
def test_sigma0_release_is_the_sum_of_clipped_user_means_and_one_user_moves_it_by_at_most_c(ddp, name):
    _, _, sharded, records = CASES[name]
    r0 = ddp[0][name]
    assert all(r[name]["q"] == 1.0 and r[name]["bbar"] == USERS and r[name]["sharded"] == sharded for r in ddp)
    names = list(r0["starts"][0])
    ends = r0["starts"][1:] + [r0["final"]]
    big = records.index(4)
    for start, end in zip(r0["starts"], ends):
        released = torch.cat([((start[n] - end[n]) * USERS).flatten() for n in names])  # lr 1, B̄ = N_users
        owner, grads = record_grads(start, records)
        mine = {u: [g for g, v in zip(grads, owner) if v == u] for u in range(USERS)}
        terms = {u: clip(sum(gs) / len(gs)) for u, gs in mine.items() if u != big}
        rest = released - sum(terms.values())  # the big user's term: the clipped mean of k = 2 of its 4 records
        pairs = [clip((a + b) / 2) for a, b in itertools.combinations(mine[big], 2)]
        # float64: the update read back from the parameters is exact to ~1e-16 per coordinate
        matches = [float((rest - t).norm()) <= 1e-9 * C for t in pairs]
        assert sum(matches) == 1, [float((rest - t).norm()) for t in pairs]
        assert float(rest.norm()) == pytest.approx(C, rel=1e-9)  # removing the user moves the sum by C, not k·C
        whole = clip(sum(mine[big]) / 4)  # all 4 records would be another term
        assert float((rest - whole).norm()) > 1e-6 * C
    assert all(math.isinf(r[name]["epsilon"]) for r in ddp)  # σ = 0 is not private: ε = inf, said so
    if sharded:  # every step: rank 0 ran 4 real chunks, rank 1 its 2 and 2 stand-ins (the same passes)
        assert ddp[0][name]["ran"] == [[4, 0]] * STEPS and ddp[1][name]["ran"] == [[2, 2]] * STEPS
    for n, v in r0["final"].items():
        assert torch.equal(v, ddp[1][name]["final"][n]), n


def test_epsilon_equals_the_one_process_run_and_ranks_agree(ddp, tmp_path):
    sigma, accumulation, _, _ = CASES["noise"]
    q = PER_DEVICE * accumulation * WORLD / USERS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = trainer(tmp_path, sigma, accumulation * WORLD)
        one.train()
    assert one.sample_rate == q == 0.5
    assert one.get_epsilon() == pytest.approx(dpsgd_epsilon(sigma, q, STEPS, DELTA), rel=1e-9)
    for r in ddp:
        noise = r["noise"]
        assert noise["q"] == q and noise["ledger"] == STEPS
        assert noise["epsilon"] == pytest.approx(one.get_epsilon(), rel=1e-12)
        assert noise["unit"] == one.ledger.privacy_unit == f"user (at most {K} records each)"
        assert noise["num_users"] == USERS
        for name in ("exact", "noise"):
            assert r[name]["equal"] == [True] * STEPS
    for name in CASES:
        for n, v in ddp[0][name]["final"].items():
            assert torch.equal(v, ddp[1][name]["final"][n]), n
