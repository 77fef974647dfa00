"""``dpopt.cli.main``: the exit status of the command, and leaving a process group under torchrun.

* without a process group the status is the command's (0, 2 for bad input, 3 ...), through ``sys.exit``;
* with one (a 1-rank gloo group here, what :func:`dpopt.distributed.setup` joins under torchrun) the
  process leaves it (:func:`dpopt.distributed.leave`) and exits with ``os._exit`` — with the command's
  status, and with its printed output flushed first (os._exit drops unflushed buffers).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dpopt.distributed import leave


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout to a pipe: block-buffered
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, env=env
    )


def test_leave_without_a_group_is_a_no_op():
    assert leave() is False


@pytest.mark.parametrize("argv, status", [(["--version"], 0), (["train", "--no-such-flag"], 2)])
def test_status_without_a_process_group(argv, status):
    proc = subprocess.run([sys.executable, "-m", "dpopt", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == status, proc.stderr
    if status == 0:
        assert proc.stdout.startswith("dpopt ")


GROUP = """
    import os, sys, tempfile
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    sys.argv = ["dpopt"] + {argv!r}
    print("BEFORE")  # print() to a pipe is block-buffered: only main's flush writes it before os._exit
    from dpopt.cli import main
    main()
    print("NOT REACHED")
"""


def test_under_a_process_group_output_is_flushed_and_the_status_kept():
    proc = _run(GROUP.format(argv=["methods"]))
    assert proc.returncode == 0, proc.stderr
    assert "dp-macadam" in proc.stdout and "NOT REACHED" not in proc.stdout
    proc = _run(GROUP.format(argv=["train", "--no-such-flag"]))
    assert proc.returncode == 2 and "no-such-flag" in proc.stderr
    assert proc.stdout == "BEFORE\n"  # nothing else wrote to stdout: main flushed it before os._exit


def test_leave_destroys_the_group():
    proc = _run("""
        import tempfile
        import torch.distributed as dist
        from dpopt.distributed import leave
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        print(leave(), dist.is_initialized(), leave())
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False", "False"]
