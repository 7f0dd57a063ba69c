"""The documentation stays navigable: every relative link in README.md and docs/**/*.md points to a file of
the repository (and, for a `#fragment` into a Markdown page, to one of its headings), every docs/ page that
code or tests name exists, and the README opens with its two commands."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _links(page: Path) -> list[str]:
    """Targets of the inline Markdown links of ``page``, outside fenced code blocks."""
    return _LINK.findall(_FENCE.sub("", page.read_text(encoding="utf-8")))


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of the headings of ``page``: lower case, punctuation dropped, spaces to hyphens."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_anchor_rule_matches_githubs():
    page = REPO_ROOT / "README.md"
    assert "on-a-robot-ros-2-jazzy-or-kilted-installed" in _anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):    # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or REPO_ROOT not in (file, *file.parents):
            broken.append(f"{target}: no such file in the repository")
        elif fragment and file.suffix == ".md" and fragment not in _anchors(file):
            broken.append(f"{target}: no heading with anchor #{fragment} in {file.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_docs_pages_named_in_code_and_tests_exist():
    named = set()
    for folder in ("oxygen_ros", "test", "scripts", "launch", "config"):
        for source in (REPO_ROOT / folder).rglob("*"):
            if source.is_file() and source.suffix in (".py", ".sh", ".yaml", ".cpp", ""):
                named.update(re.findall(r"docs/[\w./-]+\.md", source.read_text(encoding="utf-8", errors="replace")))
    missing = sorted(name for name in named if not (REPO_ROOT / name).exists())
    assert not missing, f"named in code or tests but not in the repository: {missing}"


def test_readme_opens_with_the_two_commands():
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    first_block = re.search(r"^```bash\n(.*?)^```", text, re.S | re.M).group(1).splitlines()
    assert [line.split("#")[0].strip() for line in first_block] == ["make demo", "make test"]
    assert text.index("```bash") < text.index("\n## ")
