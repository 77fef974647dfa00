"""DPTrainer's device settings in one process: bf16 accepted (autocast left after train), fp16 / deepspeed / fsdp /
several GPUs in one process refused with what to use instead; dpopt.hf.distributed's context checks."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

import transformers as T  # noqa: E402

from dpopt.hf import DPTrainer  # noqa: E402
from dpopt.hf.distributed import check_launch, data_parallel_context, launched_args  # noqa: E402

V, L, N = 37, 8, 16


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randint(1, V, (N, L), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "attention_mask": torch.ones(L, dtype=torch.long), "labels": self.x[i]}


def gpt2():
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V, n_positions=16, bos_token_id=0, eos_token_id=0)
    return T.GPT2LMHeadModel(cfg)


def targs(out, **kw):
    base = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    base.update(kw)
    return T.TrainingArguments(str(out), **base)


def test_bf16_trains_in_one_process_and_leaves_no_autocast(tmp_path, monkeypatch):
    # transformers 4.47's TrainingArguments(bf16=True) writes ACCELERATE_MIXED_PRECISION=bf16 into the process
    # environment: restored after this test (monkeypatch), so later tests' float32 trainers stay float32
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    model = gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = DPTrainer(
            model=model,
            args=targs(tmp_path, bf16=True),
            train_dataset=Tokens(),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            privacy_unit="record",
        )
        tr.train()
    assert len(tr.ledger) == 2 and not tr.ranks.enabled
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast: the parameters stay float32
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(
    "setting, match",
    [
        (dict(fp16=True), "use bf16=True"),
        (dict(deepspeed={"train_batch_size": 4}), "FSDP2"),
        (dict(fsdp=["full_shard"]), "pass fsdp= / fsdp_config= to its constructor"),
        (dict(_n_gpu=2), "torchrun --nproc_per_node 2"),
    ],
)
def test_device_settings_it_cannot_honour_say_what_to_use(tmp_path, setting, match):
    args = targs(tmp_path)
    for k, v in setting.items():
        setattr(args, k, v)  # after __post_init__ (fp16 needs a GPU there)
    with pytest.raises(ValueError, match=match):
        DPTrainer(model=gpt2(), args=args, train_dataset=Tokens(), noise_multiplier=1.0)


@pytest.mark.parametrize(
    "fsdp, match",
    [
        (dict(fsdp="full_shard"), r"fsdp with one process: .*torchrun --nproc_per_node W"),
        (dict(fsdp=True, fsdp_config={"fsdp_version": 1}), "DPTrainer supports FSDP2 only"),
        (dict(fsdp="full_shard offload"), "cpu_offload"),
    ],
)
def test_fsdp_settings_it_cannot_honour_say_what_to_change(tmp_path, monkeypatch, fsdp, match):
    if not hasattr(T.TrainingArguments, "_process_fsdp_args"):  # transformers 4.x: FSDP set up through os.environ
        pytest.skip("this transformers builds no fsdp_plugin_args (DPTrainer refuses its fsdp= as a whole)")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # TrainingArguments(fsdp=...) sets it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = targs(tmp_path, **fsdp)
    with pytest.raises(ValueError, match=match):
        DPTrainer(model=gpt2(), args=args, train_dataset=Tokens(), noise_multiplier=1.0)


def test_world_size_without_its_process_group_is_refused():
    assert not data_parallel_context(1).enabled
    with pytest.raises(RuntimeError, match="torchrun"):
        data_parallel_context(2)


def test_a_launch_the_trainer_does_not_see_is_refused(tmp_path, monkeypatch):
    args = targs(tmp_path)
    assert launched_args(args) is args  # no launcher: unchanged
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="use_cpu=True"):
        check_launch(1)  # 2 processes started, each alone: separate runs on the whole dataset
    check_launch(2)


def test_a_mixed_precision_left_in_the_environment_is_refused_not_silently_used(tmp_path, monkeypatch):
    # accelerate launch --mixed_precision bf16, or an earlier TrainingArguments(bf16=True) under transformers 4.47:
    # accelerate would run this float32 trainer's forward in bf16 autocast (both transformers 4.47 and 5.x)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    args = targs(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"ACCELERATE_MIXED_PRECISION='bf16'.*pass bf16=True"):
            DPTrainer(model=gpt2(), args=args, train_dataset=Tokens(), noise_multiplier=1.0, max_grad_norm=1.0)


@pytest.mark.parametrize("name", ["noise_multiplier", "target_epsilon"])
def test_a_budget_given_as_text_is_refused(tmp_path, name):
    with pytest.raises(TypeError, match=f"{name} must be a number, got str '8'"):
        DPTrainer(model=gpt2(), args=targs(tmp_path), train_dataset=Tokens(), max_grad_norm=1.0, **{name: "8"})
