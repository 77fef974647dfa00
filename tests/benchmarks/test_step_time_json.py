"""benchmarks/step_time.py --json: the keys the performance table reads, with their arithmetic.

The script is loaded from its file and run in-process on the MLP at B = 8, without the memory children
and the vmap baseline. Its timer (``time_round_robin``) is replaced by one that runs every configuration
once (so each step factory really builds and steps) and then returns fixed, hand-chosen medians, so the
ratios are checked as arithmetic: Opacus ghost is the fastest in wall time and Opacus hooks the cheapest
in CPU time, so ``dp-sgd/opacus-best`` and ``cpu:dp-sgd/opacus-best`` compare with different modes.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from benchmark_module import load_benchmark

#: (wall median, cpu median) seconds per step; anything else gets (0.05, 0.05)
FIXED = {
    "non-private": (0.010, 0.010),
    "floor: non-private + noise": (0.012, 0.015),
    "dp-sgd": (0.020, 0.030),
    "dp-macadam": (0.025, 0.033),
    "opacus hooks": (0.050, 0.040),
    "opacus ghost": (0.040, 0.060),
    "opacus functorch": (0.080, 0.080),
}


@pytest.fixture
def st(monkeypatch):
    pytest.importorskip("opacus")
    module = load_benchmark("step_time")
    monkeypatch.setitem(module.SHAPES, "mlp", ((1, 28, 28), 8, 60_000, "mnist"))
    ran: list[str] = []

    def fixed_timer(steps, rounds, per_round, warmup, probes=None, sync=None):
        out = {}
        for name, step in steps.items():
            step()
            ran.append(name)
            wall, cpu = FIXED.get(name, (0.05, 0.05))
            out[name] = {"median": wall, "p10": wall, "n": 1, "cpu_median": cpu}
            if probes and name in probes:
                out[name].update(probe_median=0.001, probe_share=0.02)
        return out

    monkeypatch.setattr(module, "time_round_robin", fixed_timer)
    module.ran = ran
    return module


def run_json(st, capsys) -> dict:
    args = ["--models", "mlp", "--rounds", "1", "--per-round", "1", "--warmup", "0", "--no-memory", "--no-vmap"]
    st.main(args + ["--threads", str(torch.get_num_threads()), "--json"])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mlp"]


def test_json_carries_the_opacus_best_keys_in_wall_and_cpu_time(st, capsys):
    r = run_json(st, capsys)
    assert {"opacus hooks", "opacus ghost", "opacus functorch", "dp-sgd"} <= set(st.ran)
    assert r["dp-sgd/non-private"] == pytest.approx(2.0)
    assert r["cpu:dp-sgd/non-private"] == pytest.approx(3.0)
    assert r["floor/non-private"] == pytest.approx(1.2)
    assert r["dp-sgd/opacus"] == pytest.approx({"hooks": 0.4, "ghost": 0.5, "functorch": 0.25})
    assert r["opacus_best_mode"] == "ghost" and r["dp-sgd/opacus-best"] == pytest.approx(0.020 / 0.040)
    assert r["opacus_best_cpu_mode"] == "hooks" and r["cpu:dp-sgd/opacus-best"] == pytest.approx(0.030 / 0.040)


def test_opacus_warnings_are_silenced_and_no_other(st, capsys, monkeypatch):
    """The full-backward-hook and secure-RNG UserWarnings of the Opacus runs are not shown; a different
    UserWarning raised while the configurations run still is (the filter is by message, not blanket)."""
    timer = st.time_round_robin

    def timer_and_another_warning(*args, **kw):
        warnings.warn("a different UserWarning of a step", UserWarning, stacklevel=1)
        return timer(*args, **kw)

    monkeypatch.setattr(st, "time_round_robin", timer_and_another_warning)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_json(st, capsys)
    messages = [str(w.message) for w in seen]
    assert "a different UserWarning of a step" in messages
    assert not [m for m in messages if m.startswith(("Full backward hook is firing", "Secure RNG turned off"))]
    assert "opacus ghost" in st.ran and "opacus hooks" in st.ran  # the modes that warn did run


def test_opacus_quiet_is_exact():
    """Only the listed category and message prefix are ignored, and the filters are restored afterwards."""
    st = load_benchmark("step_time")
    hook = "Full backward hook is firing when gradients are computed with respect to module outputs since ..."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with st.opacus_quiet():
            warnings.warn(hook, UserWarning, stacklevel=1)
            warnings.warn(
                "Secure RNG turned off. This is perfectly fine for experimentation", UserWarning, stacklevel=1
            )
            warnings.warn(hook, RuntimeWarning, stacklevel=1)  # another category: shown
            warnings.warn("Note: " + hook, UserWarning, stacklevel=1)  # the prefix elsewhere: shown
        warnings.warn(hook, UserWarning, stacklevel=1)  # after the block: shown
    assert [(w.category, str(w.message)) for w in seen] == [
        (RuntimeWarning, hook),
        (UserWarning, "Note: " + hook),
        (UserWarning, hook),
    ]
