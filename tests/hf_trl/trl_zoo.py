"""Tiny TRL fixtures built locally (no downloads): a word-level tokenizer, a 1-layer GPT-2, text datasets.

The tokenizer maps the words ``w0 … w{V-3}`` (and ``<eos>``, ``<unk>``) to ids; texts are random word
sequences, so SFT examples and DPO pairs have different lengths (padding is exercised).
"""

from __future__ import annotations

import random

import transformers as T
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers

V = 32  # vocabulary: <eos>=0, <unk>=1, w0 … w29
WORDS = [f"w{i}" for i in range(V - 2)]


def tokenizer() -> T.PreTrainedTokenizerFast:
    vocab = {"<eos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>")


def gpt2(seed: int = 0, double: bool = False) -> T.GPT2LMHeadModel:
    """A 1-layer GPT-2 (float64 with ``double``: parameter read-backs exact to ~1e-16)."""
    import torch

    torch.manual_seed(seed)
    cfg = T.GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        vocab_size=V,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = T.GPT2LMHeadModel(cfg)
    return model.double() if double else model


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def texts(n: int, seed: int = 0, users: int = 0) -> Dataset:
    """``n`` texts of 3–9 words (``{"text"}``; with ``users``: a ``user_id`` column, user u = rows ≡ u mod users)."""
    rng = random.Random(seed)
    rows = {"text": [_words(rng, 3, 9) for _ in range(n)]}
    if users:
        rows["user_id"] = [i % users for i in range(n)]
    return Dataset.from_dict(rows)


def pairs(n: int, seed: int = 0) -> Dataset:
    """``n`` preference pairs ``{"prompt", "chosen", "rejected"}`` of 2–4 / 1–4 / 1–4 words."""
    rng = random.Random(seed)
    return Dataset.from_dict(
        {
            "prompt": [_words(rng, 2, 4) for _ in range(n)],
            "chosen": [" " + _words(rng, 1, 4) for _ in range(n)],
            "rejected": [" " + _words(rng, 1, 4) for _ in range(n)],
        }
    )


def prompt_completion(n: int, seed: int = 0) -> Dataset:
    """``n`` examples ``{"prompt", "completion"}`` (2–4 and 1–5 words): TRL trains on the completion only."""
    rng = random.Random(seed)
    return Dataset.from_dict(
        {
            "prompt": [_words(rng, 2, 4) for _ in range(n)],
            "completion": [" " + _words(rng, 1, 5) for _ in range(n)],
        }
    )
