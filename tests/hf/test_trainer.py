"""DPTrainer (dpopt.hf): tiny HF models built from configs (no downloads), trained privately through transformers.Trainer.

Done-when of issue 21 (Trainer part): LoRA GPT-2 and a BERT classifier train;
ε equals dp_accounting's PLD of the run; generate()/save_pretrained()/
merge_and_unload() work after training; resume from a Trainer checkpoint
continues the ledger (also after save_total_limit deleted the checkpoint
resumed from); the chunks of a Poisson batch are one release (σ = 0: the
update is exactly the clipped per-example sum / B̄, computed here by single-
example autograd); only public values are logged; refusals.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import peft  # noqa: E402
import transformers as T  # noqa: E402
from dp_accounting import dp_event  # noqa: E402
from dp_accounting.pld import pld_privacy_accountant  # noqa: E402

from dpopt.accounting.accountant import dpsgd_epsilon, epsilon  # noqa: E402
from dpopt.accounting.events import dpsgd_event, poisson_gaussian_step  # noqa: E402
from dpopt.hf import DPTrainer  # noqa: E402
from dpopt.hf.trainer import LEDGER_FILE, LOGGED, SUMMARY_FILE  # noqa: E402
from dpopt.losses import per_example_lm_loss  # noqa: E402
from dpopt.noise import NoiseSource  # noqa: E402

V, L, N = 37, 8, 32


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


class Tokens(torch.utils.data.Dataset):
    """N random token sequences (a causal-LM or a classification dataset)."""

    def __init__(self, n=N, classes=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(1, V, (n, L), generator=g)
        self.y = None if classes is None else torch.randint(0, classes, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        item = {"input_ids": self.x[i], "attention_mask": torch.ones(L, dtype=torch.long)}
        item["labels"] = self.x[i] if self.y is None else self.y[i]
        return item


def gpt2(lora=False, drop=0.0):
    torch.manual_seed(0)
    cfg = T.GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        vocab_size=V,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=drop,
        embd_pdrop=drop,
        attn_pdrop=drop,
    )
    model = T.GPT2LMHeadModel(cfg)
    if lora:
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
        )
    return model


def bert():
    torch.manual_seed(0)
    cfg = T.BertConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=3,
        pad_token_id=0,
    )
    return T.BertForSequenceClassification(cfg)


def targs(out, **kw):
    base = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1000,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    base.update(kw)
    return T.TrainingArguments(str(out), **base)


def pld_epsilon(sigma, q, steps, delta):
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_lora_gpt2_trains_and_epsilon_is_dp_accountings_pld(tmp_path):
    model = gpt2(lora=True)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = trainable(model)
    tr = DPTrainer(
        model=model,
        args=targs(tmp_path, max_steps=4),
        train_dataset=Tokens(),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        delta=1e-5,
    )
    out = tr.train()
    assert tr.sample_rate == 0.125 and tr.expected_batch_size == 4.0  # B-bar = 2 x 2 over N = 32
    assert len(tr.ledger) == 4
    want = pld_epsilon(1.0, 0.125, 4, 1e-5)
    assert tr.get_epsilon() == pytest.approx(want, rel=1e-3)
    assert out.metrics["epsilon"] == pytest.approx(want, rel=1e-3) and math.isnan(out.training_loss)
    after = trainable(model)
    assert all(n.find("lora_") >= 0 for n in after) and all(not torch.equal(before[n], after[n]) for n in after)
    assert all(torch.equal(frozen[n], p) for n, p in model.named_parameters() if n in frozen)
    # min_new_tokens: the trained (secret-noise) model may emit EOS early (seen under transformers 4.47)
    gen = model.generate(
        input_ids=torch.ones(2, 3, dtype=torch.long), max_new_tokens=4, min_new_tokens=4, do_sample=False
    )
    assert gen.shape == (2, 7)
    merged = model.merge_and_unload()
    assert isinstance(merged, T.GPT2LMHeadModel)
    merged.save_pretrained(tmp_path / "merged")
    again = T.GPT2LMHeadModel.from_pretrained(tmp_path / "merged")
    x = torch.randint(1, V, (2, L))
    assert torch.allclose(again(input_ids=x).logits, merged(input_ids=x).logits, atol=1e-6)


def test_bert_classifier_trains_and_logs_only_public_values(tmp_path):
    model = bert()
    before = trainable(model)
    tr = DPTrainer(
        model=model,
        args=targs(tmp_path, save_strategy="steps", save_steps=3, logging_steps=1),
        train_dataset=Tokens(classes=3),
        eval_dataset=Tokens(classes=3, seed=1),
        noise_multiplier=0.8,
        max_grad_norm=0.5,
    )
    tr.train()
    assert len(tr.ledger) == 3 and all(not torch.equal(before[n], p) for n, p in trainable(model).items())
    metrics = tr.evaluate()  # returned to the caller, never logged (eval_is_public=False)
    assert "eval_loss" in metrics and math.isfinite(metrics["eval_loss"])
    state = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    keys = {k for row in state["log_history"] for k in row}
    assert keys <= set(LOGGED) | {"step"} and "epsilon" in keys
    assert state["total_flos"] == 0
    assert all(not k.startswith("eval_") for row in tr.state.log_history for k in row)
    saved = json.loads((tmp_path / "checkpoint-3" / LEDGER_FILE).read_text())
    summary = json.loads((tmp_path / "checkpoint-3" / SUMMARY_FILE).read_text())
    assert saved["run_id"] == tr.ledger.run_id and summary["steps"] == 3
    assert summary["epsilon"] == pytest.approx(dpsgd_epsilon(0.8, 0.125, 3, 1e-5), rel=1e-9)


class Recording(DPTrainer):
    """Keeps each Poisson batch and the parameters before its step (test only: the batch is private)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append(({k: v.clone() for k, v in inputs.items()}, trainable(model)))
        return super().training_step(model, inputs, num_items_in_batch)

    def _losses(self, model, inputs):
        self.chunks.append(inputs["input_ids"].shape[0])
        return super()._losses(model, inputs)


def _near_equal(n, size):
    """Chunk sizes of n examples in ceil(n / size) chunks differing by <= 1 (an empty batch: one empty stand-in)."""
    if n == 0:
        return [1]
    k = math.ceil(n / size)
    return [n // k + (i < n % k) for i in range(k)]


def _clipped_sum(model, params, batch, c):
    """Σ_i clip_C(∇ℓ_i) by single-example autograd at ``params`` (the reference of one release with σ = 0)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in params:
                p.copy_(params[n])
    names = list(params)
    total = {n: torch.zeros_like(params[n]) for n in names}
    for i in range(batch["input_ids"].shape[0]):
        model.zero_grad()
        logits = model(
            input_ids=batch["input_ids"][i : i + 1], attention_mask=batch["attention_mask"][i : i + 1]
        ).logits
        per_example_lm_loss(logits, batch["labels"][i : i + 1]).sum().backward()
        g = {n: p.grad.detach().clone() for n, p in model.named_parameters() if n in params}
        norm = torch.sqrt(sum(v.double().square().sum() for v in g.values()))
        scale = min(1.0, c / float(norm))
        for n in names:
            total[n] += g[n] * scale
    return total


@pytest.mark.parametrize("reentrant", [None, True, False], ids=["no-checkpointing", "reentrant", "non-reentrant"])
def test_accumulated_chunks_are_one_release_and_sigma0_update_is_the_clipped_sum(tmp_path, reentrant):
    # B-bar = 2 x 4 = 8 over N = 32 (q = 1/4): each Poisson batch is cut into chunks of <= 2 examples;
    # with gradient checkpointing (both forms) the update is the same clipped sum (reference: no checkpointing)
    model = gpt2()
    lr, c = 0.5, 0.05
    ckpt = {} if reentrant is None else dict(gradient_checkpointing=True)
    if reentrant is not None:
        ckpt["gradient_checkpointing_kwargs"] = {"use_reentrant": reentrant}
    tr = Recording(
        model=model,
        args=targs(
            tmp_path, gradient_accumulation_steps=4, max_steps=2, lr_scheduler_type="constant", learning_rate=lr, **ckpt
        ),
        train_dataset=Tokens(),
        noise_multiplier=0.0,
        max_grad_norm=c,
        method=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr),
    )
    # σ = 0 draws no noise: seed the Poisson masks, so that the batches (and "a batch needed accumulation" below)
    # are fixed. On secret masks two batches of Binomial(32, 1/4) both <= 2 had probability 0.0067² = 4.5e-5 per
    # case, 1.3e-4 per run over the three cases (not "< 1e-6").
    tr.engine.noise = NoiseSource("reproducible", seed=2)
    tr.seen, tr.chunks = [], []
    tr.train()
    final = trainable(model)
    flags = [m.gradient_checkpointing for m in model.modules() if "gradient_checkpointing" in m.__dict__]
    assert any(f is True for f in flags) == (reentrant is not None)  # the Trainer switched it on (or not)
    assert len(tr.ledger) == 2 and tr.sample_rate == 0.25
    assert all(e.event.sampling_probability == 0.25 for e in tr.ledger.entries)  # one release at q, not k at q/k
    sizes = [b["input_ids"].shape[0] for b, _ in tr.seen]
    assert tr.chunks == [m for s in sizes for m in _near_equal(s, 2)]  # chunks of <= 2 examples, by hand
    assert any(s > 2 for s in sizes), "no batch needed accumulation (another masks seed is needed)"
    ends = [p for _, p in tr.seen[1:]] + [final]
    for (batch, start), end in zip(tr.seen, ends):
        want = _clipped_sum(gpt2(), start, batch, c)
        for n in start:
            step = (start[n] - end[n]) / lr * 8  # SGD: theta -= lr * clipped_sum / B-bar
            assert torch.allclose(step, want[n], atol=1e-5, rtol=1e-3), n
        moved = math.sqrt(sum(float(((start[n] - end[n]) / lr * 8).double().square().sum()) for n in start))
        assert moved <= c * len(batch["input_ids"]) + 1e-6  # sensitivity: each example moves it by <= C


def test_resume_continues_the_ledger_after_save_total_limit_deleted_checkpoints(tmp_path):
    kept = tmp_path / "kept-2"

    class Keep(T.TrainerCallback):
        def on_save(self, args, state, control, **kw):
            if state.global_step == 2:
                shutil.copytree(tmp_path / "run" / "checkpoint-2", kept)

    a = dict(save_strategy="steps", save_steps=2, save_total_limit=1)
    tr = DPTrainer(
        model=gpt2(lora=True),
        args=targs(tmp_path / "run", max_steps=4, **a),
        train_dataset=Tokens(),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        callbacks=[Keep()],
    )
    tr.train()
    run_id = tr.ledger.run_id
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-4"]
    assert [p.name for p in (tmp_path / "run").glob("ledger-*.jsonl")] == [f"ledger-{run_id}.jsonl"]
    # resume from the last checkpoint: 4 releases restored, 2 more
    tr2 = DPTrainer(
        model=gpt2(lora=True),
        args=targs(tmp_path / "run", max_steps=6, **a),
        train_dataset=Tokens(),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    tr2.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert tr2.ledger.run_id == run_id and len(tr2.ledger) == 6
    assert tr2.get_epsilon() == pytest.approx(dpsgd_epsilon(1.0, 0.125, 6, 1e-5), rel=1e-9)
    # resume from the copy of the deleted checkpoint-2: the journal still charges the 4 releases made after it
    tr3 = DPTrainer(
        model=gpt2(lora=True),
        args=targs(tmp_path / "run", max_steps=3, **a),
        train_dataset=Tokens(),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    with pytest.warns(UserWarning, match="release"):
        tr3.train(resume_from_checkpoint=str(kept))
    assert len(tr3.ledger) == 7  # the 6 journaled + 1 new step (global step 2 -> 3)


def test_max_epsilon_stops_before_exceeding(tmp_path):
    cap = dpsgd_epsilon(1.0, 0.125, 3, 1e-5) * 1.0001
    tr = DPTrainer(
        model=gpt2(),
        args=targs(tmp_path, max_steps=50),
        train_dataset=Tokens(),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        max_epsilon=cap,
    )
    tr.train()
    assert len(tr.ledger) == 3 and tr.get_epsilon() <= cap
    assert tr.next_step_exceeds()  # the ledger holds this run's steps only: the cached T
    tr.noise_multiplier = 8.0  # as if resumed with another sigma: the next step is composed onto the ledger
    nxt = dp_event.ComposedDpEvent([dpsgd_event(1.0, 0.125, 3), poisson_gaussian_step(8.0, 0.125)])
    assert tr.next_step_exceeds() and epsilon(nxt, 1e-5) > cap  # any step adds: still over the cap
    tr.max_epsilon = epsilon(nxt, 1e-5) * 1.0001
    assert not tr.next_step_exceeds()


@pytest.mark.slow  # ~10 s: the calibration's PLD evaluations
def test_target_epsilon_calibrates_sigma_for_the_planned_steps(tmp_path):
    tr = DPTrainer(
        model=bert(),
        args=targs(tmp_path, max_steps=2),
        train_dataset=Tokens(classes=3),
        target_epsilon=4.0,
        max_grad_norm=1.0,
        delta=1e-5,
        method="dp-adam",
        method_kwargs={"lr": 1e-3},
    )
    tr.train()
    assert len(tr.ledger) == 2
    eps = tr.get_epsilon()
    assert eps <= 4.0 and eps == pytest.approx(4.0, rel=0.02)


def test_resume_without_optimizer_state_is_refused(tmp_path):
    tr = DPTrainer(
        model=gpt2(),
        args=targs(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, save_only_model=True),
        train_dataset=Tokens(),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    tr.train()
    assert (tmp_path / "checkpoint-2" / LEDGER_FILE).is_file()
    tr2 = DPTrainer(
        model=gpt2(), args=targs(tmp_path, max_steps=3), train_dataset=Tokens(), noise_multiplier=1.0, max_grad_norm=1.0
    )
    with pytest.raises(ValueError, match="optimizer.pt"):
        tr2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


@pytest.mark.parametrize(
    "setting, match",
    [
        (dict(fp16=True), "fp16"),
        (dict(torch_compile=True), "torch_compile"),
        (dict(load_best_model_at_end=True), "load_best_model_at_end"),
        (dict(save_strategy="best"), "save_strategy='best'"),
        (dict(include_num_input_tokens_seen="all"), "token count"),
        (dict(train_sampling_strategy="group_by_length"), "length-grouped"),
        (dict(auto_find_batch_size=True), "auto_find_batch_size"),
    ],
)
def test_settings_it_cannot_honour_are_refused(tmp_path, setting, match):
    args = targs(tmp_path)
    for k, v in setting.items():
        setattr(args, k, v)  # set after __post_init__ (some need a GPU there)
    with pytest.raises(ValueError, match=match):
        DPTrainer(model=gpt2(), args=args, train_dataset=Tokens(), noise_multiplier=1.0)


def test_refusals_of_arguments(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        DPTrainer(model=gpt2(), args=targs(tmp_path), train_dataset=Tokens(), noise_multiplier=1.0, target_epsilon=1.0)
    with pytest.raises(ValueError, match="EarlyStoppingCallback"):
        DPTrainer(
            model=gpt2(),
            args=targs(tmp_path),
            train_dataset=Tokens(),
            noise_multiplier=1.0,
            callbacks=[T.EarlyStoppingCallback()],
        )
    with pytest.raises(ValueError, match="per_example_loss"):
        DPTrainer(
            model=gpt2(),
            args=targs(tmp_path),
            train_dataset=Tokens(),
            noise_multiplier=1.0,
            compute_loss_func=lambda *a, **k: 0,
        )
    tr = DPTrainer(model=gpt2(), args=targs(tmp_path), train_dataset=Tokens(), noise_multiplier=1.0, delta=0.05)
    with pytest.raises(ValueError, match="1/N"):
        tr.train()


def test_args_are_copied_not_changed(tmp_path):
    args = targs(tmp_path, max_grad_norm=1.0, gradient_accumulation_steps=3)
    tr = DPTrainer(model=gpt2(), args=args, train_dataset=Tokens(), noise_multiplier=1.0)
    assert args.max_grad_norm == 1.0 and args.gradient_accumulation_steps == 3 and not args.ignore_data_skip
    assert tr.args.max_grad_norm == 0.0 and tr.args.gradient_accumulation_steps == 1 and tr.bbar == 6


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_an_empty_poisson_batch_is_one_release_of_pure_noise(tmp_path, sigma):
    model = gpt2()
    tr = DPTrainer(
        model=model,
        args=targs(tmp_path),
        train_dataset=Tokens(),
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        method=torch.optim.SGD([p for p in model.parameters()], lr=1.0),
    )
    # each step below is on a batch the loader handed out, over up to 8 passes: a Poisson batch (q = 1/8, N = 32)
    # has <= 2 examples with probability 0.219 (secret masks), so one pass of 8 batches held no good batch
    # followed by another in 0.219^7 = 2.4e-5 of the cases (StopIteration); over 8 passes 0.219^63 < 1e-41
    loader = tr.get_train_dataloader()
    batches = (b for _ in range(8) for b in loader)
    good = next(b for b in batches if len(b["input_ids"]) >= 3)
    tr.training_step(model, good)  # the first batch (the engine's check) is a real one
    tr.optimizer.step()
    before = trainable(model)
    next(batches)  # a new batch: the step releases an empty subset of it
    empty = {k: v[:0] for k, v in good.items()}  # GPT-2 cannot run 0 examples: the public stand-in runs
    tr.training_step(model, empty)
    tr.optimizer.step()
    assert len(tr.ledger) == 2
    moved = [not torch.equal(before[n], p) for n, p in trainable(model).items()]
    assert all(moved) if sigma > 0 else not any(moved)  # sigma 0: the release is exactly 0


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(V - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def test_variable_length_texts_through_the_hf_collators(tmp_path):
    tok = _tokenizer()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, L + 1, (N,), generator=g).tolist()
    texts = [" ".join(f"w{int(w)}" for w in torch.randint(0, V - 2, (n,), generator=g)) for n in lengths]
    lm = [tok(t) for t in texts]  # dicts of lists, padded per batch by the collator
    model = gpt2(lora=True)
    tr = DPTrainer(
        model=model,
        args=targs(tmp_path, max_steps=2),
        train_dataset=lm,
        processing_class=tok,
        data_collator=T.DataCollatorForLanguageModeling(tok, mlm=False),
        noise_multiplier=1.0,
    )
    tr.train()
    assert len(tr.ledger) == 2
    cls = [dict(tok(t), labels=int(i % 3)) for i, t in enumerate(texts)]
    tr = DPTrainer(
        model=bert(),
        args=targs(tmp_path / "b", max_steps=2),
        train_dataset=cls,
        processing_class=tok,
        data_collator=T.DataCollatorWithPadding(tok),
        noise_multiplier=1.0,
    )
    tr.train()
    assert len(tr.ledger) == 2


def test_a_mixing_hook_added_during_training_is_checked_and_refused(tmp_path):
    """A forward hook that mixes examples, registered by a callback after step 1: the next step is re-checked.

    The user's hooks are part of the first-batch check's signature
    (:func:`dpopt.engine.check.module_state`); the hook door refuses a step
    whose per-example gradients disagree with single-example autograd.
    """
    model = bert()

    class AddHook(T.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                model.classifier.register_forward_hook(lambda m, i, o: o + o.mean(0, keepdim=True))

    tr = DPTrainer(
        model=model,
        # q = 16/32: step 2's Poisson batch has >= 2 examples (checkable) but with probability 33 / 2**32 ≈ 8e-9;
        # at q = 4/32 it had < 2 in 7.7% of runs, its check waited (a batch of 1 cannot mix) and 2 steps released
        args=targs(tmp_path, max_steps=6, per_device_train_batch_size=16, gradient_accumulation_steps=1),
        train_dataset=Tokens(classes=3),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        callbacks=[AddHook()],
    )
    with pytest.raises(ValueError, match="do not match single-example autograd"):
        tr.train()
    assert len(tr.ledger) == 1  # the step before the hook only
