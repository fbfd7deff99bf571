"""The documentation holds together without MkDocs installed: every page of mkdocs.yml's nav
exists and every page of docs/ is in it; every relative link of README.md and of docs/*.md
names a file that is there (and, with an anchor, a heading of that page). CI's
``mkdocs build --strict`` checks the pages again as MkDocs renders them."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from tests.docs_support import DOCS, README, ROOT, nav_pages

PAGES = sorted(DOCS.rglob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (MkDocs' default) gives a heading."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M)}


def _broken_links(page: Path, inside: Path) -> list[str]:
    """The relative links of ``page`` whose file is missing or lies outside ``inside``, or
    whose anchor names no heading of the Markdown page it points to."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    broken = []
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page.resolve()
        if not where.is_relative_to(inside.resolve()) or not where.exists():
            broken.append(target)
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            broken.append(target)
    return broken


def test_every_nav_page_exists_and_every_page_is_in_the_nav() -> None:
    """mkdocs.yml's nav names only pages of docs/, each once, and every page of docs/."""
    nav = nav_pages()
    assert len(nav) == len(set(nav))
    assert sorted(nav) == [page.relative_to(DOCS).as_posix() for page in PAGES]
    assert nav[:5] == ["index.md", "gate.md", "check.md", "loss-scaling.md", "audit-your-loop.md"]


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    """A link of the README names a file of the repository; a link of a docs page a file of
    docs/ (what the site can serve); an anchor names a heading of its page."""
    assert "../shared" not in page.read_text(encoding="utf-8")
    assert _broken_links(page, ROOT if page == README else DOCS) == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    """The link check is not vacuous: a missing file, a file outside the folder, and an anchor
    that no heading makes are each reported; a good link and an external one are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Two `words`\n", encoding="utf-8")
    (tmp_path / "outside.md").write_text("# Out\n", encoding="utf-8")
    page = tmp_path / "docs" / "b.md"
    page.write_text(
        "[ok](a.md#two-words) [web](https://example.org/x.md) [gone](c.md) "
        "[out](../outside.md) [anchor](a.md#three) ![img](a.md)\n"
        "```bash\n[in a block](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    assert _broken_links(page, tmp_path / "docs") == ["c.md", "../outside.md", "a.md#three"]
