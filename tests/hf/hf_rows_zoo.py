"""Tiny Hugging Face models whose layers see rows that are not examples (:mod:`dpopt.engine.lift`).

Each builder returns ``(model, x, y, loss_fn, batch_loss)`` as in
:mod:`hf_zoo` (``model(x)`` a tensor ``[B, ...]``; ``loss_fn(out_i, y_i)``
one example's loss; ``batch_loss(out, y)`` the mean of the per-example
losses), in float64 with dropout off (an enclosing call's vjp re-runs its
forward per example). The kind each covers:

* tokens flattened to ``[B·T, H]``: OPT (``final_layer_norm``, ``fc1``, ``fc2``);
* mixture of experts (routers over ``[B·T, H]`` tokens, experts over routed
  subsets): Mixtral, Qwen2-MoE (with a shared expert and its gate), Qwen3-MoE;
* parameters used on tables shared by the batch: T5 (``relative_attention_bias``),
  BART and mBART (decoder learned positions), DeBERTa-v2 (``pos_key_proj``), MPNet;
* windows: Swin (window partition, relative position table); BEiT (relative position bias);
* a weight-norm parametrization: wav2vec2 (``pos_conv_embed.conv``).

A builder returns None when this transformers version lacks the model class
(CI also runs at transformers 4.47).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers as T
from hf_zoo import Wrap

from dpopt.losses import per_example_lm_loss

V, D, L, B = 37, 16, 6, 4


def _ce(out, y):
    return F.cross_entropy(out, y)


def _lm(out, y):
    return per_example_lm_loss(out, y)


def _lm_batch(out, y):
    return per_example_lm_loss(out, y).mean()


def _s2s(out, y):
    return per_example_lm_loss(out, y, shift=False)


def _s2s_batch(out, y):
    return per_example_lm_loss(out, y, shift=False).mean()


def _cls(name: str):
    return getattr(T, name, None)


def _ids(gen, lo=2):
    return torch.randint(lo, V, (B, L), generator=gen)


def _causal(model_cls: str, cfg, gen):
    cls = _cls(model_cls)
    if cls is None:
        return None
    model = Wrap(cls(cfg)).double().train()
    ids = _ids(gen)
    y = ids.clone()
    y[0, -2:] = -100
    return model, ids, y, _lm, _lm_batch


def _experts_eager(cfg):
    cfg._experts_implementation = "eager"  # transformers 5: grouped_mm has no float64 kernel on CPU
    return cfg


def opt(gen):
    cfg = T.OPTConfig(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=2,
        ffn_dim=32,
        num_attention_heads=2,
        max_position_embeddings=16,
        word_embed_proj_dim=D,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=1,
        use_cache=False,
    )
    return _causal("OPTForCausalLM", cfg, gen)


def mixtral(gen):
    cfg = T.MixtralConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=16,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return _causal("MixtralForCausalLM", _experts_eager(cfg), gen)


def qwen2_moe(gen):
    cfg = T.Qwen2MoeConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=16,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return _causal("Qwen2MoeForCausalLM", _experts_eager(cfg), gen)


def qwen3_moe(gen):
    cls = _cls("Qwen3MoeConfig")
    if cls is None:
        return None
    cfg = cls(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=16,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return _causal("Qwen3MoeForCausalLM", _experts_eager(cfg), gen)


def _seq2seq(model_cls: str, cfg, gen):
    cls = _cls(model_cls)
    if cls is None:
        return None
    model = Wrap(cls(cfg), ("input_ids", "attention_mask", "decoder_input_ids")).double().train()
    ids, dec = _ids(gen), _ids(gen)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, -2:] = 0  # example 0 is padded
    y = torch.randint(2, V, (B, L), generator=gen)
    y[1, -1] = -100
    return model, torch.stack([ids, mask, dec], 1), y, _s2s, _s2s_batch


def t5(gen):
    cfg = T.T5Config(
        vocab_size=V,
        d_model=D,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        pad_token_id=0,
        decoder_start_token_id=0,
        use_cache=False,
    )
    return _seq2seq("T5ForConditionalGeneration", cfg, gen)


def _bart_family(prefix: str, gen):
    """BART and mBART share one config shape; only the classes differ."""
    cfg = getattr(T, f"{prefix}Config")(
        vocab_size=V,
        d_model=D,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=16,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        use_cache=False,
    )
    return _seq2seq(f"{prefix}ForConditionalGeneration", cfg, gen)


def bart(gen):
    return _bart_family("Bart", gen)


def mbart(gen):
    return _bart_family("MBart", gen)


def _classify(model_cls: str, cfg, gen, keys=("input_ids", "attention_mask")):
    cls = _cls(model_cls)
    if cls is None:
        return None
    model = Wrap(cls(cfg), keys).double().train()
    ids = _ids(gen)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, -2:] = 0
    ids[0, -2:] = 0
    y = torch.randint(0, 3, (B,), generator=gen)
    return model, torch.stack([ids, mask], 1), y, _ce, _ce


def deberta_v2(gen):
    cfg = T.DebertaV2Config(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        relative_attention=True,
        position_buckets=4,
        max_relative_positions=8,
        pos_att_type=["p2c", "c2p"],
        share_att_key=False,
        norm_rel_ebd="layer_norm",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        pad_token_id=0,
        type_vocab_size=0,
    )
    return _classify("DebertaV2ForSequenceClassification", cfg, gen)


def mpnet(gen):
    cfg = T.MPNetConfig(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        relative_attention_num_buckets=32,  # MPNet's bucketing assumes 32
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
        pad_token_id=1,
    )
    return _classify("MPNetForSequenceClassification", cfg, gen)


def _image(model_cls: str, cfg, gen, size: int):
    cls = _cls(model_cls)
    if cls is None:
        return None
    model = Wrap(cls(cfg), ("pixel_values",)).double().train()
    x = torch.randn(B, 3, size, size, generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (B,), generator=gen), _ce, _ce


def swin(gen):
    cfg = T.SwinConfig(
        image_size=8,
        patch_size=2,
        num_channels=3,
        embed_dim=8,
        depths=[2, 1],
        num_heads=[2, 2],
        window_size=2,
        mlp_ratio=2.0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
        num_labels=3,
    )
    return _image("SwinForImageClassification", cfg, gen, 8)


def beit(gen):
    cfg = T.BeitConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        use_relative_position_bias=True,
        use_mean_pooling=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
        num_labels=3,
    )
    return _image("BeitForImageClassification", cfg, gen, 8)


def wav2vec2(gen):
    cls = _cls("Wav2Vec2ForSequenceClassification")
    if cls is None:
        return None
    cfg = T.Wav2Vec2Config(
        hidden_size=D,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        conv_dim=(8, 8),
        conv_stride=(4, 2),
        conv_kernel=(8, 4),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.0,
        mask_feature_prob=0.0,
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
        classifier_proj_size=8,
        num_labels=3,
    )
    model = Wrap(cls(cfg), ("input_values",)).double().train()
    x = torch.randn(B, 64, generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (B,), generator=gen), _ce, _ce


CASES = {
    "opt": opt,
    "mixtral": mixtral,
    "qwen2-moe": qwen2_moe,
    "qwen3-moe": qwen3_moe,
    "t5": t5,
    "bart": bart,
    "mbart": mbart,
    "deberta-v2": deberta_v2,
    "mpnet": mpnet,
    "swin": swin,
    "beit": beit,
    "wav2vec2": wav2vec2,
}


def make(name: str, seed: int = 0):
    """The case ``name`` (None if this transformers lacks its class), seeded."""
    torch.manual_seed(seed)
    return CASES[name](torch.Generator().manual_seed(seed + 1))
