"""Exact comparison of floats and arrays as float64 bit patterns, every NaN equal to every NaN.

``+0.0`` and ``-0.0`` differ; NaN sign and payload are not compared (positions are). Every oracle
of the suite compares values through these keys, so "identical" means one thing everywhere.
"""

from __future__ import annotations

import struct

import numpy as np

from wacc_ref.display import value_text

__all__ = [
    "CANONICAL_NAN_BITS",
    "array_differences",
    "array_key",
    "describe_array",
    "float_key",
]

# Every NaN is compared as this one pattern (float64 canonical quiet NaN).
CANONICAL_NAN_BITS = 0x7FF8000000000000


def float_key(value: float) -> int:
    """The float64 bit pattern of ``value``; every NaN maps to one pattern."""
    if value != value:
        return CANONICAL_NAN_BITS
    bits: int = struct.unpack("<Q", struct.pack("<d", value))[0]
    return bits


def array_key(array: np.ndarray) -> tuple[tuple[int, ...], bytes]:
    """Shape and float64 bit patterns of ``array``; every NaN maps to one pattern."""
    values = np.ascontiguousarray(array, dtype=np.float64)
    bits = values.view(np.uint64).copy()
    bits[np.isnan(values)] = np.uint64(CANONICAL_NAN_BITS)
    return tuple(values.shape), bits.tobytes()


def describe_array(array: np.ndarray) -> str:
    flat = np.asarray(array, dtype=np.float64).reshape(-1)
    return "[" + ", ".join(float(v).hex() for v in flat) + f"] shape {tuple(array.shape)}"


def array_differences(
    what: str, expected: np.ndarray, actual: np.ndarray, *, fmt: str = "float64"
) -> list[str]:
    """One line per element that differs bit for bit (NaN equal to NaN), values shown as
    :func:`wacc_ref.display.value_text` in ``fmt`` (the arrays' own format)."""
    if array_key(expected) == array_key(actual):
        return []
    if expected.shape != actual.shape:
        return [f"{what}: shape {tuple(expected.shape)} != {tuple(actual.shape)}"]
    exp_flat = expected.reshape(-1)
    act_flat = actual.reshape(-1)
    lines = []
    for position in range(exp_flat.size):
        e, a = float(exp_flat[position]), float(act_flat[position])
        if float_key(e) != float_key(a):
            lines.append(
                f"{what}[flat {position}]: expected {value_text(e, fmt)}, got {value_text(a, fmt)}"
            )
    return lines
