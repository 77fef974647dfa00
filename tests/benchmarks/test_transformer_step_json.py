"""benchmarks/transformer_step.py --json carries the entries and keys issue 34's "Done when" names.

Each of ``gpt2-untied``, ``bert`` and ``gpt2-lora`` must carry ``dp-sgd/non-private``,
``privacy-engine/non-private``, ``dp-sgd/opacus-best``, ``peak_mem_dp/non-private`` and
``peak_mem_pe/non-private``. The script is loaded from its file and run in-process at a tiny size
(vocab 61, d 16, T 8, 2 blocks, B 4: the module's size constants patched), one timed step per
configuration; the memory children (fresh subprocesses, which the patch would not reach) are replaced
by fixed figures, so the peak-memory ratios are checked as arithmetic: 110/100 and 125/100.
"""

from __future__ import annotations

import json

import pytest
import torch
from benchmark_module import load_benchmark

KEYS = (
    "dp-sgd/non-private",
    "privacy-engine/non-private",
    "dp-sgd/opacus-best",
    "peak_mem_dp/non-private",
    "peak_mem_pe/non-private",
)
MIB = {"non-private": 100.0, "dp-sgd": 110.0, "dp-sgd (PrivacyEngine)": 125.0}


@pytest.fixture
def tiny(monkeypatch):
    pytest.importorskip("opacus")
    ts = load_benchmark("transformer_step")
    for key, value in {"V": 61, "D": 16, "T": 8, "HEADS": 2, "LAYERS": 2, "B": 4}.items():
        monkeypatch.setattr(ts, key, value)
    monkeypatch.setattr(ts, "run_memory", lambda model, config, threads: MIB.get(config, 130.0))
    return ts


@pytest.mark.slow  # 15 configurations, each with its first step (dpopt's first-batch check, Opacus's set-up)
def test_json_carries_the_issue_34_keys(tiny, capsys):
    threads = torch.get_num_threads()
    args = ["--models", "gpt2-untied,bert,gpt2-lora", "--rounds", "1", "--per-round", "1", "--warmup", "0"]
    tiny.main(args + ["--threads", str(threads), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == {"gpt2-untied", "bert", "gpt2-lora"}
    for model, r in out.items():
        missing = [k for k in KEYS if k not in r]
        assert not missing, (model, missing)
        assert all(r[k] > 0 and r["cpu:" + k] > 0 for k in KEYS[:3])
        assert r["peak_mem_dp/non-private"] == pytest.approx(1.1)
        assert r["peak_mem_pe/non-private"] == pytest.approx(1.25)
        opacus = {k: v for k, v in r["peak_mem_mib"].items() if "opacus" in k}
        assert len(opacus) == 2 and set(opacus.values()) == {130.0}  # printed for every configuration
    for model in ("gpt2-untied", "bert"):  # the hook door ran on Opacus's model: compared with it as well
        assert out[model]["privacy-engine/opacus-best"] > 0
    assert out["gpt2-lora"]["opacus_best_mode"].startswith("untied")  # tied LoRA: Opacus on the untied twin
    assert "privacy-engine/opacus-best" not in out["gpt2-lora"]  # no untied PrivacyEngine row to compare


def test_memory_figures_are_medians_of_interleaved_children(monkeypatch):
    """--memory-runs N: N children per configuration, run k of each before run k + 1 of any; the figure is
    their median (one child 32 MiB high does not move it), the range is recorded; failed children are skipped."""
    ts = load_benchmark("transformer_step")
    peaks = {"non-private": iter([100.0, 104.0, 96.0]), "dp-sgd": iter([110.0, 142.0, 108.0]), "x": iter([None] * 3)}
    order = []

    def child(model, config, threads):
        order.append(config)
        return next(peaks[config])

    monkeypatch.setattr(ts, "run_memory", child)
    configs = {"non-private": ("m", "non-private"), "dp-sgd": ("m", "dp-sgd"), "broken": ("m", "x")}
    mem, spread = ts.memory_medians(configs, 1, 3)
    assert order == ["non-private", "dp-sgd", "x"] * 3
    assert mem == {"non-private": 100.0, "dp-sgd": 110.0, "broken": None}
    assert spread == {"non-private": [96.0, 104.0], "dp-sgd": [108.0, 142.0]}
