"""DPSFTTrainer and DPDPOTrainer (dpopt.hf, extra ``dpopt[trl]``): TRL's SFT and DPO trainers, trained privately.

Tiny GPT-2 from a config and a word-level tokenizer built here (tests/trl/trl_zoo.py; no downloads).
Sensitivity at σ = 0, SGD at lr 1 and q = 1 (B̄ = N units): θ_before − θ_after = clipped sum / B̄, so
(θ_before − θ_after) × B̄ is the release before noise. It must equal Σ_units clip_C(g_unit), each g_unit
computed by single-example autograd on the unit collated ALONE through the trainer's own collator, with an
independent loss (SFT: token cross-entropy over the example's label tokens; DPO: eq. 7 of Rafailov et al.
2023 from full logits); removing one unit (an example, a preference pair, a user) moves the clipped sum by
clip_C(g_unit), of norm ≤ C (= C here: every unit is clipped).
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl")

from trl import DPOConfig, SFTConfig  # noqa: E402
from trl_zoo import gpt2, pairs, prompt_completion, texts, tokenizer  # noqa: E402

from dpopt.accounting.accountant import dpsgd_epsilon  # noqa: E402
from dpopt.hf import DPDPOTrainer, DPSFTTrainer  # noqa: E402
from dpopt.hf.trainer import LOGGED  # noqa: E402

C = 0.05  # below every unit's gradient norm here: every unit's gradient is clipped, so one unit moves the sum by exactly C


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def cfg(kind, out, **kw):
    base = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )  # TRL's own defaults otherwise (bf16=True: DPTrainer's bf16 autocast; gradient_checkpointing=True)
    base.update(kw)
    return kind(str(out), **base)


def flat(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def released_sum(tr, n):
    """One σ = 0 step of trainer ``tr`` (B̄ = n units: q = 1): (θ before − θ after) × n, flattened float64."""
    model = tr.model
    loader = tr.get_train_dataloader()
    assert tr.sample_rate == 1.0 and tr.expected_batch_size == n
    batch = next(iter(loader))
    before = flat(model)
    tr.training_step(model, batch)
    tr.optimizer.step()
    after = flat(model)
    return torch.cat([((before[k] - after[k]) * n).double().flatten() for k in before])


def grad_of(model, loss):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    gs = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).double().flatten() for p, g in zip(params, gs)]), names


def close(a, b, tol=1e-9):
    """‖a − b‖ ≤ tol·C (float64 models: the update read back from the parameters is exact to ~1e-15)."""
    return float((a - b).norm()) <= tol * C


def clip(g, c=C):
    norm = float(g.norm())
    return g if norm <= c else g * (c / norm)


def sft_loss_alone(model, collator, example):
    """The SFT example collated alone: token cross-entropy (shifted) averaged over its label tokens."""
    b = collator([example])
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    labels = b["labels"][0, 1:]
    if not bool((labels != -100).any()):  # no label token (a 1-token block): no loss, a zero gradient
        return logits.sum() * 0.0
    return F.cross_entropy(logits[0, :-1], labels, ignore_index=-100)


def dpo_loss_alone(model, ref, collator, example, beta):
    """The preference pair collated alone (TRL's collator: row 0 chosen, row 1 rejected): DPO eq. 7."""
    b = collator([example])

    def logp(m):
        lp = torch.log_softmax(m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1], -1)
        tok = lp.gather(-1, b["input_ids"][:, 1:, None])[..., 0]
        return (tok * b["completion_mask"][:, 1:]).sum(1)

    pol = logp(model)
    with torch.no_grad():
        rf = logp(ref)
    return -F.logsigmoid(beta * ((pol[0] - rf[0]) - (pol[1] - rf[1])))


def sft(tmp_path, data, per_device, accumulation, c=C, **kw):
    """A σ = 0 DPSFTTrainer with SGD at lr 1, B̄ = per_device × accumulation (chunks of ``per_device`` examples)."""
    model = gpt2(double=True)
    return DPSFTTrainer(
        model=model,
        args=cfg(
            SFTConfig,
            tmp_path,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
            **{**EXACT, **kw},
        ),
        train_dataset=data,
        processing_class=tokenizer(),
        noise_multiplier=0.0,
        max_grad_norm=c,
        delta=1e-3,
        method=torch.optim.SGD(model.parameters(), lr=1.0),
    )


EXACT = dict(bf16=False, gradient_checkpointing=False)  # float64 throughout (a test may turn checkpointing on)
BIG = 1e3  # above every unit's gradient norm: nothing is clipped, the release is the plain sum of unit gradients


# -- σ = 0 sensitivity ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("c, make", [(C, texts), (BIG, texts), (C, prompt_completion)])
def test_sft_unpacked_release_is_the_sum_of_clipped_examples_and_one_example_moves_it_by_c(tmp_path, c, make):
    n, removed = 8, 3
    tr = sft(tmp_path / "a", make(n), 2, n // 2, c=c, max_length=16)  # 4 chunks, one release
    first = tr.data_collator([tr.train_dataset[0]])["labels"][0]
    assert bool((first == -100).any()) == (make is prompt_completion)  # completion-only: the prompt is masked
    full = released_sum(tr, n)
    ref_model, collator = gpt2(double=True), tr.data_collator
    per = [clip(grad_of(ref_model, sft_loss_alone(ref_model, collator, tr.train_dataset[i]))[0], c) for i in range(n)]
    assert close(full, sum(per))  # the engine's clipped sum = autograd of each example collated alone
    data = make(n).select([i for i in range(n) if i != removed])
    less = released_sum(sft(tmp_path / "b", data, n - 1, 1, c=c, max_length=16), n - 1)  # B̄ = N - 1: q = 1 still
    moved = full - less
    assert close(moved, per[removed]) and float(moved.norm()) <= c * (1 + 1e-9)
    if c == C:
        assert float(moved.norm()) == pytest.approx(C, rel=1e-9)


def test_sft_packed_release_is_a_sum_of_clipped_blocks_and_the_block_is_recorded(tmp_path):
    with pytest.warns(UserWarning, match="privacy unit is the block of 8 tokens"):
        tr = sft(tmp_path, texts(12), 1, 1, max_length=8, packing=True, packing_strategy="wrapped")
    blocks = len(tr.train_dataset)
    tr.accumulation = blocks  # B̄ = 1 x blocks: q = 1 (the block count is read from TRL's packed dataset)
    tr.per_device_batch = 1
    full = released_sum(tr, blocks)
    assert tr.ledger.privacy_unit == "block of 8 tokens" and tr.block_tokens == 8
    model, collator = gpt2(double=True), tr.data_collator
    per = [clip(grad_of(model, sft_loss_alone(model, collator, tr.train_dataset[i]))[0]) for i in range(blocks)]
    norms = [float(g.norm()) for g in per]
    assert max(norms) <= C * (1 + 1e-12)  # each block is one unit of norm <= C
    assert sum(x == pytest.approx(C, rel=1e-9) for x in norms) >= blocks - 1  # all but a short last block: = C
    assert close(full, sum(per))  # so removing a block moves it by exactly C


def policy(lora):
    """The float64 policy: the tiny GPT-2, or LoRA adapters (seeded) on it with its base weights frozen."""
    model = gpt2(double=True)
    if not lora:
        return model
    import peft

    torch.manual_seed(7)
    cfg_ = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    model = peft.get_peft_model(model, cfg_)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B = 0 at init would leave A without gradient: a nonzero B exercises both
            torch.nn.init.normal_(p, std=0.1)
    return model


# BIG: unclipped, so the unit gradient's scale (the pair's) is checked too; lora: PEFT policy, frozen base
@pytest.mark.parametrize("c, lora", [(C, False), (BIG, False), (C, True)])
def test_dpo_pair_is_the_unit_and_removing_one_pair_moves_the_clipped_sum_by_c(tmp_path, c, lora):
    n, removed, beta = 6, 2, 0.5

    def run(out, data, per_device, accumulation):
        model = policy(lora)
        ref = gpt2(seed=1, double=True)  # a different (public) reference: the log-ratios are not 0
        tr = DPDPOTrainer(
            model=model,
            ref_model=ref,
            args=cfg(
                DPOConfig,
                out,
                per_device_train_batch_size=per_device,
                gradient_accumulation_steps=accumulation,
                beta=beta,
                bf16=False,
                gradient_checkpointing=c == BIG,  # TRL's default on: the recomputed layers are recorded once
            ),
            train_dataset=data,
            processing_class=tokenizer(),
            noise_multiplier=0.0,
            max_grad_norm=c,
            delta=1e-3,
            method=torch.optim.SGD(model.parameters(), lr=1.0),
        )
        return tr, released_sum(tr, len(data))

    tr, full = run(tmp_path / "a", pairs(n), 2, n // 2)  # 3 chunks of 2 pairs, one release
    model, ref, collator = policy(lora), gpt2(seed=1, double=True), tr.data_collator.collator  # TRL's own collator
    per = [
        clip(grad_of(model, dpo_loss_alone(model, ref, collator, tr.train_dataset[i], beta))[0], c) for i in range(n)
    ]
    assert close(full, sum(per))  # the pair's DPO gradient, clipped as ONE unit
    _, less = run(tmp_path / "b", pairs(n).select([i for i in range(n) if i != removed]), n - 1, 1)
    moved = full - less
    assert close(moved, per[removed]) and float(moved.norm()) <= c * (1 + 1e-9)
    if c == C:
        assert float(moved.norm()) == pytest.approx(C, rel=1e-9)


@pytest.mark.parametrize("removed", [0, 1, 2])  # a user with 1, k and more than k records
def test_user_level_sft_removing_one_user_moves_the_clipped_sum_by_c(tmp_path, removed):
    from datasets import Dataset

    k, sizes = 2, [1, 2, 4, 1]
    rows = texts(8, seed=3)["text"]
    text = [rows[0], rows[1], rows[2], rows[3], rows[3], rows[3], rows[3], rows[4]]  # user 2: 4 equal records
    user = [u for u, s in enumerate(sizes) for _ in range(s)]

    def run(out, keep):
        model = gpt2(double=True)
        data = Dataset.from_dict(
            {"text": [t for t, u in zip(text, user) if u in keep], "user_id": [u for u in user if u in keep]}
        )
        tr = DPSFTTrainer(
            model=model,
            args=cfg(
                SFTConfig,
                out,
                per_device_train_batch_size=1,
                gradient_accumulation_steps=len(keep),
                max_length=16,
                **EXACT,
            ),
            train_dataset=data,
            processing_class=tokenizer(),
            noise_multiplier=0.0,
            max_grad_norm=C,
            delta=1e-3,
            privacy_unit="user",
            max_records_per_user=k,
            method=torch.optim.SGD(model.parameters(), lr=1.0),
        )
        return tr, released_sum(tr, len(keep))

    tr, full = run(tmp_path / "a", {0, 1, 2, 3})
    _, less = run(tmp_path / "b", {0, 1, 2, 3} - {removed})
    moved = full - less  # clipped sums (B̄ = N_users differs: it is public)
    assert float(moved.norm()) <= C * (1 + 1e-9)  # per-record clipping would allow up to k·C
    # the user's unit: the mean of its (at most k) records' gradients, each record collated alone, clipped once
    model, rows = gpt2(double=True), [r for r in tr.train_dataset if r["user_id"] == removed]
    mean = sum(grad_of(model, sft_loss_alone(model, tr.data_collator, r))[0] for r in rows[:k]) / len(rows[:k])
    assert close(moved, clip(mean)) and float(moved.norm()) == pytest.approx(C, rel=1e-9)


def user_packed(out, text, user, k, block, **kw):
    """A σ = 0 DPSFTTrainer, packing within each user (blocks of ``block`` tokens), B̄ = N_users (q = 1)."""
    from datasets import Dataset

    model = gpt2(double=True)
    return DPSFTTrainer(
        model=model,
        args=cfg(
            SFTConfig,
            out,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=len(set(user)),
            max_length=block,
            packing=True,
            packing_strategy="wrapped",
            **{**EXACT, **kw},
        ),
        train_dataset=Dataset.from_dict({"text": text, "user_id": user}),
        processing_class=tokenizer(),
        noise_multiplier=0.0,
        max_grad_norm=C,
        delta=1e-3,
        privacy_unit="user",
        max_records_per_user=k,
        method=torch.optim.SGD(model.parameters(), lr=1.0),
    )


def test_user_packing_never_mixes_users_and_keeps_every_token_in_order(tmp_path):
    # user u writes only the words w(10u) … w(10u + 9): a token's id tells its user (<eos> = 0 ends every text)
    import random

    rng = random.Random(5)
    n, block = 12, 8
    user = [i % 3 for i in range(n)]
    text = [" ".join(f"w{10 * u + rng.randrange(10)}" for _ in range(rng.randint(3, 9))) for u in user]
    tr = user_packed(tmp_path, text, user, 2, block)
    packed = tr.train_dataset
    tok = tokenizer()
    for b in packed:
        assert 1 <= len(b["input_ids"]) <= block and b["labels"] == b["input_ids"]
        owners = {(t - 2) // 10 for t in b["input_ids"] if t != 0}
        assert owners == {b["user_id"]}  # one user per block, the one in the user column
    for u in range(
        3
    ):  # each user's blocks, concatenated: that user's texts (each + <eos>) in order, all full but the last
        blocks = [b["input_ids"] for b in packed if b["user_id"] == u]
        stream = [t for x, v in zip(text, user) if v == u for t in tok(x)["input_ids"] + [0]]
        assert sum(blocks, []) == stream
        assert [len(b) for b in blocks] == [block] * (len(blocks) - 1) + [len(stream) - block * (len(blocks) - 1)]
    assert tr.privacy_unit == "user" and tr.block_tokens == block
    tr.get_train_dataloader()
    assert tr.ledger.privacy_unit == "user (at most 2 blocks of 8 tokens each)" and tr.ledger.num_users == 3
    # TRL's own wrapped packing of the same texts (the block is the unit) does mix users: the check above can fail
    with pytest.warns(UserWarning, match="privacy unit is the block"):
        plain = sft(
            tmp_path / "plain", tr_texts(text), 1, 1, max_length=block, packing=True, packing_strategy="wrapped"
        )
    assert any(len({(t - 2) // 10 for t in b["input_ids"] if t != 0}) > 1 for b in plain.train_dataset)


def tr_texts(text):
    from datasets import Dataset

    return Dataset.from_dict({"text": text})


@pytest.mark.parametrize("removed", [0, 1, 2])  # a user with 1, k and more than k blocks
def test_user_packed_sft_removing_one_user_moves_the_clipped_sum_by_c(tmp_path, removed):
    k, block = 2, 4  # 3 words + <eos> = one block of 4 tokens
    rows = texts(8, seed=3)["text"]
    three = [" ".join(r.split()[:3]) for r in rows]
    # user 0: one block; user 1: 2 blocks (7 words + <eos>); user 2: 4 equal blocks (k of them drawn: all the same
    # gradient); user 3: 2 blocks
    text = [three[0], " ".join((rows[1].split() * 3)[:7]), three[2], three[2], three[2], three[2], three[3], three[4]]
    user = [0, 1, 2, 2, 2, 2, 3, 3]

    def keep(users):
        return [t for t, u in zip(text, user) if u in users], [u for u in user if u in users]

    tr = user_packed(tmp_path / "a", *keep({0, 1, 2, 3}), k, block)
    counts = [sum(1 for b in tr.train_dataset if b["user_id"] == u) for u in range(4)]
    assert counts == [1, k, 4, k]  # 1, k and more than k blocks
    full = released_sum(tr, 4)
    less = released_sum(user_packed(tmp_path / "b", *keep({0, 1, 2, 3} - {removed}), k, block), 3)
    moved = full - less
    assert float(moved.norm()) <= C * (1 + 1e-9)  # per-block clipping would allow up to k·C
    # the user's unit: the mean of its (at most k) blocks' gradients, each block collated alone, clipped once
    model = gpt2(double=True)
    blocks = [b for b in tr.train_dataset if b["user_id"] == removed][:k]
    mean = sum(grad_of(model, sft_loss_alone(model, tr.data_collator, b))[0] for b in blocks) / len(blocks)
    assert close(moved, clip(mean)) and float(moved.norm()) == pytest.approx(C, rel=1e-9)


# -- runs: ε, logs, generate, resume -------------------------------------------------------------------------
TRL_METRICS = ("mean_token_accuracy", "entropy", "num_tokens", "rewards/chosen", "rewards/margins", "logps/chosen")


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_run_logs_only_public_values_generates_and_resume_continues_the_ledger(tmp_path, kind):
    def make(out, max_steps):
        common = dict(max_steps=max_steps, save_strategy="steps", save_steps=2)
        if kind == "sft":
            return DPSFTTrainer(
                model=gpt2(),
                args=cfg(SFTConfig, out, max_length=16, **common),
                train_dataset=texts(16),
                processing_class=tokenizer(),
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                delta=1e-3,
            )
        return DPDPOTrainer(
            model=gpt2(),
            args=cfg(DPOConfig, out, **common),
            train_dataset=pairs(16),
            processing_class=tokenizer(),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            delta=1e-3,
        )

    whole = make(tmp_path / "whole", 4)
    out = whole.train()
    q = 4 / 16
    assert whole.sample_rate == q and len(whole.ledger) == 4
    assert whole.get_epsilon() == pytest.approx(dpsgd_epsilon(1.0, q, 4, 1e-3), rel=1e-9)
    assert out.metrics["epsilon"] == pytest.approx(whole.get_epsilon()) and math.isnan(out.training_loss)
    keys = {k for row in whole.state.log_history for k in row}
    assert keys <= set(LOGGED) | {"step"} and "epsilon" in keys
    assert not keys & set(TRL_METRICS)
    gen = whole.model.generate(torch.tensor([[2, 3, 4]]), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert tuple(gen.shape) == (1, 6)
    # interrupted after 2 steps, resumed to 4: the same ledger length and epsilon as the uninterrupted run
    first = make(tmp_path / "cut", 2)
    first.train()
    resumed = make(tmp_path / "cut", 4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    assert resumed.ledger.run_id == first.ledger.run_id and len(resumed.ledger) == 4
    assert resumed.get_epsilon() == pytest.approx(whole.get_epsilon(), rel=1e-12)
    summary = json.loads((tmp_path / "cut" / "checkpoint-4" / "privacy_summary.json").read_text())
    unit = "record" if kind == "sft" else "preference pair (prompt, chosen, rejected)"
    assert summary["privacy_unit"] == unit and (resumed.ledger.privacy_unit or "record") == unit


# -- refusals --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, unit, match",
    [
        (dict(packing=True), None, "flattens the whole batch"),  # TRL's default packing: bfd, padding-free
        (dict(padding_free=True), None, "flattens the whole batch"),
        (dict(loss_type="dft"), None, "loss_type='dft'"),
        (dict(packing=True), "user", "flattens the whole batch"),  # bfd packs across the batch: never per user
        (dict(packing=True, packing_strategy="bfd_split"), "user", "flattens the whole batch"),
        (dict(packing=True, packing_strategy="wrapped"), "user", "user column 'user_id'"),  # no user ids to pack by
        (
            dict(packing=True, packing_strategy="wrapped", dataset_kwargs={"skip_prepare_dataset": True}),
            "user",
            "packs within each user while preparing",
        ),
        (dict(packing=True, packing_strategy="wrapped"), "record", "the unit is the block"),
        (dict(activation_offloading=True), None, "activation_offloading"),
    ],
)
def test_sft_refusals(tmp_path, kw, unit, match):
    with pytest.raises(ValueError, match=match):
        DPSFTTrainer(
            model=gpt2(),
            args=cfg(SFTConfig, tmp_path, max_length=8, **kw),
            train_dataset=texts(8),
            processing_class=tokenizer(),
            noise_multiplier=1.0,
            privacy_unit=unit,
        )


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(loss_type=["aot"]), "couples pairs across the batch"),
        (dict(loss_type=["sft"]), "couples pairs across the batch"),
        (dict(loss_type=["bco_pair"]), "not implemented per pair"),
        (dict(precompute_ref_log_probs=True), "cache file on disk"),
        (dict(ld_alpha=0.5), "ld_alpha"),
        (dict(use_weighting=True), "use_weighting"),
        (dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2}), "DPDPOTrainer does not support FSDP2"),
    ],
)
def test_dpo_refusals(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        DPDPOTrainer(
            model=gpt2(),
            args=cfg(DPOConfig, tmp_path, **kw),
            train_dataset=pairs(8),
            processing_class=tokenizer(),
            noise_multiplier=1.0,
        )
    with pytest.raises(ValueError, match="unit of DPDPOTrainer is the preference pair"):
        DPDPOTrainer(
            model=gpt2(),
            args=cfg(DPOConfig, tmp_path),
            train_dataset=pairs(8),
            noise_multiplier=1.0,
            privacy_unit="user",
        )


def test_sft_then_dpo_default_reference_is_a_frozen_copy_not_the_live_policy(tmp_path):
    # after a TRL trainer the model's forward is TRL's patch, whose closure calls the ORIGINAL model: a deepcopy
    # of it would run the live policy. The default reference must stay the weights at DPO's start.
    model = gpt2()
    sft = DPSFTTrainer(
        model=model,
        args=cfg(SFTConfig, tmp_path / "sft", max_length=16, max_steps=2),
        train_dataset=texts(16),
        processing_class=tokenizer(),
        noise_multiplier=1.0,
        delta=1e-3,
    )
    sft.train()
    sft.engine.detach()  # the SFT run's hooks off the model before the next private run
    dpo = DPDPOTrainer(
        model=model,
        args=cfg(DPOConfig, tmp_path / "dpo", max_steps=2, learning_rate=0.1),
        train_dataset=pairs(16),
        processing_class=tokenizer(),
        noise_multiplier=1.0,
        delta=1e-3,
    )
    x = torch.tensor([[2, 3, 4, 5]])
    start = model(x).logits.detach().clone()
    assert torch.equal(dpo.ref_model(x).logits, start)
    dpo.train()
    assert torch.equal(dpo.ref_model(x).logits, start)  # frozen
    assert not torch.allclose(model(x).logits, start)  # the policy moved
    assert all(not p.requires_grad for p in dpo.ref_model.parameters())


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_dpo_empty_poisson_batch_is_one_release_of_pure_noise(tmp_path, sigma):
    # the loader tags the empty batch (0 pairs); GPT-2 cannot run 0 rows, so a public stand-in pair (2 rows, loss × 0)
    # runs: the rows-vs-pairs check must accept it and the release must be pure noise (exactly 0 at σ = 0)
    from dpopt.release_boundary import ChunkTag, boundary_of

    model = gpt2()
    tr = DPDPOTrainer(
        model=model,
        args=cfg(DPOConfig, tmp_path, **EXACT),
        train_dataset=pairs(8),
        processing_class=tokenizer(),
        noise_multiplier=sigma,
        delta=1e-3,
        method=torch.optim.SGD(model.parameters(), lr=1.0),
    )
    # up to 8 passes of the loader's 2 batches (q = 4/8 over 8 pairs): a batch is empty with probability 2^-8 (secret
    # masks), so both batches of one pass were empty (StopIteration) in 2^-16 = 1.5e-5 of the cases; over 8 passes
    # 2^-128
    passes = tr.get_train_dataloader()
    loader = (b for _ in range(8) for b in passes)
    batch = next(loader)
    while int(batch["input_ids"].shape[0]) < 2:  # the first release checks the engine on a real batch
        batch = next(loader)
    tr.training_step(model, batch)
    tr.optimizer.step()
    before = flat(model)
    empty = {k: v[:0] for k, v in batch.items()}
    boundary = boundary_of(tr.optimizer)
    boundary.hand(ChunkTag(boundary.new_batch(), 0, 1, 0))  # as the Poisson loader tags an empty draw
    tr.training_step(model, empty)
    tr.optimizer.step()
    assert len(tr.ledger) == 2
    moved = [not torch.equal(before[k], p) for k, p in flat(model).items()]
    assert all(moved) if sigma > 0 else not any(moved)
