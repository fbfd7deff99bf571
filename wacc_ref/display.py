"""Values as a person reads them: the shortest decimal that names the value in its format, with
the exact hex beside it in that format's width.

A failure line that says ``expected -0x1.0000000000000p-114, got -0x0.0p+0`` for a bfloat16
gradient makes the reader decode float64 hex of a value that has 8 significant bits. Here the
same value reads ``-4.81e-35 (-0x1.00p-114)``: the decimal is the shortest one that rounds
back to the value in the format (so two different values never print alike), the hex has
exactly the digits the format's significand needs (``ceil((p - 1) / 4)``), and both are exact
statements about the value, computed with :func:`wacc_ref.formats.round_to` (no numpy dtype,
no global precision).
"""

from __future__ import annotations

import math

from wacc_ref import formats

__all__ = ["hex_digits", "shortest_decimal", "shown_format", "value_text"]


def hex_digits(fmt: str | formats.Format) -> int:
    """Hex digits after the point that hold the format's fraction bits (``p - 1``)."""
    return -(-(formats.get_format(fmt).precision - 1) // 4)


def _hex(value: float, digits: int) -> str:
    """``float.hex`` with ``digits`` fraction digits: exact for a value of the format (its
    fraction has at most ``p - 1`` bits, so only zeros are dropped or added)."""
    text = value.hex()  # "[-]0x1.<13 digits>p<exp>" or "[-]0x0.0p+0"
    head, exponent = text.split("p")
    whole, fraction = head.split(".")
    if fraction[digits:].strip("0"):  # not a value of the format: show every digit
        return text
    return f"{whole}.{fraction[:digits].ljust(digits, '0')}p{exponent}"


def shortest_decimal(value: float, fmt: str | formats.Format) -> str:
    """The decimal with the fewest significant digits that rounds back to ``value`` in ``fmt``,
    spelled as Python spells that decimal (``repr``); ``value`` itself in full when it is not a
    value of ``fmt``."""
    if not math.isfinite(value) or value == 0:
        return repr(value)
    for digits in range(1, 18):
        decimal = float(f"{value:.{digits}g}")
        try:
            if formats.round_to(decimal, fmt) == value:
                return repr(decimal)  # Python's own spelling: 30.0, 0.0003662, -4.81e-35
        except formats.FormatError:
            break
    return repr(value)


def value_text(value: float, fmt: str | formats.Format = "float64") -> str:
    """``value`` as ``<shortest decimal> (<hex in the format's width>)``; ``inf``, ``-inf`` and
    ``nan`` as such."""
    if not math.isfinite(value):
        return repr(value)
    return f"{shortest_decimal(value, fmt)} ({_hex(value, hex_digits(fmt))})"


def shown_format(*dtypes: object) -> str:
    """The format to show values in: the first of ``dtypes`` that is a work dtype (a record's
    dtype field holds whatever an implementation wrote), else float64 (every value fits)."""
    return next((str(d) for d in dtypes if d in formats.WORK_DTYPES), "float64")
