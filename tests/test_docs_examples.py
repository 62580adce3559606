"""Every ```python block of README.md and docs/*.md whose first line is ``# runnable``
is executed, so that the examples in the documentation keep working."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"^```python\n(# runnable\n.*?)^```", re.S | re.M)


def _blocks():
    for path in FILES:
        text = path.read_text(encoding="utf-8")
        for i, match in enumerate(BLOCK.finditer(text)):
            line = text[: match.start()].count("\n") + 1
            yield pytest.param(path, match.group(1), id=f"{path.relative_to(ROOT)}:{line}")


BLOCKS = list(_blocks())


def test_there_are_runnable_blocks():
    assert len(BLOCKS) >= 6


@pytest.mark.parametrize("path,code", BLOCKS)
def test_doc_block_runs(path, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{path.name} (runnable block)", "exec"), {"__name__": "__docs__"})
