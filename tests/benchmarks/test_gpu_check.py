"""benchmarks/gpu_check.py: the CPU fallback runs (GPU parts skipped), its equality checks can fail, and the
GPU-only parts (step ratios, memory, the transformer timings, the FSDP smoke run) run on the CPU at a tiny size
(CUDA memory statistics stubbed; the FSDP smoke run on a world-size-1 gloo group) and can fail.

The script is loaded from its file by ``importlib`` (benchmarks/ is not a package; no ``sys.path``
change) and run in-process on the CPU at its tiny fallback size (a few seconds).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from benchmark_module import load_benchmark

from dpopt.engine.fast import FastPerSampleGrads


@pytest.fixture(scope="module")
def gpu_check():
    return load_benchmark("gpu_check")


def run_cpu(gpu_check, capsys) -> tuple[int, dict, str]:
    rc = gpu_check.main(["--device", "cpu", "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out.strip().splitlines()[-1]), out


@pytest.mark.slow  # ~20 s on a loaded machine: every CPU part, the tiny HF models included
def test_cpu_fallback_passes_and_skips_the_gpu_parts(gpu_check, capsys):
    rng = torch.get_rng_state()
    rc, report, out = run_cpu(gpu_check, capsys)
    assert rc == 0 and report["passed"] is True
    assert report["device"] == "cpu"
    cases = report["equality"]["cases"]
    assert {(c["model"], c["dtype"]) for c in cases} >= {("mlp", "float64"), ("cnn5", "float64"), ("cnn5", "float32")}
    for c in cases:
        assert c["ok"] and c["enforced"] and not c["beyond"]
        for geo, errors in c["errors"].items():
            for kind, value in errors.items():
                assert value <= c["tolerance"][geo][kind]
        if c["dtype"] == "float64":
            assert max(t for geo in c["tolerance"].values() for t in geo.values()) == 1e-9
        else:  # under-estimated norms (the privacy-relevant direction) are held to 1e-4 in float32
            assert c["tolerance"]["flat"]["norms_under"] == c["tolerance"]["shift-scale"]["norms_under"] == 1e-4
    assert report["skipped"] == ["timings (cnn5, wrn16-4)", "cuda memory", "transformer timings", "fsdp (nccl)"]
    assert not {"timings", "memory", "transformer_timings", "fsdp"} & set(report)
    assert out.count("SKIPPED") == 4
    hf = report["transformers"]  # part 4 runs on the CPU too (tiny HF GPT-2 and BERT, float64)
    assert hf["passed"] is True
    if importlib.util.find_spec("transformers") is not None:
        assert {(c["model"], c["dtype"]) for c in hf["cases"]} == {("gpt2", "float64"), ("bert", "float64")}
        for c in hf["cases"]:
            assert c["ok"] and c["tolerance"] == 1e-9 and max(c["errors"].values()) <= 1e-9
    assert torch.equal(torch.get_rng_state(), rng)  # the check leaves the caller's RNG alone


@pytest.mark.parametrize("method", ["sq_norms", "weighted_sum"])
def test_equality_check_fails_when_the_fast_engine_is_perturbed(gpu_check, capsys, monkeypatch, method):
    """A relative 1e-6 error in the fast engine's norms (or clipped sums alone) must fail the float64 cases."""
    original = getattr(FastPerSampleGrads, method)

    def perturbed(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        return out * (1 + 1e-6) if method == "sq_norms" else [t * (1 + 1e-6) for t in out]

    monkeypatch.setattr(FastPerSampleGrads, method, perturbed)
    rc, report, out = run_cpu(gpu_check, capsys)
    assert rc == 1 and report["passed"] is False and "FAILED" in out
    by_case = {(c["model"], c["dtype"]): c for c in report["equality"]["cases"]}
    for key in (("mlp", "float64"), ("cnn5", "float64")):
        case = by_case[key]
        assert not case["ok"]
        kind = "norms_over" if method == "sq_norms" else "clipped_sums"
        assert case["errors"]["flat"][kind] == pytest.approx(1e-6, rel=1e-3)
    assert by_case[("cnn5", "float32")]["ok"]  # 1e-6 is inside float32's stated tolerances
    if importlib.util.find_spec("transformers") is not None:  # the HF cases (float64) see it too
        assert report["transformers"]["passed"] is False and "transformers" in report["failed_parts"]


def test_an_underestimated_float32_norm_fails(gpu_check, monkeypatch):
    """Float32 norms read 1e-3 too small (the direction that lets a clipped example exceed C) fail,
    although a 1e-3 over-estimate (a conservative bound) would be allowed in the shift/scale geometry."""
    original = FastPerSampleGrads.sq_norms
    monkeypatch.setattr(FastPerSampleGrads, "sq_norms", lambda self, *a, **k: original(self, *a, **k) * (1 - 1e-3))
    result = gpu_check.run_equality(torch.device("cpu"), [("cnn5", "float32", 3, True)])
    assert result["passed"] is False
    (case,) = result["cases"]
    assert not case["ok"]
    assert any(b.startswith("shift-scale norms_under") for b in case["beyond"])


def test_step_time_sync_brackets_every_timed_step(gpu_check):
    """step_time.time_round_robin calls ``sync`` before starting and before stopping each step's clock."""
    st = gpu_check.step_time_module()  # the script's own loader of benchmarks/step_time.py
    calls = []
    res = st.time_round_robin(
        {"a": lambda: calls.append("step")}, rounds=2, per_round=1, warmup=1, sync=lambda: calls.append("sync")
    )
    assert calls == ["step"] + ["sync", "step", "sync"] * 2
    assert res["a"]["n"] == 2
    assert st.synchronizer("cpu") is None
    assert st.resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert st.resolve_device("auto") == torch.device("cpu")
        with pytest.raises(SystemExit):
            st.resolve_device("cuda")


def test_gpu_parts_bookkeeping_runs_on_the_cpu_with_stubbed_cuda_calls(gpu_check, monkeypatch, capsys):
    """Parts 2 and 3 only run on a GPU; this runs their code at a tiny size on the CPU (CUDA memory
    statistics stubbed) so that a slip in them is caught before a GPU session is spent on it."""
    timings = gpu_check.run_timings(
        torch.device("cpu"), models=("mlp",), rounds=1, per_round=1, warmup=1, batch_sizes={"mlp": 8}
    )
    assert set(timings) == {"mlp"} and timings["mlp"]["batch"] == 8
    assert set(timings["mlp"]["ms"]) == {"non-private", "dp-sgd", "dp-macadam"}
    assert timings["mlp"]["dp-sgd/non-private"] > 0 and timings["mlp"]["dp-macadam/dp-sgd"] > 0

    allocated = iter(range(1, 1000))
    for name, fake in {
        "synchronize": lambda *a: None,
        "reset_peak_memory_stats": lambda *a: None,
        "empty_cache": lambda: None,
        "memory_allocated": lambda *a: 2**20,
        "max_memory_allocated": lambda *a: 2**20 * (1 + next(allocated)),
    }.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(gpu_check, "MEMORY", {"model": "mlp", "logical": 8, "physical": 4})
    memory = gpu_check.run_memory(torch.device("cpu"))
    assert set(memory["mib"]) == {"dp-sgd 8 in chunks of 4", "dp-sgd 4", "non-private 4"}
    assert memory["peak_4096_over_256"] == pytest.approx(2 / 3)  # stub peaks: 2, 3, 4 MiB in that order
    assert memory["step_4096_over_256"] == pytest.approx(1 / 2)
    assert "peak" in capsys.readouterr().out


@pytest.fixture
def tiny_transformer(gpu_check, monkeypatch):
    """benchmarks/transformer_step.py's GPT-2-shaped model at a tiny size (vocab 61, d 16, T 8, 2 blocks)."""
    ts = gpu_check.transformer_module()
    for name, value in {"V": 61, "D": 16, "T": 8, "HEADS": 2, "LAYERS": 2}.items():
        monkeypatch.setattr(ts, name, value)
    return ts


@pytest.mark.slow  # ~14 s on a loaded machine (the first step of each door verifies the engine)
def test_transformer_timings_bookkeeping_on_the_cpu(gpu_check, tiny_transformer, monkeypatch):
    """Part 5 (GPU only in main) at a tiny size on the CPU, CUDA memory statistics stubbed."""
    for name, fake in {
        "synchronize": lambda *a: None,
        "reset_peak_memory_stats": lambda *a: None,
        "empty_cache": lambda: None,
        "memory_allocated": lambda *a: 2**20,
        "max_memory_allocated": lambda *a: 3 * 2**20,
    }.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    out = gpu_check.run_transformer_timings(torch.device("cpu"), batch=4, rounds=1, per_round=1, warmup=1)
    assert set(out) == {"gpt2 full", "gpt2 lora"}
    for r in out.values():
        assert r["batch"] == 4 and set(r["ms"]) == {"non-private", "dp-sgd"} and r["dp-sgd/non-private"] > 0
        assert r["peak_mib"] == {"non-private": 3.0, "dp-sgd": 3.0} and r["peak_dp/non-private"] == 1.0


def test_fsdp_smoke_dry_run_on_the_cpu_and_it_can_fail(gpu_check, tiny_transformer, monkeypatch):
    """Part 6 with gloo on a world-size-1 group: FSDP equals the plain run (σ = 0), a σ = 1 step completes;
    a release scaled by 1.01 (a wrong reduction) fails it."""
    import torch.distributed as dist

    from dpopt import fsdp

    assert not dist.is_initialized()
    out = gpu_check.run_fsdp_smoke(torch.device("cpu"))
    assert out["passed"] and out["equal"] and out["trained"] and out["backend"] == "gloo"
    assert out["ledger_steps"] == 2 and out["noisy_step_ledger"] == 1
    assert not dist.is_initialized()  # its own group, destroyed

    original = fsdp.ShardedRelease.__call__

    def scaled(self, *a, **k):
        totals, count = original(self, *a, **k)
        return [t * 1.01 for t in totals], count

    monkeypatch.setattr(fsdp.ShardedRelease, "__call__", scaled)
    bad = gpu_check.run_fsdp_smoke(torch.device("cpu"))
    assert not bad["passed"] and not bad["equal"] and bad["worst_over_tolerance"] > 1
    assert not dist.is_initialized()
