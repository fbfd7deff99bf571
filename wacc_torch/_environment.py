"""Floating-point environment checks: the semantics' gradual underflow on the CPU."""

from __future__ import annotations

import struct
import sys

from wacc_torch.errors import UnsupportedEnvironmentError

__all__ = ["check_gradual_underflow"]


def denormals_flushed() -> bool:
    """Whether this thread's FPU flushes subnormals (FTZ) or reads them as zero (DAZ).

    ``torch.set_flush_denormal(True)`` sets both bits for the calling thread (x86 MXCSR, ARM
    FPCR), which is also the thread that runs CPU kernels on small tensors; Python's own float
    arithmetic runs on the same unit, so two multiplications tell (about 100 ns, no tensor).
    """
    # FTZ: min_normal * 0.5 gives 0 instead of a subnormal; DAZ: that subnormal, read back as an
    # operand, is 0, so doubling it does not give min_normal back.
    half = sys.float_info.min * 0.5
    return half == 0.0 or half * 2.0 != sys.float_info.min


def check_gradual_underflow(operation: str) -> None:
    """Refuse a CPU computation while subnormals are flushed (semantics §2 rounds with gradual
    underflow; FTZ/DAZ would silently give other bits), naming ``operation``."""
    if denormals_flushed():
        raise UnsupportedEnvironmentError(
            f"{operation}: the CPU flushes subnormals to zero (flush-to-zero / denormals-are-zero "
            f"is on, e.g. torch.set_flush_denormal(True)); §2 rounds with gradual underflow, "
            f"so CPU results would differ. Call torch.set_flush_denormal(False) first."
        )


def is_subnormal(value: float) -> bool:
    """Whether ``value`` is a nonzero float64 subnormal, read from its bits: under
    denormals-are-zero the CPU's own comparisons see such a value as 0."""
    bits = struct.unpack("<Q", struct.pack("<d", value))[0]
    return (bits >> 52) & 0x7FF == 0 and bits & ((1 << 52) - 1) != 0


def check_readable(value: int | float, what: str) -> None:
    """Refuse a subnormal ``value`` while subnormals are flushed: its comparisons with 0 would be
    wrong (a weight of 5e-324 would silently count as a zero-weight batch), naming ``what``."""
    if isinstance(value, float) and is_subnormal(value):
        # Written from the bits: repr() itself would print 0.0 under flush-to-zero.
        bits = struct.unpack("<Q", struct.pack("<d", value))[0]
        sign = "-" if bits >> 63 else ""
        shown = f"{sign}0x0.{bits & ((1 << 52) - 1):013x}p-1022"
        check_gradual_underflow(f"{what} {shown} is subnormal")
