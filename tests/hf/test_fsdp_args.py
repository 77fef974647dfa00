"""``dpopt.hf.fsdp_args`` in one process (no process group): which modules ``TrainingArguments(fsdp=...)`` shards
(accelerate's FSDP2 auto-wrap rule), the order, the copy of ``args`` without FSDP, and the refusals.

The sharding itself and the training run on 2 gloo processes: tests/distributed/test_hf_trainer_accelerate_fsdp.py.
"""

from __future__ import annotations

import warnings

import pytest

T = pytest.importorskip("transformers")

from dpopt.hf.fsdp_args import _bottom_up, _wrap_policy, fsdp_refusals, without_fsdp  # noqa: E402

if not hasattr(T.TrainingArguments, "_process_fsdp_args"):  # transformers 4.x: no fsdp_plugin_args
    pytest.skip("this transformers builds no fsdp_plugin_args", allow_module_level=True)


def gpt2(layers=2):
    cfg = T.GPT2Config(n_layer=layers, n_embd=16, n_head=2, vocab_size=37, n_positions=16)
    return T.GPT2LMHeadModel(cfg)


def chosen(model, plugin):
    policy = _wrap_policy(model, plugin)
    return [name for name, m in model.named_modules() if m is not model and policy(m)]


def test_transformer_wrap_takes_the_no_split_blocks_or_the_named_classes():
    model = gpt2()
    assert chosen(model, {}) == ["transformer.h.0", "transformer.h.1"]  # GPT2LMHeadModel._no_split_modules
    assert chosen(model, {"transformer_cls_names_to_wrap": "GPT2MLP"}) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    with pytest.raises(ValueError, match="'NoSuchBlock', which is not a module class of GPT2LMHeadModel"):
        _wrap_policy(model, {"transformer_cls_names_to_wrap": "GPT2MLP,NoSuchBlock"})
    assert chosen(model, {"auto_wrap_policy": "NO_WRAP"}) == []


def test_size_wrap_takes_every_module_over_min_num_params():
    model = gpt2()
    least = sum(p.numel() for p in model.transformer.h[0].parameters()) - 1  # a block has least + 1
    names = chosen(model, {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": least})
    # the blocks and every ancestor of them (a module counts its descendants' parameters)
    assert names == ["transformer", "transformer.h", "transformer.h.0", "transformer.h.1"]


def test_modules_come_after_their_descendants():
    model = gpt2()
    order = _bottom_up(model)
    position = {id(m): i for i, m in enumerate(order)}
    assert model not in order and len(position) == len(list(model.modules())) - 1
    for m in order:
        assert all(position[id(c)] < position[id(m)] for c in m.children())


def test_the_copy_has_fsdp_off_and_the_original_keeps_it(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = T.TrainingArguments(str(tmp_path), fsdp="full_shard", fsdp_config={"fsdp_version": 2}, use_cpu=True)
    off = without_fsdp(args)
    assert not off.fsdp and off.fsdp_plugin_args is None and not off.fsdp_config
    assert args.fsdp and args.fsdp_plugin_args["fsdp_version"] == 2 and args.fsdp_plugin_args["reshard_after_forward"]
    assert fsdp_refusals(off) == []  # nothing asked, nothing refused


@pytest.mark.parametrize(
    "config, match",
    [
        ({"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"}, "FULL_STATE_DICT"),
        ({"fsdp_version": 2, "activation_checkpointing": True}, "activation_checkpointing"),
        ({"fsdp_version": 2, "cpu_ram_efficient_loading": True}, "load the model on every rank"),
        ({"fsdp_version": 1}, "FSDP2 only"),
    ],
)
def test_each_unsupported_setting_is_named(tmp_path, monkeypatch, config, match):
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # TrainingArguments(fsdp=...) writes it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = T.TrainingArguments(str(tmp_path), fsdp=True, fsdp_config=config, use_cpu=True)
    problems = fsdp_refusals(args)
    assert any(match in p for p in problems), problems
    assert any("one process" in p for p in problems)  # and this pytest process is one process
    assert not any("not supported by DPTrainer's FSDP2 path" in p for p in problems), problems  # FSDP1's defaults
