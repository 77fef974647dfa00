"""The accounting package's layout: leaf accountants behind a registry, one DpEvent walker, no cycles.

* ``ACCOUNTANTS`` is derived from the registry; ``epsilon_report`` dispatches through it and
  gives exactly the leaf's report.
* Inside ``dpopt.accounting`` no module imports another in a cycle or imports a sibling's
  private (``_x``) name.
* The ledger check lives at ``dpopt.accounting.ledger_check``; ``dpopt.check`` is gone.
* ``collapse_for_pld`` and ``summarize_event`` read Poisson-sampled compositions the same way.
"""

import ast
import importlib
import math
from pathlib import Path

import pytest
from dp_accounting import dp_event

import dpopt.accounting as accounting
from dpopt.accounting import accountant, registry
from dpopt.accounting.events import (
    collapse_for_pld,
    dpsgd_event,
    effective_noise_multiplier,
    poisson_composed_step,
    sampled_gaussians,
    summarize_event,
)
from dpopt.accounting.pld import pld_epsilon_report
from dpopt.accounting.prv import prv_available, prv_epsilon_report
from dpopt.accounting.rdp import rdp_epsilon_report
from dpopt.accounting.validation import check_rtol, check_target_epsilon

DELTA = 1e-5
PACKAGE = Path(accounting.__file__).parent


def test_accountants_are_the_registry():
    assert registry.ACCOUNTANTS == tuple(registry.REGISTRY) == ("pld", "rdp", "prv")
    assert accountant.ACCOUNTANTS is registry.ACCOUNTANTS is accounting.ACCOUNTANTS
    assert registry.get_accountant("PLD").report is pld_epsilon_report
    assert registry.get_accountant("rdp").report is rdp_epsilon_report
    assert registry.get_accountant("prv").report is prv_epsilon_report
    assert registry.get_accountant("prv").requires == "prv-accountant"
    assert registry.get_accountant("prv").available() == prv_available()
    with pytest.raises(ValueError, match="choose one of pld, rdp, prv"):
        registry.get_accountant("gdp")
    with pytest.raises(TypeError):
        registry.REGISTRY["gdp"] = registry.REGISTRY["pld"]  # read-only


@pytest.mark.parametrize("name", ["pld", "rdp", "prv"])
def test_entry_dispatches_to_the_leaf(name):
    spec = registry.get_accountant(name)
    if not spec.available():
        pytest.skip(f"{spec.requires} not installed")
    event = dpsgd_event(1.0, 0.01, 100)
    report = accountant.epsilon_report(event, DELTA, name)
    assert report == spec(event, DELTA, budget=accountant.DEFAULT_BUDGET)
    assert report.accountant == name and 0 < report.epsilon < math.inf
    assert accountant.epsilon(event, DELTA, name) == report.epsilon


def _relative_imports(path: Path):
    """(module, imported name) for every ``from .x import y`` anywhere in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            yield node.module.split(".")[0], [a.name for a in node.names]


def test_no_import_cycle_and_no_private_sibling_imports():
    graph, private = {}, []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.stem == "__init__":
            continue
        graph[path.stem] = set()
        for module, names in _relative_imports(path):
            if module != "__init__":
                graph[path.stem].add(module)
            private += [f"{path.stem} imports {module}.{n}" for n in names if n.startswith("_")]
    assert not private
    done, stack = set(), []

    def visit(node):
        assert node not in stack, f"import cycle: {' -> '.join(stack[stack.index(node) :] + [node])}"
        if node in done:
            return
        stack.append(node)
        for dep in graph.get(node, ()):
            visit(dep)
        stack.pop()
        done.add(node)

    for node in graph:
        visit(node)
    # the leaves know nothing of the registry, the entry or each other
    for leaf in ("pld", "rdp", "prv", "validation", "cost", "capture"):
        assert not graph[leaf] & {"registry", "accountant", "calibration", "pld", "rdp", "prv"}, leaf


def test_ledger_check_lives_in_accounting():
    from dpopt.accounting.ledger_check import check_ledger, check_run, load_run  # noqa: F401

    assert accounting.check_ledger is check_ledger and accounting.check_run is check_run
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dpopt.check")


def test_collapse_for_pld_reads_sampled_events_like_the_walker():
    step = poisson_composed_step([1.2, 4.0], 0.01)
    collapsed = collapse_for_pld(dp_event.SelfComposedDpEvent(step, 3))
    sigma_eff = effective_noise_multiplier([1.2, 4.0])
    assert collapsed == dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(sigma_eff)), 3
    )
    assert sampled_gaussians(step) == summarize_event(step).gaussians == [1.2, 4.0]
    three = dp_event.SelfComposedDpEvent(step, 3)
    assert summarize_event(collapsed).terms == summarize_event(three).terms == {(0.01, sigma_eff): 3}
    # not only Gaussians inside: left as it is, and the walker says why
    odd = dp_event.PoissonSampledDpEvent(
        0.01, dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(1.0), dp_event.LaplaceDpEvent(1.0)])
    )
    assert sampled_gaussians(odd) is None and collapse_for_pld(odd) is odd
    assert summarize_event(odd).unsupported == ["PoissonSampledDpEvent(ComposedDpEvent)"]
    bad = dp_event.PoissonSampledDpEvent(
        0.01, dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(-1.0), dp_event.GaussianDpEvent(1.0)])
    )
    with pytest.raises(ValueError, match="noise_multiplier"):
        collapse_for_pld(bad)
    assert summarize_event(bad).unsupported == ["PoissonSampledDpEvent with an invalid noise multiplier"]


def test_shared_validators():
    assert check_target_epsilon(2) == 2.0 and check_rtol(1e-3) == 1e-3
    for bad in (0, -1, math.inf, math.nan, "x"):
        with pytest.raises(ValueError, match="target_epsilon"):
            check_target_epsilon(bad)
    for bad in (0, 0.2, -1e-3):
        with pytest.raises(ValueError, match=r"rtol must be in \(0, 0.1\]"):
            check_rtol(bad)
