"""Strict reading of the project's JSON files: every problem is one line naming the field.

The scenario files of :mod:`wacc_ref.scenario` and the gate files of :mod:`wacc.gate.baseline`
are written by the tools themselves and read back; a person may edit them, and a file may come
from anywhere. Reading them goes through these helpers so that every file reader answers the
same way: a :class:`FieldError` whose message is ``"<field>: <problem>, got <value>"``, the field
a path such as ``steps[2].grads['w'][0]`` or ``entries['float32/sums/corpus'].max_ulps`` and the
value shown in at most :data:`SHOWN_CHARS` characters, never a traceback of ``float.fromhex``,
``int`` or ``json``.

The rules (the strict reading, each chosen so that a lenient one cannot hide a corrupt or
hand-edited file, while everything the tools write reads back):

* **Floats** are strings spelled exactly as :meth:`float.hex` writes them (``0x1.8000000000000p+1``,
  ``-0x0.0p+0``, ``inf``, ``-inf``, ``nan``): one spelling per value, so the value read is the value
  written, bit for bit. ``float.fromhex`` itself also reads ``"1.8p1"`` (no ``0x``: ``"0.125"``
  would silently read as 0.0715...), ``"0X1P+0"``, ``" 0x1p0 "``, ``"infinity"``, ``"-nan"``,
  hex digits beyond 53 bits (rounded) and exponents below the subnormal range (read as 0); all of
  those are refused, and the message says how the value they spell is written. A value beyond
  float64 (``0x1.0p+1024``) is refused instead of raising ``OverflowError``.
* **Integers** are JSON integers: ``true``/``false`` (Python's ``True == 1``) and ``1.0`` are
  refused, and so is an integer with more digits than Python converts (``int`` raises past
  4300): it is kept as a :class:`HugeInt` placeholder and refused where it stands, with its path.
* **Objects** have exactly the fields of their kind (missing and unknown fields are named), and no
  key twice: ``json`` keeps the last of two equal keys, which is how a merge conflict resolved by
  keeping both lines would silently change a baseline.
* **Strings** are JSON strings (no coercion); the values allowed are the reader's business.

The document as a whole (not UTF-8, not JSON, nested deeper than the interpreter's recursion
limit, not an object) is refused by :func:`loads` with :class:`FieldError` on the field
``(document)``.
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Iterable
from typing import Any

__all__ = [
    "DOCUMENT",
    "SHOWN_CHARS",
    "FieldError",
    "HugeInt",
    "check_free_json",
    "expect_bool",
    "expect_int",
    "expect_list",
    "expect_object",
    "expect_str",
    "field",
    "item",
    "loads",
    "parse_hex",
    "shown",
]

SHOWN_CHARS = 60  # a value shown in a message: enough to recognise it, short enough for one line
DOCUMENT = "(document)"  # the "field" of a problem with the whole document


class FieldError(ValueError):
    """A value that breaks the rules; ``str()`` is ``"<field>: <problem>"``, one line."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class HugeInt:
    """Stands for a JSON integer with more digits than ``int()`` converts (refused where used)."""

    def __init__(self, digits: str) -> None:
        self.digits = len(digits.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


class _Object(dict[str, Any]):
    """A JSON object that remembers the keys it had more than once."""

    duplicates: tuple[str, ...] = ()


_REPR = reprlib.Repr()
_REPR.maxstring = SHOWN_CHARS
_REPR.maxother = SHOWN_CHARS
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxdict = 4


def shown(value: object) -> str:
    """``repr(value)`` in at most :data:`SHOWN_CHARS` characters (any size, any depth)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * 60:
        # repr() itself refuses an int of more than 4300 digits; the size is what matters.
        digits = math.floor(value.bit_length() * math.log10(2))
        return f"<an integer of about {digits} digits>"
    try:
        text = _REPR.repr(value)
    except (ValueError, RecursionError):  # such an int, or a structure deeper than reprlib's guard
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def field(path: str, name: str) -> str:
    """The path of the fixed field ``name`` of the object at ``path`` (``steps[0].weight``)."""
    return f"{path}.{name}" if path else name


def item(path: str, key: int | str) -> str:
    """The path of list index or object key ``key`` under ``path`` (``grads['w']``, ``[3]``)."""
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}[{shown(key)}]"


def _parse_int(text: str) -> int | HugeInt:
    try:
        return int(text)
    except ValueError:  # more digits than int() converts: refused later, where its path is known
        return HugeInt(text)


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    result = _Object(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        repeated: list[str] = []
        for key, _ in pairs:
            if key in seen:
                repeated.append(key)
            seen.add(key)
        result.duplicates = tuple(repeated)
    return result


def loads(data: bytes | str) -> Any:
    """The JSON document in ``data`` (UTF-8 bytes or text); :class:`FieldError` on ``(document)``
    when it is not UTF-8, not JSON or nested too deeply."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise FieldError(DOCUMENT, f"not UTF-8 text: {exc}") from None
    try:
        return json.loads(text, parse_int=_parse_int, object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        raise FieldError(DOCUMENT, f"not JSON: {exc}") from None
    except RecursionError:
        raise FieldError(DOCUMENT, "nested too deeply to be read") from None


def expect_object(value: object, path: str, fields: Iterable[str] | None = None) -> dict[str, Any]:
    """``value`` as a JSON object; with ``fields``, exactly those (each problem named by path)."""
    if not isinstance(value, dict):
        raise FieldError(path or DOCUMENT, f"must be a JSON object, got {shown(value)}")
    duplicates = getattr(value, "duplicates", ())
    if duplicates:
        raise FieldError(item(path, duplicates[0]), "appears twice in the same object")
    for name in value:
        if not _unicode(name):
            raise FieldError(item(path, name), "the key must be Unicode text (a lone surrogate)")
    if fields is not None:
        expected = list(fields)
        for name in expected:
            if name not in value:
                raise FieldError(field(path, name), "missing")
        for name in value:
            if name not in expected:
                raise FieldError(
                    item(path, name), f"unknown field (expected {', '.join(expected)})"
                )
    return value


def expect_list(value: object, path: str) -> list[Any]:
    """``value`` as a JSON array."""
    if not isinstance(value, list):
        raise FieldError(path, f"must be a JSON array, got {shown(value)}")
    return value


def _unicode(text: str) -> bool:
    """Whether ``text`` is Unicode text: JSON's ``\\ud800`` escapes decode to lone surrogates,
    which no UTF-8 output (a terminal, a pipe, a summary file) can write."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def expect_str(value: object, path: str, *, choices: Iterable[str] | None = None) -> str:
    """``value`` as a JSON string of Unicode text (one of ``choices`` when given)."""
    if not isinstance(value, str):
        raise FieldError(path, f"must be a string, got {shown(value)}")
    if not _unicode(value):
        raise FieldError(path, f"must be Unicode text, got {shown(value)} (a lone surrogate)")
    if choices is not None:
        allowed = list(choices)
        if value not in allowed:
            listed = ", ".join(allowed[:6]) + (
                f", ... ({len(allowed)} in all)" * (len(allowed) > 6)
            )
            raise FieldError(path, f"must be one of {listed}, got {shown(value)}")
    return value


def expect_bool(value: object, path: str) -> bool:
    """``value`` as a JSON ``true``/``false`` (never 0/1)."""
    if not isinstance(value, bool):
        raise FieldError(path, f"must be true or false, got {shown(value)}")
    return value


def expect_int(
    value: object, path: str, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """``value`` as a JSON integer (never a bool, a float like ``1.0``, nor a :class:`HugeInt`)."""
    if type(value) is not int:
        raise FieldError(path, f"must be an integer, got {shown(value)}")
    if minimum is not None and value < minimum:
        raise FieldError(path, f"must be >= {minimum}, got {shown(value)}")
    if maximum is not None and value > maximum:
        raise FieldError(path, f"must be <= {maximum}, got {shown(value)}")
    return value


def parse_hex(value: object, path: str) -> float:
    """The float that ``value`` spells exactly as :meth:`float.hex` writes it (see the module
    docstring): NaN, infinities and -0.0 included; the caller restricts the range."""
    if not isinstance(value, str):
        raise FieldError(path, f"must be a float.hex string, got {shown(value)}")
    try:
        number = float.fromhex(value)
    except OverflowError:
        raise FieldError(path, f"{shown(value)} is beyond float64's range") from None
    except ValueError:
        raise FieldError(path, f"must be a float.hex string, got {shown(value)}") from None
    canonical = number.hex()
    if canonical != value:
        spelled = "nan" if math.isnan(number) else repr(number)
        raise FieldError(
            path,
            f"{shown(value)} is not spelled as float.hex writes it; the value it reads as, "
            f"{spelled}, is written {canonical!r}",
        )
    return number


def check_free_json(value: object, path: str) -> None:
    """A free-form JSON value (provenance): anything but a :class:`HugeInt` or a repeated key."""
    stack: list[tuple[str, object]] = [(path, value)]
    while stack:  # iterative: the document may be nested as deeply as json.loads allows
        where, current = stack.pop()
        if isinstance(current, HugeInt):
            raise FieldError(where, f"must be a JSON value Python reads, got {shown(current)}")
        if isinstance(current, dict):
            expect_object(current, where)
            stack.extend((item(where, k), v) for k, v in current.items())
        elif isinstance(current, list):
            stack.extend((item(where, i), v) for i, v in enumerate(current))
