"""The committed reproduction tables and the pages that quote them agree.

``docs/repro/NAME.md`` is what ``prunopt repro NAME`` writes (its claims table
is rebuilt here from ``NAME.json``); each paper's docs page and
``docs/reproductions.md`` quote its head -- the command, seeds and threads,
the verdict counts and the claims table -- verbatim, so that a regenerated
run cannot leave a stale table on a page. Relative links of the docs resolve.
"""
import json
import pathlib
import re

import pytest

from prunopt.repro.report import VERDICTS, Report

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: committed report -> the docs page whose reproduction section quotes it
PAGES = [("interspace", "interspace.md"), ("ds", "sparsification.md"), ("ap", "architecture_pruning.md"),
         ("prunadag", "prunadag.md"), ("prunadag_investigation", "prunadag.md")]


def head(name: str) -> str:
    """From the ``Command:`` line to the end of the claims table."""
    text = (DOCS / "repro" / f"{name}.md").read_text(encoding="utf-8")
    start = text.index("Command: ")
    end = text.find("\n## ", start)
    return text[start:end if end >= 0 else len(text)].strip()


def section(page: str, heading_start: str) -> str:
    """The text of the ``## `` section of ``page`` whose heading starts with ``heading_start``."""
    text = (DOCS / page).read_text(encoding="utf-8")
    m = re.search(rf"^## {re.escape(heading_start)}.*?(?=^## |\Z)", text, re.S | re.M)
    assert m, f"{page} has no section '## {heading_start}...'"
    return m.group(0)


@pytest.mark.parametrize("name,page", PAGES)
def test_committed_table_matches_its_json(name, page):
    report = json.loads((DOCS / "repro" / f"{name}.json").read_text(encoding="utf-8"))
    rep = Report(name, report["title"], report["command"], report["seeds"], report["threads"])
    for c in report["claims"]:
        rep.claim(c["claim"], c["paper"], c["prunopt"], c["verdict"], c["note"])
    block = head(name)
    assert rep.claims_markdown() in block
    assert block.startswith(f"Command: `{report['command']}`")
    counts = rep.verdict_counts()
    assert counts == report["verdicts"]
    assert "Verdicts: " + ", ".join(f"{counts[v]} {v}" for v in VERDICTS) in block


@pytest.mark.parametrize("name,page", PAGES)
def test_pages_quote_the_committed_table(name, page):
    block = head(name)
    assert block in section(page, "Reproduction"), f"docs/{page}'s reproduction section does not quote repro/{name}.md"
    assert block in (DOCS / "reproductions.md").read_text(encoding="utf-8")


def test_compare_table_is_quoted():
    text = (DOCS / "repro" / "compare_snip.md").read_text(encoding="utf-8")
    table = text[text.index("| target p |"):].strip()
    for page in ("reproductions.md", "pruning.md", "interspace.md"):
        assert table in (DOCS / page).read_text(encoding="utf-8"), page


def test_relative_links_resolve():
    broken = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((DOCS / "repro").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_overall_verdicts_table():
    """docs/reproductions.md opens with every report's verdict counts and their sum."""
    text = section("reproductions.md", "Overall verdicts")
    total = {v: 0 for v in VERDICTS}
    for name in dict.fromkeys(n for n, _ in PAGES):
        verdicts = json.loads((DOCS / "repro" / f"{name}.json").read_text(encoding="utf-8"))["verdicts"]
        rows = [line for line in text.splitlines() if f"(repro/{name}.md)" in line]
        assert len(rows) == 1, name
        assert [c.strip() for c in rows[0].strip("|").split("|")][-3:] == [str(verdicts[v]) for v in VERDICTS]
        for v in VERDICTS:
            total[v] += verdicts[v]
    assert f"| all | | {total['reproduced']} | {total['qualitatively']} | {total['not reproduced']} |" in text
