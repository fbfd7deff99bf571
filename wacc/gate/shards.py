"""A shard of the gate's work, ``K/N``: parsed without importing the judge, so a bad ``--shard``
answers at once."""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass

__all__ = ["Shard"]

_SHOWN_CHARS = 60  # wacc_ref.strict_json.SHOWN_CHARS, checked by tests/wacc/test_gate_compare.py
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _SHOWN_CHARS


def shown(value: object) -> str:
    """``value`` as :func:`wacc_ref.strict_json.shown` shows it; a string (the command line's
    case) without importing the reference, which a fast answer to a typo cannot afford."""
    if not isinstance(value, str):
        from wacc_ref.strict_json import shown as shown_any

        return shown_any(value)
    text = _REPR.repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


_SHARD = re.compile(r"([1-9][0-9]{0,8})/([1-9][0-9]{0,8})")


@dataclass(frozen=True, order=True)
class Shard:
    """Shard ``index`` (1-based) of ``count``."""

    index: int = 1
    count: int = 1

    @classmethod
    def parse(cls, text: object) -> Shard:
        """``"K/N"`` with ``1 <= K <= N``; ``ValueError`` naming the text otherwise.

        Only the spelling :meth:`__str__` writes: ASCII digits without sign, space or leading
        zero (``int()`` would also take ``"+1"``, ``" 1"`` and ``"١"``), at most 9 of them.
        """
        match = _SHARD.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(
                "must be K/N with 1 <= K <= N (decimal digits, no sign, space or leading zero), "
                f"got {shown(text)}"
            )
        index, count = int(match[1]), int(match[2])
        if not index <= count:
            raise ValueError(f"K/N needs 1 <= K <= N, got {shown(text)}")
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def takes(self, position: int) -> bool:
        """Whether unit ``position`` of the ordered unit list is in this shard."""
        return position % self.count == self.index - 1
