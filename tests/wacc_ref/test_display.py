"""``wacc_ref.display``: the shortest decimal that names a value in its format, and its hex in
that format's width, both exact statements about the value."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wacc_ref import formats
from wacc_ref.display import hex_digits, shortest_decimal, shown_format, value_text


@pytest.mark.parametrize(
    ("fmt", "digits"), [("float64", 13), ("float32", 6), ("float16", 3), ("bfloat16", 2)]
)
def test_hex_digits_hold_the_fraction_bits(fmt: str, digits: int) -> None:
    """ceil((p - 1) / 4) hex digits: 52, 23, 10 and 7 fraction bits."""
    assert hex_digits(fmt) == digits


@pytest.mark.parametrize(
    ("value", "fmt", "text"),
    [
        (1.5, "bfloat16", "1.5 (0x1.80p+0)"),
        (-4.81482486096809e-35, "bfloat16", "-4.81e-35 (-0x1.00p-114)"),
        (65504.0, "float16", "65500.0 (0x1.ffcp+15)"),
        (2.0**-24, "float16", "6e-08 (0x1.000p-24)"),
        (30.0, "float64", "30.0 (0x1.e000000000000p+4)"),
        (0.1, "float64", "0.1 (0x1.999999999999ap-4)"),
        (float.fromhex("0x1.99999ap-4"), "float32", "0.1 (0x1.99999ap-4)"),
        (-0.0, "float32", "-0.0 (-0x0.000000p+0)"),
        (math.inf, "float16", "inf"),
        (-math.inf, "bfloat16", "-inf"),
    ],
)
def test_known_values(value: float, fmt: str, text: str) -> None:
    """Worked examples: the decimal is as short as the format allows (65504 reads 65500.0 in
    float16, where 65500 rounds to it), spelled as Python spells it; the hex has the format's
    digits."""
    assert value_text(value, fmt) == text


def test_nan_and_a_value_outside_the_format_are_shown_in_full() -> None:
    """NaN reads ``nan``; a value that is not one of the format's (a float32 value shown as
    bfloat16) keeps every digit of its hex and its full repr, never a rounded lie."""
    assert value_text(math.nan, "float32") == "nan"
    odd = float.fromhex("0x1.000002p+0")  # float32, not bfloat16
    assert value_text(odd, "bfloat16") == f"{odd!r} ({odd.hex()})"


def _values_of(fmt: str) -> st.SearchStrategy[float]:
    top = formats.get_format(fmt).max_finite
    return st.floats(-top, top, allow_nan=False).map(lambda x: formats.round_to(x, fmt))


@given(data=st.data(), fmt=st.sampled_from(formats.WORK_DTYPES))
def test_the_decimal_is_the_shortest_that_rounds_back_and_the_hex_is_exact(
    data: st.DataObject, fmt: str
) -> None:
    """For any value of a work dtype (subnormals included): the hex reads back to the value, the
    decimal rounds back to it in the format, and one digit fewer does not."""
    value = data.draw(_values_of(fmt))
    text = value_text(value, fmt)
    decimal, hexed = text.split(" (")
    assert float.fromhex(hexed.rstrip(")")) == value
    assert len(hexed.rstrip(")").split(".")[1].split("p")[0]) == hex_digits(fmt)
    assert decimal == shortest_decimal(value, fmt)
    if value != 0:
        assert formats.round_to(float(decimal), fmt) == value
        # significant digits written: no sign, exponent, point, leading or trailing zeros
        digits = len(decimal.lstrip("-").split("e")[0].replace(".", "").strip("0"))
        if digits > 1:
            assert formats.round_to(float(f"{value:.{digits - 1}g}"), fmt) != value


def test_shown_format_takes_the_first_work_dtype() -> None:
    """A record's dtype field holds whatever an implementation wrote: a work dtype is used,
    anything else falls through to the next, and float64 shows every value."""
    assert shown_format("bfloat16") == "bfloat16"
    assert shown_format(None, "float16") == "float16"
    assert shown_format("torch.float16", 3, None) == "float64"
