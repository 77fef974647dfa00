"""The accounting commands import only what they need (issue 23): no torch, no matplotlib, no rich help
machinery, no training/engine code — checked in fresh interpreters (import rules, not timings; the time
is measured by benchmarks/calibrate_time.py)."""

import json
import subprocess
import sys

import pytest

FORBIDDEN = (
    "torch",
    "matplotlib",
    "typer.rich_utils",
    "rich.markdown",
    "dpopt.training",
    "dpopt.engine",
    "dpopt.privatizer",
    "dpopt.transforms",
)


def _modules_after(args: list[str], tmp_path) -> tuple[set, str]:
    code = (
        "import sys, json\nfrom dpopt.cli import app\n"
        f"try:\n    app({args!r}, standalone_mode=False)\nexcept SystemExit:\n    pass\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.stderr)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return set(json.loads(res.stderr.strip().splitlines()[-1])), res.stdout


def _run_dir(tmp_path):
    """A run directory written without torch: a 3-step ledger and its summary."""
    from dpopt.accounting.accountant import epsilon
    from dpopt.accounting.events import poisson_gaussian_step
    from dpopt.accounting.ledger import PrivacyLedger

    ledger = PrivacyLedger()
    for step in range(3):
        ledger.record(
            step,
            poisson_gaussian_step(1.0, 0.01),
            reads=1,
            releases=1,
            noise_multiplier=1.0,
            sensitivity=1.0,
            noise_std=1.0,
            max_grad_norm=1.0,
        )
    run = tmp_path / "run"
    run.mkdir()
    ledger.save(run / "ledger.json")
    (run / "summary.json").write_text(
        json.dumps(
            {
                "epsilon": epsilon(ledger, 1e-5, "rdp"),
                "delta": 1e-5,
                "accountant": "rdp",
                "noise_multiplier": 1.0,
                "sample_rate": 0.01,
                "steps": 3,
                "ledger_run_id": ledger.run_id,
            }
        )
    )
    return run


@pytest.mark.parametrize(
    "args",
    [
        ["account", "--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "100", "--json"],
        ["calibrate", "--target-epsilon", "4", "--sample-rate", "0.02", "--steps", "600", "--json"],
        ["--version"],
    ],
)
def test_accounting_commands_load_no_heavy_modules(args, tmp_path):
    loaded, out = _modules_after(args, tmp_path)
    assert out.strip(), "the command printed nothing"
    leaked = sorted(m for m in loaded for f in FORBIDDEN if m == f or m.startswith(f + "."))
    assert not leaked, f"dpopt {args[0]} imported {leaked}"


def test_ledger_and_check_load_no_heavy_modules(tmp_path):
    run = _run_dir(tmp_path)
    for command in ("ledger", "check"):
        loaded, out = _modules_after([command, str(run), "--json"], tmp_path)
        assert json.loads(out)  # it ran and printed its JSON
        leaked = sorted(m for m in loaded for f in FORBIDDEN if m == f or m.startswith(f + "."))
        assert not leaked, f"dpopt {command} imported {leaked}"


def test_help_still_loads_the_rich_help_and_is_wide(tmp_path):
    """The help machinery is imported only when help is shown — and then it is set to 100 columns."""
    code = (
        "import sys\nfrom dpopt.cli import app\n"
        "try:\n    app(['train', '--help'], standalone_mode=False)\nexcept SystemExit:\n    pass\n"
        "import typer.rich_utils as r\nprint('WIDTH', r.MAX_WIDTH, file=sys.stderr)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={k: v for k, v in __import__("os").environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")},
    )
    assert res.returncode == 0, res.stderr
    assert "WIDTH 100" in res.stderr and "--reproducible-noise" in res.stdout and "…" not in res.stdout
