"""Tests of wacc_ref.strict_json: the strict reading shared by the scenario and gate files."""

from __future__ import annotations

import math
import re
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wacc_ref.strict_json import (
    DOCUMENT,
    SHOWN_CHARS,
    FieldError,
    HugeInt,
    check_free_json,
    expect_int,
    expect_object,
    expect_str,
    loads,
    parse_hex,
    shown,
)


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


@given(st.floats())
def test_every_float_reads_back_from_what_float_hex_writes(value: float) -> None:
    """parse_hex(x.hex()) is x bit for bit (a NaN reads as a NaN): every float round-trips."""
    back = parse_hex(value.hex(), "f")
    assert math.isnan(back) if math.isnan(value) else _bits(back) == _bits(value), value.hex()


@pytest.mark.parametrize(
    "text", ["0x1p+0", "1.8p1", "0X1.8P+1", " 0x1.0000000000000p+0", "infinity", "-nan", "0.5"]
)
def test_other_spellings_are_refused_with_the_written_one(text: str) -> None:
    """A spelling float.fromhex reads but float.hex never writes raises FieldError naming the
    field and showing how the value it reads as is written."""
    with pytest.raises(FieldError, match=r"^f: .*is written '") as caught:
        parse_hex(text, "f")
    assert repr(float.fromhex(text).hex()) in str(caught.value)


def test_overflow_and_non_strings_are_field_errors() -> None:
    """Beyond float64, not hex, or not a string: FieldError, never OverflowError or TypeError."""
    for value in ("0x1.0p+1024", "-0x1p+1024", "0xzz", "", 1.5, None, ["0x0.0p+0"]):
        with pytest.raises(FieldError, match=r"^f: "):
            parse_hex(value, "f")


def test_ints_are_json_integers_only() -> None:
    """expect_int refuses true/false, 1.0 and a HugeInt; bounds are checked."""
    assert expect_int(3, "n", minimum=0, maximum=3) == 3
    for value in (True, False, 1.0, HugeInt("9" * 5000), "1", -1, 4):
        with pytest.raises(FieldError, match=r"^n: "):
            expect_int(value, "n", minimum=0, maximum=3)


def test_loads_keeps_what_json_would_lose_or_refuse() -> None:
    """A repeated key is remembered and refused by expect_object; an integer of 5000 digits is a
    HugeInt refused where it stands; not UTF-8, not JSON and too deep are document errors."""
    document = loads('{"a": 1, "a": 2, "b": ' + "9" * 5000 + "}")
    with pytest.raises(FieldError, match=r"^\['a'\]: appears twice"):
        expect_object(document, "")
    with pytest.raises(FieldError, match=r"^x\['b'\]: .*5000 digits"):
        check_free_json({"b": document["b"]}, "x")
    for data in (b"\xff{}", "{", "[" * 100_000 + "]" * 100_000):
        with pytest.raises(FieldError, match=rf"^{re.escape(DOCUMENT)}: "):
            loads(data)


def test_shown_is_short_for_any_value() -> None:
    """shown() stays within SHOWN_CHARS for huge ints (repr() itself refuses them), long strings
    and structures nested deeper than repr's recursion limit."""
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    for value in (10**5000, -(10**5000), "x" * 10**6, deep, {"k" * 100: list(range(1000))}):
        text = shown(value)
        assert len(text) <= SHOWN_CHARS and "\n" not in text, text
    assert "5000 digits" in shown(10**5000)


def test_a_lone_surrogate_is_refused_as_a_value_and_as_a_key() -> None:
    """JSON's ``\\ud800`` escape decodes to a lone surrogate, which no UTF-8 output can print:
    a string value or an object key holding one is a FieldError naming its path."""
    document = loads('{"name": "a\\ud800", "grads": {"\\udfff": 1}}')
    with pytest.raises(FieldError, match=r"^name: must be Unicode text"):
        expect_str(document["name"], "name")
    key_path = re.escape("grads['\\udfff']: the key must be Unicode text")
    with pytest.raises(FieldError, match=f"^{key_path}"):
        expect_object(document["grads"], "grads")
    assert expect_str(loads('"\\ud83d\\ude00"'), "ok") == "\U0001f600"  # a pair is text
