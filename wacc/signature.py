"""What makes two divergences one finding: their signature.

The same bug (a wrong division, say) fails in float32 and in bfloat16, in several families and
in many corpus scenarios, each time with other values, steps, sizes and parameter names. The
signature keeps what they share: the oracles that failed and the first failure line with every
number, hex float and quoted name replaced by ``#``. ``wacc check`` prints one block per
signature, ``wacc gate`` one group per signature (with counts and one replay command).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the judge is imported by the commands when they run (a fast --help)
    from wacc.verdict import ScenarioVerdict

__all__ = ["line_signature", "signature"]

# Quoted names first (parameters differ from one family to the next), then hex floats, inf/nan
# and decimal numbers (a leading sign included: -0.0 and +0.0 are one shape).
_VALUE = re.compile(r"'[^']*'|-?(?:0x[0-9a-f.]+p[+-]?\d+|inf|nan|\d+(?:\.\d+)?(?:e[+-]?\d+)?)")


def line_signature(line: str) -> str:
    """``line`` with every number, hex float and quoted name replaced by ``#``."""
    return _VALUE.sub("#", line)


def signature(verdict: ScenarioVerdict) -> str:
    """The oracles that failed and the shape of the first failure line."""
    lines = verdict.describe(limit=1)
    first = line_signature(lines[0] if lines else "")
    oracles = f"[{', '.join(verdict.failed_oracles)}]"
    if first.startswith(oracles):  # a step's line carries its oracles already
        return first
    return f"{oracles} {first}"
