"""Where the documentation lives, read the way its tests need it (README.md, docs/, mkdocs.yml)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def quickstart(page: Path = README) -> str:
    """The text of the first ```bash block under the page's "## Quickstart" heading."""
    text = page.read_text(encoding="utf-8")
    section = re.split(r"^## Quickstart[ \t]*$", text, maxsplit=1, flags=re.M)[1]
    section = re.split(r"^## ", section, maxsplit=1, flags=re.M)[0]
    block = re.search(r"^```bash[ \t]*\n(.*?)^```[ \t]*$", section, flags=re.S | re.M)
    assert block is not None, f"{page.name} has no bash block in its Quickstart"
    return block.group(1)


def nav_pages() -> list[str]:
    """Every page file named in mkdocs.yml's nav, in order (nested sections flattened)."""
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))

    def walk(entry: Any) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, list):
            return [page for item in entry for page in walk(item)]
        if isinstance(entry, dict):
            return [page for value in entry.values() for page in walk(value)]
        raise AssertionError(f"mkdocs.yml nav: unexpected entry {entry!r}")

    return walk(config["nav"])
