"""The architecture table of docs/finetuning.md, generated from the test zoos.

Every case the CI's exactness tests build (``hf_zoo.CASES``: one private step
per door against single-example autograd; ``hf_rows_zoo.CASES``: rows that
are not examples, ``tests/hf/test_hf_rows.py``; Gemma-2 in float64 with left
padding, ``tests/hf/test_hf_float64.py``; gradient checkpointing,
``tests/hf/test_hf_checkpointing.py``) is one row; ``test_architecture_table``
fails when the docs' table and this one differ, or when a case has no row here.
Regenerate with ``python tests/hf/architecture_table.py --write``.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "finetuning.md"
BEGIN, END = "<!-- architectures:begin -->", "<!-- architectures:end -->"

#: case name -> (architecture, what the rows' capture is, test file). The keys must equal the zoos' cases.
ROWS = {
    "gpt2": ("GPT-2 (HF `Conv1D`, tied embedding + head)", "fast rules", "test_hf_per_example.py"),
    "lora-gpt2": ("GPT-2 + LoRA (peft)", "fast rules", "test_hf_per_example.py"),
    "llama": ("Llama (RMSNorm, rotary, GQA)", "fast rules", "test_hf_per_example.py"),
    "bert": ("BERT (token types, pooler)", "fast rules", "test_hf_per_example.py"),
    "vit": ("ViT (class token, patch conv)", "fast rules", "test_hf_per_example.py"),
    "gemma2": ("Gemma-2, float64, left padding", "fast rules", "test_hf_float64.py"),
    "opt": ("OPT (tokens flattened to [B·T, H])", "enclosing decoder layer", "test_hf_rows.py"),
    "mixtral": ("Mixtral (router, routed experts)", "enclosing sparse MoE block", "test_hf_rows.py"),
    "qwen2-moe": ("Qwen2-MoE (shared expert)", "enclosing sparse MoE block", "test_hf_rows.py"),
    "qwen3-moe": ("Qwen3-MoE", "enclosing sparse MoE block", "test_hf_rows.py"),
    "t5": ("T5 (relative attention bias)", "enclosing stack", "test_hf_rows.py"),
    "bart": ("BART (decoder learned positions)", "enclosing stack", "test_hf_rows.py"),
    "mbart": ("mBART", "enclosing stack", "test_hf_rows.py"),
    "deberta-v2": ("DeBERTa-v2 (`pos_key_proj`)", "enclosing attention", "test_hf_rows.py"),
    "mpnet": ("MPNet (relative attention bias)", "enclosing stack", "test_hf_rows.py"),
    "swin": ("Swin (windows)", "enclosing Swin block", "test_hf_rows.py"),
    "beit": ("BEiT (relative position bias)", "enclosing BEiT layer", "test_hf_rows.py"),
    "wav2vec2": ("wav2vec2 (weight-norm parametrization)", "enclosing `pos_conv_embed.conv`", "test_hf_rows.py"),
    "checkpointing-gpt2": (
        "GPT-2, gradient checkpointing (both `use_reentrant`)",
        "fast rules",
        "test_hf_checkpointing.py",
    ),
    "checkpointing-llama": (
        "Llama, gradient checkpointing (both `use_reentrant`)",
        "fast rules",
        "test_hf_checkpointing.py",
    ),
}

EXTRA = ("gemma2", "checkpointing-gpt2", "checkpointing-llama")  # cases outside the two zoos' CASES


def case_names() -> set:
    """The names of every case the zoos define (imports the zoos: tests/hf on sys.path)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import hf_rows_zoo
    import hf_zoo

    return set(hf_zoo.CASES) | set(hf_rows_zoo.CASES) | set(EXTRA)


def table() -> str:
    """The markdown table (header + one row per case, in ROWS' order)."""
    lines = [
        "| architecture (tiny config) | parameters captured by | exact in |",
        "|---|---|---|",
    ]
    lines += [f"| {arch} | {how} | `tests/hf/{where}` |" for arch, how, where in ROWS.values()]
    return "\n".join(lines)


def documented() -> str:
    """The table between the markers in docs/finetuning.md."""
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def write() -> None:
    """Replace the docs' table with :func:`table`."""
    text = DOC.read_text()
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:a] + "\n" + table() + "\n" + text[b:])


if __name__ == "__main__":
    if "--write" in sys.argv:
        write()
    print(table())
