"""A locale whose default text encoding is ASCII, for the duration of a ``with``: a writer that
leaves its file's encoding to the locale fails there on any non-ASCII character, as it would
write another encoding on a machine whose locale is not UTF-8 (Windows' cp1252, a ``C`` locale
without Python's UTF-8 coercion). The files wacc writes are UTF-8 on every machine."""

from __future__ import annotations

import locale
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

__all__ = ["ascii_locale"]


@contextmanager
def ascii_locale() -> Iterator[None]:
    """``LC_CTYPE`` set to ``C`` (ASCII) inside, restored after; a skip where Python's UTF-8 mode
    makes the locale irrelevant."""
    if sys.flags.utf8_mode:
        pytest.skip("Python's UTF-8 mode: the locale does not choose the encoding")
    before = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        if locale.getencoding().lower().replace("-", "") == "utf8":
            pytest.skip("the C locale is UTF-8 here")
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, before)
