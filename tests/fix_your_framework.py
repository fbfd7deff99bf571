"""The "Fix your framework" pages' Python blocks, read and run as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tests.docs_support import DOCS

PAGES = DOCS / "fix-your-framework"


def blocks(page: str) -> list[str]:
    """The ```python blocks of ``page`` (a file name of docs/fix-your-framework/)."""
    text = (PAGES / page).read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def run_page(page: str, directory: Path) -> dict[str, Any]:
    """Run every Python block of ``page`` in order in one namespace, in ``directory`` (the
    caller's working directory: chdir there first); a traceback names the page."""
    namespace: dict[str, Any] = {"__name__": "__fix_your_framework__"}
    for block in blocks(page):
        exec(compile(block, str(PAGES / page), "exec"), namespace)
    return namespace
