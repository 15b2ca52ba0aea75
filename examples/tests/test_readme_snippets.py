"""Every fenced ``python`` block of the READMEs runs as written.

The blocks of one README run in order in one fresh interpreter and share their names, as a
reader's session would: the top-level README's "Use" section starts with a block that defines
``model``, ``loss_fn``, ``loader`` and ``optimizer`` for the blocks after it. Blocks fenced as
anything else (``bash``, ``text``) are not run. A failure's traceback names the README and the
line of the failing statement.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
RUNNER = """\
import json, sys
path, blocks = sys.argv[1], json.load(sys.stdin)
names = {"__name__": "__readme__"}
for line, code in blocks:
    exec(compile("\\n" * (line - 1) + code, path, "exec"), names)
"""


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line, code)`` of each fenced python block of a Markdown text (lines from 1)."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def _readmes() -> list[str]:
    paths = [ROOT / "README.md", *sorted(ROOT.glob("examples/**/README.md"))]
    paths += sorted(ROOT.glob("packages/*/README.md"))
    return [str(p.relative_to(ROOT)) for p in paths if python_blocks(p.read_text())]


def test_python_blocks_are_found_with_their_lines():
    text = "# t\n\n```python\nx = 1\n```\n\n```bash\nls\n```\n```python\ny = x\n```\n"
    assert python_blocks(text) == [(4, "x = 1\n"), (11, "y = x\n")]


def test_the_main_readme_has_snippets():
    assert "README.md" in _readmes()


@pytest.mark.parametrize("readme", _readmes())
def test_readme_python_blocks_run(readme: str, tmp_path: Path) -> None:
    path = ROOT / readme
    blocks = python_blocks(path.read_text())
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(path)],
        input=json.dumps(blocks),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, f"a python block of {readme} failed:\n{proc.stderr[-4000:]}"
