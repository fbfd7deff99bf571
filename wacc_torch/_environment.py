"""Floating-point environment checks: the semantics' gradual underflow on the CPU."""

from __future__ import annotations

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
