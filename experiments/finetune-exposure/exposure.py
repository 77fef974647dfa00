"""Canary exposure of a small private language model (Carlini et al. 2019, "The Secret Sharer"), at CPU scale.

Inserts canaries "my PIN is dddd" (random digits, each repeated a chosen
number of times) into a real public text corpus, trains the same tiny
GPT-2-shaped character LM on it without privacy (``transformers.Trainer``)
and with DP (``dpopt.hf.DPTrainer`` at each ε), and reports each canary's
exposure

    exposure = log2 |R| - log2 rank,   R = the 10^4 PINs,

where rank is the canary's position (1 = most likely) among all candidates
ranked by the model's log-likelihood of "dddd" after "my PIN is " (the same
prefix for every candidate: the order equals the perplexity order of the
whole sequence). Exposure log2 10^4 ≈ 13.3 means the model ranks the true
PIN first; a model that learnt nothing about it gives ~1 bit on average.

Corpus: the text of Python's own help topics (``pydoc_data.topics``, shipped
with every CPython; Python Software Foundation License), cut into records of
``--record`` characters; the alphabet is printable ASCII (fixed in advance,
not fitted on the corpus: tokenizer statistics would be a look at the data).
Privacy unit: one record. A canary repeated k times is k records: DP
protects it only at group level (about k·ε). Exposure is an ATTACK
measurement on these canaries, not a bound on ε.

Run (from the repository root; ~15 CPU-minutes at the defaults)::

    nice -n 19 python experiments/finetune-exposure/exposure.py --out experiments/finetune-exposure/exposure-results

writes ``exposure.json`` (per setting: ε, seconds, held-out bits per
character on 500 later corpus records — utility, so that a low exposure is
not just a model that learnt nothing; per canary: repetitions, rank,
exposure) and ``exposure.png``. ``--quick`` is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import string
import time
import warnings
from pathlib import Path

import torch

ALPHABET = string.printable[:95]  # digits, letters, punctuation, space: public, fixed
PAD, BOS = 0, 1
VOCAB = 2 + len(ALPHABET)
PREFIX = "my PIN is "


def encode(text: str) -> list[int]:
    """Characters → ids (unknown characters become spaces)."""
    return [2 + ALPHABET.index(c if c in ALPHABET else " ") for c in text]


def corpus_records(n: int, length: int, skip: int = 0) -> list[str]:
    """Records ``skip .. skip + n`` of ``length`` characters of pydoc_data's help topics (whitespace squeezed)."""
    import pydoc_data.topics as topics

    text = " ".join(" ".join(v.split()) for _, v in sorted(topics.topics.items()))
    records = [text[i : i + length] for i in range(0, len(text) - length, length)]
    if len(records) < skip + n:
        raise ValueError(f"the corpus has {len(records)} records of {length} characters, fewer than {skip + n}")
    return records[skip : skip + n]


class Records(torch.utils.data.Dataset):
    """Each record → BOS + characters, padded to ``length + 1`` (labels −100 on padding)."""

    def __init__(self, texts: list[str], length: int):
        self.ids = torch.full((len(texts), length + 1), PAD, dtype=torch.long)
        self.mask = torch.zeros_like(self.ids)
        for i, t in enumerate(texts):
            row = [BOS] + encode(t)[:length]
            self.ids[i, : len(row)] = torch.tensor(row)
            self.mask[i, : len(row)] = 1

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


def make_model(length: int, seed: int):
    import transformers as T

    torch.manual_seed(seed)
    cfg = T.GPT2Config(
        vocab_size=VOCAB,
        n_positions=length + 1,
        n_embd=96,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=BOS,
        eos_token_id=BOS,
        pad_token_id=PAD,
    )
    return T.GPT2LMHeadModel(cfg)


@torch.no_grad()
def ranks(model, pins: list[str]) -> list[int]:
    """Rank (1 = most likely) of each PIN among all 10^4 under the model's log-likelihood of the digits."""
    model.eval()
    cands = [f"{i:04d}" for i in range(10_000)]
    prefix = [BOS] + encode(PREFIX)
    ids = torch.tensor([prefix + encode(c) for c in cands])
    scores = torch.empty(len(cands))
    for lo in range(0, len(cands), 2000):
        x = ids[lo : lo + 2000]
        logp = torch.log_softmax(model(input_ids=x).logits.float(), -1)
        tok = logp[:, len(prefix) - 1 : -1].gather(-1, x[:, len(prefix) :, None]).squeeze(-1)
        scores[lo : lo + 2000] = tok.sum(1)
    out = []
    for pin in pins:
        s = scores[int(pin)]
        out.append(1 + int((scores > s).sum()))
    return out


@torch.no_grad()
def bits_per_char(model, data: "Records") -> float:
    """Held-out cross-entropy in bits per predicted character (utility: a model that learnt nothing has ~6.6)."""
    model.eval()
    total, count = 0.0, 0
    for lo in range(0, len(data), 500):
        ids, mask = data.ids[lo : lo + 500], data.mask[lo : lo + 500]
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
        tok = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        valid = mask[:, 1:].bool()
        total += float(-tok[valid].sum())
        count += int(valid.sum())
    return total / count / math.log(2)


def exposure(rank: int) -> float:
    return math.log2(10_000) - math.log2(rank)


def train_one(setting, data, args, out: Path):
    """Train the model for one setting (None: non-private); return (model, epsilon or None, seconds)."""
    import transformers as T

    from dpopt.hf import DPTrainer

    model = make_model(args.length, args.seed)
    targs = T.TrainingArguments(
        str(out / f"run-{setting or 'nonprivate'}"),
        per_device_train_batch_size=args.batch,
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=10**9,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=args.seed,
    )
    start = time.time()
    if setting is None:
        trainer = T.Trainer(model=model, args=targs, train_dataset=data)
        trainer.train()
        return model, None, time.time() - start
    trainer = DPTrainer(
        model=model,
        args=targs,
        train_dataset=data,
        target_epsilon=float(setting),
        delta=args.delta,
        max_grad_norm=args.clip,
    )
    trainer.train()
    return model, trainer.get_epsilon(), time.time() - start


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    names = list(results["runs"])
    reps = sorted({c["repetitions"] for c in results["canaries"]})
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        run = results["runs"][name]
        by_rep = {r: [c["exposure"] for c in run["canaries"] if c["repetitions"] == r] for r in reps}
        xs = [i + j * width for i in range(len(reps))]
        ax.bar(xs, [sum(v) / len(v) for v in by_rep.values()], width, label=name)
        for x, v in zip(xs, by_rep.values()):
            ax.plot([x] * len(v), v, "k.", ms=3)
    ax.axhline(math.log2(10_000), color="grey", ls=":", lw=1)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(reps))], [f"{r}x" for r in reps])
    ax.set_xlabel("canary repetitions in the training data")
    ax.set_ylabel("exposure (bits; max 13.3)")
    ax.set_title("Canary exposure of a tiny char-level GPT-2 (attack, not a bound)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="experiments/finetune-exposure/exposure-results")
    p.add_argument("--records", type=int, default=2000)
    p.add_argument("--record", type=int, default=24, help="characters per record")
    p.add_argument("--repetitions", default="1,4,16", help="repetitions of each canary group")
    p.add_argument("--per-group", type=int, default=3, help="canaries per repetition count")
    p.add_argument("--epsilons", default="1,8")
    p.add_argument("--epochs", type=float, default=10.0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 300 records, 1 epoch")
    args = p.parse_args()
    if args.quick:
        args.records, args.epochs, args.per_group = 300, 1.0, 1
    warnings.simplefilter("ignore", FutureWarning)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(args.seed + 1000)  # the canaries' digits: part of the experiment, public
    canaries = []
    for r in (int(x) for x in args.repetitions.split(",")):
        for _ in range(args.per_group):
            canaries.append({"pin": f"{int(torch.randint(0, 10_000, (1,), generator=g)):04d}", "repetitions": r})
    texts = corpus_records(args.records, args.record)
    texts += [PREFIX + c["pin"] for c in canaries for _ in range(c["repetitions"])]
    args.length = max(args.record, len(PREFIX) + 4)
    data = Records(texts, args.length)
    held_out = Records(corpus_records(500, args.record, skip=args.records), args.length)  # never trained on
    results = {
        "corpus": "pydoc_data.topics (CPython help topics; PSF License)",
        "records": len(texts),
        "record_chars": args.record,
        "canaries": canaries,
        "delta": args.delta,
        "args": vars(args),
        "runs": {},
    }
    for setting in [None] + [float(e) for e in args.epsilons.split(",")]:
        model, eps, secs = train_one(setting, data, args, out)
        if setting is not None:
            # evaluate a hook-free copy of the trained weights: the DP-trained model still carries the per-sample
            # engine's hooks, and ranking 10^4 candidates through it was OOM-killed at ~14 GB on a 24 GB machine
            fresh = make_model(args.length, args.seed)
            fresh.load_state_dict(model.state_dict())
            model = fresh
        rk = ranks(model, [c["pin"] for c in canaries])
        bpc = bits_per_char(model, held_out)
        name = "non-private" if setting is None else f"DP eps={setting:g}"
        results["runs"][name] = {
            "epsilon": eps,
            "seconds": round(secs, 1),
            "held_out_bits_per_char": bpc,
            "canaries": [dict(c, rank=r, exposure=exposure(r)) for c, r in zip(canaries, rk)],
        }
        print(
            name,
            "eps",
            eps,
            "seconds",
            round(secs, 1),
            "held-out bits/char",
            round(bpc, 3),
            "exposures",
            [round(exposure(r), 2) for r in rk],
            flush=True,
        )
        (out / "exposure.json").write_text(json.dumps(results, indent=1))  # after each setting: a killed run
        plot(results, out / "exposure.png")  # keeps what it finished


if __name__ == "__main__":
    main()
