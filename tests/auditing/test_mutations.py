"""The privacy-mutation suite's CI part: each mutant's seam really changes behaviour, and the switch reaches subprocesses.

The kill table (which CI tests catch each mutant) is built by
``python tests/auditing/mutants.py`` (minutes per mutant: a script, not a
test); docs/auditing.md holds the table. These tests make sure the table
is about live mutants: a mutant whose patch no longer reaches the code (a
renamed seam) would "survive" nothing and be killed by nothing.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _load():
    if "dpopt_mutants" in sys.modules:
        return sys.modules["dpopt_mutants"]
    spec = importlib.util.spec_from_file_location("dpopt_mutants", HERE / "mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["dpopt_mutants"] = mod
    spec.loader.exec_module(mod)
    return mod


M = _load()

#: The issue's list (issue 25), one mutant each.
REQUIRED = {
    "clip_skipped",
    "noise_half",
    "noise_per_rank_unscaled",
    "poisson_shuffled",
    "ledger_missing_step",
    "microbatch_several_steps",
    "noise_div_bbar_twice",
    "batchnorm_kept",
    "noise_bf16",
    "nonfinite_clipped_large",
    "quantile_count_uncharged",
    "private_loss_printed",
    "train_mode_only_mixing",
    "tail_cut_gaussian",
    "ledger_dropped_from_checkpoint",
}


def test_every_required_mutant_exists():
    assert REQUIRED <= set(M.MUTANTS)


@pytest.mark.parametrize("name", sorted(M.MUTANTS))
def test_mutant_seam_changes_behaviour_and_undoes(name):
    before = M.probe(name)
    undo = M.activate(name)
    try:
        during = M.probe(name)
    finally:
        undo()
    assert during != before, f"{name}: the patch does not reach its seam ({M.MUTANTS[name].seam})"
    assert M.probe(name) == before  # removed again: no mutant leaks into later tests


@pytest.mark.slow  # a fresh interpreter importing torch and dpopt in sitecustomize: ~5-15 s on 2 busy cores
def test_the_environment_variable_reaches_a_subprocess():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('m', {str(HERE / 'mutants.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['m'] = m; spec.loader.exec_module(m)\n"
        "print(m.probe('noise_half'))\n"
    )
    env = dict(
        os.environ,
        DPOPT_MUTANT="noise_half",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(HERE / "mutant_site")] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(0.5, 0)"  # sigma S z halved in the child, applied by sitecustomize
    with pytest.raises(KeyError, match="unknown mutant"):
        M.activate("no_such_bug")
