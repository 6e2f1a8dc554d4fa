"""The guides under docs/: the MkDocs build is strict (no broken link or anchor), the command-line reference is the
parser's own help, and every code block runs here or is marked as illustrative.

Markers, on the line before a fence: ``<!-- illustrative -->`` (shown, not run), ``<!-- run -->`` (a bash block run
in a temporary directory), ``<!-- tested-by: tests/FILE.py::TEST -->`` (a test that does what the block shows).
Python blocks without a marker run as they are. Blocks without a language, or ``text``, are output or diagrams.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\S*)")
MARKER = re.compile(r"^<!--\s*(illustrative|run|tested-by:\s*(\S+))\s*-->$")


@dataclass
class Block:
    path: Path
    line: int
    language: str
    marker: str | None
    target: str | None
    code: str

    def __str__(self) -> str:
        shown = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{shown}:{self.line} ({self.language})"


def blocks(path: Path) -> list[Block]:
    found, lines, i = [], path.read_text().split("\n"), 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(previous)
        found.append(Block(path, i + 1, fence.group(1) or "text", marker and marker.group(1).split(":")[0],
                           marker and marker.group(2), "\n".join(lines[i + 1:end])))
        i = end + 1
    return found


def problems(docs: list[Path]) -> list[str]:
    """Code blocks that neither run nor say why not."""
    out = []
    for block in (b for path in docs for b in blocks(path)):
        if block.language in ("text", "console") or block.marker in ("illustrative", "run", "tested-by"):
            continue
        if block.language != "python":
            out.append(f"{block}: not run by a test: mark it <!-- illustrative -->, <!-- run --> or "
                       f"<!-- tested-by: TEST -->")
    return out


ALL_DOCS = sorted(DOCS.rglob("*.md"))


def test_every_code_block_runs_or_is_marked_illustrative():
    assert problems(ALL_DOCS) == []


def test_the_check_fails_on_an_unmarked_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n```bash\ntenplex demo\n```\n\n<!-- illustrative -->\n```bash\ntenplex demo\n```\n")
    assert problems([page]) == [f"{page}:3 (bash): not run by a test: mark it <!-- illustrative -->, <!-- run --> "
                                f"or <!-- tested-by: TEST -->"]


@pytest.mark.parametrize("block", [b for p in ALL_DOCS for b in blocks(p) if b.marker == "tested-by"], ids=str)
def test_tested_by_names_a_real_test(block):
    file, _, name = block.target.partition("::")
    tree = ast.parse((ROOT / file).read_text())
    assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, f"{block}: no {block.target}"


RUNNABLE = [b for p in ALL_DOCS for b in blocks(p) if (b.language == "python" and b.marker is None)
            or b.marker == "run"]


@pytest.mark.parametrize("block", RUNNABLE, ids=str)
def test_runnable_blocks_run(block, tmp_path):
    command = [sys.executable, "-c", block.code] if block.language == "python" else ["bash", "-euo", "pipefail",
                                                                                     "-c", block.code]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{block} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"


def test_mkdocs_build_is_strict_and_clean(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "site" / "guides" / "stores" / "index.html").exists()


def test_cli_reference_is_the_parsers_help():
    from tenplex.cli.reference import render

    assert (DOCS / "reference" / "cli.md").read_text() == render(), (
        "docs/reference/cli.md is stale: run python -m tenplex.cli.reference > docs/reference/cli.md")
