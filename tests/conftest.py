"""Shared test fixtures, the test tiers (markers by path) and one torch thread per xdist worker.

Tiers (markers declared in pyproject.toml; README "Two commands" shows the commands):

* ``distributed`` — several gloo processes (every test under ``tests/distributed/``);
* ``hf`` — needs Hugging Face ``transformers`` (every test under ``tests/hf/``, ``tests/hf_trl/`` or in a
  ``test_hf*.py`` file);
* ``slow`` — longer than ~10 s on one core: marked in the test file with
  ``@pytest.mark.slow``, or listed here in :data:`SLOW` by node-id prefix (so a test
  file owned by someone else need not be edited to move it to the slow tier).

The markers are applied at collection (:func:`pytest_collection_modifyitems`), so a
new test file placed in one of these folders lands in its tier without editing it.

The README's test command is ``python -m pytest -q -n 2 --dist loadgroup``: two
xdist workers, the ``distributed`` tier on one of them at a time (:data:`SERIAL_TIERS`).
Under pytest-xdist each worker process runs torch with ONE thread
(``OMP_NUM_THREADS=1`` before torch loads, for the worker and the subprocesses it
starts, and ``torch.set_num_threads(1)``): two workers on two cores, not four
threads fighting for two.
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # before torch is imported (OpenMP reads it once)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

#: Tier by folder or file (a path relative to tests/, as a prefix of the test's path).
TIER_BY_PATH = {
    "distributed/": "distributed",
    "hf/": "hf",
    "hf_trl/": "hf",  # TRL's trainers (extra dpopt[trl]) need transformers too
    "test_hf": "hf",  # tests/**/test_hf*.py
}

#: Node-id prefixes (relative to tests/) of tests slower than ~10 s that are not marked in their file
#: (measured with --durations under pytest -n 2; most start `dpopt train` subprocesses or train on digits).
SLOW: tuple = (
    "training/test_resume.py::test_sigint_stops_cleanly_and_resume_completes",
    "training/test_resume.py::test_piped_output_is_plain_and_not_wrapped",
    "training/test_resume.py::test_sigterm_with_reproducible_noise_resumes_to_the_uninterrupted_parameters",
    "training/test_resume.py::test_clip_state_carries_over",
    "training/test_budget_stop.py::test_tracker_cache_and_bound",
    "training/test_budget_stop.py::test_cli_stops_at_the_last_step_within_budget",
    "training/test_mnist.py::test_dp_sgd_learns_mnist_in_a_few_steps",
    "training/test_validation_split.py::test_fraction_zero_reproduces_the_run_without_the_option",
    "diagnostics/test_diagnose_cli.py::test_cli_diagnose_writes_tables_and_figures",
    "core/test_secret_noise.py::test_cli_same_seed_differs_reproducible_identical_and_check_fails",
)

#: Under ``--dist loadgroup`` the tests of these tiers run one at a time on one worker: each
#: distributed test starts 2-4 gloo processes with collective timeouts, and two at once on two
#: cores would be eight processes fighting for them.
SERIAL_TIERS = ("distributed",)


def tiers_for(relpath: str) -> set:
    """The tier markers of a test at ``relpath`` (a node id relative to tests/, e.g. ``distributed/test_x.py::t``).

    >>> sorted(tiers_for("distributed/test_ddp_resume.py::test_resume"))
    ['distributed']
    """
    name = relpath.split("::")[0]
    out = {
        tier
        for prefix, tier in TIER_BY_PATH.items()
        if name.startswith(prefix) or name.rsplit("/", 1)[-1].startswith(prefix)
    }
    if any(relpath.startswith(prefix) for prefix in SLOW):
        out.add("slow")
    return out


def pytest_collection_modifyitems(config, items):
    """Add the tier markers of :func:`tiers_for` to every collected test under tests/."""
    root = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        path = os.path.abspath(str(item.path))
        if not path.startswith(root + os.sep):
            continue
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        nodeid = rel + item.nodeid[item.nodeid.index("::") :] if "::" in item.nodeid else rel
        for tier in sorted(tiers_for(nodeid)):
            item.add_marker(getattr(pytest.mark, tier))
            if tier in SERIAL_TIERS:
                item.add_marker(pytest.mark.xdist_group(tier))


@pytest.fixture
def float64():
    """Run the test with torch's default dtype set to float64 (restored afterwards)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture
def releases(monkeypatch):
    """Every ``Release`` that ``Privatizer.release`` returns in this test, in order (a list, appended to as the
    test runs; the method is wrapped through ``monkeypatch``, so it is restored after the test)."""
    from dpopt.privatizer import Privatizer

    out = []
    original = Privatizer.release

    def recorded(self, *a, **kw):
        rel = original(self, *a, **kw)
        out.append(rel)
        return rel

    monkeypatch.setattr(Privatizer, "release", recorded)
    return out


@pytest.fixture
def two_threads():
    """Run the test with two torch threads (the count before is restored afterwards)."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture
def held_noise_pool(monkeypatch):
    """``hold(source) -> (gate, busy)``: ``source``'s noise workers run on one thread of their own (the pool
    claims ``_pool_threads`` = 2), held by a task that waits for ``gate`` (a ``threading.Event``; ``busy`` its
    future): a draw's worker tasks queue behind it until the test sets the gate. Every gate is set and every pool
    shut down after the test."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    held = []

    def hold(source):
        pool, gate = ThreadPoolExecutor(1), threading.Event()
        monkeypatch.setattr(source, "_thread_pool", lambda: pool)
        monkeypatch.setattr(source, "_pool_threads", 2)
        held.append((pool, gate))
        return gate, pool.submit(gate.wait)

    yield hold
    for pool, gate in held:
        gate.set()
        pool.shutdown(wait=True)


@pytest.fixture(scope="session")
def leaky():
    """The deliberately leaky privatizers and ledger checks of ``tests/auditing/leaky.py`` (test-only module).

    Loaded from its file by ``importlib`` (no ``sys.path`` change) and registered once as
    ``sys.modules["leaky"]``, so every test sees the same classes.
    """
    import importlib.util
    import sys
    from pathlib import Path

    if "leaky" in sys.modules:
        return sys.modules["leaky"]
    spec = importlib.util.spec_from_file_location("leaky", Path(__file__).parent / "auditing" / "leaky.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["leaky"] = module
    spec.loader.exec_module(module)
    return module
