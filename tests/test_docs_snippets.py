"""Every code block of README.md and docs/*.md runs as written (issue 39): a snippet that fails fails CI.

Each ```python and ```bash block is one test case (``file:line``), run in its own temporary directory:

* ```python — the block, after its ``setup`` (if any), in a fresh ``python`` process (this tree's ``src`` first
  on the path, one torch thread); it must exit 0 without a traceback.
* ```bash — every command (continuation lines joined, ``# comments`` dropped) must be a ``dpopt ...``
  command; each runs through the CLI (``typer``'s runner, in this process) and must exit 0. The block's
  ``args`` append tiny-data options to the commands they name (click keeps the last value of an option
  given twice, so ``--epochs 0.01`` after the documented ``--epochs 5`` shortens the run; nothing else of
  the command changes). ``{data}`` in ``args`` is the datasets folder (``../shared/data`` from the repository
  root, as in CI); without it those blocks are skipped, saying so.

A block is configured by one HTML comment right above its fence (invisible in the rendered page)::

    <!-- docs-test
    skip: why this block cannot run here (network install, torchrun, a GPU, Hugging Face downloads, ...)
    args: train --epochs 0.01 --data-dir {data}
    setup: python lines run first (in the block's folder), e.g. the `model` a fragment refers to
    -->

``setup:`` takes every following line up to the next key or the end of the comment. A ``skip`` must say
why (an empty reason fails). A bash block with a command other than ``dpopt`` must be skipped with a reason.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGS = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash", "console": "bash"}
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)
_DIRECTIVE = re.compile(r"<!--\s*docs-test\b(?P<body>.*?)-->", re.S)
_KEYS = ("skip", "args", "setup", "slow")


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    skip: str | None = None
    args: list = field(default_factory=list)
    setup: str = ""
    slow: bool = False

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _directive(before: str) -> dict:
    """The keys of the ``<!-- docs-test ... -->`` comment that ends right before a fence (``{}``: none)."""
    before = before.rstrip("\n")
    start = before.rfind("<!-- docs-test")
    match = _DIRECTIVE.match(before, start) if start >= 0 else None
    if match is None or match.end() != len(before):
        return {}
    out: dict = {}
    key = None
    for raw in match.group("body").splitlines():
        head, sep, rest = raw.partition(":")
        if sep and head.strip() in _KEYS and not raw.startswith(" "):
            key = head.strip()
            out.setdefault(key, []).append(rest.strip())
        elif key is not None and raw.startswith(" "):  # a continuation line of the key above
            out[key].append(raw if key == "setup" else raw.strip())
        elif raw.strip():
            raise ValueError(f"docs-test comment: unknown line {raw!r}; keys are {', '.join(_KEYS)}")
    return out


def _setup(lines: list) -> str:
    """The ``setup:`` code: its first line's rest, then the following lines dedented."""
    if not lines:
        return ""
    return (lines[0] + "\n" + textwrap.dedent("\n".join(lines[1:]))).strip("\n")


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in _FENCE.finditer(text):
            lang = LANGS.get(m.group("lang"))
            if lang is None:
                continue
            d = _directive(text[: m.start()])
            indent = len(m.group("indent"))
            code = "\n".join(line[indent:] for line in m.group("body").splitlines())
            found.append(
                Block(
                    path=path,
                    line=text[: m.start()].count("\n") + 1,
                    lang=lang,
                    code=code,
                    skip=" ".join(d["skip"]) if "skip" in d else None,
                    args=d.get("args", []),
                    setup=_setup(d.get("setup", [])),
                    slow="slow" in d,
                )
            )
    return found


BLOCKS = blocks()


def _params():
    for b in BLOCKS:
        marks = [pytest.mark.slow] if b.slow else []
        yield pytest.param(b, id=b.id, marks=marks)


def commands(code: str) -> list[list[str]]:
    """The shell commands of a bash block: continuations joined, comments and blank lines dropped."""
    out, pending = [], ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        words = shlex.split(pending + line, comments=True)
        pending = ""
        if words:
            out.append(words)
    return out


def _with_args(words: list[str], args: list[str]) -> list[str]:
    """``dpopt CMD ...`` + the ``args`` lines that name CMD (``{data}`` → the datasets folder)."""
    extra = []
    for line in args:
        name, _, rest = line.partition(" ")
        if len(words) > 1 and words[1] == name:
            extra += shlex.split(rest.replace("{data}", str(DATA)))
    return words[1:] + extra


def test_the_docs_have_blocks_and_every_skip_says_why():
    assert len(BLOCKS) >= 25, [b.id for b in BLOCKS]
    for b in BLOCKS:
        assert b.skip is None or len(b.skip) >= 10, f"{b.id}: a skip must say why"


def test_commands_parse_continuations_and_comments():
    code = "dpopt a --x 1 \\\n    --y '1.*'   # note\n\n# only a comment\ndpopt b"
    assert commands(code) == [["dpopt", "a", "--x", "1", "--y", "1.*"], ["dpopt", "b"]]
    assert _with_args(["dpopt", "train", "--epochs", "5"], ["train --epochs 0.01", "audit --trials 40"]) == [
        "train",
        "--epochs",
        "5",
        "--epochs",
        "0.01",
    ]


def _run_python(code: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("block", list(_params()))
def test_doc_block_runs_as_written(block: Block, tmp_path, monkeypatch):
    if block.skip is not None:
        pytest.skip(f"{block.id}: {block.skip}")
    for extra in ("transformers", "peft"):  # the optional [hf] extra: a block using it needs it installed
        if re.search(rf"\b{extra}\b", block.setup + block.code) and importlib.util.find_spec(extra) is None:
            pytest.skip(f"{block.id}: needs the optional {extra} package (pip install 'dpopt[hf]')")
    if any("{data}" in a for a in block.args) and not DATA.is_dir():
        pytest.skip(f"{block.id}: needs the datasets in {DATA} (as in CI)")
    if block.lang == "python":
        done = _run_python(block.setup + "\n" + block.code, tmp_path)
        assert done.returncode == 0 and "Traceback" not in done.stderr, f"{block.id}\n{done.stderr[-3000:]}"
        return
    cmds = commands(block.code)
    assert cmds, f"{block.id}: an empty bash block"
    others = [" ".join(c) for c in cmds if c[0] != "dpopt"]
    assert not others, f"{block.id}: not dpopt commands ({others}); run them here or add a skip with a reason"
    if block.setup:
        done = _run_python(block.setup, tmp_path)
        assert done.returncode == 0, f"{block.id} setup\n{done.stderr[-3000:]}"
    from typer.testing import CliRunner

    from dpopt.cli import app

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for words in cmds:
        argv = _with_args(words, block.args)
        res = runner.invoke(app, argv)
        assert res.exit_code == 0, f"{block.id}: dpopt {shlex.join(argv)}\n{res.output[-3000:]}"
        assert "Traceback" not in res.output
