"""Every link in the README, the changelog and docs/ leads somewhere: the file exists and,
for a ``#section``, the heading does (GitHub's anchors). Moving text between them (the
README's reference went to docs/) must not leave a link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _prose(page: Path) -> list[str]:
    """The page's lines outside code fences."""
    out, fenced = [], False
    for line in page.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def anchors(page: Path) -> set[str]:
    return {anchor(line.lstrip("#")) for line in _prose(page) if re.match(r"^#{1,6} ", line)}


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def broken(page: Path) -> list[str]:
    bad = []
    for line in _prose(page):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, section = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists():
                bad.append(f"{target}: no such file")
            elif section and where.suffix == ".md" and section not in anchors(where):
                bad.append(f"{target}: no heading #{section} in {_shown(where)}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_somewhere(page: Path) -> None:
    assert not broken(page), f"{page.relative_to(ROOT)}: " + "; ".join(broken(page))


def test_the_check_catches_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# B\n\n## Some `code` here\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#some-code-here) [gone](c.md) [no](b.md#nothing) [self](#a)\n"
                    "[me](#missing)\n# A\n```\n[in a fence](nowhere.md)\n```\n")
    assert broken(page) == ["c.md: no such file", "b.md#nothing: no heading #nothing in b.md",
                            "#missing: no heading #missing in a.md"]
